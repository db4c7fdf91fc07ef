"""Tests for zeropp.config: DeepSpeed JSON -> EngineConfig.

DeepSpeed itself is the independent reference where it can be: its batch-size resolution, its
ZeRO/fp16/scheduler defaults and its acceptance of the shipped config files. Those tests skip
when deepspeed is not importable.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from zeropp.config import (
    ACCEPTED,
    ALIASES,
    UNSUPPORTED,
    BF16Config,
    ConfigError,
    EngineConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
    read_json_config,
    resolve_auto,
)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
ZEROPP_KEYS = ("zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients")
# keys a file may set beyond ZeRO++'s and still be compared with the ZeRO-3 baseline
PLACEMENT_KEYS = ("offload_optimizer", "offload_param")
# file -> (stage, qwZ, hpZ size, qgZ)
EXPECTED_CONFIGS = {
    "ds_zero0_config.json": (0, False, 1, False),
    "ds_zero3_config.json": (3, False, 1, False),
    "ds_zeropp_config.json": (3, True, 16, True),
    "ds_zeropp_qwz.json": (3, True, 1, False),
    "ds_zeropp_hpz.json": (3, False, 16, False),
    "ds_zeropp_qgz.json": (3, False, 1, True),
    "ds_zeropp_cpu2x2.json": (3, True, 2, True),
    "ds_zeropp_offload.json": (3, True, 16, True),
}
SECTIONS = (EngineConfig, FP16Config, BF16Config, OptimizerConfig, SchedulerConfig, ZeroConfig)


def zero(**keys: Any) -> dict[str, Any]:
    return {"zero_optimization": keys}


def error_of(raw: Any, world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        EngineConfig.from_json(raw, world_size=world_size)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def deepspeed_config():
    return pytest.importorskip("deepspeed.runtime.config")


# --- the shipped config files -------------------------------------------------------------


def test_config_directory_holds_exactly_the_documented_files():
    assert {path.name for path in CONFIG_DIR.glob("*.json")} == set(EXPECTED_CONFIGS)


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_config_file_loads_with_its_components(name):
    config = EngineConfig.from_json(CONFIG_DIR / name)
    zero_config = config.zero_optimization
    observed = (zero_config.stage, zero_config.zero_quantized_weights,
                zero_config.zero_hpz_partition_size, zero_config.zero_quantized_gradients)
    assert observed == EXPECTED_CONFIGS[name]
    assert zero_config.reduce_bucket_size == 10_000_000  # the tutorial's value
    assert zero_config.overlap_comm
    assert config.compute_dtype == "float32"  # precision comes from the command line
    assert config.train_micro_batch_size_per_gpu is None
    assert EngineConfig.from_json(config.to_dict()) == config


def test_zero3_configs_differ_only_in_zeropp_keys():
    def without_zeropp(name: str) -> dict[str, Any]:
        raw = json.loads((CONFIG_DIR / name).read_text())
        for key in ZEROPP_KEYS:
            raw["zero_optimization"].pop(key)
        for key in PLACEMENT_KEYS:
            raw["zero_optimization"].pop(key, None)
        return raw

    stage3 = [name for name, expected in EXPECTED_CONFIGS.items() if expected[0] == 3]
    baseline = without_zeropp("ds_zero3_config.json")
    for name in stage3:
        assert without_zeropp(name) == baseline, name


def test_deepspeed_itself_reads_the_config_files_the_same_way(deepspeed_config):
    shared = ("stage", "reduce_bucket_size", "overlap_comm", *ZEROPP_KEYS)
    for name in EXPECTED_CONFIGS:
        raw = json.loads((CONFIG_DIR / name).read_text())
        ours = EngineConfig.from_json(raw).zero_optimization
        raw["train_micro_batch_size_per_gpu"] = 1
        reference = deepspeed_config.DeepSpeedConfig(raw).zero_config
        for key in shared:
            assert getattr(ours, key) == getattr(reference, key), (name, key)
        assert ours.stage3_prefetch_bucket_size == reference.prefetch_bucket_size
        assert ours.stage3_param_persistence_threshold == reference.param_persistence_threshold


# --- defaults agree with DeepSpeed's ------------------------------------------------------


def test_zero_defaults_match_deepspeed(deepspeed_config):
    reference = deepspeed_config.get_zero_config({"zero_optimization": {"stage": 3}})
    ours = ZeroConfig(stage=3)
    renamed = {"stage3_prefetch_bucket_size": "prefetch_bucket_size",
               "stage3_max_live_parameters": "max_live_parameters",
               "stage3_max_reuse_distance": "max_reuse_distance",
               "stage3_param_persistence_threshold": "param_persistence_threshold",
               "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save"}
    for key in ("reduce_bucket_size", "overlap_comm", *ZEROPP_KEYS, *renamed):
        assert getattr(ours, key) == getattr(reference, renamed.get(key, key)), key
    # Keys this engine only accepts at one value: DeepSpeed's default is that value.
    for key in ("reduce_scatter", "contiguous_gradients"):
        assert getattr(reference, key) in UNSUPPORTED[f"zero_optimization.{key}"].inert, key


def test_fp16_defaults_match_deepspeed(deepspeed_config):
    constants = pytest.importorskip("deepspeed.runtime.constants")
    ours = FP16Config()
    for key in ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale"):
        assert getattr(ours, key) == getattr(constants, f"FP16_{key.upper()}_DEFAULT"), key
    assert constants.FP16_AUTO_CAST_DEFAULT in UNSUPPORTED["fp16.auto_cast"].inert


def test_scheduler_and_optimizer_defaults_match_deepspeed_signatures(deepspeed_config):
    schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    required = {"WarmupLR": {}, "WarmupDecayLR": {"total_num_steps": 5000},
                "WarmupCosineLR": {"total_num_steps": 5000}}
    for kind, given in required.items():
        filled = SchedulerConfig(type=kind, params=given).params
        signature = inspect.signature(getattr(schedules, kind).__init__).parameters
        expected = {name: parameter.default for name, parameter in signature.items()
                    if name not in ("self", "optimizer", "last_batch_iteration")}
        assert filled == {**expected, **given}, kind

    fused_adam = pytest.importorskip("deepspeed.ops.adam").FusedAdam
    signature = inspect.signature(fused_adam.__init__).parameters
    params = OptimizerConfig(type="Adam").params
    for key in ("lr", "eps", "weight_decay"):
        assert params[key] == signature[key].default
    assert tuple(params["betas"]) == signature["betas"].default
    assert signature["adam_w_mode"].default is True  # why "Adam" is normalized to AdamW


def test_every_deepspeed_zero_key_is_classified(deepspeed_config):
    zero_module = pytest.importorskip("deepspeed.runtime.zero.config")
    spellings = set()
    for name, info in zero_module.DeepSpeedZeroConfig.model_fields.items():
        spellings |= {name, info.alias} - {None}
    for key in sorted(spellings):
        try:
            EngineConfig.from_json(zero(**{"stage": 3, key: None}))
        except ConfigError as error:
            assert "unknown key" not in str(error), key


# --- value rules ----------------------------------------------------------------------------


def test_integral_floats_are_integers():
    config = EngineConfig.from_json(zero(stage=3, reduce_bucket_size=1e7,
                                         stage3_max_live_parameters=5e8))
    assert config.zero_optimization.reduce_bucket_size == 10_000_000
    assert type(config.zero_optimization.reduce_bucket_size) is int
    assert config.zero_optimization.stage3_max_live_parameters == 500_000_000


@pytest.mark.parametrize("raw, message", [
    (zero(reduce_bucket_size=-5), "zero_optimization.reduce_bucket_size: expected a positive integer, got -5"),
    (zero(reduce_bucket_size=1.5), "zero_optimization.reduce_bucket_size: expected a positive integer, got 1.5"),
    (zero(reduce_bucket_size="1e7"), 'zero_optimization.reduce_bucket_size: expected a positive integer, got "1e7"'),
    (zero(reduce_bucket_size=True), "zero_optimization.reduce_bucket_size: expected a positive integer, got true"),
    (zero(reduce_bucket_size=0), "zero_optimization.reduce_bucket_size: expected a positive integer, got 0"),
    (zero(stage3_prefetch_bucket_size=-1), "zero_optimization.stage3_prefetch_bucket_size: expected a non-negative integer, got -1"),
    (zero(overlap_comm="true"), 'zero_optimization.overlap_comm: expected true or false, got "true"'),
    (zero(overlap_comm=1), "zero_optimization.overlap_comm: expected true or false, got 1"),
    (zero(stage=3, zero_quantized_weights_bits=6), "zero_optimization.zero_quantized_weights_bits: expected one of 8, 4, got 6"),
    (zero(stage=3, zero_quantized_gradients_bits=2), "zero_optimization.zero_quantized_gradients_bits: expected one of 4, 8, got 2"),
    (zero(stage=3, zero_hpz_partition_size=0), "zero_optimization.zero_hpz_partition_size: expected a positive integer, got 0"),
    (zero(zero_quantization_block_size=0), "zero_optimization.zero_quantization_block_size: expected a positive integer, got 0"),
    (zero(stage=5), "zero_optimization.stage: expected one of 0, 1, 2, 3, got 5"),
    ({"gradient_clipping": -1.0}, "gradient_clipping: expected a non-negative number, got -1.0"),
    ({"gradient_clipping": math.inf}, "gradient_clipping: expected a non-negative number, got Infinity"),
    ({"communication_data_type": "int8"}, 'communication_data_type: expected one of "fp32", "fp16", "bf16", got "int8"'),
    ({"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window: expected a positive integer, got 0"),
    ({"zero_optimization": True}, "zero_optimization: expected an object, got true"),
    ({"steps_per_print": None}, "steps_per_print: expected a positive integer, got null"),
])
def test_bad_values_name_key_path_and_value(raw, message):
    assert error_of(raw) == message


def test_inter_node_gradient_width():
    """qgZ's inter-node hop may be narrower; int2 only with error feedback."""
    from zeropp.deepspeed_api.initialize import options_from_config

    key = "zero_optimization.zero_quantized_gradients_inter_node_bits"
    qgz = {"stage": 3, "zero_quantized_gradients": True}
    config = EngineConfig.from_json(zero(**qgz, zero_quantized_gradients_inter_node_bits=2,
                                         zero_quantized_gradients_error_feedback=True))
    _, quant = options_from_config(config.zero_optimization)
    assert (quant.gradient_bits, quant.gradient_inter_node_bits) == (4, 2)
    default = EngineConfig.from_json(zero(**qgz)).zero_optimization
    assert default.zero_quantized_gradients_inter_node_bits is None
    loco = zero(**qgz, zero_quantized_gradients_inter_node_bits=2,
                zeropp_loco_param={"err_beta": 0.8, "reset_T": 1024})
    assert EngineConfig.from_json(loco).zero_optimization.error_feedback == (0.8, 1024)
    assert error_of(zero(**qgz, zero_quantized_gradients_inter_node_bits=2)).startswith(
        f"{key}: 2-bit gradients need error feedback")
    assert error_of(zero(stage=3, zero_quantized_gradients_inter_node_bits=4)) == (
        f"{key}: needs zero_quantized_gradients true")
    assert error_of(zero(**qgz, zero_quantized_gradients_inter_node_bits=3)) == (
        f"{key}: expected one of 2, 4, 8, got 3")


