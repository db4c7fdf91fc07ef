"""Learning-rate schedule with Megatron's AnnealingLR semantics.

    lr(i) = max_lr * i / warmup_iters                          for i <= warmup_iters
          = min_lr + (max_lr - min_lr) * coeff(r)               for warmup_iters < i <= decay_iters
          = min_lr                                              for i > decay_iters
    r = (i - warmup_iters) / (decay_iters - warmup_iters)
    coeff(r) = 1 - r (linear)   or   (1 + cos(pi * r)) / 2 (cosine)

The "constant" style holds max_lr after warmup and never decays. ``i`` counts completed
iterations: as in Megatron, the loop calls ``step(0)`` before training and ``step(i)`` after
iteration ``i``, so the optimizer step of iteration ``i + 1`` uses ``lr(i)`` (the first warmup
step runs at lr 0).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

DECAY_STYLES = ("constant", "linear", "cosine")
_SCHEDULE_FIELDS = ("max_lr", "min_lr", "warmup_iters", "decay_iters", "decay_style")


class HasParamGroups(Protocol):
    """Anything shaped like a torch optimizer: a list of dicts with an "lr" entry."""

    param_groups: list[dict[str, Any]]


class LRScheduler:
    """Warmup then linear/cosine/constant annealing, applied to an optimizer's param groups.

    ``optimizer`` may be None when only ``get_lr`` is wanted (for example to print the plan).
    """

    def __init__(
        self,
        optimizer: HasParamGroups | None,
        max_lr: float,
        min_lr: float,
        warmup_iters: int,
        decay_iters: int,
        decay_style: str,
    ) -> None:
        _check_schedule(max_lr, min_lr, warmup_iters, decay_iters, decay_style)
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.warmup_iters = int(warmup_iters)
        self.decay_iters = int(decay_iters)
        self.decay_style = decay_style
        self.num_iters = 0

    def get_lr(self, iteration: int) -> float:
        """The learning rate after ``iteration`` completed iterations; no side effects."""
        if iteration < 0:
            raise ValueError(f"iteration must not be negative, got {iteration}")
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.max_lr * iteration / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if iteration > self.decay_iters:
            return self.min_lr
        decay_ratio = (iteration - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coefficient = 1.0 - decay_ratio
        else:
            coefficient = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)

    def step(self, iteration: int) -> float:
        """Set every param group's lr to ``get_lr(iteration)``; returns that lr."""
        lr = self.get_lr(iteration)
        self.num_iters = iteration
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        state = {field: getattr(self, field) for field in _SCHEDULE_FIELDS}
        state["num_iters"] = self.num_iters
        return state

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Resume at the saved iteration and apply its lr to the optimizer.

        With ``strict`` the saved schedule must equal this one (a silently different schedule
        after a resume is a classic loss-curve surprise); without it the current schedule
        wins, which is how a run's schedule is deliberately changed on resume.
        """
        missing = [key for key in (*_SCHEDULE_FIELDS, "num_iters") if key not in state]
        if missing:
            raise ValueError(f"lr scheduler state lacks {', '.join(missing)}")
        if strict:
            for field in _SCHEDULE_FIELDS:
                if state[field] != getattr(self, field):
                    raise ValueError(
                        f"lr scheduler {field} is {getattr(self, field)!r} but the checkpoint "
                        f"has {state[field]!r}; pass matching flags or load with strict=False"
                    )
        self.step(int(state["num_iters"]))


def _check_schedule(max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                    decay_style: str) -> None:
    if decay_style not in DECAY_STYLES:
        raise ValueError(f"decay_style must be one of {', '.join(DECAY_STYLES)}, "
                         f"got {decay_style!r}")
    if not 0.0 <= min_lr <= max_lr:
        raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr {min_lr} and max_lr {max_lr}")
    if warmup_iters < 0:
        raise ValueError(f"warmup_iters must not be negative, got {warmup_iters}")
    if decay_style != "constant" and decay_iters <= 0:
        raise ValueError(f"decay_iters must be positive for {decay_style} decay, got {decay_iters}")
    if decay_style != "constant" and warmup_iters > decay_iters:
        raise ValueError(f"warmup_iters {warmup_iters} must not exceed decay_iters {decay_iters} "
                         f"for {decay_style} decay")
