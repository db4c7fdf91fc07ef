"""Checkpoints across the DeepSpeed border, in both directions.

    python -m zeropp.convert --from-deepspeed DS_DIR --out DIR [--tag TAG] [--world-size N]
    python -m zeropp.convert --to-fp32 DIR --out FILE [--tag TAG]

``--from-deepspeed`` reads a DeepSpeed ZeRO-1/2/3 checkpoint ([Note: DeepSpeed's checkpoint
layout] in ``zeropp/checkpoints/deepspeed_checkpoint.py``) and writes this engine's ([Note:
checkpoint layout]) through its own writer: fp32 masters, Adam's moments and step, the param groups'
hyperparameters, the loss scale, the step counters, the lr schedule and the client state.
``engine.load_checkpoint`` then resumes the job. The written world size only sets how many
rank files there are: this engine's load reshards to any world size, so ``--world-size``
defaults to DeepSpeed's.

``--to-fp32`` writes what DeepSpeed's ``zero_to_fp32.py`` writes: one torch-saved dict of
every parameter's full fp32 value by its ``state_dict`` name (tied names share one tensor).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from zeropp.checkpoints import checkpoint
from zeropp.checkpoints.checkpoint_files import CheckpointError
from zeropp.checkpoints.deepspeed_checkpoint import (
    MOMENTS,
    DeepSpeedCheckpoint,
    DeepSpeedCheckpointError,
    open_checkpoint,
)
from zeropp.config.json_reading import ConfigError
from zeropp.config.optimizer import OptimizerConfig
from zeropp.flat_layout import FlatLayout

# The whole model as one unit: the load finds parameters by name, whatever its units are.
CONVERTED_UNIT = "<converted from deepspeed>"
# The torch Adam(W) hyperparameters a group carries over (DeepSpeed's own keys stay behind).
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "initial_lr")
_DEEPSPEED_SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def optimizer_type(ckpt: DeepSpeedCheckpoint, asked: str | None = None) -> str:
    """"AdamW" or "Adam": from the config's optimizer block, else from the saved state."""
    block = ckpt.ds_config.get("optimizer")
    if block is not None:
        try:
            kind = OptimizerConfig.from_mapping(block).type
        except ConfigError as exc:
            raise DeepSpeedCheckpointError(f"the checkpoint's optimizer: {exc}") from None
        if kind not in ("Adam", "AdamW"):
            raise DeepSpeedCheckpointError(
                f"optimizer {kind}: only Adam and AdamW checkpoints convert")
        found = kind
    else:  # the client's own optimizer: its state and groups say what it was
        keys = ckpt.state_keys()
        if not set(MOMENTS) <= keys:
            raise DeepSpeedCheckpointError(
                f"optimizer state holds {sorted(keys) or 'nothing'}, not Adam's exp_avg and "
                "exp_avg_sq: only Adam and AdamW checkpoints convert")
        groups = ckpt.param_groups()
        decoupled = {group.get("decoupled_weight_decay") for group in groups}
        if decoupled in ({True}, {False}):  # torch's Adam and AdamW say it
            found = "AdamW" if decoupled == {True} else "Adam"
        elif asked is not None:
            found = asked
        elif all(float(group.get("weight_decay", 0.0)) == 0.0 for group in groups):
            found = "AdamW"  # without weight decay the two take the same step
        else:  # DeepSpeed's FusedAdam keeps adam_w_mode off the checkpoint
            raise DeepSpeedCheckpointError(
                "the checkpoint does not say whether its Adam decayed weights as AdamW or as "
                "Adam (FusedAdam's adam_w_mode): pass --optimizer AdamW or --optimizer Adam")
    if asked is not None and asked != found:
        raise DeepSpeedCheckpointError(
            f"--optimizer {asked}, but the checkpoint's optimizer is {found}")
    return found


def scheduler_state(ckpt: DeepSpeedCheckpoint) -> dict | None:
    """The lr schedule's state as this engine's schedule of the same kind saves it."""
    saved = ckpt.model_states.get("lr_scheduler")
    block = ckpt.ds_config.get("scheduler")
    if saved is None or block is None:
        # None, or the client's own schedule (torch's, Hugging Face's): the same class is
        # given to initialize here and reads its own state.
        return saved
    kind = block.get("type")
    if kind not in _DEEPSPEED_SCHEDULES:
        raise DeepSpeedCheckpointError(
            f"scheduler {kind}: only {', '.join(_DEEPSPEED_SCHEDULES)} and client schedules "
            "convert")
    # The ratios' base (WarmupCosineLR) is the optimizer's lr before any schedule ran.
    base_lr = (ckpt.ds_config.get("optimizer") or {}).get("params", {}).get("lr")
    if base_lr is None:
        if kind == "WarmupCosineLR":
            raise DeepSpeedCheckpointError(
                "WarmupCosineLR: the checkpoint's config has no optimizer lr to take the "
                "schedule's ratios of")
        base_lr = ckpt.param_groups()[0]["lr"] if ckpt.param_groups() else 0.0
    return {"last_step": int(saved["last_batch_iteration"]), "kind": kind,
            "base_lr": float(base_lr)}


