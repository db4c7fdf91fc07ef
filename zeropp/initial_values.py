"""The fp32 value each parameter starts from when the engine shards it.

A parameter with real values starts from them. One left on the meta device
(``zeropp.zero.Init``) starts from ``param_init_fn(name)`` when the engine was given one, else
from its modules' own ``reset_parameters()``, run on a copy of its unit
(``reset_parameters_values``). ``UnitInitialValues`` answers for one unit, one parameter at a
time, as ``FlatLayout.fill_shard`` asks, so a model too large for one rank is never whole.
"""

from __future__ import annotations

import copy
import itertools
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from zeropp.deepspeed_params.deepspeed_adoption import DeepSpeedValues
from zeropp.flat_layout import ParamSlot


def _post_order(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, module) with every child before its parent, each module once."""
    for name, child in module._modules.items():
        if child is not None and id(child) not in seen:
            seen.add(id(child))
            yield from _post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    yield prefix, module


def reset_parameters_values(module: nn.Module, prefix: str,
                            wanted: dict[int, str]) -> dict[str, torch.Tensor]:
    """Initial values of the meta parameters ``wanted`` (id -> name) of ``module``, by torch's
    convention: each module's own ``reset_parameters()`` (``_reset_parameters()`` for the
    few torch modules that name it so).

    The default for a model built on the meta device (``zeropp.zero.Init``) with neither
    ``param_init_fn`` nor an ``initial_value`` method. It runs on a copy of ``module`` in
    which only the wanted parameters are materialized (on the CPU: one unit at a time, never
    the whole model), calling ``reset_parameters()`` children first, then parents, as
    construction does (a parent's reset may re-initialize its children's parameters). Each
    module draws from its own seed, a function of its qualified name, so every rank computes
    the same values and the user's random stream is left alone. The distributions are the
    module's own; the draws are not those of eager construction, which takes them from the
    global random stream in construction order. A reset written in an ancestor outside the
    unit is not run for the unit's parameters.
    """
    # Real (non-meta) tensors are replaced by meta twins in the copy: never duplicated in
    # memory, never overwritten by a reset.
    memo: dict[int, object] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if not tensor.is_meta:
            twin = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, nn.Parameter):
                twin = nn.Parameter(twin, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = twin
    copies = {id(copy.deepcopy(p, memo)): name
              for p in module.parameters() if (name := wanted.get(id(p))) is not None}
    clone = copy.deepcopy(module, memo)
    real: dict[int, nn.Parameter] = {}  # id of the copy's meta parameter -> materialized one
    for sub in clone.modules():
        for attr, param in sub._parameters.items():
            if param is not None and id(param) in copies:
                if id(param) not in real:  # a tied parameter stays one tensor
                    real[id(param)] = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device="cpu"),
                        requires_grad=param.requires_grad)
                sub._parameters[attr] = real[id(param)]
    materialized = {id(p): meta_id for meta_id, p in real.items()}
    covered: set[int] = set()
    with torch.no_grad():
        for name, sub in _post_order(clone, prefix, set()):
            # nn.MultiheadAttention and nn.Transformer name theirs with an underscore.
            reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
            mine = {id(p) for p in sub.parameters() if id(p) in materialized}
            if not callable(reset) or not mine:
                continue
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(zlib.crc32(name.encode()))
                reset()
            covered |= mine
    missing = [copies[meta_id] for meta_id, p in real.items() if id(p) not in covered]
    if missing:
        raise ValueError(
            f"parameter {missing[0]!r} is on the meta device and no module holding it has "
            "reset_parameters(): give the model an initial_value(name) method or pass "
            "param_init_fn"
        )
    return {copies[meta_id]: p.detach() for meta_id, p in real.items()}


class UnitInitialValues:
    """``full value of slot -> fp32 tensor`` for the parameters of one unit.

    ``originals`` maps each parameter's name to the parameter; ``module`` and ``prefix`` are
    the unit's module and its qualified name, for ``reset_parameters_values``. Those values
    are made for the whole unit at once, on the first meta parameter asked for (one module's
    reset may set several parameters), and kept until ``clear()``.
    """

    def __init__(self, module: nn.Module, prefix: str, originals: dict[str, nn.Parameter],
                 param_init_fn: Callable[[str], torch.Tensor] | None,
                 deepspeed_values: DeepSpeedValues | None = None) -> None:
        self.module = module
        self.prefix = prefix
        self.originals = originals
        self.param_init_fn = param_init_fn
        # Values of the unit's stand-ins for DeepSpeed-partitioned parameters, gathered by
        # the caller ([Note: adopting DeepSpeed's partitions]).
        self.deepspeed_values = deepspeed_values
        self._defaults: dict[str, torch.Tensor] = {}

    def __call__(self, slot: ParamSlot) -> torch.Tensor:
        param = self.originals[slot.name]
        if not param.is_meta:
            return param.detach().to(torch.float32)
        if self.deepspeed_values is not None:
            adopted = self.deepspeed_values.value(param)
            if adopted is not None:
                return adopted
        if self.param_init_fn is None:
            if not self._defaults:
                self._defaults.update(reset_parameters_values(self.module, self.prefix, {
                    id(p): n for n, p in self.originals.items() if p.is_meta}))
            return self._defaults[slot.name].to(torch.float32)
        value = self.param_init_fn(slot.name)
        if tuple(value.shape) != slot.shape:
            raise ValueError(
                f"param_init_fn({slot.name!r}) returned shape {tuple(value.shape)}, "
                f"expected {slot.shape}"
            )
        return value.to(torch.float32)

    def clear(self) -> None:
        """Drop the ``reset_parameters()`` values kept for the unit."""
        self._defaults.clear()
