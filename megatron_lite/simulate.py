"""This program on the simulated GPU cluster: rank r of N GPUs, measured.

    python -m megatron_lite.simulate --sim-nodes 4 --sim-gpus-per-node 16 -- \\
        --num-layers 40 --hidden-size 6144 --num-attention-heads 32 --seq-length 512 \\
        --micro-batch-size 1 --global-batch-size 64 --fp16 --checkpoint-activations \\
        --deepspeed_config configs/ds_zeropp_config.json

The real program (``megatron_lite.pretrain_gpt.main``) runs with ``--mock-data`` as one rank of
the cluster, under ``zeropp.simulation``: torch's process-group machinery with a backend that
moves no data but enforces NCCL's rules, tensors on the meta device (the engine then takes
its CUDA execution model, with no real streams), a memory tracker and a host-sync counter.
It trains three iterations and saves a checkpoint, then a second run of ``main`` loads it
and trains one more: every collective of set-up, training, evaluation, save and load is checked.

Measured exactly: peak bytes per GPU by category (what the engine and autograd allocate; no
allocator fragmentation, no CUDA context, no NCCL buffers), the order of operations on every
communicator, collectives given a tensor off the device or issued off the training thread,
and host reads of device values per iteration by call site; on request (``count_ops``) the
ops dispatched and collectives issued in one iteration. Values are meaningless here.

[Note: which ranks]
Every rank runs the same program on different shards, so rank 0 and rank N-1 (first and last
node, first and last local rank) bound the others: their peaks are reported, and their
operation order on the communicators they share (the world) must be identical.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

GIB = 1024**3


@dataclass
class RankMeasurement:
    """What one simulated rank measured."""

    rank: int
    world_size: int
    peak_bytes: int  # during the training iterations
    peak_by_category: dict[str, int]  # at the moment of the peak
    category_peaks: dict[str, int]  # each category's own peak, whenever it happened
    phase_peaks: dict[str, int]  # forward / backward / optimizer step, over all iterations
    host_syncs_per_iteration: dict[str, int]  # iteration 2 (steady): call site -> count
    violations: list[str]
    order: dict  # communicator (global ranks) -> operations, in issue order
    collectives: dict = field(default_factory=dict)
    seconds: float = 0.0
    # The caching allocator's hold ([Note: allocation lanes] in zeropp/comm/streams.py):
    # each stream's own peak ("compute", "gather", "reduce"), and their sum.
    lane_peaks: dict[str, int] = field(default_factory=dict)
    reserved_peak_bytes: int = 0
    # Host memory held for ZeRO-Offload ([Note: offload] in zeropp/offload.py), apart from
    # every device figure above: the peak of the storages allocated on the host lane.
    host_peak_bytes: int = 0
    # With ``trace=True``: iteration 2 as an IterationTrace (zeropp.simulation.trace), and
    # the engine's own byte accounting (``engine.comm_bytes()``'s {phase: {locality: bytes}})
    # over the same window, for checking one against the other.
    trace: object | None = None
    trace_comm_bytes: dict = field(default_factory=dict)
    # With ``count_ops=True``, over the same window as the host syncs (iteration 2): every op
    # dispatched on the training thread (OpCounter's names -> counts, most frequent first),
    # their number without collectives and profiler markers (measure.dispatched_ops), and
    # the collectives this rank issued, by kind ("all_gather_single" -> count).
    op_counts: dict[str, int] = field(default_factory=dict)
    ops_per_iteration: int = 0
    collectives_per_iteration: dict[str, int] = field(default_factory=dict)


# Flags the simulation sets itself (the value follows in the argv).
_OVERRIDES = ("--train-iters", "--save", "--save-interval", "--load", "--log-interval",
              "--eval-iters", "--eval-interval", "--num-workers", "--ranks-per-node",
              "--wandb-project", "--tensorboard-dir", "--metrics-file", "--exit-interval",
              # the lr schedule's length must fit the few simulated iterations
              "--lr-warmup-iters", "--lr-warmup-fraction", "--lr-decay-iters")
_DS_CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config")


def _strip(argv: list[str], drop: tuple[str, ...] = ()) -> list[str]:
    """The user's training flags without the data, dry-run and run-length ones (and
    ``drop``)."""
    out, dropping = [], False
    for arg in argv:
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            dropping = (name in _OVERRIDES or name in drop or name.startswith("--dry-run")
                        or name in ("--data-path", "--mock-data"))
            if dropping:
                continue
        elif dropping:  # a value of a dropped flag
            continue
        out.append(arg)
    return out


def training_argv(argv: list[str], gpus_per_node: int, iterations: int, ds_config: str | None,
                  save_dir: str | None = None, load_dir: str | None = None) -> list[str]:
    """``argv`` as a short run on mock data; ``ds_config`` replaces the user's JSON."""
    run = ["--mock-data", "--train-iters", str(iterations), "--log-interval", "1",
           "--eval-iters", "1", "--eval-interval", str(iterations + 1), "--num-workers", "0",
           "--ranks-per-node", str(gpus_per_node)]
    if ds_config is not None:
        run += ["--deepspeed_config", ds_config]
    if save_dir is not None:
        run += ["--save", save_dir, "--save-interval", str(iterations)]
    if load_dir is not None:
        run += ["--load", load_dir]
    if not any(arg.split("=", 1)[0] == "--lr" for arg in argv):
        run += ["--lr", "1e-4"]  # a dry run needs none; values do not matter here
    return _strip(argv, drop=_DS_CONFIG_FLAGS if ds_config is not None else ()) + run


