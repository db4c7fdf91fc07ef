"""DeepSpeed's own Adam class, built by the script and passed to ``initialize``, as
DeepSpeedExamples' scripts do: read into the torch optimizer that takes the same step.

DeepSpeed's ``FusedAdam`` is used as DeepSpeed 0.19.8 builds it on a CPU machine (its CPU
kernel, compiled on first use into ~/.cache/torch_extensions, as tests/test_deepspeed_example.py
compiles it too). ``DeepSpeedCPUAdam`` is read the same way (same attributes)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

LR = 3e-3


def _groups(model, lr_no_decay=None):
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    no_decay = {"params": rest, "weight_decay": 0.0}
    if lr_no_decay is not None:
        no_decay["lr"] = lr_no_decay
    return [{"params": decay, "weight_decay": 0.1}, no_decay]


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_the_torch_optimizer_read_from_fused_adam_takes_its_step(adam_w_mode):
    """DeepSpeed's kernel and the torch class it is read into, three steps on the same
    gradients: the same weights."""
    from deepspeed.ops.adam import FusedAdam

    from zeropp.optimizer import OptimizerRecipe

    torch.manual_seed(0)
    theirs = [torch.nn.Parameter(torch.randn(37, 5)), torch.nn.Parameter(torch.randn(5))]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    groups = [{"params": theirs[:1], "weight_decay": 0.1}, {"params": theirs[1:], "lr": 1e-2}]
    deepspeed_adam = FusedAdam(groups, lr=LR, betas=(0.8, 0.95), eps=1e-6,
                               adam_w_mode=adam_w_mode)
    recipe = OptimizerRecipe.from_optimizer(deepspeed_adam)
    assert recipe.cls is (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)
    assert recipe.translated_from == "FusedAdam"
    torch_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [p]}
                    for group, p in zip(recipe.groups, ours, strict=True)]
    torch_adam = recipe.cls(torch_groups, **recipe.defaults)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in theirs]
        for p, q, g in zip(theirs, ours, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        deepspeed_adam.step()
        torch_adam.step()
    for p, q in zip(theirs, ours, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def engines(rank, world):
    from deepspeed.ops.adam import FusedAdam

    import zeropp

    config = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3}}
    data = toy_batches(3, 1, 3 * world)[:, :, rank * 3:(rank + 1) * 3]
    states, notes = [], ""
    for build in (lambda m: FusedAdam(_groups(m, lr_no_decay=1e-2), lr=LR),
                  lambda m: torch.optim.AdamW(_groups(m, lr_no_decay=1e-2), lr=LR)):
        model = toy_model()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            engine, optimizer, _, _ = zeropp.initialize(model, optimizer=build(model),
                                                        config=config)
        notes += printed.getvalue()
        for step in data:
            engine.backward(toy_loss(engine(step[0]), step[0]))
            engine.step()
        states.append((engine.full_state_dict(), type(optimizer.inner).__name__,
                       [g["lr"] for g in optimizer.param_groups]))
        engine.close()
    (deepspeed_state, deepspeed_cls, deepspeed_lrs), (torch_state, _, torch_lrs) = states
    same = all(torch.equal(deepspeed_state[k], torch_state[k]) for k in torch_state)
    return same, deepspeed_cls, deepspeed_lrs == torch_lrs == [LR, 1e-2], notes


def test_initialize_takes_deepspeeds_fused_adam():
    for rank, (same, cls, lrs, notes) in enumerate(run_ranks(engines, 2)):
        assert same and cls == "AdamW" and lrs
        if rank == 0:  # one line says what runs instead
            assert ("note: FusedAdam is stepped as torch.optim.AdamW(lr=0.003, betas=(0.9, "
                    "0.999), eps=1e-08, weight_decay=0.0) over each rank's shard, with its 2 "
                    "param group(s)") in notes


def test_a_setting_without_a_torch_equivalent_is_refused():
    from deepspeed.ops.adam import FusedAdam

    from zeropp.optimizer import OptimizerRecipe

    adam = FusedAdam([torch.nn.Parameter(torch.zeros(3))], lr=LR, bias_correction=False)
    with pytest.raises(ValueError, match="^optimizer FusedAdam: bias_correction=False has no "
                                         "torch Adam equivalent; leave it True$"):
        OptimizerRecipe.from_optimizer(adam)
