"""A model DeepSpeed's own ``zero.Init`` already partitioned, taken over by this engine.

Hugging Face's ``from_pretrained`` builds a model inside DeepSpeed's ``zero.Init`` when a
``HfDeepSpeedConfig`` says ZeRO-3 (it imports DeepSpeed itself): each parameter then holds an
empty tensor, its values live in DeepSpeed's partition (``ds_tensor``), and ``ds_shape`` says
what it stands for. Handed to ``initialize`` as it is, torch would compute with the empty
tensors.

[Note: adopting DeepSpeed's partitions]
``stand_in_for_deepspeed`` replaces each such parameter, in every module holding it, by a
meta tensor of its real shape and dtype, so the engine plans its units as it does for a model
built under ``zeropp.zero.Init``; it keeps DeepSpeed's parameter as the source of the values.
When the engine fills a unit's shards, ``DeepSpeedValues`` gathers that unit's parameters with
DeepSpeed's own ``GatheredParameters`` (a collective: every rank gathers every unit, in unit
order), copies what the unit needs, and lets DeepSpeed partition them again; then it drops
DeepSpeed's partition and attributes from those parameters. The whole model is never gathered
at once: one unit at a time, as DeepSpeed itself would gather it.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

__all__ = ["DeepSpeedValues", "is_deepspeed_partitioned", "stand_in_for_deepspeed"]


def is_deepspeed_partitioned(param: torch.Tensor) -> bool:
    """Whether DeepSpeed's ``zero.Init`` partitioned ``param`` (its values are elsewhere)."""
    return hasattr(param, "ds_id") and hasattr(param, "ds_shape") and hasattr(param, "ds_tensor")


def stand_in_for_deepspeed(model: nn.Module) -> dict[int, nn.Parameter]:
    """Put a meta parameter of the real shape where each DeepSpeed-partitioned parameter is
    ([Note: adopting DeepSpeed's partitions]); returns {id(meta parameter): DeepSpeed's}."""
    sources: dict[int, nn.Parameter] = {}
    stand_ins: dict[int, nn.Parameter] = {}  # id(DeepSpeed's) -> its meta twin (tied weights)
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is None or not is_deepspeed_partitioned(param):
                continue
            if id(param) not in stand_ins:
                twin = nn.Parameter(torch.empty(tuple(param.ds_shape), dtype=param.dtype,
                                                device="meta"),
                                    requires_grad=param.requires_grad)
                stand_ins[id(param)] = twin
                sources[id(twin)] = param
            module._parameters[attr] = stand_ins[id(param)]
    if sources:
        _deepspeed()  # a one-line error now, not in the middle of building units
    return sources


def _deepspeed():
    try:
        return importlib.import_module("deepspeed")
    except ImportError as error:  # partitioned by DeepSpeed, yet it cannot be imported
        raise RuntimeError(
            "the model's parameters were partitioned by DeepSpeed's zero.Init, but deepspeed "
            f"cannot be imported to gather them ({error}); build the model without "
            "zero.Init (or under zeropp.zero.Init)") from error


# What DeepSpeed's zero.Init attaches to a parameter besides its ds_* fields.
_DEEPSPEED_METHODS = ("all_gather", "all_gather_coalesced", "partition", "partition_gradients",
                      "reduce_gradients_at_owner", "convert_to_zero_parameters", "aligned_size",
                      "padding_size", "partition_numel", "ds_summary", "item", "nvme_swapper",
                      "is_external_param")


def _release(param: nn.Parameter) -> None:
    """Drop DeepSpeed's partition and attributes: nothing of DeepSpeed's stays alive."""
    for name in list(vars(param)):
        if name.startswith("ds_") or name in _DEEPSPEED_METHODS:
            delattr(param, name)


class DeepSpeedValues:
    """The full values of one unit's DeepSpeed-partitioned parameters, gathered once."""

    def __init__(self, sources: dict[int, nn.Parameter]) -> None:
        self.sources = sources
        self._values: dict[int, torch.Tensor] = {}

    def gather_unit(self, params: list[nn.Parameter]) -> None:
        """Gather the DeepSpeed sources of ``params`` (every rank calls it for every unit,
        in the same order), keep fp32 copies, release DeepSpeed's partitions."""
        sources = [self.sources[id(p)] for p in params if id(p) in self.sources]
        if not sources:
            return
        deepspeed = _deepspeed()
        with deepspeed.zero.GatheredParameters(sources, modifier_rank=None):
            for param in params:
                source = self.sources.get(id(param))
                if source is not None:
                    self._values[id(param)] = source.detach().to(torch.float32, copy=True)
        for source in sources:
            _release(source)

    def value(self, param: nn.Parameter) -> torch.Tensor | None:
        """The gathered value standing behind ``param`` (a meta stand-in), if any."""
        return self._values.get(id(param))

    def clear(self) -> None:
        self._values.clear()