@pytest.mark.parametrize("block_size", [1, 3, 17, 100, 4096])
def test_any_positive_block_size_is_accepted(block_size):
    config = EngineConfig.from_json(zero(stage=3, zero_quantization_block_size=block_size))
    assert config.zero_optimization.zero_quantization_block_size == block_size


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu",
                                 "gradient_accumulation_steps"])
def test_auto_batch_values_must_be_resolved(key):
    message = error_of({key: "auto"})
    assert message.startswith(f'{key}: "auto" is a Hugging Face Trainer placeholder')
    assert "resolve it to a positive integer" in message
    assert "zeropp.config.resolve_auto" in message and "zeropp.initialize" in message


def test_prescale_gradients_makes_deepspeed_ignore_the_predivide_factor():
    config = EngineConfig.from_json({"prescale_gradients": True, "gradient_predivide_factor": 8})
    assert config.predivide_factor is None  # the data-parallel size, as DeepSpeed's prescale
    assert EngineConfig.from_json({"prescale_gradients": False,
                                   "gradient_predivide_factor": 1.0}).predivide_factor == 1.0


def test_communication_data_type_is_normalized():
    assert EngineConfig.from_json({"communication_data_type": "FP32"}).communication_data_type == "fp32"


# --- unknown keys -------------------------------------------------------------------------


