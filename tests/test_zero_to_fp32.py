"""``zeropp.zero_to_fp32``: DeepSpeed's ``deepspeed.utils.zero_to_fp32`` functions on this
engine's checkpoints (2 gloo ranks, ZeRO-3 in bf16): fp32 values whose bf16 rounding is the
engine's working weights."""

from __future__ import annotations

import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model


def train_and_save(rank, world, save_dir):
    import zeropp

    model = toy_model()
    config = {"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3}}
    engine, _, _, _ = zeropp.initialize(model, optimizer=torch.optim.AdamW(
        model.parameters(), lr=1e-2), config=config)
    tokens = toy_batches(1, 1, 3 * world)[0, 0, rank * 3:(rank + 1) * 3]
    engine.backward(toy_loss(engine(tokens), tokens))
    engine.step()
    engine.save_checkpoint(save_dir, tag="checkpoint")
    working = engine.full_state_dict()
    engine.close()
    return working


def test_fp32_state_dict_and_converted_file_hold_the_masters(tmp_path):
    from zeropp.checkpoints.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    working, _ = run_ranks(train_and_save, 2, str(tmp_path / "ckpt"))
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", tag="checkpoint")
    assert sorted(state) == sorted(working)
    for name, value in state.items():
        assert value.dtype == torch.float32 and value.shape == working[name].shape, name
        # the bf16 working weights are the fp32 masters rounded, and the masters hold more
        assert torch.equal(value.to(torch.bfloat16), working[name]), name
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in state.values())
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out")
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[name], state[name]) for name in state)
    model = load_state_dict_from_zero_checkpoint(toy_model(seed=5), tmp_path / "ckpt")
    assert all(torch.equal(p, state[n]) for n, p in model.state_dict().items() if n in state)


def test_a_shard_limit_splits_the_file_with_an_index(tmp_path):
    import json

    from zeropp.checkpoints.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    run_ranks(train_and_save, 2, str(tmp_path / "ckpt"))
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out",
                                               max_shard_size="20KB")
    index = json.loads((tmp_path / "out" / "pytorch_model.bin.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1
    merged = {}
    for name in files:
        merged.update(torch.load(tmp_path / "out" / name, weights_only=True))
    assert merged.keys() == index["weight_map"].keys()
