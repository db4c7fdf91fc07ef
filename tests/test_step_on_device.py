"""The step's outcome on the device ([Note: step outcome on the device] in zeropp/engine.py):
with torch's fused AdamW, a step reads nothing back to the host, takes the same update as the
host-decided step, and skips a non-finite one on the device (2 ranks, gloo, fp32); with fp16,
the dynamic loss scaler's overflow skips and scale changes are the host-decided ones, and the
training loop's lr schedule follows the device's count of applied updates."""

from __future__ import annotations

import math

import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

LR = 3e-3
CLIP = 0.05  # small enough that every step here is clipped


def _engine(fused: bool, fp16: dict | None = None):
    import zeropp

    model = toy_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1,
                                  **({"fused": True} if fused else {"foreach": True}))
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
              "gradient_clipping": CLIP, "zero_optimization": {"stage": 3}}
    if fp16 is not None:
        config["fp16"] = {"enabled": True, **fp16}
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


# High enough that some steps overflow in fp16 (hysteresis 2: an overflow first uses up the
# hysteresis, the next halves the scale) and a short window, so it also doubles.
FP16_SCALER = {"initial_scale_power": 15, "loss_scale_window": 2, "hysteresis": 2}


def fp16_deferred_against_host(rank, world):
    data = toy_batches(8, 2, 3 * world)[:, :, rank * 3:(rank + 1) * 3]
    deferred, host = _engine(True, FP16_SCALER), _engine(False, FP16_SCALER)
    out = {"modes": (deferred.defers_step_outcome, host.defers_step_outcome), "trace": []}
    reads = 0
    for step in data:
        reads += _train(deferred, [step], count_reads=True)
        _train(host, [step])
        out["trace"].append([(engine.loss_scale, engine.skipped_steps, engine.was_step_applied())
                             for engine in (deferred, host)])
    out["reads"] = reads
    a, b = deferred.full_state_dict(), host.full_state_dict()
    out["largest_difference"] = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    out["saved_scaler"] = (deferred.loss_scaler.state_dict(), host.loss_scaler.state_dict())
    deferred.close()
    host.close()
    return out


def test_fp16_overflow_skips_and_loss_scale_decided_on_the_device_match_the_host():
    for result in run_ranks(fp16_deferred_against_host, 2):
        assert result["modes"] == (True, False)
        assert result["reads"] == 0  # 8 steps, overflows among them, no host read
        for deferred, host in result["trace"]:
            assert deferred == host  # scale, skipped count, applied: step by step
        scales = [host[0] for _, host in result["trace"]]
        skipped = result["trace"][-1][1][1]
        pairs = list(zip(scales, scales[1:], strict=False))
        assert skipped >= 2 and any(b < a for a, b in pairs) and any(b > a for a, b in pairs)
        deferred_state, host_state = result["saved_scaler"]
        assert deferred_state == host_state
        assert result["largest_difference"] < 1e-3  # fp16 weights: a rounding apart at most


def test_the_device_loss_scaler_follows_deepspeeds_rules():
    """The same random overflow sequence through the host's and the device's scaler, for
    each hysteresis / window / floor rule: identical state after every step."""
    import random

    from zeropp.loss_scaler import DynamicLossScaler

    settings = [{}, {"hysteresis": 1}, {"hysteresis": 3, "consecutive_hysteresis": True,
                                        "window": 3}, {"window": 2, "min_scale": 256.0}]
    for kwargs in settings:
        host = DynamicLossScaler(initial_scale_power=12, **kwargs)
        device = DynamicLossScaler(initial_scale_power=12, **kwargs)
        device.scale_on(torch.device("cpu"))
        draw = random.Random(1)
        for _ in range(200):
            overflow = draw.random() < 0.3
            host.update(overflow)
            device.update(torch.tensor(overflow))
            assert device.state_dict() == host.state_dict(), kwargs


