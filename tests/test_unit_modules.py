"""Units below the block ([Note: units]): the split rule, explicit unit modules, the release of
recomputed units, and training parity at sub-block granularity with explicit units."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_lite.model import GPTConfig, GPTModel
from tests.distributed import run_ranks
from tests.test_zero3_parity import CLIP, LR, WD, reference_run, sharded_run
from tests.toy_models import toy_batches, toy_loss, toy_model
from zeropp.config import ZeroConfig
from zeropp.deepspeed_api.initialize import max_unit_numel, options_from_config
from zeropp.planning.planner import unit_parameter_counts
from zeropp.unit_modules import default_unit_modules, unit_parameters


def gpt(layers=2, hidden=64, heads=4, vocab=100, seq=16):
    with torch.device("meta"):
        return GPTModel(GPTConfig(layers, hidden, heads, vocab, seq))


def names(model, units):
    by_id = {id(m): n for n, m in model.named_modules()}
    return [by_id[id(m)] for m in units]


def test_blocks_stay_whole_under_the_cap():
    model = gpt()
    block = sum(p.numel() for p in model.layers[0].parameters())  # 12 h^2 + 13 h
    assert names(model, default_unit_modules(model, block)) == ["layers.0", "layers.1"]
    assert names(model, default_unit_modules(model, None)) == ["layers.0", "layers.1"]


def test_a_block_above_the_cap_splits_into_its_linears():
    model = gpt()
    h = 64
    # Below attention and MLP (4 h^2 + 4h and 8 h^2 + 5h); the MLP's Linears (4 h^2 + 4h
    # and 4 h^2 + h) are above the cap too, but a Linear is never split.
    units = default_unit_modules(model, 10_000, min_child_numel=1000)
    assert names(model, units) == [
        "layers.0", "layers.0.attention.query_key_value", "layers.0.attention.dense",
        "layers.0.mlp.dense_h_to_4h", "layers.0.mlp.dense_4h_to_h",
        "layers.1", "layers.1.attention.query_key_value", "layers.1.attention.dense",
        "layers.1.mlp.dense_h_to_4h", "layers.1.mlp.dense_4h_to_h"]
    plan = unit_parameters(model, units)
    # The block's own unit keeps its two layer norms (2 x 2h, below min_child_numel).
    assert [p.numel() for p in plan[1][1]] == [h, h, h, h]
    # Every parameter is in exactly one unit, the root first with the embeddings.
    everything = [id(p) for _, params in plan for p in params]
    assert sorted(everything) == sorted(id(p) for p in model.parameters())
    assert plan[0][0] is model and model.embedding.word_embeddings.weight in plan[0][1]


def test_small_children_become_units_without_a_minimum_and_a_linear_is_never_split():
    model = gpt(layers=1)
    units = default_unit_modules(model, 10)  # below every Linear
    assert names(model, units) == [
        "layers.0.input_layernorm", "layers.0.attention.query_key_value",
        "layers.0.attention.dense", "layers.0.post_attention_layernorm",
        "layers.0.mlp.dense_h_to_4h", "layers.0.mlp.dense_4h_to_h"]
    counts = unit_parameter_counts(model, units)
    assert sum(counts) == sum(p.numel() for p in model.parameters())


def test_the_cap_is_a_quarter_of_the_live_budget_not_the_prefetch_window():
    # DeepSpeed's default budget, 1e9: blocks of up to 250M parameters stay whole.
    assert max_unit_numel(ZeroConfig(stage=3)) == 250_000_000
    zero = ZeroConfig(stage=3, stage3_prefetch_bucket_size=0, stage3_max_live_parameters=7)
    assert max_unit_numel(zero) == 1  # a budget below four parameters: every module alone
    assert options_from_config(zero)[0].max_unit_numel == 1
    # 0 asks to release every unit at once, not for units of one parameter: blocks stay whole.
    assert max_unit_numel(ZeroConfig(stage=3, stage3_max_live_parameters=0)) is None
    # The planner groups a model as the engine will for that config (18B: 453M-element
    # blocks, split at the default budget).
    model = gpt(layers=3)
    block = sum(p.numel() for p in model.layers[0].parameters())

    def counts(max_live, prefetch=50_000_000):
        zero = ZeroConfig(stage=3, stage3_max_live_parameters=max_live,
                          stage3_prefetch_bucket_size=prefetch,
                          stage3_param_persistence_threshold=1000)
        return unit_parameter_counts(model, zero=zero)

    whole, split = counts(4 * block), counts(4 * block - 4)
    # Split: the block's own unit (its layer norms, below the persistence threshold),
    # attention and MLP, each within the cap.
    assert len(whole) == 1 + 3 and len(split) == 1 + 3 * 3
    assert sum(whole) == sum(split)
    # The prefetch window says how far ahead to gather, not how small a unit is.
    assert counts(4 * block, prefetch=1) == counts(4 * block, prefetch=0) == whole


def _engine(unit_modules=None, **options):
    from zeropp.deepspeed_api.initialize import build_engine
    from zeropp.sharded_model import ShardingOptions

    model = toy_model(checkpoint=options.pop("checkpoint", False))
    units = unit_modules(model) if unit_modules else None
    return build_engine(model, lr=LR, weight_decay=WD, gradient_clipping=CLIP,
                        sharding=ShardingOptions(**options), unit_modules=units)


def _one_step(rank, world, unit_modules, options):
    engine = _engine(unit_modules, **options)
    gathers = []  # (phase, unit) of every gather that moves data
    for unit in engine.sharded.units:
        def counted(phase, unit=unit, start=unit.start_gather):
            if unit.state.value != "gathered" and not unit.gathering:
                gathers.append((phase, unit.name))
            start(phase)
        unit.start_gather = counted
    tokens = toy_batches(1, 1, 4)[0, 0]
    engine.backward(toy_loss(engine(tokens), tokens))
    engine.step()
    return [u.name for u in engine.sharded.units], gathers


def test_recomputed_units_are_released_beyond_the_live_budget():
    split = {"max_unit_numel": 800, "persistence_threshold": 100, "checkpoint": True}
    units, kept = run_ranks(_one_step, 1, None, split)[0]
    assert units == ["<root>", "layers.0", "layers.0.up", "layers.0.down", "layers.1",
                     "layers.1.up", "layers.1.down", "layers.2", "layers.2.up", "layers.2.down"]
    backward = [name for phase, name in kept if phase == "backward_all_gather"]
    # Within the live budget the recompute's gathers serve the backward too: once each.
    assert sorted(backward) == sorted(u for u in units if u.endswith(("up", "down")))
    _, released = run_ranks(_one_step, 1, None, {**split, "max_live_numel": 0})[0]
    backward = [name for phase, name in released if phase == "backward_all_gather"]
    # Beyond it the first unit of each recomputed block is freed and gathered again for its
    # backward; the last one (its backward comes next) never is.
    assert backward.count("layers.1.up") == 2 and backward.count("layers.1.down") == 1


def linears_then_blocks(model):
    """FSDP2's wrap-policy style: every Linear its own unit, each block around them."""
    linears = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    return linears + list(model.layers)


