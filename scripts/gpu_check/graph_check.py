"""The whole iteration as one CUDA graph against the same iteration eager, on one GPU.

    python -m scripts.gpu_check.graph_check --out DIR [--layers 2] [--micro-batch 2]
        [--iterations 20]

Two engines of the GPU check's section e (the 18B's block shape, bf16 ZeRO++ with qwZ and
qgZ, activation checkpointing; one rank on NCCL) are built from the same initial values
and trained on the same token batches: one eagerly, one through ``IterationGraph``
([Note: iteration graphs] in zeropp/acceleration/cuda_graph.py). Per iteration it records the loss,
the host's time to issue it (until the call returns) and the GPU's time (CUDA events). It
writes DIR/gpu_graph_check.json and prints a table:
- losses equal to rounding (largest relative difference; CUDA's atomics in the embedding's
  backward make two eager runs differ in the last bits too);
- host time per iteration against the GPU's, eager and graphed (target: graphed host time at
  most 10% of the GPU's);
- the host-side records after the graphed run: step count and bytes per iteration equal
  the eager run's.
Exit status 0 when all three hold, 1 otherwise, 3 without CUDA.

The learning rate is 1e-4 (``--lr``): at the section's 1e-3, with no warm-up, the 18B's
block diverged (the loss rose from 12.0 to 16.6 over 20 iterations on the H200), where the
last bits in which two correct runs differ grow into differences the loss limit would take
for a fault. (A smaller lr also shrinks what a replay reading stale weights would change, so
the report gives, for scale, the difference while both runs were still eager: rounding.)
The JSON is written after each run, and SIGTERM (the session's time limit) ends the run in
progress and still writes it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

from scripts.gpu_check.report import sigterm_raises, write_json_atomically

LOSS_RTOL = 2e-3
HOST_FRACTION_TARGET = 0.10
REPORT_NAME = "gpu_graph_check.json"  # written into --out


def _train(engine, batches: torch.Tensor, call) -> dict:
    """Train on ``batches`` through ``call(tokens) -> loss`` (one whole iteration)."""
    losses, host, gpu = [], [], []
    engine.comm_bytes(reset=True)
    for tokens in batches:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        loss = call(tokens)
        end.record()
        host.append(time.perf_counter() - began)
        end.synchronize()
        gpu.append(start.elapsed_time(end) / 1e3)
        losses.append(float(loss))
    sent = engine.comm_bytes(reset=True)
    return {"losses": losses, "host_s": host, "gpu_s": gpu,
            "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "bytes_per_iteration": {phase: {k: v / len(batches) for k, v in where.items()}
                                    for phase, where in sent.items()}}


def _steady(values: list[float], skip: int) -> float:
    return statistics.median(values[skip:]) if len(values) > skip else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_check.graph_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device: the graph check needs one", file=sys.stderr)
        return 3
    from scripts.gpu_check.engine import ensure_process_group

    args.out.mkdir(parents=True, exist_ok=True)
    ensure_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    results: dict = {"layers": args.layers, "micro_batch": args.micro_batch,
                     "iterations": args.iterations, "warmup": args.warmup, "lr": args.lr,
                     "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    _write(args.out, results)  # something to read even if the first build is stopped
    try:
        with sigterm_raises():  # the session's time limit: SystemExit, the report kept
            for mode in ("eager", "graphed"):
                _run_mode(mode, args, device, results)
                _write(args.out, results)
    finally:
        _write(args.out, results)
    report = _verdict(results, skip=args.warmup + 1)
    _write(args.out, results)
    print(report, flush=True)
    return 0 if results.get("passed") else 1


def _run_mode(mode: str, args: argparse.Namespace, device: torch.device, results: dict) -> None:
    """Build the engine and train it ``mode`` ("eager" or "graphed"), into ``results[mode]``."""
    from scripts.gpu_check.engine import (
        GPT2_VOCAB,
        build_18b_block_engine,
        free_memory,
        token_batches,
        train_iteration,
    )
    from zeropp.acceleration.cuda_graph import CudaGraphOptions, IterationGraph, capture_blockers

    free_memory()
    torch.manual_seed(0)
    engine, tokens, config = build_18b_block_engine(device, args.layers, args.micro_batch,
                                                    lr=args.lr)
    seq = tokens.shape[1] - 1
    batches = token_batches(args.iterations, args.micro_batch, seq, GPT2_VOCAB).to(device)
    call = functools.partial(train_iteration, engine)
    graph = None
    if mode == "graphed":
        results["blockers"] = capture_blockers(engine)
        graph = call = IterationGraph(engine, call, CudaGraphOptions(True, args.warmup),
                                      log=lambda line: print(line, flush=True))
    torch.cuda.reset_peak_memory_stats()
    try:
        results[mode] = _train(engine, batches, call)
        results[mode]["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if graph is not None:
            results[mode]["captured"] = graph.captured
            results[mode]["replays"] = graph.replays
    except BaseException as error:  # the report says what failed (SIGTERM included)
        results[mode] = {"error": f"{type(error).__name__}: {error}"}
        print(f"{mode}: {type(error).__name__}: {error}", flush=True)
        if not isinstance(error, Exception):
            raise
    finally:
        try:  # a failed capture may leave work the close cannot finish
            engine.close()
        except Exception as error:  # noqa: BLE001
            results.setdefault(f"{mode}_close_error", f"{type(error).__name__}: {error}")


def _write(out: Path, results: dict) -> None:
    """The report as it stands, whole or not at all."""
    write_json_atomically(out / REPORT_NAME, results, indent=2)


def _verdict(results: dict, skip: int) -> str:
    eager, graphed = results.get("eager", {}), results.get("graphed", {})
    if "losses" not in eager or "losses" not in graphed:
        results["passed"] = False
        return f"graph check: failed to run: {eager.get('error') or graphed.get('error')}"
    differences = [abs(a - b) / max(abs(a), 1e-12)
                   for a, b in zip(eager["losses"], graphed["losses"], strict=True)]
    summary = {
        "max_relative_loss_difference": max(differences),
        # Both runs are eager (or capturing) up to here: their difference is the rounding
        # floor two correct runs show (the embedding's atomics), for scale.
        "eager_phase_relative_difference": max(differences[:skip]) if skip else 0.0,
        "eager_host_ms": _steady(eager["host_s"], skip) * 1e3,
        "eager_gpu_ms": _steady(eager["gpu_s"], skip) * 1e3,
        "graphed_host_ms": _steady(graphed["host_s"], skip) * 1e3,
        "graphed_gpu_ms": _steady(graphed["gpu_s"], skip) * 1e3,
    }
    summary["graphed_host_fraction"] = summary["graphed_host_ms"] / summary["graphed_gpu_ms"]
    summary["same_records"] = (eager["global_steps"] == graphed["global_steps"]
                               and eager["micro_steps"] == graphed["micro_steps"]
                               and eager["bytes_per_iteration"] == graphed["bytes_per_iteration"])
    results["summary"] = summary
    results["passed"] = (summary["max_relative_loss_difference"] <= LOSS_RTOL
                         and summary["graphed_host_fraction"] <= HOST_FRACTION_TARGET
                         and summary["same_records"] and graphed.get("captured", False))
    return "\n".join([
        "graph check (median of steady iterations)",
        f"  eager:   host {summary['eager_host_ms']:.2f} ms, GPU {summary['eager_gpu_ms']:.2f} ms",
        f"  graphed: host {summary['graphed_host_ms']:.2f} ms, GPU "
        f"{summary['graphed_gpu_ms']:.2f} ms (host {summary['graphed_host_fraction']:.1%} of GPU,"
        f" target {HOST_FRACTION_TARGET:.0%})",
        f"  losses: largest relative difference {summary['max_relative_loss_difference']:.2e}"
        f" (limit {LOSS_RTOL:g}; {summary['eager_phase_relative_difference']:.2e} while both"
        f" ran eagerly); records equal: {summary['same_records']}",
        f"  passed: {results['passed']}",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
