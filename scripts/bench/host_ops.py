"""Host work per training iteration: ops dispatched, collectives issued and host syncs.

    python -m scripts.bench.host_ops [--systems model,fsdp2,zero3,zeropp,deltas2] \\
        [--json FILE.json] [--top N] [-- MEGATRON FLAGS]
    python -m scripts.bench.host_ops --python-time [--runs 3] [--json FILE.json]

``--python-time`` measures instead the host's Python time per iteration on the CPU, FSDP2,
ZeRO-3 and ZeRO++ in one run, at hidden 64 (``scripts/bench/host_python.py`` says how).

The setting is the DeepSpeed ZeRO++ tutorial's 18B (``--num-layers 40 --hidden-size 6144
--num-attention-heads 32 --seq-length 512 --micro-batch-size 1 --global-batch-size 64 --fp16
--checkpoint-activations``) on 4 nodes x 16 GPUs, measured as rank 0. Megatron flags given
after ``--`` (or any flag this script does not know, e.g. ``--num-layers 4`` for a quick run)
replace the tutorial's. One iteration in steady state is counted: iteration 2 of a run, from
the start of one ``Trainer.train_step`` to the start of the next (the window in which
``megatron_lite.simulate`` counts host syncs: the batch, forward, backward, optimizer step and
the log line).

Counted, per system:
- ops dispatched: every op that reaches a ``TorchDispatchMode`` on the training thread
  (``zeropp.simulation.OpCounter``), as the host issues it, without decomposition: aten ops
  and custom kernels (``zeropp::`` quantization, FSDP2's ``fsdp::`` copy-in/out), one each;
  not the profiler's range markers nor c10d's collective ops (those are the next column). An
  op on a DTensor (FSDP2's parameters, the optimizer's step) counts once. No other thread
  issues ops in any of these runs: on meta tensors the engine runs its CUDA execution model
  with the collectives inline on the training thread (``zeropp/comm/streams.py``, and the
  simulated backend flags any collective from another thread), and autograd's CPU and meta
  backward runs on the calling thread.
- collectives: what this rank issued in the window, by kind.
- host syncs: reads of device values by the host (``HostSyncCounter``), by call site. The
  simulated run logs every iteration, so the engine rows hold the log line's read of the loss
  (``mean_across_ranks``, and its all-reduce), which a run with ``--log-interval`` N makes
  once in N iterations.

Systems:
- ``model``, the model alone, unsharded: what any system must issue. The program's
  GPTModel (its shape, fp16, activation checkpointing, dropout) on the meta device, one
  micro-batch of ``--seq-length`` tokens: forward, ``lm_loss`` and backward (with the
  recomputation), no optimizer, no batch fetching or logging. The second such pass is counted
  (gradients set to None between, as a training loop does).
- ``fsdp2``, PyTorch FSDP2 with one group per block: ``fully_shard`` on every transformer
  block, then on the root, MixedPrecisionPolicy(param_dtype=float16) (fp32 sharded weights,
  fp16 compute and gradient reduce-scatter), ``torch.optim.AdamW`` with its default settings,
  in a world of nodes x GPUs on torch's fake process group; forward, ``lm_loss``, backward,
  ``step()``, ``zero_grad()``; no gradient clipping, no loss scaling (which the engine rows do,
  as the tutorial's JSON and ``--fp16`` ask: torch.amp's GradScaler would add a host sync, the
  clipping an all-reduce). FSDP2 does not run on the meta device, so it runs on the CPU at
  hidden size 64 with 4 heads (every other flag as given): the ops issued do not depend on
  the hidden size, which the run checks by counting the model alone at both shapes (the CPU
  runs use SDPA's math path, the one the meta device takes); FSDP2's own count is the same at
  hidden 64, 96 and 200 (4 layers; the last two shard unevenly over 64 ranks). Its
  collectives are the c10d ops
  it dispatches; its host syncs are the reads of tensors that a GPU run keeps on the device
  (not the optimizer's step counters, which torch keeps on the host).
- ``zero3``, ``zeropp``, ``deltas2``: this engine, the real program (``pretrain_gpt.main``,
  ``--mock-data``) as rank 0 of the simulated GPU cluster, on meta tensors
  (``megatron_lite.simulate.simulate_rank(count_ops=True)``). ZeRO++ is the tutorial's JSON
  (configs/ds_zeropp_config.json, or the ``--deepspeed_config`` given); ZeRO-3 the dry run's
  baseline of it (qwZ, hpZ, qgZ off: ``megatron_lite.dry_run.baseline_ds_config``); 2-bit
  weight deltas the same JSON with ``zero_quantized_weight_deltas: true`` and
  ``zero_quantized_weight_deltas_bits: 2``.

Every row takes torch.optim's choice of implementation for CUDA tensors (foreach) although
the tensors are on meta or the CPU, where torch would take its per-tensor loop. What the meta
device cannot mirror is the same in every row, so the differences between rows hold: SDPA
takes its math path (with dropout, 32 ops for attention's forward and 28 for its backward,
where flash attention on a GPU issues one or two each way: an estimated 3,500 of the model's
ops at 40 layers, forward, recomputation and backward) and dropout is not fused (4 ops for
one native_dropout).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite.progress import Progress
from scripts.bench.host_setup import (  # noqa: F401 (program_argv, ROOT: this bench's API too)
    ROOT,
    TUTORIAL_FLAGS,
    ZEROPP_CONFIG,
    build_model,
    engine_ds_config,
    fsdp2_training,
    math_attention,
    one_batch,
    optimizers_as_on_cuda,
    program_argv,
)
from zeropp.simulation.measure import (
    HostSyncCounter,
    OpCounter,
    collective_ops,
    dispatched_ops,
)

NODES, GPUS_PER_NODE, RANK = 4, 16, 0
# FSDP2 runs on the CPU at this shape (see the module docstring).
FSDP2_HIDDEN, FSDP2_HEADS = 64, 4
SYSTEMS = {
    "model": "the model alone, unsharded",
    "fsdp2": "PyTorch FSDP2, one group per block",
    "zero3": "this engine, ZeRO-3",
    "zeropp": "this engine, ZeRO++",
    "deltas2": "this engine, ZeRO++ with 2-bit weight deltas",
}
# Collective kinds in display order: (a substring of the op's name without "_", plural label).
COLLECTIVE_KINDS = (("allgather", "all-gathers"), ("reducescatter", "reduce-scatters"),
                    ("alltoall", "all-to-alls"), ("allreduce", "all-reduces"),
                    ("broadcast", "broadcasts"), ("barrier", "barriers"), ("send", "sends"),
                    ("recv", "receives"))


@dataclasses.dataclass
class HostWork:
    """One system's counts for the measured iteration."""

    system: str
    ops: int  # dispatched_ops(op_counts)
    op_counts: dict[str, int]  # every op name -> count, most frequent first
    collectives: dict[str, int]  # the backend's name ("all_gather_single") -> count
    host_syncs: dict[str, int]  # call site -> count
    seconds: float
    shape: str = ""  # where the shape differs from the setting's


