"""AnnealingLR against hand-computed values and torch's own cosine annealing."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from zeropp.deepspeed_api.lr_schedules import AnnealingLR

MAX_LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-4, 10, 110


def schedule(style: str, warmup: int = WARMUP, decay: int = DECAY,
             optimizer: object | None = None) -> AnnealingLR:
    return AnnealingLR(optimizer, MAX_LR, MIN_LR, warmup, decay, style)


@pytest.mark.parametrize(
    ("style", "iteration", "expected"),
    [
        # Warmup: max_lr * i / warmup, the same for every style.
        ("linear", 0, 0.0),
        ("linear", 1, 1e-4),
        ("cosine", 5, 5e-4),
        ("constant", 7, 7e-4),
        ("linear", 10, 1e-3),
        # Linear: min + (max - min) * (1 - r), r = (i - 10) / 100.
        ("linear", 35, 1e-4 + 9e-4 * 0.75),
        ("linear", 60, 5.5e-4),
        ("linear", 109, 1e-4 + 9e-4 * 0.01),
        ("linear", 110, 1e-4),
        ("linear", 500, 1e-4),
        # Cosine: min + (max - min) * (1 + cos(pi r)) / 2; r = 0.25 -> (1 + 0.70710678) / 2.
        ("cosine", 35, 1e-4 + 9e-4 * 0.8535533906),
        ("cosine", 60, 5.5e-4),
        ("cosine", 85, 1e-4 + 9e-4 * 0.1464466094),
        ("cosine", 110, 1e-4),
        ("cosine", 111, 1e-4),
        # Constant: max_lr after warmup, also past decay_iters.
        ("constant", 11, 1e-3),
        ("constant", 10_000, 1e-3),
    ],
)
def test_lr_at_known_iterations(style: str, iteration: int, expected: float) -> None:
    assert schedule(style).get_lr(iteration) == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_without_warmup_starts_at_max_lr() -> None:
    lr = schedule("linear", warmup=0, decay=100)
    assert lr.get_lr(0) == MAX_LR
    assert lr.get_lr(50) == pytest.approx((MAX_LR + MIN_LR) / 2)


def test_cosine_matches_torch_cosine_annealing() -> None:
    steps = DECAY - WARMUP
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=MAX_LR)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=MIN_LR)
    ours = schedule("cosine")
    for offset in range(steps + 1):
        assert ours.get_lr(WARMUP + offset) == pytest.approx(optimizer.param_groups[0]["lr"],
                                                             rel=1e-6)
        optimizer.step()
        reference.step()


def test_decay_is_monotone_and_continuous_at_warmup_end() -> None:
    for style in ("linear", "cosine"):
        lr = schedule(style)
        values = [lr.get_lr(i) for i in range(WARMUP, DECAY + 5)]
        assert all(later <= earlier for earlier, later in zip(values, values[1:], strict=False))
        assert values[0] == MAX_LR and values[-1] == MIN_LR


def test_get_lr_is_pure() -> None:
    optimizer = SimpleNamespace(param_groups=[{"lr": 123.0}])
    lr = schedule("linear", optimizer=optimizer)
    lr.get_lr(50)
    assert optimizer.param_groups[0]["lr"] == 123.0 and lr.num_iters == 0


def test_step_sets_every_param_group() -> None:
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.5}, {"lr": 0.5, "weight_decay": 0.0}])
    lr = schedule("cosine", optimizer=optimizer)
    applied = lr.step(60)
    assert applied == pytest.approx(5.5e-4)
    assert [group["lr"] for group in optimizer.param_groups] == [applied, applied]
    assert optimizer.param_groups[1]["weight_decay"] == 0.0


def test_step_drives_a_real_torch_optimizer() -> None:
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    lr = schedule("linear", optimizer=optimizer)
    lr.step(5)
    parameter.grad = torch.ones(3)
    optimizer.step()
    assert torch.allclose(parameter.detach(), torch.full((3,), 1.0 - 5e-4))


def test_state_dict_resume_continues_the_curve() -> None:
    continuous = schedule("cosine")
    first_half = schedule("cosine")
    first_half.step(40)
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.0}])
    resumed = schedule("cosine", optimizer=optimizer)
    resumed.load_state_dict(first_half.state_dict())
    assert resumed.num_iters == 40
    assert optimizer.param_groups[0]["lr"] == continuous.get_lr(40)
    for iteration in range(41, 120):
        assert resumed.step(iteration) == continuous.get_lr(iteration)


def test_load_rejects_a_different_schedule_unless_not_strict() -> None:
    saved = schedule("cosine").state_dict()
    current = schedule("linear")
    with pytest.raises(ValueError, match="decay_style is 'linear' but the checkpoint has 'cosine'"):
        current.load_state_dict(saved)
    saved["num_iters"] = 60
    current.load_state_dict(saved, strict=False)
    assert current.decay_style == "linear" and current.num_iters == 60
    with pytest.raises(ValueError, match="lacks num_iters"):
        current.load_state_dict({key: value for key, value in saved.items() if key != "num_iters"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"decay_style": "exponential"}, "decay_style must be one of"),
        ({"min_lr": 2e-3}, "need 0 <= min_lr <= max_lr"),
        ({"warmup_iters": -1}, "warmup_iters must not be negative"),
        ({"warmup_iters": 200}, "warmup_iters 200 must not exceed decay_iters 110"),
        ({"warmup_iters": 0, "decay_iters": 0}, "decay_iters must be positive"),
    ],
)
def test_invalid_schedules(kwargs: dict, message: str) -> None:
    settings = {"max_lr": MAX_LR, "min_lr": MIN_LR, "warmup_iters": WARMUP,
                "decay_iters": DECAY, "decay_style": "linear", **kwargs}
    with pytest.raises(ValueError, match=message):
        AnnealingLR(None, **settings)


def test_negative_iteration_is_rejected() -> None:
    with pytest.raises(ValueError, match="iteration must not be negative"):
        schedule("linear").get_lr(-1)


def test_constant_schedule_needs_no_decay_horizon() -> None:
    lr = AnnealingLR(None, MAX_LR, 0.0, warmup_iters=4, decay_iters=0, decay_style="constant")
    assert [lr.get_lr(i) for i in (0, 2, 4, 1000)] == [0.0, MAX_LR / 2, MAX_LR, MAX_LR]
    assert math.isclose(lr.get_lr(3), 0.75 * MAX_LR)
