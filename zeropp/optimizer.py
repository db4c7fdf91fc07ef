"""Any element-wise torch optimizer over this rank's fp32 shards, with global-norm clipping
and loss scaling.

[Note: gradient averaging]
Gradients are reduce-scattered as SUMs and accumulated in fp32 across micro-batches; they are
divided exactly once, here, by (data-parallel size x accumulation steps x loss scale). The
global norm is computed from the shards with one all-reduce of a single number; a non-finite
norm means some rank overflowed, so every rank skips the same step.

[Note: partitioned parameter groups]
A shard is a run of a unit's flat buffer: it can hold the end of a weight matrix and the start
of a bias, and the two can belong to different parameter groups (Megatron's no-decay group for
biases and norms, a user's per-group learning rates). So the fp32 master of a shard is kept as
one *piece* per (unit, group): that group's elements of the shard, packed end to end (the
shard itself, no copy, when one group holds all of it). Group g of the torch optimizer holds
group g's pieces of every unit with group g's hyperparameters, so torch applies each group's
lr and weight decay itself. The classes allowed are element-wise (an element's update reads
only its own gradient and state), so stepping the pieces is stepping the whole model.

[Note: frozen parameters]
Parameters with ``requires_grad=False``, or given to no group, are in no piece: neither
updated nor given optimizer state. Their weights live in the working shard alone.
``shard_master`` and ``shard_state`` give shard-shaped tensors back for checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeropp.comm import all_reduce_sum
from zeropp.unit import ShardedUnit

# Torch optimizers whose update of an element reads only that element's gradient and state:
# stepping each rank's shard is then exactly stepping the whole model.
ELEMENTWISE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    cls.__name__: cls for cls in (
        torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad,
        torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
        torch.optim.Adadelta)
}


@dataclass
class OptimizerRecipe:
    """What to run over the shards: a torch optimizer class, its keyword arguments, and the
    model's parameters in groups, each with its own overrides (lr, weight_decay, ...).

    ``groups`` holds dicts shaped like torch's: ``{"params": [nn.Parameter, ...], **overrides}``.
    A parameter in no group is not optimized (torch's meaning).
    """

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    groups: list[dict[str, Any]]

    def __post_init__(self) -> None:
        if self.cls not in ELEMENTWISE_OPTIMIZERS.values():
            raise ValueError(
                f"optimizer {self.cls.__name__} cannot be partitioned: only element-wise torch "
                f"optimizers are ({', '.join(ELEMENTWISE_OPTIMIZERS)})")

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer) -> OptimizerRecipe:
        """The recipe of a torch optimizer built over the model's parameters: its class,
        defaults, and every group with that group's hyperparameters."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer or a callable returning "
                            f"one, got {type(optimizer).__name__}")
        groups = [dict(group) for group in optimizer.param_groups]
        return cls(type(optimizer), dict(optimizer.defaults), groups)

    @staticmethod
    def groups_of(model_parameters) -> list[dict[str, Any]]:
        """``model_parameters`` as torch takes them (tensors, or dicts with "params") -> groups."""
        items = list(model_parameters)
        if not items:
            raise ValueError("model_parameters is empty: no parameter to optimize")
        if all(isinstance(item, Mapping) for item in items):
            groups = []
            for item in items:
                group = dict(item)
                params = group["params"]
                group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
                groups.append(group)
            return groups
        if any(isinstance(item, Mapping) for item in items):
            raise ValueError("model_parameters mixes parameters and parameter-group dicts")
        return [{"params": items}]

    def group_by_name(self, model: nn.Module) -> dict[str, int]:
        """Parameter name -> group index, read before sharding (which may give the module new
        parameter objects): every name of a tied parameter maps to its group."""
        index: dict[int, int] = {}
        for number, group in enumerate(self.groups):
            for param in group["params"]:
                if id(param) in index:
                    raise ValueError("a parameter appears in more than one parameter group")
                index[id(param)] = number
        by_name = {name: index[id(param)]
                   for name, param in model.named_parameters(remove_duplicate=False)
                   if id(param) in index}
        found = {id(param) for _, param in model.named_parameters(remove_duplicate=False)}
        if index.keys() - found:
            raise ValueError("a parameter group holds a tensor that is not a parameter of the model")
        return by_name