def test_explicit_unit_modules_match_the_unsharded_loop():
    ref_losses, _, ref_params = reference_run(4, 1, 12, checkpoint=True)
    results = run_ranks(sharded_run, 3, 4, 1, 12, True, False, {"persistence_threshold": 0},
                        linears_then_blocks)
    for losses, _, params in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def tied_across_units(model):
    model.layers[1].up.weight = model.layers[0].up.weight
    return [model.layers[0].up, model.layers[1].up]


def test_a_parameter_shared_between_units_is_refused():
    with pytest.raises(AssertionError, match="is shared with unit"):
        run_ranks(_one_step, 1, tied_across_units, {})


def _initialize_with_units(rank, world):
    import zeropp

    model = toy_model()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW",
              "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
    engine, *_ = zeropp.initialize(model=model, config=config,
                                   unit_modules=[model.layers[0].up, model.layers[0]])
    tokens = toy_batches(1, 1, 2)[0, 0]
    engine.backward(toy_loss(engine(tokens), tokens))
    engine.step()
    return [(u.name, u.layout.numel) for u in engine.sharded.units]


def test_initialize_takes_unit_modules_as_fsdp2s_wrap_policy():
    units = run_ranks(_initialize_with_units, 2)[0]
    # The root keeps the other blocks; layers.0 holds its norm and down, up its own Linear.
    assert units == [("<root>", 4403 + 2 * 1486), ("layers.0.up", 738), ("layers.0", 34 + 714)]
