"""Typed sections: the dataclass base every block is built on (each field runs its check,
table keys are routed to ``zeropp.config.keys``) and the blocks fp16, bf16,
zero_optimization and the monitors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from zeropp.config.checks import (
    Check,
    _boolean,
    _fail,
    _fill_params,
    _is_number,
    _non_negative_float,
    _non_negative_int,
    _object,
    _one_of,
    _optional,
    _positive_float,
    _positive_int,
    _string,
    _unknown_key,
)
from zeropp.config.json_reading import ConfigError
from zeropp.config.keys import ALIASES, _check_table_key, _children, _require_inert


# Typed sections. Each field carries its one-line doc and its check in the field metadata.
def _field(default: Any, doc: str, check: Check, *, factory: bool = False) -> Any:
    metadata = {"doc": doc, "check": check}
    if factory:
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _json_fields(section: Any) -> list[Field]:
    """The fields that are JSON keys: all but bookkeeping ones, which carry no check."""
    return [spec for spec in fields(section) if "check" in spec.metadata]


SectionT = TypeVar("SectionT", bound="_Section")


class _Section:
    """Shared validation: every field runs its check, also when built directly in code."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for spec in _json_fields(self):
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
        names = {spec.name for spec in _json_fields(cls)}
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


@dataclass(frozen=True)
class CudaGraphConfig(_Section):
    """The whole iteration as one CUDA graph ([Note: iteration graphs] in
    zeropp/acceleration/cuda_graph.py)."""

    SECTION: ClassVar[str] = "cuda_graph"
    enabled: bool = _field(False, "capture forward, backward and step once, then replay them "
                           "(bf16/fp32 steps decided on the device; else said and run eager)",
                           _boolean)
    warmup_iterations: int = _field(3, "eager iterations before the capture", _positive_int)


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


def _offload_device(path: str, value: Any) -> str:
    device = _one_of("none", "cpu", "nvme")(path, value)
    if device == "nvme":
        raise ConfigError(f'{path}="nvme" is not supported by this engine (NVMe offload); '
                          'supported: "none", "cpu"')
    return device


@dataclass(frozen=True)
class OffloadOptimizerConfig(_Section):
    """ZeRO-Offload of the optimizer ([Note: offload] in zeropp/offload.py)."""

    SECTION: ClassVar[str] = "zero_optimization.offload_optimizer"
    device: str = _field("none", '"cpu": fp32 masters, optimizer states and the step in host '
                         'memory; "none": on the device', _offload_device)
    pin_memory: bool = _field(False, "page-locked host buffers (faster copies on CUDA)", _boolean)


@dataclass(frozen=True)
class OffloadParamConfig(_Section):
    """ZeRO-Offload of the 16-bit parameter shards, stage 3 ([Note: offload])."""

    SECTION: ClassVar[str] = "zero_optimization.offload_param"
    device: str = _field("none", '"cpu": each rank\'s 16-bit weight shard in host memory, '
                         'copied to the device at each gather; "none": on the device',
                         _offload_device)
    pin_memory: bool = _field(False, "page-locked host buffers (faster copies on CUDA)", _boolean)