def _accumulation_steps(config: dict, world: int) -> int:
    gas = config.get("gradient_accumulation_steps")
    if isinstance(gas, int):
        return gas
    batch, micro = config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")
    if isinstance(batch, int) and isinstance(micro, int) and micro * world:
        return max(1, batch // (micro * world))
    return 1


def _working_dtype(config: dict) -> torch.dtype:
    if (config.get("fp16") or {}).get("enabled"):
        return torch.float16
    if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled"):
        return torch.bfloat16
    return torch.float32


def from_deepspeed(source: str | Path, out: str | Path, tag: str | None = None,
                   world_size: int | None = None, optimizer: str | None = None) -> Path:
    """Convert DeepSpeed checkpoint ``source`` (at ``tag`` or its latest) into this engine's
    format under ``out``, as ``world_size`` rank files; returns the written tag's directory."""
    ckpt = open_checkpoint(source, tag)
    if Path(out).resolve() in (Path(source).resolve(), ckpt.tag_dir.resolve()):
        # Publishing the tag would replace DeepSpeed's own directory of the same name.
        raise DeepSpeedCheckpointError(f"--out {out} is the DeepSpeed checkpoint itself: "
                                       "write the conversion elsewhere")
    kind = optimizer_type(ckpt, optimizer)
    world = world_size or ckpt.world_size
    if world < 1:
        raise DeepSpeedCheckpointError(f"--world-size must be at least 1, got {world}")
    step = ckpt.optimizer_step()
    state_keys = [key for key in (*MOMENTS, "max_exp_avg_sq") if key in ckpt.state_keys()]
    values = {"master": ckpt.full_tensors("master")}
    values.update({key: ckpt.full_tensors(key) for key in state_keys})
    # Parameters no optimizer owns: weights only, no optimizer state (zeros, never read).
    for name, value in ckpt.frozen_tensors().items():
        values["master"][name] = value
        for key in state_keys:
            values[key][name] = torch.zeros_like(value)
    layout = FlatLayout.build([(name, tuple(v.shape)) for name, v in values["master"].items()],
                              num_shards=world)
    config = ckpt.ds_config
    global_steps = int(ckpt.model_states.get("global_steps", 0))
    groups = [{k: v for k, v in group.items() if k in _GROUP_KEYS}
              for group in ckpt.param_groups()]
    lr_schedule = scheduler_state(ckpt)

    def rank_states():
        for rank in range(world):  # one rank's shards in memory at a time
            start, end = layout.shard_range(rank)
            shards = {}
            for field, by_name in values.items():
                shard = torch.empty(layout.shard_numel, dtype=torch.float32)
                layout.fill_shard(shard, rank, lambda slot, by_name=by_name: by_name[slot.name])
                shards[field] = shard
            unit = checkpoint.unit_record(
                CONVERTED_UNIT, layout, start, end, shards["master"],
                {key: shards[key] for key in state_keys})
            yield checkpoint.rank_file_state(
                rank=rank, world_size=world, units=[unit], optimizer_type=kind,
                state_keys=state_keys, optimizer_scalars={"step": step}, param_groups=groups,
                loss_scaler=ckpt.loss_scaler(),
                counters={"global_steps": global_steps,
                          "skipped_steps": int(ckpt.model_states.get("skipped_steps", 0)),
                          "micro_steps": global_steps * _accumulation_steps(config, world)},
                lr_scheduler=lr_schedule, client_state=ckpt.client_state)

    meta = {
        "world_size": world,
        "topology": {"world_size": world, "ranks_per_node": world, "num_nodes": 1,
                     "hpz_size": 1},
        "dtype": str(_working_dtype(config)),
        "units": [[CONVERTED_UNIT, layout.numel, layout.padded_numel]],
        "config": config,
        "shared_params": ckpt.shared_params,
    }
    return checkpoint.write_from_one_process(out, ckpt.tag_dir.name, rank_states(), meta)


def to_fp32(source: str | Path, out: str | Path, tag: str | None = None) -> Path:
    """``zero_to_fp32.py``'s output from this engine's checkpoint: name -> full fp32 tensor."""
    state = checkpoint.consolidate(source, tag)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zeropp.convert",
        description="Convert a DeepSpeed ZeRO checkpoint into this engine's format, or this "
                    "engine's checkpoint into one fp32 state dict.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--from-deepspeed", metavar="DIR",
                      help="a DeepSpeed checkpoint directory (ZeRO stage 1, 2 or 3)")
    what.add_argument("--to-fp32", metavar="DIR", help="this engine's checkpoint directory")
    parser.add_argument("--out", required=True,
                        help="the checkpoint directory to write (--from-deepspeed) or the "
                             "state-dict file (--to-fp32)")
    parser.add_argument("--tag", help="the tag to read (default: the one 'latest' names)")
    parser.add_argument("--world-size", type=int,
                        help="rank files to write (default: DeepSpeed's data-parallel size); "
                             "the load reshards to any world size")
    parser.add_argument("--optimizer", choices=("AdamW", "Adam"),
                        help="FusedAdam's mode where the checkpoint does not say it "
                             "(adam_w_mode true: AdamW)")
    args = parser.parse_args(argv)
    try:
        if args.from_deepspeed:
            written = from_deepspeed(args.from_deepspeed, args.out, args.tag, args.world_size,
                                     args.optimizer)
        else:
            written = to_fp32(args.to_fp32, args.out, args.tag)
    except (DeepSpeedCheckpointError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
