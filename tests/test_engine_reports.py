"""The keys that make DeepSpeed's engine print and write: steps_per_print, wall_clock_breakdown,
dump_state, the tensorboard / csv_monitor / wandb blocks, and the 16-bit model save."""

from __future__ import annotations

import csv
import sys

import pytest
import torch

import zeropp
from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model


@pytest.fixture(autouse=True)
def own_process_group():
    """Single-process tests build an engine, which joins a world of one: leave none behind
    (the simulated cluster and the training tests build their own)."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def base_config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
            "zero_optimization": {"stage": 3}, **extra}


def train(engine, steps, rank=0, world=1):
    data = toy_batches(steps, 2, 2 * world)
    for step in range(steps):
        for micro in range(2):
            tokens = data[step, micro, 2 * rank:2 * rank + 2]
            engine.backward(toy_loss(engine(tokens), tokens))
            engine.step()


def test_steps_per_print_prints_deepspeeds_progress_line(capsys):
    engine, *_ = zeropp.initialize(toy_model(), config=base_config(steps_per_print=2))
    train(engine, 5)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[Rank 0]")]
    assert lines == [f"[Rank 0] step={s}, skipped=0, lr=[0.001], mom=[(0.9, 0.95)]"
                     for s in (2, 4)]
    engine.close()


def test_wall_clock_breakdown_prints_micro_and_step_times(capsys):
    engine, *_ = zeropp.initialize(toy_model(), config=base_config(wall_clock_breakdown=True))
    train(engine, 2)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("time (ms)")]
    micro = [line for line in lines if "fwd_microstep" in line]
    steps = [line for line in lines if " fwd: " in line]
    assert len(micro) == 4 and len(steps) == 2  # every micro-step, every optimizer step
    fields = dict(part.split(": ") for part in steps[0].split(" | ")[1:])
    assert set(fields) == {"fwd", "bwd", "step"} and all(float(v) > 0 for v in fields.values())
    engine.close()


def test_dump_state_prints_the_configuration(capsys):
    engine, *_ = zeropp.initialize(toy_model(), config=base_config(dump_state=True))
    out = capsys.readouterr().out
    assert "DeepSpeedEngine configuration:" in out
    assert any(line.split()[:1] == ["zero_optimization.stage"] and line.split()[-1] == "3"
               for line in out.splitlines())
    engine.close()


def monitored_run(rank, world, root):
    config = base_config(
        tensorboard={"enabled": True, "output_path": f"{root}/tb", "job_name": "run1"},
        csv_monitor={"enabled": True, "output_path": f"{root}/csv", "job_name": "run1"},
        wandb={"enabled": True, "project": "zeropp-test"},
    )
    engine, *_ = zeropp.initialize(toy_model(), config=config)
    train(engine, 3)
    engine.close()


def test_monitor_blocks_write_deepspeeds_events(tmp_path):
    """In a process of its own: W&B starts a service and sets variables a test process
    must not keep."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "wandb").mkdir()
    run_ranks(monitored_run, 1, str(tmp_path),
              env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb")})
    with open(tmp_path / "csv" / "run1" / "Train_Samples_lr.csv") as handle:
        rows = list(csv.reader(handle))
    assert rows == [["step", "lr"], ["4", "0.001"], ["8", "0.001"], ["12", "0.001"]]
    events = EventAccumulator(str(tmp_path / "tb" / "run1"))
    events.Reload()
    scalars = events.Scalars("Train/Samples/lr")
    assert [(s.step, round(s.value, 6)) for s in scalars] == [(4, 0.001), (8, 0.001), (12, 0.001)]
    assert list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))


def test_an_enabled_monitor_without_its_package_is_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(zeropp.ConfigError, match="tensorboard.enabled is true but the "
                                                 "tensorboard package is not installed"):
        zeropp.initialize(toy_model(), config=base_config(tensorboard={"enabled": True}))


def save_16bit(rank, world, save_dir, gather):
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": gather,
            "stage3_param_persistence_threshold": 0}
    engine, *_ = zeropp.initialize(toy_model(), config={**base_config(), "zero_optimization": zero})
    train(engine, 1, rank, world)
    saved = engine.save_16bit_model(save_dir)
    state = engine.full_state_dict()
    engine.close()
    return saved, state


def test_save_16bit_model_gathers_only_when_the_key_says_so(tmp_path):
    on = run_ranks(save_16bit, 2, str(tmp_path / "on"), True)
    assert [saved for saved, _ in on] == [True, True]
    written = torch.load(tmp_path / "on" / "pytorch_model.bin", weights_only=True)
    assert set(written) == set(on[0][1])
    for name, value in on[0][1].items():
        assert torch.equal(written[name], value), name
    off = run_ranks(save_16bit, 2, str(tmp_path / "off"), False)
    assert [saved for saved, _ in off] == [False, False]
    assert not (tmp_path / "off").exists()
