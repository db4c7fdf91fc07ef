"""Megatron-compatible command line for pretrain_zeropp_gpt.py.

The DeepSpeed ZeRO++ tutorial launches training with a Megatron-DeepSpeed command line
(``--num-layers 40 --hidden-size 6144 ... --zero-stage 3 --deepspeed_config ds.json --fp16``);
this module accepts that command line unchanged. Three steps, in this order:

    args = parse_args(argv)                      # argparse only; records which flags were given
    ds_config = read_ds_config(args)             # the DeepSpeed JSON, parsed once; CLI and
                                                 # JSON agree or fail loudly (ds_config.py)
    validate_args(args, world_size)              # checks, then derived values

The middle step lives in ``megatron_lite.ds_config`` (this module imports no engine);
``reconcile_with_ds_config`` may also run after ``validate_args``: it then validates again so
the derived values follow the JSON. ``validate_args`` is idempotent.

Every problem raises ``ArgumentError`` (a ``ValueError``) with one line naming the flag or JSON
key and the offending values; the entry point prints it and exits with status 2.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import torch

from megatron_lite.arguments_model import (
    ArgumentError,
    add_kernel_args,
    add_model_args,
    add_recompute_args,
    check_model_shape,
    gpt_config_from_args,
)
from megatron_lite.arguments_model import derive as _derive
from megatron_lite.arguments_model import describe as _describe
from megatron_lite.arguments_model import flag as _flag

__all__ = [
    "ArgumentError", "build_parser", "gpt_config_from_args", "parse_args", "parse_data_blend",
    "parse_split", "validate_args",
]
SUPPORTED_ZERO_STAGES = (0, 1, 2, 3)
# zeropp.deepspeed_api.lr_schedules.AnnealingLR's styles, named here so that parsing the
# command line imports no engine (tests/test_arguments.py checks the two agree).
DECAY_STYLES = ("constant", "linear", "cosine")

_REQUIRED_MODEL_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
_POSITIVE_IF_SET = (
    "micro_batch_size", "global_batch_size", "num_layers", "hidden_size", "num_attention_heads",
    "seq_length", "ffn_hidden_size", "max_position_embeddings", "make_vocab_size_divisible_by",
    "checkpoint_num_layers", "train_iters", "lr_decay_iters", "log_interval", "eval_interval",
    "save_interval", "exit_interval", "ranks_per_node", "tensor_model_parallel_size",
    "cuda_graph_warmup_steps", "pipeline_model_parallel_size", "adam_eps", "init_method_std",
    "layernorm_epsilon",
    "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis",
    "dry_run_nodes", "dry_run_gpus_per_node", "dry_run_gpu_memory_gb", "train_samples",
    "lr_decay_samples", "kv_channels", "recompute_num_layers", "rotary_base", "rotary_percent",
    "exit_duration_in_mins", "vocab_size", "decoupled_lr", "context_parallel_size",
)
_NON_NEGATIVE_IF_SET = (
    "lr", "min_lr", "weight_decay", "clip_grad", "eval_iters", "num_workers", "lr_warmup_iters",
    "lr_warmup_samples", "sgd_momentum", "decoupled_min_lr", "manual_gc_interval",
)
_FP8_FLAGS = ("fp8_format", "fp8_recipe", "fp8_margin", "fp8_amax_history_len",
              "fp8_amax_compute_algo", "fp8_param_gather")
_PROBABILITIES = ("hidden_dropout", "attention_dropout", "adam_beta1", "adam_beta2")


# -------------------- Parser -------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with ``--help`` grouped by concern."""
    parser = argparse.ArgumentParser(
        prog="pretrain_zeropp_gpt.py",
        description="Megatron-style GPT pretraining on a ZeRO-3 / ZeRO++ engine.",
        # Prefix matching would let "--deepspeed" swallow "--deepspeed_c"; accept exact names only.
        allow_abbrev=False,
    )
    add_model_args(parser.add_argument_group("model"))
    add_recompute_args(parser.add_argument_group("activation recomputation"))
    add_kernel_args(parser.add_argument_group(
        "kernel choices", "Accepted from Megatron scripts; no effect on what is computed."))
    _add_training_args(parser.add_argument_group("training"))
    _add_learning_rate_args(parser.add_argument_group("learning rate"))
    _add_data_args(parser.add_argument_group("data"))
    _add_mixed_precision_args(parser.add_argument_group("mixed precision"))
    _add_checkpointing_args(parser.add_argument_group("checkpointing"))
    _add_distributed_args(parser.add_argument_group("distributed/ZeRO"))
    _add_logging_args(parser.add_argument_group("logging"))
    _add_watchdog_args(parser.add_argument_group(
        "hang watchdog", "[Note: hang watchdog] in megatron_lite/watchdog.py"))
    _add_dry_run_args(parser.add_argument_group("dry run (with --dry-run)"))
    return parser


