"""ZeRO++ inside the engine: each component against ZeRO-3, and the bytes against theory."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model, train_data_parallel

LR = 3e-3


def train(rank, world, per_node, quant, steps, micro, checkpoint, dtype_name, model_kwargs,
          sharding=None):
    from zeropp.deepspeed_api.initialize import QuantizationOptions, build_engine, make_loss_scaler
    from zeropp.sharded_model import ShardingOptions

    dtype = getattr(torch, dtype_name)
    model = toy_model(checkpoint=checkpoint, **model_kwargs)
    engine = build_engine(
        model, lr=LR, weight_decay=0.01, gradient_accumulation_steps=micro, gradient_clipping=1.0,
        dtype=dtype, loss_scaler=make_loss_scaler(dtype == torch.float16),
        ranks_per_node=per_node, quantization=QuantizationOptions(**quant),
        sharding=ShardingOptions(**{"persistence_threshold": 0, "prefetch_bucket_numel": 4000,
                                    **(sharding or {})}),
    )
    vocab = model_kwargs.get("vocab", 257)
    bytes_per_step = []
    losses = train_data_parallel(engine, rank, world, toy_batches(steps, micro, 8, vocab=vocab),
                                 steps, micro,
                                 after_step=lambda _: bytes_per_step.append(
                                     engine.comm_bytes(reset=True)))
    layouts = [(u.layout.padded_numel, u is engine.sharded.root) for u in engine.sharded.units]
    weights = engine.full_state_dict()
    return losses, bytes_per_step, layouts, weights


def run(per_node, quant, steps=5, micro=2, checkpoint=False, dtype="float32", sharding=None,
        **model_kwargs):
    return run_ranks(train, 4, per_node, quant, steps, micro, checkpoint, dtype, model_kwargs,
                     sharding)


@pytest.mark.parametrize("dtype,checkpoint,sharding", [
    ("float32", False, None),
    ("bfloat16", True, {"max_unit_numel": 20_000, "max_live_numel": 0}),
    ("float16", "reentrant", {"max_unit_numel": 20_000}),
], ids=["fp32", "bf16-checkpoint-subblock-release", "fp16-reentrant-subblock"])
def test_int8_secondary_is_the_forward_weights(dtype, checkpoint, sharding):
    """[Note: int8 secondary]: backward computes with exactly the weights the 16-bit secondary
    held (qwZ's dequantized forward weights), so training is bit for bit the same, while the
    intra-node backward gather moves the int8 payload instead of 16/32-bit values."""
    quant = {"quantized_weights": True, "hpz_size": 2}
    sizes = dict(vocab=128, width=64, hidden=256, layers=2)  # 33K-element blocks
    sixteen = run(2, {**quant, "quantized_secondary": False}, steps=3, checkpoint=checkpoint,
                  dtype=dtype, sharding=sharding, **sizes)
    int8 = run(2, quant, steps=3, checkpoint=checkpoint, dtype=dtype, sharding=sharding, **sizes)
    for exact, quantized in zip(sixteen, int8, strict=True):
        assert quantized[0] == exact[0]  # losses, bit for bit
        for name, value in exact[3].items():
            assert torch.equal(quantized[3][name], value), name
    element = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    for exact_bytes, int8_bytes in zip(sixteen[0][1], int8[0][1], strict=True):
        exact_gather = exact_bytes["backward_all_gather"]
        int8_gather = int8_bytes["backward_all_gather"]
        assert exact_gather["inter_node"] == int8_gather["inter_node"] == 0
        # one byte per element, a 4-byte scale per 256-element block, codes padded to blocks
        ratio = int8_gather["intra_node"] / exact_gather["intra_node"]
        assert 1 / element < ratio < 1.15 / element, ratio


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_hpz_alone_changes_nothing(checkpoint):
    zero3 = run(2, {}, checkpoint=checkpoint)
    hpz = run(2, {"hpz_size": 2}, checkpoint=checkpoint)
    for a, b in zip(zero3, hpz, strict=True):
        assert b[0] == pytest.approx(a[0], rel=1e-6, abs=0)
    # and the backward gather never left the node
    for step_bytes in hpz[0][1]:
        assert step_bytes["backward_all_gather"]["inter_node"] == 0
        assert step_bytes["backward_all_gather"]["intra_node"] > 0


@pytest.mark.parametrize("per_node", [2, 4, 1], ids=["2x2", "1x4", "4x1"])
def test_all_three_track_zero3(per_node):
    zero3 = run(per_node, {}, steps=8)
    hpz = per_node if per_node > 1 else 1
    zeropp = run(per_node, {"quantized_weights": True, "hpz_size": hpz,
                            "quantized_gradients": True}, steps=8)
    base, quant = zero3[0][0], zeropp[0][0]
    assert quant != base  # quantization really happened
    assert quant[-1] < quant[0]  # and it still learns
    for a, b in zip(base, quant, strict=True):
        assert abs(a - b) / a < 0.02


def _theory(layouts, world, per_node, quant, elem_bytes):
    """Inter-node bytes per step by phase for the ZeRO-3 / ZeRO++ data paths (one rank)."""
    from zeropp.kernels import quantized_nbytes

    nodes = world // per_node
    fwd = bwd = grad = 0
    for padded, is_root in layouts:
        shard = padded // world
        if quant.get("quantized_weights"):
            fwd += quantized_nbytes(shard, 8, 256) * (world - 1)
        else:
            fwd += shard * elem_bytes * (world - 1)
        if not is_root and quant.get("hpz_size", 1) == 1:  # the root stays gathered for backward
            bwd += (quantized_nbytes(shard, 8, 256) if quant.get("quantized_weights")
                    else shard * elem_bytes) * (world - 1)
        if quant.get("quantized_gradients"):
            grad += quantized_nbytes(nodes * shard, 4, 256) * (nodes - 1) // nodes * 2  # micro=2
        else:
            grad += padded * elem_bytes * (world - 1) // world * 2
    return {"forward_all_gather": fwd * 2, "backward_all_gather": bwd * 2, "gradient_reduce": grad}


def test_inter_node_bytes_match_theory_and_ratio():
    sizes = dict(vocab=128, width=64, hidden=256, layers=4)
    quant = {"quantized_weights": True, "hpz_size": 2, "quantized_gradients": True}
    zero3 = run(2, {}, steps=2, dtype="float16", **sizes)
    zeropp = run(2, quant, steps=2, dtype="float16", **sizes)
    totals = {}
    for name, result, q in (("zero3", zero3, {}), ("zeropp", zeropp, quant)):
        losses, per_step, layouts, _ = result[0]
        measured = per_step[-1]
        theory = _theory(layouts, 4, 2, q, 2)
        for phase, expected in theory.items():
            got = measured[phase]["inter_node"]
            assert got == pytest.approx(expected, rel=0.02, abs=0), (name, phase, got, expected)
        totals[name] = sum(measured[p]["inter_node"] for p in theory)
    assert totals["zero3"] / totals["zeropp"] >= 4.0, totals


def half_precision(rank, world, dtype_name, poison_step):
    from zeropp.deepspeed_api.initialize import QuantizationOptions, build_engine
    from zeropp.loss_scaler import DynamicLossScaler, LossScaler
    from zeropp.sharded_model import ShardingOptions

    dtype = getattr(torch, dtype_name)
    scaler = DynamicLossScaler(initial_scale_power=8, hysteresis=1)
    engine = build_engine(
        toy_model(), lr=3e-3, dtype=dtype, ranks_per_node=2,
        loss_scaler=scaler if dtype == torch.float16 else LossScaler(1.0),
        quantization=QuantizationOptions(quantized_weights=True, hpz_size=2,
                                         quantized_gradients=True),
        sharding=ShardingOptions(persistence_threshold=0),
    )
    data = toy_batches(6, 1, 8)
    losses, scales, skipped = [], [], []
    for step in range(6):
        tokens = data[0, 0, rank * 2:(rank + 1) * 2]  # one batch, so the loss must fall
        loss = toy_loss(engine(tokens), tokens)
        if step == poison_step and rank == 1:  # one rank overflows
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        scales.append(engine.loss_scale)
        skipped.append(engine.last_step_overflowed)
    return losses, scales, skipped


def test_bf16_and_fp16_overflow_with_all_three():
    for losses, _, skipped in run_ranks(half_precision, 4, "bfloat16", -1):
        assert not any(skipped) and losses[-1] < losses[0]
    results = run_ranks(half_precision, 4, "float16", 2)
    for losses, scales, skipped in results:
        # every rank skips the same step and halves the scale alike, then trains on
        assert skipped == [False, False, True, False, False, False]
        assert scales == [256.0, 256.0, 128.0, 128.0, 128.0, 128.0]
        assert losses[-1] < losses[0]
