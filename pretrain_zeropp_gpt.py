"""Pretrain a Megatron GPT-2 on the ZeRO-3 / ZeRO++ engine.

    torchrun --nproc_per_node 2 pretrain_zeropp_gpt.py --num-layers 4 --hidden-size 128 \\
        --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 16 \\
        --train-iters 200 --lr 6e-4 --lr-decay-style cosine --lr-warmup-iters 20 \\
        --data-path cache/data/pile_sample_text_document \\
        --deepspeed_config configs/ds_zero3_config.json --zero-stage 3

Also launched by plain ``python`` (one rank) or ``deepspeed --num_nodes 1 --num_gpus N``
(which appends ``--local_rank=N``; on a machine without GPUs DeepSpeed 0.19 falls back to
its CPU accelerator and still starts N processes, which then use gloo).

The program itself, its steps and its exit statuses: ``megatron_lite/pretrain_gpt.py``.
"""

from __future__ import annotations

import os
import sys

from megatron_lite import pretrain_gpt
from megatron_lite.dry_run import run_dry_run

# The program lives in megatron_lite.pretrain_gpt; these names stay importable from here.
from megatron_lite.pretrain_gpt import (  # noqa: F401
    USAGE_ERRORS,
    Training,
    build_engine,
    build_loader_factories,
    build_meta_model,
    build_training,
    check_supported,
    choose_backend,
    describe_architecture,
    fail,
    parameter_groups,
    print_rank_0,
    print_run_description,
    report,
)


def main(argv: list[str] | None = None) -> int:
    """The program (``megatron_lite.pretrain_gpt.main``), with ``--dry-run`` planning any
    cluster size and simulating its rank 0 (``megatron_lite.dry_run``)."""
    return pretrain_gpt.main(argv, dry_run=run_dry_run)


def exit_without_teardown(status: int) -> None:
    """End the process now that everything the run writes is written.

    Checkpoints are complete on disk when save returns, and main() has closed the metrics
    writers (W&B finished, TensorBoard flushed) and destroyed the process group. What is left
    is the interpreter's C++ teardown, in which torch's gloo backend now and then aborts
    ("terminate called without an active exception", a worker thread destroyed while still
    joinable), turning a finished run into a failed one for the launcher; it is skipped.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_without_teardown(main())
