"""A flight recorder of this rank's last collectives, and a reader that compares ranks' dumps.

[Note: flight recorder]
Each rank keeps its last ``capacity`` collectives in a ring, in the order it issued them:
sequence number, kind (the issuing collective's class), group, bytes held, lane (the
stream or thread it runs on), and when it was issued, waited for and finished. Every rank
issues the engine's collectives in the same order ([Note: execution models]), so sequence
number S names the same collective on every rank; after a hang the ranks' dumps say which
collective some ranks finished, some entered and never left, and some never entered.
PyTorch's NCCL flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``) keeps the same facts per
communicator.

The engine feeds it from one place, where every collective is launched and waited for
(``zeropp.comm.streams``): ``issued`` when a collective is launched, ``Record.waiting`` and
``Record.finished`` around its wait. With no recorder installed each call costs a global
read and two empty calls. On CUDA "finished" is the host's: the compute stream was made to
wait for the collective's event (NCCL's own recorder also queries the event on the GPU). The watchdog (``megatron_lite.watchdog``) reads ``state()`` from its thread and dumps
the ring when it declares a hang.

``python -m megatron_lite.watchdog DIR`` says where the ranks' dumps in DIR diverge.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DUMP_PATTERN = "flight_recorder_rank*.json"


def dump_name(rank: int) -> str:
    return f"flight_recorder_rank{rank:05d}.json"


class Record:
    """One collective: filled at issue, ``waiting`` and ``finished`` by the thread that
    waits for it."""

    __slots__ = ("recorder", "seq", "kind", "group", "nbytes", "lane", "issued", "wait_started",
                 "finished_at")

    def __init__(self, recorder: FlightRecorder, seq: int, kind: str, group: str, nbytes: int,
                 lane: str, issued: float) -> None:
        self.recorder = recorder
        self.seq, self.kind, self.group, self.nbytes, self.lane = seq, kind, group, nbytes, lane
        self.issued = issued
        self.wait_started: float | None = None
        self.finished_at: float | None = None

    def waiting(self) -> None:
        self.wait_started = time.monotonic()

    def finished(self) -> None:
        self.recorder._finish(self)

    def as_dict(self, wall_offset: float) -> dict[str, Any]:
        def wall(t: float | None) -> float | None:
            return None if t is None else round(t + wall_offset, 6)

        return {"seq": self.seq, "kind": self.kind, "group": self.group, "bytes": self.nbytes,
                "lane": self.lane, "issued": wall(self.issued),
                "wait_started": wall(self.wait_started), "finished": wall(self.finished_at)}


class FlightRecorder:
    """The ring of this rank's last ``capacity`` collectives (see [Note: flight recorder]).

    Written by the training thread, read by the watchdog's without a lock: each update is
    one dict or attribute operation, atomic under the GIL, and the reads (``min`` of the
    open sequence numbers, a copy of the ring) run in C without releasing it.
    """

    def __init__(self, capacity: int = 2048) -> None:
        if capacity < 1:
            raise ValueError(f"the flight recorder needs room for at least 1 collective, "
                             f"got {capacity}")
        self.capacity = capacity
        self._ring: list[Record | None] = [None] * capacity
        self._open: dict[int, Record] = {}  # issued, not finished: seq -> record
        self.issued_count = 0  # the last sequence number issued (1-based)
        self.finished_count = 0
        self.last_activity = time.monotonic()  # the last issue or finish: progress
        self.blocked_seconds = 0.0  # time spent waiting for collectives (straggler report)

    def issue(self, kind: str, group: str, nbytes: int, lane: str) -> Record:
        now = time.monotonic()
        seq = self.issued_count + 1
        record = Record(self, seq, kind, group, nbytes, lane, now)
        self._ring[seq % self.capacity] = record
        self._open[seq] = record
        self.issued_count = seq
        self.last_activity = now
        return record

    def _finish(self, record: Record) -> None:
        now = time.monotonic()
        record.finished_at = now
        self._open.pop(record.seq, None)
        self.finished_count += 1
        self.last_activity = now
        if record.wait_started is not None:
            self.blocked_seconds += now - record.wait_started

    def take_blocked_seconds(self) -> float:
        """Seconds spent waiting for collectives since the last call (training thread)."""
        blocked, self.blocked_seconds = self.blocked_seconds, 0.0
        return blocked

    def state(self) -> dict[str, Any]:
        """What the watchdog publishes: the last sequence number issued and the oldest
        collective still open (issued and not finished), if any."""
        issued = self.issued_count
        open_seqs = list(self._open)  # one C call: no update interleaves
        oldest = self._open.get(min(open_seqs)) if open_seqs else None
        state: dict[str, Any] = {"issued": issued, "open": None}
        if oldest is not None:
            state["open"] = {"seq": oldest.seq, "kind": oldest.kind, "group": oldest.group,
                             "lane": oldest.lane, "waiting": oldest.wait_started is not None}
        return state

    def records(self) -> list[Record]:
        """The ring's records, oldest first."""
        kept = [r for r in list(self._ring) if r is not None]
        return sorted(kept, key=lambda r: r.seq)

    def dump(self, path: Path, **facts: Any) -> Path:
        """Write the ring as JSON (times as wall-clock seconds, comparable across hosts as
        far as their clocks agree), with ``facts`` (rank, iteration, the verdict) beside it."""
        offset = time.time() - time.monotonic()
        body = {**facts, "capacity": self.capacity, "issued": self.issued_count,
                "records": [r.as_dict(offset) for r in self.records()]}
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(body, indent=0) + "\n")
        partial.replace(path)
        return path


