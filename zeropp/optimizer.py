"""Any element-wise torch optimizer over this rank's fp32 shards, with global-norm clipping
and loss scaling.

[Note: gradient averaging]
Gradients are reduce-scattered as SUMs and accumulated in fp32 across micro-batches; they are
divided exactly once, here, by (data-parallel size x accumulation steps x loss scale). The
global norm is computed from the shards with one all-reduce of a single number; a non-finite
norm means some rank overflowed, so every rank skips the same step.

[Note: partitioned parameter groups]
A shard is a run of a unit's flat buffer: it can hold the end of a weight matrix and the start
of a bias, and the two can belong to different parameter groups (Megatron's no-decay group for
biases and norms, a user's per-group learning rates). So the fp32 master of a shard is given
to the torch optimizer as one tensor per run of a group inside it (the whole shard when one
group holds all of it), each a view of one flat master buffer ([Note: flat optimizer step]).
Group g of the torch optimizer holds group g's runs of every unit with group g's
hyperparameters, so torch applies each group's lr and weight decay itself. The classes
allowed are element-wise (an element's update reads only its own gradient and state), so
stepping the runs is stepping the whole model.

[Note: frozen parameters]
Parameters with ``requires_grad=False``, or given to no group, are in no run: neither
updated nor given optimizer state. Their fp32 masters (in the flat buffer, [Note: flat
optimizer step]) only mirror the working shard.
``shard_master`` and ``shard_state`` give shard-shaped tensors back for checkpoints.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeropp.comm import all_reduce_sum
from zeropp.offload import HostMemory
from zeropp.unit import ShardedUnit

# Torch optimizers whose update of an element reads only that element's gradient and state:
# stepping each rank's shard is then exactly stepping the whole model.
ELEMENTWISE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    cls.__name__: cls for cls in (
        torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad,
        torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
        torch.optim.Adadelta)
}


# DeepSpeed's Adam classes (deepspeed.ops.adam), which scripts build themselves and pass to
# initialize: read into the torch Adam/AdamW taking the same step (from_deepspeed_adam).
DEEPSPEED_ADAMS = ("FusedAdam", "DeepSpeedCPUAdam")
_DEEPSPEED_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction")
_DEEPSPEED_ONLY_KEYS = ("bias_correction",)  # always true once checked


def is_deepspeed_adam(optimizer: object) -> bool:
    kind = type(optimizer)
    return kind.__name__ in DEEPSPEED_ADAMS and kind.__module__.startswith("deepspeed.")


@dataclass
class OptimizerRecipe:
    """What to run over the shards: a torch optimizer class, its keyword arguments, and the
    model's parameters in groups, each with its own overrides (lr, weight_decay, ...).

    ``groups`` holds dicts shaped like torch's: ``{"params": [nn.Parameter, ...], **overrides}``.
    A parameter in no group is not optimized (torch's meaning).
    """

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    groups: list[dict[str, Any]]
    translated_from: str | None = None  # the client's class, when read into a torch one

    def __post_init__(self) -> None:
        if self.cls not in ELEMENTWISE_OPTIMIZERS.values():
            raise ValueError(
                f"optimizer {self.cls.__name__} cannot be partitioned: only element-wise torch "
                f"optimizers are ({', '.join(ELEMENTWISE_OPTIMIZERS)})")

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer) -> OptimizerRecipe:
        """The recipe of a torch optimizer built over the model's parameters: its class,
        defaults, and every group with that group's hyperparameters."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer or a callable returning "
                            f"one, got {type(optimizer).__name__}")
        if is_deepspeed_adam(optimizer):
            return cls.from_deepspeed_adam(optimizer)
        groups = [dict(group) for group in optimizer.param_groups]
        return cls(type(optimizer), dict(optimizer.defaults), groups)

    @classmethod
    def from_deepspeed_adam(cls, optimizer: torch.optim.Optimizer) -> OptimizerRecipe:
        """DeepSpeed's FusedAdam or DeepSpeedCPUAdam as the torch optimizer that takes the
        same step: AdamW where ``adam_w_mode`` (their default), else Adam (L2 decay), with
        their lr, betas, eps, weight decay and amsgrad, group by group. Their kernels are
        DeepSpeed's implementations of that update; this engine steps each rank's fp32 shard
        with torch's (fused on CUDA)."""
        name = type(optimizer).__name__
        defaults = dict(optimizer.defaults)
        unknown = set(defaults) - set(_DEEPSPEED_ADAM_KEYS)
        if unknown:
            raise ValueError(f"optimizer {name}: settings {sorted(unknown)} have no torch "
                             "Adam equivalent here")
        groups = []
        for group in optimizer.param_groups:
            if not group.get("bias_correction", True):
                raise ValueError(f"optimizer {name}: bias_correction=False has no torch Adam "
                                 "equivalent; leave it True")
            groups.append({key: value for key, value in group.items()
                           if key not in _DEEPSPEED_ONLY_KEYS})
        torch_cls = torch.optim.AdamW if getattr(optimizer, "adam_w_mode", True) else torch.optim.Adam
        kept = {key: value for key, value in defaults.items() if key not in _DEEPSPEED_ONLY_KEYS}
        return cls(torch_cls, kept, groups, translated_from=name)

    @staticmethod
    def groups_of(model_parameters) -> list[dict[str, Any]]:
        """``model_parameters`` as torch takes them (tensors, or dicts with "params") -> groups."""
        items = list(model_parameters)
        if not items:
            raise ValueError("model_parameters is empty: no parameter to optimize")
        if all(isinstance(item, Mapping) for item in items):
            groups = []
            for item in items:
                group = dict(item)
                params = group["params"]
                group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
                groups.append(group)
            return groups
        if any(isinstance(item, Mapping) for item in items):
            raise ValueError("model_parameters mixes parameters and parameter-group dicts")
        return [{"params": items}]

    def group_by_name(self, model: nn.Module) -> dict[str, int]:
        """Parameter name -> group index, read before sharding (which may give the module new
        parameter objects): every name of a tied parameter maps to its group."""
        index: dict[int, int] = {}
        for number, group in enumerate(self.groups):
            for param in group["params"]:
                if id(param) in index:
                    raise ValueError("a parameter appears in more than one parameter group")
                index[id(param)] = number
        by_name = {name: index[id(param)]
                   for name, param in model.named_parameters(remove_duplicate=False)
                   if id(param) in index}
        found = {id(param) for _, param in model.named_parameters(remove_duplicate=False)}
        if index.keys() - found:
            raise ValueError("a parameter group holds a tensor that is not a parameter of the model")
        return by_name


