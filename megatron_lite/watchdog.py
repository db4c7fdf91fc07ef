"""A watchdog on every rank: a hung rank is found in seconds, named, and the job ends with a
status the supervisor restarts on. Also the straggler report and the fault injection that
tests and benchmarks use.

[Note: hang watchdog]
Each rank runs a thread that, every ``--heartbeat-interval`` seconds, publishes a record to
the job's rendezvous store (a connection of its own, so nothing it does waits on a
collective or on the training thread): a beat counter, the iteration, the section it is in
(a checkpoint save or load), the seconds since its training thread last made progress (an
iteration boundary, or a collective issued or finished: ``zeropp.comm.flight_recorder``),
and the collective it is in. Its timeout at that moment comes with it:

- in a checkpoint save or load: ``--hang-checkpoint-timeout`` (or k times the longest one
  seen, if longer);
- in the first ``--hang-startup-iterations`` iterations (kernel compiles, communicators
  warming up): ``--hang-startup-timeout``;
- otherwise ``max(--hang-timeout, k x the longest iteration seen)``, k being
  ``--hang-timeout-factor``.

Two judges (the first and the last rank) read every record. A rank is hung when its beat
has not changed for longer than ``--hang-timeout`` (the thread beats on through saves,
loads and compiles: silence is a stopped or dead process, SIGSTOP, a host that froze), or when every rank has been stalled past its own timeout (a GPU stuck in a kernel,
a NIC that stopped delivering): then the ranks that are behind (the lowest iteration and
collective sequence number) are the ones the others wait for. A slow rank that still
progresses is never hung: its waiting peers are stalled, it is not; and a save within its
budget holds its peers' verdict back the same way.

The verdict goes to the store; every rank that can still run reads it within one beat,
writes its flight recorder next to the checkpoints, notes the hang for the supervisor
(``megatron_lite.supervise``) and exits with ``HANG_STATUS``. A judge also SIGKILLs a hung
rank that runs on its own host: a stopped process takes no SIGTERM, and the launcher's
teardown would otherwise wait its grace period (30 s for torchrun) on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_lite.arguments_model import ArgumentError
from megatron_lite.supervise import note_hang
from zeropp.comm import flight_recorder
from zeropp.comm.flight_recorder import (
    DUMP_PATTERN,
    FlightRecorder,
    divergence,
    dump_name,
    read_dumps,
)

HANG_STATUS = 75  # EX_TEMPFAIL: the supervisor restarts on it (any status but a usage error)
FAULT_ENV = "ZEROPP_FAULT"  # "RANK:ITERATION:KIND[:SECONDS[:COUNT]]", ';'-separated (Fault)
FAULT_KINDS = ("kill", "stop", "sleep", "slowsave")
ATTEMPT_ENV = "ZEROPP_SUPERVISE_ATTEMPT"  # set by the supervisor: 0 for the first run
JUDGES_NOTE = "the first and the last rank"


@dataclass(frozen=True)
class WatchdogConfig:
    """The watchdog's flags (``--hang-*``, ``--heartbeat-interval``); seconds throughout."""

    watchdog: bool = True
    hang_timeout: float = 10.0  # the timeout's floor once the first iterations are done
    hang_timeout_factor: float = 10.0  # k: the timeout is at least k x the longest iteration
    hang_startup_timeout: float = 300.0
    hang_startup_iterations: int = 2
    hang_checkpoint_timeout: float = 600.0
    heartbeat_interval: float = 1.0
    flight_recorder_size: int = 2048
    save: str | None = None  # where the flight recorder dumps go (next to the checkpoints)

    @property
    def floor(self) -> float:
        """The shortest hang timeout accepted: three heartbeats, and never under 2 s (a beat
        delayed by the host must not read as a hang)."""
        return max(2.0, 3 * self.heartbeat_interval)

    @classmethod
    def from_arguments(cls, arguments: dict[str, Any]) -> WatchdogConfig | None:
        """From the run's arguments as plain values; None where they carry no watchdog
        flags (a run control built by hand)."""
        if "watchdog" not in arguments:
            return None
        config = cls(**{f.name: arguments[f.name] for f in fields(cls) if f.name in arguments})
        config.validate()
        return config

    def validate(self) -> None:
        for name in ("hang_timeout", "hang_startup_timeout", "hang_checkpoint_timeout",
                     "heartbeat_interval"):
            value = getattr(self, name)
            if not value > 0:
                raise ArgumentError(f"--{name.replace('_', '-')} must be a positive number of "
                                    f"seconds, got {value:g}")
        if self.hang_timeout < self.floor:
            raise ArgumentError(
                f"--hang-timeout {self.hang_timeout:g} is below the floor of {self.floor:g} s "
                f"(three heartbeats of --heartbeat-interval {self.heartbeat_interval:g}): "
                "a delayed beat would read as a hang")
        for name in ("hang_startup_timeout", "hang_checkpoint_timeout"):
            if getattr(self, name) < self.hang_timeout:
                raise ArgumentError(f"--{name.replace('_', '-')} {getattr(self, name):g} is "
                                    f"below --hang-timeout {self.hang_timeout:g}")
        if self.hang_timeout_factor < 1:
            raise ArgumentError(f"--hang-timeout-factor must be at least 1, got "
                                f"{self.hang_timeout_factor:g}")
        if self.hang_startup_iterations < 0:
            raise ArgumentError(f"--hang-startup-iterations must be at least 0, got "
                                f"{self.hang_startup_iterations}")
        if self.flight_recorder_size < 1:
            raise ArgumentError(f"--flight-recorder-size must be at least 1, got "
                                f"{self.flight_recorder_size}")


