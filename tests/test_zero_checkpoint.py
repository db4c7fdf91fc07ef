"""Sharded checkpoints: bit-exact resume, resharding, hpZ after load, atomicity, errors."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

STEPS, SPLIT = 6, 3


def train(rank, world, ckpt, mode, per_node, hpz, crash_rank=None, stage=3):
    """mode: 'full' (STEPS steps), 'first' (SPLIT steps, save), 'resume' (load, rest)."""
    from zeropp.checkpoints import checkpoint
    from zeropp.deepspeed_api.initialize import QuantizationOptions, build_engine
    from zeropp.sharded_model import ShardingOptions

    engine = build_engine(
        toy_model(hidden=43), lr=3e-3, weight_decay=0.1, gradient_clipping=1.0,
        ranks_per_node=per_node, quantization=QuantizationOptions(hpz_size=hpz),
        sharding=ShardingOptions(stage=stage, persistence_threshold=0),
    )
    data = toy_batches(STEPS, 1, 8)
    per_rank = 8 // world
    start = 0
    if mode == "resume":
        _, client = engine.load_checkpoint(ckpt)
        start = client["iteration"]
    stop = SPLIT if mode == "first" else STEPS
    losses = []
    for step in range(start, stop):
        tokens = data[step, 0, rank * per_rank:(rank + 1) * per_rank]
        loss = toy_loss(engine(tokens), tokens)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    if mode == "first":
        if crash_rank is not None:
            original = torch.save

            def crash_on_one_rank(obj, path, *a, **k):
                if rank == crash_rank:
                    raise OSError(28, "No space left on device")
                return original(obj, path, *a, **k)

            torch.save = crash_on_one_rank
            try:
                engine.save_checkpoint(ckpt, tag="iter_again", client_state={"iteration": stop})
            except checkpoint.CheckpointError as exc:
                return str(exc)
            finally:
                torch.save = original
            return "no error"
        engine.save_checkpoint(ckpt, tag=f"iter_{stop}", client_state={"iteration": stop})
    return losses, engine.full_state_dict()


def test_resume_is_bit_exact_and_reshards(tmp_path):
    full = run_ranks(train, 4, None, "full", 2, 1)[0]
    first = run_ranks(train, 4, str(tmp_path), "first", 2, 1)[0]
    assert (tmp_path / "latest").read_text() == "iter_3"
    resumed = run_ranks(train, 4, str(tmp_path), "resume", 2, 1)[0]
    assert first[0] + resumed[0] == full[0]  # bit for bit, same world size
    for name, value in full[1].items():
        assert torch.equal(resumed[1][name], value), name

    # Written by 4 ranks, loaded by 2 (another layout, with hpZ): the loss continues.
    two = run_ranks(train, 2, str(tmp_path), "resume", 2, 2)[0]
    assert two[0] == pytest.approx(full[0][SPLIT:], rel=1e-5)


def test_two_to_four_and_hpz_rebuilt_after_load(tmp_path):
    full = run_ranks(train, 4, None, "full", 2, 2)[0]
    run_ranks(train, 2, str(tmp_path), "first", 1, 1)
    resumed = run_ranks(train, 4, str(tmp_path), "resume", 2, 2)[0]
    # The first iteration after the load already equals the uninterrupted hpZ run: the
    # secondary shards were rebuilt from the loaded weights, not reused stale.
    assert resumed[0] == pytest.approx(full[0][SPLIT:], rel=1e-5)


def test_failed_save_keeps_latest_valid(tmp_path):
    run_ranks(train, 2, str(tmp_path), "first", 1, 1)
    assert (tmp_path / "latest").read_text() == "iter_3"
    messages = run_ranks(train, 2, str(tmp_path), "first", 1, 1, 1)
    for message in messages:  # every rank raised, naming the failure; nobody hung
        assert "cannot write checkpoint shard" in message
    assert (tmp_path / "latest").read_text() == "iter_3"
    assert not (tmp_path / "iter_again").exists()
    run_ranks(train, 2, str(tmp_path), "resume", 1, 1)  # the previous one still loads


def test_load_errors(tmp_path):
    from zeropp.checkpoints import checkpoint

    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        checkpoint.read_latest(tmp_path / "nope")
    with pytest.raises(checkpoint.CheckpointError, match="has no 'latest' file"):
        checkpoint.read_latest(tmp_path)
    os.makedirs(tmp_path / "x")
    (tmp_path / "latest").write_text("gone")
    with pytest.raises(checkpoint.CheckpointError, match="names 'gone'"):
        checkpoint.read_latest(tmp_path)


def mismatched(rank, world, ckpt):
    from zeropp.checkpoints import checkpoint
    from zeropp.deepspeed_api.initialize import build_engine

    engine = build_engine(toy_model(hidden=45), lr=1e-3)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"layers.0.up.weight.*checkpoint shape \[43, 17\] != model shape \[45, 17\]"):
        engine.load_checkpoint(ckpt)
    return True


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    run_ranks(train, 1, str(tmp_path), "first", 1, 1)
    assert run_ranks(mismatched, 1, str(tmp_path)) == [True]
    consolidated = __import__("zeropp.checkpoints.checkpoint", fromlist=["x"]).consolidate(tmp_path)
    assert consolidated["layers.0.up.weight"].shape == (43, 17)


def rng_after_load(rank, world, ckpt):
    from zeropp.checkpoints import checkpoint
    from zeropp.deepspeed_api.initialize import build_engine

    engine = build_engine(toy_model(hidden=43), lr=3e-3)
    tokens = toy_batches(1, 1, 8)[0, 0, rank * 4:(rank + 1) * 4]
    engine.backward(toy_loss(engine(tokens), tokens))
    engine.step()
    at_save = torch.get_rng_state()
    engine.save_checkpoint(ckpt, tag="t")
    torch.rand(7)  # the script's own draws after the save
    before_load = torch.get_rng_state()
    engine.load_checkpoint(ckpt, tag="t")
    untouched = torch.equal(torch.get_rng_state(), before_load)
    kept = torch.equal(engine.loaded_rng_state["torch"], at_save)
    restored = checkpoint.restore_rng_state(engine.loaded_rng_state)
    return untouched, kept, restored and torch.equal(torch.get_rng_state(), at_save)


def test_load_checkpoint_leaves_the_random_streams_alone(tmp_path):
    """As DeepSpeed's load_checkpoint: the global RNG is the script's; each rank's saved
    streams are there to restore (the Megatron program does, unless --no-load-rng)."""
    for untouched, kept, restored in run_ranks(rng_after_load, 2, str(tmp_path / "ckpt")):
        assert untouched and kept and restored

