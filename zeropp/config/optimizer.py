"""The optimizer and scheduler blocks: each type's parameters with DeepSpeed's defaults, the
optimizers refused with reasons, and their typed sections.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from zeropp.config.checks import (
    _REQUIRED,
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
    _show,
    _string,
    _unit_interval,
)
from zeropp.config.json_reading import ConfigError
from zeropp.config.keys import _check_table_key, _require_inert
from zeropp.config.sections import _field, _Section


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
    # DeepSpeed's 1cycle policy (zeropp.deepspeed_api.lr_schedules.OneCycle), its defaults.
    "OneCycle": {"cycle_min_lr": (_non_negative_float, _REQUIRED),
                 "cycle_max_lr": (_non_negative_float, _REQUIRED),
                 "decay_lr_rate": (_non_negative_float, 0.0),
                 "cycle_first_step_size": (_positive_float, 2000),
                 "cycle_second_step_size": (_optional(_non_negative_float), None),
                 "cycle_first_stair_count": (_non_negative_int, 0),
                 "cycle_second_stair_count": (_optional(_non_negative_int), None),
                 "decay_step_size": (_non_negative_float, 0),
                 "cycle_momentum": (_boolean, True),
                 "cycle_min_mom": (_unit_interval, 0.8),
                 "cycle_max_mom": (_unit_interval, 0.9),
                 "decay_mom_rate": (_non_negative_float, 0.0)},
}


@dataclass(frozen=True)
class SchedulerConfig(_Section):
    """The learning-rate schedule: one of DeepSpeed's warmup schedules, or its OneCycle."""

    SECTION: ClassVar[str] = "scheduler"
    type: str = _field("WarmupLR", "WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle",
                       _one_of(*_SCHEDULER_PARAMS))
    params: dict[str, Any] = _field(dict, "the schedule's parameters; missing ones filled",
                                    _object, factory=True)

    def _check_combination(self) -> None:
        params = _fill_params("scheduler.params", self.params, _SCHEDULER_PARAMS[self.type])
        object.__setattr__(self, "params", params)
        total, warmup = params.get("total_num_steps"), params.get("warmup_num_steps")
        if total is not None and warmup is not None and total < warmup:
            raise ConfigError(f"scheduler.params: total_num_steps {total} is smaller than "
                              f"warmup_num_steps {warmup}")
