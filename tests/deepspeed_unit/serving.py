"""Serve this engine where DeepSpeed's unit tests call DeepSpeed's public API.

[Note: serving zeropp to DeepSpeed's tests]
DeepSpeed's tests import ``deepspeed`` for two things: its public API (``deepspeed.initialize``,
``deepspeed.zero.Init``, ``deepspeed.zero.GatheredParameters``, the functions of
``deepspeed.utils.zero_to_fp32``, the schedule classes of ``deepspeed.runtime.lr_schedules``)
and their own scaffolding
(``DistributedTest`` launches ranks and calls ``deepspeed.init_distributed``; the CPU
accelerator; ``deepspeed.comm``). Only the first is replaced: once the installed ``deepspeed``
has been imported, those names of it (``SERVED``) are rebound to zeropp's. Everything else stays
DeepSpeed's own, so the scaffolding, and any test reaching into DeepSpeed's internals, runs
against the real package.

The ranks run in processes DeepSpeed's scaffolding starts (multiprocessing's forkserver),
which never load pytest plugins. So the rebinding is installed at interpreter start by
``serve/sitecustomize.py``, which the plugin puts on ``PYTHONPATH`` together with
``ZEROPP_SERVES_DEEPSPEED=1``; every process started after that (the forkserver, hence every
rank) serves zeropp. ``install()`` does the same in the pytest process itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

ENV = "ZEROPP_SERVES_DEEPSPEED"
ZERO_TO_FP32 = ("get_fp32_state_dict_from_zero_checkpoint",
                "convert_zero_checkpoint_to_fp32_state_dict", "load_state_dict_from_zero_checkpoint")
# DeepSpeed's schedule classes, which scripts build and test with isinstance ([Note:
# DeepSpeed's schedule classes] in zeropp/deepspeed_api/lr_schedules.py).
SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")
SERVED = ("deepspeed.initialize", "deepspeed.DeepSpeedConfigError", "deepspeed.zero.Init",
          "deepspeed.zero.GatheredParameters",
          *(f"deepspeed.utils.zero_to_fp32.{name}" for name in ZERO_TO_FP32),
          *(f"deepspeed.runtime.lr_schedules.{name}" for name in SCHEDULES))


def _rebind(deepspeed) -> None:
    import importlib

    import zeropp
    import zeropp.checkpoints.zero_to_fp32 as zero_to_fp32

    deepspeed.initialize = zeropp.initialize
    deepspeed.DeepSpeedConfigError = zeropp.ConfigError  # what a bad config raises
    deepspeed.zero.Init = zeropp.zero.Init
    deepspeed.zero.GatheredParameters = zeropp.zero.GatheredParameters
    theirs = importlib.import_module("deepspeed.utils.zero_to_fp32")
    for name in ZERO_TO_FP32:
        setattr(theirs, name, getattr(zero_to_fp32, name))
    schedules = importlib.import_module("deepspeed.runtime.lr_schedules")
    for name in SCHEDULES:
        setattr(schedules, name, getattr(zeropp.lr_schedules, name))
    deepspeed.served_by_zeropp = True


class _AfterDeepSpeed(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed`` as the other finders do and rebinds its public API once its
    ``__init__`` has run."""

    def find_spec(self, name, path, target=None):
        if name != "deepspeed":
            return None
        sys.meta_path.remove(self)  # one import; the other finders find the package
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _rebind(module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Serve zeropp in this process: now if deepspeed is imported already, else on import."""
    if "deepspeed" in sys.modules:
        _rebind(sys.modules["deepspeed"])
    elif not any(isinstance(f, _AfterDeepSpeed) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDeepSpeed())


def install_if_asked() -> None:
    if os.environ.get(ENV) == "1":
        install()
