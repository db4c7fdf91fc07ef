"""DeepSpeed JSON -> typed, validated engine configuration.

Users drive this engine with the DeepSpeed config they already know (the ZeRO++ tutorial's
``zero_optimization`` block, ``fp16``, ``optimizer``, ...). This module turns that JSON into
frozen dataclasses and refuses anything it cannot honour, so a run never silently differs from
what its config says:

* every key is exactly one of: a dataclass field (the engine acts on it), an ``ACCEPTED`` key
  (harmless here; the table says what happens to it), an ``UNSUPPORTED`` key (a DeepSpeed
  feature this engine lacks; accepted only at a value that leaves it off) or an ``ALIASES``
  key (another spelling of a key);
* anything else is an unknown key, reported with the nearest known spelling;
* values are checked strictly: integral floats such as ``1e7`` count as integers, but strings,
  booleans for numbers, numbers for booleans and Hugging Face ``"auto"`` placeholders do not.

Hugging Face's ``"auto"`` placeholders are filled before parsing by ``resolve_auto``, with the
values HF's Trainer would put there. Offload is refused unless its device is ``"none"``; the
offload blocks' other keys and the ``aio`` block then describe no offload and are accepted.

Errors are ``ConfigError`` with one line naming the key path and the offending value. Batch
sizes are resolved against the data-parallel world size by DeepSpeed's rules
(``EngineConfig.resolve_batch``). Whether ``zero_hpz_partition_size`` divides the ranks per
node depends on the launch and is checked by the topology, not here.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from os import PathLike
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, NoReturn, TypeVar


class ConfigError(ValueError):
    """A config problem, described in one line that names the key path and the value."""


def read_json_config(path_or_dict: str | PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Return the config as a fresh dict: a mapping is deep-copied, a path is parsed strictly.

    Parse errors carry ``file:line:column``; duplicate keys and NaN/Infinity are rejected
    because Python's json module would otherwise accept them silently.
    """
    if isinstance(path_or_dict, Mapping):
        return copy.deepcopy(dict(path_or_dict))
    if not isinstance(path_or_dict, (str, PathLike)):
        raise ConfigError(f"config: expected a file path or a dict, got {type(path_or_dict).__name__}")
    path = Path(path_or_dict)
    if not path.is_file():
        if path.exists():
            raise ConfigError(f"{path}: not a regular file, expected a DeepSpeed JSON config")
        raise FileNotFoundError(f"DeepSpeed config file not found: {path}")

    def reject_constant(name: str) -> NoReturn:
        raise ConfigError(f"{path}: {name} is not valid JSON; write a finite number")

    def reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:  # json would keep the last one and hide the conflict
                raise ConfigError(f"{path}: duplicate key '{key}' in one JSON object")
            seen.add(key)
        return dict(pairs)

    try:
        text = path.read_text(encoding="utf-8")
        loaded = json.loads(text, object_pairs_hook=reject_duplicates, parse_constant=reject_constant)
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}:{error.lineno}:{error.colno}: {error.msg}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object, got {type(loaded).__name__}")
    return loaded


# Value checks: each takes (key path, raw value) and returns the normalized value or raises.
Check = Callable[[str, Any], Any]


