"""Faults injected into a supervised 2 x 2-rank run, with what each cost and what the
watchdog said.

    .venv/bin/python -m scripts.bench.faults --out cache/faults.json [--cases ...]

A small GPT (4 ranks under torchrun on gloo, 2 per simulated node, ZeRO-3, ``--save-interval
5``, 30 iterations, the default ``--distributed-timeout-minutes`` of 10) runs under ``python
-m megatron_lite.supervise --restarts 2``. The faults are injected by the program itself
(``ZEROPP_FAULT``, [Note: hang watchdog]) on the last rank, at iteration 12, on the first run
only, so every case is deterministic:

- ``none``, ``no-watchdog``: undisturbed, with and without the watchdog (its cost: the mean
  iteration time of both, ``--repeats`` times each, interleaved);
- ``sigkill``: SIGKILLed after iteration 12;
- ``sigstop``: SIGSTOPped (hung) after iteration 12: seconds until the watchdog names it,
  until the supervisor relaunches, and the wall time lost against the undisturbed run;
- ``slow-rank``: 4 x the undisturbed iteration time of sleep in its step, iterations 12-14:
  reported as the straggler, never hung;
- ``long-save``: 30 s more in its save at iteration 10 (3 x ``--hang-timeout``): never hung;
- ``big-save``: a 355M-parameter GPT whose checkpoint is 1 GiB per rank, saved at iteration
  2 of 3: never hung, and the save's seconds.

For each: the exit status, the supervisor's and the watchdog's lines, the iterations run
again, and whether every final loss equals the undisturbed run's. Also the cost of the
straggler report's all-gather of one number per rank. Needs the sample corpus (``python -m
data.sample_corpus`` and ``data.preprocess``, as ``scripts/quickstart.sh`` builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "cache" / "data" / "pile_sample_text_document"
ITERATIONS, SAVE_EVERY, FAULT_AFTER, RANKS = 30, 5, 12, 4
VICTIM = RANKS - 1
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8"]
BIG_MODEL = ["--num-layers", "5", "--hidden-size", "2048", "--num-attention-heads", "16",
             "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4"]
COMMON = ["--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
          "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "1000",
          "--eval-iters", "1", "--split", "969,30,1", "--num-workers", "0", "--zero-stage", "3",
          "--ranks-per-node", "2", "--deepspeed", "--deepspeed_config",
          str(ROOT / "configs" / "ds_zero3_config.json")]
CASES = ("none", "no-watchdog", "sigkill", "sigstop", "slow-rank", "long-save", "big-save")


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_losses(records: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


def mean_iteration_ms(records: list[dict], skip: set[int]) -> float | None:
    """Mean logged iteration time, past the first 3 and away from saves and faults."""
    times = [r["elapsed_ms_per_iteration"] for r in records if "elapsed_ms_per_iteration" in r
             and r["iteration"] > 3 and r["iteration"] % SAVE_EVERY not in (0, 1)
             and r["iteration"] not in skip]
    return statistics.mean(times) if times else None


def run_case(work: Path, case: str, fault: str | None, extra: list[str], model: list[str],
             iterations: int) -> dict:
    ckpt, metrics = work / f"ckpt_{case}", work / f"metrics_{case}.jsonl"
    shutil.rmtree(ckpt, ignore_errors=True)  # each run starts from scratch
    metrics.unlink(missing_ok=True)
    training = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(RANKS), str(ROOT / "pretrain_zeropp_gpt.py"), *model,
                *COMMON, "--train-iters", str(iterations), "--data-path", str(DATA),
                "--data-cache-dir", str(work / "data_cache"), "--metrics-file", str(metrics),
                "--save", str(ckpt), "--load", str(ckpt), *extra]
    command = [sys.executable, "-m", "megatron_lite.supervise", "--restarts", "2",
               "--backoff", "0", "--", *training]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("ZEROPP_FAULT", None)
    if fault:
        env["ZEROPP_FAULT"] = fault
    started = time.time()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                               stdout=subprocess.DEVNULL)
    stamped: list[tuple[float, str]] = []

    def read() -> None:  # each line with the moment it arrived
        for line in process.stderr:
            stamped.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    status = process.wait()
    reader.join()
    wall = time.time() - started

    def first(prefix: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in stamped if line.startswith(prefix)), None)

    fault_line = first("fault injected:")
    fault_at = float(fault_line[1].rsplit(" at ", 1)[1]) if fault_line else None
    verdict, relaunch = first("watchdog: rank"), first("supervise:")
    records = read_metrics(metrics)
    return {
        "case": case, "exit_status": status, "wall_seconds": round(wall, 1),
        "fault_line": fault_line[1] if fault_line else None,
        "watchdog_lines": [line for _, line in stamped if line.startswith("watchdog:")],
        "supervisor_lines": [line for _, line in stamped if line.startswith("supervise:")],
        "hang_declared": any(" hung " in line for _, line in stamped
                             if line.startswith("watchdog:")),
        "seconds_to_verdict": round(verdict[0] - fault_at, 1) if verdict and fault_at else None,
        "seconds_to_relaunch": round(relaunch[0] - fault_at, 1) if relaunch and fault_at
        else None,
        "iterations_run": len(records and [r for r in records if "lm_loss" in r]),
        "stragglers": {r["iteration"]: [r.get("straggler_rank"),
                                        round(r.get("straggler_ms_per_iteration") or 0, 1),
                                        round(r.get("median_rank_ms_per_iteration") or 0, 1)]
                       for r in records if "lm_loss" in r},
        "mean_iteration_ms": mean_iteration_ms(records, skip=set(range(FAULT_AFTER,
                                                                       FAULT_AFTER + 4))),
        "losses": last_losses(records),
        "saves": [line for _, line in stamped if "save" in line and "fault" in line],
        # What the ranks said where a run failed without a fault asking for it.
        "errors": [line for _, line in stamped if "Error" in line or "error:" in line
                   or "exitcode" in line or "Signal" in line][:20],
    }


def allgather_probe(calls: int = 200) -> None:
    """Run under torchrun: the straggler report's all-gather of one float64 per rank."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    local = torch.tensor([1.0], dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    for _ in range(10):
        dist.all_gather(gathered, local)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(calls):
        dist.all_gather(gathered, local)
        torch.cat(gathered).tolist()
    seconds = (time.perf_counter() - started) / calls
    if dist.get_rank() == 0:
        print(json.dumps({"straggler_allgather_us": round(seconds * 1e6, 1)}), flush=True)
    dist.destroy_process_group()


