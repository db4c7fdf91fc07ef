"""zeropp: a ZeRO-3 engine with the ZeRO++ communication optimizations (qwZ, hpZ, qgZ).

    engine, optimizer, _, _ = zeropp.initialize(model=model, config="ds_config.json")
    loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()
"""

import importlib
import sys

from zeropp.checkpoints import checkpoint, zero_to_fp32
from zeropp.checkpoints.checkpoint import CheckpointError, CheckpointStorageError
from zeropp.checkpoints.checkpoint import client_state as checkpoint_client_state
from zeropp.checkpoints.checkpoint import consolidate as consolidate_checkpoint
from zeropp.config import ConfigError, EngineConfig, read_json_config
from zeropp.deepspeed_api import (
    lr_schedules,
    zero,  # deepspeed.zero's twin: GatheredParameters, Init
)
from zeropp.deepspeed_api.initialize import (
    QuantizationOptions,
    add_config_arguments,
    build_engine,
    engine_from_config,
    init_distributed,
    initialize,
    options_from_config,
)
from zeropp.engine import ZeroEngine
from zeropp.loss_scaler import DynamicLossScaler, LossScaler
from zeropp.sharded_model import ShardingOptions
from zeropp.topology import Topology, TopologyError, build_topology

# Modules that moved into packages answer to their old names too, so that `import zeropp.zero`,
# `from zeropp.initialize import build_engine` and `zeropp.checkpoint.consolidate(...)` keep
# working (`python -m zeropp.convert` has its own file, zeropp/convert.py). New code imports
# the new paths; tests/test_import_graph.py holds the project to them.
MOVED_MODULES = {
    "zeropp.checkpoint": checkpoint,
    # the package's attribute `initialize` is the function, as in DeepSpeed: fetch the module
    "zeropp.initialize": importlib.import_module("zeropp.deepspeed_api.initialize"),
    "zeropp.lr_schedules": lr_schedules,
    "zeropp.zero": zero,
    "zeropp.zero_to_fp32": zero_to_fp32,
}
for _old_name, _module in MOVED_MODULES.items():
    sys.modules.setdefault(_old_name, _module)

__all__ = [
    "add_config_arguments",
    "CheckpointError",
    "CheckpointStorageError",
    "ConfigError",
    "DynamicLossScaler",
    "EngineConfig",
    "LossScaler",
    "QuantizationOptions",
    "ShardingOptions",
    "Topology",
    "TopologyError",
    "ZeroEngine",
    "build_engine",
    "engine_from_config",
    "build_topology",
    "checkpoint_client_state",
    "consolidate_checkpoint",
    "init_distributed",
    "initialize",
    "options_from_config",
    "read_json_config",
    "zero",
]