def _show(value: Any) -> str:
    """Render a value as JSON, so messages quote what the user wrote."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _fail(path: str, expected: str, value: Any) -> NoReturn:
    if isinstance(value, str) and value.strip().lower() == "auto":
        raise ConfigError(f'{path}: "auto" is a Hugging Face Trainer placeholder; resolve it to '
                          f"{expected} first: zeropp.config.resolve_auto does, and "
                          "zeropp.initialize calls it once the model is known")
    raise ConfigError(f"{path}: expected {expected}, got {_show(value)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(minimum: int, expected: str) -> Check:
    def check(path: str, value: Any) -> int:
        # JSON writers (and people) write 5e8 for 500000000: integral floats are integers.
        integral = _is_number(value) and math.isfinite(value) and float(value).is_integer()
        if not integral or int(value) < minimum:
            _fail(path, expected, value)
        return int(value)

    return check


def _real(minimum: float, inclusive: bool, expected: str, maximum: float = math.inf) -> Check:
    def check(path: str, value: Any) -> float:
        valid = _is_number(value) and math.isfinite(value) and minimum <= value <= maximum
        if not valid or (not inclusive and value == minimum):
            _fail(path, expected, value)
        return float(value)

    return check


_positive_int = _integer(1, "a positive integer")
_non_negative_int = _integer(0, "a non-negative integer")
_positive_float = _real(0.0, False, "a positive number")
_non_negative_float = _real(0.0, True, "a non-negative number")
_unit_interval = _real(0.0, True, "a number in [0, 1]", maximum=1.0)


def _boolean(path: str, value: Any) -> bool:
    # "true" strings and 0/1 are rejected: a quoted flag is usually a templating mistake.
    if not isinstance(value, bool):
        _fail(path, "true or false", value)
    return value


def _optional(check: Check) -> Check:
    return lambda path, value: None if value is None else check(path, value)


def _one_of(*choices: Any) -> Check:
    """Exact choices; strings match case-insensitively and normalize to the listed spelling."""
    expected = "one of " + ", ".join(_show(choice) for choice in choices)

    def check(path: str, value: Any) -> Any:
        for choice in choices:
            if isinstance(choice, str) and isinstance(value, str) and value.lower() == choice.lower():
                return choice
            if _is_number(choice) and _is_number(value) and value == choice:
                return choice
        _fail(path, expected, value)

    return check


def _string(path: str, value: Any) -> str:
    if not isinstance(value, str):
        _fail(path, "a string", value)
    return value


def _string_list(path: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        _fail(path, "an array of strings", value)
    return list(value)


def _devices(path: str, value: Any) -> Any:
    # CUDA_VISIBLE_DEVICES written into the JSON: a device index, a "0,1" string or a list.
    def index(item: Any) -> bool:
        return isinstance(item, int) and not isinstance(item, bool) and item >= 0

    valid = (isinstance(value, str) or index(value)
             or (isinstance(value, list) and all(map(index, value))))
    if not valid:
        _fail(path, "a device index, a string or an array of indices", value)
    return value


def _object(path: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        _fail(path, "an object", value)
    return dict(value)


def _unknown_key(path: str, candidates: set[str]) -> NoReturn:
    key = path.rpartition(".")[2]
    close = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"{path}: unknown key{hint}")


# The key tables. Paths are dotted from the top of the JSON.
class Accepted(NamedTuple):
    check: Check
    meaning: str  # what this engine does with the key


class Unsupported(NamedTuple):
    reason: str
    inert: tuple[Any, ...] = ()  # values that leave the feature off, hence accepted


DISABLED_BLOCK = object()  # inert marker: an object whose "enabled" is false


def _under(section: str, entries: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": entry for key, entry in entries.items()}


def _same_meaning(meaning: str, **checks: Check) -> dict[str, Accepted]:
    return {key: Accepted(check, meaning) for key, check in checks.items()}


_STAGE3_SHORT_NAMES = (
    "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "model_persistence_threshold",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")
ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    **_under("zero_optimization", {name: f"zero_optimization.stage3_{name}" for name in _STAGE3_SHORT_NAMES}),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}

_CLI_CHECKPOINTING = "no effect: --checkpoint-activations alone controls recomputation"
_PROFILER_OFF = "no effect: the flops profiler is not reproduced"
_BYTE_ACCOUNTING = "no effect: the engine's own byte accounting reports communication volume"
# Offload sub-keys and the aio block only tune offload I/O. They are accepted because the
# offload device itself is refused unless it is "none": they can only ever describe no offload.
_OFFLOAD_OFF = 'no effect: offload is off (its device is "none")'
_NVME_IO = 'no effect: NVMe I/O for offload, which is off (a device other than "none" is refused)'

ACCEPTED: dict[str, Accepted] = {
    "zero_allow_untested_optimizer": Accepted(
        _boolean, "no effect: the engine always runs its own partitioned optimizer"),
    "memory_breakdown": Accepted(_boolean, "no effect: DeepSpeed's memory printout is not reproduced"),
    "zero_force_ds_cpu_optimizer": Accepted(_boolean, "no effect: concerns CPU offload, which is rejected"),
    **_under("comms_logger", _same_meaning(_BYTE_ACCOUNTING, enabled=_boolean, verbose=_boolean,
                                           prof_all=_boolean, prof_ops=_string_list, debug=_boolean)),
    "cuda_visible_devices": Accepted(
        _devices, "no effect: DeepSpeed's config does not read it either; the launcher picks devices"),
    "dataloader_drop_last": Accepted(
        _boolean, "no effect: concerns deepspeed_io's loader; the application's loader decides"),
    **_under("flops_profiler", _same_meaning(
        _PROFILER_OFF, enabled=_boolean, profile_step=_positive_int,
        module_depth=_integer(-1, "an integer >= -1"), top_modules=_positive_int,
        detailed=_boolean, output_file=_optional(_string),
        recompute_fwd_factor=_non_negative_float)),
    **_under("activation_checkpointing", {
        **_same_meaning(_CLI_CHECKPOINTING, number_checkpoints=_optional(_positive_int),
                        contiguous_memory_optimization=_boolean,
                        synchronize_checkpoint_boundary=_boolean, profile=_boolean),
        "partition_activations": Accepted(_boolean, "no effect: there are no tensor-parallel ranks"),
    }),
    **_under("aio", {
        **_same_meaning(_NVME_IO, block_size=_positive_int, queue_depth=_positive_int,
                        intra_op_parallelism=_positive_int, single_submit=_boolean,
                        overlap_events=_boolean, use_gds=_boolean),
        "thread_count": Accepted(_positive_int, "no effect: DeepSpeed 0.19 no longer reads it "
                                 "(renamed intra_op_parallelism); NVMe I/O is not used"),
    }),
    **_under("zero_optimization.offload_param", _same_meaning(
        _OFFLOAD_OFF, nvme_path=_optional(_string), buffer_count=_non_negative_int,
        buffer_size=_non_negative_int, max_in_cpu=_non_negative_int, pin_memory=_boolean)),
    **_under("zero_optimization.offload_optimizer", _same_meaning(
        _OFFLOAD_OFF, nvme_path=_optional(_string), buffer_count=_non_negative_int,
        pin_memory=_boolean, pipeline_read=_boolean, pipeline_write=_boolean, fast_init=_boolean,
        ratio=_unit_interval, super_offload=_boolean, cpuadam_cores_perc=_unit_interval)),
    "optimizer.params.torch_adam": Accepted(
        _boolean, "no effect on the update: torch's kernel instead of DeepSpeed's (with torch's "
        "AdamW, a missing weight_decay is torch's 0.01)"),
    "optimizer.params.adam_w_mode": Accepted(
        _boolean, "type Adam: true = AdamW, false = Adam with L2 decay; type AdamW ignores it"),
    "checkpoint.tag_validation": Accepted(_one_of("Ignore", "Warn", "Fail"),
                                          "no effect: the application checks checkpoint tags"),
    "bf16.immediate_grad_update": Accepted(_boolean, "no effect: a stage 0-2 bf16 optimizer detail"),
    **_under("zero_optimization", {
        "allgather_bucket_size": Accepted(_non_negative_int, "no effect: stage 3 gathers module groups"),
        "allgather_partitions": Accepted(_boolean, "no effect: shards are always all-gathered"),
        "use_multi_rank_bucket_allreduce": Accepted(_boolean, "no effect: a stage 1/2 option"),
        "sub_group_size": Accepted(_non_negative_int, "no effect: the optimizer steps a whole shard"),
        "round_robin_gradients": Accepted(_boolean, "no effect: a stage 1/2 offload option"),
        "ignore_unused_parameters": Accepted(_boolean, "no effect: a stage 2 check"),
        "parameter_alignment": Accepted(_boolean, "no effect: flat buffers have their own padding"),
        "memory_efficient_linear": Accepted(_boolean, "no effect: nn.Linear is never replaced"),
        "override_module_apply": Accepted(_boolean, "no effect: module.apply is never wrapped"),
        "log_trace_cache_warnings": Accepted(_boolean, "no effect: there is no trace cache"),
        "enable_sanity_checks": Accepted(_boolean, "no effect: DeepSpeed-internal debug checks"),
        "save_muon_momentum_buffer_in_memory": Accepted(_boolean, "no effect: concerns NVMe offload"),
        "stage3_module_granularity_threshold": Accepted(
            _non_negative_int, "no effect: the gather unit is always a whole module group"),
        "stage3_use_all_reduce_for_fetch_params": Accepted(
            _boolean, "no effect: parameters are always fetched by all-gather"),
        "stage3_allgather_sequential": Accepted(
            _boolean, "no effect: each module group is one flat buffer, gathered in one call"),
    }),
}

_DEVICE_ONLY = "ZeRO-3/ZeRO++ on device memory only"
_DATA_PARALLEL_ONLY = "this engine is data-parallel only"
_OFFLOAD = f"CPU/NVMe offload; {_DEVICE_ONLY}"
_OFF = (DISABLED_BLOCK,)

UNSUPPORTED: dict[str, Unsupported] = {
    "amp": Unsupported("NVIDIA Apex AMP; use the fp16 or bf16 block", _OFF),
    "torch_autocast": Unsupported("torch.autocast; use the fp16 or bf16 block", _OFF),
    "compression_training": Unsupported("quantization-aware training and pruning"),
    "quantize_training": Unsupported("MoQ quantization-aware training", _OFF),
    "weight_quantization": Unsupported("inference weight quantization; qwZ quantizes on the wire"),
    "sparse_attention": Unsupported("sparse attention; the GPT model uses dense attention"),
    "pipeline": Unsupported(f"pipeline parallelism; {_DATA_PARALLEL_ONLY}"),
    "tensor_parallel": Unsupported(f"tensor parallelism; {_DATA_PARALLEL_ONLY}"),
    "sequence_parallel_size": Unsupported(f"sequence parallelism; {_DATA_PARALLEL_ONLY}", (1,)),
    "elasticity": Unsupported("elastic batch sizing; set the batch keys directly", _OFF),
    "data_efficiency": Unsupported("data sampling and routing; the GPT dataset orders data", _OFF),
    "curriculum_learning": Unsupported("curriculum learning", _OFF),
    "progressive_layer_drop": Unsupported("progressive layer dropping", _OFF),
    "eigenvalue": Unsupported("Hessian eigenvalue estimation", _OFF),
    "autotuning": Unsupported("the DeepSpeed autotuner", _OFF),
    "hybrid_engine": Unsupported("the RLHF hybrid engine", _OFF),
    "compile": Unsupported("DeepCompile", ({},)),
    "comet": Unsupported("the Comet monitor; use the W&B or TensorBoard writers", _OFF),
    "gradient_allreduce_op": Unsupported("gradients are always averaged", ("mean",)),
    "fp16.auto_cast": Unsupported("input autocasting; the model casts its own activations", (False,)),
    "fp16.fp16_master_weights_and_grads": Unsupported("master weights stay fp32", (False,)),
    "bf16.bf16_master_weights_and_grads": Unsupported("master weights stay fp32", (False,)),
    "bf16.bf16_optimizer_states": Unsupported("optimizer states stay fp32", (False,)),
    "bf16.check_overflow": Unsupported("skipping bf16 steps on inf/nan gradients", (False,)),
    "activation_checkpointing.cpu_checkpointing": Unsupported(
        "checkpointed activations stay in device memory", (False,)),
    "data_types.grad_accum_dtype": Unsupported(
        "gradients accumulate across micro-batches in fp32; 16-bit accumulation would round "
        "them", (None, "fp32")),
    "data_types.param_dtype": Unsupported("weights take the fp16/bf16 block's dtype", (None,)),
    "data_types.buffer_dtype": Unsupported("buffers keep the dtype the model gives them", (None,)),
    "optimizer.params.bias_correction": Unsupported(
        "the Adam update always corrects the moment bias", (True,)),
    "optimizer.params.max_grad_norm": Unsupported("DeepSpeed rejects it too: use gradient_clipping"),
    "checkpoint.load_universal": Unsupported("universal checkpoints", (False,)),
    "checkpoint.use_node_local_storage": Unsupported("node-local checkpoint storage", (False,)),
    **_under("zero_optimization", {
        "offload_param.device": Unsupported(_OFFLOAD, ("none",)),
        "offload_optimizer.device": Unsupported(_OFFLOAD, ("none",)),
        "cpu_offload": Unsupported(_DEVICE_ONLY, (None, False)),
        "cpu_offload_param": Unsupported(_DEVICE_ONLY, (None, False)),
        "cpu_offload_use_pin_memory": Unsupported(_DEVICE_ONLY, (None, False)),
        "zenflow": Unsupported(f"ZenFlow offloaded updates; {_DEVICE_ONLY}", (None,)),
        "mics_shard_size": Unsupported("MiCS; zero_hpz_partition_size gives node-local gathers", (-1,)),
        "mics_hierarchical_params_gather": Unsupported("MiCS sharding", (False,)),
        "reduce_scatter": Unsupported(
            "stages 1-3 always reduce-scatter gradients and stage 0 all-reduces them", (True,)),
        "contiguous_gradients": Unsupported(
            "gradients always move into one flat buffer per module group", (True,)),
        "zero_quantized_nontrainable_weights": Unsupported(
            "weights stored quantized; qwZ quantizes only what crosses the wire", (False,)),
        "stage3_model_persistence_threshold": Unsupported(
            "a cap on persistent parameters; the per-group threshold alone decides", (sys.maxsize,)),
        "elastic_checkpoint": Unsupported("elastic checkpoints", (False,)),
        "legacy_stage1": Unsupported("the legacy stage 1 optimizer", (False,)),
        "load_from_fp32_weights": Unsupported("checkpoints always restore fp32 master weights", (True,)),
        "compute_grad_norm": Unsupported("the global gradient norm is always computed", (True,)),
        "pipeline_loading_checkpoint": Unsupported("pipeline checkpoint loading", (False,)),
        "leaf_module": Unsupported("leaf modules; the gather unit is already a module group", (None, {})),
    }),
}


def _is_inert(value: Any, inert: Any) -> bool:
    if inert is DISABLED_BLOCK:
        return isinstance(value, Mapping) and value.get("enabled") is False
    if isinstance(inert, bool) or isinstance(value, bool):
        return value is inert  # keeps False from matching 0 and True from matching 1
    return value == inert  # 1 == 1.0 as in JSON; dicts compare by content


def _require_inert(path: str, value: Any) -> None:
    entry = UNSUPPORTED.get(path)
    if entry is None or any(_is_inert(value, inert) for inert in entry.inert):
        return
    shown = "" if isinstance(value, (Mapping, list)) else f"={_show(value)}"
    allowed = " or ".join('an object with "enabled": false' if inert is DISABLED_BLOCK
                          else _show(inert) for inert in entry.inert)
    suffix = f"; accepted only as {allowed}" if allowed else ""
    raise ConfigError(f"{path}{shown} is not supported by this engine ({entry.reason}){suffix}")


def _children(section: str) -> set[str]:
    """Names the tables know directly under ``section`` ("" is the top level)."""
    prefix = f"{section}." if section else ""
    return {key[len(prefix):].split(".", 1)[0]
            for key in (*ALIASES, *ACCEPTED, *UNSUPPORTED) if key.startswith(prefix)}


# Blocks DeepSpeed reads as optional: null means the block is absent.
_NULL_MEANS_ABSENT = {"aio", "zero_optimization.offload_param", "zero_optimization.offload_optimizer"}


def _check_table_key(path: str, value: Any, siblings: set[str]) -> None:
    """Validate a key that is no dataclass field: a table entry, an accepted block, or a typo."""
    if value is None and path in _NULL_MEANS_ABSENT:
        return
    if path in UNSUPPORTED:
        _require_inert(path, value)
    elif path in ACCEPTED:
        ACCEPTED[path].check(path, value)
    elif _children(path):
        for key, item in _object(path, value).items():
            if "." in key:  # a dotted key would otherwise alias a nested table path
                _unknown_key(f"{path}.{key}", set())
            _check_table_key(f"{path}.{key}", item, _children(path))
    else:
        _unknown_key(path, siblings)


# Typed sections. Each field carries its one-line doc and its check in the field metadata.
def _field(default: Any, doc: str, check: Check, *, factory: bool = False) -> Any:
    metadata = {"doc": doc, "check": check}
    if factory:
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


SectionT = TypeVar("SectionT", bound="_Section")


class _Section:
    """Shared validation: every field runs its check, also when built directly in code."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for spec in fields(self):  # type: ignore[arg-type]
            path = _join(self.SECTION, spec.name)
            value = spec.metadata["check"](path, getattr(self, spec.name))
            _require_inert(path, value)
            object.__setattr__(self, spec.name, value)
        self._check_combination()

    def _check_combination(self) -> None:
        """Cross-field rules and normalization; a no-op where a section has none."""

    @classmethod
    def from_mapping(cls: type[SectionT], raw: Mapping[str, Any]) -> SectionT:
        """Build from JSON keys: resolve aliases, route table keys, reject unknown keys."""
        names = {spec.name for spec in fields(cls)}  # type: ignore[arg-type]
        given: dict[str, Any] = {}
        spelled: dict[str, str] = {}
        for key, value in raw.items():
            path = ALIASES.get(_join(cls.SECTION, key), _join(cls.SECTION, key))
            name = path.rpartition(".")[2]
            if "." in key:  # a dotted key would otherwise alias a nested table path
                _unknown_key(_join(cls.SECTION, key), set())
            if name not in names or path != _join(cls.SECTION, name):
                _check_table_key(path, value, names | _children(cls.SECTION))
            elif name in given:
                raise ConfigError(f"{_join(cls.SECTION, key)}: same setting as '{spelled[name]}', "
                                  "which is also given; keep one")
            else:
                given[name], spelled[name] = value, key
        return cls(**given)


