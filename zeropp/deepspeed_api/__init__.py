"""DeepSpeed's user API on this engine: ``initialize``, ``zero`` and the lr schedules.

- ``initialize``: ``init_distributed``, ``initialize`` (``deepspeed.initialize``'s whole
  signature), ``add_config_arguments``, and ``build_engine`` (a model and typed options).
- ``zero``: ``deepspeed.zero``'s twin: ``Init`` (construction on the meta device) and
  ``GatheredParameters``.
- ``lr_schedules``: Megatron's ``AnnealingLR`` and DeepSpeed's warmup schedules over an
  optimizer's param groups.

``zeropp`` re-exports these and keeps their old names (``zeropp.initialize``, ``zeropp.zero``,
``zeropp.lr_schedules``), so ``import zeropp as deepspeed`` reads as DeepSpeed does.
"""

from zeropp.deepspeed_api import zero
from zeropp.deepspeed_api.initialize import (
    QuantizationOptions,
    add_config_arguments,
    build_engine,
    engine_from_config,
    init_distributed,
    initialize,
    options_from_config,
)
from zeropp.deepspeed_api.lr_schedules import AnnealingLR, WarmupSchedule
from zeropp.deepspeed_api.zero import GatheredParameters, Init

__all__ = [
    "AnnealingLR",
    "GatheredParameters",
    "Init",
    "QuantizationOptions",
    "WarmupSchedule",
    "add_config_arguments",
    "build_engine",
    "engine_from_config",
    "init_distributed",
    "initialize",
    "options_from_config",
    "zero",
]
