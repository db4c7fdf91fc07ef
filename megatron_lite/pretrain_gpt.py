"""Pretrain a Megatron GPT-2 on the ZeRO-3 / ZeRO++ engine: the program behind
``pretrain_zeropp_gpt.py`` (its docstring has the command line).

The steps, in order: command line -> process group -> DeepSpeed JSON reconciled with the
command line -> validation for this world size -> tokenizer -> datasets and this rank's
loaders -> GPT config -> model on the meta device -> engine (each rank materializes only
its shard) -> lr schedule -> training loop -> final validation loss.
The test split of ``--split`` is held out: no sample of it is read.

Errors in the command line or the DeepSpeed config print one ``error: ...`` line and exit
with status 2; other bad input (missing data, too small a dataset) exits with status 1.

The entry point imports this module and so does ``megatron_lite.simulate`` (which runs
``main`` as one rank of a simulated cluster); ``--dry-run`` is dispatched by the entry point,
so that the dry run, which simulates, and this module do not import each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import zeropp
from data.gpt_dataset import MockGPTDataset, build_train_valid_test_datasets
from data.samplers import build_pretraining_data_loader
from data.tokenizers import build_tokenizer
from megatron_lite.arguments import (
    ArgumentError,
    gpt_config_from_args,
    parse_args,
    validate_args,
)
from megatron_lite.checkpointing import (
    CheckpointConfig,
    RunControl,
    SaveFailed,
    plain_arguments,
)
from megatron_lite.ds_config import engine_config, optimizer_params, read_ds_config
from megatron_lite.metrics import MetricsWriter
from megatron_lite.model import GPTModel, describe_count, lm_loss
from megatron_lite.supervise import note_usage_error
from megatron_lite.training import (
    LoaderFactory,
    LoopConfig,
    LossFunction,
    TrainingSummary,
    perplexity,
    pretrain,
)
from zeropp.config import EngineConfig
from zeropp.deepspeed_api.lr_schedules import AnnealingLR

USAGE_ERRORS = (ArgumentError, zeropp.ConfigError, zeropp.TopologyError)

# run_dry_run(args, argv) -> exit status
DryRun = Callable[[argparse.Namespace, list[str] | None], int]


def main(argv: list[str] | None = None, dry_run: DryRun | None = None) -> int:
    """Run the command line ``argv`` (None: ``sys.argv``) and return the exit status.

    A ``--dry-run`` command line goes to ``dry_run`` (pretrain_zeropp_gpt.py passes
    ``megatron_lite.dry_run.run_dry_run``; the simulated cluster, which runs training command
    lines only, passes none): this module does not import the dry run, which imports it.
    """
    owns_process_group = False
    try:
        args = parse_args(argv)
        if args.dry_run:
            if dry_run is None:
                raise ArgumentError("--dry-run is run by pretrain_zeropp_gpt.py")
            return dry_run(args, argv)  # plans any cluster size, simulates its rank 0
        # A process group that exists already (an embedding program, the simulated GPU
        # cluster) belongs to the caller: used, not destroyed.
        owns_process_group = not dist.is_initialized()
        backend, why = choose_backend(args.distributed_backend)
        zeropp.init_distributed(backend=backend, timeout_s=args.distributed_timeout_minutes * 60)
        if why and owns_process_group:
            print_rank_0(f"> distributed backend: {backend} ({why})")
        training = build_training(args)
        print_run_description(args, training.model, training.engine.topology.describe())
    except USAGE_ERRORS as error:
        note_usage_error()  # a supervisor (megatron_lite.supervise) must not restart this
        return fail(error, status=2, destroy=owns_process_group)
    except (FileNotFoundError, ValueError) as error:
        return fail(error, status=1, destroy=owns_process_group)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        with MetricsWriter.from_args(args, enabled=rank == world_size - 1) as metrics_writer:
            summary = training.run(metrics_writer)
    except (SaveFailed, FloatingPointError, zeropp.CheckpointError, ValueError) as error:
        return fail(error, status=1, destroy=owns_process_group)
    finally:
        training.close()
    report(summary)
    if owns_process_group:
        dist.destroy_process_group()
    return 0


@dataclass
class Training:
    """One run, wired: what ``build_training`` makes and the entry point, the tests and the
    benchmarks all train with."""

    args: argparse.Namespace
    model: GPTModel
    engine: zeropp.ZeroEngine
    scheduler: AnnealingLR
    train_loader: LoaderFactory
    valid_loader: LoaderFactory | None
    run_control: RunControl

    def run(self, metrics_writer: MetricsWriter, loss_fn: LossFunction = lm_loss
            ) -> TrainingSummary:
        """Train (resuming from ``--load``), then measure the validation loss."""
        return pretrain(LoopConfig.from_args(self.args), self.engine, self.scheduler, self.model.config,
                        self.train_loader, self.valid_loader, metrics_writer,
                        self.engine.device, loss_fn=loss_fn, run_control=self.run_control)

    def close(self) -> None:
        self.engine.close()


def build_training(args: argparse.Namespace) -> Training:
    """Parsed command line -> a wired run, in the process group that exists already.

    The DeepSpeed JSON is read and parsed once and reconciled with the command line here;
    then the tokenizer, this rank's loaders, the model on the meta device, the engine (each
    rank materializes only its shard), the lr schedule and the run control.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ds_config = read_ds_config(args)
    validate_args(args, world_size)
    check_supported(args, ds_config)
    # One seed for every rank, as Megatron seeds its data-parallel ranks.
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                                merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                                vocab_size=args.vocab_size)
    train_loader, valid_loader = build_loader_factories(args, rank, world_size,
                                                        tokenizer.vocab_size)
    model = build_meta_model(args, tokenizer.vocab_size)
    engine = build_engine(args, model, ds_config)
    scheduler = AnnealingLR(engine.optimizer, max_lr=args.lr, min_lr=args.min_lr,
                            warmup_iters=args.lr_warmup_iters, decay_iters=args.lr_decay_iters,
                            decay_style=args.lr_decay_style)
    return Training(args, model, engine, scheduler, train_loader, valid_loader,
                    RunControl(CheckpointConfig.from_args(args), engine, scheduler, model.config,
                               run_arguments=plain_arguments(args)))