def recorder_us_per_collective(calls: int = 20_000, rounds: int = 5) -> float:
    """The flight recorder's cost per collective on the training thread: the launch's
    ``issued``, then ``waiting`` and ``finished`` around the wait, as the engine calls them
    (the fastest of ``rounds``: on a shared machine the others measure its load)."""
    import torch

    from zeropp.comm import flight_recorder
    from zeropp.comm.collectives import CommGroup

    output, shard, group = torch.zeros(8), torch.zeros(2), CommGroup(None, 4, 0, False)
    issue = lambda async_op: (output, shard, group)  # noqa: E731 (the engine's shape)
    recorder = flight_recorder.FlightRecorder()
    flight_recorder.install(recorder)
    try:
        best = float("inf")
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(calls):
                record = flight_recorder.issued("gather", issue, (output, shard))
                record.waiting()
                record.finished()
            best = min(best, (time.perf_counter() - started) / calls * 1e6)
        return best
    finally:
        flight_recorder.install(None)


def judge_beat_cpu_us(beats: int = 100) -> float:
    """CPU time of one heartbeat of a judge of 4 ranks (the heaviest: it publishes its record,
    reads all four and judges them), against a TCPStore on this host; the thread holds the
    GIL for at most this long once per ``--heartbeat-interval``."""
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_lite.watchdog import RecordWatch, Watchdog, WatchdogConfig

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    watchdog = Watchdog(WatchdogConfig())
    watchdog.rank, watchdog.world_size = 0, RANKS
    watchdog._store = dist.PrefixStore("bench/", dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, wait_for_workers=False))
    for rank in range(RANKS):
        watchdog.rank = rank
        watchdog._publish(0)
    watchdog.rank = 0
    watch = RecordWatch(RANKS)
    best = float("inf")
    for round_ in range(5):  # the fastest round: the thread's own CPU time, less contention
        started = time.thread_time()
        for beat in range(1, beats + 1):
            watchdog.beat(round_ * beats + beat, watch)
        best = min(best, (time.thread_time() - started) / beats * 1e6)
    return best


