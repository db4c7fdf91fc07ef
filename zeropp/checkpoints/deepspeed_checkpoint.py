"""Reading a checkpoint DeepSpeed's ZeRO-1/2/3 wrote: every trainable parameter's full fp32
master and Adam moments by name, with the step, hyperparameters, schedule and client state.

[Note: DeepSpeed's checkpoint layout]
    DIR/latest                                   the tag of the newest checkpoint
    DIR/TAG/mp_rank_00_model_states.pt           stage 1/2: the module (working dtype), counters,
                                                 lr scheduler, param_shapes, client state
    DIR/TAG/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: the same, one per rank
    DIR/TAG/zero_pp_rank_R_mp_rank_00_optim_states.pt   rank R's fp32 partitions and moments

``param_shapes`` lists, per flat group, the names and shapes of the parameters in flat order.

Stage 1/2: a flat group is a param group. Its parameters lie end to end, each followed by
``param_alignment_paddings[i]`` elements; the whole is split into equal partitions, one per
rank, the last padded at its end. ``single_partition_of_fp32_groups`` holds each rank's fp32
partition without that end padding; the moments (``base_optimizer_state``) keep it, so they
are cut to the partition's length.

Stage 3: a flat group is a sub-group. Every parameter is partitioned on its own: rank R holds
elements ``[R * p, (R + 1) * p)`` of it, ``p = ceil(numel / world)``, the last rank's piece
padded. A rank's fp32 flat group is its pieces of the sub-group's parameters end to end;
the moments of sub-group i are the inner optimizer's state i.

The files hold a few DeepSpeed objects (the ZeRO stage enum, the loss scaler): they are read
with ``weights_only=True`` and stand-ins for those classes, so reading runs no pickled code
and needs no DeepSpeed installation.
"""

from __future__ import annotations

import enum
import math
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

MODEL_STATES = "mp_rank_00_model_states.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")
# Keys DeepSpeed's engine writes into the model-states file; the rest is the client's state.
_ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info",
}


class DeepSpeedCheckpointError(ValueError):
    """A DeepSpeed checkpoint that cannot be read here (one-line message)."""


class _ZeroStage(int, enum.Enum):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _SavedLossScaler:
    """Stand-in for DeepSpeed's loss scaler objects: their attributes, nothing else."""


class _SavedRecord:
    """Stand-in for DeepSpeed's small records (a fragment's address): attributes only."""