def megatron_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Megatron's two groups: matrices decayed, biases and norm parameters not."""
    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


@dataclass
class _Run:
    """Contiguous elements of one parameter group inside one unit's shard: one tensor of the
    torch optimizer, a view of the flat fp32 master ([Note: flat optimizer step])."""

    unit: int
    group: int
    start: int  # shard offsets
    end: int
    master: nn.Parameter  # fp32, a view of PartitionedOptimizer.master_flat


# Optimizer classes that step a list of tensors in one multi-tensor kernel per operation
# (``foreach``), and those with a single fused kernel for the whole list on CUDA.
_FUSED_ON_CUDA = (torch.optim.Adam, torch.optim.AdamW)


def _multi_tensor_settings(cls: type[torch.optim.Optimizer], defaults: dict[str, Any],
                           device: torch.device, offloaded_from_gpu: bool = False
                           ) -> dict[str, Any]:
    """``foreach`` (or on CUDA ``fused``) where the user left the implementation to torch:
    torch picks the per-tensor loop on CPU and on the meta device, which issues a dozen
    kernels per tensor where the multi-tensor ones issue a dozen per group. A GPU job's
    offloaded step ([Note: offload]) runs torch's fused CPU kernel: one pass over memory,
    5.8x the foreach update's throughput here and on a par with DeepSpeed's CPU Adam
    (``python -m scripts.bench.cpu_adam``). A CPU job keeps foreach with or without offload,
    so its offloaded run stays bit for bit the run without."""
    accepted = inspect.signature(cls.__init__).parameters
    if defaults.get("fused"):  # asked for: passed on, so torch sets up its fused step
        return {"fused": True}  # (and its found_inf / grad_scale support) as for the user
    if defaults.get("foreach") is not None or defaults.get("fused") is not None:
        return {}
    fused_here = device.type == "cuda" or (device.type == "cpu" and offloaded_from_gpu)
    if fused_here and cls in _FUSED_ON_CUDA and "fused" in accepted:
        return {"fused": True}
    if "foreach" in accepted:
        return {"foreach": True}
    return {}