def test_the_megatron_schedule_follows_a_device_count_of_applied_updates():
    """``AnnealingLR.step_on_device``: the lr each param group gets from a device count is the
    one ``step`` gives for that count, also past the decay and for a group's own bounds."""
    from zeropp.deepspeed_api.lr_schedules import AnnealingLR

    groups = [{"lr": 0.0}, {"lr": 0.0, "max_lr": 1e-2, "min_lr": 1e-4}]

    class Optimizer:
        param_groups = groups

    for style in ("cosine", "linear", "constant"):
        schedule = AnnealingLR(Optimizer(), 3e-4, 3e-5, warmup_iters=3, decay_iters=11,
                               decay_style=style)
        for count in (0, 2, 3, 7, 11, 12, 40):
            schedule.step(count)
            expected = [group["lr"] for group in groups]
            schedule.step_on_device(torch.tensor(count))
            assert [float(group["lr"]) for group in groups] == expected, (style, count)


def _logged(text: str) -> list[dict[str, str]]:
    """The fields of each training log line (``name: value`` between bars)."""
    rows = []
    for line in text.splitlines():
        if line.lstrip().startswith("iteration"):
            fields = [part.split(":", 1) for part in line.split("|") if ":" in part]
            rows.append({name.strip(): value.strip() for name, value in fields})
    return rows


def test_fp16_training_loop_with_device_decided_skips_logs_what_the_host_decided_one_does(
        tmp_path, monkeypatch, capsys):
    """The Megatron program in fp16 with a loss scale high enough to overflow: with the step
    decided on the device (torch's fused AdamW, as on CUDA) the log lines (losses, lr, loss
    scale, skipped iterations) and the saved progress equal the host-decided run's: the
    schedule did not advance on the skipped iterations.

    A 512-token vocabulary (NullTokenizer) rather than GPT-2's 50,257: what is tested is the
    step's verdict, and half-precision matmuls of the tied output layer over GPT-2's vocabulary
    took 25 of this test's 29 s on CPU; the loss scale still overflows in each log window."""
    import torch.distributed as dist

    import zeropp.optimizer
    from megatron_lite.pretrain_gpt import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
            "--lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 --lr-decay-iters 10 "
            "--lr-decay-style cosine --fp16 --initial-loss-scale 1048576 --loss-scale-window 3 "
            "--hysteresis 1 --mock-data --train-iters 15 --log-interval 5 --eval-iters 0 "
            "--num-workers 0 --zero-stage 3 --tokenizer-type NullTokenizer --vocab-size 512").split()
    runs = {}
    settings = zeropp.optimizer._multi_tensor_settings
    for mode in ("host", "device"):
        if mode == "device":  # the implementation torch picks on CUDA
            monkeypatch.setattr(zeropp.optimizer, "_multi_tensor_settings",
                                lambda cls, defaults, device, **_: {"fused": True})
        save = tmp_path / mode
        assert main([*argv, "--save", str(save), "--save-interval", "15"]) == 0
        if dist.is_initialized():
            dist.destroy_process_group()
        saved = torch.load(next(save.rglob("*.pt")), weights_only=False)  # one rank: one file
        runs[mode] = (_logged(capsys.readouterr().out), saved["client_state"])
    monkeypatch.setattr(zeropp.optimizer, "_multi_tensor_settings", settings)
    (host_rows, host_saved), (device_rows, device_saved) = runs["host"], runs["device"]
    assert len(host_rows) == len(device_rows) == 3
    exact = ("learning rate", "loss scale", "number of skipped iterations", "consumed samples")
    for host, device in zip(host_rows, device_rows, strict=True):
        assert [device[k] for k in exact] == [host[k] for k in exact]
        # fused and foreach AdamW round differently in the last bits
        assert math.isclose(float(device["lm loss"]), float(host["lm loss"]), rel_tol=1e-5)
    assert int(host_rows[0]["number of skipped iterations"]) > 0  # overflows happened
    assert float(host_rows[-1]["learning rate"]) > 0
    for key in ("iteration", "applied_updates", "skipped_iterations", "lr_scheduler"):
        assert device_saved[key] == host_saved[key], key
    assert host_saved["applied_updates"] < host_saved["iteration"]
