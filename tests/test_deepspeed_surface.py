"""DeepSpeed's engine surface that its own unit tests and its users' scripts call: the
partition cache, save_checkpoint's save_latest / exclude_frozen_parameters, a load without
``latest``, checkpoint.tag_validation, elastic_checkpoint, ``engine.optimizer.optimizer``, the
throughput timer's fields, an engine without an optimizer, the legacy offload switches, and
the schedule classes by DeepSpeed's names (OneCycle included)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import zeropp
from tests.distributed import run_ranks
from zeropp.config import ConfigError, EngineConfig
from zeropp.deepspeed_api import lr_schedules
from zeropp.unit import ShardState

ADAM = {"type": "Adam", "params": {"lr": 0.01}}


@pytest.fixture(autouse=True)
def own_process_group():
    """Single-process tests build engines, which join a world of one: leave none behind."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _model(seed: int = 0, frozen_first: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    if frozen_first:
        model[0].requires_grad_(False)
    return model


def _engine(model: nn.Module, stage: int = 3, **config):
    """Each linear is a unit of its own ([Note: units]), none persistent."""
    cfg = {"train_batch_size": 1, "optimizer": ADAM,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           **config}
    return zeropp.initialize(model=model, config=cfg, unit_modules=list(model))


def _train(engine, steps: int = 2, seed: int = 1) -> None:
    torch.manual_seed(seed)
    for _ in range(steps):
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def test_empty_partition_cache_releases_what_no_one_needs_and_keeps_the_backward_whole():
    engine, *_ = _engine(_model())
    block = engine.sharded.units[1]
    block.gather_exact(engine.sharded.stats)  # as a prefetch left behind would
    assert block.state is ShardState.GATHERED
    engine.empty_partition_cache()
    assert block.state is ShardState.SHARDED
    assert engine.memory_breakdown()["gathered_parameters"] == 0

    def trained(empty_between: bool) -> dict[str, torch.Tensor]:
        engine, *_ = _engine(_model())
        torch.manual_seed(1)
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        if empty_between:  # the root's gathered weights are saved for this backward
            engine.empty_partition_cache()
        engine.backward(loss)
        engine.step()
        return engine.full_state_dict()

    plain, emptied = trained(False), trained(True)
    assert all(torch.equal(plain[name], emptied[name]) for name in plain)


def test_save_latest_false_and_load_without_latest(tmp_path):
    engine, *_ = _engine(_model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.load_checkpoint(tmp_path / "none_yet") == (None, None)
    assert any("no 'latest' file" in str(w.message) for w in caught)

    _train(engine, 1)
    first = engine.full_state_dict()
    engine.save_checkpoint(tmp_path, tag="first")
    _train(engine, 1, seed=2)
    second = engine.full_state_dict()
    engine.save_checkpoint(tmp_path, tag=7, save_latest=False)  # DeepSpeed: str(tag)
    assert (tmp_path / "latest").read_text().strip() == "first"

    fresh, *_ = _engine(_model(5))
    path, _ = fresh.load_checkpoint(tmp_path)
    assert path.endswith("first")
    assert all(torch.equal(fresh.full_state_dict()[k], first[k]) for k in first)
    fresh.load_checkpoint(tmp_path, tag="7")
    assert all(torch.equal(fresh.full_state_dict()[k], second[k]) for k in second)


def test_exclude_frozen_parameters_keeps_the_loading_models_frozen_values(tmp_path):
    engine, *_ = _engine(_model(frozen_first=True))
    _train(engine)
    saved = engine.full_state_dict()
    engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)

    other = _model(seed=9, frozen_first=True)  # another base: other frozen weights
    base = {name: value.clone() for name, value in other.state_dict().items()}
    fresh, *_ = _engine(other)
    fresh.load_checkpoint(tmp_path)
    loaded = fresh.full_state_dict()
    for name in saved:
        expected = base[name] if name.startswith("0.") else saved[name]
        assert torch.equal(loaded[name], expected), name
    assert not torch.equal(base["0.weight"], saved["0.weight"])  # the test can tell them apart


