"""The DeepSpeed JSON is read and parsed once on every path that takes one: the training
program, ``--dry-run`` (planning, and the simulated ranks it runs) and ``zeropp.initialize``
(also with ``zero.Init`` before it).

A spy counts the opens of each config file (``builtins.open`` and ``io.open``, which
``Path.read_text`` uses) and the typed parses (``EngineConfig.from_mapping``, which
``from_json`` calls too), while the real path runs in this process. Then what the one parse
remembers for the command line: ``EngineConfig.explicit_keys``, the keys the file set.
"""

from __future__ import annotations

import builtins
import dataclasses
import io
import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist
from torch import nn

import zeropp
from megatron_lite.arguments import parse_args
from megatron_lite.dry_run import run_dry_run
from megatron_lite.ds_config import reconcile_with_ds_config
from megatron_lite.pretrain_gpt import main
from zeropp.config import ConfigError, EngineConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3").split()
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True},
}


class Reads:
    """Opens for reading per JSON file, and typed parses, while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opens: Counter[str] = Counter()
        self.parses = 0
        for module in (builtins, io):
            monkeypatch.setattr(module, "open", self._counting(module.open))
        parse = EngineConfig.from_mapping.__func__

        def counting_parse(cls, raw):
            self.parses += 1
            return parse(cls, raw)

        monkeypatch.setattr(EngineConfig, "from_mapping", classmethod(counting_parse))

    def _counting(self, open_):
        def spy(file, *args, **kwargs):
            mode = args[0] if args else kwargs.get("mode", "r")
            if (isinstance(file, (str, os.PathLike)) and str(file).endswith(".json")
                    and not set(mode) & set("wax+")):
                self.opens[os.path.realpath(file)] += 1
            return open_(file, *args, **kwargs)
        return spy

    def of(self, path: Path) -> int:
        return self.opens[os.path.realpath(path)]


def written(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture
def ds_path(tmp_path: Path) -> Path:
    return written(tmp_path, DS_CONFIG)


@pytest.fixture
def zeropp_path(tmp_path: Path) -> Path:
    """With hpZ over 2 GPUs per node: the dry run's two systems differ."""
    zero = {**DS_CONFIG["zero_optimization"], "zero_hpz_partition_size": 2}
    return written(tmp_path, {**DS_CONFIG, "zero_optimization": zero})


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain ``python`` run: one rank, the program's own in-process store."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_training_program_reads_and_parses_once(ds_path, no_launcher, monkeypatch, capsys):
    argv = TINY + ["--mock-data", "--train-iters", "2", "--eval-iters", "1", "--num-workers",
                   "0", "--deepspeed_config", str(ds_path)]
    reads = Reads(monkeypatch)
    assert main(argv) == 0, capsys.readouterr().err
    assert (reads.of(ds_path), reads.parses) == (1, 1)


def test_dry_run_plan_reads_and_parses_once(zeropp_path, monkeypatch, capsys):
    argv = TINY + ["--deepspeed_config", str(zeropp_path), "--dry-run", "--dry-run-nodes", "2",
                   "--dry-run-gpus-per-node", "2", "--no-dry-run-simulate"]
    reads = Reads(monkeypatch)
    assert run_dry_run(parse_args(argv), argv) == 0, capsys.readouterr().err
    assert (reads.of(zeropp_path), reads.parses) == (1, 1)


def test_dry_run_simulated_ranks_take_the_parsed_config(zeropp_path, monkeypatch, capsys):
    """The user's file once; each simulated rank is the training program and reads the
    config the dry run parsed (ZeRO-3's and ZeRO++'s, written for it) once."""
    argv = TINY + ["--fp16", "--deepspeed_config", str(zeropp_path), "--dry-run",
                   "--dry-run-nodes", "2", "--dry-run-gpus-per-node", "2"]
    reads = Reads(monkeypatch)
    assert run_dry_run(parse_args(argv), argv) == 0, capsys.readouterr().err
    simulated = {path: count for path, count in reads.opens.items()
                 if path.endswith("ds_config.json") and "zeropp-sim-config-" in path}
    assert reads.of(zeropp_path) == 1
    assert list(simulated.values()) == [1, 1]  # the ZeRO-3 baseline, then ZeRO++
    assert reads.parses == 3


