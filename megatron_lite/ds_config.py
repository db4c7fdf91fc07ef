"""The DeepSpeed JSON of a run: read, reconciled with the command line, parsed once.

The one place where the application's two sources of engine settings meet: the file is
compared with the command line (``megatron_lite.arguments.reconcile_with_ds_config``: a
value set in both must agree), parsed into the engine's typed ``EngineConfig``, and after
``validate_args`` every value the command line resolved is set on it (``engine_config``).
The training run and the dry run both take their config from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any

from megatron_lite.arguments import ArgumentError, reconcile_with_ds_config
from zeropp.config import EngineConfig, OptimizerConfig, read_json_config


def read_ds_config(args: argparse.Namespace) -> EngineConfig:
    """The DeepSpeed JSON (empty without --deepspeed_config), reconciled with the command
    line, then parsed once; ``engine_config`` later sets every value the command line
    resolved."""
    if args.deepspeed_config is None:
        return EngineConfig()
    if not os.path.isfile(args.deepspeed_config):
        raise ArgumentError(f"--deepspeed_config {args.deepspeed_config}: no such file")
    raw = read_json_config(args.deepspeed_config)
    reconcile_with_ds_config(args, raw)  # compares what the file itself says
    return EngineConfig.from_json(raw)


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


