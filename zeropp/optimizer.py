"""AdamW over this rank's fp32 shards, with global-norm clipping and loss scaling.

[Note: gradient averaging]
Gradients are reduce-scattered as SUMs and accumulated in fp32 across micro-batches; they are
divided exactly once, here, by (data-parallel size x accumulation steps x loss scale). The
global norm is computed from the shards with one all-reduce of a single number; a non-finite
norm means some rank overflowed, so every rank skips the same step.

The update itself is ``torch.optim.AdamW`` on flat fp32 tensors (element-wise, so sharding
cannot change it); decoupled weight decay is applied first with a per-element mask, because a
shard can hold the end of a weight matrix (decayed) and the start of a bias (not decayed).
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
        self.masters = [nn.Parameter(m.float()) for m in initial_masters]
        # Decayed elements of each shard as (start, end) runs: a few per unit, no per-element mask.
        self.decay_runs = [u.layout.shard_runs(u.comm.world.rank, decay_rule) for u in units]
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
        total = torch.zeros(1, dtype=torch.float32, device=self.masters[0].device)
        for unit in self.units:
            total += unit.grad_shard.pow(2).sum()
        if self.world is not None:
            all_reduce_sum(total, self.world, self.units[0].comm.stats, "optimizer")
        return float(total.item()) * inv_scale * inv_scale

    def step(self, grad_multiplier: float) -> None:
        """Apply AdamW with gradients ``grad_shard * grad_multiplier``; cast back to shards."""
        group = self._adam.param_groups[0]
        lr, wd = group["lr"], group["masked_weight_decay"]
        for unit, master, runs in zip(self.units, self.masters, self.decay_runs, strict=True):
            master.grad = unit.grad_shard.mul_(grad_multiplier)
            if wd:
                for start, end in runs:
                    master.data[start:end].mul_(1.0 - lr * wd)
        self._adam.step()
        for unit, master in zip(self.units, self.masters, strict=True):
            master.grad = None
            unit.shard.copy_(master.detach())
            unit.zero_grad_shard()

    def skip_step(self) -> None:
        for unit in self.units:
            unit.zero_grad_shard()

    # ---- state ---------------------------------------------------------------------------
    def moments(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) of unit ``index``'s shard; zeros before the first step."""
        state = self._adam.state.get(self.masters[index], {})
        zeros = torch.zeros_like(self.masters[index])
        return state.get("exp_avg", zeros), state.get("exp_avg_sq", zeros)

    @property
    def step_count(self) -> float:
        """Adam's step counter (the same for every shard)."""
        state = self._adam.state.get(self.masters[0], {}) if self.masters else {}
        return float(state["step"]) if "step" in state else 0.0

    def set_moments(self, index: int, step: float, exp_avg, exp_avg_sq) -> None:
        self._adam.state[self.masters[index]] = {
            "step": torch.tensor(step), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
        }

    def state_dict(self) -> dict:
        return self._adam.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._adam.load_state_dict(state)


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient, so clipping matches it exactly."""
    if max_norm <= 0 or not math.isfinite(grad_norm):
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))