def choose_backend(requested: str | None) -> tuple[str | None, str | None]:
    """(backend to use, why it is not the one asked for, or None).

    ``None`` asked: the engine's choice (NCCL with CUDA, else gloo). A backend this machine
    cannot use gives way to one that works, so a launch script written for GPUs runs
    unchanged on a CPU machine; gloo asked on a GPU machine is honoured (this engine then
    trains on the CPU, as gloo collectives are CPU collectives here).
    """
    if requested is None:
        return None, None
    nccl_works = torch.cuda.is_available() and dist.is_nccl_available()
    fallback = "nccl" if nccl_works else "gloo"
    if requested == "nccl" and not nccl_works:
        return fallback, "--distributed-backend nccl needs CUDA, which this machine lacks"
    if requested == "ccl" and not dist.is_backend_available("ccl"):
        return fallback, ("--distributed-backend ccl needs oneCCL's torch bindings "
                          "(oneccl_bindings_for_pytorch), which are not loaded")
    if requested == "gloo" and torch.cuda.is_available():
        return "gloo", "as --distributed-backend asks: this engine then trains on the CPU"
    return requested, None


def fail(error: Exception, status: int, destroy: bool) -> int:
    print(f"error: {error}", file=sys.stderr, flush=True)
    if destroy:
        dist.destroy_process_group()
    return status