def megatron_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Megatron's two groups: matrices decayed, biases and norm parameters not."""
    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


@dataclass
class _Piece:
    """The elements of one parameter group inside one unit's shard, packed end to end."""

    group: int
    runs: list[tuple[int, int]]  # shard offsets
    master: nn.Parameter  # fp32


class PartitionedOptimizer(torch.optim.Optimizer):
    """A torch optimizer over this rank's fp32 shards ([Note: partitioned parameter groups]).

    It is a ``torch.optim.Optimizer``: ``param_groups`` and ``state`` are those of the torch
    optimizer stepping the shards, so torch, Hugging Face and DeepSpeed schedules attach to it
    and write each group's lr. Only the engine steps it (``engine.step()`` averages, clips and
    unscales the gradients first).
    """

    def __init__(self, units: list[ShardedUnit], initial_masters: list[torch.Tensor],
                 recipe: OptimizerRecipe, group_by_name: dict[str, int]) -> None:
        self.units = units
        self.world = units[0].comm.world if units else None
        self.recipe = recipe
        self.pieces: list[list[_Piece]] = []
        for unit, initial in zip(units, initial_masters, strict=True):
            slot_group = {slot.name: group_by_name.get(slot.name) if param.requires_grad else None
                          for slot, param in zip(unit.layout.slots, unit.params, strict=True)}
            rank = unit.comm.world.rank
            group_runs = [_merged(unit.layout.shard_runs(
                rank, lambda slot, n=number, of=slot_group: of[slot.name] == n))
                for number in range(len(recipe.groups))]
            # The shard's padding rides with the first group holding elements here, so a shard
            # that one group holds entirely is that group's master whole (no packing copies)
            # and master sizes are the shard sizes the memory plan counts. Its gradient is zero.
            padding = _complement(
                _merged(unit.layout.shard_runs(rank, lambda slot: True)), unit.layout.shard_numel)
            first = next((n for n, runs in enumerate(group_runs) if runs), 0)
            group_runs[first] = _merged(sorted(group_runs[first] + padding))
            pieces = []
            for number, runs in enumerate(group_runs):
                whole = runs == [(0, unit.layout.shard_numel)]
                runs = None if whole else runs
                pieces.append(_Piece(number, runs, nn.Parameter(_pack(initial.float(), runs))))
            self.pieces.append(pieces)
        torch_groups = []
        for number, group in enumerate(recipe.groups):
            settings = {key: value for key, value in group.items() if key != "params"}
            params = [p.master for pieces in self.pieces for p in pieces if p.group == number]
            torch_groups.append({**recipe.defaults, **settings, "params": params})
        self.inner = recipe.cls(torch_groups)
        super().__init__(torch_groups, self.inner.defaults)
        # One set of groups and state, the inner optimizer's: what a schedule writes is what
        # the update reads.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults

    @property
    def masters(self) -> list[nn.Parameter]:
        return [piece.master for pieces in self.pieces for piece in pieces]

    def grad_norm_squared(self, inv_scale: float) -> float:
        """Squared global gradient norm (true units), over all ranks: one all-reduce."""
        total = torch.zeros(1, dtype=torch.float32, device=self.units[0].grad_shard.device)
        for unit in self.units:
            total += unit.grad_shard.float().pow(2).sum()  # 16-bit squares would overflow
        if self.world is not None:
            all_reduce_sum(total, self.world, self.units[0].comm.stats, "optimizer")
        return float(total.item()) * inv_scale * inv_scale

    def step(self, closure=None, *, grad_multiplier: float | None = None):
        """Update with gradients ``grad_shard * grad_multiplier``; cast back to the shards."""
        if closure is not None or grad_multiplier is None:
            raise RuntimeError("call engine.step(), not optimizer.step(): the engine averages, "
                               "clips and unscales the sharded gradients before this update")
        # One unit at a time: the packed gradients of one shard exist at once, not of all
        # (torch skips parameters without a gradient, and their step counts stay put).
        for unit, pieces in zip(self.units, self.pieces, strict=True):
            for piece in pieces:
                piece.master.grad = _pack(unit.grad_shard, piece.runs).to(
                    torch.float32).mul_(grad_multiplier)
            self.inner.step()
            for piece in pieces:
                piece.master.grad = None
                _unpack_into(unit.shard, piece.master.detach(), piece.runs)
            unit.zero_grad_shard()
        return None

    def skip_step(self) -> None:
        for unit in self.units:
            unit.zero_grad_shard()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the units' shards (``engine.zero_grad()`` drops them)."""

    # ---- shard-shaped state (checkpoints) ------------------------------------------------
    def shard_master(self, index: int) -> torch.Tensor:
        """The fp32 weights of unit ``index``'s shard; unoptimized ones from the working shard."""
        full = self.units[index].shard.float().clone()
        for piece in self.pieces[index]:
            _unpack_into(full, piece.master.detach(), piece.runs)
        return full

    def state_keys(self) -> list[str]:
        """Names of the element-wise optimizer state (e.g. exp_avg, exp_avg_sq)."""
        keys: list[str] = []
        for pieces in self.pieces:
            for piece in pieces:
                for key, value in self.state.get(piece.master, {}).items():
                    if _elementwise(value, piece.master) and key not in keys:
                        keys.append(key)
        return keys

    def shard_state(self, index: int) -> dict[str, torch.Tensor]:
        """Element-wise state in shard layout; zeros where an element has none."""
        out = {}
        for key in self.state_keys():
            full = torch.zeros_like(self.units[index].grad_shard, dtype=torch.float32)
            for piece in self.pieces[index]:
                value = self.state.get(piece.master, {}).get(key)
                if value is not None:
                    _unpack_into(full, value, piece.runs)
            out[key] = full
        return out

    def scalar_state(self) -> dict[str, float]:
        """Per-tensor scalars (Adam's step, ...): the same for every piece that has state."""
        for pieces in self.pieces:
            for piece in pieces:
                state = self.state.get(piece.master, {})
                scalars = {key: float(value) for key, value in state.items()
                           if isinstance(value, torch.Tensor) and value.dim() == 0}
                if state:
                    return scalars
        return {}

    def load_shard(self, index: int, master: torch.Tensor, state: dict | None = None,
                   scalars: dict | None = None) -> None:
        """Set unit ``index``'s fp32 weights (and optimizer state) from shard-shaped tensors."""
        with torch.no_grad():
            self.units[index].shard.copy_(master)
            for piece in self.pieces[index]:
                piece.master.copy_(_pack(master.float(), piece.runs))
        if state is None:
            return
        for piece in self.pieces[index]:
            restored = {key: _pack(value, piece.runs).clone() for key, value in state.items()}
            for key, value in (scalars or {}).items():
                restored[key] = torch.tensor(value, dtype=torch.float32)
            self.state[piece.master] = restored

    def moment_tensors(self) -> list[torch.Tensor]:
        """Every element-wise state tensor this rank holds."""
        return [value for master in self.masters for value in self.state.get(master, {}).values()
                if _elementwise(value, master)]

    @property
    def step_count(self) -> float:
        return self.scalar_state().get("step", 0.0)


def _elementwise(value, master: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == master.shape


def _complement(runs: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The offsets of [0, numel) outside ``runs`` (sorted, disjoint)."""
    out, cursor = [], 0
    for start, end in runs:
        if start > cursor:
            out.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < numel:
        out.append((cursor, numel))
    return out


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in runs:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _pack(shard: torch.Tensor, runs: list[tuple[int, int]] | None) -> torch.Tensor:
    """The trainable runs of a shard-shaped tensor, end to end (the tensor itself if all)."""
    if runs is None:
        return shard
    if not runs:
        return shard.new_zeros(0)
    return torch.cat([shard[start:end] for start, end in runs])


def _unpack_into(shard: torch.Tensor, packed: torch.Tensor,
                 runs: list[tuple[int, int]] | None) -> None:
    if runs is None:
        shard.copy_(packed)
        return
    position = 0
    for start, end in runs:
        shard[start:end].copy_(packed[position : position + end - start])
        position += end - start


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient, so clipping matches it exactly."""
    if max_norm <= 0 or not math.isfinite(grad_norm):
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))