@dataclass(frozen=True)
class Fault:
    """An injected fault (``ZEROPP_FAULT``): ``kill`` (SIGKILL) or ``stop`` (SIGSTOP) this
    rank after iteration ``iteration`` (its log line, evaluation and save done); ``sleep``
    ``seconds`` in the step of ``count`` iterations from it; ``slowsave``: ``seconds`` more
    in the checkpoint save of that iteration."""

    rank: int
    iteration: int
    kind: str
    seconds: float = 0.0
    count: int = 1

    @classmethod
    def parse_all(cls, text: str) -> list[Fault]:
        faults = []
        for spec in filter(None, (s.strip() for s in text.split(";"))):
            parts = spec.split(":")
            try:
                if len(parts) < 3 or parts[2] not in FAULT_KINDS:
                    raise ValueError
                fault = cls(int(parts[0]), int(parts[1]), parts[2],
                            float(parts[3]) if len(parts) > 3 else 0.0,
                            int(parts[4]) if len(parts) > 4 else 1)
            except ValueError:
                raise ArgumentError(f"{FAULT_ENV}={spec!r}: expected RANK:ITERATION:"
                                    f"{'|'.join(FAULT_KINDS)}[:SECONDS[:COUNT]]") from None
            faults.append(fault)
        return faults


def injected_faults(rank: int) -> list[Fault]:
    """This rank's faults from ``ZEROPP_FAULT``, on the first run of a supervised job only
    (a relaunch passes the same iterations again)."""
    if os.environ.get(ATTEMPT_ENV, "0") != "0":
        return []
    return [f for f in Fault.parse_all(os.environ.get(FAULT_ENV, "")) if f.rank == rank]


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _store_of_own(generation: int) -> dist.Store:
    """The job's rendezvous store, through a connection of its own where it is a TCPStore
    (the training thread's store calls never wait behind the watchdog's, nor the reverse)."""
    store = dist.distributed_c10d._get_default_store()
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        with contextlib.suppress(Exception):  # the shared connection still works
            store = dist.TCPStore(base.host, base.port, is_master=False,
                                  timeout=timedelta(seconds=30), wait_for_workers=False)
    return dist.PrefixStore(f"zeropp-watchdog/{generation}/", store)


