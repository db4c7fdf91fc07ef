"""AdamW over this rank's fp32 shards, with global-norm clipping and loss scaling.

[Note: gradient averaging]
Gradients are reduce-scattered as SUMs and accumulated in fp32 across micro-batches; they are
divided exactly once, here, by (data-parallel size x accumulation steps x loss scale). The
global norm is computed from the shards with one all-reduce of a single number; a non-finite
norm means some rank overflowed, so every rank skips the same step.

The update itself is ``torch.optim.AdamW`` on flat fp32 tensors (element-wise, so sharding
cannot change it); decoupled weight decay is applied first with a per-element mask, because a
shard can hold the end of a weight matrix (decayed) and the start of a bias (not decayed).

[Note: frozen parameters]
Parameters with ``requires_grad=False`` are neither updated nor given optimizer state: the
fp32 master of a unit holds only the trainable runs of its shard, packed end to end (the
whole shard, the same tensor layout, when nothing in it is frozen), and Adam's moments follow
the master. Frozen weights live in the working shard alone. ``shard_master`` and
``shard_moments`` give shard-shaped views back for checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from zeropp.comm import all_reduce_sum
from zeropp.flat_layout import ParamSlot
from zeropp.unit import ShardedUnit


def default_decay_rule(slot: ParamSlot) -> bool:
    """Megatron's rule: weight decay on matrices, none on biases and LayerNorm parameters."""
    return len(slot.shape) >= 2


