"""The step's outcome on the device ([Note: step outcome on the device] in zeropp/engine.py):
with a fixed loss scale and torch's fused AdamW, a step reads nothing back to the host, takes
the same update as the host-decided step, and skips a non-finite one on the device
(2 ranks, gloo, fp32)."""

from __future__ import annotations

import math

import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

LR = 3e-3
CLIP = 0.05  # small enough that every step here is clipped


def _engine(fused: bool):
    import zeropp

    model = toy_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1,
                                  **({"fused": True} if fused else {"foreach": True}))
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
              "gradient_clipping": CLIP, "zero_optimization": {"stage": 3}}
    engine, _, _, _ = zeropp.initialize(model, optimizer=optimizer, config=config)
    return engine


def _train(engine, batches, count_reads: bool = False) -> int:
    """Train on ``batches``; with ``count_reads``, the number of scalar reads by the host
    (``item``, ``bool``, ``float`` of a tensor: what syncs a GPU's host)."""
    from zeropp.simulation import OpCounter

    reads = 0
    for step in batches:
        for tokens in step:
            if count_reads:
                with OpCounter() as counter:
                    engine.backward(toy_loss(engine(tokens), tokens))
                    engine.step()
                reads += counter.by_name().get("aten._local_scalar_dense.default", 0)
            else:
                engine.backward(toy_loss(engine(tokens), tokens))
                engine.step()
    return reads


def deferred_against_host(rank, world):
    data = toy_batches(3, 2, 3 * world)[:, :, rank * 3:(rank + 1) * 3]
    deferred, host = _engine(fused=True), _engine(fused=False)
    out = {"modes": (deferred.defers_step_outcome, host.defers_step_outcome),
           "reads": _train(deferred, data, count_reads=True)}
    out["host_reads"] = _train(host, data, count_reads=True)
    out["norms"] = (deferred.get_global_grad_norm(), host.get_global_grad_norm())
    out["skipped"] = (deferred.skipped_steps, host.skipped_steps)
    out["applied"] = (deferred.was_step_applied(), host.was_step_applied())
    a, b = deferred.full_state_dict(), host.full_state_dict()
    out["largest_difference"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    out["moved"] = max(float((a[k] - toy_model().state_dict()[k]).abs().max()) for k in a)
    deferred.close()
    host.close()
    return out


def test_the_device_decided_step_reads_nothing_and_matches_the_host_decided_one():
    for result in run_ranks(deferred_against_host, 2):
        assert result["modes"] == (True, False)
        assert result["reads"] == 0  # 3 steps x 2 micro-batches, no host read of a value
        # the host-decided step reads its norm each step (and torch's foreach AdamW its
        # step counts, host tensors: also scalar reads here, though no sync on a GPU)
        assert result["host_reads"] >= 3
        deferred_norm, host_norm = result["norms"]
        assert math.isclose(deferred_norm, host_norm, rel_tol=1e-5) and host_norm > CLIP
        assert result["skipped"] == (0, 0) and result["applied"] == (True, True)
        assert result["moved"] > 1e-3  # the updates were applied
        assert result["largest_difference"] < 1e-6  # fused vs foreach AdamW, same clip


def nonfinite_step(rank, world):
    data = toy_batches(2, 2, 3 * world)[:, :, rank * 3:(rank + 1) * 3]
    engine = _engine(fused=True)
    _train(engine, data[:1])
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    steps_before = [float(s["step"]) for s in engine.optimizer.state.values()]
    for index, tokens in enumerate(data[1]):
        loss = toy_loss(engine(tokens), tokens)
        if index == 1 and rank == 0:  # one rank's gradient poisoned: both must skip
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
    out = {"applied": engine.was_step_applied(), "skipped": engine.skipped_steps,
           "norm": engine.get_global_grad_norm(),
           "unchanged": all(torch.equal(before[k], v)
                            for k, v in engine.full_state_dict().items()),
           "steps": (steps_before, [float(s["step"]) for s in engine.optimizer.state.values()])}
    _train(engine, data[:1])  # the next step applies again
    out["after"] = (engine.was_step_applied(), engine.skipped_steps)
    engine.close()
    return out


def test_a_nonfinite_step_is_skipped_on_the_device():
    for result in run_ranks(nonfinite_step, 2):
        assert result["applied"] is False and result["skipped"] == 1
        assert math.isnan(result["norm"])
        assert result["unchanged"]  # weights untouched
        before, after = result["steps"]
        assert before == after == [1.0] * len(before)  # Adam's step counts not advanced
        assert result["after"] == (True, 1)


def test_the_log_interval_counts_device_decided_skips_as_host_decided_ones():
    """The training loop's interval totals: the same mean loss (skipped iterations left out)
    and the same skipped count whether each step's outcome came as a bool or a device flag."""
    from megatron_lite.training import IntervalTotals

    def totals(losses, applied, on_device):
        interval = IntervalTotals()
        for loss, ok in zip(losses, applied, strict=True):
            interval.add_iteration(torch.tensor(loss), torch.tensor(ok) if on_device else ok)
        interval.resolve()
        return interval.skipped, float(interval.local_mean_loss())

    some = ([2.0, float("nan"), 3.0, 4.0], [True, False, True, True])
    assert totals(*some, on_device=True) == totals(*some, on_device=False) == (1, 3.0)
    every = ([7.0, 5.0], [False, False])  # all skipped: the skipped losses' mean is logged
    assert totals(*every, on_device=True) == totals(*every, on_device=False) == (2, 6.0)