def print_rank_0(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


# ---- configuration ------------------------------------------------------------------------


def check_supported(args: argparse.Namespace, ds_config: EngineConfig) -> None:
    if args.data_path is None and not args.mock_data:
        raise ArgumentError("--data-path is required for training (or --mock-data)")
    if args.data_path is not None and args.mock_data:
        raise ArgumentError("--mock-data and --data-path exclude each other: pick one")
    if ds_config.scheduler is not None:
        raise ArgumentError(
            f"the scheduler block in {args.deepspeed_config} would be ignored: the lr "
            "schedule comes from --lr, --lr-decay-style and --lr-warmup-iters; remove the block"
        )


def build_meta_model(args: argparse.Namespace, vocab_size: int) -> GPTModel:
    """The model without storage: the engine materializes each rank's shard itself."""
    with torch.device("meta"):
        return GPTModel(gpt_config_from_args(args, vocab_size))


def build_loader_factories(
    args: argparse.Namespace, rank: int, world_size: int, vocab_size: int
) -> tuple[LoaderFactory, LoaderFactory | None]:
    """This rank's (train, valid) loader factories; valid is None when its split is empty.

    Sized as in Megatron: train for every iteration's global batch, valid for --eval-iters
    global batches (every evaluation scores the same ones). The test split is held out:
    no sample of it is read, so it stays unseen for a later evaluation.
    """
    global_batch = args.global_batch_size
    valid_samples = args.eval_iters * global_batch if args.split_fractions[1] > 0 else 0
    if args.mock_data:
        train = MockGPTDataset(args.train_iters * global_batch, args.seq_length, vocab_size,
                               args.seed)
        valid = MockGPTDataset(valid_samples, args.seq_length, vocab_size, args.seed + 1) \
            if valid_samples else None
    else:
        train, valid, _ = build_train_valid_test_datasets(
            args.data_path, args.split, args.seq_length, args.seed,
            (args.train_iters * global_batch, valid_samples, 0),
            cache_dir=args.data_cache_dir, build_barrier=dist.barrier, is_builder=rank == 0,
        )

    def factory(dataset: Any) -> LoaderFactory:
        return lambda consumed_samples: build_pretraining_data_loader(
            dataset, consumed_samples, args.micro_batch_size, dp_rank=rank, dp_size=world_size,
            num_workers=args.num_workers,
        )

    return factory(train), factory(valid) if valid is not None else None


# ---- engine and run -----------------------------------------------------------------------


def build_engine(args: argparse.Namespace, model: GPTModel,
                 ds_config: EngineConfig) -> zeropp.ZeroEngine:
    config = engine_config(args, ds_config)
    if args.compile:  # the JSON's compile.enabled ([Note: compiled blocks])
        config = dataclasses.replace(config, compile=dataclasses.replace(config.compile,
                                                                         enabled=True))
    return zeropp.engine_from_config(
        model,
        config,
        ranks_per_node=args.ranks_per_node,
        param_init_fn=model.initial_value,
        optimizer_params=optimizer_params(args, config.optimizer.type),
        model_parameters=parameter_groups(args, model),
    )


def parameter_groups(args: argparse.Namespace, model: GPTModel) -> list[dict] | None:
    """None (the engine's Megatron groups: weight decay on matrices only), or with
    --decoupled-lr those groups plus Megatron-LM's third: the input embedding and output layer
    weights, decayed, with their own peak and final lr (the schedule reads max_lr/min_lr)."""
    if args.decoupled_lr is None:
        return None
    own_lr = {id(model.embedding.word_embeddings.weight)}
    if model.output_layer is not None:
        own_lr.add(id(model.output_layer.weight))
    decay, no_decay, embedding_and_output = [], [], []
    for param in model.parameters():
        if id(param) in own_lr:
            embedding_and_output.append(param)
        else:
            (decay if param.dim() >= 2 else no_decay).append(param)
    floor = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
    return [{"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": embedding_and_output, "weight_decay": args.weight_decay,
             "lr": args.decoupled_lr, "max_lr": args.decoupled_lr, "min_lr": floor}]


def print_run_description(args: argparse.Namespace, model: GPTModel, topology: str) -> None:
    config = model.config
    # From the shapes, not model.parameters(): once the engine holds the model, each rank's
    # parameters are empty views into its shards, and counting them gives 0.
    print_rank_0(f"> GPT model: {describe_count(config.num_parameters())} parameters | "
                 f"{args.num_layers} layers, hidden {args.hidden_size}, "
                 f"{args.num_attention_heads} heads, seq {args.seq_length}, vocab "
                 f"{config.vocab_size} (padded {config.padded_vocab_size})")
    print_rank_0(f"> architecture: {describe_architecture(config)}")
    print_rank_0(f"> topology: {topology}")
    dtype = str(args.params_dtype).removeprefix("torch.")
    print_rank_0(f"> dtype {dtype} | micro batch {args.micro_batch_size} | global batch "
                 f"{args.global_batch_size} | gradient accumulation "
                 f"{args.gradient_accumulation_steps} | zero stage {args.zero_stage} | "
                 f"train iters {args.train_iters}")


def describe_architecture(config) -> str:
    """The switches the command line resolved, so a launch script's flags can be checked:
    'rope (base 10000), RMSNorm, SwiGLU MLP 128, 2 key/value groups, ...'."""
    positions = config.position_embedding_type
    if positions == "rope":
        positions = f"rope (base {config.rotary_base:g}, {config.rotary_percent:.0%} of channels)"
    mlp = f"{'SwiGLU' if config.swiglu else 'GELU'} MLP {config.ffn_hidden_size}"
    attention = f"{config.num_key_value_heads} key/value heads of {config.head_dim} channels"
    head = "untied output layer" if config.untie_embeddings_and_output_weights \
        else "output layer tied to the embedding"
    bias = "linear biases" if config.add_bias_linear else "no linear biases"
    recompute = "full recomputation " + (f"({config.recompute_method}, "
                                         f"{config.checkpoint_num_layers} layers)") \
        if config.checkpoint_activations else \
        "selective recomputation" if config.recompute_attention else "no recomputation"
    return (f"positions {positions}, {config.normalization}, {mlp}, {attention}, {head}, "
            f"{bias}, {recompute}")


def report(summary: TrainingSummary) -> None:
    # The last rank prints the training log; printing here too keeps the lines in order.
    if dist.get_rank() != dist.get_world_size() - 1:
        return
    if summary.final_valid_loss is None:
        why = summary.stop_reason or "--split gives validation no weight or --eval-iters is 0"
        print(f"no validation loss: {why}", flush=True)
        return
    loss = summary.final_valid_loss
    print(f"final validation loss: {loss:.4f} | ppl: {perplexity(loss):.1f}", flush=True)