class Watchdog:
    """One rank's watchdog ([Note: hang watchdog]), its flight recorder and its step clock.

    The training thread calls ``step_started`` / ``step_finished`` around each iteration's
    step, ``section`` around a checkpoint save or load, and ``stragglers`` at log
    iterations; ``start`` and ``stop`` bracket training. Without ``start`` every call is
    cheap bookkeeping and nothing runs in the background.
    """

    _generation = 0  # watchdogs started in this process: the store prefix every rank agrees on

    def __init__(self, config: WatchdogConfig, log: Callable[[str], None] = _stderr,
                 exit_process: Callable[[int], None] = os._exit) -> None:
        self.config = config
        self.log = log
        self.exit_process = exit_process
        self.recorder = FlightRecorder(config.flight_recorder_size)
        self.rank, self.world_size = 0, 1
        self.faults: list[Fault] = []
        self.iteration = 0
        self.section_name: str | None = None
        self._section_budget = 0.0
        self._last_mark = time.monotonic()
        self._steps_timed = 0
        self._step_started_at: float | None = None
        self._blocked_at_step_start = 0.0
        self.longest_step = 0.0
        self.longest_checkpoint = 0.0
        self._busy_seconds = 0.0  # this rank's step time not spent waiting for collectives
        self._busy_steps = 0
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._peers_apart = True  # the ranks are processes of their own (not simulated)
        self._store: dist.Store | None = None
        self.verdict: str | None = None
        # Set on the judge that published the verdict: (silent ranks, their records).
        self._silent_to_kill: tuple[list[int], dict[int, dict]] | None = None

    # ---- lifetime --------------------------------------------------------------------------

    def start(self) -> None:
        """Install the flight recorder and, where the job has a store, start the heartbeat."""
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.faults = injected_faults(self.rank)
        flight_recorder.install(self.recorder)
        self._last_mark = time.monotonic()
        if not self.config.watchdog:
            return
        try:
            if self.world_size > 1:
                Watchdog._generation += 1
                self._store = _store_of_own(Watchdog._generation)
            else:  # one rank: its own stalls are still caught (a kernel that never returns)
                self._store = dist.HashStore()
            self._publish(beat=0)
        except RuntimeError as error:
            # A store that cannot carry heartbeats: the simulated cluster's (one process
            # playing one rank of many) says so quietly; a real job's says it in one line.
            self._store = None
            self._peers_apart = False  # one process playing many: nothing to compare
            if dist.get_backend() in ("gloo", "nccl"):
                self.log(f"watchdog: off, the job's store does not carry heartbeats ({error})")
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="zeropp-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping.set()
            self._thread.join(timeout=10 * self.config.heartbeat_interval)
            self._thread = None
        if flight_recorder.installed() is self.recorder:
            flight_recorder.install(None)

    # ---- the training thread's marks ---------------------------------------------------------

    def step_started(self, iteration: int) -> None:
        """Before iteration ``iteration``'s step (everything of the previous one is done)."""
        now = time.monotonic()
        self._last_mark = now
        self._step_started_at = now  # an injected sleep is the step's, as a slow step's is
        self._blocked_at_step_start = self.recorder.blocked_seconds
        for fault in self.faults:
            self._inject(fault, iteration)

    def step_finished(self, iteration: int) -> None:
        now = time.monotonic()
        self.iteration = iteration
        self._last_mark = now
        if self._step_started_at is None:
            return
        seconds = now - self._step_started_at
        blocked = self.recorder.blocked_seconds - self._blocked_at_step_start
        self._busy_seconds += max(seconds - max(blocked, 0.0), 0.0)
        self._busy_steps += 1
        self._steps_timed += 1
        if self._steps_timed > self.config.hang_startup_iterations:
            self.longest_step = max(self.longest_step, seconds)
        self._step_started_at = None

    def progress(self) -> None:
        """Progress outside a step (an evaluation batch): units that stay gathered, or one
        rank alone, issue no collective that would show it."""
        self._last_mark = time.monotonic()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A checkpoint save or load: its own, longer budget ([Note: hang watchdog])."""
        outer = self.section_name
        started = time.monotonic()
        self._section_budget = max(self.config.hang_checkpoint_timeout,
                                   self.config.hang_timeout_factor * self.longest_checkpoint)
        self.section_name = name
        self._last_mark = started
        try:
            if name == "save":
                for fault in self.faults:
                    self._inject(fault, self.iteration, saving=True)
            yield
        finally:
            now = time.monotonic()
            self.longest_checkpoint = max(self.longest_checkpoint, now - started)
            self.section_name = outer
            self._last_mark = now

    def timeout(self) -> float:
        """The hang timeout of where this rank is now (for its progress; its heartbeat's is
        ``--hang-timeout`` wherever it is: the thread beats on through saves and compiles)."""
        config = self.config
        if self.section_name is not None:
            return self._section_budget
        if self._steps_timed <= config.hang_startup_iterations:
            # Up to the end of the first step that counts: no iteration measured before it.
            return config.hang_startup_timeout
        return max(config.hang_timeout, config.hang_timeout_factor * self.longest_step)

    def stalled_seconds(self) -> float:
        """Seconds since the training thread last made progress."""
        return time.monotonic() - max(self._last_mark, self.recorder.last_activity)

    # ---- straggler report --------------------------------------------------------------------

    def stragglers(self, device: torch.device) -> dict[str, float | int] | None:
        """The slowest rank of the log interval by its own step time (the step's wall time
        less the time it waited for collectives, so the rank the others wait for stands
        out), against the median: one all-gather of one number per rank. Called on every
        rank at a log iteration; None on one rank."""
        mine = self._busy_seconds / max(self._busy_steps, 1) * 1000.0
        self._busy_seconds, self._busy_steps = 0.0, 0
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2 \
                or not self._peers_apart:
            return None
        local = torch.tensor([mine], dtype=torch.float64, device=device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        times = torch.cat(gathered).tolist()
        slowest = max(range(len(times)), key=times.__getitem__)
        return {"straggler_rank": slowest, "straggler_ms_per_iteration": times[slowest],
                "median_rank_ms_per_iteration": statistics.median(times)}

    # ---- faults ------------------------------------------------------------------------------

    def _inject(self, fault: Fault, iteration: int, saving: bool = False) -> None:
        if (fault.kind == "slowsave") != saving:
            return
        if saving:
            if fault.iteration == iteration:
                self.log(f"fault injected: rank {self.rank} sleeps {fault.seconds:g} s in the "
                         f"save of iteration {iteration} at {time.time():.3f}")
                time.sleep(fault.seconds)
            return
        if fault.kind == "sleep":
            if fault.iteration <= iteration < fault.iteration + fault.count:
                self.log(f"fault injected: rank {self.rank} sleeps {fault.seconds:g} s in "
                         f"iteration {iteration} at {time.time():.3f}")
                time.sleep(fault.seconds)
            return
        if iteration != fault.iteration + 1:
            return
        self.log(f"fault injected: rank {self.rank} {fault.kind} after iteration "
                 f"{fault.iteration} at {time.time():.3f}")
        os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)

    # ---- the thread --------------------------------------------------------------------------

    def _record(self, beat: int) -> dict[str, Any]:
        return {"beat": beat, "iteration": self.iteration, "section": self.section_name,
                "stalled": round(self.stalled_seconds(), 3), "timeout": self.timeout(),
                "silence_timeout": self.config.hang_timeout,
                "host": socket.gethostname(), "pid": os.getpid(), **self.recorder.state()}

    def _publish(self, beat: int) -> None:
        self._store.set(f"rank/{self.rank}", json.dumps(self._record(beat)))

    def _run(self) -> None:
        watch = RecordWatch(self.world_size)
        beat = 0
        try:
            while not self._stopping.wait(self.config.heartbeat_interval):
                beat += 1
                verdict = self.beat(beat, watch)
                if verdict is not None:
                    self._act(verdict)
                    return
        except Exception as error:  # the store went away: the job is ending anyway
            if not self._stopping.is_set():
                self.log(f"watchdog: rank {self.rank} stops watching ({error})")

    def beat(self, beat: int, watch: RecordWatch) -> str | None:
        """One heartbeat: publish this rank's record; on a judge, read every rank's and
        publish a verdict if there is one; return the job's verdict, if any."""
        self._publish(beat)
        keys = [f"rank/{r}" for r in range(self.world_size)]
        if self.rank in (0, self.world_size - 1) and self._store.check(keys):
            records = {r: json.loads(v) for r, v in enumerate(self._store.multi_get(keys))}
            verdict = watch.verdict(records, time.monotonic())
            if verdict is not None:
                published = self._store.compare_set("verdict", "", verdict)
                if published.decode() == verdict:  # this judge's: it ends the silent ranks
                    self._silent_to_kill = (watch.silent_ranks, records)
                    self.log(f"watchdog: {verdict}")
        if self._store.check(["verdict"]):
            return self._store.get("verdict").decode()
        return None

    def _act(self, verdict: str) -> None:
        """Dump, note, and exit with ``HANG_STATUS`` (see [Note: hang watchdog])."""
        self.verdict = verdict
        where = Path(self.config.save) if self.config.save else Path.cwd()
        try:
            path = self.recorder.dump(where / dump_name(self.rank), rank=self.rank,
                                      world_size=self.world_size, host=socket.gethostname(),
                                      pid=os.getpid(), iteration=self.iteration,
                                      section=self.section_name, verdict=verdict)
            self.log(f"watchdog: rank {self.rank} wrote its last "
                     f"{min(self.recorder.issued_count, self.recorder.capacity)} collectives "
                     f"to {path}")
        except OSError as error:
            self.log(f"watchdog: rank {self.rank} could not write its flight recorder: {error}")
        note_hang(verdict)
        self._end_together()
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit_process(HANG_STATUS)

    def _end_together(self) -> None:
        """The first rank to exit makes the launcher end the others (torchrun: SIGTERM), so
        every live rank dumps before any exits, and the silent ranks are SIGKILLed before
        any exits (a stopped process does not take SIGTERM, and torchrun would wait out its
        30 s grace on it); each step bounded by a few beats."""
        deadline = time.monotonic() + 5 * self.config.heartbeat_interval
        with contextlib.suppress(Exception):
            self._store.add("dumped", 1)
            if self._silent_to_kill is not None:
                silent, records = self._silent_to_kill
                live = self.world_size - len(silent)
                while self._store.add("dumped", 0) < live and time.monotonic() < deadline:
                    time.sleep(0.05)
                self._kill_silent_on_this_host(silent, records)
                self._store.set("ended", "1")
            else:
                while not self._store.check(["ended"]) and time.monotonic() < deadline:
                    time.sleep(0.05)

    def _kill_silent_on_this_host(self, silent: list[int], records: dict[int, dict]) -> None:
        """SIGKILL the silent (stopped) hung ranks that run on this host. A hung rank that
        still beats exits by itself when it reads the verdict."""
        host = socket.gethostname()
        for rank in silent:
            record = records[rank]
            if rank != self.rank and record.get("host") == host:
                with contextlib.suppress(OSError):
                    os.kill(int(record["pid"]), signal.SIGKILL)


