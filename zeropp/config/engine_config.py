"""The whole DeepSpeed JSON as one typed section, ``EngineConfig``: its blocks, the rules
between them, the batch keys resolved against the world size, and which keys the JSON set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike
from typing import Any, ClassVar

from zeropp.config.batch import _exact_quotient
from zeropp.config.checks import (
    _boolean,
    _non_negative_float,
    _one_of,
    _optional,
    _positive_float,
    _positive_int,
    _show,
)
from zeropp.config.json_reading import ConfigError, read_json_config
from zeropp.config.keys import ALIASES
from zeropp.config.optimizer import OptimizerConfig, SchedulerConfig
from zeropp.config.sections import (
    BF16Config,
    CheckpointConfig,
    CompileConfig,
    CSVMonitorConfig,
    CudaGraphConfig,
    FP16Config,
    TensorBoardConfig,
    TimersConfig,
    WandbConfig,
    ZeroConfig,
    _field,
    _join,
    _Section,
    _section,
)

_batch = _optional(_positive_int)


@dataclass(frozen=True)
class EngineConfig(_Section):
    """The whole DeepSpeed JSON, validated. Build it with ``EngineConfig.from_json``."""

    SECTION: ClassVar[str] = ""
    train_batch_size: int | None = _field(None, "samples per optimizer step, all ranks", _batch)
    train_micro_batch_size_per_gpu: int | None = _field(None, "samples per rank per pass", _batch)
    gradient_accumulation_steps: int | None = _field(None, "micro-batches per step", _batch)
    gradient_clipping: float = _field(1.0, "max global gradient norm; 0 = off (DeepSpeed's "
                                      "default, 1.0, when the JSON is silent)",
                                      _non_negative_float)
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
    timers: TimersConfig = _field(TimersConfig, "engine.tput_timer", _section(TimersConfig),
                                  factory=True)
    checkpoint: CheckpointConfig = _field(
        CheckpointConfig, "checkpoint saves", _section(CheckpointConfig), factory=True)
    cuda_graph: CudaGraphConfig = _field(
        CudaGraphConfig, "the iteration as one CUDA graph", _section(CudaGraphConfig),
        factory=True)
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
    compile: CompileConfig = _field(
        CompileConfig, "compiled blocks (torch.compile)", _section(CompileConfig), factory=True)
    dump_state: bool = _field(False, "print the engine's state when it starts (rank 0)", _boolean)
    # Not a JSON key (no check): what the parse saw, so that a caller with settings of its own
    # (the application's command line) can tell a value the file chose from a default.
    explicit_keys: frozenset[str] = dataclasses.field(
        default=frozenset(), compare=False, repr=False, metadata={
            "doc": "dotted paths the parsed JSON set to a value other than null, objects "
                   "included, aliases resolved; empty for a config built in code"})

    def _check_combination(self) -> None:
        object.__setattr__(self, "explicit_keys", frozenset(self.explicit_keys))
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

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> EngineConfig:
        """Build from the JSON's keys (``_Section.from_mapping``), remembering which ones it
        set (``explicit_keys``)."""
        config = super().from_mapping(raw)
        object.__setattr__(config, "explicit_keys", _written_paths(raw))
        return config

    def explicit_value(self, path: str) -> Any:
        """This config's value at the dotted JSON ``path`` (a field, or a key of a field's
        object) if the parsed JSON set it, else None: "did the file say, and what?"."""
        if path not in self.explicit_keys:
            return None
        node: Any = self
        for key in path.split("."):
            node = node[key] if isinstance(node, Mapping) else getattr(node, key)
        return node

    def explicit_dict(self) -> dict[str, Any]:
        """``to_dict`` cut down to the keys the parsed JSON set, at this config's values: the
        file with any ``dataclasses.replace`` applied. Keys without effect here (the tables'
        accepted and switched-off keys) are left out, so the file's meaning is kept."""
        def kept(node: Any, section: str) -> Any:
            if not isinstance(node, Mapping):
                return node
            return {key: kept(value, _join(section, key)) for key, value in node.items()
                    if value is not None and _join(section, key) in self.explicit_keys}

        return kept(self.to_dict(), "")

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
        raw = {key: value for key, value in dataclasses.asdict(self).items()
               if value is not None and key != "explicit_keys"}
        if self.optimizer is not None:
            raw["optimizer"] = self.optimizer.to_dict()
        return raw


def _written_paths(raw: Mapping[str, Any], section: str = "") -> frozenset[str]:
    """Every dotted path ``raw`` sets to a value other than null (DeepSpeed reads null as
    absent), objects included, each alias spelled as its canonical key."""
    paths: set[str] = set()
    for key, value in raw.items():
        path = ALIASES.get(_join(section, key), _join(section, key))
        if value is None:
            continue
        paths.add(path)
        if isinstance(value, Mapping):
            paths |= _written_paths(value, path)
    return frozenset(paths)
