"""Off the tutorial's path: frozen parameters, rank-dependent unused parameters, reentrant
checkpointing with hpZ. Each sharded run against the exact single-process run it replaces."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

LR, WD, CLIP = 3e-3, 0.1, 0.5
WORLD, GLOBAL_BATCH, STEPS = 4, 8, 4

FREEZE_RULES = {
    # Fine-tuning habits: frozen norms and biases (BitFit's complement), frozen embeddings
    # (tied to the head here, so the root's largest tensor is frozen).
    "norms-biases": lambda name: "norm" in name or name.endswith("bias"),
    "embedding": lambda name: name == "embed.weight",
}


def freeze(model, rule_name):
    rule = FREEZE_RULES[rule_name]
    for name, param in model.named_parameters():
        if rule(name):
            param.requires_grad_(False)
    return model


def skip_of(rank):
    """Rank-dependent bypass: ranks leave different blocks' parameters without a gradient.

    Every rank still calls every block (a gather is a collective: a block one rank never
    calls would hang ZeRO-3 as it hangs DeepSpeed)."""
    return {0: 1, 1: 2, 2: None, 3: 1}[rank]


def reference_run(freeze_rule, checkpoint, rank_dependent_skip):
    model = toy_model(checkpoint=checkpoint)
    if freeze_rule:
        freeze(model, freeze_rule)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for _, p in trainable if p.ndim >= 2], "weight_decay": WD},
         {"params": [p for _, p in trainable if p.ndim < 2], "weight_decay": 0.0}],
        lr=LR, foreach=False,
    )
    data = toy_batches(STEPS, 1, GLOBAL_BATCH)
    per_rank = GLOBAL_BATCH // WORLD
    losses = []
    for step in range(STEPS):
        tokens = data[step, 0]
        if rank_dependent_skip:  # data parallelism averages the per-rank mean losses
            loss = sum(
                toy_loss(model(tokens[r * per_rank:(r + 1) * per_rank], skip_layer=skip_of(r)),
                         tokens[r * per_rank:(r + 1) * per_rank])
                for r in range(WORLD)) / WORLD
        else:
            loss = toy_loss(model(tokens), tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trainable], CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def sharded_run(rank, world, freeze_rule, checkpoint, rank_dependent_skip):
    from zeropp.deepspeed_api.initialize import build_engine
    from zeropp.sharded_model import ShardingOptions

    model = toy_model(checkpoint=checkpoint)
    if freeze_rule:
        freeze(model, freeze_rule)
    frozen_numel = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    engine = build_engine(
        model, lr=LR, weight_decay=WD, gradient_clipping=CLIP,
        sharding=ShardingOptions(persistence_threshold=0, prefetch_bucket_numel=4000),
    )
    data = toy_batches(STEPS, 1, GLOBAL_BATCH)
    per_rank = GLOBAL_BATCH // world
    losses = []
    for step in range(STEPS):
        tokens = data[step, 0, rank * per_rank:(rank + 1) * per_rank]
        skip = skip_of(rank) if rank_dependent_skip else None
        loss = toy_loss(engine(tokens, skip_layer=skip), tokens)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    master_numel = torch.tensor(sum(m.numel() for m in engine.optimizer.masters))
    torch.distributed.all_reduce(master_numel)
    padded = sum(u.layout.padded_numel - u.layout.numel for u in engine.sharded.units)
    total_numel = sum(u.layout.numel for u in engine.sharded.units)
    engine.close()
    return (losses, engine.full_state_dict(),
            int(master_numel), total_numel + padded - frozen_numel)


@pytest.mark.parametrize("freeze_rule,checkpoint", [
    ("norms-biases", False), ("embedding", False), ("norms-biases", True),
])
def test_frozen_parameters_match_single_process(freeze_rule, checkpoint):
    """Frozen weights stay readable through backward (the unit is released after its whole
    backward, not at its last trainable gradient), are never updated, and have no fp32
    master or Adam state."""
    ref_losses, ref_params = reference_run(freeze_rule, checkpoint, False)
    for losses, params, master_numel, trainable_numel in run_ranks(
            sharded_run, WORLD, freeze_rule, checkpoint, False):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5, msg=name)
        assert master_numel == trainable_numel


def test_frozen_parameters_stay_at_their_initial_values():
    initial = dict(toy_model().named_parameters())
    _, params = reference_run("norms-biases", False, False)
    frozen = [n for n in params if FREEZE_RULES["norms-biases"](n)]
    results = run_ranks(sharded_run, 2, "norms-biases", False, False)
    for name in frozen:
        torch.testing.assert_close(results[0][1][name], initial[name].detach(), rtol=0, atol=0)


def test_rank_dependent_unused_parameters_match_single_process():
    """Ranks that leave different (same-sized) blocks without gradients still reduce every
    unit in one order: no gradient lands in another layer's shard."""
    ref_losses, ref_params = reference_run(None, False, True)
    for losses, params, _, _ in run_ranks(sharded_run, WORLD, None, False, True):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_reentrant_checkpointing_keeps_hpz_inside_the_node():
    """Hugging Face's default checkpointing runs the block's forward under no_grad; with hpZ
    the recompute must still gather from the secondary shards, never across nodes."""
    from tests.test_zeropp_engine import run

    plain = run(2, {"hpz_size": 2}, checkpoint=False)
    reentrant = run(2, {"hpz_size": 2}, checkpoint="reentrant")
    for a, b in zip(plain, reentrant, strict=True):
        assert b[0] == pytest.approx(a[0], rel=1e-6, abs=0)
    for step_bytes in reentrant[0][1]:
        assert step_bytes["backward_all_gather"]["inter_node"] == 0
        assert step_bytes["backward_all_gather"]["intra_node"] > 0


def reuse_run(rank, world, max_reuse_distance):
    from zeropp.deepspeed_api.initialize import QuantizationOptions, build_engine
    from zeropp.sharded_model import ShardingOptions

    engine = build_engine(
        toy_model(), lr=LR, ranks_per_node=2, quantization=QuantizationOptions(hpz_size=2),
        sharding=ShardingOptions(persistence_threshold=0, max_reuse_distance=max_reuse_distance),
    )
    data = toy_batches(STEPS, 1, GLOBAL_BATCH)
    per_rank = GLOBAL_BATCH // world
    losses, backward_bytes = [], []
    for step in range(STEPS):
        tokens = data[step, 0, rank * per_rank:(rank + 1) * per_rank]
        loss = toy_loss(engine(tokens), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        backward_bytes.append(sum(engine.comm_bytes()["backward_all_gather"].values()))
    engine.close()
    return losses, backward_bytes


def test_max_reuse_distance_keeps_blocks_gathered_into_backward():
    """stage3_max_reuse_distance: blocks reused within the distance skip their backward
    gather (after the first step, which records the order); the numbers do not change."""
    released = run_ranks(reuse_run, 4, 0)
    kept = run_ranks(reuse_run, 4, 10**9)
    for (losses, _), (kept_losses, kept_bytes) in zip(released, kept, strict=True):
        assert kept_losses == losses
        assert kept_bytes[0] > 0 and kept_bytes[1:] == [0] * (STEPS - 1)
    assert all(b > 0 for b in released[0][1])
