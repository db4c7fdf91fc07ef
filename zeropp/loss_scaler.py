"""fp16 loss scaling with DeepSpeed's semantics and defaults.

Dynamic: start at 2**initial_scale_power; on an overflow skip the step and, once
``hysteresis`` overflows have been absorbed, halve the scale (never below ``min_scale``);
after ``window`` clean steps since the last overflow, double it. Static: a fixed scale.
bf16 and fp32 use a scale of 1 and never skip.

The dynamic scaler can keep its state on the device (``scale_on``), for a step whose overflow
verdict never leaves the device ([Note: step outcome on the device] in zeropp/engine.py): the
same rules, as element-wise selects on 0-dim tensors, read back only when someone asks for
``scale`` (a log line, a checkpoint).
"""

from __future__ import annotations

import torch


class LossScaler:
    """A fixed scale (1.0 for fp32/bf16)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    @property
    def held_scale(self) -> float | torch.Tensor:
        """The scale as held, with no read: the float here (a device tensor where
        ``DynamicLossScaler.scale_on`` moved the state)."""
        return self.scale

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step, after the overflow check agreed across ranks."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    dynamic = True

    def __init__(
        self,
        initial_scale_power: int = 16,
        window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
        factor: float = 2.0,
    ) -> None:
        self._scale_on_device: torch.Tensor | None = None  # set by scale_on
        super().__init__(2.0**initial_scale_power)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.factor = factor
        self.iteration = 0  # steps seen, skipped or not: known to the host either way
        self.last_overflow_iteration: int | torch.Tensor = -1
        self.hysteresis_left: int | torch.Tensor = hysteresis

    # The host's view of the scale; where the state lives on the device, reading it is a sync.
    @property
    def scale(self) -> float:
        if self._scale_on_device is not None:
            return float(self._scale_on_device)
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = float(value)
        if self._scale_on_device is not None:
            self._scale_on_device.fill_(self._scale)

    @property
    def held_scale(self) -> float | torch.Tensor:
        return self._scale if self._scale_on_device is None else self._scale_on_device

    def scale_on(self, device: torch.device) -> torch.Tensor:
        """The scale as a 0-dim fp32 tensor on ``device``; from the first call on, the state
        lives there and ``update`` takes the overflow flag as a device tensor. Scales are
        powers of ``factor`` well inside fp32's range, so fp32 holds them exactly."""
        if self._scale_on_device is None:
            def held(value, dtype):
                return torch.tensor(value, dtype=dtype, device=device)

            self._scale_on_device = held(self._scale, torch.float32)
            self.last_overflow_iteration = held(self.last_overflow_iteration, torch.int64)
            self.hysteresis_left = held(self.hysteresis_left, torch.int64)
        return self._scale_on_device

    def update(self, overflow: bool | torch.Tensor) -> None:
        if self._scale_on_device is not None:
            self._update_on_device(torch.as_tensor(overflow, device=self._scale_on_device.device))
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def _update_on_device(self, overflow: torch.Tensor) -> None:
        """``update``'s rules with the verdict a device flag: both outcomes computed, one
        selected, nothing read back."""
        scale, left = self._scale_on_device, self.hysteresis_left
        since_overflow = self.iteration - self.last_overflow_iteration
        # An overflow halves the scale once the hysteresis is used up, else uses one up.
        halve = overflow if self.hysteresis == 1 else overflow & (left == 1)
        halved = torch.clamp(scale / self.factor, min=self.min_scale)
        # A clean step doubles it every `window` steps after the last overflow, where the
        # hysteresis is also restored (after every clean step with consecutive_hysteresis).
        grow = ~overflow & (since_overflow % self.window == 0)
        restore = ~overflow if self.consecutive_hysteresis else grow
        new_left = torch.where(restore, self.hysteresis,
                               torch.where(overflow & ~halve, left - 1, left))
        new_scale = torch.where(halve, halved, torch.where(grow, scale * self.factor, scale))
        self._scale_on_device.copy_(new_scale)
        self.hysteresis_left = new_left
        self.last_overflow_iteration = torch.where(overflow, self.iteration,
                                                   self.last_overflow_iteration)
        self.iteration += 1

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "iteration": self.iteration,
            "last_overflow_iteration": int(self.last_overflow_iteration),
            "hysteresis_left": int(self.hysteresis_left),
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        on_device = self._scale_on_device is not None
        for name in ("last_overflow_iteration", "hysteresis_left"):
            value = int(state[name])
            setattr(self, name, torch.tensor(value, device=self._scale_on_device.device)
                    if on_device else value)