def test_initialize_reads_and_parses_once(ds_path, no_launcher, monkeypatch):
    reads = Reads(monkeypatch)
    engine, *_ = zeropp.initialize(model=nn.Linear(8, 8), config=str(ds_path))
    engine.close()
    assert (reads.of(ds_path), reads.parses) == (1, 1)


def test_zero_init_and_initialize_share_one_parse(ds_path, no_launcher, monkeypatch):
    reads = Reads(monkeypatch)
    config = EngineConfig.from_json(ds_path)
    with zeropp.zero.Init(config_dict_or_path=config):
        model = nn.Linear(8, 8)
    engine, *_ = zeropp.initialize(model=model, config=config,
                                   model_parameters=model.parameters())
    engine.close()
    assert (reads.of(ds_path), reads.parses) == (1, 1)


def test_the_command_line_is_reconciled_with_the_parsed_config_only(ds_path):
    args = parse_args(TINY + ["--deepspeed_config", str(ds_path)])
    with pytest.raises(TypeError, match="takes the parsed config"):
        reconcile_with_ds_config(args, DS_CONFIG)
    reconcile_with_ds_config(args, EngineConfig.from_json(ds_path))
    assert (args.adam_beta2, args.ds_config_sources["adam_beta2"]) == (
        0.95, ("optimizer.params.betas[1]", str(ds_path)))


# ---- what the parse remembers: the keys the file set ----------------------------------------


def test_explicit_keys_are_the_paths_the_json_set():
    config = EngineConfig.from_json({
        "bfloat16": {"enabled": True}, "train_batch_size": None,
        "zero_optimization": {"stage": 3, "prefetch_bucket_size": 5, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    assert config.explicit_keys == {  # aliases as canonical keys; null is absent
        "bf16", "bf16.enabled", "zero_optimization", "zero_optimization.stage",
        "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.contiguous_gradients",
        "optimizer", "optimizer.type", "optimizer.params", "optimizer.params.lr"}
    assert config.explicit_value("zero_optimization.stage3_prefetch_bucket_size") == 5
    assert config.explicit_value("optimizer.params.lr") == 1e-4
    assert config.optimizer.params["eps"] == 1e-8  # filled in, not set:
    assert config.explicit_value("optimizer.params.eps") is None
    assert config.explicit_value("gradient_clipping") is None
    assert EngineConfig().explicit_keys == set()  # built in code: nothing came from a file
    # bookkeeping, not a setting: no JSON key, and no part of equality or the saved dict
    assert "explicit_keys" not in config.to_dict()
    assert EngineConfig.from_json(config.to_dict()) == config
    with pytest.raises(ConfigError, match="explicit_keys: unknown key"):
        EngineConfig.from_json({"explicit_keys": []})


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda path: path.name)
def test_explicit_dict_means_what_the_file_says(path):
    config = EngineConfig.from_json(path)
    again = EngineConfig.from_json(config.explicit_dict())
    assert again == config and again.explicit_keys <= config.explicit_keys
    replaced = dataclasses.replace(config, gradient_clipping=0.25)
    assert replaced.explicit_dict()["gradient_clipping"] == 0.25  # values are this config's


def test_explicit_dict_keeps_the_optimizer_as_written():
    raw = {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "betas": [0.8, 0.9]}},
           "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                 "zeropp_loco_param": {"err_beta": 0.5}}}
    config = EngineConfig.from_json(raw)
    assert config.explicit_dict() == {
        "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "betas": [0.8, 0.9]}},
        "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                              "zeropp_loco_param": {"err_beta": 0.5}}}
    assert EngineConfig.from_json(config.explicit_dict()) == config
