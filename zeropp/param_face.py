"""How a sharded parameter looks to a script written for DeepSpeed: its ``ds_*`` attributes.

[Note: DeepSpeed's parameter attributes]
Scripts written for DeepSpeed's ZeRO-3 ask a parameter whether it is partitioned
(``hasattr(p, "ds_id")``), what it really holds (``ds_shape``, ``ds_numel``) and whether it is
gathered now (``p.ds_status == ZeroParamStatus.NOT_AVAILABLE``), and gather it with
``GatheredParameters`` before reading it: DeepSpeed-Chat's ``save_zero_three_model`` and its
EMA update, Hugging Face's ZeRO-3 code. Without these attributes such a script takes a
sharded parameter for an ordinary one and reads storage the engine has released.

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
from collections.abc import Sequence

import torch
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


def present_as_partitioned(params: Sequence[nn.Parameter], shapes: Sequence[tuple[int, ...]],
                           persistent: bool) -> None:
    """Give each parameter DeepSpeed's identity and size attributes (see the note)."""
    for param, shape in zip(params, shapes, strict=True):
        param.ds_id = next(_next_id)
        param.ds_shape = torch.Size(shape)
        param.ds_numel = math.prod(shape)
        param.ds_persist = persistent
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def mirror_status(params: Sequence[nn.Parameter], status: ZeroParamStatus) -> None:
    for param in params:
        param.ds_status = status
