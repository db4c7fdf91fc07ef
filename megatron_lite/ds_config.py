"""The DeepSpeed JSON of a run: read and parsed once, reconciled with the command line.

The one place where the application's two sources of engine settings meet: the file is
read and parsed once into the engine's typed ``EngineConfig`` (wrong keys and types fail
there, naming the key), then compared with the command line (``reconcile_with_ds_config``: a
value set in both must agree; the config's ``explicit_keys`` say which values the file set),
and after ``validate_args`` every value the command line resolved is set on it
(``engine_config``). The training run and the dry run both take their config from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable
from typing import Any

from megatron_lite.arguments import ArgumentError, ds_source, ensure_bookkeeping, validate_args
from megatron_lite.arguments_model import describe, flag
from zeropp.config import ConfigError, EngineConfig, OptimizerConfig, read_json_config


def read_ds_config(args: argparse.Namespace) -> EngineConfig:
    """The DeepSpeed JSON (empty without --deepspeed_config), read and parsed once, then
    reconciled with the command line; ``engine_config`` later sets every value the command
    line resolved."""
    if args.deepspeed_config is None:
        return EngineConfig()
    path = args.deepspeed_config
    if not os.path.isfile(path):
        raise ArgumentError(f"--deepspeed_config {path}: no such file")
    raw = read_json_config(path)  # its errors name the file, line and column
    try:
        config = EngineConfig.from_mapping(raw)
    except ConfigError as error:  # names the key; the file is named here
        raise ConfigError(f"{path}: {error}") from None
    reconcile_with_ds_config(args, config)
    return config


# -------------------- Reconciliation with the command line --------------------------------------


def reconcile_with_ds_config(args: argparse.Namespace, config: EngineConfig) -> None:
    """Make the CLI and the parsed DeepSpeed JSON agree on every value both can set.

    Only values the file set count (``config.explicit_keys``), at their parsed types. A value
    set in both places must be equal (else ``ArgumentError`` naming both places and both
    values); a value set in one place is taken from there. If ``validate_args`` already ran,
    it runs again so derived values (global batch, accumulation steps) follow the JSON.
    """
    if not isinstance(config, EngineConfig):
        raise TypeError("reconcile_with_ds_config takes the parsed config (EngineConfig."
                        f"from_json), got {type(config).__name__}")
    ensure_bookkeeping(args)
    source = ds_source(args)
    _take_or_compare(args, config, "micro_batch_size", "train_micro_batch_size_per_gpu", source)
    _take_or_compare(args, config, "global_batch_size", "train_batch_size", source)
    accumulation = config.explicit_value("gradient_accumulation_steps")
    if accumulation is not None:
        args.ds_gradient_accumulation_steps = accumulation
    _take_or_compare(args, config, "clip_grad", "gradient_clipping", source)
    _reconcile_precision(args, config, source)
    _reconcile_loss_scaling(args, config, source)
    _take_or_compare(args, config, "zero_stage", "zero_optimization.stage", source)
    _reconcile_optimizer(args, config, source)
    _reconcile_communication(args, config, source)
    _take_or_compare(args, config, "cuda_graph", "cuda_graph.enabled", source)
    _take_or_compare(args, config, "cuda_graph_warmup_steps", "cuda_graph.warmup_iterations",
                     source)
    if getattr(args, "world_size", None) is not None:
        validate_args(args, args.world_size)


def _reconcile_precision(args: argparse.Namespace, config: EngineConfig, source: str) -> None:
    _take_or_compare(args, config, "fp16", "fp16.enabled", source)
    _take_or_compare(args, config, "bf16", "bf16.enabled", source)  # or its alias bfloat16
    if args.fp16 and args.bf16:
        raise ArgumentError(f"fp16 and bf16 are both enabled ({describe(args, 'fp16')} and "
                            f"{describe(args, 'bf16')}); choose one")


def _reconcile_loss_scaling(args: argparse.Namespace, config: EngineConfig, source: str) -> None:
    # DeepSpeed spells "dynamic" as loss_scale 0 and the initial scale as a power of two.
    _take_or_compare(args, config, "loss_scale", "fp16.loss_scale", source,
                     convert=lambda value: None if value == 0 else float(value))
    _take_or_compare(args, config, "initial_loss_scale", "fp16.initial_scale_power", source,
                     convert=lambda power: 2.0 ** power)
    for dest in ("min_loss_scale", "loss_scale_window", "hysteresis"):
        _take_or_compare(args, config, dest, f"fp16.{dest}", source)


def _reconcile_optimizer(args: argparse.Namespace, config: EngineConfig, source: str) -> None:
    optimizer = config.optimizer
    if optimizer is None:
        return  # no block: the command line decides
    _reconcile_optimizer_type(args, config, optimizer, source)
    if args.optimizer == "sgd":
        _take_or_compare(args, config, "sgd_momentum", "optimizer.params.momentum", source)
    _take_or_compare(args, config, "lr", "optimizer.params.lr", source)
    _take_or_compare(args, config, "weight_decay", "optimizer.params.weight_decay", source)
    _take_or_compare(args, config, "adam_eps", "optimizer.params.eps", source)
    betas = config.explicit_value("optimizer.params.betas")
    if betas is not None:
        for index, dest in enumerate(("adam_beta1", "adam_beta2")):
            _take(args, dest, f"optimizer.params.betas[{index}]", betas[index], source)


def _reconcile_optimizer_type(args: argparse.Namespace, config: EngineConfig,
                              optimizer: OptimizerConfig, source: str) -> None:
    # The parser has normalized DeepSpeed's spellings: its Adam is decoupled (AdamW) unless
    # adam_w_mode is false, as Megatron's adam is; the L2-coupled Adam and Adagrad have no
    # --optimizer of their own.
    ours = {"AdamW": "adam", "SGD": "sgd"}.get(optimizer.type)
    if "optimizer" in args.explicit_args and args.optimizer != ours:
        shown = ('"Adam" with adam_w_mode false' if optimizer.type == "Adam"
                 else json.dumps(optimizer.type))
        if "optimizer.type" not in config.explicit_keys:
            shown += " (the default of an optimizer block without a type)"
        raise ArgumentError(f"--optimizer {args.optimizer} disagrees with optimizer.type "
                            f"{shown} in {source}")
    if ours is not None:  # else the JSON's own class (Adagrad, L2 Adam) runs
        args.optimizer = ours
        args.ds_config_sources["optimizer"] = ("optimizer.type", source)


def _reconcile_communication(args: argparse.Namespace, config: EngineConfig,
                             source: str) -> None:
    if config.explicit_value("zero_optimization.overlap_comm") is False:
        for dest in ("overlap_grad_reduce", "overlap_param_gather"):
            if getattr(args, dest):
                raise ArgumentError(f"{flag(dest)} disagrees with zero_optimization."
                                    f"overlap_comm false in {source}")
    dtype = config.communication_data_type
    if args.grad_reduce_in_bf16 and dtype is not None and dtype != "bf16":
        raise ArgumentError(f"--grad-reduce-in-bf16 disagrees with communication_data_type "
                            f"{json.dumps(dtype)} in {source}")


def _take_or_compare(args: argparse.Namespace, config: EngineConfig, dest: str, key: str,
                     source: str, convert: Callable[[Any], Any] | None = None) -> None:
    """``_take`` the value the file set at ``key``, if it set one."""
    written = config.explicit_value(key)
    if written is not None:
        _take(args, dest, key, written, source, convert)


def _take(args: argparse.Namespace, dest: str, key: str, written: Any, source: str,
          convert: Callable[[Any], Any] | None = None) -> None:
    """Set ``dest`` from the file's value (``convert`` turns DeepSpeed's spelling into the
    flag's), unless the user typed a different value for it: that is an error."""
    current = getattr(args, dest)
    value = convert(written) if convert else written
    if dest in args.explicit_args and current != value:
        cli = flag(dest) if isinstance(current, bool) else f"{flag(dest)} {current}"
        shown = _as_json(written)
        if value is not None and value != written:  # e.g. initial_scale_power 16 (= 65536)
            shown += f" (= {value:g})"
        raise ArgumentError(f"{cli} disagrees with {key} {shown} in {source}")
    setattr(args, dest, value)
    args.ds_config_sources[dest] = (key, source)