def _section(section_cls: type[_Section]) -> Check:
    def check(path: str, value: Any) -> Any:
        if isinstance(value, section_cls):
            return value
        return section_cls.from_mapping(_object(path, value))

    return check


@dataclass(frozen=True)
class FP16Config(_Section):
    """fp16 mixed precision with dynamic loss scaling (DeepSpeed's ``fp16`` block)."""

    SECTION: ClassVar[str] = "fp16"
    enabled: bool = _field(False, "train in fp16 with fp32 master weights", _boolean)
    loss_scale: float = _field(0.0, "static loss scale; 0 selects dynamic scaling", _non_negative_float)
    initial_scale_power: int = _field(16, "dynamic scaling starts at 2**this", _non_negative_int)
    loss_scale_window: int = _field(1000, "overflow-free steps before the scale doubles", _positive_int)
    hysteresis: int = _field(2, "overflows tolerated before the scale halves", _positive_int)
    consecutive_hysteresis: bool = _field(False, "refill hysteresis after each clean step", _boolean)
    min_loss_scale: float = _field(1.0, "dynamic scaling never goes below this", _positive_float)


@dataclass(frozen=True)
class BF16Config(_Section):
    """bf16 mixed precision (no loss scaling: bf16 has fp32's exponent range)."""

    SECTION: ClassVar[str] = "bf16"
    enabled: bool = _field(False, "train in bf16 with fp32 master weights", _boolean)