@pytest.mark.parametrize("raw, message", [
    (zero(zero_quantised_weights=True),
     "zero_optimization.zero_quantised_weights: unknown key (did you mean 'zero_quantized_weights'?)"),
    ({"train_batch_sise": 8}, "train_batch_sise: unknown key (did you mean 'train_batch_size'?)"),
    ({"zero_optimisation": {}}, "zero_optimisation: unknown key (did you mean 'zero_optimization'?)"),
    ({"fp16": {"loss_scale_windw": 10}}, "fp16.loss_scale_windw: unknown key (did you mean 'loss_scale_window'?)"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
     "optimizer.params.weight_decy: unknown key (did you mean 'weight_decay'?)"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}},
     "scheduler.params.warmup_num_step: unknown key (did you mean 'warmup_num_steps'?)"),
    ({"activation_checkpointing": {"partition_activation": True}},
     "activation_checkpointing.partition_activation: unknown key (did you mean 'partition_activations'?)"),
    ({"tensorboard": {"enabeld": True}}, "tensorboard.enabeld: unknown key (did you mean 'enabled'?)"),
    (zero(prefetch_bucket_sizes=1), "zero_optimization.prefetch_bucket_sizes: unknown key (did you mean 'prefetch_bucket_size'?)"),
    ({"xyzzy": 1}, "xyzzy: unknown key"),
    ({"fp16.enabled": True}, "fp16.enabled: unknown key"),
])
def test_unknown_keys_name_the_nearest_known_key(raw, message):
    assert error_of(raw) == message


# --- unsupported and accepted DeepSpeed keys ----------------------------------------------


