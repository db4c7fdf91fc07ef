"""GPU check sections c, d and e: the engine on one GPU with NCCL.

c. A tiny GPT trained a few steps by the engine on CUDA (its CUDA execution model, an NCCL
   process group of one rank) gives the losses of the same training on CPU with gloo, run
   at the same time in a subprocess. ZeRO-3 and ZeRO++ (qwZ + qgZ; hpZ needs two ranks on a
   node) are both compared; see LOSS_RTOL for the tolerances.
d. One iteration of a larger GPT with ZeRO++ under torch.profiler: kernels run on more than
   one stream and the gather and reduce streams overlap the compute stream. Marker kernels
   launched on each stream before the iteration say which profiler stream id is which; the
   overlap is computed from the chrome trace, which is kept in the out dir.
e. Host time against GPU time per iteration for the 18B's block shape
   (configs/models/gpt_18b.args) with few layers, so it fits one GPU: wall clock and CUDA
   events per iteration, and the GPU's busy time from one profiled iteration.

`python -m scripts.gpu_check.engine cpu-losses --steps N --out FILE` is section c's
CPU reference (run by the section itself).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.model import GPTConfig, GPTModel
from scripts.gpu_check.report import (
    TRACE_NAME,
    Outcome,
    analyse_streams,
    covered_seconds,
    gpu_events_from_chrome_trace,
    host_blocked_seconds,
    median_seconds,
    merge_intervals,
    one_line,
    write_json_atomically,
)
from zeropp.comm.streams import COMPLETION_LANES
from zeropp.deepspeed_api.initialize import QuantizationOptions, build_engine, make_loss_scaler
from zeropp.sharded_model import ShardingOptions

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_ARGS_18B = REPO_ROOT / "configs" / "models" / "gpt_18b.args"
HOST_TRACE_NAME = "gpu_check_host_trace.json"  # section e's profiled iteration
GPT2_VOCAB = 50257

ZEROPP = QuantizationOptions(quantized_weights=True, quantized_gradients=True)
SYSTEMS = {"zero3": QuantizationOptions(), "zeropp": ZEROPP}
# Largest relative loss difference, CUDA/NCCL against CPU/gloo. The kernels are
# bit-identical on both (section a), matmuls and reductions are not (different summation
# orders, ~1e-6 relative in fp32 without TF32). ZeRO-3 stays within that after a few Adam
# steps; with qgZ's int4 gradients such a difference can move a value across a rounding
# boundary, changing it by a whole quantization step, so ZeRO++ gets more room.
LOSS_RTOL = {"zero3": 1e-4, "zeropp": 2e-3}
TINY_GPT = dict(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=512,
                max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
TINY_BATCH, TINY_SEQ = 4, 32
# Section d: large enough that compute kernels outlast the host's launches, so the side
# streams have compute to overlap.
OVERLAP_GPT = {"full": dict(num_layers=4, hidden_size=2048, num_attention_heads=16, seq=1024,
                            micro_batch=4),
               "quick": dict(num_layers=2, hidden_size=1024, num_attention_heads=16, seq=512,
                             micro_batch=2)}
WARMUP_ITERATIONS = 2  # the first iteration records the gather order and compiles kernels
MARKER_CYCLES = 20_000  # a few microseconds of spinning per marker kernel
# The side streams section d labels: the lanes and the gather lane's completion stream, where
# qwZ's dequantize runs ([Note: completion steps] in zeropp/comm/streams.py).
STREAM_LANES = ("gather", "reduce", COMPLETION_LANES["gather"])
# Section e passes when the GPU is busy for at least this share of an iteration's wall time:
# below it the host (Python, launches, syncs) leaves the GPU waiting.
GPU_BUSY_TARGET = 0.7


# ---- shared set-up ---------------------------------------------------------------------------


def ensure_process_group(backend: str) -> None:
    """A process group of one rank on `backend`, through a file store in a fresh temporary
    directory (no port to pick, nothing to collide with)."""
    if dist.is_initialized():
        if dist.get_backend() != backend:
            raise RuntimeError(f"a {dist.get_backend()} process group is already initialized, "
                               f"this section needs {backend}")
        return
    if backend == "nccl":
        torch.cuda.set_device(0)
    store = Path(tempfile.mkdtemp(prefix="gpu_check_store_")) / "store"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def read_model_args(path: Path) -> dict[str, int]:
    """`--flag value` pairs of a configs/models/*.args file, as ints (comments skipped)."""
    values: dict[str, int] = {}
    for line in path.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) == 2 and words[0].startswith("--"):
            values[words[0][2:]] = int(words[1])
    return values


def build_gpt_engine(config: GPTConfig, device: torch.device, dtype: torch.dtype,
                     quantization: QuantizationOptions, sharding: ShardingOptions,
                     lr: float = 1e-3):
    """The engine over a GPT built on the meta device (each rank materializes its shard),
    as the application builds it."""
    with torch.device("meta"):
        model = GPTModel(config)
    return build_engine(model, lr=lr, weight_decay=0.01, gradient_clipping=1.0, dtype=dtype,
                        loss_scaler=make_loss_scaler(dtype == torch.float16),
                        quantization=quantization, sharding=sharding, device=device)


def token_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """(steps, batch, seq + 1) token ids from a CPU generator: the same on every device."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, batch, seq + 1), generator=generator)


def train_iteration(engine, tokens: torch.Tensor) -> torch.Tensor:
    """Forward, backward and step on one micro-batch of `tokens` (batch, seq + 1)."""
    logits = engine(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                           tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    return loss.detach()


def free_memory() -> None:
    """Give the memory of engines no longer referenced back to the GPU before the next one
    is built (sections run one after another in one process in the tests)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- section c -------------------------------------------------------------------------------


def _train_tiny_gpt(device: torch.device, quantization: QuantizationOptions,
                    batches: torch.Tensor) -> dict[str, Any]:
    engine = build_gpt_engine(GPTConfig(**TINY_GPT), device, torch.float32, quantization,
                              ShardingOptions(persistence_threshold=0))
    try:
        losses = [float(train_iteration(engine, batch.to(device))) for batch in batches]
        return {"losses": losses, "execution": type(engine.sharded.comm.execution).__name__}
    finally:
        engine.close()


def tiny_gpt_losses(device: torch.device, steps: int) -> dict[str, Any]:
    """Per system: the losses of `steps` fp32 training steps of the tiny GPT on `device`, and
    the execution model the engine took there."""
    batches = token_batches(steps, TINY_BATCH, TINY_SEQ, TINY_GPT["vocab_size"])
    result: dict[str, Any] = {}
    for system, quantization in SYSTEMS.items():
        result[system] = _train_tiny_gpt(device, quantization, batches)
        free_memory()
    return result


def compare_losses(on_gpu: dict[str, list[float]], on_cpu: dict[str, list[float]],
                   rtol: dict[str, float] = LOSS_RTOL) -> dict[str, dict[str, Any]]:
    """Per system: the largest relative difference between the two runs' losses and whether
    it is within the system's tolerance (non-finite or missing losses never are)."""
    verdicts = {}
    for system, tolerance in rtol.items():
        gpu, cpu = on_gpu.get(system, []), on_cpu.get(system, [])
        finite = bool(gpu) and len(gpu) == len(cpu) and all(
            math.isfinite(v) for v in [*gpu, *cpu])
        worst = max((abs(g - c) / max(abs(c), 1e-12) for g, c in zip(gpu, cpu, strict=False)),
                    default=math.inf) if finite else math.inf
        verdicts[system] = {"max_relative_difference": worst if finite else None,
                            "tolerance": tolerance, "within": finite and worst <= tolerance}
    return verdicts


def start_cpu_reference(out_path: Path, steps: int) -> subprocess.Popen:
    """The CPU/gloo run of section c, in a subprocess that sees no GPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen(
        [sys.executable, "-m", "scripts.gpu_check.engine", "cpu-losses",
         "--steps", str(steps), "--out", str(out_path)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def check_engine_against_gloo(out_dir: Path, steps: int = 5, timeout_s: float = 300) -> Outcome:
    """Section c."""
    reference_path = out_dir / "engine_cpu_losses.json"
    reference_path.unlink(missing_ok=True)  # never compare with an earlier run's losses
    worker = start_cpu_reference(reference_path, steps)  # trains while the GPU does
    try:
        ensure_process_group("nccl")
        # fp32 matmuls in fp32: TF32 would be a 1e-3 difference of its own.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        on_gpu = tiny_gpt_losses(torch.device("cuda", torch.cuda.current_device()), steps)
        output, _ = worker.communicate(timeout=timeout_s)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    if worker.returncode != 0 or not reference_path.exists():
        tail = " | ".join(output.strip().splitlines()[-3:])
        return Outcome("fail", f"the CPU/gloo reference run failed (exit {worker.returncode}): "
                       f"{tail}", {"gpu": on_gpu})
    on_cpu = json.loads(reference_path.read_text())
    verdicts = compare_losses({s: r["losses"] for s, r in on_gpu.items()},
                              {s: r["losses"] for s, r in on_cpu.items()})
    figures = {"steps": steps, "gpu": on_gpu, "cpu": on_cpu, "comparison": verdicts,
               "model": TINY_GPT, "batch": TINY_BATCH, "seq": TINY_SEQ}
    executions = {s: r["execution"] for s, r in on_gpu.items()}
    if any(name != "CudaExecution" for name in executions.values()):
        return Outcome("fail", f"the engine on CUDA did not take the CUDA execution model: "
                       f"{executions}", figures)
    diffs = ", ".join(f"{s} {v['max_relative_difference']:.1e}" if v["max_relative_difference"]
                      is not None else f"{s} non-finite" for s, v in verdicts.items())
    if not all(v["within"] for v in verdicts.values()):
        return Outcome("fail", f"losses differ from CPU/gloo beyond tolerance "
                       f"({diffs}; tolerances {LOSS_RTOL})", figures)
    return Outcome("pass", f"{steps} steps, largest relative loss difference: {diffs}", figures)


def cpu_reference_main(steps: int, out_path: Path) -> int:
    ensure_process_group("gloo")
    try:
        result = tiny_gpt_losses(torch.device("cpu"), steps)
    finally:
        dist.destroy_process_group()
    write_json_atomically(out_path, result)
    return 0


# ---- section d -------------------------------------------------------------------------------


def launch_stream_markers(streams: dict[str, torch.cuda.Stream]) -> None:
    """One spinning kernel on each side stream, then one on the compute stream, one after
    the other: in the profiler's trace they map its stream ids to the engine's lanes."""
    if not hasattr(torch.cuda, "_sleep"):  # private API; without it the analysis falls back
        return                              # to taking the busiest stream as compute
    for lane in STREAM_LANES:
        with torch.cuda.stream(streams[lane]):
            torch.cuda._sleep(MARKER_CYCLES)
        torch.cuda.synchronize()
    torch.cuda._sleep(MARKER_CYCLES)
    torch.cuda.synchronize()


def overlap_verdict(analysis: dict[str, Any]) -> Outcome:
    """Pass when kernels ran on more than one stream and each labelled side lane (gather,
    reduce, the gather's completion stream; or, without markers, at least two unlabelled side
    streams) overlapped compute."""
    lanes = analysis.get("lanes", {})
    if analysis.get("streams_with_events", 0) < 2:
        return Outcome("fail", f"GPU work on {analysis.get('streams_with_events', 0)} "
                       "stream(s) only", analysis)
    required = list(lanes)  # every labelled lane (or unlabelled side stream) must work
    if analysis.get("labels") != "marker kernels":
        if len(required) < 2:
            return Outcome("fail", "streams unlabelled (no marker kernels) and fewer than two "
                           "side streams", analysis)
    missing = [lane for lane in required if lanes.get(lane, {}).get("events", 0) == 0]
    if missing:
        return Outcome("fail", f"no GPU work on the {', '.join(missing)} stream(s)", analysis)
    parts = [f"{lane} {lanes[lane]['overlapped_s'] * 1e3:.2f} of "
             f"{lanes[lane]['busy_s'] * 1e3:.2f} ms" for lane in required]
    idle = [lane for lane in required if lanes[lane]["overlapped_s"] <= 0]
    busy = _compute_busy_note(analysis)
    if idle:
        return Outcome("fail", f"{', '.join(idle)} never overlapped compute ({'; '.join(parts)})"
                       f"{busy}", analysis)
    return Outcome("pass", f"{analysis['streams_with_events']} streams; overlapped compute: "
                   f"{'; '.join(parts)}{busy}", analysis)


def _compute_busy_note(analysis: dict[str, Any]) -> str:
    """How busy compute was over the iteration: where the host sets the pace (seen on an
    H100 at these sizes, docs/gpu_runs.md) the GPU idles between kernels and there is little
    compute for the side streams to hide under, whatever the engine does."""
    busy, span = analysis.get("compute_busy_s"), analysis.get("span_s")
    if not busy or not span:
        return ""
    note = f"; compute busy {busy * 1e3:.1f} of {span * 1e3:.1f} ms"
    if busy / span < 0.5:
        note += " (the GPU waits for the host: little compute to overlap)"
    return note


def check_stream_overlap(out_dir: Path, num_layers: int, hidden_size: int,
                         num_attention_heads: int, seq: int, micro_batch: int) -> Outcome:
    """Section d."""
    from torch.profiler import ProfilerActivity, profile

    from zeropp.comm.streams import CudaExecution

    free_memory()
    ensure_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    config = GPTConfig(num_layers=num_layers, hidden_size=hidden_size,
                       num_attention_heads=num_attention_heads, vocab_size=32000,
                       max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0)
    # Every unit gathered again in backward (reuse distance 0), so the gather stream works
    # in backward too, as it does at the paper's sizes.
    engine = build_gpt_engine(config, device, torch.bfloat16, ZEROPP,
                              ShardingOptions(persistence_threshold=0, max_reuse_distance=0))
    try:
        execution = engine.sharded.comm.execution
        if not isinstance(execution, CudaExecution):
            return Outcome("fail", f"the engine took {type(execution).__name__}, not "
                           "CudaExecution", {})
        tokens = token_batches(1, micro_batch, seq, config.vocab_size)[0].to(device)
        for _ in range(WARMUP_ITERATIONS):
            train_iteration(engine, tokens)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            launch_stream_markers({**execution.streams, COMPLETION_LANES["gather"]:
                                   execution.completion_stream("gather")})
            train_iteration(engine, tokens)
            torch.cuda.synchronize()
    finally:
        engine.close()
    trace_path = out_dir / TRACE_NAME
    profiler.export_chrome_trace(str(trace_path))
    analysis = analyse_streams(gpu_events_from_chrome_trace(json.loads(trace_path.read_text())),
                               side_lanes=STREAM_LANES)
    analysis.update(trace=trace_path.name, model=dict(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        seq=seq, micro_batch=micro_batch, dtype="bf16", system="ZeRO++ (qwZ + qgZ)"))
    return overlap_verdict(analysis)


# ---- section e -------------------------------------------------------------------------------


def host_gpu_verdict(walls: list[float], gpu_spans: list[float], issues: list[float],
                     gpu_busy: float, target: float = GPU_BUSY_TARGET,
                     launches: int = 0, host_blocked: float = 0.0) -> Outcome:
    """Medians of the timed iterations and the profiled iteration's GPU busy time; passes when
    the GPU was busy for `target` of the median wall time or more. ``launches``: the GPU
    events (kernels, copies, collectives) of one iteration; the host's issue time less
    ``host_blocked`` (its waits for the GPU inside the iteration, `host_blocked_seconds`)
    over them is the host cost per op the step-time model takes ([Note: host in the
    step-time model])."""
    wall = median_seconds(walls)
    figures = {"wall_s": wall, "gpu_event_s": median_seconds(gpu_spans),
               "host_issue_s": median_seconds(issues), "gpu_busy_s": gpu_busy,
               "gpu_busy_fraction": gpu_busy / wall, "target_fraction": target,
               "walls_s": walls, "gpu_events_s": gpu_spans, "host_issues_s": issues,
               "host_blocked_s": host_blocked}
    if launches > 0:
        own = max(figures["host_issue_s"] - host_blocked, 0.0)
        figures.update(launches=launches, host_seconds_per_op=own / launches)
    line = (f"wall {wall * 1e3:.1f} ms, CUDA events {figures['gpu_event_s'] * 1e3:.1f} ms, "
            f"GPU busy {gpu_busy * 1e3:.1f} ms ({figures['gpu_busy_fraction']:.0%}), host "
            f"returns after {figures['host_issue_s'] * 1e3:.1f} ms")
    if figures["gpu_busy_fraction"] < target:
        return Outcome("fail", f"host-bound: {line}", figures)
    return Outcome("pass", line, figures)


def build_18b_block_engine(device: torch.device, num_layers: int, micro_batch: int,
                           hidden_size: int | None = None,
                           num_attention_heads: int | None = None, lr: float = 1e-3):
    """(engine, tokens, config): the 18B's block shape (hidden size, heads, sequence) with
    `num_layers` layers, bf16 ZeRO++ with the tutorial's units and activation checkpointing,
    and one micro-batch of tokens on `device`."""
    shape = read_model_args(MODEL_ARGS_18B)
    seq = shape["seq-length"]
    config = GPTConfig(num_layers=num_layers,
                       hidden_size=hidden_size or shape["hidden-size"],
                       num_attention_heads=num_attention_heads or shape["num-attention-heads"],
                       vocab_size=GPT2_VOCAB,
                       max_position_embeddings=shape["max-position-embeddings"],
                       hidden_dropout=0.0, attention_dropout=0.0, checkpoint_activations=True)
    # configs/ds_zeropp_config.json's sharding, with the reuse distance at 0: with a few
    # layers the default 1e9 would keep every block gathered into backward, which the 40
    # layers of the real 18B do only for the last one.
    sharding = ShardingOptions(prefetch_bucket_numel=50_000_000,
                               max_live_numel=1_000_000_000, persistence_threshold=100_000,
                               max_reuse_distance=0, max_unit_numel=50_000_000)
    engine = build_gpt_engine(config, device, torch.bfloat16, ZEROPP, sharding, lr=lr)
    tokens = token_batches(1, micro_batch, seq, GPT2_VOCAB)[0].to(device)
    return engine, tokens, config


def check_host_vs_gpu(out_dir: Path, num_layers: int = 2, micro_batch: int = 2,
                      timed_iterations: int = 3, hidden_size: int | None = None,
                      num_attention_heads: int | None = None) -> Outcome:
    """Section e: `build_18b_block_engine`'s iteration, timed on the host and the GPU."""
    from torch.profiler import ProfilerActivity, profile

    free_memory()
    ensure_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    engine, tokens, config = build_18b_block_engine(device, num_layers, micro_batch,
                                                    hidden_size, num_attention_heads)
    seq = tokens.shape[1] - 1
    # Kernels the build compiled ahead, and what the first iteration still compiled: a
    # launch through kernel.run rather than the cache (0 when the build prepared them all).
    from zeropp.kernels.launcher import LAUNCHER

    compiles_before = LAUNCHER.plain_launches
    try:
        train_iteration(engine, tokens)
        torch.cuda.synchronize()
        first_iteration_compiles = LAUNCHER.plain_launches - compiles_before
        for _ in range(WARMUP_ITERATIONS - 1):
            train_iteration(engine, tokens)
        walls, spans, issues = [], [], []
        for _ in range(timed_iterations):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            began = time.perf_counter()
            start.record()
            train_iteration(engine, tokens)
            issues.append(time.perf_counter() - began)  # the host is done issuing
            end.record()
            end.synchronize()
            walls.append(time.perf_counter() - began)
            spans.append(start.elapsed_time(end) / 1e3)
        # GPU activity only: recording host ops would slow the host it is measuring.
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            train_iteration(engine, tokens)
            torch.cuda.synchronize()
    finally:
        engine.close()
    with torch.device("meta"):
        parameters = GPTModel(config).num_parameters()
    trace_path = out_dir / HOST_TRACE_NAME
    profiler.export_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())
    events = gpu_events_from_chrome_trace(trace)
    busy = covered_seconds(merge_intervals((e.start, e.end) for e in events))
    outcome = host_gpu_verdict(walls, spans, issues, busy, launches=len(events),
                               host_blocked=host_blocked_seconds(trace))
    outcome.figures.update(
        prepared_kernel_variants=engine.sharded.prepared_kernels,
        first_iteration_kernel_compiles=first_iteration_compiles,
        trace=trace_path.name, parameters=parameters, model=dict(
            num_layers=num_layers, hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads, seq=seq, micro_batch=micro_batch,
            shape_from=str(MODEL_ARGS_18B.relative_to(REPO_ROOT)), dtype="bf16",
            system="ZeRO++ (qwZ + qgZ), activation checkpointing"))
    return outcome


def worker_main(argv: list[str] | None, module: str, description: str, command: str,
                what: str, run) -> int:
    """The command line of a section's worker process: ``command --steps N --out FILE``,
    running ``run(steps, out)``; a failure is one line on stderr for the parent's report."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    commands = parser.add_subparsers(dest="command", required=True)
    worker = commands.add_parser(command, help=what)
    worker.add_argument("--steps", type=int, required=True)
    worker.add_argument("--out", type=Path, required=True, help="write the result here (JSON)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    try:
        return run(args.steps, args.out)
    except Exception as error:  # noqa: BLE001 (one line for the parent's report)
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, "scripts.gpu_check.engine",
                       "GPU check section c's CPU/gloo reference run", "cpu-losses",
                       "train the tiny GPT on CPU with gloo", cpu_reference_main)


if __name__ == "__main__":
    raise SystemExit(main())