def _add_training_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--micro-batch-size", "--batch-size", dest="micro_batch_size", type=int,
                       default=None, help="Samples per rank per forward pass "
                       "(or train_micro_batch_size_per_gpu in the DeepSpeed config).")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Samples per optimizer step over all ranks "
                       "(default: micro batch x data-parallel size).")
    group.add_argument("--train-iters", type=int, default=None, help="Optimizer steps to run.")
    group.add_argument("--train-samples", type=int, default=None,
                       help="Megatron-LM: train on this many samples instead of --train-iters; "
                       "runs train_samples // global batch iterations (a partial last batch "
                       "is dropped).")
    group.add_argument("--rampup-batch-size", nargs=3, default=None,
                       metavar=("START", "INCREMENT", "SAMPLES"),
                       help="Refused: the global batch is fixed for the whole run.")
    group.add_argument("--step-batch-size-schedule", nargs="+", default=None,
                       help="Refused: the global batch is fixed for the whole run.")
    group.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                       help="adam: AdamW (decoupled weight decay, as Megatron's adam); sgd: "
                       "torch SGD with --sgd-momentum (default: adam; a DeepSpeed JSON "
                       "optimizer block must name the same).")
    group.add_argument("--weight-decay", type=float, default=0.01,
                       help="Weight decay of the matrices; biases and norms get none "
                       "(default: 0.01).")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1 (default: 0.9).")
    group.add_argument("--adam-beta2", type=float, default=0.999,
                       help="Adam beta2 (default: 0.999).")
    group.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon (default: 1e-8).")
    group.add_argument("--sgd-momentum", type=float, default=0.9,
                       help="Momentum of --optimizer sgd (default: 0.9).")
    group.add_argument("--clip-grad", type=float, default=1.0,
                       help="Global gradient-norm clip; 0 disables (default: 1.0).")
    group.add_argument("--seed", type=int, default=1234, help="Random seed.")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="Stop after the iteration that is a multiple of this.")
    group.add_argument("--exit-duration-in-mins", type=float, default=None,
                       help="After the first iteration that ends this many minutes after "
                       "training started, save a checkpoint (with --save) and exit cleanly; "
                       "all ranks decide together.")
    group.add_argument("--calculate-per-token-loss", action="store_true",
                       help="Accepted; the same loss here: every position is trained on, so "
                       "each micro-batch holds as many loss tokens and the mean of "
                       "micro-batch means is the mean over tokens.")
    group.add_argument("--manual-gc", action="store_true",
                       help="Stop Python's automatic garbage collection during training and "
                       "collect only at --manual-gc-interval and around evaluations (as "
                       "Megatron): no collector pass inside an iteration's host work.")
    group.add_argument("--manual-gc-interval", type=int, default=0, metavar="N",
                       help="With --manual-gc, collect every N iterations (0: never while "
                       "training).")
    group.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                       help="With --manual-gc, do not collect before and after evaluations.")
    group.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                       help="Accepted, no effect: the CUDA caching allocator keeps its blocks.")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile each transformer block's computation (inductor); "
                       "the engine's gathers and reductions stay outside it. The first "
                       "iteration's compile time is printed (DeepSpeed JSON: compile.enabled).")
    group.add_argument("--exit-on-nan", type=int, default=10, metavar="N",
                       help="Stop with an error after N consecutive iterations whose loss is "
                       "not finite (default: 10; 0 disables the guard).")
    group.add_argument("--dry-run", action="store_true",
                       help="Build the model on the meta device and print its size, per-GPU memory and per-iteration communication for the cluster given by the --dry-run-* flags; then exit.")


def _add_learning_rate_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    group.add_argument("--min-lr", type=float, default=0.0,
                       help="Learning rate after decay (default: 0).")
    group.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="linear",
                       help="Shape of the decay after warmup (default: linear).")
    group.add_argument("--lr-warmup-iters", type=int, default=None,
                       help="Iterations of linear warmup from 0 (default: 0).")
    group.add_argument("--lr-warmup-fraction", type=float, default=None,
                       help="Warmup as a fraction of --lr-decay-iters.")
    group.add_argument("--lr-decay-iters", type=int, default=None,
                       help="Iteration at which the lr reaches --min-lr (default: --train-iters).")
    group.add_argument("--lr-decay-samples", type=int, default=None,
                       help="Megatron-LM, with --train-samples: decay over this many samples; "
                       "becomes lr_decay_samples // global batch iterations (rounded down; "
                       "Megatron's schedule counts samples, and the two agree when the count "
                       "is a multiple of the global batch).")
    group.add_argument("--lr-warmup-samples", type=int, default=None,
                       help="Megatron-LM, with --train-samples: warm up over this many "
                       "samples; becomes lr_warmup_samples // global batch iterations "
                       "(rounded down, as --lr-decay-samples).")
    group.add_argument("--decoupled-lr", type=float, default=None,
                       help="Megatron-LM: peak lr of the input embedding and output layer "
                       "weights (their own param group; same warmup and decay).")
    group.add_argument("--decoupled-min-lr", type=float, default=None,
                       help="Final lr of those weights with --decoupled-lr (default: --min-lr).")


