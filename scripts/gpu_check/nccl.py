"""GPU check sections f and g: the hazards a first NCCL run meets that gloo hides.

  f. the engine (ZeRO++: qwZ, qgZ, hpZ off at one rank) trains a few steps at world size 1
     under PyTorch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``, set for this section's
     process by the check): a kernel on one stream reading or writing memory another stream
     is still using, without an event between them, is reported as a race;
  g. two processes on two GPUs over NCCL, launched as torchrun launches them (RANK,
     LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), each its own simulated node
     (LOCAL_WORLD_SIZE=1) so that qwZ and qgZ cross the "node" boundary: each rank must land
     on its own GPU (LOCAL_RANK's), and both ranks must see the same losses. Skipped, with
     the reason, on a machine with one GPU.

    python -m scripts.gpu_check.nccl rank --steps N --out FILE   (one rank of section g)
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from scripts.gpu_check.engine import (
    REPO_ROOT,
    TINY_BATCH,
    TINY_GPT,
    TINY_SEQ,
    ZEROPP,
    build_gpt_engine,
    ensure_process_group,
    token_batches,
    train_iteration,
    worker_main,
)
from scripts.gpu_check.report import Outcome, one_line, write_json_atomically

SANITIZER_ENV = {"TORCH_CUDA_SANITIZER": "1"}  # the environment of section f's process
RANKS = 2


def section_env(key: str) -> dict[str, str]:
    """Extra environment variables the check sets for section ``key``'s process."""
    return dict(SANITIZER_ENV) if key == "f" else {}


def _tiny_engine(device: torch.device):
    from megatron_lite.model import GPTConfig
    from zeropp.sharded_model import ShardingOptions

    return build_gpt_engine(GPTConfig(**TINY_GPT), device, torch.float32, ZEROPP,
                            ShardingOptions(persistence_threshold=0))


# ---- section f -------------------------------------------------------------------------------


def sanitizer_enabled() -> bool:
    """Whether PyTorch's CUDA sanitizer watches this process's kernels."""
    try:
        from torch.cuda import _sanitizer
    except ImportError:
        return False
    handler = getattr(_sanitizer, "cuda_sanitizer", None)
    return bool(getattr(handler, "enabled", False))


def check_under_sanitizer(steps: int = 3) -> Outcome:
    """Section f."""
    if not sanitizer_enabled():
        return Outcome("fail", "the CUDA sanitizer is not enabled in this process (run the "
                       "section through scripts/gpu_check.sh, which sets "
                       "TORCH_CUDA_SANITIZER=1)", {})
    ensure_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    batches = token_batches(steps, TINY_BATCH, TINY_SEQ, TINY_GPT["vocab_size"])
    engine = _tiny_engine(device)
    try:
        losses = [float(train_iteration(engine, batch.to(device))) for batch in batches]
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 (the sanitizer's report is the finding)
        return Outcome("fail", f"the sanitizer reported: {one_line(error)}", {})
    finally:
        engine.close()
    return Outcome("pass", f"{steps} ZeRO++ steps, no cross-stream race reported",
                   {"steps": steps, "losses": losses})


# ---- section g -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_env(rank: int, port: int) -> dict[str, str]:
    """What torchrun sets for one rank of a two-GPU job, but for LOCAL_WORLD_SIZE: 1 makes
    each rank a node of its own to the engine's topology."""
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(RANKS),
            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def two_rank_verdict(results: list[dict[str, Any]]) -> Outcome:
    """Both ranks on their own GPU, the same losses, all finite."""
    figures = {"ranks": results}
    devices = [r["device"] for r in results]
    if devices != [f"cuda:{rank}" for rank in range(RANKS)]:
        return Outcome("fail", f"ranks ran on {devices}, not one GPU each by LOCAL_RANK",
                       figures)
    losses = [r["losses"] for r in results]
    if not all(math.isfinite(loss) for run in losses for loss in run):
        return Outcome("fail", f"non-finite losses: {losses}", figures)
    if losses[0] != losses[1]:
        return Outcome("fail", f"the ranks' losses differ: {losses}", figures)
    return Outcome("pass", f"{len(losses[0])} ZeRO++ steps on {devices} over NCCL, equal "
                   f"losses (last {losses[0][-1]:.4f})", figures)


def check_two_ranks(out_dir: Path, steps: int = 3, timeout_s: float = 120) -> Outcome:
    """Section g."""
    count = torch.cuda.device_count()
    if count < RANKS:
        return Outcome("skip", f"{count} GPU(s) visible: the two-process NCCL section needs "
                       f"{RANKS}", {"device_count": count})
    port = free_port()
    paths = [out_dir / f"two_ranks_{rank}.json" for rank in range(RANKS)]
    workers = []
    for rank, path in enumerate(paths):
        path.unlink(missing_ok=True)
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "scripts.gpu_check.nccl", "rank", "--steps",
             str(steps), "--out", str(path)],
            cwd=REPO_ROOT, env=rank_env(rank, port), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout_s
    outputs = []
    try:
        for worker in workers:
            output, _ = worker.communicate(timeout=max(deadline - time.monotonic(), 1))
            outputs.append(output)
    except subprocess.TimeoutExpired:
        return Outcome("fail", f"the two ranks did not finish within {timeout_s:.0f} s "
                       "(a hang in a collective?)", {})
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    for rank, (worker, output) in enumerate(zip(workers, outputs, strict=True)):
        if worker.returncode != 0 or not paths[rank].exists():
            tail = " | ".join(output.strip().splitlines()[-3:])
            return Outcome("fail", f"rank {rank} exited with status {worker.returncode}: "
                           f"{tail}", {})
    return two_rank_verdict([json.loads(path.read_text()) for path in paths])


def rank_main(steps: int, out_path: Path) -> int:
    """One rank of section g, started as torchrun would start it."""
    import torch.distributed as dist

    from zeropp.deepspeed_api.initialize import init_distributed

    init_distributed()  # LOCAL_RANK's GPU, the NCCL group created for it
    device = torch.device("cuda", torch.cuda.current_device())
    batches = token_batches(steps, TINY_BATCH * RANKS, TINY_SEQ, TINY_GPT["vocab_size"])
    rank = dist.get_rank()
    mine = slice(rank * TINY_BATCH, (rank + 1) * TINY_BATCH)
    engine = _tiny_engine(device)
    try:
        losses = []
        for batch in batches:
            loss = train_iteration(engine, batch[mine].to(device))
            dist.all_reduce(loss)
            losses.append(float(loss) / RANKS)
    finally:
        engine.close()
        dist.destroy_process_group()
    write_json_atomically(out_path, {"device": str(device), "losses": losses})
    return 0


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, "scripts.gpu_check.nccl",
                       "one rank of the GPU check's section g", "rank",
                       "train the tiny GPT as one of two NCCL ranks", rank_main)


if __name__ == "__main__":
    sys.exit(main())