class PartitionedAdamW:
    def __init__(
        self,
        units: list[ShardedUnit],
        initial_masters: list[torch.Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decay_rule: Callable[[ParamSlot], bool] = default_decay_rule,
    ) -> None:
        self.units = units
        world = units[0].comm.world if units else None
        self.world = world
        # Trainable runs of each shard, in shard offsets ([Note: frozen parameters]).
        self.trainable_runs = [_trainable_runs(u) for u in units]
        self.masters = [
            nn.Parameter(_pack(m.float(), runs))
            for m, runs in zip(initial_masters, self.trainable_runs, strict=True)
        ]
        # Decayed elements of each master as (start, end) runs: a few per unit, no mask.
        self.decay_runs = [
            _packed_runs(u.layout.shard_runs(u.comm.world.rank, decay_rule), runs)
            for u, runs in zip(units, self.trainable_runs, strict=True)
        ]
        self._adam = torch.optim.AdamW(
            self.masters, lr=lr, betas=betas, eps=eps, weight_decay=0.0, foreach=False
        )
        # The lr schedule writes group["lr"]; decay lives beside it under its own key so
        # torch's AdamW never applies it unmasked.
        for group in self._adam.param_groups:
            group["masked_weight_decay"] = weight_decay

    @property
    def param_groups(self) -> list[dict]:
        return self._adam.param_groups

    def grad_norm_squared(self, inv_scale: float) -> float:
        """Squared global gradient norm (true units), over all ranks: one all-reduce."""
        total = torch.zeros(1, dtype=torch.float32, device=self.units[0].grad_shard.device)
        for unit in self.units:
            total += unit.grad_shard.pow(2).sum()
        if self.world is not None:
            all_reduce_sum(total, self.world, self.units[0].comm.stats, "optimizer")
        return float(total.item()) * inv_scale * inv_scale

    def step(self, grad_multiplier: float) -> None:
        """Apply AdamW with gradients ``grad_shard * grad_multiplier``; cast back to shards."""
        group = self._adam.param_groups[0]
        lr, wd = group["lr"], group["masked_weight_decay"]
        for unit, master, runs, decay in zip(self.units, self.masters, self.trainable_runs,
                                             self.decay_runs, strict=True):
            if master.numel() == 0:  # nothing trainable in this shard: no state, no update
                continue
            master.grad = _pack(unit.grad_shard, runs).mul_(grad_multiplier)
            if wd:
                for start, end in decay:
                    master.data[start:end].mul_(1.0 - lr * wd)
        self._adam.step()
        for unit, master, runs in zip(self.units, self.masters, self.trainable_runs, strict=True):
            if master.grad is not None:
                master.grad = None
                _unpack_into(unit.shard, master.detach(), runs)
            unit.zero_grad_shard()

    def skip_step(self) -> None:
        for unit in self.units:
            unit.zero_grad_shard()

    # ---- shard-shaped state (checkpoints) ------------------------------------------------
    def shard_master(self, index: int) -> torch.Tensor:
        """The fp32 weights of unit ``index``'s shard; frozen ones read from the working shard."""
        master, runs = self.masters[index].detach(), self.trainable_runs[index]
        if runs is None:
            return master
        full = self.units[index].shard.float()
        _unpack_into(full, master, runs)
        return full

    def shard_moments(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) in shard layout; zeros before the first step and where frozen."""
        state = self._adam.state.get(self.masters[index], {})
        out = []
        for key in ("exp_avg", "exp_avg_sq"):
            value, runs = state.get(key), self.trainable_runs[index]
            if runs is None and value is not None:
                out.append(value)
                continue
            full = torch.zeros_like(self.units[index].grad_shard)
            if value is not None:
                _unpack_into(full, value, runs)
            out.append(full)
        return out[0], out[1]

    def load_shard(self, index: int, master: torch.Tensor, moments=None, step: float = 0.0) -> None:
        """Set unit ``index``'s fp32 weights (and moments) from shard-shaped tensors."""
        runs = self.trainable_runs[index]
        with torch.no_grad():
            self.masters[index].copy_(_pack(master, runs))
            self.units[index].shard.copy_(master)
        if moments is None or self.masters[index].numel() == 0:
            return
        exp_avg, exp_avg_sq = moments
        self._adam.state[self.masters[index]] = {
            "step": torch.tensor(step),
            "exp_avg": _pack(exp_avg, runs).clone(),
            "exp_avg_sq": _pack(exp_avg_sq, runs).clone(),
        }

    def moment_tensors(self) -> list[torch.Tensor]:
        """Every Adam moment this rank holds (none for frozen or untouched shards)."""
        return [value for state in self._adam.state.values()
                for key, value in state.items() if key in ("exp_avg", "exp_avg_sq")]

    @property
    def step_count(self) -> float:
        """Adam's step counter (the same for every shard that has state)."""
        for master in self.masters:
            state = self._adam.state.get(master, {})
            if "step" in state:
                return float(state["step"])
        return 0.0

    def state_dict(self) -> dict:
        return self._adam.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._adam.load_state_dict(state)


def _trainable_runs(unit: ShardedUnit) -> list[tuple[int, int]] | None:
    """Shard offsets of the trainable elements (padding included); None when all are."""
    frozen_names = {slot.name for slot, param in zip(unit.layout.slots, unit.params, strict=True)
                    if not param.requires_grad}
    frozen = unit.layout.shard_runs(unit.comm.world.rank, lambda slot: slot.name in frozen_names)
    if not frozen:
        return None
    runs, cursor = [], 0
    for start, end in sorted(frozen):
        if start > cursor:
            runs.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < unit.layout.shard_numel:
        runs.append((cursor, unit.layout.shard_numel))
    return runs


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


def _packed_runs(shard_runs: list[tuple[int, int]],
                 runs: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """Shard-offset runs (each inside one trainable run, or frozen) -> packed offsets."""
    if runs is None:
        return shard_runs
    packed, base = [], []
    position = 0
    for start, end in runs:
        base.append((start, end, position))
        position += end - start
    for lo, hi in shard_runs:
        for start, end, offset in base:
            if start <= lo and hi <= end:
                packed.append((offset + lo - start, offset + hi - start))
                break
    return packed


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient, so clipping matches it exactly."""
    if max_norm <= 0 or not math.isfinite(grad_norm):
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))