_REQUIRED = object()  # marks a parameter without a default


def _betas(path: str, value: Any) -> list[float]:
    betas = value if isinstance(value, (list, tuple)) and len(value) == 2 else [math.nan]
    if not all(_is_number(beta) and 0.0 <= beta < 1.0 for beta in betas):
        _fail(path, "two numbers in [0, 1)", value)
    return [float(beta) for beta in betas]


# Each optimizer's parameters: the keyword arguments of its torch.optim class, with the
# defaults DeepSpeed passes (FusedAdam's for Adam/AdamW, torch's for SGD and Adagrad).
_ADAM_PARAMS: dict[str, tuple[Check, Any]] = {
    "lr": (_positive_float, 1e-3),
    "betas": (_betas, [0.9, 0.999]),
    "eps": (_positive_float, 1e-8),
    "weight_decay": (_non_negative_float, 0.0),
    "amsgrad": (_boolean, False),
}
_OPTIMIZER_PARAMS: dict[str, dict[str, tuple[Check, Any]]] = {
    "AdamW": _ADAM_PARAMS,
    "Adam": _ADAM_PARAMS,
    "SGD": {"lr": (_positive_float, 1e-3), "momentum": (_non_negative_float, 0.0),
            "dampening": (_non_negative_float, 0.0), "weight_decay": (_non_negative_float, 0.0),
            "nesterov": (_boolean, False)},
    "Adagrad": {"lr": (_positive_float, 0.01), "lr_decay": (_non_negative_float, 0.0),
                "weight_decay": (_non_negative_float, 0.0),
                "initial_accumulator_value": (_non_negative_float, 0.0),
                "eps": (_positive_float, 1e-10)},
}
# The optimizer steps each rank's flat shard on its own, so only element-wise updates qualify.
_NOT_ELEMENT_WISE = "not element-wise: a rank's shard cannot step on its own"
_REFUSED_OPTIMIZERS = {
    "lamb": f"LAMB scales each tensor by its own trust ratio; {_NOT_ELEMENT_WISE}",
    "onebitadam": "1-bit Adam needs its own compressed communication",
    "zerooneadam": "0/1 Adam needs its own compressed communication",
    "onebitlamb": f"1-bit LAMB needs its own compressed communication; {_NOT_ELEMENT_WISE}",
    "lion": "Lion; the partitioned optimizer implements AdamW, Adam, SGD and Adagrad",
    "muon": f"Muon orthogonalizes whole matrices; {_NOT_ELEMENT_WISE}",
    **{name: f"muP scales each tensor by its width; {_NOT_ELEMENT_WISE}"
       for name in ("muadam", "muadamw", "musgd")},
}
# DeepSpeed keys of the Adam block that are no torch.optim.Adam(W) keyword arguments.
_ADAM_SWITCHES = ("torch_adam", "adam_w_mode", "bias_correction")


