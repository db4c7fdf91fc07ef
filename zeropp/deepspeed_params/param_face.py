"""How a sharded parameter looks to a script written for DeepSpeed: its ``ds_*`` attributes.

[Note: DeepSpeed's parameter attributes]
Scripts written for DeepSpeed's ZeRO-3 ask a parameter whether it is partitioned
(``hasattr(p, "ds_id")``), what it really holds (``ds_shape``, ``ds_numel``) and whether it is
gathered now (``p.ds_status == ZeroParamStatus.NOT_AVAILABLE``), and gather it with
``GatheredParameters`` before reading it: DeepSpeed-Chat's ``save_zero_three_model`` and its
EMA update, Hugging Face's ZeRO-3 code. Without these attributes such a script takes a
sharded parameter for an ordinary one and reads storage the engine has released. Where the
script gathers with DeepSpeed's own ``GatheredParameters`` (its helpers still
``import deepspeed``), that context calls ``all_gather`` and ``partition`` on the parameters,
and they answer with this engine's gather (zeropp/deepspeed_api/zero.py) and carry
``ds_process_group``.

This is the one place the engine writes onto ``nn.Parameter`` (STYLE: explicit states,
nothing patched onto parameters). The state itself still lives in the unit
(``ShardedUnit.state``); the attributes are a mirror of it for scripts, written by the unit
whenever its state changes and never read by the engine. Only stage 3 sets them, as only
DeepSpeed's stage 3 partitions parameters.

``ZeroParamStatus`` has DeepSpeed's names and values, and a member equals DeepSpeed's member
of the same name, so a script that imports DeepSpeed's own enum
(``deepspeed.runtime.zero.partition_parameters``) compares correctly without this package
importing DeepSpeed.
"""

from __future__ import annotations

import enum
import itertools
import math
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ZeroParamStatus", "mirror_status", "present_as_partitioned"]


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # gathered: the whole weights are readable
    NOT_AVAILABLE = 2  # released: only this rank's shard exists
    INFLIGHT = 3  # being gathered

    def __eq__(self, other: object) -> bool:
        if isinstance(other, enum.Enum) and type(other).__name__ == "ZeroParamStatus":
            return self.name == other.name
        return NotImplemented

    __hash__ = enum.Enum.__hash__


_next_id = itertools.count()


# The engine's answers to DeepSpeed's two calls, ``(gather, partition)``, each taking the list
# of parameters: registered by zeropp.deepspeed_api.zero when it is imported (the package's
# __init__ imports it), because that module imports the units that import this one.
_deepspeed_answers: tuple[Callable, Callable] | None = None


def answer_deepspeed_calls(gather: Callable, partition: Callable) -> None:
    global _deepspeed_answers
    _deepspeed_answers = (gather, partition)


class _DeepSpeedCall:
    """``param.all_gather(param_list=...)`` or ``param.partition(param_list=...)``, the two
    calls DeepSpeed's own ``GatheredParameters`` makes on a parameter ([Note: DeepSpeed's
    GatheredParameters on this engine's parameters] in zeropp/deepspeed_api/zero.py). Holds its
    parameter weakly: a parameter does not keep itself alive through its own attribute."""

    def __init__(self, param: nn.Parameter, gather: bool) -> None:
        self._param = weakref.ref(param)
        self._gather = gather

    def __call__(self, param_list=None, *args, has_been_updated: bool = False, **kwargs):
        if _deepspeed_answers is None:
            raise RuntimeError("zeropp.zero is not imported: import zeropp before gathering "
                               "its parameters with deepspeed.zero.GatheredParameters")
        gather, partition = _deepspeed_answers
        params = [self._param()] if param_list is None else list(param_list)
        if self._gather:
            gather(params)
        else:
            partition(params, has_been_updated)


def present_as_partitioned(params: Sequence[nn.Parameter], shapes: Sequence[tuple[int, ...]],
                           persistent: bool) -> None:
    """Give each parameter DeepSpeed's identity and size attributes, and the two methods
    DeepSpeed's ``GatheredParameters`` calls (see the note)."""
    # DeepSpeed's GatheredParameters(modifier_rank=r) broadcasts over a parameter's group.
    group = dist.group.WORLD if dist.is_initialized() else None
    for param, shape in zip(params, shapes, strict=True):
        param.ds_id = next(_next_id)
        param.ds_shape = torch.Size(shape)
        param.ds_numel = math.prod(shape)
        param.ds_persist = persistent
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        param.ds_process_group = group
        param.all_gather = _DeepSpeedCall(param, gather=True)
        param.partition = _DeepSpeedCall(param, gather=False)


def mirror_status(params: Sequence[nn.Parameter], status: ZeroParamStatus) -> None:
    for param in params:
        param.ds_status = status