def _as_json(value: Any) -> str:
    """A parsed value as the file would write it: 0.0 was parsed from 0 as likely as not."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value)


# -------------------- The engine's config -------------------------------------------------------


def engine_config(args: argparse.Namespace, ds_config: EngineConfig) -> EngineConfig:
    """The config the engine gets: the file's, with every value the command line resolved.

    Without an optimizer block in the file, ``--optimizer`` chooses the class (adam: AdamW,
    sgd: SGD); with one, ``reconcile_with_ds_config`` has made the two agree.
    """
    optimizer = ds_config.optimizer
    if optimizer is None:
        optimizer = OptimizerConfig(type="SGD" if args.optimizer == "sgd" else "AdamW")
    return dataclasses.replace(
        ds_config,
        optimizer=optimizer,
        communication_data_type="bf16" if args.grad_reduce_in_bf16
        else ds_config.communication_data_type,
        train_micro_batch_size_per_gpu=args.micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        train_batch_size=args.global_batch_size,
        gradient_clipping=args.clip_grad,
        zero_optimization=dataclasses.replace(ds_config.zero_optimization, stage=args.zero_stage),
        fp16=dataclasses.replace(ds_config.fp16, **fp16_block(args)),
        bf16=dataclasses.replace(ds_config.bf16, enabled=bool(args.bf16)),
        cuda_graph=dataclasses.replace(ds_config.cuda_graph, enabled=bool(args.cuda_graph),
                                       warmup_iterations=args.cuda_graph_warmup_steps),
    )


def optimizer_params(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """The command line's hyperparameters for the optimizer class ``kind`` (an
    ``OptimizerConfig.type``): what each torch class takes, nothing it would refuse."""
    params: dict[str, Any] = {"lr": args.lr, "weight_decay": args.weight_decay}
    if kind in ("Adam", "AdamW"):
        params.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    elif kind == "SGD":
        params["momentum"] = args.sgd_momentum
    return params


def fp16_block(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's fp16 settings as ``FP16Config`` fields."""
    if not args.fp16:
        return {"enabled": False}
    power = math.log2(args.initial_loss_scale)
    if not power.is_integer():
        raise ArgumentError(f"--initial-loss-scale {args.initial_loss_scale:g} must be a power "
                            "of two (DeepSpeed stores it as initial_scale_power)")
    return {
        "enabled": True,
        "loss_scale": args.loss_scale or 0,  # 0 selects dynamic scaling
        "initial_scale_power": int(power),
        "loss_scale_window": args.loss_scale_window,
        "hysteresis": args.hysteresis,
        "min_loss_scale": args.min_loss_scale,
    }
