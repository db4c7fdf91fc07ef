"""zeropp: a ZeRO-3 engine with the ZeRO++ communication optimizations (qwZ, hpZ, qgZ).

    engine, optimizer, _, _ = zeropp.initialize(model=model, config="ds_config.json")
    loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()
"""

from zeropp import zero  # deepspeed.zero's twin: GatheredParameters, Init
from zeropp.checkpoint import CheckpointError, CheckpointStorageError
from zeropp.checkpoint import client_state as checkpoint_client_state
from zeropp.checkpoint import consolidate as consolidate_checkpoint
from zeropp.config import ConfigError, EngineConfig, read_json_config
from zeropp.engine import ZeroEngine
from zeropp.initialize import (
    QuantizationOptions,
    add_config_arguments,
    build_engine,
    engine_from_config,
    init_distributed,
    initialize,
    options_from_config,
)
from zeropp.loss_scaler import DynamicLossScaler, LossScaler
from zeropp.sharded_model import ShardingOptions
from zeropp.topology import Topology, TopologyError, build_topology

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
