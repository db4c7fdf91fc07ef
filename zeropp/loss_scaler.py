"""fp16 loss scaling with DeepSpeed's semantics and defaults.

Dynamic: start at 2**initial_scale_power; on an overflow skip the step and, once
``hysteresis`` overflows have been absorbed, halve the scale (never below ``min_scale``);
after ``window`` clean steps since the last overflow, double it. Static: a fixed scale.
bf16 and fp32 use a scale of 1 and never skip.
"""

from __future__ import annotations


class LossScaler:
    """A fixed scale (1.0 for fp32/bf16)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

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
        super().__init__(2.0**initial_scale_power)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.factor = factor
        self.iteration = 0
        self.last_overflow_iteration = -1
        self.hysteresis_left = hysteresis

    def update(self, overflow: bool) -> None:
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

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.hysteresis_left = int(state["hysteresis_left"])