def _add_data_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--data-path", nargs="*", default=None,
                       help="Indexed-dataset prefix, or a weighted blend: 0.3 PREFIX 0.7 PREFIX.")
    group.add_argument("--mock-data", action="store_true",
                       help="Train on random token ids instead of --data-path (Megatron's flag: "
                            "for trying a configuration, e.g. on the simulated GPU cluster).")
    group.add_argument("--split", default="969,30,1",
                       help="Train,validation,test weights (default: 969,30,1).")
    group.add_argument("--data-impl", choices=("mmap", "infer", "lazy", "cached"),
                       default="infer", help="Accepted as mmap or infer: the indexed dataset "
                       "here is Megatron's mmap format; lazy and cached (the older formats) are "
                       "refused.")
    group.add_argument("--tokenizer-type", default="GPT2BPETokenizer",
                       help="GPT2BPETokenizer (default), SentencePieceTokenizer, "
                       "GPTSentencePieceTokenizer (SentencePiece, no BOS), Llama2Tokenizer "
                       "(SentencePiece with BOS before every text), HuggingFaceTokenizer "
                       "(alias HFTokenizer), NullTokenizer (ids written as integers; "
                       "needs --vocab-size).")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer's vocabulary: ids 0..N-1, eod N-1 (Megatron-LM); "
                       "other tokenizers know their own size.")
    group.add_argument("--tiktoken-pattern", default=None,
                       help="Accepted, no effect: used by Megatron's TikTokenizer only.")
    group.add_argument("--vocab-file", default=None, help="BPE vocabulary (vocab.json).")
    group.add_argument("--merge-file", default=None, help="BPE merges (merges.txt).")
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece or HF tokenizer.")
    group.add_argument("--num-workers", type=int, default=2,
                       help="DataLoader worker processes (default: 2).")
    group.add_argument("--data-cache-dir", "--data-cache-path", dest="data_cache_dir",
                       default=None,
                       help="Where sample-index caches are written (default: next to the data).")
    group.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                       help="Accepted, no effect: the .bin files are always memory-mapped.")
    group.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                       dest="create_attention_mask_in_dataloader",
                       help="Accepted, no effect: the causal mask is never materialized.")


def _add_mixed_precision_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--fp16", action="store_true", help="fp16 compute, fp32 master weights.")
    group.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master weights.")
    group.add_argument("--loss-scale", type=float, default=None,
                       help="Static fp16 loss scale (default: dynamic).")
    group.add_argument("--initial-loss-scale", type=float, default=2.0**16,
                       help="First dynamic loss scale (default: 65536).")
    group.add_argument("--min-loss-scale", type=float, default=1.0,
                       help="Floor of the dynamic loss scale (default: 1).")
    group.add_argument("--loss-scale-window", type=int, default=1000,
                       help="Overflow-free steps before the scale doubles (default: 1000).")
    group.add_argument("--hysteresis", type=int, default=2,
                       help="Overflows tolerated before the scale halves (default: 2).")
    for name, kind in (("--fp8-format", str), ("--fp8-recipe", str), ("--fp8-margin", int),
                       ("--fp8-amax-history-len", int), ("--fp8-amax-compute-algo", str)):
        group.add_argument(name, type=kind, default=None,
                           help="Refused: there is no FP8 path here (use --bf16).")
    group.add_argument("--fp8-param-gather", action="store_true",
                       help="Refused: there is no FP8 path here (use --bf16).")


