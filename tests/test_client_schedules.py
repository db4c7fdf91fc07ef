"""A schedule the script built on its own optimizer drives the engine (DeepSpeed's meaning of
``initialize(optimizer=opt, lr_scheduler=sched)``), for torch's schedulers and Hugging Face's
``get_scheduler``: the engine's lr follows the same curve as the schedule on a plain torch
optimizer, and training moves the weights from the first step after a warm-up from 0.
Before, the schedule kept writing into the script's optimizer, which nothing stepped: the lr
stayed 0 and nothing trained, silently. 2 ranks, gloo, fp32."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

LR = 1e-2
STEPS = 5


def _schedule(kind: str, optimizer):
    if kind == "lambda_warmup":  # warm-up from 0, as the DeepSpeedExamples scripts do
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 3))
    if kind == "hf_linear":
        from transformers import get_scheduler

        return get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=10)
    if kind == "hf_cosine":
        from transformers import get_scheduler

        return get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=10)
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if kind == "one_cycle":  # writes betas too
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=10)
    raise ValueError(kind)


def _client_optimizer(model):
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if p.ndim <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=LR)


def reference_lrs(kind: str) -> list[list[float]]:
    """The schedule on a plain torch optimizer: its group lrs after each step."""
    optimizer = _client_optimizer(toy_model())
    schedule = _schedule(kind, optimizer)
    lrs = []
    for _ in range(STEPS):
        optimizer.step()
        schedule.step()
        lrs.append([group["lr"] for group in optimizer.param_groups])
    return lrs


def client_schedule_run(rank, world, kind):
    import zeropp

    model = toy_model()
    optimizer = _client_optimizer(model)
    schedule = _schedule(kind, optimizer)
    config = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3}}
    engine, engine_optimizer, _, engine_schedule = zeropp.initialize(
        model, optimizer=optimizer, lr_scheduler=schedule, config=config)
    start = {k: v.clone() for k, v in engine.full_state_dict().items()}
    data = toy_batches(STEPS, 1, 3 * world)[:, :, rank * 3:(rank + 1) * 3]
    lrs, moved = [], []
    for step in data:
        engine.backward(toy_loss(engine(step[0]), step[0]))
        engine.step()
        lrs.append(engine.get_lr())
        now = engine.full_state_dict()
        moved.append(max(float((now[k] - start[k]).abs().max()) for k in now))
    out = {"same_schedule": engine_schedule is schedule,
           "bound": schedule.optimizer is engine_optimizer, "lrs": lrs, "moved": moved,
           "betas": [g.get("betas") for g in engine_optimizer.param_groups]}
    engine.close()
    return out


@pytest.mark.parametrize("kind", ["lambda_warmup", "hf_linear", "hf_cosine", "step",
                                  "one_cycle"])
def test_a_client_schedule_drives_the_engine(kind):
    expected = reference_lrs(kind)
    for result in run_ranks(client_schedule_run, 2, kind):
        assert result["same_schedule"] and result["bound"]
        assert [lr for step in result["lrs"] for lr in step] == pytest.approx(
            [lr for step in expected for lr in step], rel=1e-12)
        # lr 0 at the first step of a warm-up from 0: nothing moves; then training does
        assert result["moved"][-1] > 1e-4
    if kind == "one_cycle":  # OneCycleLR's momentum cycling reaches the engine's groups
        assert result["betas"][0] != (0.9, 0.999)


def unreachable(rank, world, problem):
    import zeropp

    model = toy_model()
    config = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    if problem == "groups":  # built on a three-group optimizer; the engine's has one
        params = list(model.parameters())
        other = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:2]},
                                 {"params": params[2:]}], lr=LR)
        schedule = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    else:
        class NoOptimizer:
            def step(self):
                pass
        schedule = NoOptimizer()
    try:
        zeropp.initialize(model, lr_scheduler=schedule, config=config)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("problem, words", [
    ("groups", "drives 3 param groups, the engine's optimizer has 1"),
    ("no_optimizer", "NoOptimizer has no .optimizer"),
])
def test_a_schedule_that_cannot_reach_the_engine_is_an_error(problem, words):
    message = run_ranks(unreachable, 1, problem)[0]
    assert message is not None and words in message and "\n" not in message