@pytest.mark.parametrize("raw, message", [
    # NVMe offload's refusal: tests/test_offload.py
    ({"data_types": {"grad_accum_dtype": "bf16"}},
     'data_types.grad_accum_dtype="bf16" is not supported by this engine (gradients accumulate across micro-batches in fp32'),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": False}}},
     "optimizer.params.bias_correction=false is not supported by this engine"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}},
     "optimizer.params.max_grad_norm=1.0 is not supported by this engine (DeepSpeed rejects it too: "
     "use gradient_clipping)"),
    (zero(stage=3, mics_shard_size=8), "zero_optimization.mics_shard_size=8 is not supported by this engine (MiCS"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast=true is not supported by this engine"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}},
     "activation_checkpointing.cpu_checkpointing=true is not supported by this engine"),
    ({"compression_training": {}}, "compression_training is not supported by this engine"),
    ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention is not supported by this engine"),
    ({"pipeline": {"stages": 2}}, "pipeline is not supported by this engine (pipeline parallelism"),
    ({"amp": {"enabled": True}}, "amp is not supported by this engine (NVIDIA Apex AMP"),
    ({"elasticity": {"enabled": True}}, "elasticity is not supported by this engine"),
    (zero(stage=3, reduce_scatter=False),
     "zero_optimization.reduce_scatter=false is not supported by this engine (stages 1-3 always"),
    (zero(stage=3, contiguous_gradients=False),
     "zero_optimization.contiguous_gradients=false is not supported by this engine (gradients"),
    ({"bf16": {"enabled": True, "check_overflow": True}}, "bf16.check_overflow=true is not supported"),
    # booleans and numbers never stand in for each other, even where Python says 0 == False
    ({"sequence_parallel_size": True}, "sequence_parallel_size=true is not supported by this engine"),
])
def test_unsupported_features_are_errors_with_reason(raw, message):
    error = error_of(raw)
    assert error.startswith(message)
    path = message.split(" ", 1)[0].split("=")[0]
    assert f"is not supported by this engine ({UNSUPPORTED[path].reason})" in error


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stages_1_and_2_take_the_tutorial_config_and_leave_zeropp_inert(stage):
    """DeepSpeed reads the ZeRO++ keys at stage 3 only: the tutorial's JSON runs at any
    stage, and the keys it leaves without effect are listed for the log."""
    tutorial = json.loads((CONFIG_DIR / "ds_zeropp_config.json").read_text())
    tutorial["zero_optimization"]["stage"] = stage
    cfg = EngineConfig.from_json(tutorial).zero_optimization
    assert cfg.stage == stage
    assert cfg.inert_keys == ["zero_optimization.zero_quantized_weights",
                              "zero_optimization.zero_hpz_partition_size",
                              "zero_optimization.zero_quantized_gradients"]
    assert EngineConfig.from_json(zero(stage=3, zero_quantized_weights=True)) \
        .zero_optimization.inert_keys == []
    assert error_of(zero(stage=4)).startswith("zero_optimization.stage")


@pytest.mark.parametrize("raw", [
    zero(stage=3, offload_param={"device": "none"}, offload_optimizer=None),
    # offload off: its tuning keys and the aio block describe no offload at all
    {"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "none", "buffer_count": 4, "pipeline_read": False, "pipeline_write": False,
        "pin_memory": True, "fast_init": False, "ratio": 0.3, "nvme_path": None},
        "offload_param": {"device": "none", "pin_memory": True, "buffer_size": 1e8,
                          "max_in_cpu": 1e9, "buffer_count": 5}},
     "aio": {"block_size": 1048576, "queue_depth": 16, "single_submit": False,
             "overlap_events": True, "thread_count": 2, "intra_op_parallelism": 1}},
    zero(stage=2, offload_optimizer={"pin_memory": True}),  # device defaults to "none"
    {"aio": None, "flops_profiler": {"enabled": True, "profile_step": 1}},
    {"data_types": {"grad_accum_dtype": "fp32"}}, {"data_types": {"grad_accum_dtype": None}},
    {"cuda_visible_devices": 0, "dataloader_drop_last": True},
    {"prescale_gradients": True, "gradient_predivide_factor": 8},  # DeepSpeed ignores the factor
    zero(stage=3, cpu_offload=False, mics_shard_size=-1, load_from_fp32_weights=True),
    {"fp16": {"enabled": True, "auto_cast": False}},
    {"activation_checkpointing": {"cpu_checkpointing": False, "partition_activations": True,
                                  "number_checkpoints": 4, "contiguous_memory_optimization": False,
                                  "synchronize_checkpoint_boundary": False, "profile": False}},
    {"flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "detailed": True}},
    {"amp": {"enabled": False, "opt_level": "O1"}, "elasticity": {"enabled": False}},
    {"tensorboard": {"enabled": True, "output_path": "tb/", "job_name": "run"},
     "wandb": {"enabled": True, "project": "zeropp", "group": None, "team": None},
     "csv_monitor": {"enabled": False, "output_path": "csv/"},
     "comms_logger": {"enabled": True, "verbose": False, "prof_ops": ["all_gather"]}},
    {"prescale_gradients": False, "gradient_predivide_factor": 1, "memory_breakdown": False},
    zero(stage=3, allgather_bucket_size=5e8, allgather_partitions=True, sub_group_size=1e9,
         round_robin_gradients=False, ignore_unused_parameters=True),
])
def test_harmless_and_switched_off_keys_are_accepted(raw):
    EngineConfig.from_json(raw)


def test_keys_inside_accepted_blocks_are_type_checked():
    assert error_of({"wandb": {"enabled": "yes"}}) == 'wandb.enabled: expected true or false, got "yes"'


def test_tables_are_disjoint_documented_and_point_at_real_keys():
    field_paths = {
        (f"{section.SECTION}.{spec.name}" if section.SECTION else spec.name)
        for section in SECTIONS for spec in dataclasses.fields(section)}
    assert not set(ACCEPTED) & set(UNSUPPORTED)
    assert not set(ACCEPTED) & field_paths
    assert not set(ALIASES) & (field_paths | set(ACCEPTED) | set(UNSUPPORTED))
    for alias, target in ALIASES.items():
        assert target in field_paths | set(ACCEPTED) | set(UNSUPPORTED), alias
    assert all(entry.meaning.strip() for entry in ACCEPTED.values())
    assert all(entry.reason.strip() for entry in UNSUPPORTED.values())
    for section in SECTIONS:
        for spec in dataclasses.fields(section):
            doc = spec.metadata["doc"]
            assert doc.strip() and "\n" not in doc, (section.__name__, spec.name)


