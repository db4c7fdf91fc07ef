"""DeepSpeed's warmup schedules, for a ``scheduler`` block in the JSON config.

Same semantics as ``deepspeed.runtime.lr_schedules``: ``step()`` is called once per optimizer
step (by the engine, skipped steps excluded) and writes ``group["lr"]``.

- WarmupLR: warm up from ``warmup_min_lr`` to ``warmup_max_lr`` (log or linear), then hold.
- WarmupDecayLR: WarmupLR, then linear decay back to ``warmup_min_lr`` at ``total_num_steps``.
- WarmupCosineLR: ratios of the optimizer's lr: warm up from ``warmup_min_ratio`` to 1, then
  cosine decay to ``cos_min_ratio`` at ``total_num_steps``.
"""

from __future__ import annotations

import math


class WarmupSchedule:
    def __init__(self, optimizer, kind: str, params: dict) -> None:
        self.optimizer = optimizer
        self.kind = kind
        self.params = dict(params)
        self.base_lr = optimizer.param_groups[0]["lr"]
        self.last_step = 0
        self._apply()

    def _warmup_gamma(self, step: int) -> float:
        warmup = self.params["warmup_num_steps"]
        if step >= warmup:
            return 1.0
        if self.params["warmup_type"] == "log":
            return math.log(step + 1) / math.log(warmup) if warmup > 1 else 1.0
        return step / warmup

    def get_lr(self, step: int | None = None) -> float:
        step = self.last_step if step is None else step
        p, gamma = self.params, self._warmup_gamma(step)
        if self.kind == "WarmupCosineLR":
            total, warmup = p["total_num_steps"], p["warmup_num_steps"]
            if step < warmup:
                ratio = p["warmup_min_ratio"] + (1 - p["warmup_min_ratio"]) * gamma
            else:
                progress = min(1.0, (step - warmup) / max(1, total - warmup))
                cosine = 0.5 * (1 + math.cos(math.pi * progress))
                ratio = p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * cosine
            return self.base_lr * ratio
        max_lr = p.get("warmup_max_lr") or self.base_lr
        lr = p["warmup_min_lr"] + (max_lr - p["warmup_min_lr"]) * gamma
        if self.kind == "WarmupDecayLR" and step >= p["warmup_num_steps"]:
            total, warmup = p["total_num_steps"], p["warmup_num_steps"]
            decay = max(0.0, (total - step) / max(1.0, total - warmup))
            lr = p["warmup_min_lr"] + (max_lr - p["warmup_min_lr"]) * decay
        return lr

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "kind": self.kind, "base_lr": self.base_lr}

    def load_state_dict(self, state: dict) -> None:
        self.last_step, self.base_lr = int(state["last_step"]), float(state["base_lr"])
        self._apply()
