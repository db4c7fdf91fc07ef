"""ZeRO stages 0-3 as residency policies of one engine: memory by DeepSpeed's formulas, what
each stage sends, checkpoints moved between stages, and ``zeropp.initialize`` with the
tutorial's JSON changed only in ``stage`` (parity with the unsharded loop:
tests/test_zero3_parity.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_zero_checkpoint import SPLIT, train
from tests.toy_models import toy_batches, toy_loss, toy_model
from zeropp.residency import Residency

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LR = 3e-3
# Big enough that padding (a few elements per unit) is noise beside the formulas.
WIDE = {"vocab": 1000, "width": 64, "hidden": 256, "layers": 4}


def test_residency_of_each_stage():
    assert [Residency.for_stage(s).stage for s in range(4)] == [0, 1, 2, 3]
    assert not Residency.for_stage(0).shard_optimizer_states
    assert Residency.for_stage(0).all_reduce_gradients
    assert not Residency.for_stage(1).reduce_every_micro_batch
    assert Residency.for_stage(2).weights_replicated
    assert not Residency.for_stage(3).weights_replicated
    assert Residency.for_stage(3, 8).secondary_group_size == 8
    with pytest.raises(ValueError, match="hpZ secondary shards need weights sharded"):
        Residency.for_stage(2, 8)
    with pytest.raises(ValueError, match="ZeRO stage must be one of"):
        Residency.for_stage(4)


def _engine(stage: int, micro: int, **sharding):
    from zeropp.deepspeed_api.initialize import build_engine
    from zeropp.sharded_model import ShardingOptions

    return build_engine(
        toy_model(**WIDE), lr=LR, weight_decay=0.1, gradient_accumulation_steps=micro,
        sharding=ShardingOptions(stage=stage, persistence_threshold=0, **sharding),
    )


def _micro_step(engine, data, step, m, rank, per_rank):
    tokens = data[step, m, rank * per_rank:(rank + 1) * per_rank]
    engine.backward(toy_loss(engine(tokens), tokens))
    engine.step()


def memory_in_accumulation(rank, world, stage):
    """Bytes held after one full step and the first micro-batch of the next (stage 1 then
    holds its whole gradients; every stage has its Adam state)."""
    engine = _engine(stage, micro=2)
    data = toy_batches(2, 2, 4 * world)
    for step, m in ((0, 0), (0, 1), (1, 0)):
        _micro_step(engine, data, step, m, rank, 4)
    psi = sum(unit.layout.numel for unit in engine.sharded.units)
    return psi, engine.memory_breakdown()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_per_rank_follows_deepspeeds_formulas(stage):
    """fp32 (d = 4 bytes), Adam (K = 12): stage 0 2d Psi + K Psi, stage 1 2d Psi + K Psi / N,
    stage 2 d Psi + (d + K) Psi / N, stage 3 (2d + K) Psi / N. Stage 1 also keeps the fp32
    gradient shard it accumulates into at the boundary (+4 Psi / N)."""
    world, d, k = 4, 4, 12
    results = run_ranks(memory_in_accumulation, world, stage)
    psi, memory = results[0]
    n = 1 if stage == 0 else world
    formula = {0: 2 * d * psi + k * psi, 1: 2 * d * psi + k * psi / n,
               2: d * psi + (d + k) * psi / n, 3: (2 * d + k) * psi / n}[stage]
    total = sum(memory.values())
    assert total == pytest.approx(formula, rel=0.10), memory
    # Where the bytes are: the stage's own rule, to padding.
    replicated_weights = memory["gathered_parameters"]
    assert replicated_weights == pytest.approx(d * psi if stage < 3 else 0, rel=0.01)
    assert memory["gradient_buffers"] == pytest.approx(d * psi if stage == 1 else 0, rel=0.01)
    assert memory["fp32_master_shards"] == pytest.approx(4 * psi / n, rel=0.01)
    assert memory["optimizer_moments"] == pytest.approx(8 * psi / n, rel=0.01)
    assert memory["working_shards"] == pytest.approx(d * psi / n if stage == 3 else 0, rel=0.01)
    for _, other in results[1:]:
        assert other == pytest.approx(memory, rel=0.01)


def bytes_per_step(rank, world, stage, micro):
    engine = _engine(stage, micro)
    data = toy_batches(2, micro, 2 * world)
    for m in range(micro):
        _micro_step(engine, data, 0, m, rank, 2)
    engine.comm_bytes(reset=True)
    for m in range(micro):
        _micro_step(engine, data, 1, m, rank, 2)
    padded = [unit.layout.padded_numel for unit in engine.sharded.units]
    return padded, engine.comm_bytes(reset=True)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_what_each_replicated_stage_sends(stage):
    """Per step of 3 micro-batches on 3 ranks: stage 0 all-reduces every
    micro-batch; stage 1 reduce-scatters once, at the boundary; stage 2 after every
    micro-batch; stages 1 and 2 then all-gather the updated weights once."""
    world, micro, d = 3, 3, 4
    padded, sent = run_ranks(bytes_per_step, world, stage, micro)[0]
    total = sum(padded) * d
    reduce_scatter = total * (world - 1) // world
    expected_reduce = {0: micro * 2 * reduce_scatter, 1: reduce_scatter,
                       2: micro * reduce_scatter}[stage]
    assert sum(sent["gradient_reduce"].values()) == pytest.approx(expected_reduce, rel=1e-3)
    gathered = 0 if stage == 0 else total // world * (world - 1)
    assert sum(sent["forward_all_gather"].values()) == pytest.approx(gathered, rel=1e-3)
    assert sum(sent["backward_all_gather"].values()) == 0


@pytest.mark.parametrize("saved,loaded", [((3, 4), (1, 2)), ((1, 2), (2, 4)), ((2, 4), (0, 1)),
                                          ((0, 2), (3, 4))],
                         ids=["3x4-to-1x2", "1x2-to-2x4", "2x4-to-0x1", "0x2-to-3x4"])
def test_checkpoints_move_between_stages_and_world_sizes(tmp_path, saved, loaded):
    """Stage s on N ranks saves after 3 steps; stage s' on M ranks resumes and equals the
    uninterrupted run (``tests/test_zero_checkpoint.train``, one rank per node)."""
    (old_stage, old_world), (new_stage, new_world) = saved, loaded
    full_losses, full_params = run_ranks(train, old_world, None, "full", 1, 1, None,
                                         old_stage)[0]
    run_ranks(train, old_world, str(tmp_path), "first", 1, 1, None, old_stage)
    resumed = run_ranks(train, new_world, str(tmp_path), "resume", 1, 1, None, new_stage)
    for losses, params in resumed:
        assert losses == pytest.approx(full_losses[SPLIT:], rel=1e-5)
        for name, value in full_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def tutorial_run(rank, world, stage, steps):
    import zeropp

    config = json.loads((CONFIGS / "ds_zeropp_config.json").read_text())
    config["zero_optimization"]["stage"] = stage
    engine, optimizer, _, _ = zeropp.initialize(toy_model(), config=config,
                                                optimizer_params={"lr": LR})
    assert optimizer is engine.optimizer
    data = toy_batches(steps, 1, 6)
    per_rank = 6 // world
    losses = []
    for step in range(steps):
        tokens = data[step, 0, rank * per_rank:(rank + 1) * per_rank]
        loss = toy_loss(engine(tokens), tokens)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


@pytest.mark.parametrize("stage,world", [(1, 2), (2, 3), (2, 1)])
def test_initialize_runs_the_tutorial_config_at_stages_1_and_2(stage, world):
    """The tutorial's JSON (gradient_clipping 1.0) with only ``stage`` changed equals torch's
    AdamW + clip_grad_norm_ on one process."""
    steps = 4
    model = toy_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    data = toy_batches(steps, 1, 6)
    reference = []
    for step in range(steps):
        loss = toy_loss(model(data[step, 0]), data[step, 0])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        reference.append(loss.item())
    for losses in run_ranks(tutorial_run, world, stage, steps):
        assert losses == pytest.approx(reference, rel=1e-5)