def _save_with_rank_tags(rank: int, world_size: int, root: str, validation: str) -> str:
    model = _model()
    engine, *_ = zeropp.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": ADAM, "zero_optimization": {"stage": 2},
        "checkpoint": {"tag_validation": validation}})
    try:
        engine.save_checkpoint(root, tag=f"tag-{rank}")
    except AssertionError as error:  # DeepSpeed raises AssertionError here
        return f"raised {type(error).__name__}"
    return Path(root, "latest").read_text()


def test_tag_validation_fail_raises_on_every_rank_and_ignore_saves_under_rank_0s(tmp_path):
    assert run_ranks(_save_with_rank_tags, 2, str(tmp_path / "f"), "FAIL") == [
        "raised CheckpointTagError"] * 2
    assert not (tmp_path / "f" / "latest").exists()
    assert run_ranks(_save_with_rank_tags, 2, str(tmp_path / "i"), "Ignore") == ["tag-0"] * 2
    assert EngineConfig.from_json({"checkpoint": {"tag_validation": "fail"}}) \
        .checkpoint.tag_validation == "Fail"


def test_elastic_checkpoint_accepted_and_inner_optimizer_state_round_trips(tmp_path):
    engine, optimizer, *_ = _engine(_model(), stage=2,
                                    zero_optimization={"stage": 2, "elastic_checkpoint": True})
    assert isinstance(optimizer.optimizer, torch.optim.AdamW)
    assert optimizer.optimizer.param_groups is optimizer.param_groups
    _train(engine)
    before = optimizer.optimizer.state_dict()
    engine.save_checkpoint(tmp_path)
    fresh, fresh_optimizer, *_ = _engine(_model(3), stage=2,
                                         zero_optimization={"stage": 2,
                                                            "elastic_checkpoint": False})
    fresh.load_checkpoint(tmp_path)
    after = fresh_optimizer.optimizer.state_dict()
    assert before["state"].keys() == after["state"].keys() and before["state"]
    for key, state in before["state"].items():
        for name, value in state.items():
            assert torch.equal(value, after["state"][key][name]), name


def test_throughput_timer_has_deepspeeds_fields_and_span_arithmetic():
    engine, *_ = zeropp.initialize(model=_model(), config={
        "train_micro_batch_size_per_gpu": 7, "gradient_accumulation_steps": 6,
        "optimizer": ADAM})
    timer = engine.tput_timer
    assert timer.batch_size == 42 and timer.start_step == 2
    assert not timer.initialized and not timer.started and timer.start_time == 0
    timer.stop()  # before any start: nothing counted
    assert timer.micro_step_count == 0
    timer.start()
    assert timer.initialized and timer.started
    timer.stop()
    assert timer.micro_step_count == 1 and not timer.started and timer.total_elapsed_time == 0
    while timer.global_step_count < timer.start_step:
        timer.start()
        timer.stop(global_step=True, report_speed=False)
    total = timer.total_elapsed_time
    timer.start()
    timer.stop(global_step=False)
    assert timer.end_time >= timer.start_time > 0
    assert timer.total_elapsed_time == total + (timer.end_time - timer.start_time)


def test_engine_without_optimizer_runs_forward_and_refuses_step():
    model = _model()
    with zeropp.zero.Init():
        meta_model = _model()
    for built, stage in ((model, 0), (meta_model, 3)):
        engine, optimizer, _, schedule = zeropp.initialize(model=built, config={
            "train_batch_size": 1, "zero_optimization": {"stage": stage}})
        assert optimizer is None and schedule is None and not engine.trains
        out = engine(torch.randn(2, 8))
        assert out.shape == (2, 8) and torch.isfinite(out).all()
        engine.backward(out.sum())
        with pytest.raises(RuntimeError, match="built without an optimizer"):
            engine.step()
    with pytest.raises(ConfigError, match="scheduler block needs an optimizer"):
        zeropp.initialize(model=_model(), config={"train_batch_size": 1,
                                                  "scheduler": {"type": "WarmupLR"}})


def _zero(**keys):
    return EngineConfig.from_json({"zero_optimization": keys}).zero_optimization


