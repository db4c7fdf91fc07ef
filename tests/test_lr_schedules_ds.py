"""DeepSpeed-style scheduler blocks drive the engine's lr like DeepSpeed's own schedules."""

from __future__ import annotations

import math

import pytest
import torch

from zeropp.deepspeed_api.lr_schedules import WarmupSchedule


def make(kind, **params):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    defaults = {"warmup_num_steps": 10, "warmup_type": "linear"}
    return opt, WarmupSchedule(opt, kind, {**defaults, **params})


def test_warmup_lr_linear_then_hold():
    opt, sched = make("WarmupLR", warmup_min_lr=0.0, warmup_max_lr=0.02)
    seen = []
    for _ in range(15):
        seen.append(opt.param_groups[0]["lr"])
        sched.step()
    # DeepSpeed's iterations start at -1: updates 0 and 1 both run at the floor.
    assert seen[0] == seen[1] == 0.0
    assert seen[6] == pytest.approx(0.01) and seen[12] == pytest.approx(0.02)


def test_warmup_decay_and_cosine_end_points():
    _, decay = make("WarmupDecayLR", total_num_steps=30, warmup_min_lr=0.0, warmup_max_lr=0.02)
    assert decay.get_lr(10) == pytest.approx(0.02)
    assert decay.get_lr(20) == pytest.approx(0.01)
    assert decay.get_lr(30) == pytest.approx(0.0)
    _, cosine = make("WarmupCosineLR", total_num_steps=30, warmup_min_ratio=0.0, cos_min_ratio=0.1)
    assert cosine.get_lr(10) == pytest.approx(0.01)
    assert cosine.get_lr(20) == pytest.approx(0.01 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))))
    assert cosine.get_lr(30) == pytest.approx(0.001)


def test_log_warmup_matches_deepspeed_formula():
    _, sched = make("WarmupLR", warmup_min_lr=0.0, warmup_max_lr=0.02, warmup_type="log")
    assert sched.get_lr(4) == pytest.approx(0.02 * math.log(5) / math.log(10))