# DeepSpeed's legacy switches (deprecated there, still read): each true one stands for its
# block with {"device": "cpu"}. DeepSpeed reads cpu_offload_use_pin_memory nowhere.
_LEGACY_OFFLOAD_SWITCHES = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


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
    zero_quantized_gradients_inter_node_bits: int | None = _field(
        None, "qgZ width of the inter-node hop alone: 2 (ternary; needs error feedback), 4 "
        "or 8; null = zero_quantized_gradients_bits", _optional(_one_of(2, 4, 8)))
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
        4, "weight-delta integer width: 2, 4 or 8", _one_of(2, 4, 8))
    zero_quantized_weight_deltas_block_size: int = _field(
        2048, "elements per fp32 scale of a weight delta", _positive_int)
    offload_optimizer: OffloadOptimizerConfig | None = _field(
        None, "ZeRO-Offload of the optimizer: {\"device\": \"cpu\", \"pin_memory\": ...}",
        _optional(_section(OffloadOptimizerConfig)))
    offload_param: OffloadParamConfig | None = _field(
        None, "ZeRO-Offload of the weight shards (stage 3; below it no effect, as in "
        "DeepSpeed): {\"device\": \"cpu\"}", _optional(_section(OffloadParamConfig)))
    ignore_unused_parameters: bool = _field(
        True, "stages 1-2: false makes a step raise when a trainable parameter got no "
        "gradient since the last step (DeepSpeed's check); true reduces it as zeros", _boolean)
    elastic_checkpoint: bool = _field(
        False, "DeepSpeed's stage 1/2 checkpoints loadable at another world size; every "
        "checkpoint here is, so true and false mean the same", _boolean)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> ZeroConfig:
        """``_Section.from_mapping`` after DeepSpeed's legacy offload switches are read as
        the blocks they stand for (``_LEGACY_OFFLOAD_SWITCHES``)."""
        raw = dict(raw)
        for legacy, block in _LEGACY_OFFLOAD_SWITCHES.items():
            value = raw.pop(legacy, None)
            if value is None or not _boolean(f"{cls.SECTION}.{legacy}", value):
                continue
            if raw.get(block) is not None:
                raise ConfigError(f"{cls.SECTION}.{legacy}: same setting as '{block}', which "
                                  "is also given; keep one")
            raw[block] = {"device": "cpu"}
        pin = raw.pop("cpu_offload_use_pin_memory", None)
        if pin is not None:
            _boolean(f"{cls.SECTION}.cpu_offload_use_pin_memory", pin)
        return super().from_mapping(raw)

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer is not None and self.offload_optimizer.device == "cpu"

    @property
    def offloads_params(self) -> bool:
        return self.offload_params_asked and self.stage == 3

    @property
    def offload_params_asked(self) -> bool:
        """offload_param names the CPU, whatever the stage (only stage 3 acts on it)."""
        return self.offload_param is not None and self.offload_param.device == "cpu"

    def _check_combination(self) -> None:
        if self.offloads_optimizer and self.stage == 0:
            raise ConfigError('zero_optimization.offload_optimizer.device="cpu": needs ZeRO '
                              "stage 1, 2 or 3 (the offloaded state is each rank's shard), "
                              "got stage 0")
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
        if self.zero_quantized_gradients_inter_node_bits is not None:
            key = "zero_optimization.zero_quantized_gradients_inter_node_bits"
            if not self.zero_quantized_gradients:
                raise ConfigError(f"{key}: needs zero_quantized_gradients true")
            if (self.zero_quantized_gradients_inter_node_bits == 2
                    and not (self.zero_quantized_gradients_error_feedback
                             or self.zeropp_loco_param is not None)):
                raise ConfigError(f"{key}: 2-bit gradients need error feedback "
                                  "(zero_quantized_gradients_error_feedback true or a "
                                  "zeropp_loco_param block); without it most of each "
                                  "gradient rounds to zero every step")
        if self.zeropp_loco_param is not None:
            if not self.zero_quantized_gradients:
                raise ConfigError("zero_optimization.zeropp_loco_param: LoCo error feedback "
                                  "needs zero_quantized_gradients true")
            object.__setattr__(self, "zeropp_loco_param", _fill_params(
                "zero_optimization.zeropp_loco_param", self.zeropp_loco_param, _LOCO_PARAMS))

    @property
    def ignored_offload_param(self) -> bool:
        """offload_param on the CPU below stage 3: no effect (stages 0-2 keep whole weights
        on the device), which DeepSpeed accepts the same way."""
        return self.offload_params_asked and self.stage != 3

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
class ThroughputTimerConfig(_Section):
    """DeepSpeed's ``timers.throughput``: ``engine.tput_timer`` (zeropp.reports.ThroughputTimer)."""

    SECTION: ClassVar[str] = "timers.throughput"
    enabled: bool = _field(True, "time the steps (samples per second); false: the timer stays "
                           "at -inf and prints nothing", _boolean)
    synchronized: bool = _field(
        False, "synchronize the device at each timed span's start and end (CUDA). DeepSpeed "
        "defaults to true; here false, since a synchronize per step is the host sync the "
        "engine avoids ([Note: step outcome on the device]); the rate is then the host's, "
        "which the GPU's bounds over many steps", _boolean)


@dataclass(frozen=True)
class TimersConfig(_Section):
    """DeepSpeed's ``timers`` block."""

    SECTION: ClassVar[str] = "timers"
    throughput: ThroughputTimerConfig = _field(
        ThroughputTimerConfig, "the throughput timer", _section(ThroughputTimerConfig),
        factory=True)


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    """DeepSpeed's ``checkpoint`` block."""

    SECTION: ClassVar[str] = "checkpoint"
    tag_validation: str = _field(
        "Warn", "ranks passing different tags to save_checkpoint: every rank saves under "
        "rank 0's, with a warning (Warn), silently (Ignore), or the save raises (Fail)",
        _one_of("Ignore", "Warn", "Fail"))


# torch.compile's keyword arguments a ``compile.kwargs`` object may set.
COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options")


def _compile_kwargs(path: str, value: Any) -> dict[str, Any]:
    kwargs = _object(path, value)
    for key in kwargs:
        if key not in COMPILE_KWARGS:
            _unknown_key(f"{path}.{key}", set(COMPILE_KWARGS))
    return kwargs


@dataclass(frozen=True)
class CompileConfig(_Section):
    """torch.compile of each block's computation, the engine's gathers and reductions left
    outside ([Note: compiled blocks] in zeropp/acceleration/compiled_blocks.py). The keys of
    DeepSpeed's earlier ``compile`` block (0.14-0.16: enabled, backend, kwargs; 0.13: disable),
    whose meaning this is; DeepSpeed 0.19's DeepCompile keys are in ``zeropp.config.keys``."""

    SECTION: ClassVar[str] = "compile"
    enabled: bool = _field(False, "compile each block's forward (and so its backward)", _boolean)
    backend: str = _field("inductor", "torch.compile's backend", _string)
    kwargs: dict[str, Any] = _field(dict, "torch.compile's keyword arguments: fullgraph, "
                                    "dynamic, mode, options", _compile_kwargs, factory=True)
    disable: bool | None = _field(None, "DeepSpeed 0.13's switch: false compiles, true does "
                                  "not; None leaves it to enabled", _optional(_boolean))

    def _check_combination(self) -> None:
        if self.disable is None:
            return
        if self.disable and self.enabled:
            raise ConfigError("compile.enabled is true and compile.disable is true; keep one")
        object.__setattr__(self, "enabled", not self.disable)


@dataclass(frozen=True)
class WandbConfig(_Section):
    """DeepSpeed's W&B monitor (offline when WANDB_MODE=offline or no API key)."""

    SECTION: ClassVar[str] = "wandb"
    enabled: bool = _field(False, "log the engine's scalars to W&B", _boolean)
    group: str | None = _field(None, "W&B run group", _optional(_string))
    team: str | None = _field(None, "W&B entity", _optional(_string))
    project: str = _field("deepspeed", "W&B project", _string)
