"""DeepSpeed's engine API on this engine, with DeepSpeedEngine's meanings (2 ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

LR = 3e-3


def _engine(stage: int, accumulation: int = 2, scheduler: bool = False, **extra):
    import zeropp

    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": accumulation,
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}, **extra}
    if scheduler:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4,
                                                              "warmup_max_lr": LR}}
    engine, _, _, _ = zeropp.initialize(toy_model(), config=config)
    return engine


def _micro(engine, tokens):
    engine.backward(toy_loss(engine(tokens), tokens))
    return engine.step()


def facts(rank, world):
    engine = _engine(stage=3, scheduler=True)
    data = toy_batches(2, 2, 3 * world)
    mine = data[:, :, rank * 3:(rank + 1) * 3]
    out = {
        "sizes": (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
                  engine.train_batch_size(), engine.world_size, engine.dp_world_size),
        "local_rank": engine.local_rank,
        "stage": engine.zero_optimization_stage(),
        "precision": (engine.fp16_enabled(), engine.bfloat16_enabled()),
        "parameters": (sum(1 for _ in engine.parameters()),
                       sorted(n for n, _ in engine.named_parameters())),
        "model_names": sorted(n for n, _ in toy_model().named_parameters()),
    }
    applied = [_micro(engine, mine[0, 0])]
    out["after_first"] = (engine.was_step_applied(), engine.global_samples)
    applied.append(_micro(engine, mine[0, 1]))
    out["after_boundary"] = (engine.was_step_applied(), engine.global_samples)
    out["applied"] = applied
    out["lr"] = (engine.get_lr(), engine.lr_scheduler.get_last_lr())
    engine.eval()
    out["training"] = [engine.training]
    engine.train()
    out["training"].append(engine.training)
    out["state_dict"] = sorted(engine.state_dict())
    engine.close()
    return out


def test_engine_answers_deepspeeds_questions():
    world = 2
    for rank, out in enumerate(run_ranks(facts, world)):
        assert out["sizes"] == (3, 2, 3 * 2 * world, world, world)
        assert out["local_rank"] == rank
        assert out["stage"] == 3
        assert out["precision"] == (False, False)
        assert out["parameters"][1] == out["model_names"]
        assert out["parameters"][0] == len(out["model_names"])  # the tied head counted once
        assert out["after_first"] == (False, 0)  # not a boundary: nothing applied
        assert out["after_boundary"] == (True, 3 * 2 * world)
        assert out["applied"] == [False, True]
        engine_lr, scheduler_lr = out["lr"]
        assert engine_lr == scheduler_lr and 0 <= engine_lr[0] < LR  # warming up (DeepSpeed: iteration 0 is the floor)
        assert out["training"] == [False, True]
        assert out["state_dict"] == out["model_names"]


def zero_grad_run(rank, world, discard_first):
    """With 2 micro-batches per step: [a (discarded by zero_grad), b, c] must equal [b, c]."""
    engine = _engine(stage=1)
    data = toy_batches(1, 3, 3 * world)[0, :, rank * 3:(rank + 1) * 3]
    held = None
    if discard_first:
        engine.backward(toy_loss(engine(data[0]), data[0]))
        held = engine.memory_breakdown()["gradient_buffers"]
        engine.zero_grad()
        assert engine.memory_breakdown()["gradient_buffers"] == 0
        engine.set_gradient_accumulation_boundary(False)  # b is not the boundary either
        _micro(engine, data[1])
        engine.set_gradient_accumulation_boundary(True)
        applied = _micro(engine, data[2])
    else:
        _micro(engine, data[1])
        applied = _micro(engine, data[2])
    return held, applied, engine.full_state_dict()


def test_zero_grad_discards_and_the_boundary_can_be_set():
    discarded = run_ranks(zero_grad_run, 2, True)
    plain = run_ranks(zero_grad_run, 2, False)
    for (held, applied, params), (_, plain_applied, plain_params) in zip(discarded, plain,
                                                                         strict=True):
        assert held > 0  # stage 1 held the discarded micro-batch's gradients whole
        assert applied and plain_applied
        for name, value in plain_params.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=name)


def module_only(rank, world, ckpt, mode):
    engine = _engine(stage=3, accumulation=1, scheduler=True)
    data = toy_batches(2, 1, 3 * world)[:, 0, rank * 3:(rank + 1) * 3]
    if mode == "save":
        for step in range(2):
            _micro(engine, data[step])
        engine.save_checkpoint(ckpt, tag="t")
        return engine.full_state_dict(), engine.global_steps, engine.get_lr()
    lr_before = engine.get_lr()
    engine.load_checkpoint(ckpt, load_module_only=True)
    return (engine.full_state_dict(), engine.global_steps, engine.get_lr(), lr_before,
            len(engine.optimizer.moment_tensors()))


def test_load_module_only_takes_the_weights_alone(tmp_path):
    saved = run_ranks(module_only, 2, str(tmp_path), "save")
    loaded = run_ranks(module_only, 2, str(tmp_path), "load")
    for (weights, steps, lr), (new_weights, new_steps, new_lr, lr_before, moments) in zip(
            saved, loaded, strict=True):
        assert steps == 2 and new_steps == 0
        assert new_lr == lr_before != lr  # this run's schedule, not the checkpoint's
        assert moments == 0  # no Adam state restored
        for name, value in weights.items():
            torch.testing.assert_close(new_weights[name], value, rtol=0, atol=0, msg=name)


def test_load_module_strict_false_is_refused_with_the_reason(tmp_path):
    results = run_ranks(_refused, 1, str(tmp_path))
    assert "load_module_strict=False) is not supported" in results[0]


def _refused(rank, world, ckpt):
    engine = _engine(stage=3, accumulation=1)
    try:
        engine.load_checkpoint(ckpt, load_module_strict=False)
    except ValueError as error:
        return str(error)
    pytest.fail("no error")


def module_face(rank, world):
    """Hugging Face's Llama, as DeepSpeedExamples' fine-tuning scripts wrap it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import zeropp

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=16))
    names = [name for name, _ in model.named_modules()]
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    engine, _, _, _ = zeropp.initialize(model, config=config)
    out = {
        "model": engine.model is model.model,  # an attribute of the wrapped module
        "lm_head": engine.lm_head is model.lm_head,
        "named_modules": [name for name, _ in engine.named_modules()] == names,
        "modules": sum(1 for _ in engine.modules()) == len(names),
        "children": [name for name, _ in engine.named_children()] == ["model", "lm_head"],
        "to_same": engine.to(engine.device) is engine and engine.to("cpu") is engine,
    }
    errors = []
    for call in (lambda: engine.to("meta"), lambda: engine.to(torch.float16),
                 lambda: engine.no_such_thing):
        try:
            call()
            errors.append(None)
        except (ValueError, AttributeError) as error:
            errors.append(str(error))
    out["errors"] = errors
    engine.close()
    return out