def test_legacy_offload_switches_read_as_deepspeed_reads_them(capsys):
    assert _zero(stage=2, cpu_offload=True).offloads_optimizer
    legacy = _zero(stage=3, cpu_offload=False, cpu_offload_param=True,
                   cpu_offload_use_pin_memory=True)
    assert legacy.offloads_params and not legacy.offloads_optimizer
    with pytest.raises(ConfigError, match="cpu_offload: same setting as 'offload_optimizer'"):
        _zero(stage=2, cpu_offload=True, offload_optimizer={"device": "cpu"})
    with pytest.raises(ConfigError, match="zero_optimization.cpu_offload: expected true or false"):
        _zero(stage=2, cpu_offload=0)
    # offload_param below stage 3: no effect, said once, as DeepSpeed accepts it.
    engine, *_ = _engine(_model(), stage=0,
                         zero_optimization={"stage": 0, "offload_param": {"device": "cpu"}})
    assert not engine.optimizer.offloaded
    assert "offload_param has no effect at ZeRO stage 0" in capsys.readouterr().out


def test_config_schedules_are_deepspeeds_classes_and_one_cycle_matches_deepspeed():
    _, _, _, schedule = _engine(_model(), scheduler={"type": "WarmupDecayLR",
                                                     "params": {"total_num_steps": 20,
                                                                "warmup_num_steps": 5}})
    assert isinstance(schedule, lr_schedules.WarmupDecayLR)
    assert isinstance(schedule, lr_schedules.WarmupLR)  # as DeepSpeed's class tree has it
    assert not isinstance(schedule, lr_schedules.WarmupCosineLR)

    deepspeed_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    params = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
              "cycle_second_step_size": 2, "cycle_first_stair_count": 2,
              "decay_step_size": 3, "decay_lr_rate": 0.5, "decay_mom_rate": 0.1}

    def adam():
        return torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=0.5)

    ours_opt, theirs_opt = adam(), adam()
    ours = lr_schedules.OneCycle(ours_opt, **params)
    theirs = deepspeed_schedules.OneCycle(theirs_opt, **params)
    for _ in range(14):
        for a, b in zip(ours_opt.param_groups, theirs_opt.param_groups, strict=True):
            assert math.isclose(a["lr"], b["lr"]) and a["betas"] == pytest.approx(b["betas"])
        ours.step()
        theirs.step()
    warm = deepspeed_schedules.WarmupLR(adam(), warmup_max_lr=0.02, warmup_num_steps=5)
    mine = lr_schedules.WarmupLR(adam(), warmup_max_lr=0.02, warmup_num_steps=5)
    for step in range(8):
        warm.step()
        mine.step()
        assert math.isclose(mine.get_last_lr()[0], warm.get_last_lr()[0]), step
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        lr_schedules.WarmupLR(adam(), warmup_num_steps=0)



def test_zero_init_joins_a_launchers_process_group_and_starts_none_without_one():
    """DeepSpeed's zero.Init starts the group a launcher describes (a script may ask
    dist.get_rank() inside it). Fresh processes: this one's group is not the one seen."""
    import os
    import subprocess
    import sys

    from tests.distributed import free_port

    program = ("import torch.distributed as dist, zeropp\n"
               "with zeropp.zero.Init():\n"
               "    print('group', dist.is_initialized() and dist.get_world_size())\n")
    bare = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    launched = {**bare, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}
    seen = []
    for env in (launched, bare):
        done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                              text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, done.stderr[-2000:]
        seen.append(done.stdout.split()[-1])
    assert seen == ["1", "False"]


class _PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("stage", [1, 2])
def test_ignore_unused_parameters_false_raises_at_the_step(stage):
    def engine(ignore: bool | None, model: nn.Module):
        zero = {"stage": stage} if ignore is None else {"stage": stage,
                                                         "ignore_unused_parameters": ignore}
        return zeropp.initialize(model=model, config={
            "train_batch_size": 2, "gradient_accumulation_steps": 2, "optimizer": ADAM,
            "zero_optimization": zero})[0]

    checked = engine(False, _PartlyUsed())
    loss = checked(torch.randn(2, 8)).sum()
    checked.backward(loss)
    checked.step()  # not the boundary: nothing checked yet
    checked.backward(checked(torch.randn(2, 8)).sum())
    with pytest.raises(AssertionError, match="unused.weight, unused.bias; set "
                                             "zero_optimization.ignore_unused_parameters"):
        checked.step()
    for ignore in (True, None):  # DeepSpeed's default is true
        plain = engine(ignore, _PartlyUsed())
        _train(plain, 2)
    used = engine(False, nn.Sequential(nn.Linear(8, 8)))
    _train(used, 4)  # every parameter gets its gradient: no error