class PartitionedOptimizer(torch.optim.Optimizer):
    """A torch optimizer over this rank's fp32 shards ([Note: partitioned parameter groups]).

    It is a ``torch.optim.Optimizer``: ``param_groups`` and ``state`` are those of the torch
    optimizer stepping the shards, so torch, Hugging Face and DeepSpeed schedules attach to it
    and write each group's lr. Only the engine steps it (``engine.step()`` averages, clips and
    unscales the gradients first).

    [Note: flat optimizer step]
    The fp32 masters of every unit live in one flat buffer laid out as the model's flat
    shards ([Note: flat shards]); the torch optimizer's tensors are views of it, one per run
    of a parameter group inside a unit's shard (a weight, then its bias in the no-decay
    group). A step is then a fixed number of kernels whatever the depth of the model: the
    16-bit gradient shards cast into one fp32 buffer (allocated for the step, its storage
    freed after, so it costs no memory between steps), one multiply by the averaging and
    clipping factor, the torch optimizer's multi-tensor update per group (``foreach``, or
    ``fused`` on CUDA), and one cast of the masters into the working shards. Elements no group
    trains (frozen parameters) have masters too, equal to their working weights (writes to
    those reach the masters through ``load_shard``), so the cast writes them back unchanged.
    """

    def __init__(self, units: list[ShardedUnit], initial_masters: list[torch.Tensor],
                 recipe: OptimizerRecipe, group_by_name: dict[str, int],
                 grad_shards_flat: torch.Tensor, shards_flat: torch.Tensor | None,
                 host: HostMemory | None = None) -> None:
        """``grad_shards_flat`` and ``shards_flat`` are the model's flat gradient and working
        shards ([Note: flat shards]); ``shards_flat`` is None where units are replicated.
        ``host``: where the masters, the moments and the step run when the optimizer is
        offloaded ([Note: offload]); None keeps them on the gradients' device."""
        self.units = units
        self.world = units[0].comm.world if units else None
        self.recipe = recipe
        self.host = host
        device = units[0].grad_shard.device if units else torch.device("cpu")
        self.comm_device = device  # where the norm's all-reduce runs
        if host is not None:
            device = host.device
        self.unit_ranges: list[tuple[int, int]] = []
        offset = 0
        for unit in units:
            self.unit_ranges.append((offset, offset + unit.layout.shard_numel))
            offset += unit.layout.shard_numel
        self.grad_shards_flat = grad_shards_flat
        self.shards_flat = shards_flat
        self.master_flat = (host.empty(offset, torch.float32) if host is not None
                            else torch.empty(offset, dtype=torch.float32, device=device))
        for initial, (start, end) in zip(initial_masters, self.unit_ranges, strict=True):
            self.master_flat[start:end].copy_(initial)
        # The fp32 gradients of a step, ``_grads_fresh`` once cast for it: on the device,
        # storage only while the step runs (resize_, as unit.full); in host memory, kept
        # (pinned storage cannot be resized, and the host has room).
        self._grads32 = (host.zeros(offset, torch.float32) if host is not None
                         else torch.zeros(offset, dtype=torch.float32, device=device))
        self._grads_fresh = False
        # On CUDA the updated weights cross to the device already 16-bit, from a pinned buffer
        # (half of fp32's PCIe bytes); the event says when that copy has read it.
        self._shard_staging: torch.Tensor | None = None
        self._staging_read: torch.cuda.Event | None = None
        if (host is not None and shards_flat is not None and shards_flat.device.type == "cuda"):
            self._shard_staging = host.empty(offset, shards_flat.dtype)

        self.runs: list[_Run] = []
        self.runs_of_unit: list[list[_Run]] = []
        for index, (unit, (base, _)) in enumerate(zip(units, self.unit_ranges, strict=True)):
            slot_group = {slot.name: group_by_name.get(slot.name) if param.requires_grad else None
                          for slot, param in zip(unit.layout.slots, unit.params, strict=True)}
            rank = unit.comm.world.rank
            group_runs = [_merged(unit.layout.shard_runs(
                rank, lambda slot, n=number, of=slot_group: of[slot.name] == n))
                for number in range(len(recipe.groups))]
            # The shard's padding rides with the first group holding elements here, so a shard
            # that one group holds entirely is one tensor of the optimizer. Its gradient is zero.
            padding = _complement(
                _merged(unit.layout.shard_runs(rank, lambda slot: True)), unit.layout.shard_numel)
            first = next((n for n, runs in enumerate(group_runs) if runs), 0)
            group_runs[first] = _merged(sorted(group_runs[first] + padding))
            mine = []
            for number, runs in enumerate(group_runs):
                for start, end in runs:
                    master = nn.Parameter(self.master_flat[base + start : base + end])
                    master.grad = self._grads32[base + start : base + end]
                    mine.append(_Run(index, number, start, end, master))
            self.runs_of_unit.append(mine)
            self.runs.extend(mine)
        if host is None:
            self._grads32.untyped_storage().resize_(0)  # the views above stay bound to it
        torch_groups = []
        for number, group in enumerate(recipe.groups):
            settings = {key: value for key, value in group.items() if key != "params"}
            params = [run.master for run in self.runs if run.group == number]
            torch_groups.append({**recipe.defaults, **settings, "params": params})
        implementation = _multi_tensor_settings(
            recipe.cls, recipe.defaults, device,
            offloaded_from_gpu=host is not None and self.comm_device.type == "cuda")
        self.inner = recipe.cls(torch_groups, **implementation)
        super().__init__(torch_groups, self.inner.defaults)
        # One set of groups and state, the inner optimizer's: what a schedule writes is what
        # the update reads.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults
        # Set while an asynchronous checkpoint save still copies the shards: called before
        # anything here writes the masters, the moments or the working shards.
        self.before_update: Callable[[], None] | None = None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer stepping the shards, as DeepSpeed's wrappers expose the one they
        wrap (``engine.optimizer.optimizer``): its ``state_dict()`` is this rank's shard of the
        state, its ``param_groups`` are this optimizer's."""
        return self.inner

    @property
    def masters(self) -> list[nn.Parameter]:
        """The tensors the torch optimizer steps (trainable elements and padding)."""
        return [run.master for run in self.runs]

    @property
    def offloaded(self) -> bool:
        """Whether the masters, the moments and the step live in host memory."""
        return self.host is not None

    def _gradients_fp32(self) -> torch.Tensor:
        """The step's fp32 gradients, cast from the gradient shards once per step (across to
        the host in the same copy when offloaded)."""
        grads = self._grads32
        if self._grads_fresh:
            return grads
        if self.host is None:
            grads.untyped_storage().resize_(grads.numel() * grads.element_size())
        elif self.units and self.units[0].comm.gradient_delivery is not None:
            self.units[0].comm.gradient_delivery.finish()  # every reduction has landed
        grads.copy_(self.grad_shards_flat)
        self._grads_fresh = True
        return grads

    def _end_step(self) -> None:
        if self.host is None:
            self._grads32.untyped_storage().resize_(0)
        self._grads_fresh = False
        self.grad_shards_flat.zero_()
        for unit in self.units:
            unit.grad_shard_is_zero = True

    def grad_norm_squared_tensor(self, inv_scale: float) -> torch.Tensor:
        """Squared global gradient norm (true units), over all ranks, as a 0-dim fp32 tensor
        on the device: one all-reduce, no host read."""
        # In fp32 (16-bit squares would overflow), summed as torch.sum sums (pairwise: the
        # same value whatever the number of ranks, to rounding).
        with self._allocating_state():
            total = self._gradients_fp32().pow(2).sum().reshape(1)  # on the host if offloaded
        total = total.to(self.comm_device)
        if self.world is not None:
            all_reduce_sum(total, self.world, self.units[0].comm.stats, "optimizer")
        return total.reshape(()) * (inv_scale * inv_scale)

    def grad_norm_squared(self, inv_scale: float) -> float:
        """``grad_norm_squared_tensor`` read by the host, scaled in float64."""
        return float(self.grad_norm_squared_tensor(1.0)) * inv_scale * inv_scale

    @property
    def skips_on_device(self) -> bool:
        """Whether the torch optimizer skips its update on a device flag (``found_inf``, read
        by torch's fused Adam and AdamW: ``_step_supports_amp_scaling``)."""
        return bool(getattr(self.inner, "_step_supports_amp_scaling", False))

    def step_on_device(self, grad_multiplier: torch.Tensor | float,
                       skipped: torch.Tensor) -> None:
        """``step`` with the multiplier a device tensor, skipped on the device where
        ``skipped`` is true ([Note: step outcome on the device])."""
        self._update(grad_multiplier, skipped if self.skips_on_device else None)

    def step(self, closure=None, *, grad_multiplier: float | None = None):
        """Update with gradients ``grad_shard * grad_multiplier``; cast back to the shards."""
        if closure is not None or grad_multiplier is None:
            raise RuntimeError("call engine.step(), not optimizer.step(): the engine averages, "
                               "clips and unscales the sharded gradients before this update")
        self._update(grad_multiplier, None)
        return None

    def _update(self, grad_multiplier: torch.Tensor | float,
                found_inf: torch.Tensor | None) -> None:
        """The torch optimizer's update of the masters on ``grad_shard * grad_multiplier``
        (skipped where ``found_inf``, a device flag its fused step reads), then the masters
        cast into the working shards."""
        self._opt_called = True
        self.wait_for_checkpoint_copy()
        try:
            with self._allocating_state():  # the host's work when offloaded
                self._gradients_fp32().mul_(grad_multiplier)
            if found_inf is not None:
                self.inner.found_inf = found_inf.to(torch.float32)
            with self._allocating_state():  # the moments torch creates, if offloaded
                self.inner.step()
        finally:
            self.inner.found_inf = None
            self._end_step()
        self._write_back()

    def _write_back(self) -> None:
        """The updated masters cast into the working shards."""
        if self._shard_staging is not None:  # offloaded on CUDA: cast on the host, then DMA
            assert self.shards_flat is not None
            if self._staging_read is not None:
                self._staging_read.synchronize()  # the last step's copy has read the buffer
            self._shard_staging.copy_(self.master_flat)
            self.shards_flat.copy_(self._shard_staging, non_blocking=True)
            self._staging_read = torch.cuda.Event()
            self._staging_read.record()
        elif self.shards_flat is not None:
            self.shards_flat.copy_(self.master_flat)
        else:  # replicated units: each shard lies inside its unit's whole weights
            for unit, (start, end) in zip(self.units, self.unit_ranges, strict=True):
                unit.shard.copy_(self.master_flat[start:end])

    # torch's lr schedulers warn at their first step unless the optimizer's step is theirs
    # (wrapped) and has run. The engine steps this optimizer before any schedule it drives
    # (``_opt_called``, set by each step), so a schedule bound to it later
    # (``bind_client_schedule``) has nothing to warn about.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def wait_for_checkpoint_copy(self) -> None:
        # [Note: asynchronous checkpoint saves]: the masters and moments may change only once
        # an asynchronous save has copied them.
        if self.before_update is not None:
            self.before_update()

    def skip_step(self) -> None:
        self._end_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the units' shards (``engine.zero_grad()`` drops them)."""

    # ---- shard-shaped state (checkpoints) ------------------------------------------------
    def shard_master(self, index: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weights of unit ``index``'s shard; unoptimized ones from the working shard.
        ``out``: a host buffer to copy into (a checkpoint's staging buffer; asynchronous
        where it is pinned), else a new tensor."""
        runs = self.runs_of_unit[index]
        shard = self.units[index].shard
        if out is None:
            full = shard.float().clone()
        else:
            full = out
            if not self._runs_cover(index):
                full.copy_(shard, non_blocking=True)
        for run in runs:
            full[run.start : run.end].copy_(run.master.detach(), non_blocking=True)
        return full

    def _runs_cover(self, index: int) -> bool:
        """Whether the optimizer's runs hold every element of unit ``index``'s shard."""
        return sum(run.end - run.start for run in self.runs_of_unit[index]) == \
            self.units[index].layout.shard_numel

    def state_keys(self) -> list[str]:
        """Names of the element-wise optimizer state (e.g. exp_avg, exp_avg_sq)."""
        keys: list[str] = []
        for run in self.runs:
            for key, value in self.state.get(run.master, {}).items():
                if _elementwise(value, run.master) and key not in keys:
                    keys.append(key)
        return keys

    def shard_state(self, index: int, out: dict[str, torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
        """Element-wise state in shard layout; zeros where an element has none. ``out``:
        host buffers by key to copy into (as ``shard_master``)."""
        result = {}
        for key in self.state_keys():
            if out is None:
                full = torch.zeros(self.units[index].layout.shard_numel, dtype=torch.float32,
                                   device=self.master_flat.device)
            else:
                full = out[key]
                if not self._runs_cover(index):
                    full.zero_()
            for run in self.runs_of_unit[index]:
                value = self.state.get(run.master, {}).get(key)
                if value is not None:
                    full[run.start : run.end].copy_(value, non_blocking=True)
                elif out is not None:
                    full[run.start : run.end].zero_()
            result[key] = full
        return result

    def scalar_state(self) -> dict[str, float]:
        """Per-tensor scalars (Adam's step, ...): the same for every tensor that has state."""
        for run in self.runs:
            state = self.state.get(run.master, {})
            scalars = {key: float(value) for key, value in state.items()
                       if isinstance(value, torch.Tensor) and value.dim() == 0}
            if state:
                return scalars
        return {}

    def load_shard(self, index: int, master: torch.Tensor, state: dict | None = None,
                   scalars: dict | None = None) -> None:
        """Set unit ``index``'s fp32 weights (and optimizer state) from shard-shaped tensors,
        copied (the caller may reuse them): into the state tensors the optimizer already holds
        where their shapes match, so a load into a trained engine allocates nothing."""
        start, end = self.unit_ranges[index]
        self.wait_for_checkpoint_copy()
        with torch.no_grad():
            self.units[index].shard.copy_(master)
            self.master_flat[start:end].copy_(master)
        if state is None:
            return
        for run in self.runs_of_unit[index]:
            held = self.state.get(run.master, {})
            restored = {}
            for key, value in state.items():
                piece = value[run.start : run.end]
                kept = held.get(key)
                fits = (isinstance(kept, torch.Tensor) and kept.shape == piece.shape
                        and kept.dtype == piece.dtype)
                if fits:
                    restored[key] = kept.copy_(piece)
                else:  # a new state tensor where the optimizer keeps it: host memory if offloaded
                    with self._allocating_state():
                        restored[key] = piece.to(run.master.device, copy=True)
            for key, value in (scalars or {}).items():
                restored[key] = self._scalar_tensor(value, run)
            self.state[run.master] = restored

    def _allocating_state(self) -> contextlib.AbstractContextManager:
        """Where the optimizer's own tensors are allocated: host memory when offloaded."""
        return self.host.running() if self.host is not None else contextlib.nullcontext()

    def _scalar_tensor(self, value: float, run: _Run) -> torch.Tensor:
        """A per-tensor scalar as torch keeps it: on the device for fused and capturable
        updates, on the host otherwise."""
        group = self.param_groups[run.group]
        on_device = group.get("fused") or group.get("capturable")
        return torch.tensor(value, dtype=torch.float32,
                            device=run.master.device if on_device else "cpu")

    def moment_tensors(self) -> list[torch.Tensor]:
        """Every element-wise state tensor this rank holds."""
        return [value for master in self.masters for value in self.state.get(master, {}).values()
                if _elementwise(value, master)]

    @property
    def step_count(self) -> float:
        return self.scalar_state().get("step", 0.0)


def _elementwise(value, master: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == master.shape


def _complement(runs: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The offsets of [0, numel) outside ``runs`` (sorted, disjoint)."""
    out, cursor = [], 0
    for start, end in runs:
        if start > cursor:
            out.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < numel:
        out.append((cursor, numel))
    return out


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in runs:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient, so clipping matches it exactly."""
    if max_norm <= 0 or not math.isfinite(grad_norm):
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))