# ---- the engine's hook ------------------------------------------------------------------------


class _NoRecord:
    """What a collective carries when no recorder is installed: waiting for it records
    nothing, and the engine's wait needs no branch."""

    __slots__ = ()

    def waiting(self) -> None:
        pass

    def finished(self) -> None:
        pass


NO_RECORD = _NoRecord()

_installed: FlightRecorder | None = None
# An issuing function's code -> (the collective's kind, which closure cell holds its
# CommGroup or None): found once per code object, not per call.
_launch_sites: dict[object, tuple[str, int | None]] = {}
_groups: dict[int, str] = {}  # id(process group) -> "ranks 0,1"


def install(recorder: FlightRecorder | None) -> None:
    """Record the engine's collectives into ``recorder`` from now on (None: stop)."""
    global _installed
    _installed = recorder


def installed() -> FlightRecorder | None:
    return _installed


def issued(lane: str, issue: Callable, keep: tuple) -> Record | _NoRecord:
    """Called where the engine launches a collective: ``issue`` is the function that issues
    it (its class names the kind, its ``CommGroup`` the group), ``keep`` the buffers it
    holds (their bytes are recorded). ``NO_RECORD`` when no recorder is installed."""
    recorder = _installed
    if recorder is None:
        return NO_RECORD
    code = getattr(issue, "__code__", None)
    site = _launch_sites.get(code)
    if site is None:
        site = _launch_sites[code] = (describe_kind(issue), _group_cell(issue))
    kind, cell = site
    group = "?" if cell is None else describe_group(issue.__closure__[cell].cell_contents)
    nbytes = 0
    for held in keep:  # the caller's tensors (a dict of buffers the issue fills is empty yet)
        nbytes += getattr(held, "nbytes", 0)
    return recorder.issue(kind, group, nbytes, lane)


def describe_kind(issue: Callable) -> str:
    """'AllGather' for AllGather.__call__'s issuing lambda; the function's name otherwise."""
    qualname = getattr(issue, "__qualname__", None) or getattr(issue, "__name__", "collective")
    parts = [p for p in qualname.split(".") if p not in ("<locals>", "<lambda>", "__call__")]
    return parts[0] if parts else "collective"