def collective_kind(name: str) -> str:
    """The plural label of a collective, from the simulated backend's name
    ("reduce_scatter_single") or a c10d op's ("c10d._reduce_scatter_base_.default")."""
    bare = (name.split(".")[1] if "." in name else name).replace("_", "").lower()
    for key, label in COLLECTIVE_KINDS:
        if key in bare:
            return label
    return name


def by_kind(collectives: dict[str, int]) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    for name, count in collectives.items():
        kinds[collective_kind(name)] += count
    order = [label for _, label in COLLECTIVE_KINDS]
    return dict(sorted(kinds.items(),
                       key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


# ---- the model as the program builds it ---------------------------------------------------
def count_model_alone(argv: list[str], device: str = "meta", nodes: int = NODES,
                      gpus_per_node: int = GPUS_PER_NODE) -> HostWork:
    """The model's forward, loss and backward (with recomputation), in the program's dtype."""
    from megatron_lite.model import lm_loss

    started = time.perf_counter()
    args, model = build_model(argv, device, nodes, gpus_per_node)
    model.to(args.params_dtype).train()
    tokens, labels, loss_mask = one_batch(args, device)
    with math_attention(device):
        for _ in range(2):  # the first pass may set things up once; the second is counted
            model.zero_grad(set_to_none=True)
            # The counter innermost: it sees each op first (HostSyncCounter answers a read of
            # a meta value itself, and modes below it would not see that op).
            with HostSyncCounter(device) as syncs, OpCounter() as ops:
                lm_loss(model(tokens), labels, loss_mask).backward()
    op_counts = ops.by_name()
    return HostWork("model", dispatched_ops(op_counts), op_counts,
                    collective_ops(op_counts), dict(syncs.counts),
                    time.perf_counter() - started, shape=shape_of(args))


def shape_of(args) -> str:
    return (f"{args.num_layers} layers, hidden {args.hidden_size}, "
            f"{args.num_attention_heads} heads, seq {args.seq_length}")


# ---- FSDP2 ---------------------------------------------------------------------------------
class DeviceReads(TorchDispatchMode):
    """Host reads of values a GPU run keeps on the device, for a run on CPU tensors.

    On the CPU every tensor is on the host, so ``HostSyncCounter`` cannot tell a device read
    from a host one: here a scalar read (``item``, ``bool``, ``equal``, ``allclose``) counts
    unless its tensor is in ``on_host`` (what torch keeps on the host on a GPU too).
    """

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
             torch.ops.aten.allclose.default)

    def __init__(self, on_host: set[int]) -> None:
        super().__init__()
        self.on_host = on_host
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS and id(args[0]) not in self.on_host:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_fsdp2(argv: list[str], nodes: int = NODES, gpus_per_node: int = GPUS_PER_NODE,
                iterations: int = 3, measured: int = 2) -> HostWork:
    """FSDP2 over the model at hidden ``FSDP2_HIDDEN``, rank 0 of a fake world, on the CPU;
    iteration ``measured`` of ``iterations`` counted (module docstring)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_lite.model import lm_loss

    started = time.perf_counter()
    world_size = nodes * gpus_per_node
    small = argv + ["--hidden-size", str(FSDP2_HIDDEN),
                    "--num-attention-heads", str(FSDP2_HEADS)]
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=world_size)
    progress = Progress(f"counting FSDP2 as rank {RANK} of {world_size} on the CPU")
    try:
        args, model, optimizer = fsdp2_training(small, nodes, gpus_per_node)
        tokens, labels, loss_mask = one_batch(args, "cpu")
        with progress, math_attention("cpu"):
            for iteration in range(1, iterations + 1):
                progress.update(f"iteration {iteration} of {iterations}")
                counting = iteration == measured
                # The step counters exist from the first step on; a GPU run keeps them on
                # the host too (AdamW's default, capturable=False).
                on_host = {id(state["step"]) for state in optimizer.state.values()}
                with DeviceReads(on_host) as reads, OpCounter() as ops:
                    ops.enabled = counting
                    lm_loss(model(tokens), labels, loss_mask).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if counting:
                    op_counts, syncs = ops.by_name(), dict(reads.counts)
    finally:
        dist.destroy_process_group()
    return HostWork("fsdp2", dispatched_ops(op_counts), op_counts, collective_ops(op_counts),
                    syncs, time.perf_counter() - started, shape=shape_of(args))


# ---- this engine ---------------------------------------------------------------------------
def count_engine(argv: list[str], system: str, nodes: int = NODES,
                 gpus_per_node: int = GPUS_PER_NODE) -> HostWork:
    from megatron_lite.simulate import simulate_rank

    started = time.perf_counter()
    result = simulate_rank(argv, RANK, nodes, gpus_per_node, save_dir=None,
                           ds_config=engine_ds_config(argv, system), label=SYSTEMS[system],
                           count_ops=True)
    if result.violations:
        raise RuntimeError(f"{system} broke NCCL's rules: {result.violations[:5]}")
    return HostWork(system, result.ops_per_iteration, result.op_counts,
                    result.collectives_per_iteration, result.host_syncs_per_iteration,
                    time.perf_counter() - started)


def measure(system: str, argv: list[str]) -> HostWork:
    with optimizers_as_on_cuda():
        if system == "model":
            return count_model_alone(argv)
        if system == "fsdp2":
            return count_fsdp2(argv)
        return count_engine(argv, system)


# ---- report --------------------------------------------------------------------------------
def render(results: list[HostWork], top: int = 0, checks: tuple[str, ...] = ()) -> str:
    floor = next((r.ops for r in results if r.system == "model"), None)
    lines = ["| per training iteration | ops dispatched | collectives | host syncs |",
             "|---|---:|---|---:|"]
    for result in results:
        ops = f"{result.ops:,}"
        if floor and result.system != "model":
            ops += f" ({result.ops / floor:.2f}x)"
        kinds = by_kind(result.collectives)
        total = sum(kinds.values())
        collectives = f"{total:,}"
        if total:
            collectives += " (" + ", ".join(f"{n:,} {kind}" for kind, n in kinds.items()) + ")"
        lines.append(f"| {SYSTEMS[result.system]} | {ops} | {collectives} | "
                     f"{sum(result.host_syncs.values())} |")
    lines.append("")
    for result in results:
        syncs = ", ".join(f"{site} x{n}" for site, n in sorted(result.host_syncs.items()))
        shape = f"; at {result.shape}" if result.system == "fsdp2" else ""
        lines.append(f"- {SYSTEMS[result.system]}: host syncs at {syncs or 'none'}{shape}; "
                     f"counted in {result.seconds:.0f} s")
    lines += [f"- {check}" for check in checks]
    if top:
        for result in results:
            lines += ["", f"{SYSTEMS[result.system]}, the {top} most frequent ops:"]
            frequent = sorted(result.op_counts.items(), key=lambda kv: -kv[1])[:top]
            lines += [f"  {count:>7,}  {name}" for name, count in frequent]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    program = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench.host_ops", description=__doc__.split("\n")[0],
        epilog="Flags it does not know (and any after --) are Megatron flags that replace the "
        "tutorial's, e.g. --num-layers 4.")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS)} (default: all)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE.json",
                        help="write the raw counts here")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="also print each system's N most frequent ops")
    parser.add_argument("--python-time", action="store_true",
                        help="measure the host's Python time per iteration on the CPU "
                        "(FSDP2, ZeRO-3, ZeRO++ at hidden 64) instead of counting ops")
    parser.add_argument("--runs", type=int, default=3,
                        help="with --python-time: runs per system (the median is shown)")
    options, megatron_flags = parser.parse_known_args(own)
    if options.python_time:
        return python_time(options, megatron_flags + program)
    systems = options.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; expected {', '.join(SYSTEMS)}")
    program_flags = program_argv(megatron_flags + program)
    results = []
    for system in SYSTEMS:  # in table order, whatever the order asked
        if system in systems:
            result = measure(system, program_flags)
            print(f"{SYSTEMS[system]}: {result.ops:,} ops, "
                  f"{sum(result.collectives.values()):,} collectives, "
                  f"{sum(result.host_syncs.values())} host syncs ({result.seconds:.0f} s)",
                  file=sys.stderr, flush=True)
            results.append(result)
    checks = [check_shape_independence(program_flags, results)] if "fsdp2" in systems else []
    shown = " ".join(program_flags).replace(f"{ROOT}/", "")  # paths relative to the repository
    print(f"Host work of one training iteration (iteration 2, rank {RANK} of "
          f"{NODES} x {GPUS_PER_NODE} GPUs): {shown}\n")
    print(render(results, options.top, tuple(checks)))
    if options.json is not None:
        options.json.write_text(json.dumps({
            "argv": program_flags, "nodes": NODES, "gpus_per_node": GPUS_PER_NODE,
            "rank": RANK, "checks": checks,
            "systems": {r.system: dataclasses.asdict(r) for r in results},
        }, indent=1) + "\n")
        print(f"wrote {options.json}")
    return 0


def python_time(options, megatron_flags: list[str]) -> int:
    from scripts.bench import host_python

    results = host_python.measure(runs=options.runs, overrides=megatron_flags)
    print(host_python.render(results))
    if options.json is not None:
        options.json.write_text(json.dumps({
            "argv": host_python.probe_argv(megatron_flags),
            "systems": {r.system: dataclasses.asdict(r) for r in results}}, indent=1) + "\n")
        print(f"wrote {options.json}")
    return 0


def check_shape_independence(argv: list[str], results: list[HostWork]) -> str:
    """FSDP2 ran at a small hidden size: the model alone must issue as many ops there (on
    the CPU) as at the setting's shape (on meta)."""
    full = next((r for r in results if r.system == "model"), None) or count_model_alone(argv)
    small = count_model_alone(argv + ["--hidden-size", str(FSDP2_HIDDEN),
                                      "--num-attention-heads", str(FSDP2_HEADS)], device="cpu")
    if full.op_counts != small.op_counts:
        raise RuntimeError(f"the model alone issues {full.ops:,} ops at {full.shape} on meta "
                           f"but {small.ops:,} at {small.shape} on the CPU: FSDP2's count at "
                           "the small shape does not stand for the setting's")
    return (f"the model alone issues the same {full.ops:,} ops at {small.shape} on the CPU as "
            f"at {full.shape} on meta, op for op: FSDP2's count at the small shape holds")


if __name__ == "__main__":
    sys.exit(main())