# --- aliases --------------------------------------------------------------------------------


def test_deepspeed_aliases_map_onto_canonical_fields():
    config = EngineConfig.from_json({
        "bfloat16": {"enabled": True},
        "zero_optimization": {"stage": 3, "prefetch_bucket_size": 123, "max_live_parameters": 456,
                              "param_persistence_threshold": 7, "max_reuse_distance": 8,
                              "stage3_gather_fp16_weights_on_model_save": True}})
    zero_config = config.zero_optimization
    assert config.bf16.enabled and config.compute_dtype == "bfloat16"
    assert (zero_config.stage3_prefetch_bucket_size, zero_config.stage3_max_live_parameters,
            zero_config.stage3_param_persistence_threshold, zero_config.stage3_max_reuse_distance) == (123, 456, 7, 8)
    assert zero_config.stage3_gather_16bit_weights_on_model_save


def test_alias_and_canonical_key_together_is_an_error():
    message = error_of(zero(stage3_prefetch_bucket_size=1, prefetch_bucket_size=2))
    assert message == ("zero_optimization.prefetch_bucket_size: same setting as "
                       "'stage3_prefetch_bucket_size', which is also given; keep one")


# --- reading files ------------------------------------------------------------------------


def test_json_syntax_error_reports_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    # The comma after 10 is missing; the parser stops at the next key: line 3, column 3.
    path.write_text('{\n  "steps_per_print": 10\n  "gradient_clipping": 1.0\n}\n')
    assert error_of(path) == f"{path}:3:3: Expecting ',' delimiter"


def test_missing_file_is_file_not_found(tmp_path):
    missing = tmp_path / "absent.json"
    with pytest.raises(FileNotFoundError, match="absent.json"):
        EngineConfig.from_json(missing)


@pytest.mark.parametrize("text, fragment", [
    ('{"zero_optimization": {"stage": 3, "stage": 0}}', "duplicate key 'stage'"),
    ('{"gradient_clipping": NaN}', "NaN is not valid JSON"),
    ("[1, 2]", "the top level must be a JSON object, got list"),
])
def test_malformed_json_is_rejected(tmp_path, text, fragment):
    path = tmp_path / "config.json"
    path.write_text(text)
    assert fragment in error_of(path)


def test_directory_is_rejected(tmp_path):
    assert error_of(tmp_path).startswith(f"{tmp_path}: not a regular file")


def test_dict_input_is_copied():
    raw = zero(stage=3, zero_hpz_partition_size=2)
    copied = read_json_config(raw)
    copied["zero_optimization"]["stage"] = 0
    assert raw["zero_optimization"]["stage"] == 3
    config = EngineConfig.from_json(raw)
    raw["zero_optimization"]["zero_hpz_partition_size"] = 8
    assert config.zero_optimization.zero_hpz_partition_size == 2


# --- batch sizes --------------------------------------------------------------------------


@pytest.mark.parametrize("batch, world_size, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 4, (60, 3, 5)),
    ({"train_batch_size": 16}, 4, (16, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 2}, 8, (16, 2, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 4, (24, 2, 3)),
])
def test_batch_resolution(batch, world_size, expected):
    assert EngineConfig.from_json(batch).resolve_batch(world_size) == expected
    resolved = EngineConfig.from_json(batch, world_size=world_size)
    assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
            resolved.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("batch, world_size, message", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
     "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 * world_size 2 = 16"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2,
     "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 * world_size 2 = 8"),
    ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}, 2,
     "train_batch_size 4 is not divisible by train_micro_batch_size_per_gpu 4 * world_size 2 = 8"),
    ({"train_batch_size": 10, "gradient_accumulation_steps": 3}, 2,
     "train_batch_size 10 is not divisible by gradient_accumulation_steps 3 * world_size 2 = 6"),
    ({"gradient_accumulation_steps": 4}, 2, "train_batch_size or train_micro_batch_size_per_gpu must be set"),
    ({"train_batch_size": 8}, 0, "world_size: expected a positive integer, got 0"),
])
def test_batch_inconsistency_names_the_numbers(batch, world_size, message):
    assert error_of(batch, world_size=world_size).startswith(message)


def test_batch_resolution_agrees_with_deepspeed(deepspeed_config, monkeypatch):
    def deepspeed_outcome(batch: dict[str, int], world_size: int) -> tuple[int, int, int] | None:
        monkeypatch.setattr(deepspeed_config.dist, "get_rank", lambda *args, **kwargs: 0)
        monkeypatch.setattr(deepspeed_config.dist, "get_world_size", lambda *args, **kwargs: world_size)
        try:
            reference = deepspeed_config.DeepSpeedConfig(dict(batch))
        except AssertionError:
            return None
        return (reference.train_batch_size, reference.train_micro_batch_size_per_gpu,
                reference.gradient_accumulation_steps)

    compared = 0
    for total, micro, steps, world_size in itertools.product(
            (None, 6, 8, 12, 30), (None, 1, 2, 4), (None, 1, 3), (1, 2, 4)):
        keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        batch = {key: value for key, value in zip(keys, (total, micro, steps), strict=True) if value is not None}
        expected = deepspeed_outcome(batch, world_size)
        try:
            observed = EngineConfig.from_json(batch).resolve_batch(world_size)
        except ConfigError:
            observed = None
        assert observed == expected, (batch, world_size)
        compared += expected is not None
    assert compared > 40  # the grid exercises the resolving branches, not only the errors


