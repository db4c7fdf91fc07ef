"""Gradient reduction off the tutorial's path: qgZ error feedback through overflows, loss-scale
changes and resumes; gradient pre-division; communication_data_type."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model
from zeropp.comm.error_feedback import ErrorFeedback

QGZ = {"stage": 3, "zero_quantized_gradients": True, "zero_quantization_block_size": 32,
       "stage3_param_persistence_threshold": 0}


def qgz_config(fp16=False, error_feedback=None, qgz=True, **top):
    zero = {**QGZ, "zero_quantized_gradients": qgz}
    if error_feedback == "plain":
        zero["zero_quantized_gradients_error_feedback"] = True
    elif error_feedback == "loco":
        zero["zeropp_loco_param"] = {"err_beta": 0.8, "reset_T": 3}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
              "zero_optimization": zero, **top}
    if fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    return config


def build(config, ranks_per_node=2, model=None):
    import zeropp

    engine, *_ = zeropp.initialize(model or toy_model(), config=config,
                                   ranks_per_node=ranks_per_node)
    return engine


def train_steps(engine, rank, world, steps, first_step=0, poison_steps=()):
    data = toy_batches(first_step + steps, 1, 2 * world)
    losses, skipped = [], []
    for step in range(first_step, first_step + steps):
        tokens = data[step, 0, rank * 2:(rank + 1) * 2]
        loss = toy_loss(engine(tokens), tokens)
        if step in poison_steps and rank == 1:  # one rank's gradients overflow
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item())
        skipped.append(engine.last_step_overflowed)
    return losses, skipped


# ---- error feedback ------------------------------------------------------------------------
def overflow_run(rank, world, error_feedback):
    engine = build(qgz_config(fp16=True, error_feedback=error_feedback))
    _, skipped = train_steps(engine, rank, world, 6, poison_steps={2})
    engine.close()
    return skipped, engine.loss_scale


@pytest.mark.parametrize("error_feedback", ["plain", "loco"])
def test_error_feedback_recovers_from_an_overflow_like_plain_qgz(error_feedback):
    """A non-finite step resets the errors: the steps after it are not skipped."""
    plain = run_ranks(overflow_run, 4, None)
    with_feedback = run_ranks(overflow_run, 4, error_feedback)
    assert plain[0][0] == [False, False, True, False, False, False]
    assert with_feedback == plain  # the same skipped steps and final loss scale


def resume_run(rank, world, save_dir, keep_errors, inter_node_bits=None):
    config = qgz_config(error_feedback="loco")
    config["zero_optimization"]["zero_quantized_gradients_inter_node_bits"] = inter_node_bits
    engine = build(config)
    train_steps(engine, rank, world, 2)
    engine.save_checkpoint(save_dir, tag="step2")
    losses, _ = train_steps(engine, rank, world, 3, first_step=2)
    state = engine.full_state_dict()
    engine.close()

    resumed = build(config)
    resumed.load_checkpoint(save_dir, tag="step2")
    if not keep_errors:  # the control: what resuming without the saved errors gives
        resumed.sharded.error_feedback.reset()
    resumed_losses, _ = train_steps(resumed, rank, world, 3, first_step=2)
    resumed_state = resumed.full_state_dict()
    resumed.close()
    same = losses == resumed_losses and all(
        torch.equal(state[name], resumed_state[name]) for name in state)
    return same


@pytest.mark.parametrize("inter_node_bits", [None, 2], ids=["int4", "int2-across-nodes"])
def test_resume_with_error_feedback_is_bit_exact(tmp_path, inter_node_bits):
    """Errors are checkpointed (and reset_T's step count with them)."""
    assert all(run_ranks(resume_run, 4, str(tmp_path / "a"), True, inter_node_bits))
    # Without them the continuation differs: the check above can fail.
    assert not any(run_ranks(resume_run, 4, str(tmp_path / "b"), False, inter_node_bits))


def module_only_run(rank, world, save_dir):
    """Errors kept after two steps, a save, then a module-only load into the same engine."""
    engine = build(qgz_config(error_feedback="plain"))
    train_steps(engine, rank, world, 2)
    had_errors = bool(engine.sharded.error_feedback.errors)
    engine.save_checkpoint(save_dir, tag="step2")
    train_steps(engine, rank, world, 1, first_step=2)
    engine.load_checkpoint(save_dir, tag="step2", load_module_only=True)
    left = dict(engine.sharded.error_feedback.errors)
    engine.close()
    return had_errors, left


def test_a_module_only_load_drops_the_error_feedback_residuals(tmp_path):
    """The residuals go with the optimizer state of the run that made them (DeepSpeed's
    load_module_only restores the weights alone): they were restored anyway."""
    for had_errors, left in run_ranks(module_only_run, 4, str(tmp_path)):
        assert had_errors and left == {}


def test_weight_delta_bases_load_in_the_working_dtype():
    """A checkpoint of an fp32 run resumed in bf16: the bases the hpZ gather sends must be
    bf16 too (they kept their saved dtype, and the gather failed)."""
    from zeropp.comm.delta import DeltaWeightGather
    from zeropp.topology import Topology

    gather = DeltaWeightGather(Topology(world_size=4, ranks_per_node=2, rank=0, hpz_size=2))
    saved = {"unit": {"values": torch.randn(2, 8, dtype=torch.float32), "current": True}}
    gather.load_state_dict(saved, torch.device("cpu"), torch.bfloat16)
    assert gather.bases["unit"].values.dtype == torch.bfloat16
    assert torch.equal(gather.bases["unit"].values, saved["unit"]["values"].bfloat16())


def test_errors_are_stored_unscaled_in_int4():
    feedback = ErrorFeedback(block_size=16)
    send = torch.linspace(-1, 1, 64)
    feedback.gradient_scale = 1024.0  # fp16 loss scale
    quantized = torch.round(send * 1024.0 * 4) / 4  # what a coarse quantizer keeps
    feedback.record("bucket", send * 1024.0, quantized)
    payload = feedback.errors["bucket"]
    assert payload.dtype == torch.uint8
    assert payload.numel() == ErrorFeedback.nbytes(64, 16) == 64 // 2 + 4 * 4  # codes, scales
    # After the scale halves, the error added back is in the new scale's units.
    feedback.gradient_scale = 512.0
    added = feedback.compensate("bucket", torch.zeros(64))
    expected = (send * 1024.0 - quantized) / 1024.0 * 512.0
    # int4 keeps 7 levels each side of zero: within half a level of the block's largest.
    torch.testing.assert_close(added, expected, atol=expected.abs().max().item() / 14, rtol=0)


def test_loco_moving_average_and_resets():
    feedback = ErrorFeedback(block_size=8, beta=0.5, reset_interval=2)
    first, second = torch.full((8,), 0.4), torch.full((8,), -0.2)
    feedback.record("k", first, torch.zeros(8))
    torch.testing.assert_close(feedback.compensate("k", torch.zeros(8)), first * 0.5,
                               atol=1e-2, rtol=0)
    feedback.record("k", second, torch.zeros(8))
    torch.testing.assert_close(feedback.compensate("k", torch.zeros(8)),
                               0.5 * (first * 0.5) + 0.5 * second, atol=1e-2, rtol=0)
    feedback.after_step(skipped=False)
    assert feedback.errors
    feedback.after_step(skipped=False)  # reset_T = 2 applied steps
    assert not feedback.errors
    feedback.record("k", first, torch.zeros(8))
    feedback.after_step(skipped=True)  # a non-finite step
    assert not feedback.errors


# ---- pre-division and communication dtype -------------------------------------------------
class Scalars(nn.Module):
    """One tiny root unit: its gradient is exactly the coefficient vector."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8))

    def forward(self, coefficients):
        return (self.weight * coefficients).sum()


def headroom_run(rank, world, top):
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"params": {"lr": 1e-3}},
              "fp16": {"enabled": True, "loss_scale": 2.0 ** 15},
              "zero_optimization": {"stage": 3}, **top}
    engine = build(config, ranks_per_node=world, model=Scalars())
    # Each rank's scaled gradient is 1.5 * 2**15 = 49152: fine in fp16 (max 65504), but
    # the sum over two ranks is not.
    engine.backward(engine(torch.full((8,), 1.5, dtype=torch.float16)))
    engine.step()
    engine.close()
    return engine.last_step_overflowed, engine.get_global_grad_norm()


def test_gradients_are_predivided_before_the_sum():
    default = run_ranks(headroom_run, 2, {})
    summed_first = run_ranks(headroom_run, 2, {"gradient_predivide_factor": 1.0})
    prescaled = run_ranks(headroom_run, 2, {"prescale_gradients": True})
    assert [r[0] for r in summed_first] == [True, True]  # DeepSpeed's stage 3 would not overflow
    for overflowed, norm in default + prescaled:
        assert not overflowed
        assert norm == pytest.approx(1.5 * 8 ** 0.5)


def comm_dtype_run(rank, world, top):
    engine = build(qgz_config(qgz=False, **top), ranks_per_node=world)
    losses, _ = train_steps(engine, rank, world, 3)
    engine.close()
    return losses, engine.comm_bytes()["gradient_reduce"]


def test_communication_data_type_sets_the_reduction_dtype():
    exact = run_ranks(comm_dtype_run, 2, {})
    as_bf16 = run_ranks(comm_dtype_run, 2, {"communication_data_type": "bf16"})
    as_fp32 = run_ranks(comm_dtype_run, 2, {"communication_data_type": "fp32"})
    nbytes = lambda result: sum(result[0][1].values())  # noqa: E731
    assert nbytes(as_bf16) * 2 == nbytes(exact) == nbytes(as_fp32)
    assert as_fp32[0][0] == exact[0][0]  # fp32 model: fp32 is the working dtype already
    assert as_bf16[0][0] != exact[0][0]  # rounded to bf16 on the wire
    assert as_bf16[0][0] == pytest.approx(exact[0][0], rel=1e-2)
