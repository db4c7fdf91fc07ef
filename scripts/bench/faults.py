"""Faults injected into a supervised 2-rank run, with what each cost.

    .venv/bin/python -m scripts.bench.faults --out cache/faults.json

A small GPT (2 ranks under torchrun on gloo, ZeRO-3, ``--save-interval 5``, 30 iterations,
``--distributed-timeout-minutes 1``) runs under ``python -m megatron_lite.supervise
--restarts 2`` three times: undisturbed, with one rank SIGKILLed after iteration 12, and with
one rank SIGSTOPped (hung) after iteration 12. For each it records the exit status, the
restarts, the seconds from the fault until the supervisor relaunched, the iterations run
again (lost work since the last save) and whether every final loss equals the undisturbed
run's. Needs the sample corpus (``python -m data.sample_corpus`` and ``data.preprocess``, as
``scripts/quickstart.sh`` builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "cache" / "data" / "pile_sample_text_document"
ITERATIONS, SAVE_EVERY, FAULT_AFTER = 30, 5, 12
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
         "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "1000",
         "--eval-iters", "1", "--split", "969,30,1", "--num-workers", "0", "--zero-stage", "3",
         "--deepspeed", "--deepspeed_config", str(ROOT / "configs" / "ds_zero3_config.json")]


def losses(metrics: Path) -> dict[int, float]:
    out = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "lm_loss" in record:
            out[record["iteration"]] = record["lm_loss"]  # a repeated iteration: the last
    return out


def iterations_run(metrics: Path) -> int:
    return sum("lm_loss" in json.loads(line) for line in metrics.read_text().splitlines())


def descendants(pid: int, depth: int) -> list[int]:
    """Processes ``depth`` generations below ``pid``."""
    level = [pid]
    for _ in range(depth):
        level = [int(child) for parent in level for child in subprocess.run(
            ["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()]
    return level


def run(work: Path, fault: str | None) -> dict:
    ckpt, metrics = work / f"ckpt_{fault}", work / f"metrics_{fault}.jsonl"
    training = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", str(ROOT / "pretrain_zeropp_gpt.py"), *MODEL,
                "--train-iters", str(ITERATIONS), "--data-path", str(DATA),
                "--data-cache-dir", str(work / "data_cache"), "--metrics-file", str(metrics),
                "--save", str(ckpt), "--load", str(ckpt), "--save-interval", str(SAVE_EVERY),
                "--distributed-timeout-minutes", "1"]
    command = [sys.executable, "-m", "megatron_lite.supervise", "--restarts", "2",
               "--backoff", "0", "--", *training]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                               stdout=subprocess.DEVNULL)
    fault_at = None
    while fault and fault_at is None and process.poll() is None:
        if metrics.exists() and f'"iteration": {FAULT_AFTER},' in metrics.read_text():
            # supervisor -> torchrun -> ranks: the last rank of this job's own tree
            victim = max(descendants(process.pid, depth=2))
            os.kill(victim, signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
            fault_at = time.monotonic()
        time.sleep(0.05)
    restart_at = None
    lines = []
    for line in process.stderr:
        if line.startswith("supervise:"):
            lines.append(line.strip())
            restart_at = restart_at or time.monotonic()
    status = process.wait()
    return {"fault": fault or "none", "exit_status": status, "supervisor_lines": lines,
            "seconds_to_relaunch": (restart_at - fault_at) if fault_at and restart_at else None,
            "iterations_run": iterations_run(metrics), "losses": losses(metrics)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.faults",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not DATA.with_suffix(".bin").exists():
        parser.error(f"{DATA}.bin is missing: build the sample corpus first "
                     "(scripts/quickstart.sh does)")
    with tempfile.TemporaryDirectory(prefix="zeropp-faults-") as scratch:
        results = [run(Path(scratch), fault) for fault in (None, "sigkill", "sigstop")]
    reference = results[0]["losses"]
    for result in results:
        result["iterations_lost"] = result["iterations_run"] - ITERATIONS
        result["losses_equal_undisturbed"] = result.pop("losses") == reference
        print(json.dumps(result), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
