"""The GPU check: one command, under 10 minutes on one GPU, for the moment a GPU is at hand.

    scripts/gpu_check.sh [--out DIR] [--quick] [--sections abcdefg] [--budget-s 570]
    (= .venv/bin/python -m scripts.gpu_check.run ...)

Sections (each timed, each pass / fail / skip with its figures; a failing one does not stop
the others):
  a. the Triton kernels on CUDA equal the torch reference bit for bit
     (scripts/gpu_check/kernels.py);
  b. each kernel's bandwidth on 64 MiB tensors against the device's peak (target 70%); the
     per-op rates become the report's `kernel_rates`, which the step-time model reads
     (`pretrain_zeropp_gpt.py --dry-run --dry-run-kernel-rates DIR/gpu_check.json`);
  c. the engine on NCCL (one rank, CUDA execution model) trains a tiny GPT to the losses of
     the same run on CPU/gloo (scripts/gpu_check/engine.py);
  d. a profiled iteration shows the gather and reduce streams overlapping compute (the
     chrome trace is kept in DIR);
  e. host time against GPU time per iteration at the 18B's block shape, few layers;
  f. the engine at world size 1 under PyTorch's CUDA sanitizer: no cross-stream race
     (scripts/gpu_check/nccl.py);
  g. two processes on two GPUs over NCCL, started as torchrun starts them: one GPU each by
     LOCAL_RANK, equal losses (skipped on a one-GPU machine).

Writes DIR/gpu_check.json (rewritten after every section, so a killed run leaves what it
had) and prints a short table. Exit status: 0 when every section passed, 1 when one did not,
2 for bad arguments, 3 without a CUDA device (one line says why).

Each section runs in its own process, for two reasons: a CUDA error that poisons the context
(an illegal address in a kernel) fails only its section, and a section that overruns its
time is killed, which keeps the whole check within --budget-s. Each section's time limit is
what is left of the budget minus the shares reserved for the sections after it
(SECTION_SHARES_S), so one that finishes early leaves its time to the later ones.
`--quick` shrinks every size (16 MiB tensors, smaller models, fewer steps and cases).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scripts.gpu_check.report import (
    SECTIONS,
    Outcome,
    SectionResult,
    build_report,
    describe_device,
    json_safe,
    one_line,
    render_table,
    run_section,
    sigterm_raises,
    write_json_atomically,
    write_report,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path("cache") / "gpu_check"
DEFAULT_BUDGET_S = 570.0  # 9.5 minutes: the check must fit 10 on one H100, start-up included
# Seconds reserved for each section within the budget (they add up to the default budget;
# with another budget or fewer sections they are scaled to it).
# Estimates with room to spare: on an H100 (docs/gpu_runs.md) the sections took a 29 s,
# b 4 s, c 10 s, d 10 s, e 20 s, f 6 s (128 s in all, first Triton compiles included); a
# slower host or a cold compile cache takes longer.
SECTION_SHARES_S = {"a": 130.0, "b": 60.0, "c": 90.0, "d": 90.0, "e": 130.0, "f": 45.0,
                    "g": 25.0}
SECTION_GRACE_S = 15.0  # a section stops starting new work this long before its limit
NO_CUDA_EXIT = 3
SECTIONS_DIR = "sections"  # per-section results and logs, inside the out dir


class UsageError(ValueError):
    """A bad command line (one line)."""


def parse_sections(text: str) -> list[str]:
    """'abcdefg', 'a,c' or 'all' -> the section keys in run order."""
    if text.strip().lower() == "all":
        return list(SECTIONS)
    keys = [k for k in text.replace(",", "").replace(" ", "").lower()]
    unknown = sorted(set(keys) - set(SECTIONS))
    if not keys or unknown:
        raise UsageError(f"--sections {text!r}: choose from {', '.join(SECTIONS)} (e.g. "
                         "'abcdefg', 'a,c' or 'all')")
    return [k for k in SECTIONS if k in keys]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh",
        description="Check the Triton kernels, their bandwidth, the engine on NCCL, its "
        "streams and its host overhead on one CUDA device, within 10 minutes.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                        help=f"where gpu_check.json, the traces and logs go (default: "
                        f"{DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true",
                        help="smaller tensors, models and case lists (a minute or two)")
    parser.add_argument("--sections", default="all", metavar="KEYS",
                        help="which sections to run: letters of abcdefg, or 'all' (default)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, metavar="S",
                        help=f"wall-clock budget for all sections together (default: "
                        f"{DEFAULT_BUDGET_S:g})")
    # Internal: run one section in this process (the parent starts one such child each).
    parser.add_argument("--run-section", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--section-limit-s", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.sections = parse_sections(args.sections)
    if not args.budget_s > 0:
        raise UsageError(f"--budget-s {args.budget_s:g} must be positive")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} exists and is not a directory")
    if args.run_section is not None and args.run_section not in SECTIONS:
        raise UsageError(f"--run-section {args.run_section!r} is not a section")
    args.out = args.out.resolve()  # the sections run with the repository as their cwd
    return args


def no_cuda_reason() -> str | None:
    """Why this machine cannot run the check (one line), or None when it can."""
    try:
        import torch
    except ImportError as error:
        return f"no CUDA device: torch is not importable ({error})"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return (f"no CUDA device: torch {torch.__version__} ({build}) sees none "
                f"(torch.cuda.is_available() is False{hint})")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return ("TRITON_INTERPRET=1 would run the Triton kernels in its interpreter: unset it "
                "for the GPU check")
    return None


# ---- one section, in this process --------------------------------------------------------------


def section_function(key: str, out_dir: Path, quick: bool, limit_s: float | None):
    """The call that runs section `key` with the sizes of a full or a quick check."""
    from scripts.gpu_check import engine as engine_sections
    from scripts.gpu_check import kernels as kernel_sections

    work_s = None if limit_s is None else max(limit_s - SECTION_GRACE_S, 1.0)
    if key == "a":
        numels = ((kernel_sections.AWKWARD_NUMEL,) if quick else
                  (kernel_sections.REGULAR_NUMEL, kernel_sections.AWKWARD_NUMEL))
        return lambda: kernel_sections.check_bit_exact("cuda", numels=numels, budget_s=work_s)
    if key == "b":
        def bandwidth() -> Outcome:
            device, _ = describe_device()
            peak = device["peak_memory_bandwidth"]
            size = (kernel_sections.QUICK_TENSOR_BYTES if quick
                    else kernel_sections.FULL_TENSOR_BYTES)
            return kernel_sections.measure_bandwidth(
                "cuda", size, peak["bytes_per_second"] if peak else None,
                repeats=5 if quick else 10, warmup=2 if quick else 3)
        return bandwidth
    if key == "c":
        return lambda: engine_sections.check_engine_against_gloo(
            out_dir, steps=3 if quick else 5, timeout_s=work_s or 300)
    if key == "d":
        shape = engine_sections.OVERLAP_GPT["quick" if quick else "full"]
        return lambda: engine_sections.check_stream_overlap(out_dir, **shape)
    if key == "e":
        return lambda: engine_sections.check_host_vs_gpu(
            out_dir, num_layers=1 if quick else 2, micro_batch=1 if quick else 2,
            timed_iterations=2 if quick else 3)
    from scripts.gpu_check import nccl as nccl_sections

    if key == "f":
        return lambda: nccl_sections.check_under_sanitizer(steps=2 if quick else 3)
    return lambda: nccl_sections.check_two_ranks(out_dir, steps=2 if quick else 3,
                                                 timeout_s=work_s or 120)


def result_path(out_dir: Path, key: str) -> Path:
    return out_dir / SECTIONS_DIR / f"{key}.json"


def run_section_here(key: str, out_dir: Path, quick: bool, limit_s: float | None) -> int:
    """Child mode: run one section and write its result next to the report."""

    result = run_section(key, section_function(key, out_dir, quick, limit_s))
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001 (the result is what matters)
        print(f"warning: destroying the process group failed: {error}", file=sys.stderr)
    path = result_path(out_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, json_safe(result.to_dict()), indent=1, allow_nan=False)
    if result.traceback:
        print(result.traceback, file=sys.stderr)
    return 0


# ---- the parent: every section in a child ----------------------------------------------------


def section_limit(key: str, selected: list[str], remaining_s: float, budget_s: float) -> float:
    """Time section `key` may take: what is left of the budget minus the shares reserved for
    the selected sections after it (SECTION_SHARES_S, scaled so that the selected sections'
    shares add up to the budget)."""
    later = selected[selected.index(key) + 1:]
    scale = budget_s / sum(SECTION_SHARES_S[k] for k in selected)
    return remaining_s - scale * sum(SECTION_SHARES_S[k] for k in later)


def run_section_in_child(key: str, args: argparse.Namespace, limit_s: float) -> SectionResult:
    """Run one section in a child process with a hard time limit; its output goes to
    DIR/sections/KEY.log."""
    import json

    path = result_path(args.out, key)
    path.unlink(missing_ok=True)
    log_path = path.with_suffix(".log")
    command = [sys.executable, "-m", "scripts.gpu_check.run", "--out", str(args.out),
               "--run-section", key, "--section-limit-s", f"{limit_s:.1f}"]
    if args.quick:
        command.append("--quick")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # Its own session: on timeout the whole group goes, section c's CPU worker included.
        from scripts.gpu_check.nccl import section_env

        child = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True,
                                 env={**os.environ, **section_env(key)})
        try:
            child.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return SectionResult(key, "fail", time.perf_counter() - start,
                                 f"killed after {limit_s:.0f} s, its share of --budget-s "
                                 f"(log: {log_path.name})", error="timed out")
        except BaseException:  # Ctrl-C does not reach a child in its own session
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
    if path.exists():
        return SectionResult.from_dict(json.loads(path.read_text()))
    tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
    return SectionResult(key, "fail", time.perf_counter() - start,
                         f"the section's process exited with status {child.returncode} and no "
                         f"result: {tail}", error=f"exit status {child.returncode}")


def skipped(key: str, reason: str) -> SectionResult:
    return SectionResult(key, "skip", 0.0, reason)


def run_check(args: argparse.Namespace) -> int:
    # SIGTERM (a caller's time limit) raises SystemExit, whose way through
    # run_section_in_child kills the running section (a session of its own, which the signal
    # misses); the sections done so far are saved already.
    with sigterm_raises():
        return _run_check(args)


def _run_check(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / SECTIONS_DIR).mkdir(exist_ok=True)
    try:
        device, environment = describe_device()
    except Exception as error:  # noqa: BLE001 (a broken driver: say so in one line)
        print(f"error: cannot query the CUDA device: {one_line(error)}", file=sys.stderr)
        return 1
    options = {"quick": args.quick, "sections": args.sections, "budget_s": args.budget_s}
    print(f"GPU check on {device['name']} -> {args.out / 'gpu_check.json'}", flush=True)
    results: list[SectionResult] = []

    def save(complete: bool) -> dict[str, Any]:
        report = build_report(sections=results, device=device, environment=environment,
                              options=options, total_seconds=time.perf_counter() - began,
                              complete=complete)
        write_report(report, args.out)
        return report

    for key in args.sections:
        remaining = args.budget_s - (time.perf_counter() - began)
        limit = section_limit(key, args.sections, remaining, args.budget_s)
        if limit < SECTION_GRACE_S:
            result = skipped(key, f"not started: {limit:.0f} s left of its share of --budget-s")
        else:
            print(f"[{key}] {SECTIONS[key][1]} (up to {limit:.0f} s) ...", flush=True)
            result = run_section_in_child(key, args, limit)
        print(f"[{key}] {result.status} in {result.seconds:.1f} s: {result.summary}", flush=True)
        results.append(result)
        save(complete=False)
    report = save(complete=True)
    print(render_table(report), flush=True)
    return 0 if report["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    reason = no_cuda_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return NO_CUDA_EXIT
    if args.run_section is not None:
        return run_section_here(args.run_section, args.out, args.quick, args.section_limit_s)
    return run_check(args)


if __name__ == "__main__":
    raise SystemExit(main())