class RecordWatch:
    """A judge's view of the ranks' records: when each beat last changed on the judge's own
    clock, and the verdict ([Note: hang watchdog]). Pure: tests drive it with records."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beat, when it changed)
        self.silent_ranks: list[int] = []  # the hung ranks of the last verdict that are silent

    def verdict(self, records: dict[int, dict[str, Any]], now: float) -> str | None:
        silent = {}
        for rank, record in records.items():
            beat, changed = self._seen.get(rank, (None, now))
            if record["beat"] != beat:
                self._seen[rank] = (record["beat"], now)
                changed = now
            silent[rank] = now - changed
        # A thread that beats on through saves and collectives: silence is a stopped process.
        frozen = [r for r in records if silent[r] > records[r]["silence_timeout"]]
        self.silent_ranks = frozen
        if frozen:
            return self._describe(records, frozen, {
                r: f"no heartbeat for {silent[r]:.1f} s, timeout "
                   f"{records[r]['silence_timeout']:g} s" for r in frozen})
        if all(rec["stalled"] > rec["timeout"] for rec in records.values()):
            position = {r: (rec["iteration"], rec["issued"]) for r, rec in records.items()}
            lowest = min(position.values())
            behind = [r for r in records if position[r] == lowest]
            # Level with the others: the ones not blocked in a collective's wait hold it up.
            working = [r for r in behind if not (records[r]["open"] or {}).get("waiting")]
            behind = working or behind
            return self._describe(records, behind, {
                r: f"no progress for {records[r]['stalled']:.1f} s, timeout "
                   f"{records[r]['timeout']:g} s" for r in behind})
        return None

    @staticmethod
    def _describe(records: dict[int, dict[str, Any]], hung: list[int],
                  why: dict[int, str]) -> str:
        """'rank 3 hung at iteration 13 (no heartbeat for 10.4 s, timeout 10 s): it finished
        collective #812 and did not enter #813 (AllGather on world(4)), which ranks 0, 1, 2
        wait in'."""
        others = [r for r in records if r not in hung]
        waited = [records[r]["open"] for r in others if records[r].get("open")]
        # The ranks that still beat published last: the step they are in is the one the hung
        # rank holds up (its own record may be a beat older).
        iteration = max(records[r]["iteration"] for r in others or hung) + 1
        parts = []
        for rank in hung:
            record = records[rank]
            where = f"in a checkpoint {record['section']}" if record["section"] else \
                f"at iteration {iteration}"
            mine = record.get("open")
            # A silent rank's record is up to a beat older than its stop: "last seen", and
            # the iteration is the one its live peers are held in.
            seen = "last seen " if why[rank].startswith("no heartbeat") else ""
            if seen:
                where = f"at iteration {iteration}"
            if mine:
                inside = (f"{seen}inside collective #{mine['seq']} ({mine['kind']} on "
                          f"{mine['group']}, {mine['lane']} lane), not finished")
            elif waited:
                first = min(waited, key=lambda o: o["seq"])
                inside = (f"{seen or 'it '}finished collective #{record['issued']} and did not enter "
                          f"#{first['seq']} ({first['kind']} on {first['group']}), which rank"
                          f"{'s' if len(others) > 1 else ''} "
                          f"{', '.join(map(str, others))} wait in")
            else:
                inside = f"outside any collective, after collective #{record['issued']}"
            parts.append(f"rank {rank} hung {where} ({why[rank]}): {inside}")
        return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_lite.watchdog DIR``: where the ranks' collectives diverge, from
    the flight recorder dumps a hang left in DIR (the ``--save`` directory)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m megatron_lite.watchdog",
        description="Say where the ranks' collectives diverge, from the flight recorder dumps "
                    "a hang left (one file per rank, next to the checkpoints).")
    parser.add_argument("directory", type=Path, help="the directory holding the dumps")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks in the job (default: the dumps say)")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a directory")
    dumps = read_dumps(args.directory)
    if not dumps:
        parser.error(f"{args.directory} holds no {DUMP_PATTERN}")
    for line in divergence(dumps, args.world_size):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