def _add_checkpointing_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--save", default=None, help="Directory to write checkpoints to.")
    group.add_argument("--load", default=None,
                       help="Directory to resume from. When it is also --save and holds no "
                       "checkpoint yet, the run starts from scratch (a restartable job).")
    group.add_argument("--save-interval", type=int, default=None, help="Iterations per checkpoint.")
    group.add_argument("--save-error", choices=("stop", "continue"), default="stop",
                       help="When a save fails for storage reasons (disk full, unwritable): "
                       "stop the run (default) or warn and keep training. The previous "
                       "checkpoint stays valid. Any other save error always stops the run.")
    group.add_argument("--async-save", action="store_true",
                       help="Save checkpoints in the background: each rank copies its shards to "
                       "host memory and trains on while a thread writes them; the checkpoint "
                       "becomes latest once every rank's files are on disk. The next save, the "
                       "end of training and a SIGTERM exit wait for it. Costs one host copy "
                       "of the optimizer shards per rank (fp32 masters and moments).")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="On SIGTERM, save a checkpoint at the next iteration boundary and "
                       "exit cleanly (what schedulers send before killing a job).")
    group.add_argument("--no-load-optim", action="store_true",
                       help="Load only the weights from --load, not optimizer states.")
    group.add_argument("--no-load-rng", action="store_true",
                       help="Do not restore each rank's random streams from --load.")
    group.add_argument("--no-load-fallback", action="store_true",
                       help="Stop when the latest checkpoint in --load is incomplete or fails "
                       "its checksums, instead of resuming from the newest one that verifies.")
    group.add_argument("--ckpt-format", default="torch",
                       choices=("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"),
                       help="Accepted, no effect: checkpoints are always this engine's "
                       "sharded files (one per rank, a 'latest' tag), not Megatron's formats.")


def _add_distributed_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--cuda-graph", "--enable-cuda-graph", dest="cuda_graph",
                       action="store_true",
                       help="Capture the whole iteration (forward, backward, step) as one CUDA "
                       "graph after the warm-up and replay it: one launch per iteration. bf16 "
                       "or fp32 on CUDA; where it cannot apply the run says why and stays "
                       "eager (DeepSpeed JSON: cuda_graph.enabled).")
    group.add_argument("--cuda-graph-warmup-steps", dest="cuda_graph_warmup_steps", type=int,
                       default=3, help="Eager iterations before the capture (default: 3).")
    group.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                       help="Bound on every collective: a rank that dies ends the job after "
                       "at most this long instead of hanging it (default: 10).")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1,
                       help="Must be 1: this engine is data-parallel ZeRO only.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                       help="Must be 1: this engine is data-parallel ZeRO only.")
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="Must be 1: this engine is data-parallel ZeRO only.")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="Accepted, no effect: it splits activations across tensor-parallel "
                       "ranks, and Megatron-LM too turns it off at tensor-parallel size 1.")
    group.add_argument("--distributed-backend", choices=("nccl", "gloo", "ccl"), default=None,
                       help="torch.distributed backend (default: nccl with CUDA, else gloo). "
                       "One this machine cannot use (nccl without CUDA) gives way to the one "
                       "that works, and rank 0 says so.")
    group.add_argument("--DDP-impl", choices=("local", "torch"), default="local",
                       help="Accepted, no effect: the ZeRO engine replaces DDP.")
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="Accepted: optimizer states are partitioned across data-parallel "
                       "ranks at ZeRO stage 1 and above (refused with --zero-stage 0).")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="Accepted: gradient reduction overlaps backward "
                       "(zero_optimization.overlap_comm, on unless the JSON turns it off).")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="Accepted: weight gathers overlap compute (likewise overlap_comm).")
    group.add_argument("--grad-reduce-in-bf16", action="store_true",
                       help="Reduce gradients in bf16 (DeepSpeed's communication_data_type "
                       "bf16).")
    group.add_argument("--zero-stage", type=int, default=3,
                       help="0 = plain data parallel, 3 = ZeRO-3 with the ZeRO++ options of the "
                       "DeepSpeed config (default: 3).")
    group.add_argument("--deepspeed", action="store_true",
                       help="Accepted for Megatron-DeepSpeed compatibility; always on.")
    group.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                       default=None, help="DeepSpeed JSON config (ZeRO++ keys, batch, fp16).")
    group.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                       help="Set by the launcher (default: $LOCAL_RANK or 0).")
    group.add_argument("--ranks-per-node", type=int, default=None, help="Simulated node size.")


def _add_logging_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--log-interval", type=int, default=100,
                       help="Iterations between log lines (default: 100).")
    group.add_argument("--eval-interval", type=int, default=1000,
                       help="Iterations between evaluations (default: 1000).")
    group.add_argument("--eval-iters", type=int, default=100, help="Batches per evaluation.")
    group.add_argument("--wandb-project", default=None, help="W&B project; enables W&B.")
    group.add_argument("--wandb-exp-name", default=None, help="W&B run name.")
    group.add_argument("--wandb-save-dir", default=None, help="W&B run directory root.")
    group.add_argument("--tensorboard-dir", default=None, help="Enables TensorBoard scalars.")
    group.add_argument("--metrics-file", default=None,
                       help="Append one JSON object per log interval to this file.")
    group.add_argument("--log-throughput", action="store_true",
                       help="Accepted: every log line shows tokens/s and TFLOPs per GPU.")
    group.add_argument("--profile", action="store_true",
                       help="Accepted, no effect: attach a profiler (nsys, torch.profiler) "
                       "from outside.")
    group.add_argument("--profile-step-start", type=int, default=10,
                       help="Accepted, no effect (see --profile).")
    group.add_argument("--profile-step-end", type=int, default=12,
                       help="Accepted, no effect (see --profile).")