def _fill_params(path: str, raw: Any, table: Mapping[str, tuple[Check, Any]]) -> dict[str, Any]:
    """Check the given parameters and fill the missing ones with DeepSpeed's defaults."""
    given = _object(path, raw)
    for key in given.keys() - table.keys():
        _unknown_key(f"{path}.{key}", set(table))
    params = {}
    for key, (check, default) in table.items():
        if key in given:
            params[key] = check(f"{path}.{key}", given[key])
        elif default is _REQUIRED:
            raise ConfigError(f"{path}.{key}: required for this type and missing")
        else:
            params[key] = copy.deepcopy(default)
    return params


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    """The optimizer, stepped over each rank's fp32 shard: AdamW, Adam, SGD or Adagrad."""

    SECTION: ClassVar[str] = "optimizer"
    type: str = _field("AdamW", "AdamW, Adam (L2-coupled decay), SGD or Adagrad; DeepSpeed's Adam "
                       "with adam_w_mode true (its default) is AdamW", _string)
    params: dict[str, Any] = _field(dict, "the torch.optim keyword arguments; missing ones filled",
                                    _object, factory=True)

    def _check_combination(self) -> None:
        given = dict(self.params)
        kind = {name.lower(): name for name in _OPTIMIZER_PARAMS}.get(self.type.lower())
        if kind is None:
            reason = _REFUSED_OPTIMIZERS.get(self.type.lower(), "the partitioned optimizer "
                                             "implements AdamW, Adam, SGD and Adagrad")
            raise ConfigError(f"optimizer.type={_show(self.type)} is not supported by this engine "
                              f"({reason})")
        if "max_grad_norm" in given:  # DeepSpeed refuses it for every optimizer type
            _require_inert("optimizer.params.max_grad_norm", given["max_grad_norm"])
        defaults = _OPTIMIZER_PARAMS[kind]
        if kind in ("Adam", "AdamW"):
            switches = {key: given.pop(key) for key in _ADAM_SWITCHES if key in given}
            for key, value in switches.items():
                _check_table_key(f"optimizer.params.{key}", value, set())
            # DeepSpeed: type AdamW is always decoupled; Adam is decoupled unless adam_w_mode false.
            if kind == "Adam" and switches.get("adam_w_mode", True):
                kind = "AdamW"
            if kind == "AdamW" and switches.get("torch_adam", False):
                # torch_adam builds torch.optim.AdamW, whose own weight_decay default is 0.01.
                defaults = {**defaults, "weight_decay": (_non_negative_float, 0.01)}
        params = _fill_params("optimizer.params", given, defaults)
        if kind == "SGD" and params["nesterov"] and (params["momentum"] <= 0 or params["dampening"]):
            raise ConfigError("optimizer.params.nesterov=true needs momentum > 0 and dampening 0 "
                              f"(got momentum {params['momentum']}, dampening {params['dampening']})")
        object.__setattr__(self, "type", kind)
        object.__setattr__(self, "params", params)

    def to_dict(self) -> dict[str, Any]:
        """DeepSpeed JSON meaning the same: normalized "Adam" needs adam_w_mode false spelled out."""
        switch = {"adam_w_mode": False} if self.type == "Adam" else {}
        return {"type": self.type, "params": {**copy.deepcopy(self.params), **switch}}


_WARMUP = {"warmup_num_steps": (_positive_int, 1000), "warmup_type": (_one_of("log", "linear"), "log")}
_SCHEDULER_PARAMS: dict[str, dict[str, tuple[Check, Any]]] = {
    # warmup_max_lr None: the optimizer's lr, as in DeepSpeed
    "WarmupLR": {"warmup_min_lr": (_non_negative_float, 0.0),
                 "warmup_max_lr": (_optional(_positive_float), None), **_WARMUP},
    "WarmupDecayLR": {"total_num_steps": (_positive_int, _REQUIRED),
                      "warmup_min_lr": (_non_negative_float, 0.0),
                      "warmup_max_lr": (_positive_float, 0.001), **_WARMUP},
    "WarmupCosineLR": {"total_num_steps": (_positive_int, _REQUIRED),
                       "warmup_min_ratio": (_unit_interval, 0.0),
                       "cos_min_ratio": (_unit_interval, 0.0001), **_WARMUP},
}


@dataclass(frozen=True)
class SchedulerConfig(_Section):
    """The learning-rate schedule, one of DeepSpeed's warmup schedules."""

    SECTION: ClassVar[str] = "scheduler"
    type: str = _field("WarmupLR", "WarmupLR, WarmupDecayLR or WarmupCosineLR",
                       _one_of(*_SCHEDULER_PARAMS))
    params: dict[str, Any] = _field(dict, "the schedule's parameters; missing ones filled",
                                    _object, factory=True)

    def _check_combination(self) -> None:
        params = _fill_params("scheduler.params", self.params, _SCHEDULER_PARAMS[self.type])
        object.__setattr__(self, "params", params)
        total, warmup = params.get("total_num_steps"), params["warmup_num_steps"]
        if total is not None and total < warmup:
            raise ConfigError(f"scheduler.params: total_num_steps {total} is smaller than "
                              f"warmup_num_steps {warmup}")


def _fraction_below_one(path: str, value: Any) -> float:
    if not (_is_number(value) and 0.0 <= value < 1.0):
        _fail(path, "a number in [0, 1)", value)
    return float(value)


# DeepSpeed's LoCo defaults: error = err_beta * error + (1 - err_beta) * new error, and
# every reset_T optimizer steps the error starts again from zero.
_LOCO_PARAMS: dict[str, tuple[Check, Any]] = {
    "err_beta": (_fraction_below_one, 0.8),
    "reset_T": (_positive_int, 1024),
}