# --- cross-field rules, dtype, construction, round trip -----------------------------------


@pytest.mark.parametrize("raw, message", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "fp16.enabled and bf16.enabled are both true; enable at most one"),
    (zero(stage=0, zero_hpz_partition_size=8),
     "zero_optimization.zero_hpz_partition_size: hpZ extends ZeRO-3 and needs stage 3, got stage 0"),
    (zero(stage=0, zero_quantized_weights=True),
     "zero_optimization.zero_quantized_weights: qwZ extends ZeRO-3 and needs stage 3, got stage 0"),
    (zero(zero_quantized_gradients=True),
     "zero_optimization.zero_quantized_gradients: qgZ extends ZeRO-3 and needs stage 3, got stage 0"),
    (zero(stage=3, zero_quantized_gradients_error_feedback=True),
     "zero_optimization.zero_quantized_gradients_error_feedback: needs zero_quantized_gradients true"),
    ({"communication_data_type": "fp16", **zero(stage=3, zero_quantized_gradients=True)},
     'communication_data_type="fp16" applies to the exact reduce-scatter; qgZ sends'),
    (zero(stage=3, zeropp_loco_param={"err_beta": 0.8}),
     "zero_optimization.zeropp_loco_param: LoCo error feedback needs zero_quantized_gradients"),
    (zero(stage=3, zero_quantized_gradients=True, zeropp_loco_param={"err_beta": 1}),
     "zero_optimization.zeropp_loco_param.err_beta: expected a number in [0, 1), got 1"),
    (zero(stage=3, zero_quantized_gradients=True, zeropp_loco_param={"reset": 5}),
     "zero_optimization.zeropp_loco_param.reset: unknown key (did you mean 'reset_T'?)"),
])
def test_cross_field_rules(raw, message):
    assert error_of(raw).startswith(message)


def test_loco_block_fills_deepspeed_defaults_and_enables_error_feedback():
    config = EngineConfig.from_json(zero(stage=3, zero_quantized_gradients=True,
                                         zeropp_loco_param={"err_beta": 0.5}))
    assert config.zero_optimization.error_feedback == (0.5, 1024)
    plain = EngineConfig.from_json(zero(stage=3, zero_quantized_gradients=True,
                                        zero_quantized_gradients_error_feedback=True))
    assert plain.zero_optimization.error_feedback == (0.0, 0)
    assert EngineConfig.from_json(zero(stage=3)).zero_optimization.error_feedback is None


def test_other_bit_widths_are_accepted():
    config = EngineConfig.from_json(zero(stage=3, zero_quantized_weights=True, zero_quantized_weights_bits=4,
                                         zero_quantized_gradients=True, zero_quantized_gradients_bits=8))
    assert (config.zero_optimization.zero_quantized_weights_bits,
            config.zero_optimization.zero_quantized_gradients_bits) == (4, 8)


@pytest.mark.parametrize("raw, dtype", [
    ({}, "float32"), ({"fp16": {"enabled": True}}, "float16"), ({"bf16": {"enabled": True}}, "bfloat16")])
def test_compute_dtype(raw, dtype):
    assert EngineConfig.from_json(raw).compute_dtype == dtype


def test_direct_construction_is_validated_and_frozen():
    assert ZeroConfig(stage=3, reduce_bucket_size=1e7).reduce_bucket_size == 10_000_000
    with pytest.raises(ConfigError, match=r"zero_optimization.stage: expected one of 0, 1, 2, 3"):
        ZeroConfig(stage=4)
    assert error_of({"fp16": {"enabled": True, "auto_cast": True}}).startswith(
        "fp16.auto_cast=true is not supported")
    config = EngineConfig(fp16={"enabled": True})
    assert isinstance(config.fp16, FP16Config) and config.compute_dtype == "float16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps_per_print = 1  # type: ignore[misc]


def test_optimizer_normalization_and_rules():
    adam = OptimizerConfig(type="adam", params={"lr": 3e-4, "torch_adam": False})
    assert adam.type == "AdamW"  # DeepSpeed's Adam defaults to adam_w_mode true
    assert adam.params == {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                           "amsgrad": False}
    assert error_of({"optimizer": {"type": "Lamb"}}).startswith(
        'optimizer.type="Lamb" is not supported by this engine (LAMB scales each tensor')
    assert error_of({"optimizer": {"params": {"betas": [0.9, 1.0]}}}) == (
        "optimizer.params.betas: expected two numbers in [0, 1), got [0.9, 1.0]")
    assert error_of({"optimizer": {"params": {"lr": "auto"}}}).startswith('optimizer.params.lr: "auto"')


