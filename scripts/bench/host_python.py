"""The host's Python time per training iteration, on the CPU, FSDP2 beside this engine.

    python -m scripts.bench.host_ops --python-time [--runs 3] [--json FILE.json]

At a small width kernels cost almost nothing, so what an iteration costs the host is the
Python that issues them. The setting (issue 47's probe):
- the tutorial's 18B flags at hidden ``HIDDEN`` (``HEADS`` heads): its 40 layers, sequence
  512, fp16, activation checkpointing;
- blocks split into units as the 18B's are: ``stage3_max_live_parameters`` 20 h^2 (units
  of at most a quarter, 5 h^2: attention and each of the MLP's Linears) and
  ``stage3_param_persistence_threshold`` 16 h (the layer norms and biases stay gathered);
- rank 0 of 4 nodes x 16 GPUs on torch's ``fake`` process group (collectives move nothing);
- FSDP2 as ``host_ops`` runs it (one group per block, fp16 compute, AdamW); this engine as
  the program builds it (``pretrain_gpt.build_engine``) from the tutorial's JSON (ZeRO++)
  or the dry run's ZeRO-3 baseline of it, with ``overlap_comm`` off: the CPU's host-thread
  execution would issue qgZ's hops from a worker thread that cProfile does not see, while
  the inline execution issues every collective and kernel on the training thread, as the
  CUDA execution model does ([Note: execution models] in zeropp/comm/streams.py);
- per run: a fresh build, ``WARMUP`` eager iterations, then ``PROFILED`` iterations under
  cProfile (forward, ``lm_loss``, backward, step; FSDP2 also ``zero_grad``); a run's figure
  is their mean; the table shows the median of ``--runs`` runs.

Python self-time (cProfile's tottime) is split by owner, from each function's file:
- ``engine``: this engine's modules (``zeropp/``) without its CPU reference kernels, plus
  ``torch/distributed/`` (FSDP2's own code lives there; this engine's collectives call the
  process group's methods directly, [Note: issued to the process group] in
  zeropp/comm/collectives.py): the figure the issue's targets compare;
- ``reference kernels``: ``zeropp/kernels/reference.py``, the CPU stand-in for Triton;
- ``torch.distributed`` (part of ``engine``, shown alone too), ``model`` (megatron_lite),
  ``torch`` (nn modules, autograd, optim, checkpoint), and ``builtins`` (C functions and
  tensor methods called from Python: their own time is the ops', not Python's).
``calls`` counts the engine's Python function calls (primitive calls, cProfile's ``cc``).
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import json
import os
import pstats
import statistics
import tempfile
from pathlib import Path

HIDDEN, HEADS = 64, 4
NODES, GPUS_PER_NODE, RANK = 4, 16, 0
WARMUP, PROFILED = 2, 3
SYSTEMS = ("fsdp2", "zero3", "zeropp")
LABELS = {"fsdp2": "FSDP2", "zero3": "ZeRO-3", "zeropp": "ZeRO++"}
OWNERS = ("engine", "torch.distributed", "reference kernels", "model", "torch", "builtins",
          "other")


@dataclasses.dataclass
class PythonTime:
    """One system's Python time per iteration (ms) by owner and engine calls, per run."""

    system: str
    runs: list[dict[str, float]]  # per run: owner -> ms per iteration, and "calls"

    def median(self, key: str) -> float:
        return statistics.median(run[key] for run in self.runs)


def owner_of(filename: str) -> str:
    """Which owner a function's own time goes to (module docstring)."""
    path = filename.replace(os.sep, "/")
    if path == "~" or path.startswith("<"):
        return "builtins"
    if "/zeropp/kernels/reference.py" in path:
        return "reference kernels"
    if "/torch/distributed/" in path:
        return "torch.distributed"
    if "/zeropp/" in path:
        return "engine"
    if "/megatron_lite/" in path:
        return "model"
    if "/torch/" in path:
        return "torch"
    return "other"


def by_owner(profile: cProfile.Profile, iterations: int) -> dict[str, float]:
    """{owner: ms per iteration, "calls": engine calls per iteration}; ``engine`` includes
    torch.distributed."""
    totals = dict.fromkeys(OWNERS, 0.0)
    calls = 0
    for (filename, _line, _name), (primitive, _total, own, _cum, _callers) in \
            pstats.Stats(profile).stats.items():
        owner = owner_of(filename)
        totals[owner] += own
        if owner in ("engine", "torch.distributed"):
            calls += primitive
    totals["engine"] += totals["torch.distributed"]
    figures = {owner: 1e3 * seconds / iterations for owner, seconds in totals.items()}
    figures["calls"] = calls / iterations
    return figures


def probe_argv(overrides: list[str] | None = None) -> list[str]:
    """The tutorial's flags at the probe's width (``overrides`` replace flags)."""
    from scripts.bench.host_setup import program_argv

    return program_argv(["--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
                         *(overrides or [])])