def _add_watchdog_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--no-watchdog", dest="watchdog", action="store_false",
                       help="Run no hang watchdog: a hung rank then ends the job only at "
                       "--distributed-timeout-minutes.")
    group.add_argument("--hang-timeout", type=float, default=10.0, metavar="S",
                       help="Floor of the hang timeout once the first iterations are done: a "
                       "rank silent or stalled longer than max(S, k x the longest iteration) "
                       "is declared hung, its flight recorder dumped and the job ended for "
                       "the supervisor to restart (default 10; at least 3 heartbeats).")
    group.add_argument("--hang-timeout-factor", type=float, default=10.0, metavar="K",
                       help="k of the hang timeout (default 10: a step 5x slower than the "
                       "slowest one seen is no hang).")
    group.add_argument("--hang-startup-timeout", type=float, default=300.0, metavar="S",
                       help="Hang timeout of the first iterations (compiles, communicator "
                       "set-up) (default 300).")
    group.add_argument("--hang-startup-iterations", type=int, default=2, metavar="N",
                       help="Iterations that get --hang-startup-timeout (default 2).")
    group.add_argument("--hang-checkpoint-timeout", type=float, default=600.0, metavar="S",
                       help="Hang timeout of a checkpoint save or load, or k x the longest "
                       "one seen if longer (default 600).")
    group.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="S",
                       help="Seconds between a rank's heartbeats in the rendezvous store "
                       "(default 1).")
    group.add_argument("--flight-recorder-size", type=int, default=2048, metavar="N",
                       help="Collectives each rank keeps for its hang dump (default 2048).")


def _add_dry_run_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--dry-run-nodes", type=int, default=1,
                       help="Nodes of the cluster to plan memory and communication for "
                       "(default: 1).")
    group.add_argument("--dry-run-gpus-per-node", type=int, default=None,
                       help="GPUs (ranks) per planned node (default: --ranks-per-node, else 1).")
    group.add_argument("--dry-run-gpu-memory-gb", type=float, default=32.0,
                       help="Memory of one planned GPU in GiB (default: 32, a V100-32GB).")
    group.add_argument("--dry-run-simulate", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="Also run the program as rank 0 of the planned cluster on the "
                       "simulated GPU cluster (meta tensors) and print the measured peak "
                       "memory next to the plan (default: on; an 18B model takes about two "
                       "minutes per system).")
    group.add_argument("--dry-run-cluster", default=None, metavar="NAME",
                       help="Also predict the seconds per iteration and TFLOPs per GPU of "
                       "ZeRO-3 and the configured ZeRO++ on this built-in cluster "
                       "(zeropp.planning.step_time.CLUSTERS: dgx2_100g, dgx2_200g, dgx2_400g, "
                       "dgx2_800g, dgx_a100, dgx_h100), by replaying the simulated rank's "
                       "iteration (needs --dry-run-simulate). Default: every built-in cluster "
                       "with as many GPUs per node as planned.")
    group.add_argument("--dry-run-kernel-rates", default=None, metavar="PATH",
                       help="Predict with the quantization kernels' bytes/s measured by the "
                       "GPU check (its gpu_check.json, from scripts/gpu_check.sh) instead of "
                       "the memory roofline (needs --dry-run-simulate).")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``); nothing is validated yet.

    Besides the flags, the namespace carries bookkeeping used by the later steps:
    ``explicit_args`` (dests the user typed), ``ds_config_sources`` (dest -> (JSON key, file)
    that supplied it), ``ds_gradient_accumulation_steps`` and ``derived_values``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    args.explicit_args = _explicitly_given_dests(argv, dests=vars(args))
    ensure_bookkeeping(args)
    return args


def ensure_bookkeeping(args: argparse.Namespace) -> None:
    """Give ``args`` the bookkeeping attributes ``parse_args`` documents, where missing."""
    # A namespace built by hand (not by parse_args) counts every value as a default.
    for name, empty in (("explicit_args", frozenset()), ("ds_config_sources", {}),
                        ("ds_gradient_accumulation_steps", None), ("derived_values", {})):
        if not hasattr(args, name):
            setattr(args, name, empty)


def ds_source(args: argparse.Namespace) -> str:
    """How messages name the DeepSpeed JSON: its path."""
    return args.deepspeed_config or "the DeepSpeed config"


