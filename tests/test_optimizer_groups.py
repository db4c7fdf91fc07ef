"""Parameter groups and optimizer types through ``zeropp.initialize`` (DeepSpeed's meanings):
every sharded run on 2 gloo ranks equals plain torch on one process with the same optimizer,
groups and schedule."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

LR = 3e-3
MICRO = 2  # rows per rank
STEPS = 4


def split_groups(model, decay_lr_scale: float = 1.0):
    """A user's groups: decay on matrices (0.1), none on vectors, with its own lr."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": LR * decay_lr_scale * 3}]


def half_lr_schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


# name -> (what initialize gets, the torch optimizer for the reference, scheduler factory)
CASES = {
    # the config's AdamW block over the user's groups (per-group weight decay and lr)
    "adamw_groups": dict(config_optimizer={"type": "AdamW", "params": {"lr": LR}},
                         groups=True),
    # a torch optimizer instance built over groups, plus a torch schedule given as a callable
    "sgd_instance": dict(optimizer="sgd", groups=True, scheduler=True),
    # a callable building classic Adam (L2-coupled decay) over every parameter
    "adam_callable": dict(optimizer="adam_callable"),
    # the JSON's SGD type with nesterov momentum
    "sgd_config": dict(config_optimizer={"type": "SGD", "params": {
        "lr": LR, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}}),
    # DeepSpeed's Adam with adam_w_mode false: classic Adam
    "adam_l2_config": dict(config_optimizer={"type": "Adam", "params": {
        "lr": LR, "weight_decay": 0.05, "adam_w_mode": False}}),
}


def torch_optimizer(case: dict, params):
    if case.get("optimizer") == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01)
    if case.get("optimizer") == "adam_callable":
        return torch.optim.Adam(params, lr=LR, weight_decay=0.02)
    block = case["config_optimizer"]
    kind = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD, "Adam": torch.optim.Adam}[block["type"]]
    kwargs = {k: v for k, v in block["params"].items() if k != "adam_w_mode"}
    if kind is torch.optim.AdamW:
        kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed's AdamW default
    return kind(params, **kwargs)


def sharded_run(rank, world, name):
    import zeropp

    case = CASES[name]
    model = toy_model()
    params = split_groups(model) if case.get("groups") else model.parameters()
    config = {"train_micro_batch_size_per_gpu": MICRO,
              "gradient_clipping": 0.0,  # the torch reference does not clip (DeepSpeed: 1.0)
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    kwargs = {}
    if "config_optimizer" in case:
        config["optimizer"] = case["config_optimizer"]
    elif case["optimizer"] == "adam_callable":
        kwargs["optimizer"] = lambda groups: torch_optimizer(case, groups)
    else:
        kwargs["optimizer"] = torch_optimizer(case, params)
    if case.get("scheduler"):
        kwargs["lr_scheduler"] = half_lr_schedule
    engine, optimizer, _, scheduler = zeropp.initialize(
        model=model, model_parameters=params, config=config, **kwargs)
    data = toy_batches(STEPS, 1, MICRO * world)
    losses = []
    for step in range(STEPS):
        tokens = data[step, 0, rank * MICRO:(rank + 1) * MICRO]
        loss = toy_loss(engine(tokens), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    out = {"state": state, "lr": engine.get_lr(), "groups": len(optimizer.param_groups),
           "is_torch_optimizer": isinstance(optimizer, torch.optim.Optimizer),
           "inner": type(optimizer.inner).__name__}
    engine.close()
    return out


def reference_run(name, world):
    case = CASES[name]
    model = toy_model()
    params = split_groups(model) if case.get("groups") else model.parameters()
    optimizer = torch_optimizer(case, params)
    scheduler = half_lr_schedule(optimizer) if case.get("scheduler") else None
    data = toy_batches(STEPS, 1, MICRO * world)
    for step in range(STEPS):
        tokens = data[step, 0]
        optimizer.zero_grad()
        toy_loss(model(tokens), tokens).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return ({n: p.detach() for n, p in model.named_parameters()},
            [group["lr"] for group in optimizer.param_groups], type(optimizer).__name__,
            len(optimizer.param_groups))


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_optimizer_equals_torch(name):
    world = 2
    expected, expected_lr, kind, groups = reference_run(name, world)
    for out in run_ranks(sharded_run, world, name):
        assert out["is_torch_optimizer"] and out["inner"] == kind
        assert out["groups"] == groups
        assert out["lr"] == pytest.approx(expected_lr)
        for param_name, value in expected.items():
            torch.testing.assert_close(out["state"][param_name], value, rtol=0, atol=1e-5,
                                       msg=f"{name}: {param_name}")


def test_groups_change_the_result():
    """The check above can fail: dropping the groups' own decay and lr changes the weights."""
    expected, *_ = reference_run("adamw_groups", 2)
    model = toy_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    data = toy_batches(STEPS, 1, MICRO * 2)
    for step in range(STEPS):
        optimizer.zero_grad()
        toy_loss(model(data[step, 0]), data[step, 0]).backward()
        optimizer.step()
    differs = [n for n, p in model.named_parameters()
               if (p.detach() - expected[n]).abs().max() > 1e-5]
    assert differs


def loader_run(rank, world):
    import zeropp

    dataset = torch.utils.data.TensorDataset(torch.arange(21))
    engine, _, loader, _ = zeropp.initialize(
        model=toy_model(), config={"train_micro_batch_size_per_gpu": 3,
                                   "optimizer": {"type": "AdamW", "params": {"lr": LR}},
                                   "zero_optimization": {"stage": 3}},
        training_data=dataset)
    batches = [batch[0].tolist() for batch in loader]
    engine.close()
    return batches


def test_training_data_gives_each_rank_its_share():
    ranks = run_ranks(loader_run, 2)
    for rank, batches in enumerate(ranks):
        sampler = torch.utils.data.DistributedSampler(range(21), num_replicas=2, rank=rank)
        order = list(sampler)
        assert [x for batch in batches for x in batch] == order  # DeepSpeed's order
        assert all(len(batch) == 3 for batch in batches[:-1])
    seen = {x for batches in ranks for batch in batches for x in batch}
    assert seen == set(range(21))


def refusals_run(rank, world):
    import zeropp

    model = toy_model()
    messages = []
    attempts = [
        dict(mpu=object(), config={}),
        dict(optimizer=torch.optim.LBFGS(model.parameters()),
             config={"train_micro_batch_size_per_gpu": 1}),
        dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
             config={"optimizer": {"type": "AdamW", "params": {"lr": 1.0}}}),
    ]
    for kwargs in attempts:
        try:
            zeropp.initialize(model=model, **kwargs)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_refusals():
    (mpu, lbfgs, both), = run_ranks(refusals_run, 1)
    assert "mpu" in mpu and "data parallel only" in mpu
    assert "LBFGS cannot be partitioned" in lbfgs
    assert "keep one" in both