@pytest.mark.parametrize("type_, params, expected_type, expected", [
    # adam_w_mode false: classic Adam, weight decay added to the gradient (L2)
    ("Adam", {"lr": 1e-4, "adam_w_mode": False, "weight_decay": 0.1}, "Adam",
     {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False}),
    # type AdamW is always decoupled: DeepSpeed ignores adam_w_mode there
    ("AdamW", {"adam_w_mode": False, "torch_adam": False, "amsgrad": True}, "AdamW",
     {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "amsgrad": True}),
    # torch_adam builds torch.optim.AdamW, whose own weight_decay default is 0.01
    ("AdamW", {"torch_adam": True, "adam_w_mode": True, "lr": 2e-5}, "AdamW",
     {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False}),
    ("Adam", {"bias_correction": True}, "AdamW",
     {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "SGD",
     {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": True}),
    ("Adagrad", {}, "Adagrad", {"lr": 0.01, "lr_decay": 0.0, "weight_decay": 0.0,
                                "initial_accumulator_value": 0.0, "eps": 1e-10}),
])
def test_optimizer_types_normalize_to_torch_keyword_arguments(type_, params, expected_type, expected):
    config = OptimizerConfig(type=type_, params=params)
    assert (config.type, config.params) == (expected_type, expected)
    torch = pytest.importorskip("torch")
    # the params are exactly keyword arguments of the torch.optim class of that name
    getattr(torch.optim, config.type)([torch.nn.Parameter(torch.zeros(2))], **config.params)
    again = EngineConfig.from_json(EngineConfig(optimizer=config).to_dict()).optimizer
    assert again == config  # to_dict spells adam_w_mode false out for classic Adam


def test_optimizer_defaults_match_torch_signatures():
    torch = pytest.importorskip("torch")
    cases = [("SGD", {}), ("Adagrad", {}), ("Adam", {"torch_adam": True, "adam_w_mode": False}),
             ("AdamW", {"torch_adam": True})]
    for kind, switches in cases:
        config = OptimizerConfig(type=kind, params=switches)
        assert config.type == kind
        signature = inspect.signature(getattr(torch.optim, kind).__init__).parameters
        for key, value in config.params.items():
            default = signature[key].default
            assert value == (list(default) if isinstance(default, tuple) else default), (kind, key)
        assert set(config.params) < set(signature), kind


@pytest.mark.parametrize("type_, params, fragment", [
    ("OneBitAdam", {}, "1-bit Adam needs its own compressed communication"),
    ("OnebitAdam", {}, "1-bit Adam needs its own compressed communication"),
    ("ZeroOneAdam", {}, "0/1 Adam needs its own compressed communication"),
    ("OneBitLamb", {}, "1-bit LAMB"),
    ("Lion", {}, "Lion"),
    ("Muon", {}, "Muon orthogonalizes whole matrices; not element-wise"),
    ("MuAdamW", {}, "muP scales each tensor by its width; not element-wise"),
    ("RMSprop", {}, "the partitioned optimizer implements AdamW, Adam, SGD and Adagrad"),
])
def test_optimizers_that_are_not_element_wise_are_refused(type_, params, fragment):
    message = error_of({"optimizer": {"type": type_, "params": params}})
    assert message.startswith(f'optimizer.type="{type_}" is not supported by this engine (')
    assert fragment in message


@pytest.mark.parametrize("raw, message", [
    ({"type": "SGD", "params": {"nesterov": True}},
     "optimizer.params.nesterov=true needs momentum > 0 and dampening 0"),
    ({"type": "SGD", "params": {"torch_adam": True}},
     "optimizer.params.torch_adam: unknown key"),
    ({"type": "SGD", "params": {"max_grad_norm": 1.0}},
     "optimizer.params.max_grad_norm=1.0 is not supported by this engine"),
    ({"type": "AdamW", "params": {"adam_w_mode": "false"}},
     'optimizer.params.adam_w_mode: expected true or false, got "false"'),
])
def test_optimizer_parameter_rules(raw, message):
    assert error_of({"optimizer": raw}).startswith(message)


def test_scheduler_rules():
    assert error_of({"scheduler": {"type": "WarmupCosineLR"}}) == (
        "scheduler.params.total_num_steps: required for this type and missing")
    assert error_of({"scheduler": {"type": "OneCycle"}}) == (
        "scheduler.params.cycle_min_lr: required for this type and missing")
    assert error_of({"scheduler": {"type": "LRRangeTest"}}).startswith(
        'scheduler.type: expected one of "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", '
        '"OneCycle", got "LRRangeTest"')
    assert error_of({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}}) == (
        "scheduler.params: total_num_steps 10 is smaller than warmup_num_steps 1000")
    assert error_of({"scheduler": {"params": {"warmup_type": "cosine"}}}) == (
        'scheduler.params.warmup_type: expected one of "log", "linear", got "cosine"')


def test_round_trip_through_json_text(tmp_path):
    raw = {
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale_window": 500, "initial_scale_power": 12, "hysteresis": 4},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000, "warmup_num_steps": 100}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 1e7, "zero_quantized_weights": True,
                              "zero_hpz_partition_size": 8, "zero_quantized_gradients": True,
                              "zero_quantization_block_size": 128, "prefetch_bucket_size": 2e7,
                              "zeropp_loco_param": {"err_beta": 0.5}},
        "wall_clock_breakdown": True, "steps_per_print": 5, "gradient_predivide_factor": 2,
        "tensorboard": {"enabled": False},
    }
    config = EngineConfig.from_json(raw, world_size=4)
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(config.to_dict()))
    assert EngineConfig.from_json(path) == config
    assert config.to_dict()["zero_optimization"]["stage3_prefetch_bucket_size"] == 20_000_000
    assert config.gradient_accumulation_steps == 8