def _explicitly_given_dests(argv: list[str] | None, dests: dict[str, Any]) -> frozenset[str]:
    # argparse only fills attributes a namespace lacks, so a namespace pre-filled with a
    # sentinel keeps the sentinel exactly where the user typed nothing.
    not_given = object()
    namespace = argparse.Namespace(**dict.fromkeys(dests, not_given))
    parsed = build_parser().parse_args(argv, namespace=namespace)
    return frozenset(dest for dest, value in vars(parsed).items() if value is not not_given)


# -------------------- Validation and derived values --------------------------------------------


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check ``args`` for ``world_size`` ranks and fill derived values; returns ``args``.

    Derived: ``data_parallel_size``, ``global_batch_size`` (default micro x dp),
    ``gradient_accumulation_steps``, ``params_dtype``, ``ffn_hidden_size``,
    ``max_position_embeddings``, the resolved architecture and recomputation switches
    (``arguments_model.check_model_shape``), ``train_iters`` / ``lr_decay_iters`` /
    ``lr_warmup_iters`` (from the ``-samples`` flags, or ``--lr-warmup-fraction``, or
    ``lr_decay_iters`` = ``--train-iters``), ``local_rank``, ``data_blend`` (list of
    (normalised weight, prefix) or None) and ``split_fractions`` (train, valid, test).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ArgumentError(f"world size must be a positive integer, got {world_size!r}")
    ensure_bookkeeping(args)
    _forget_derived_values(args)
    _check_required_model_shape(args)
    _check_ranges(args)
    _check_parallelism(args, world_size)
    check_model_shape(args)
    _check_precision(args)
    _derive_batch_sizes(args, world_size)
    _derive_iterations_from_samples(args)
    _derive_lr_schedule(args)
    _derive_data(args)
    _check_run_control(args)
    args.world_size = world_size
    return args


def _forget_derived_values(args: argparse.Namespace) -> None:
    # A re-validation must recompute what the previous one filled in, unless someone has since
    # set the value (the DeepSpeed JSON or the caller).
    for dest, value in args.derived_values.items():
        if dest not in args.ds_config_sources and getattr(args, dest) == value:
            setattr(args, dest, None)
    args.derived_values = {}


def _check_parallelism(args: argparse.Namespace, world_size: int) -> None:
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size"):
        if getattr(args, dest) != 1:
            raise ArgumentError(f"this engine is data-parallel ZeRO only; {_flag(dest)} must be 1, "
                                f"got {getattr(args, dest)}")
    if args.zero_stage not in SUPPORTED_ZERO_STAGES:
        raise ArgumentError(f"{_describe(args, 'zero_stage')} is not a ZeRO stage: use 0 (plain "
                            "data parallel), 1, 2 or 3 (ZeRO-3, with the ZeRO++ options of the "
                            "DeepSpeed config)")
    if args.use_distributed_optimizer and args.zero_stage == 0:
        raise ArgumentError(f"--use-distributed-optimizer partitions optimizer states, which "
                            f"ZeRO stage 1 and above do; {_describe(args, 'zero_stage')} "
                            "replicates them: use stage 1 or higher")
    if args.ranks_per_node is not None and world_size % args.ranks_per_node:
        raise ArgumentError(f"--ranks-per-node {args.ranks_per_node} does not divide the world "
                            f"size {world_size}")
    args.data_parallel_size = world_size
    if args.local_rank is None:
        local_rank = os.environ.get("LOCAL_RANK", "0")
        if not local_rank.isdigit():
            raise ArgumentError(f"environment variable LOCAL_RANK={local_rank!r} is not an integer")
        args.local_rank = int(local_rank)


def _check_required_model_shape(args: argparse.Namespace) -> None:
    for dest in _REQUIRED_MODEL_SHAPE:
        if getattr(args, dest) is None:
            raise ArgumentError(f"{_flag(dest)} is required")


def _check_ranges(args: argparse.Namespace) -> None:
    for dest in _POSITIVE_IF_SET:
        value = getattr(args, dest)
        if value is not None and value <= 0:
            raise ArgumentError(f"{_describe(args, dest)} must be positive")
    for dest in _NON_NEGATIVE_IF_SET:
        value = getattr(args, dest)
        if value is not None and value < 0:
            raise ArgumentError(f"{_describe(args, dest)} must not be negative")
    for dest in _PROBABILITIES:
        if not 0.0 <= getattr(args, dest) < 1.0:
            raise ArgumentError(f"{_describe(args, dest)} must lie in [0, 1)")


