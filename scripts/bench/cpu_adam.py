"""The offloaded optimizer step's throughput on this machine: AdamW over fp32 on the CPU.

    python -m scripts.bench.cpu_adam [--threads 2] [--numel 50000000] [--tensors 4]
                                     [--steps 5] [--warmup 1] [--skip-deepspeed] [--json FILE]

ZeRO-Offload ([Note: offload] in zeropp/offload.py) steps each rank's fp32 master shard, its
Adam moments and its gradients in host memory, one tensor per run of a parameter group; on a
big model that host step is a large part of the iteration, so the kernel it runs matters.
This measures, side by side in one run and with the same hyperparameters, the parameters
updated per second of:

- torch's AdamW, ``fused=True`` (torch's CPU kernel: one pass over memory per tensor);
- torch's AdamW, ``foreach=True`` (multi-tensor ops, a dozen passes over memory per group);
- torch's AdamW, the per-tensor loop (``foreach=False``, torch's own CPU default);
- DeepSpeed's ``DeepSpeedCPUAdam`` with ``adamw_mode=True`` (its AVX C++ op, JIT-built on
  first use; where it cannot be built or imported the row says why, in one line).

It is the evidence for the engine's choice in ``_multi_tensor_settings``
(zeropp/optimizer.py): a GPU job's offloaded step runs torch's fused kernel, which needs no
C++ build; a CPU job keeps foreach, which keeps its offloaded run bit for bit the run without.

Correctness: every implementation starts from the same weights and fixed random gradients;
after exactly 3 steps its weights must agree with the foreach update's within ``--rtol``
(relative) and ``--atol`` (absolute, for weights near zero), and the largest absolute
difference is printed (the same arithmetic gives 0; another kernel rounds differently).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
CHECK_STEPS = 3
REFERENCE = "torch AdamW foreach=True"
DEEPSPEED = "DeepSpeedCPUAdam adamw_mode=True"
KINDS = ("torch AdamW fused=True", REFERENCE, "torch AdamW foreach=False (per-tensor loop)",
         DEEPSPEED)


def _tensors(numel: int, count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sizes = [numel // count + (1 if i < numel % count else 0) for i in range(count)]
    return [torch.randn(size, generator=generator) for size in sizes]


def _build(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == KINDS[0]:
        return torch.optim.AdamW(params, fused=True, **HYPER)
    if kind == KINDS[1]:
        return torch.optim.AdamW(params, foreach=True, **HYPER)
    if kind == KINDS[2]:
        return torch.optim.AdamW(params, foreach=False, **HYPER)
    # Imported here, not at the top: importing deepspeed is slow and its op compiles C++ on
    # first use, which neither --help nor the torch rows should pay for.
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER)


def run_one(kind: str, numel: int, count: int, steps: int, warmup: int) -> dict:
    """Median seconds per timed step, and the weights after exactly ``CHECK_STEPS`` steps."""
    params = [torch.nn.Parameter(t) for t in _tensors(numel, count, seed=0)]
    # The gradients stay the same every step: the update's cost does not depend on them, and
    # fixed ones make every implementation's trajectory comparable.
    for param, grad in zip(params, _tensors(numel, count, seed=1), strict=True):
        param.grad = grad
    start = time.perf_counter()
    optimizer = _build(kind, params)
    setup_seconds = time.perf_counter() - start  # DeepSpeed's JIT build or load, if any
    times, checked = [], None
    # Warm-up steps first (the first step allocates the moments); extra untimed steps where
    # fewer than CHECK_STEPS were asked for, so the correctness check always sees 3.
    for step in range(max(warmup + steps, CHECK_STEPS)):
        start = time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - start
        if warmup <= step < warmup + steps:
            times.append(elapsed)
        if step + 1 == CHECK_STEPS:  # copied outside the timed region
            checked = torch.cat([p.detach() for p in params])
    seconds = statistics.median(times)
    return {"implementation": kind, "seconds_per_step": seconds,
            "params_per_second": numel / seconds, "setup_seconds": setup_seconds,
            "_weights": checked}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0][:200] if text else ""
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def run(threads: int, numel: int, count: int, steps: int, warmup: int, skip_deepspeed: bool,
        rtol: float = 1e-5, atol: float = 1e-6) -> list[dict]:
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # DeepSpeed's op runs on the same OpenMP pool
    try:
        rows = []
        for kind in KINDS:
            if kind == DEEPSPEED and skip_deepspeed:
                continue
            try:
                rows.append(run_one(kind, numel, count, steps, warmup))
            except Exception as error:  # noqa: BLE001 - a failed build is a result to report
                rows.append({"implementation": kind, "error": _first_line(error)})
    finally:
        # Called in-process (the tests), the thread count must not outlive the bench.
        torch.set_num_threads(previous_threads)
    measured = [row for row in rows if "error" not in row]
    reference = next((row["_weights"] for row in measured if row["implementation"] == REFERENCE),
                     None)
    fastest = max((row["params_per_second"] for row in measured), default=None)
    for row in measured:
        row["vs_fastest"] = row["params_per_second"] / fastest
        weights = row.pop("_weights")
        if reference is None:  # the foreach row failed: nothing to check against
            row["max_abs_diff_vs_foreach"] = row["agrees_with_foreach"] = None
            continue
        row["max_abs_diff_vs_foreach"] = float((weights - reference).abs().max())
        row["agrees_with_foreach"] = bool(torch.allclose(weights, reference, rtol=rtol,
                                                         atol=atol))
    return rows


def correctness(rows: list[dict], rtol: float, atol: float) -> str:
    """One line: did every measured implementation agree with foreach after 3 steps?"""
    checked = [row for row in rows if row.get("agrees_with_foreach") is not None]
    if not checked:
        return f"Correctness after {CHECK_STEPS} steps: not checked (no foreach row)."
    failed = [row["implementation"] for row in checked if not row["agrees_with_foreach"]]
    worst = max(row["max_abs_diff_vs_foreach"] for row in checked)
    verdict = "FAILED for " + ", ".join(failed) if failed else "pass"
    return (f"Correctness after {CHECK_STEPS} steps from the same state, against foreach "
            f"(rtol {rtol:g}, atol {atol:g}): {verdict}; largest abs difference {worst:.1e}.")


def table(rows: list[dict], threads: int, numel: int, count: int, steps: int) -> str:
    lines = [f"AdamW step over {numel:,} fp32 parameters in {count} tensors, {threads} "
             f"thread(s), median of {steps} timed step(s)",
             "",
             "| implementation | s / step | M params / s | vs fastest | "
             f"max abs diff vs foreach ({CHECK_STEPS} steps) |",
             "|---|---:|---:|---:|---:|"]
    for row in rows:
        if "error" in row:
            message = row["error"].replace("|", "/")  # a pipe would split the cell
            lines.append(f"| {row['implementation']} | not run: {message} | | | |")
            continue
        diff = row["max_abs_diff_vs_foreach"]
        lines.append(f"| {row['implementation']} | {row['seconds_per_step']:.3f} | "
                     f"{row['params_per_second'] / 1e6:,.0f} | {row['vs_fastest']:.2f}x | "
                     f"{'-' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--numel", type=int, default=50_000_000,
                        help="fp32 parameters stepped (a rank's shard of a big model)")
    parser.add_argument("--tensors", type=int, default=4,
                        help="tensors the parameters are split into (one per parameter-group run)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--rtol", type=float, default=1e-5,
                        help="relative tolerance of the check against foreach")
    parser.add_argument("--atol", type=float, default=1e-6,
                        help="absolute tolerance of the check, for weights near zero")
    parser.add_argument("--skip-deepspeed", action="store_true",
                        help="leave out DeepSpeedCPUAdam (its first use compiles C++)")
    parser.add_argument("--json", help="also write the settings and rows here")
    args = parser.parse_args(argv)
    for name in ("threads", "numel", "tensors", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.numel < args.tensors:
        parser.error("--numel must be at least --tensors")
    rows = run(args.threads, args.numel, args.tensors, args.steps, args.warmup,
               args.skip_deepspeed, args.rtol, args.atol)
    print(table(rows, args.threads, args.numel, args.tensors, args.steps))
    print()
    print(correctness(rows, args.rtol, args.atol), flush=True)
    if args.json:
        settings = {key: value for key, value in vars(args).items() if key != "json"}
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "hyperparameters": HYPER,
                       "check_steps": CHECK_STEPS, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
