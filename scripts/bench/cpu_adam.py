"""The offloaded optimizer step's throughput on this machine: AdamW over fp32 on the CPU.

    python -m scripts.bench.cpu_adam [--threads 2] [--numel 50000000] [--tensors 4]
                                     [--steps 5] [--skip-deepspeed] [--json FILE]

ZeRO-Offload ([Note: offload] in zeropp/offload.py) steps each rank's fp32 master shard on
the host, one tensor per run of a parameter group, with the torch optimizer's multi-tensor
update. This measures, side by side in one run, the parameters updated per second of:

- torch's AdamW, ``fused=True`` (torch's CPU kernel, one pass per tensor);
- torch's AdamW, ``foreach=True`` (what the engine uses on the CPU when the user left it to
  torch: a dozen multi-tensor ops per group);
- torch's AdamW, the per-tensor loop (``foreach=False``);
- DeepSpeed's ``DeepSpeedCPUAdam`` (its AVX C++ op, JIT-built on first use; the row says
  why where it cannot be built).

Every implementation starts from the same weights, moments and gradients; after the timed
steps the weights are compared with the foreach update's (the largest difference is
printed: the same arithmetic gives 0, a fused kernel rounds differently).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _tensors(numel: int, count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sizes = [numel // count + (1 if i < numel % count else 0) for i in range(count)]
    return [torch.randn(size, generator=generator) for size in sizes]


def _build(kind: str, params: list[torch.nn.Parameter]):
    if kind == "torch fused":
        return torch.optim.AdamW(params, fused=True, **HYPER)
    if kind == "torch foreach":
        return torch.optim.AdamW(params, foreach=True, **HYPER)
    if kind == "torch per-tensor loop":
        return torch.optim.AdamW(params, foreach=False, **HYPER)
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # JIT-builds its C++ op on first use

    return DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER)


def run_one(kind: str, numel: int, count: int, steps: int, warmup: int) -> dict:
    """Median seconds per step and the weights after ``warmup + steps`` steps."""
    params = [torch.nn.Parameter(t) for t in _tensors(numel, count, seed=0)]
    for param, grad in zip(params, _tensors(numel, count, seed=1), strict=True):
        param.grad = grad
    optimizer = _build(kind, params)
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
    seconds = statistics.median(times)
    return {"implementation": kind, "seconds_per_step": seconds,
            "params_per_second": numel / seconds,
            "weights": torch.cat([p.detach() for p in params])}


KINDS = ("torch fused", "torch foreach", "torch per-tensor loop", "DeepSpeedCPUAdam")


def run(threads: int, numel: int, count: int, steps: int, warmup: int,
        skip_deepspeed: bool) -> list[dict]:
    torch.set_num_threads(threads)
    rows, reference = [], None
    for kind in KINDS:
        if kind == "DeepSpeedCPUAdam" and skip_deepspeed:
            continue
        try:
            row = run_one(kind, numel, count, steps, warmup)
        except Exception as error:  # noqa: BLE001 - a build failure is a result to report
            rows.append({"implementation": kind, "error": str(error).splitlines()[0][:160]})
            continue
        weights = row.pop("weights")
        if kind == "torch foreach":
            reference = weights
        row["_weights"] = weights
        rows.append(row)
    measured = [r for r in rows if "error" not in r]
    fastest = max(r["params_per_second"] for r in measured)
    for row in measured:
        row["vs_fastest"] = row["params_per_second"] / fastest
        weights = row.pop("_weights")
        row["max_abs_diff_vs_foreach"] = (float((weights - reference).abs().max())
                                          if reference is not None else None)
    return rows


def table(rows: list[dict], threads: int, numel: int, count: int) -> str:
    lines = [f"AdamW step over {numel:,} fp32 parameters in {count} tensors, {threads} "
             "thread(s), median of the timed steps",
             "",
             "| implementation | s / step | M params / s | vs fastest | max abs diff vs foreach |",
             "|---|---:|---:|---:|---:|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['implementation']} | not run: {row['error']} | | | |")
            continue
        diff = row["max_abs_diff_vs_foreach"]
        lines.append(f"| {row['implementation']} | {row['seconds_per_step']:.3f} | "
                     f"{row['params_per_second'] / 1e6:.0f} | {row['vs_fastest']:.2f}x | "
                     f"{'-' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--tensors", type=int, default=4,
                        help="tensors the parameters are split into (one per parameter-group run)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--skip-deepspeed", action="store_true",
                        help="leave out DeepSpeedCPUAdam (its first use compiles C++)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    for name in ("threads", "numel", "tensors", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.numel < args.tensors:
        parser.error("--numel must be at least --tensors")
    rows = run(args.threads, args.numel, args.tensors, args.steps, args.warmup,
               args.skip_deepspeed)
    print(table(rows, args.threads, args.numel, args.tensors), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