def _check_precision(args: argparse.Namespace) -> None:
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 are mutually exclusive; choose one")
    for dest in _FP8_FLAGS:
        value = getattr(args, dest)
        if value not in (None, False):
            shown = _flag(dest) if value is True else f"{_flag(dest)} {value}"
            raise ArgumentError(f"{shown}: there is no FP8 path here (FP8 GEMMs need "
                                "Transformer Engine); train in --bf16 instead")
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 \
        else torch.float32


def _derive_batch_sizes(args: argparse.Namespace, world_size: int) -> None:
    accumulation_from_ds = args.ds_gradient_accumulation_steps
    if args.micro_batch_size is None:
        _derive_micro_batch_size(args, world_size, accumulation_from_ds)
    if args.global_batch_size is None:
        _derive(args, "global_batch_size",
                args.micro_batch_size * world_size * (accumulation_from_ds or 1))
    samples_per_micro_step = args.micro_batch_size * world_size
    if args.global_batch_size % samples_per_micro_step:
        raise ArgumentError(
            f"{_describe(args, 'global_batch_size')} is not divisible by "
            f"{_describe(args, 'micro_batch_size')} x data-parallel size {world_size} "
            f"(= {samples_per_micro_step})"
        )
    args.gradient_accumulation_steps = args.global_batch_size // samples_per_micro_step
    accumulation = args.gradient_accumulation_steps
    if accumulation_from_ds is not None and accumulation_from_ds != accumulation:
        raise ArgumentError(
            f"gradient_accumulation_steps {accumulation_from_ds} in {ds_source(args)} "
            f"disagrees with {_describe(args, 'global_batch_size')} / "
            f"({_describe(args, 'micro_batch_size')} x data-parallel size {world_size}) "
            f"= {accumulation}"
        )


def _derive_micro_batch_size(args: argparse.Namespace, world_size: int,
                             accumulation_from_ds: int | None) -> None:
    # DeepSpeed semantics: any two of (train batch, micro batch, accumulation) give the third.
    if args.global_batch_size is None or accumulation_from_ds is None:
        raise ArgumentError("--micro-batch-size is required (or train_micro_batch_size_per_gpu "
                            "in the DeepSpeed config)")
    samples_per_micro_batch = accumulation_from_ds * world_size
    if args.global_batch_size % samples_per_micro_batch:
        raise ArgumentError(
            f"{_describe(args, 'global_batch_size')} is not divisible by "
            f"gradient_accumulation_steps {accumulation_from_ds} x data-parallel size "
            f"{world_size} (= {samples_per_micro_batch})"
        )
    _derive(args, "micro_batch_size", args.global_batch_size // samples_per_micro_batch)


def _derive_iterations_from_samples(args: argparse.Namespace) -> None:
    """Megatron-LM's sample-based flags -> iterations (// global batch, rounded down)."""
    for dest in ("rampup_batch_size", "step_batch_size_schedule"):
        if getattr(args, dest) is not None:
            raise ArgumentError(f"{_flag(dest)} {' '.join(getattr(args, dest))}: the global "
                                "batch is fixed for the whole run here; give "
                                "--global-batch-size only")
    pairs = (("train_samples", "train_iters"), ("lr_decay_samples", "lr_decay_iters"),
             ("lr_warmup_samples", "lr_warmup_iters"), ("lr_warmup_samples",
                                                         "lr_warmup_fraction"))
    for samples, other in pairs:
        if getattr(args, samples) is not None and getattr(args, other) is not None:
            raise ArgumentError(f"{_describe(args, samples)} and {_describe(args, other)} are "
                                "mutually exclusive; give one")
    if args.train_samples is None:
        for dest in ("lr_decay_samples", "lr_warmup_samples"):
            if getattr(args, dest) is not None:  # Megatron-LM asserts the same
                raise ArgumentError(f"{_describe(args, dest)} is for sample-based training: "
                                    f"give --train-samples, or use {_flag(dest[:-7] + 'iters')}"
                                    " with --train-iters")
        return
    for dest in ("lr_decay_iters", "lr_warmup_iters"):
        if getattr(args, dest) is not None:
            raise ArgumentError(f"{_describe(args, dest)} with --train-samples: use "
                                f"{_flag(dest[:-5] + 'samples')}")
    batch = args.global_batch_size
    for samples, iterations in pairs[:3]:
        count = getattr(args, samples)
        if count is None:
            continue
        if count // batch == 0 and samples != "lr_warmup_samples":
            raise ArgumentError(f"{_describe(args, samples)} is less than one "
                                f"{_describe(args, 'global_batch_size')}")
        _derive(args, iterations, count // batch)


def _derive_lr_schedule(args: argparse.Namespace) -> None:
    training = not args.dry_run
    if training and args.train_iters is None:
        raise ArgumentError("--train-iters is required for training")
    if training and args.lr is None:
        raise ArgumentError("--lr is required for training (or optimizer.params.lr in the "
                            "DeepSpeed config)")
    if args.lr is not None and args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} exceeds {_describe(args, 'lr')}")
    if args.lr_warmup_iters is not None and args.lr_warmup_fraction is not None:
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} and --lr-warmup-fraction "
                            f"{args.lr_warmup_fraction} are mutually exclusive; give one")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        raise ArgumentError(f"--lr-warmup-fraction {args.lr_warmup_fraction} must lie in [0, 1]")
    if args.lr_decay_iters is None and args.train_iters is not None:
        _derive(args, "lr_decay_iters", args.train_iters)
    if args.lr_warmup_fraction is not None:
        if args.lr_decay_iters is None:
            raise ArgumentError("--lr-warmup-fraction needs --lr-decay-iters or --train-iters")
        _derive(args, "lr_warmup_iters", int(args.lr_warmup_fraction * args.lr_decay_iters))
    elif args.lr_warmup_iters is None:
        _derive(args, "lr_warmup_iters", 0)
    if args.lr_decay_iters is not None and args.lr_decay_style != "constant" \
            and args.lr_warmup_iters > args.lr_decay_iters:
        raise ArgumentError(f"{_describe(args, 'lr_warmup_iters')} exceeds "
                            f"{_describe(args, 'lr_decay_iters')}")
    if args.decoupled_lr is None:
        if args.decoupled_min_lr is not None:
            raise ArgumentError(f"--decoupled-min-lr {args.decoupled_min_lr} needs "
                                "--decoupled-lr")
    elif (args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr) \
            > args.decoupled_lr:
        floor = "decoupled_min_lr" if args.decoupled_min_lr is not None else "min_lr"
        raise ArgumentError(f"{_describe(args, floor)} exceeds --decoupled-lr "
                            f"{args.decoupled_lr}")