def test_the_engine_answers_as_deepspeeds_module_does():
    """DeepSpeed's engine is an nn.Module that forwards what it lacks to the model: scripts
    read ``engine.model``, walk ``engine.named_modules()`` and call ``engine.to(device)``."""
    out = run_ranks(module_face, 1)[0]
    errors = out.pop("errors")
    assert all(out.values()), out
    to_meta, to_half, missing = errors
    assert to_meta.startswith("engine.to(meta): the engine's weights live sharded on cpu")
    assert to_half.startswith("engine.to(torch.float16): the engine computes in torch.float32")
    assert missing == ("'ZeroEngine' object has no attribute 'no_such_thing', nor has its "
                       "model (LlamaForCausalLM)")


def throughput(rank, world):
    engine = _engine(stage=3, accumulation=2)
    timer = engine.tput_timer
    data = toy_batches(5, 2, 3 * world)[:, :, rank * 3:(rank + 1) * 3]
    out = {"before": timer.avg_samples_per_sec()}
    with torch.no_grad():  # an evaluation forward: its span ends at the next step()
        engine(data[0, 0])
    for step in range(2):
        for micro in range(2):
            _micro(engine, data[step, micro])
    # The first start_step (2) optimizer steps are warm-up, not timed.
    out["warm"] = (timer.global_step_count, timer.micro_step_count, timer.avg_samples_per_sec())
    timer.update_epoch_count()
    out["epoch"] = (timer.epoch_count, timer.micro_step_count)
    for step in range(2, 5):
        for micro in range(2):
            _micro(engine, data[step, micro])
    out["timed"] = (timer.global_step_count, timer.micro_step_count, timer.total_elapsed_time,
                    timer.avg_samples_per_sec(), timer.batch_size)
    engine.close()
    return out


def test_tput_timer_counts_epochs_and_steps_and_rates_the_timed_ones():
    """DeepSpeed's ``engine.tput_timer``: DeepSpeed-Chat calls ``update_epoch_count()`` after
    each epoch; the rate is train_batch_size over the mean time of the steps after the first
    two, -inf before any was timed (DeepSpeed's answer)."""
    for out in run_ranks(throughput, 2):
        assert out["before"] == float("-inf")
        assert out["warm"] == (2, 4, float("-inf"))
        assert out["epoch"] == (1, 0)
        steps, micro, elapsed, rate, batch = out["timed"]
        assert (steps, micro, batch) == (5, 6, 12)  # 3 per micro-batch x 2 ranks x 2
        assert elapsed > 0
        assert rate == pytest.approx(batch / (elapsed / 3))


def disabled_throughput(rank, world):
    engine = _engine(stage=3, accumulation=1,
                     timers={"throughput": {"enabled": False, "synchronized": True}})
    data = toy_batches(4, 1, 3 * world)[:, :, rank * 3:(rank + 1) * 3]
    for step in range(4):
        _micro(engine, data[step, 0])
    timer = engine.tput_timer
    engine.close()
    # CPU: "synchronized" has no device to synchronize
    return timer.global_step_count, timer.avg_samples_per_sec(), timer.synchronize


def test_the_timers_block_turns_the_throughput_timer_off():
    """DeepSpeed's ``"timers": {"throughput": {"enabled": false}}``: the timer never counts."""
    for steps, rate, synchronize in run_ranks(disabled_throughput, 2):
        assert (steps, rate, synchronize) == (0, float("-inf"), None)


def test_a_synchronized_throughput_timer_synchronizes_at_each_timed_span():
    """``synchronized`` (CUDA): the device is synchronized where DeepSpeed does, at the start
    and end of each span after the warm-up steps, never before."""
    from zeropp.reports import ThroughputTimer

    calls = []
    timer = ThroughputTimer(4, None, rank=1, synchronize=lambda: calls.append(timer.global_step_count))
    for _ in range(4):
        timer.start()
        timer.stop(global_step=True)
    assert calls == [2, 3, 3, 4]  # two warm-up steps untimed, then start and end of each
    assert timer.avg_samples_per_sec() > 0