def _group_cell(issue: Callable) -> int | None:
    """Which cell of the issuing function's closure holds its ``CommGroup``, if any."""
    for index, cell in enumerate(getattr(issue, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(value, "spans_nodes") and hasattr(value, "size"):
            return index
    return None


def describe_group(group) -> str:
    """A ``CommGroup`` as the dumps name it: 'world(4)' for the default group, 'ranks 0,1'
    for another."""
    import torch.distributed as dist

    if group.group is None or group.group is dist.group.WORLD:
        return f"world({group.size})"
    key = id(group.group)
    name = _groups.get(key)
    if name is None:
        ranks = dist.get_process_group_ranks(group.group)
        name = _groups[key] = "ranks " + ",".join(str(r) for r in ranks)
    return name


# ---- reading dumps ----------------------------------------------------------------------------


def read_dumps(directory: Path) -> dict[int, dict[str, Any]]:
    dumps = {}
    for path in sorted(Path(directory).glob(DUMP_PATTERN)):
        body = json.loads(path.read_text())
        dumps[int(body["rank"])] = body
    return dumps


def divergence(dumps: dict[int, dict[str, Any]], world_size: int | None = None) -> list[str]:
    """Lines saying where the ranks' collectives diverge: the first sequence number that not
    every rank finished, who finished it, who is inside it, who never entered it, and any
    rank that issued another kind of collective at the same number (an order mismatch)."""
    if not dumps:
        return ["no flight recorder dumps"]
    world = world_size or max(max(dumps) + 1, max(int(d.get("world_size", 0)) for d in
                                                  dumps.values()))
    missing = [r for r in range(world) if r not in dumps]
    lines = []
    if missing:
        lines.append(f"no dump from rank{'s' if len(missing) > 1 else ''} "
                     f"{_ranks(missing)} (hung or dead: it could not write)")
    by_rank = {rank: {r["seq"]: r for r in body["records"]} for rank, body in dumps.items()}
    issued = {rank: int(body["issued"]) for rank, body in dumps.items()}
    finished = {rank: max((s for s, r in records.items() if r["finished"] is not None),
                          default=0) for rank, records in by_rank.items()}
    first_unfinished = min(finished.values()) + 1
    # Order mismatches: the same sequence number, another kind of collective.
    for seq in range(max(min(min(r, default=1) for r in by_rank.values()), 1),
                     max(issued.values()) + 1):
        kinds = {rank: records[seq]["kind"] for rank, records in by_rank.items()
                 if seq in records}
        if len(set(kinds.values())) > 1:
            lines.append(f"collective #{seq} differs between ranks: " + "; ".join(
                f"rank {rank} {kind}" for rank, kind in sorted(kinds.items())))
            break
    if all(issued[r] == finished[r] for r in dumps) and len(set(issued.values())) == 1:
        lines.append(f"the ranks that dumped agree: each finished collectives #1 to "
                     f"#{issued[min(dumps)]} and has none open")
        return lines
    seq = first_unfinished
    entered = [r for r in dumps if issued[r] >= seq and finished[r] < seq]
    done = [r for r in dumps if finished[r] >= seq]
    never = [r for r in dumps if issued[r] < seq]
    described = next((by_rank[r][seq] for r in entered + done if seq in by_rank[r]), None)
    what = f"collective #{seq}" + (f" ({described['kind']} on {described['group']}, "
                                   f"{described['bytes']} bytes, {described['lane']} lane)"
                                   if described else "")
    lines.append(f"the ranks diverge at {what}:")
    if done:
        lines.append(f"  finished by rank{'s' if len(done) > 1 else ''} {_ranks(done)}")
    if entered:
        lines.append(f"  entered, not finished, by rank{'s' if len(entered) > 1 else ''} "
                     f"{_ranks(entered)}")
    if never:
        lines.append("  never entered by " + "; ".join(
            f"rank {r} (last issued #{issued[r]})" for r in sorted(never)))
    verdicts = {body.get("verdict") for body in dumps.values() if body.get("verdict")}
    for verdict in sorted(verdicts):
        lines.append(f"watchdog: {verdict}")
    return lines


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