@dataclass(frozen=True)
class ZeroConfig(_Section):
    """ZeRO-3 partitioning and the three ZeRO++ communication optimizations."""

    SECTION: ClassVar[str] = "zero_optimization"
    stage: int = _field(0, "0 = replicated data parallel, 1 = optimizer states partitioned, "
                        "2 = and gradients, 3 = and weights", _one_of(0, 1, 2, 3))
    reduce_bucket_size: int = _field(500_000_000, "gradient elements per reduction bucket", _positive_int)
    overlap_comm: bool = _field(True, "overlap reductions and gathers with compute", _boolean)
    stage3_prefetch_bucket_size: int = _field(
        50_000_000, "parameter elements gathered ahead of use; 0 disables prefetch", _non_negative_int)
    stage3_max_live_parameters: int = _field(
        1_000_000_000, "gathered parameter elements allowed at once", _non_negative_int)
    stage3_max_reuse_distance: int = _field(
        1_000_000_000, "keep a gathered group reused within this many elements", _non_negative_int)
    stage3_param_persistence_threshold: int = _field(
        100_000, "module groups smaller than this stay gathered", _non_negative_int)
    stage3_gather_16bit_weights_on_model_save: bool = _field(
        False, "also save the full 16-bit weights, gathered", _boolean)
    zero_quantized_weights: bool = _field(False, "qwZ: block-quantized forward all-gather", _boolean)
    zero_hpz_partition_size: int = _field(
        1, "hpZ: ranks in the secondary partition (ranks per node); 1 = off", _positive_int)
    zero_quantized_gradients: bool = _field(
        False, "qgZ: quantized hierarchical all-to-all replaces reduce-scatter", _boolean)
    zero_hpz_quantized_secondary: bool = _field(
        True, "hpZ with qwZ: keep secondary shards as the forward's int8 payload (the same "
        "weights, half the bytes); false keeps them 16-bit", _boolean)
    zero_quantized_weights_bits: int = _field(8, "qwZ integer width: 8 or 4", _one_of(8, 4))
    zero_quantized_gradients_bits: int = _field(4, "qgZ integer width: 4 or 8", _one_of(4, 8))
    zero_quantization_block_size: int = _field(
        256, "elements per fp32 scale in qwZ/qgZ; any positive size", _positive_int)
    zero_quantized_gradients_error_feedback: bool = _field(
        False, "qgZ: carry each rank's quantization error into the next step", _boolean)
    zeropp_loco_param: dict[str, Any] | None = _field(
        None, "LoCo error feedback for qgZ: err_beta (moving average), reset_T (steps)",
        _optional(_object))
    zero_quantized_weight_deltas: bool = _field(
        False, "forward gather sends each shard's change since the last step, quantized, "
        "across nodes (needs hpZ over the node); replaces qwZ's gather", _boolean)
    zero_quantized_weight_deltas_bits: int = _field(
        4, "weight-delta integer width: 4 or 8", _one_of(4, 8))
    zero_quantized_weight_deltas_block_size: int = _field(
        2048, "elements per fp32 scale of a weight delta", _positive_int)

    def _check_combination(self) -> None:
        zeropp = {"zero_quantized_weights": ("qwZ", self.zero_quantized_weights),
                  "zero_hpz_partition_size": ("hpZ", self.zero_hpz_partition_size > 1),
                  "zero_quantized_gradients": ("qgZ", self.zero_quantized_gradients),
                  "zero_quantized_weight_deltas": ("weight deltas",
                                                   self.zero_quantized_weight_deltas)}
        for key, (name, enabled) in zeropp.items():
            if enabled and self.stage == 0:
                raise ConfigError(f"zero_optimization.{key}: {name} extends ZeRO-3 and needs "
                                  f"stage 3, got stage {self.stage}")
        if (self.zero_quantized_weight_deltas and self.stage == 3
                and self.zero_hpz_partition_size == 1):
            raise ConfigError("zero_optimization.zero_quantized_weight_deltas: needs "
                              "zero_hpz_partition_size set to the ranks per node (each node "
                              "keeps the weights the deltas apply to)")
        if self.zero_quantized_gradients_error_feedback and not self.zero_quantized_gradients:
            raise ConfigError("zero_optimization.zero_quantized_gradients_error_feedback: "
                              "needs zero_quantized_gradients true")
        if self.zeropp_loco_param is not None:
            if not self.zero_quantized_gradients:
                raise ConfigError("zero_optimization.zeropp_loco_param: LoCo error feedback "
                                  "needs zero_quantized_gradients true")
            object.__setattr__(self, "zeropp_loco_param", _fill_params(
                "zero_optimization.zeropp_loco_param", self.zeropp_loco_param, _LOCO_PARAMS))

    @property
    def inert_keys(self) -> list[str]:
        """ZeRO++ keys set here that stage 1 or 2 leaves without effect: qwZ and hpZ change
        how stage 3 gathers weights, qgZ how it reduces them (DeepSpeed reads them at stage 3
        only, so the tutorial's JSON runs at stage 1 and 2 unchanged)."""
        if self.stage not in (1, 2):
            return []
        enabled = {"zero_quantized_weights": self.zero_quantized_weights,
                   "zero_hpz_partition_size": self.zero_hpz_partition_size > 1,
                   "zero_quantized_gradients": self.zero_quantized_gradients,
                   "zero_quantized_weight_deltas": self.zero_quantized_weight_deltas}
        return [f"zero_optimization.{key}" for key, on in enabled.items() if on]

    @property
    def error_feedback(self) -> tuple[float, int] | None:
        """(err_beta, reset_T) when qgZ carries its quantization error; None when it does not.

        ``zero_quantized_gradients_error_feedback`` alone is plain error feedback (beta 0,
        never reset); DeepSpeed's ``zeropp_loco_param`` block gives LoCo's moving average.
        """
        if self.zeropp_loco_param is not None:
            return self.zeropp_loco_param["err_beta"], self.zeropp_loco_param["reset_T"]
        return (0.0, 0) if self.zero_quantized_gradients_error_feedback else None


_batch = _optional(_positive_int)


@dataclass(frozen=True)
class TensorBoardConfig(_Section):
    """DeepSpeed's TensorBoard monitor: scalars under output_path/job_name (rank 0)."""

    SECTION: ClassVar[str] = "tensorboard"
    enabled: bool = _field(False, "write the engine's scalars there", _boolean)
    output_path: str = _field("", "directory of the job directories", _string)
    job_name: str = _field("DeepSpeedJobName", "directory of this job's files", _string)


@dataclass(frozen=True)
class CSVMonitorConfig(TensorBoardConfig):
    """DeepSpeed's CSV monitor: the same keys, one CSV file per scalar."""

    SECTION: ClassVar[str] = "csv_monitor"


@dataclass(frozen=True)
class WandbConfig(_Section):
    """DeepSpeed's W&B monitor (offline when WANDB_MODE=offline or no API key)."""

    SECTION: ClassVar[str] = "wandb"
    enabled: bool = _field(False, "log the engine's scalars to W&B", _boolean)
    group: str | None = _field(None, "W&B run group", _optional(_string))
    team: str | None = _field(None, "W&B entity", _optional(_string))
    project: str = _field("deepspeed", "W&B project", _string)