def probe_ds_config(argv: list[str], system: str) -> dict:
    """``system``'s DeepSpeed JSON with the 18B's unit split at this width and the inline
    execution (module docstring)."""
    from scripts.bench.host_setup import engine_ds_config

    config = engine_ds_config(argv, system)
    config.setdefault("zero_optimization", {}).update(
        stage3_max_live_parameters=20 * HIDDEN**2,
        stage3_param_persistence_threshold=16 * HIDDEN, overlap_comm=False)
    return config


@contextlib.contextmanager
def fake_world(world_size: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised")
    saved = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                  "LOCAL_WORLD_SIZE")}
    os.environ.update(RANK=str(RANK), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(RANK % GPUS_PER_NODE), LOCAL_WORLD_SIZE=str(GPUS_PER_NODE))
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def profile_iterations(step, warmup: int = WARMUP, profiled: int = PROFILED) -> dict:
    for _ in range(warmup):
        step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(profiled):
        step()
    profile.disable()
    return by_owner(profile, profiled)


def fsdp2_run(argv: list[str], warmup: int, profiled: int) -> dict:
    from megatron_lite.model import lm_loss
    from scripts.bench.host_setup import fsdp2_training, math_attention, one_batch

    with fake_world(NODES * GPUS_PER_NODE), math_attention("cpu"):
        args, model, optimizer = fsdp2_training(argv, NODES, GPUS_PER_NODE)
        tokens, labels, loss_mask = one_batch(args, "cpu")

        def step() -> None:
            lm_loss(model(tokens), labels, loss_mask).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return profile_iterations(step, warmup, profiled)


def engine_run(argv: list[str], system: str, warmup: int, profiled: int) -> dict:
    from megatron_lite.model import lm_loss
    from megatron_lite.pretrain_gpt import build_engine, build_meta_model
    from scripts.bench.host_setup import math_attention, one_batch

    with tempfile.TemporaryDirectory(prefix="zeropp-host-python-") as folder, \
            fake_world(NODES * GPUS_PER_NODE), math_attention("cpu"):
        path = Path(folder) / "ds_config.json"
        path.write_text(json.dumps(probe_ds_config(argv, system)))
        args, ds_config = _program_args(argv, path)
        model = build_meta_model(args, _vocab_size(args))
        engine = build_engine(args, model, ds_config)
        tokens, labels, loss_mask = one_batch(args, "cpu")
        try:
            def step() -> None:
                loss = lm_loss(engine(tokens), labels, loss_mask)
                engine.backward(loss)
                engine.step()

            return profile_iterations(step, warmup, profiled)
        finally:
            engine.close()


def _program_args(argv: list[str], ds_config_path: Path):
    """(parsed args, reconciled EngineConfig) of ``argv`` with this JSON, as the program
    reads them for a rank of ``NODES x GPUS_PER_NODE``."""
    from megatron_lite.arguments import parse_args, validate_args
    from megatron_lite.ds_config import read_ds_config
    from megatron_lite.simulate import training_argv

    args = parse_args(training_argv(argv, GPUS_PER_NODE, iterations=3,
                                    ds_config=str(ds_config_path)))
    ds_config = read_ds_config(args)
    validate_args(args, NODES * GPUS_PER_NODE)
    return args, ds_config


def _vocab_size(args) -> int:
    from data.tokenizers import build_tokenizer

    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                           merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                           vocab_size=args.vocab_size).vocab_size


def measure(systems: tuple[str, ...] = SYSTEMS, runs: int = 3, warmup: int = WARMUP,
            profiled: int = PROFILED, overrides: list[str] | None = None) -> list[PythonTime]:
    """Each system's Python time per iteration over ``runs`` fresh runs."""
    from scripts.bench.host_setup import optimizers_as_on_cuda

    argv = probe_argv(overrides)
    results = {system: PythonTime(system, []) for system in systems}
    with optimizers_as_on_cuda():
        for _ in range(runs):  # interleaved: a noisy spell hits every system alike
            for system in systems:
                run = (fsdp2_run(argv, warmup, profiled) if system == "fsdp2"
                       else engine_run(argv, system, warmup, profiled))
                results[system].runs.append(run)
    return list(results.values())


def render(results: list[PythonTime]) -> str:
    base = next((r for r in results if r.system == "fsdp2"), None)
    lines = ["| system | engine Python ms/iteration | Python calls | vs FSDP2 | of which "
             "torch.distributed | reference kernels | model | torch | builtins |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        engine = result.median("engine")
        ratio = f"{engine / base.median('engine'):.2f}x" if base and result is not base else ""
        lines.append(
            f"| {LABELS[result.system]} | {engine:.1f} | {result.median('calls'):,.0f} | "
            f"{ratio} | {result.median('torch.distributed'):.1f} | "
            f"{result.median('reference kernels'):.1f} | {result.median('model'):.1f} | "
            f"{result.median('torch'):.1f} | {result.median('builtins'):.1f} |")
    runs = len(results[0].runs) if results else 0
    lines.append(f"\nms per iteration, median of {runs} run(s) (each a mean over profiled "
                 f"iterations under cProfile); the tutorial's flags at hidden {HIDDEN}, rank "
                 f"{RANK} of {NODES} x {GPUS_PER_NODE} on the fake process group")
    return "\n".join(lines)