# --- resolve_auto: Hugging Face's "auto" placeholders ---------------------------------------

HF_STYLE = {
    "fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
}
TRAINING_ARGUMENTS = dict(world_size=4, micro_batch_size=3, gradient_accumulation_steps=2,
                          hidden_size=100, lr=2e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1,
                          gradient_clipping=0.5, bf16=True, total_num_steps=50, warmup_steps=5)


def test_resolve_auto_fills_what_the_hf_trainer_fills():
    resolved = resolve_auto(HF_STYLE, **TRAINING_ARGUMENTS)
    assert resolved["train_micro_batch_size_per_gpu"] == 3
    assert resolved["gradient_accumulation_steps"] == 2
    assert resolved["train_batch_size"] == 3 * 2 * 4
    assert resolved["gradient_clipping"] == 0.5
    assert resolved["fp16"]["enabled"] is False and resolved["bf16"]["enabled"] is True
    assert resolved["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                               "weight_decay": 0.1}
    assert resolved["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-4,
                                               "warmup_num_steps": 5, "total_num_steps": 50}
    zero_block = resolved["zero_optimization"]
    assert (zero_block["reduce_bucket_size"], zero_block["stage3_prefetch_bucket_size"],
            zero_block["stage3_param_persistence_threshold"]) == (10_000, 9_000, 1_000)
    assert zero_block["stage3_gather_16bit_weights_on_model_save"] is False
    config = EngineConfig.from_json(resolved, world_size=4)
    assert config.compute_dtype == "bfloat16" and config.gradient_accumulation_steps == 2
    assert HF_STYLE["train_batch_size"] == "auto"  # the input is left alone


def test_resolve_auto_follows_hugging_faces_fallbacks():
    resolved = resolve_auto(HF_STYLE, world_size=2, micro_batch_size=4, hidden_size=8, lr=1e-3,
                            betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, total_num_steps=100)
    assert resolved["fp16"]["enabled"] is False and resolved["bf16"]["enabled"] is False  # no --fp16
    assert resolved["gradient_accumulation_steps"] == 1 and resolved["train_batch_size"] == 8
    assert resolved["gradient_clipping"] == 1.0  # max_grad_norm's default in the Trainer and Accelerate
    assert resolved["scheduler"]["params"]["warmup_num_steps"] == 1  # no warmup: HF keeps it positive
    ratio = resolve_auto(HF_STYLE, **{**TRAINING_ARGUMENTS, "warmup_steps": 0.1})
    assert ratio["scheduler"]["params"]["warmup_num_steps"] == 5  # a fraction of total_num_steps


@pytest.mark.parametrize("missing, key", [
    ("micro_batch_size", "train_micro_batch_size_per_gpu"),
    ("hidden_size", "zero_optimization.reduce_bucket_size"),
    ("lr", "optimizer.params.lr"),
    ("betas", "optimizer.params.betas"),
    ("total_num_steps", "scheduler.params.total_num_steps"),
])
def test_resolve_auto_names_the_key_and_the_keyword_it_needs(missing, key):
    arguments = {name: value for name, value in TRAINING_ARGUMENTS.items() if name != missing}
    with pytest.raises(ConfigError) as caught:
        resolve_auto(HF_STYLE, **arguments)
    assert str(caught.value) == (f'{key}: "auto" needs a value: pass {missing}=... to '
                                 "zeropp.config.resolve_auto (or write the value)")


def test_resolve_auto_keeps_concrete_values_and_derives_the_batch_from_them():
    raw = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": 3, "optimizer": {"params": {"lr": 5e-5}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}}
    resolved = resolve_auto(raw, world_size=2, micro_batch_size=16, gradient_accumulation_steps=1,
                            lr=1.0, hidden_size=4)
    assert resolved["train_batch_size"] == 4 * 3 * 2  # from the config's own micro and steps
    assert resolved["optimizer"]["params"]["lr"] == 5e-5
    assert resolved["zero_optimization"]["reduce_bucket_size"] == 2e8
    written = {"train_batch_size": 32, "zero_optimization": {"stage": 1}}
    assert resolve_auto(written, world_size=8) == written


def test_resolve_auto_refuses_placeholders_hugging_face_never_fills():
    with pytest.raises(ConfigError, match=r'^zero_optimization.stage: "auto" is not a placeholder '
                                          r"Hugging Face fills; write a value$"):
        resolve_auto({"zero_optimization": {"stage": "auto"}}, world_size=1)
    with pytest.raises(ConfigError, match=r"^world_size: expected a positive integer, got 0$"):
        resolve_auto({}, world_size=0)


def test_resolve_auto_reads_files(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "bfloat16": {"enabled": "auto"}}))
    assert resolve_auto(path, world_size=1, micro_batch_size=2, bf16=True) == {
        "train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": True}}


def test_gradient_clipping_defaults_to_deepspeeds_value():
    """A JSON without gradient_clipping clips as DeepSpeed does (its runtime constants)."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from zeropp.config import EngineConfig

    assert EngineConfig.from_mapping({}).gradient_clipping == GRADIENT_CLIPPING_DEFAULT == 1.0
    assert EngineConfig.from_mapping({"gradient_clipping": 0.0}).gradient_clipping == 0.0

