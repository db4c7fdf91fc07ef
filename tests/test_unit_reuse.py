"""A unit run several times in one training forward ([Note: a unit used several times] in
zeropp/unit_hooks.py): every ZeRO stage against the plain unsharded loop, as
tests/test_zero3_parity.py checks models whose modules run once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_ranks
from tests.toy_models import ToyBlock, toy_batches, toy_loss, train_data_parallel, train_unsharded

LR, WD, CLIP = 3e-3, 0.1, 0.5
WORLD, STEPS, BATCH = 2, 4, 8


class ReuseLM(nn.Module):
    """Weights shared inside the model: ``layers[0]`` (a 17 -> 33 -> 17 block) runs ``uses``
    times, ``layers[1]`` twice, the bare Linear ``layers[2]`` three times; tied head at the
    root."""

    def __init__(self, uses: int = 2, checkpoint: bool | str = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(257, 17)
        self.layers = nn.ModuleList([ToyBlock(17, 33), ToyBlock(17, 41), nn.Linear(17, 17)])
        self.norm = nn.LayerNorm(17)
        self.uses, self.checkpoint = uses, checkpoint

    def _run(self, layer, x):
        if self.checkpoint and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(
                layer, x, use_reentrant=self.checkpoint == "reentrant")
        return layer(x)

    def forward(self, ids):
        x = self.embed(ids)
        x = self._run(self.layers[0], x)
        x = self._run(self.layers[1], x)
        for _ in range(self.uses - 1):
            x = self._run(self.layers[0], x)
        # Never checkpointed: uses in a chain and beside it, and a use whose input needs no
        # gradient (no post-backward node: the unit is reduced when backward ends).
        x = x + self.layers[2](self.layers[2](x)) + self.layers[2](x)
        x = x + 0.5 * self.layers[1](x.detach())
        return F.linear(self.norm(x), self.embed.weight)


def reuse_model(uses: int, checkpoint: bool | str = False) -> ReuseLM:
    torch.manual_seed(0)
    model = ReuseLM(uses, checkpoint)
    with torch.no_grad():  # non-trivial LayerNorm parameters so their gradients matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def reference_run(uses, micro, checkpoint):
    """Single process, unsharded, the same data and optimizer as every sharded run."""
    losses, _, weights = train_unsharded(reuse_model(uses, checkpoint),
                                         toy_batches(STEPS, micro, BATCH), STEPS, micro, LR,
                                         WD, CLIP)
    return losses, weights


def sharded_run(rank, world, uses, micro, checkpoint, options, quant):
    from zeropp.deepspeed_api.initialize import QuantizationOptions, build_engine
    from zeropp.sharded_model import ShardingOptions

    engine = build_engine(
        reuse_model(uses, checkpoint), lr=LR, weight_decay=WD, gradient_accumulation_steps=micro,
        gradient_clipping=CLIP, sharding=ShardingOptions(**options),
        quantization=QuantizationOptions(**quant), ranks_per_node=world,
    )
    losses = train_data_parallel(engine, rank, world, toy_batches(STEPS, micro, BATCH), STEPS,
                                 micro)
    weights = engine.full_state_dict()
    engine.close()
    return losses, weights


EXACT = {}  # exact collectives


@pytest.mark.parametrize("uses,micro,checkpoint,options,quant", [
    (2, 1, False, {"stage": 3, "persistence_threshold": 0}, EXACT),
    (3, 2, False, {"stage": 3, "persistence_threshold": 0, "max_live_numel": 0,
                   "prefetch_bucket_numel": 0}, EXACT),
    (2, 2, True, {"stage": 3, "persistence_threshold": 0, "prefetch_bucket_numel": 2000}, EXACT),
    (3, 1, "reentrant", {"stage": 3, "persistence_threshold": 0, "max_live_numel": 1500},
     EXACT),
    # Units below the block: the reused block's Linears are units of their own.
    (3, 2, "reentrant", {"stage": 3, "max_unit_numel": 600, "persistence_threshold": 0,
                         "max_live_numel": 0}, EXACT),
    (2, 2, False, {"stage": 3, "max_reuse_distance": 10**9, "persistence_threshold": 0},
     EXACT),
    (3, 2, False, {"stage": 0}, EXACT),
    (3, 2, True, {"stage": 1}, EXACT),
    (2, 2, "reentrant", {"stage": 2}, EXACT),
    (3, 2, True, {"stage": 2, "max_unit_numel": 600}, EXACT),
    (3, 2, "reentrant", {"stage": 3, "persistence_threshold": 0}, {"hpz_size": 2}),
], ids=["s3-twice", "s3-thrice-accum-release-no-prefetch", "s3-checkpoint-accum-prefetch",
        "s3-thrice-reentrant-live-cap", "s3-subblock-reentrant-accum", "s3-kept-for-backward",
        "s0-thrice-accum", "s1-thrice-checkpoint-accum", "s2-reentrant-accum",
        "s2-subblock-checkpoint", "hpz-reentrant-accum"])
def test_reused_units_train_as_unsharded(uses, micro, checkpoint, options, quant):
    ref_losses, ref_params = reference_run(uses, micro, checkpoint)
    for losses, params in run_ranks(sharded_run, WORLD, uses, micro, checkpoint, options,
                                    quant):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, value in ref_params.items():
            # A few embedding rows get gradients near 1e-9, where Adam's first update
            # lr * g / (|g| + eps) turns the summation order's rounding into up to ~1e-5;
            # a use's gradient missed or counted twice moves weights by ~lr (3e-3).
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=2e-5, msg=name)


def test_reused_units_with_qwz_hpz_qgz_track_the_exact_run():
    """Quantized weights and gradients (lossy) with hpZ: the reused block's later forwards
    gather inside the node from the secondary shard. Every use's backward computes with the
    weights its forward used: the int8 secondary (qwZ's payload) trains bit for bit as the
    16-bit one, and both stay near the exact run."""
    quant = {"quantized_weights": True, "hpz_size": 2, "quantized_gradients": True}
    options = {"stage": 3, "persistence_threshold": 0}
    ref_losses, _ = reference_run(3, 2, "reentrant")
    int8 = run_ranks(sharded_run, WORLD, 3, 2, "reentrant", options, quant)
    sixteen = run_ranks(sharded_run, WORLD, 3, 2, "reentrant", options,
                        {**quant, "quantized_secondary": False})
    for (losses, params), (exact_losses, exact_params) in zip(int8, sixteen, strict=True):
        assert losses == exact_losses
        for name, value in exact_params.items():
            assert torch.equal(params[name], value), name
        assert losses != pytest.approx(ref_losses, rel=1e-6)  # quantization really happened
        assert losses == pytest.approx(ref_losses, rel=0.02)


class _TwiceModel(nn.Module):
    """Calls its first Linear twice in one forward, as DeepSpeed's SimpleModel does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, ids):
        x = self.embed(ids)
        x = self.layers[0](x)
        x = self.layers[1](x)
        return self.layers[0](x).square().mean()


def _initialize_and_train(rank, world, forwards):
    """zeropp.initialize at stage 3; ``forwards`` training forwards summed into one loss
    before each backward. Returns the losses and the whole weights after training."""
    import zeropp

    torch.manual_seed(0)
    engine, *_ = zeropp.initialize(
        model=_TwiceModel(),
        config={"train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    ids = torch.arange(8).view(2, 4) + 8 * rank
    losses = []
    for _ in range(3):
        loss = sum(engine(ids + i) for i in range(forwards))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    weights = engine.full_state_dict()
    engine.close()
    return losses, weights


@pytest.mark.parametrize("forwards", [1, 2], ids=["one-forward", "two-forwards-one-backward"])
def test_a_module_run_twice_trains_through_initialize(forwards):
    """The refusal is gone: plain SGD on the data of both ranks gives the unsharded result,
    also when two training forwards (four uses of the Linear) feed one backward."""
    torch.manual_seed(0)
    model = _TwiceModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_losses = []
    for _ in range(3):
        per_rank = [sum(model(torch.arange(8).view(2, 4) + 8 * r + i) for i in range(forwards))
                    for r in range(WORLD)]
        loss = sum(per_rank) / WORLD
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    for losses, weights in run_ranks(_initialize_and_train, WORLD, forwards):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


class _Reordered(nn.Module):
    """Three blocks run in the order ``self.order`` names: a forward unlike the last one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(257, 17)
        self.layers = nn.ModuleList([ToyBlock(17, 33) for _ in range(3)])
        self.order = [0, 1, 2]

    def forward(self, ids):
        x = self.embed(ids)
        for index in self.order:
            x = self.layers[index](x)
        return F.linear(x, self.embed.weight)


def reordered_run(rank, world):
    from zeropp.deepspeed_api.initialize import build_engine
    from zeropp.prefetch import distinct_ahead
    from zeropp.sharded_model import ShardingOptions

    model = _Reordered()
    engine = build_engine(model, lr=LR, ranks_per_node=world, sharding=ShardingOptions(
        stage=3, persistence_threshold=0, prefetch_bucket_numel=2000))
    hooks = engine.sharded.hooks
    data = toy_batches(5, 1, BATCH)
    stale = []
    for step, order in enumerate([[0, 1, 2], [0, 1, 2], [2, 0, 1], [2, 0, 1], [2, 0, 1]]):
        model.order = order
        tokens = data[step, 0, rank::world]
        engine.backward(toy_loss(engine(tokens), tokens))
        engine.step()
        # Every window kept is the one the plan the next iteration reads gives.
        for forward, plan in ((True, hooks._last_forward_order),
                              (False, hooks._last_backward_needs)):
            for start, window in hooks._windows[forward].items():
                if window != distinct_ahead(plan, start, hooks._never_prefetched,
                                            hooks.options.prefetch_bucket_numel):
                    stale.append((step, forward, start))
    engine.close()
    return stale, len(hooks._windows[True])


def test_prefetch_windows_follow_a_forward_unlike_the_last():
    for stale, windows in run_ranks(reordered_run, WORLD):
        assert stale == []
        assert windows > 0  # windows were kept, and checked
