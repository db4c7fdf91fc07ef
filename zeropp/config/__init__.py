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
values HF's Trainer would put there. Offload's device may be ``"none"`` or ``"cpu"``
(``"nvme"`` is refused); its other keys tune NVMe or DeepSpeed's buffers and are accepted
without effect, as is the ``aio`` block.

Errors are ``ConfigError`` with one line naming the key path and the offending value. Batch
sizes are resolved against the data-parallel world size by DeepSpeed's rules
(``EngineConfig.resolve_batch``). Whether ``zero_hpz_partition_size`` divides the ranks per
node depends on the launch and is checked by the topology, not here.

The package, by job (each imports only those above it):

* ``json_reading``: ``ConfigError`` and ``read_json_config`` (strict JSON, error positions);
* ``checks``: the value checks every key runs;
* ``keys``: the accepted / unsupported / alias key tables, with reasons;
* ``sections``: the typed-section base and the fp16, bf16, zero_optimization, monitor blocks;
* ``optimizer``: the optimizer and scheduler blocks;
* ``batch``: batch-size arithmetic and Hugging Face ``"auto"`` placeholders (``resolve_auto``);
* ``engine_config``: ``EngineConfig``, the whole JSON.
"""

from zeropp.config.batch import resolve_auto
from zeropp.config.checks import Check
from zeropp.config.engine_config import EngineConfig
from zeropp.config.json_reading import ConfigError, read_json_config
from zeropp.config.keys import ACCEPTED, ALIASES, DISABLED_BLOCK, UNSUPPORTED, Accepted, Unsupported
from zeropp.config.optimizer import OptimizerConfig, SchedulerConfig
from zeropp.config.sections import (
    BF16Config,
    CSVMonitorConfig,
    CudaGraphConfig,
    FP16Config,
    SectionT,
    TensorBoardConfig,
    WandbConfig,
    ZeroConfig,
)

__all__ = [
    "ConfigError",
    "read_json_config",
    "Check",
    "Accepted",
    "Unsupported",
    "DISABLED_BLOCK",
    "ALIASES",
    "ACCEPTED",
    "UNSUPPORTED",
    "SectionT",
    "FP16Config",
    "BF16Config",
    "CudaGraphConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "TensorBoardConfig",
    "CSVMonitorConfig",
    "WandbConfig",
    "EngineConfig",
    "resolve_auto",
]