_STAND_INS = [
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_SavedLossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_SavedLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_SavedRecord, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def _load(path: Path) -> dict:
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            # Memory-mapped where the file allows it (torch's zip format, since torch 1.6).
            return torch.load(path, map_location="cpu", weights_only=True,
                              mmap=zipfile.is_zipfile(path))
    except Exception as exc:  # an object outside DeepSpeed's own, or a damaged file
        text = str(exc)
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        reason = (f"it holds a {found.group(1)} object" if found
                  else text.strip().splitlines()[0] if text.strip() else type(exc).__name__)
        raise DeepSpeedCheckpointError(f"cannot read {path} without running pickled code: "
                                       f"{reason}") from None


@dataclass
class DeepSpeedCheckpoint:
    """One tag of a DeepSpeed ZeRO checkpoint, opened (``open_checkpoint``)."""

    tag_dir: Path
    stage: int
    world_size: int
    model_states: dict  # rank 0's
    optim_states: list[dict]  # each rank's optimizer_state_dict

    @property
    def ds_config(self) -> dict:
        return dict(self.model_states.get("ds_config") or {})

    @property
    def flat_groups(self) -> list[dict[str, tuple[int, ...]]]:
        return [{name: tuple(shape) for name, shape in group.items()}
                for group in self.model_states["param_shapes"]]

    @property
    def shared_params(self) -> dict[str, str]:
        return dict(self.model_states.get("shared_params") or {})

    @property
    def client_state(self) -> dict:
        return {k: v for k, v in self.model_states.items() if k not in _ENGINE_KEYS}

    # ---- the inner (torch) optimizer's state_dict, per rank ------------------------------
    def _inner(self, rank: int) -> dict:
        saved = self.optim_states[rank]
        inner = saved["optimizer_state_dict"] if self.stage == 3 else saved["base_optimizer_state"]
        return inner

    def _is_elastic(self) -> bool:
        # Stage 1/2 with elastic_checkpoint: per group state lists without padding, no groups.
        return self.stage < 3 and isinstance(self._inner(0), list)

    def _moment_states(self, rank: int) -> list[dict]:
        """Rank ``rank``'s optimizer state per flat group, in flat-group order."""
        inner = self._inner(rank)
        if self._is_elastic():
            return list(inner)
        ids = [i for group in inner["param_groups"] for i in group["params"]]
        return [inner["state"].get(i, {}) for i in ids]

    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (hyperparameters); none in an elastic checkpoint."""
        return [] if self._is_elastic() else [
            {k: v for k, v in g.items() if k != "params"} for g in self._inner(0)["param_groups"]]

    def optimizer_step(self) -> float:
        """Adam's step count (bias correction), the same in every state and group."""
        steps = set()
        for state in self._moment_states(0):
            if "step" in state:
                steps.add(float(state["step"]))
        for group in self.param_groups():
            if "step" in group:  # DeepSpeed's FusedAdam keeps it in the group
                steps.add(float(group["step"]))
        saved = self.optim_states[0].get("base_optimizer_state_step")
        if saved is not None:
            steps.add(float(saved))
        if len(steps) != 1:
            raise DeepSpeedCheckpointError(
                f"{self.tag_dir}: cannot tell the optimizer's step count (found {sorted(steps)})")
        return steps.pop()

    def state_keys(self) -> set[str]:
        return {key for state in self._moment_states(0) for key, value in state.items()
                if isinstance(value, torch.Tensor) and value.dim() > 0}

    def loss_scaler(self) -> dict:
        """This engine's loss-scaler state from DeepSpeed's scaler object."""
        scaler = vars(self.optim_states[0].get("loss_scaler") or _SavedLossScaler())
        state = {"scale": float(scaler.get("cur_scale", 1.0))}
        if scaler.get("dynamic"):
            state.update(iteration=int(scaler.get("cur_iter", 0)),
                         last_overflow_iteration=int(scaler.get("last_overflow_iter", -1)),
                         hysteresis_left=int(scaler.get("cur_hysteresis", 1)))
        return state

    # ---- full tensors --------------------------------------------------------------------
    def full_tensors(self, field: str) -> dict[str, torch.Tensor]:
        """Every trainable parameter's full fp32 ``field`` ("master" or a moment) by name."""
        if self.stage == 3:
            return self._zero3_full(field)
        return self._zero12_full(field)

    def _rank_pieces(self, rank: int, field: str) -> list[torch.Tensor]:
        """Rank ``rank``'s flat fp32 vector of ``field`` per flat group."""
        saved = self.optim_states[rank]
        masters = (saved["fp32_flat_groups"] if self.stage == 3
                   else saved["single_partition_of_fp32_groups"])
        if field == "master":
            return [m.float() for m in masters]
        states = self._moment_states(rank)
        # The moments keep the partition's end padding (stage 1/2); the masters do not.
        return [state[field].float()[: master.numel()] for state, master in
                zip(states, masters, strict=True)]

    def _zero12_full(self, field: str) -> dict[str, torch.Tensor]:
        per_rank = [self._rank_pieces(rank, field) for rank in range(self.world_size)]
        paddings = self.optim_states[0].get("param_alignment_paddings")
        out = {}
        for index, shapes in enumerate(self.flat_groups):
            flat = torch.cat([pieces[index] for pieces in per_rank])
            pads = paddings[index] if paddings is not None else [0] * len(shapes)
            offset = 0
            for (name, shape), pad in zip(shapes.items(), pads, strict=True):
                numel = math.prod(shape)
                if offset + numel > flat.numel():
                    raise DeepSpeedCheckpointError(
                        f"{self.tag_dir}: param group {index} holds {flat.numel()} elements, "
                        f"fewer than its parameters need")
                out[name] = flat[offset : offset + numel].view(shape).clone()
                offset += numel + int(pad)
        return out

    def _zero3_full(self, field: str) -> dict[str, torch.Tensor]:
        world = self.world_size
        per_rank = [torch.cat(self._rank_pieces(rank, field)) for rank in range(world)]
        out, offset = {}, 0
        for shapes in self.flat_groups:
            for name, shape in shapes.items():
                numel = math.prod(shape)
                piece = math.ceil(numel / world)
                if offset + piece > per_rank[0].numel():
                    raise DeepSpeedCheckpointError(
                        f"{self.tag_dir}: rank 0 holds {per_rank[0].numel()} elements, fewer "
                        "than its parameters' partitions need")
                full = torch.cat([flat[offset : offset + piece] for flat in per_rank])
                out[name] = full[:numel].view(shape).clone()
                offset += piece
        return out

    def frozen_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters no optimizer owns (``requires_grad=False``), fp32, by name."""
        shapes = self.model_states.get("frozen_param_shapes") or {}
        if self.stage < 3:
            # Whole in the module's state_dict, also at stage 1 (which lists no frozen
            # shapes): the entries that are neither optimized, nor tied, nor buffers.
            module = self.model_states.get("module") or {}
            others = {name for group in self.flat_groups for name in group}
            others |= set(self.shared_params) | set(self.model_states.get("buffer_names") or [])
            return {name: value.float().clone() for name, value in module.items()
                    if name not in others}
        if not shapes:
            return {}
        fragments = [self._rank_model_states(rank)["frozen_param_fragments"]
                     for rank in range(self.world_size)]
        return {name: torch.cat([f[name].reshape(-1) for f in fragments]).float()
                [: math.prod(shape)].view(tuple(shape)).clone()
                for name, shape in shapes.items()}

    def _rank_model_states(self, rank: int) -> dict:
        if rank == 0:
            return self.model_states
        return _load(self.tag_dir / f"zero_pp_rank_{rank}_{MODEL_STATES}")


def _tag_dir(path: Path, tag: str | None) -> Path:
    if not path.is_dir():
        raise DeepSpeedCheckpointError(f"{path} is not a directory")
    if tag is not None:
        tag_dir = path / tag
    elif (path / "latest").is_file():
        tag_dir = path / (path / "latest").read_text().strip()
    elif any(path.glob(f"*{MODEL_STATES}")):  # the tag's own directory was given
        tag_dir = path
    else:
        raise DeepSpeedCheckpointError(
            f"{path} is not a DeepSpeed checkpoint: no 'latest' file and no *_model_states.pt")
    if not tag_dir.is_dir():
        raise DeepSpeedCheckpointError(f"{tag_dir}: no such checkpoint tag directory")
    return tag_dir


def open_checkpoint(path: str | Path, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Open ``path`` (a save directory, or one tag's directory) at ``tag`` or ``latest``."""
    tag_dir = _tag_dir(Path(path), tag)
    if any(tag_dir.glob("layer_*-model_states.pt")):
        raise DeepSpeedCheckpointError(f"{tag_dir}: a pipeline-parallel checkpoint (layer_*"
                                       " files) is not supported; only data parallelism is")
    other_mp = sorted({m.group(1) for f in tag_dir.iterdir()
                       if (m := re.search(r"mp_rank_(\d+)", f.name)) and m.group(1) != "00"})
    stage3_file = tag_dir / f"zero_pp_rank_0_{MODEL_STATES}"
    model_file = stage3_file if stage3_file.is_file() else tag_dir / MODEL_STATES
    if not model_file.is_file():
        raise DeepSpeedCheckpointError(
            f"{tag_dir} is not a DeepSpeed checkpoint: neither {MODEL_STATES} nor "
            f"{stage3_file.name} is there")
    model_states = _load(model_file)
    mp = int(model_states.get("mp_world_size", 1))
    if mp > 1 or other_mp:
        raise DeepSpeedCheckpointError(
            f"{tag_dir}: a model-parallel checkpoint (mp_world_size={max(mp, len(other_mp) + 1)})"
            " is not supported: this engine shards data-parallel only")
    if any(tag_dir.glob("bf16_zero_pp_rank_*")):
        raise DeepSpeedCheckpointError(
            f"{tag_dir}: DeepSpeed's bf16 optimizer checkpoint (bf16_zero_pp_rank_* files) "
            "cannot be read; only ZeRO stages 1-3 are")
    if model_states.get("optimizer") is not None or model_states.get("param_shapes") is None:
        raise DeepSpeedCheckpointError(
            f"{tag_dir}: a checkpoint without ZeRO (stage 0: the optimizer in the model "
            "states) cannot be read; only ZeRO stages 1-3 are")
    world = int(model_states.get("dp_world_size") or 0)
    if world < 1:
        raise DeepSpeedCheckpointError(f"{model_file} does not say its data-parallel world size")
    optim_states = []
    for rank in range(world):
        optim_file = tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        if not optim_file.is_file():
            raise DeepSpeedCheckpointError(
                f"{tag_dir}: rank file {optim_file.name} is missing (world size {world})")
        optim_states.append(_load(optim_file)["optimizer_state_dict"])
    stage = int(optim_states[0].get("zero_stage", -1))
    if stage not in (1, 2, 3):
        raise DeepSpeedCheckpointError(
            f"{tag_dir}: ZeRO stage {stage} cannot be read; only stages 1-3 are")
    if stage == 3:
        for rank in range(world):
            name = f"zero_pp_rank_{rank}_{MODEL_STATES}"
            if not (tag_dir / name).is_file():
                raise DeepSpeedCheckpointError(
                    f"{tag_dir}: rank file {name} is missing (world size {world})")
    counts = optim_states[0].get("partition_count", world)  # a list per group at stage 1/2
    if any(int(count) != world for count in (counts if isinstance(counts, list) else [counts])):
        raise DeepSpeedCheckpointError(
            f"{tag_dir}: optimizer partitioned {counts} ways in a world of {world} "
            "(MiCS or hpZ partition groups) is not supported")
    return DeepSpeedCheckpoint(tag_dir, stage, world, model_states, optim_states)