def measure_allgather() -> float | None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(RANKS), "-m", "scripts.bench.faults", "--allgather-probe"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=300)
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)["straggler_allgather_us"]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.faults",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of none and no-watchdog each, interleaved (default 2)")
    parser.add_argument("--allgather-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.allgather_probe:
        allgather_probe()
        return 0
    if args.out is None:
        parser.error("--out is required")
    if not DATA.with_suffix(".bin").exists():
        parser.error(f"{DATA}.bin is missing: build the sample corpus first "
                     "(scripts/quickstart.sh does)")
    results: list[dict] = []
    summary: dict = {"straggler_allgather_us": measure_allgather(),
                     "recorder_us_per_collective": round(recorder_us_per_collective(), 2),
                     "judge_beat_cpu_us": round(judge_beat_cpu_us(), 1)}
    print(json.dumps(summary), flush=True)
    with tempfile.TemporaryDirectory(prefix="zeropp-faults-") as scratch:
        work = Path(scratch)
        save = ["--save-interval", str(SAVE_EVERY)]

        def case(name, fault=None, extra=(), model=MODEL, iterations=ITERATIONS):
            result = run_case(work, name, fault, [*save, *extra] if model is MODEL
                              else list(extra), model, iterations)
            shown = {k: v for k, v in result.items() if k not in ("losses", "stragglers")}
            print(json.dumps(shown), flush=True)
            results.append(result)
            return result

        reference = None
        if {"none", "no-watchdog"} & set(args.cases) or len(args.cases) > 1:
            for _ in range(args.repeats):
                reference = case("none")
                if "no-watchdog" in args.cases:
                    case("no-watchdog", extra=["--no-watchdog"])
        iteration_ms = (reference or {}).get("mean_iteration_ms") or 200.0
        if "sigkill" in args.cases:
            case("sigkill", f"{VICTIM}:{FAULT_AFTER}:kill")
        if "sigstop" in args.cases:
            case("sigstop", f"{VICTIM}:{FAULT_AFTER}:stop")
            dumps = sorted((work / "ckpt_sigstop").glob("flight_recorder_rank*.json"))
            results[-1]["dumps"] = [p.name for p in dumps]
            if dumps:  # collectives per iteration, for the recorder's cost per iteration
                body = json.loads(dumps[0].read_text())
                summary["collectives_per_iteration"] = round(body["issued"] / body["iteration"])
                results[-1]["divergence"] = subprocess.run(
                    [sys.executable, "-m", "megatron_lite.watchdog",
                     str(work / "ckpt_sigstop")], cwd=ROOT, capture_output=True, text=True,
                    env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.splitlines()
        if "slow-rank" in args.cases:
            slow = round(4 * iteration_ms / 1000, 2)  # the step 5x its usual time
            case("slow-rank", f"{VICTIM}:{FAULT_AFTER}:sleep:{slow}:3")
        if "long-save" in args.cases:
            case("long-save", f"{VICTIM}:10:slowsave:30")
        if "big-save" in args.cases:
            case("big-save", None, ["--save-interval", "2"], BIG_MODEL, 3)
            sizes = sorted((work / "ckpt_big-save" / "iter_0000002").glob("zero_rank*.pt"))
            results[-1]["checkpoint_bytes_per_rank"] = [p.stat().st_size for p in sizes]
    by_case: dict[str, list[dict]] = {}
    for result in results:
        by_case.setdefault(result["case"], []).append(result)
    if reference is not None:
        expected = reference["losses"]
        for result in results:
            if result["case"] != "big-save":
                result["losses_equal_undisturbed"] = result["losses"] == expected
                result["iterations_lost"] = result["iterations_run"] - ITERATIONS
                result["seconds_lost"] = round(result["wall_seconds"]
                                               - reference["wall_seconds"], 1)
    if "none" in by_case and "no-watchdog" in by_case:
        with_ = statistics.mean(r["mean_iteration_ms"] for r in by_case["none"])
        without = statistics.mean(r["mean_iteration_ms"] for r in by_case["no-watchdog"])
        summary.update(iteration_ms_with_watchdog=round(with_, 2),
                       iteration_ms_without_watchdog=round(without, 2),
                       watchdog_cost_percent=round(100 * (with_ / without - 1), 2))
    if "collectives_per_iteration" in summary and reference is not None:
        # The watchdog's cost from its parts: the recorder on each collective, and one judge
        # beat per interval (at most this long off the training thread's GIL).
        per_iteration_us = (summary["recorder_us_per_collective"]
                            * summary["collectives_per_iteration"]
                            + summary["judge_beat_cpu_us"] * reference["mean_iteration_ms"] / 1000)
        summary["watchdog_cost_percent_from_parts"] = round(
            100 * per_iteration_us / (reference["mean_iteration_ms"] * 1000), 3)
    for result in results:
        result.pop("losses")
    print(json.dumps(summary), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "runs": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
