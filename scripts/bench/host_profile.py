"""Where the host's time goes in one training iteration: the GPU check's section e model (the
18B's block shape, bf16 ZeRO++, activation checkpointing) profiled on the host.

    python -m scripts.bench.host_profile --out DIR [--layers 2] [--micro-batch 2]

Writes DIR/host_python.txt (cProfile of one iteration: the Python functions by own time and
by cumulative time) and DIR/host_ops.txt (torch.profiler's CPU view of the next iteration:
aten ops and CUDA API calls by self time, with counts). Section e says how long the host
takes per GPU launch; this says what it spends it on. On a machine without CUDA it runs on
the CPU with gloo (the same Python, other kernels), which is how the suite checks it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path

import torch

from scripts.gpu_check.engine import (
    WARMUP_ITERATIONS,
    build_18b_block_engine,
    ensure_process_group,
    train_iteration,
)

ROWS = 45  # lines of each table


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def python_table(profiler: cProfile.Profile) -> str:
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.strip_dirs()
    for order in ("tottime", "cumulative"):
        text.write(f"==== by {order}\n")
        stats.sort_stats(order).print_stats(ROWS)
    return text.getvalue()


def profile_host(out_dir: Path, layers: int, micro_batch: int, hidden_size: int | None = None,
                 num_attention_heads: int | None = None) -> dict[str, Path]:
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    ensure_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    engine, tokens, _ = build_18b_block_engine(device, layers, micro_batch, hidden_size,
                                               num_attention_heads)
    try:
        for _ in range(WARMUP_ITERATIONS):
            train_iteration(engine, tokens)
        synchronize(device)
        python = cProfile.Profile()
        python.enable()
        train_iteration(engine, tokens)
        synchronize(device)
        python.disable()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as ops:
            train_iteration(engine, tokens)
            synchronize(device)
    finally:
        engine.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"python": out_dir / "host_python.txt", "ops": out_dir / "host_ops.txt"}
    paths["python"].write_text(python_table(python))
    paths["ops"].write_text(ops.key_averages().table(sort_by="self_cpu_time_total",
                                                     row_limit=ROWS))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.host_profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="override the 18B's 6144 (small runs on a CPU)")
    parser.add_argument("--num-attention-heads", type=int, default=None)
    args = parser.parse_args(argv)
    paths = profile_host(args.out, args.layers, args.micro_batch, args.hidden_size,
                         args.num_attention_heads)
    for path in paths.values():
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