@contextlib.contextmanager
def _patched(obj, name: str, wrapper) -> Iterator[None]:
    original = getattr(obj, name)
    setattr(obj, name, wrapper(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


@contextlib.contextmanager
def _launcher_env(rank: int, world_size: int, gpus_per_node: int) -> Iterator[None]:
    """What torchrun would export for this rank (restored afterwards)."""
    values = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank % gpus_per_node,
              "LOCAL_WORLD_SIZE": gpus_per_node}
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update({key: str(value) for key, value in values.items()})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stand_in_for_rank_0(save_dir: Path, rank: int, iterations: int, before: bool) -> None:
    """Rank 0's part of a save, for a simulated rank that runs without it.

    A save is a collective of the file system too: rank 0 creates ``TAG.tmp/``, every rank
    writes its shard there, rank 0 renames it to ``TAG/`` and writes ``latest``. Rank 0's
    simulation (run first, into the same directory) published the tag; here the directory
    is created before this rank writes, and its shard moved into the published tag after.
    """
    from megatron_lite.checkpointing import checkpoint_tag
    from zeropp.checkpoints.checkpoint import shard_file

    tag = checkpoint_tag(iterations)
    staging = save_dir / f"{tag}.tmp"
    if before:
        staging.mkdir(parents=True, exist_ok=True)
        return
    published = save_dir / tag
    if not published.is_dir():
        raise RuntimeError(f"simulate rank 0 into {save_dir} before rank {rank}")
    os.replace(shard_file(staging, rank), shard_file(published, rank))
    shutil.rmtree(staging)


def simulate_rank(argv: list[str], rank: int, nodes: int, gpus_per_node: int,
                  save_dir: str | os.PathLike | None, quiet: bool = True,
                  ds_config: dict | None = None, trace: bool = False,
                  label: str | None = None, count_ops: bool = False) -> RankMeasurement:
    """Run the program as ``rank`` of ``nodes x gpus_per_node`` simulated GPUs and measure.

    ``save_dir`` receives the checkpoints (simulate rank 0 into it before any other rank);
    None measures three iterations without the save and the resume. ``ds_config`` replaces
    the DeepSpeed JSON of ``argv`` (the dry run's ZeRO-3 baseline). ``trace`` also records
    iteration 2 of the first run (from the start of its ``train_step`` to the start of the
    next, like the host syncs: the loss logging is in it) as ``RankMeasurement.trace``.
    ``count_ops`` counts, over the same iteration, the ops dispatched and the collectives
    issued (``RankMeasurement.op_counts``, ``ops_per_iteration``, ``collectives_per_iteration``).
    A status line on stderr (``megatron_lite.progress``) names ``label`` (what is simulated),
    the rank and the iteration under way, with the seconds since the start.
    """
    from megatron_lite import pretrain_gpt
    from megatron_lite.progress import Progress
    from megatron_lite.training import Trainer
    from zeropp.comm.accounting import CommStats
    from zeropp.engine import ZeroEngine
    from zeropp.simulation import (
        HostSyncCounter,
        MemoryTracker,
        OpCounter,
        simulated_process_group,
    )
    from zeropp.simulation.measure import dispatched_ops
    from zeropp.simulation.trace import IterationTrace
    from zeropp.simulation.tracing import TraceRecorder

    world_size = nodes * gpus_per_node
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a cluster of {world_size} GPUs")
    tracker = MemoryTracker(torch.device("meta"))
    syncs = HostSyncCounter()
    iteration_syncs: list[dict[str, int]] = []
    measuring = {"on": False, "steps": 0, "run": 0}
    tracing: dict = {"recorder": None, "trace": None, "comm": None, "stats": None}
    counting: dict = {"counter": None, "collectives_before": None, "simulation": None,
                      "ops": {}, "collectives": {}}

    def stop_counting() -> None:
        counter = counting["counter"]
        if counter is not None:
            counting["counter"] = None
            counter.__exit__(None, None, None)
            counting["ops"] = counter.by_name()
            issued = counting["simulation"].counts_by_op() - counting["collectives_before"]
            counting["collectives"] = dict(sorted(issued.items()))

    def start_counting() -> None:
        # Entered last, above HostSyncCounter (which answers reads of meta values itself)
        # and the trace recorder (which may decompose an op), so it sees every op first;
        # left first (modes leave in reverse order).
        counting["collectives_before"] = counting["simulation"].counts_by_op()
        counting["counter"] = OpCounter().__enter__()

    def stop_tracing() -> None:
        recorder = tracing["recorder"]
        if recorder is not None:
            tracing["recorder"] = None
            recorder.__exit__(None, None, None)
            tracing["trace"].events = recorder.events

    def start_tracing(trainer) -> None:
        config, world = trainer.config, trainer.engine.topology.world_size
        tokens = config.global_batch_size * config.seq_length // world  # data parallel
        tracing["trace"] = IterationTrace(
            rank=rank, world_size=world_size, ranks_per_node=gpus_per_node,
            tokens_per_iteration=tokens,
            model_flops_per_iteration=trainer.flops_per_token * tokens,
            dtype_bytes=trainer.engine.sharded.dtype.itemsize)
        tracing["comm"] = {}
        tracing["stats"] = trainer.engine.comm_stats  # not qgZ's private, untracked ones
        tracing["recorder"] = TraceRecorder(torch.device("meta"), phase="forward",
                                            in_host_memory=tracker.in_host_memory).__enter__()

    def iteration(step):
        # Host syncs are counted from the start of one iteration to the start of the next,
        # so the log line and the checks after an iteration count with it.
        def run(self, batches):
            if not measuring["on"]:
                measuring["on"] = True
                tracker.reset_peak()
            else:
                iteration_syncs.append(dict(syncs.counts))
            syncs.reset()
            measuring["steps"] += 1
            if measuring["steps"] == 1:  # the engine is built: its communicators must be too
                counting["simulation"].communicators_ready()
            stop_counting()  # the measured iteration ends where the next one starts
            stop_tracing()
            if measuring["run"] == 0 and measuring["steps"] == 2:
                if trace:
                    start_tracing(self)
                if count_ops:
                    start_counting()
            progress.update(f"iteration {self.iteration + 1} of {self.config.train_iters}")
            return step(self, batches)
        return run

    def in_phase(label):
        def wrap(method):
            def run(self, *args, **kwargs):
                if tracing["recorder"] is not None:
                    tracing["recorder"].set_phase(label.split()[0])  # "optimizer step"
                with tracker.phase(label):
                    return method(self, *args, **kwargs)
            return run
        return wrap

    def accounted(record):
        def run(self, phase, spans_nodes, nbytes):
            if tracing["recorder"] is not None and self is tracing["stats"] and self.enabled \
                    and nbytes:
                by_locality = tracing["comm"].setdefault(phase, {})
                where = "inter_node" if spans_nodes else "intra_node"
                by_locality[where] = by_locality.get(where, 0) + int(nbytes)
            return record(self, phase, spans_nodes, nbytes)
        return run

    started = time.perf_counter()
    # Not in place when the program's own output shares the terminal (quiet=False).
    progress = Progress(f"simulating {label} as rank {rank} of {world_size}" if label
                        else f"simulating rank {rank} of {world_size}",
                        in_place=None if quiet else False)
    statuses, run_peaks = [], []
    config_dir = tempfile.TemporaryDirectory(prefix="zeropp-sim-config-")
    config_path = None
    if ds_config is not None:
        config_path = os.path.join(config_dir.name, "ds_config.json")
        with open(config_path, "w") as f:
            json.dump(ds_config, f)
    if save_dir is None:
        runs = [(3, None, None)]
    else:
        # Three iterations and a save; then a resume from it, one iteration and another save.
        save_dir = Path(save_dir)
        runs = [(3, save_dir / "first", None), (4, save_dir / "resumed", save_dir / "first")]
    with config_dir, _launcher_env(rank, world_size, gpus_per_node), \
            simulated_process_group(rank, world_size, torch.device("meta")) as simulation, \
            _patched(Trainer, "train_step", iteration), \
            _patched(ZeroEngine, "__call__", in_phase("forward")), \
            _patched(ZeroEngine, "backward", in_phase("backward")), \
            _patched(ZeroEngine, "step", in_phase("optimizer step")), \
            _patched(CommStats, "record", accounted), \
            _quiet(quiet), tracker, syncs, progress:
        counting["simulation"] = simulation
        for run_index, (iterations, save_to, load_from) in enumerate(runs):
            measuring["run"], measuring["steps"] = run_index, 0
            progress.update("setting up" if run_index == 0 else
                            f"resuming from iteration {runs[run_index - 1][0]}'s checkpoint")
            if rank != 0 and save_to is not None:
                _stand_in_for_rank_0(save_to, rank, iterations, before=True)
            gc.collect()  # the previous run's engine is garbage: not this run's memory
            measuring["on"] = False
            try:
                statuses.append(pretrain_gpt.main(training_argv(
                    argv, gpus_per_node, iterations, config_path,
                    save_dir=None if save_to is None else str(save_to),
                    load_dir=None if load_from is None else str(load_from))))
            finally:
                stop_counting()  # only if the run ended inside the measured iteration
                stop_tracing()
            if statuses[-1] != 0:
                break
            if rank != 0 and save_to is not None:
                _stand_in_for_rank_0(save_to, rank, iterations, before=False)
            run_peaks.append((tracker.peak_bytes, dict(tracker.peak_by_category),
                              dict(tracker.category_peaks), dict(tracker.lane_peaks),
                              tracker.host_peak_bytes))
        order = simulation.order_signature()
        violations = list(simulation.violations)
        collectives = dict(simulation.counts)
    if any(statuses):
        raise RuntimeError(f"the simulated rank {rank} exited with status {statuses[-1]}")
    peak, by_category, category_peaks, lane_peaks, host_peak = max(run_peaks,
                                                                   key=lambda peak: peak[0])
    return RankMeasurement(
        rank=rank, world_size=world_size, peak_bytes=peak, peak_by_category=by_category,
        category_peaks=category_peaks, lane_peaks=lane_peaks,
        reserved_peak_bytes=sum(lane_peaks.values()), host_peak_bytes=host_peak,
        phase_peaks=dict(tracker.phase_peaks),
        host_syncs_per_iteration=iteration_syncs[1],  # from iteration 2 to 3: steady state
        violations=violations, order=order, collectives=collectives,
        seconds=time.perf_counter() - started,
        trace=tracing["trace"], trace_comm_bytes=tracing["comm"] or {},
        op_counts=counting["ops"], ops_per_iteration=dispatched_ops(counting["ops"]),
        collectives_per_iteration=counting["collectives"],
    )


@contextlib.contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


@dataclass
class ClusterMeasurement:
    """Ranks 0 and N-1 of one configuration (see [Note: which ranks])."""

    first: RankMeasurement
    last: RankMeasurement
    order_mismatches: list[str]

    @property
    def peak_bytes(self) -> int:
        return max(self.first.peak_bytes, self.last.peak_bytes)


def simulate_cluster(argv: list[str], nodes: int, gpus_per_node: int,
                     quiet: bool = True, trace: bool = False) -> ClusterMeasurement:
    """Ranks 0 and N-1; ``trace``: rank 0 also records a steady iteration's trace."""
    from zeropp.simulation import compare_orders

    world_size = nodes * gpus_per_node
    with tempfile.TemporaryDirectory(prefix="zeropp-sim-") as save_dir:
        first = simulate_rank(argv, 0, nodes, gpus_per_node, save_dir, quiet, trace=trace)
        last = simulate_rank(argv, world_size - 1, nodes, gpus_per_node, save_dir, quiet) \
            if world_size > 1 else first
    return ClusterMeasurement(first, last, compare_orders(first.order, last.order))


def render(measurement: ClusterMeasurement) -> str:
    lines = []
    for result in (measurement.first, measurement.last):
        lines.append(f"rank {result.rank} of {result.world_size}: peak "
                     f"{result.peak_bytes / GIB:.2f} GiB ({result.seconds:.1f} s simulated)")
        for category, nbytes in sorted(result.peak_by_category.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {category:<28}{nbytes / GIB:>10.2f} GiB")
        pools = ", ".join(f"{lane} {nbytes / GIB:.2f}" for lane, nbytes in
                          sorted(result.lane_peaks.items(), key=lambda kv: -kv[1]))
        lines.append(f"  reserved by CUDA's caching allocator: "
                     f"{result.reserved_peak_bytes / GIB:.2f} GiB (each stream's pool at its "
                     f"own peak: {pools} GiB)")
        if result.host_peak_bytes:
            lines.append(f"  host memory (offloaded model states): "
                         f"{result.host_peak_bytes / GIB:.2f} GiB")
        syncs = ", ".join(f"{site} x{count}" for site, count in
                          sorted(result.host_syncs_per_iteration.items())) or "none"
        lines.append(f"  host syncs per iteration: {syncs}")
        lines.append(f"  collectives: {sum(result.collectives.values())} issued; NCCL rule "
                     f"violations: {len(result.violations)}")
        lines += [f"    {violation}" for violation in result.violations[:10]]
    mismatches = measurement.order_mismatches
    lines.append("operation order on shared communicators, first vs last rank: "
                 + ("identical" if not mismatches else f"{len(mismatches)} mismatch(es)"))
    lines += [f"  {mismatch}" for mismatch in mismatches[:10]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    program = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sim-nodes", type=int, default=1)
    parser.add_argument("--sim-gpus-per-node", type=int, default=8)
    parser.add_argument("--verbose", action="store_true", help="Show the program's own output.")
    parser.add_argument("--trace", metavar="FILE.json", default=None,
                        help="Write rank 0's steady-state iteration (iteration 2) as an "
                        "IterationTrace (zeropp.simulation.trace) to this JSON file.")
    options = parser.parse_args(own)
    measurement = simulate_cluster(program, options.sim_nodes, options.sim_gpus_per_node,
                                   quiet=not options.verbose, trace=options.trace is not None)
    print(render(measurement), flush=True)
    if options.trace is not None:
        measurement.first.trace.to_json(options.trace)
        print(f"trace of rank 0's iteration 2: {options.trace} "
              f"({len(measurement.first.trace.events)} events)", flush=True)
    clean = not measurement.order_mismatches and not measurement.first.violations \
        and not measurement.last.violations
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