@dataclass(frozen=True)
class EngineConfig(_Section):
    """The whole DeepSpeed JSON, validated. Build it with ``EngineConfig.from_json``."""

    SECTION: ClassVar[str] = ""
    train_batch_size: int | None = _field(None, "samples per optimizer step, all ranks", _batch)
    train_micro_batch_size_per_gpu: int | None = _field(None, "samples per rank per pass", _batch)
    gradient_accumulation_steps: int | None = _field(None, "micro-batches per step", _batch)
    gradient_clipping: float = _field(0.0, "max global gradient norm; 0 = off", _non_negative_float)
    fp16: FP16Config = _field(FP16Config, "fp16 mixed precision", _section(FP16Config), factory=True)
    bf16: BF16Config = _field(BF16Config, "bf16 mixed precision", _section(BF16Config), factory=True)
    optimizer: OptimizerConfig | None = _field(
        None, "None leaves the optimizer to the command line", _optional(_section(OptimizerConfig)))
    scheduler: SchedulerConfig | None = _field(
        None, "None leaves the lr schedule to the command line", _optional(_section(SchedulerConfig)))
    zero_optimization: ZeroConfig = _field(
        ZeroConfig, "ZeRO stage and ZeRO++ options", _section(ZeroConfig), factory=True)
    wall_clock_breakdown: bool = _field(
        False, "print forward/backward/step times (ms) per micro-step and per step", _boolean)
    steps_per_print: int = _field(10, "print step, skipped, lr, betas every this many steps",
                                  _positive_int)
    tensorboard: TensorBoardConfig = _field(
        TensorBoardConfig, "TensorBoard monitor", _section(TensorBoardConfig), factory=True)
    csv_monitor: CSVMonitorConfig = _field(
        CSVMonitorConfig, "CSV monitor", _section(CSVMonitorConfig), factory=True)
    wandb: WandbConfig = _field(WandbConfig, "W&B monitor", _section(WandbConfig), factory=True)
    communication_data_type: str | None = _field(
        None, "dtype of unquantized gradient reductions; None = compute dtype",
        _optional(_one_of("fp32", "fp16", "bf16")))
    prescale_gradients: bool = _field(
        False, "divide by the data-parallel size before summing (this engine's default too)",
        _boolean)
    gradient_predivide_factor: float | None = _field(
        None, "divide by this before summing over ranks, the rest after; None = the "
        "data-parallel size (DeepSpeed's stage-3 pre-division), 1.0 = sum first",
        _optional(_positive_float))
    dump_state: bool = _field(False, "print the engine's state when it starts (rank 0)", _boolean)

    def _check_combination(self) -> None:
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one")
        if self.communication_data_type is not None and self.zero_optimization.zero_quantized_gradients:
            raise ConfigError(f"communication_data_type={_show(self.communication_data_type)} "
                              "applies to the exact reduce-scatter; qgZ sends int4/int8 blocks "
                              "and sums in fp32: remove one of the two")

    @property
    def predivide_factor(self) -> float | None:
        """The gradient pre-division factor (None: the data-parallel size).

        As in DeepSpeed, prescale_gradients true divides by the data-parallel size and leaves
        gradient_predivide_factor unused."""
        return None if self.prescale_gradients else self.gradient_predivide_factor

    @classmethod
    def from_json(cls, path_or_dict: str | PathLike[str] | Mapping[str, Any],
                  world_size: int | None = None) -> EngineConfig:
        """Parse and validate; given ``world_size``, also fill in all three batch keys."""
        config = cls.from_mapping(read_json_config(path_or_dict))
        return config if world_size is None else config.with_batch_resolved(world_size)

    def with_batch_resolved(self, world_size: int) -> EngineConfig:
        """This config with all three batch keys filled in for ``world_size`` ranks."""
        total, micro, steps = self.resolve_batch(world_size)
        return dataclasses.replace(self, train_batch_size=total,
                                   train_micro_batch_size_per_gpu=micro,
                                   gradient_accumulation_steps=steps)

    def resolve_batch(self, world_size: int) -> tuple[int, int, int]:
        """(train_batch_size, micro batch per rank, accumulation steps) by DeepSpeed's rules.

        train_batch_size = micro * accumulation * world_size. Any two keys determine the third;
        train_batch_size alone or the micro batch alone imply one accumulation step.
        """
        world = _positive_int("world_size", world_size)
        total, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        steps = self.gradient_accumulation_steps
        if total is None and micro is None:
            raise ConfigError("train_batch_size or train_micro_batch_size_per_gpu must be set "
                              "(gradient_accumulation_steps alone does not fix the batch)")
        if micro is not None and (steps is not None or total is None):
            steps = 1 if steps is None else steps
            derived = micro * steps * world
            if total is not None and total != derived:
                raise ConfigError(
                    f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} * "
                    f"gradient_accumulation_steps {steps} * world_size {world} = {derived}")
            return derived, micro, steps
        assert total is not None  # every combination without it returned above
        if micro is not None:
            divisor = f"train_micro_batch_size_per_gpu {micro} * world_size {world}"
            return total, micro, _exact_quotient(total, micro * world, divisor)
        steps = 1 if steps is None else steps
        divisor = f"gradient_accumulation_steps {steps} * world_size {world}"
        return total, _exact_quotient(total, steps * world, divisor), steps

    @property
    def compute_dtype(self) -> str:
        """The forward/backward dtype: "float16", "bfloat16" or "float32"."""
        if self.fp16.enabled:
            return "float16"
        return "bfloat16" if self.bf16.enabled else "float32"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (for checkpoints); ``from_json(to_dict())`` equals this config."""
        raw = {key: value for key, value in dataclasses.asdict(self).items() if value is not None}
        if self.optimizer is not None:
            raw["optimizer"] = self.optimizer.to_dict()
        return raw


def _exact_quotient(total: int, divisor: int, divisor_text: str) -> int:
    if total % divisor != 0:
        raise ConfigError(f"train_batch_size {total} is not divisible by {divisor_text} = {divisor}")
    return total // divisor


# --- Hugging Face "auto" placeholders -------------------------------------------------------

def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _find_autos(node: Any, path: str = "") -> list[str]:
    if _is_auto(node):
        return [path]
    if isinstance(node, Mapping):
        return [found for key, value in node.items() for found in _find_autos(value, _join(path, key))]
    return []


def _parent(config: dict[str, Any], path: str) -> tuple[dict[str, Any] | None, str]:
    *sections, key = path.split(".")
    node: Any = config
    for section in sections:
        node = node.get(section) if isinstance(node, Mapping) else None
    return (node if isinstance(node, dict) else None), key


_HIDDEN_SIZE_KEYS = {  # zero_optimization keys HF derives from the model's hidden size h
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
    "param_persistence_threshold": lambda h: 10 * h,
}
_SAVE_16BIT_KEYS = ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                    "stage3_gather_fp16_weights_on_model_save")


def resolve_auto(raw: str | PathLike[str] | Mapping[str, Any], *, world_size: int,
                 micro_batch_size: int | None = None, gradient_accumulation_steps: int | None = None,
                 hidden_size: int | None = None, lr: float | None = None,
                 betas: tuple[float, float] | list[float] | None = None, eps: float | None = None,
                 weight_decay: float | None = None, gradient_clipping: float | None = None,
                 fp16: bool | None = None, bf16: bool | None = None,
                 total_num_steps: int | None = None, warmup_steps: float | None = None,
                 save_16bit_model: bool | None = None) -> dict[str, Any]:
    """A copy of the DeepSpeed config with Hugging Face's ``"auto"`` placeholders filled in.

    Contract (the values Hugging Face's Trainer/Accelerate would put there, from the
    TrainingArguments named in brackets):

    * ``train_micro_batch_size_per_gpu`` <- ``micro_batch_size`` [per_device_train_batch_size];
      ``gradient_accumulation_steps`` <- ``gradient_accumulation_steps``, else 1 (HF's default);
      ``train_batch_size`` <- micro * accumulation * ``world_size``, taking each factor from
      the config where it is a number, else from the keyword (accumulation absent: 1).
    * ``zero_optimization``: ``reduce_bucket_size`` <- h*h, ``stage3_prefetch_bucket_size`` <-
      int(0.9*h*h), ``stage3_param_persistence_threshold`` <- 10*h with h = ``hidden_size``
      (the model's ``config.hidden_size``; for a GPT, its width). HF fills the stage-3 pair at
      stage 3 only; here they are filled at any stage, where they have no effect.
      ``stage3_gather_16bit_weights_on_model_save`` <- ``save_16bit_model``, else false
      (Accelerate's ``zero3_save_16bit_model`` default).
    * ``gradient_clipping`` <- ``gradient_clipping`` [max_grad_norm], else 1.0 (the default of
      both the Trainer and Accelerate).
    * ``optimizer.params``: ``lr``, ``betas``, ``eps``, ``weight_decay`` <- the keywords
      [learning_rate, adam_beta1/2, adam_epsilon, weight_decay]; no fallback.
    * ``scheduler.params``: ``warmup_min_lr`` <- 0; ``warmup_max_lr`` <- ``lr``;
      ``total_num_steps`` <- ``total_num_steps`` [num_training_steps]; ``warmup_num_steps`` <-
      max(1, ``warmup_steps``) where a ``warmup_steps`` below 1 is a fraction of
      ``total_num_steps`` (HF's rule); none given: 1 (no warmup, as HF without --warmup_steps).
    * ``fp16.enabled`` / ``bf16.enabled`` (or ``bfloat16.enabled``) <- ``fp16`` / ``bf16``,
      else false (HF without --fp16 / --bf16).

    Keywords only fill placeholders: a concrete value in the config is kept and never compared
    with a keyword (unlike the Trainer, which refuses mismatches), so callers may pass what they
    know. An ``"auto"`` whose keyword is missing and has no fallback raises ``ConfigError``
    naming the key and the keyword to pass; so does an ``"auto"`` where Hugging Face fills
    nothing. Other keys are not validated: ``EngineConfig.from_json`` does that. A config
    without ``"auto"`` comes back equal. ``raw`` is a path or a mapping and is not modified.
    """
    config = read_json_config(raw)
    world = _positive_int("world_size", world_size)

    def keyword(name: str, value: Any, check: Check, fallback: Any = _REQUIRED) -> Callable[[str], Any]:
        """A filler: the keyword's value, checked; else the fallback; else an error naming both."""
        def make(path: str) -> Any:
            if value is None and fallback is _REQUIRED:
                raise ConfigError(f'{path}: "auto" needs a value: pass {name}=... to '
                                  "zeropp.config.resolve_auto (or write the value)")
            return check(name, fallback if value is None else value)
        return make

    def fill(path: str, make: Callable[[str], Any]) -> None:
        node, key = _parent(config, path)
        if node is not None and _is_auto(node.get(key)):
            node[key] = make(path)

    def written(key: str) -> Any:  # a top-level batch key the config gives as a number
        value = config.get(key)
        return None if value is None or _is_auto(value) else value

    micro = keyword("micro_batch_size", micro_batch_size, _positive_int)
    steps = keyword("gradient_accumulation_steps", gradient_accumulation_steps, _positive_int, 1)
    fill("gradient_accumulation_steps", steps)  # first: train_batch_size uses it
    fill("train_micro_batch_size_per_gpu", micro)
    fill("train_batch_size", lambda path: world
         * int(written("train_micro_batch_size_per_gpu") or micro(path))
         * int(written("gradient_accumulation_steps") or steps(path)))
    fill("gradient_clipping", keyword("gradient_clipping", gradient_clipping, _non_negative_float, 1.0))
    fill("fp16.enabled", keyword("fp16", fp16, _boolean, False))
    for section in ("bf16", "bfloat16"):  # HF looks under "bf16" only; DeepSpeed reads both
        fill(f"{section}.enabled", keyword("bf16", bf16, _boolean, False))
    hidden = keyword("hidden_size", hidden_size, _positive_int)
    for key, rule in _HIDDEN_SIZE_KEYS.items():
        fill(f"zero_optimization.{key}", lambda path, rule=rule: rule(hidden(path)))
    for key in _SAVE_16BIT_KEYS:
        fill(f"zero_optimization.{key}", keyword("save_16bit_model", save_16bit_model, _boolean, False))
    for name, value, check in (("lr", lr, _positive_float), ("betas", betas, _betas),
                               ("eps", eps, _positive_float),
                               ("weight_decay", weight_decay, _non_negative_float)):
        fill(f"optimizer.params.{name}", keyword(name, value, check))
    fill("scheduler.params.warmup_min_lr", lambda path: 0)  # no TrainingArguments field: HF writes 0
    fill("scheduler.params.warmup_max_lr", keyword("lr", lr, _positive_float))
    total_steps = keyword("total_num_steps", total_num_steps, _positive_int)
    fill("scheduler.params.total_num_steps", total_steps)

    def warmup(path: str) -> int:
        count = keyword("warmup_steps", warmup_steps, _non_negative_float, 0)(path)
        if 0 < count < 1:  # HF reads a warmup_steps below 1 as a fraction of the run
            count = math.ceil(count * total_steps(path))
        return max(1, int(count))  # HF keeps it positive: DeepSpeed refuses 0

    fill("scheduler.params.warmup_num_steps", warmup)
    left = _find_autos(config)
    if left:
        raise ConfigError(f'{left[0]}: "auto" is not a placeholder Hugging Face fills; write a value')
    return config