def _derive_data(args: argparse.Namespace) -> None:
    args.data_blend = parse_data_blend(args.data_path)
    args.split_fractions = parse_split(args.split)


def parse_data_blend(data_path: list[str] | None) -> list[tuple[float, str]] | None:
    """``["A"]`` -> ``[(1.0, "A")]``; ``["0.3", "A", "0.7", "B"]`` -> normalised weights."""
    if not data_path:
        return None
    if len(data_path) == 1:
        return [(1.0, data_path[0])]
    if len(data_path) % 2:
        raise ArgumentError(f"--data-path takes one prefix or weight-prefix pairs such as "
                            f"'0.3 A 0.7 B'; got {len(data_path)} values")
    weights = []
    for text in data_path[0::2]:
        try:
            weight = float(text)
        except ValueError:
            raise ArgumentError(f"--data-path weight {text!r} is not a number") from None
        if not math.isfinite(weight) or weight < 0:
            raise ArgumentError(f"--data-path weight {text!r} must be a finite non-negative number")
        weights.append(weight)
    total = sum(weights)
    if total == 0:
        raise ArgumentError("--data-path weights sum to zero")
    prefixes = data_path[1::2]
    return [(weight / total, prefix) for weight, prefix in zip(weights, prefixes, strict=True)]


def parse_split(split: str) -> tuple[float, float, float]:
    """``"969,30,1"`` (or ``"969/30/1"``) -> normalised (train, valid, test) fractions."""
    text = split.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        # Megatron-LM's Llama example passes "--split '99,1,0'" from a bash array, which hands
        # the quotes to the program; Megatron-LM reads only the numbers, so does this.
        text = text[1:-1]
    parts = text.replace("/", ",").split(",")
    if len(parts) > 3:
        raise ArgumentError(f"--split {split!r} has more than three parts (train,valid,test)")
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        raise ArgumentError(f"--split {split!r} must be comma-separated numbers") from None
    if any(not math.isfinite(weight) or weight < 0 for weight in weights) or sum(weights) == 0:
        raise ArgumentError(f"--split {split!r} needs non-negative weights with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return (weights[0] / total, weights[1] / total, weights[2] / total)


def _check_run_control(args: argparse.Namespace) -> None:
    if args.data_impl in ("lazy", "cached"):
        raise ArgumentError(f"--data-impl {args.data_impl}: only Megatron's mmap indexed "
                            "dataset is read here (the lazy and cached formats predate it); "
                            "use --data-impl mmap")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ArgumentError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.save_interval is not None and args.save is None:
        raise ArgumentError(f"--save-interval {args.save_interval} needs --save DIR")
    if args.deepspeed_config is not None and not os.path.isfile(args.deepspeed_config):
        raise ArgumentError(f"--deepspeed_config {args.deepspeed_config}: no such file")
