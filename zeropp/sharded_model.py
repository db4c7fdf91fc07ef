"""The sharded model: units, gradient reduction, the optimizer step; the hooks that gather,
prefetch and release units are in zeropp/unit_hooks.py.

[Note: protocol of one iteration]
Forward: the root unit (the model's own parameters: embeddings, final norm, tied head) is
gathered by the model's forward pre-hook; each transformer block is gathered by its own
pre-hook (waiting on a prefetch issued while the previous block computed) and released by its
post-hook; with hpZ the release keeps a secondary shard. The root stays gathered until its
gradients are reduced, since backward starts with the head and ends with the embeddings.
Backward: a hook on each block's output fires just before the block's backward; it gathers
the block (from the secondary shards inside the node with hpZ) and prefetches the previous
one. Activation-checkpoint recompute runs the block's forward hooks again while the engine is
in the BACKWARD phase; they then only make sure the block is gathered. After a unit's whole
backward (an identity autograd node on the block's inputs fires once their gradient exists:
FSDP2's post-backward; for a module run several times in one forward, after its last use's:
[Note: a unit used several times] in zeropp/unit_hooks.py) its gradients are reduce-scattered
(qgZ: hierarchical all-to-all) and its weights released. Frozen weights that backward still reads thus stay gathered after the
last *trainable* gradient has arrived, and the reductions sit at the same place among the
gathers on every rank, whatever parameters a rank left unused (those are reduced as zeros):
reducing when a unit's last gradient arrives would let two ranks interleave different
collectives on the same group. Units with no such point (the root, a first block under
frozen embeddings) are reduced and released when backward ends, in the unit list's reverse
order. The fp32 shard accumulates the results.

With hpZ, a training forward keeps each block's secondary shard even when the block ran
under ``no_grad`` (reentrant activation checkpointing), so its recompute gathers inside the
node too.
Step (``ZeroEngine.step``): at the accumulation boundary, ``PartitionedOptimizer`` averages once,
clips, checks overflow, updates the fp32 shards and casts them into the working shards; then
``refresh_after_update`` drops every derived copy (gathered buffers, secondary shards) and
re-gathers the units that stay whole.

Every rank issues the same collectives in the same order: gathers follow the model's graph,
prefetch decisions follow the previous iteration's recorded order and fixed sizes, and
reductions follow the graph's post-backward points, then the unit list.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from zeropp.comm import CommGroup, CommStats
from zeropp.comm.delta import DeltaWeightGather
from zeropp.comm.registry import Collectives
from zeropp.comm.streams import Execution
from zeropp.deepspeed_params.deepspeed_adoption import DeepSpeedValues, stand_in_for_deepspeed
from zeropp.flat_layout import FlatLayout
from zeropp.initial_values import UnitInitialValues, reset_parameters_values
from zeropp.kernels import KernelVariant, prepare_variants
from zeropp.offload import GradientDelivery, HostMemory
from zeropp.residency import Residency, shard_alignment, stays_gathered
from zeropp.topology import Topology
from zeropp.unit import ParamRef, PersistentUnits, ShardedUnit, ShardState, UnitComm
from zeropp.unit_hooks import TrainingPhase, UnitHooks, release_all
from zeropp.unit_modules import check_no_sharing, default_unit_modules, unit_cap, unit_parameters

# reset_parameters_values lives in zeropp.initial_values and TrainingPhase in zeropp.unit_hooks;
# both stay importable from here.
__all__ = ["ShardedModel", "ShardingOptions", "TrainingPhase", "find_unit",
           "reset_parameters_values"]


@dataclass(frozen=True)
class ShardingOptions:
    """The engine's knobs, resolved from the DeepSpeed JSON (see ``zeropp.config``)."""

    prefetch_bucket_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    persistence_threshold: int = 100_000
    overlap_comm: bool = True
    # Flat gradient buffers, in units of the largest one, that reductions in flight may hold
    # besides the one filling ([Note: reductions in flight]): this, not the model's depth,
    # bounds that memory.
    max_inflight_reductions: int = 1
    # The ZeRO stage (0-3): where weights, gradients and optimizer states live, resolved
    # with hpZ into a ``Residency`` ([Note: residency]).
    stage: int = 3
    # Divide gradients by this before summing them over ranks; None divides by the
    # data-parallel size (DeepSpeed's stage 3 pre-divides so: fp16 sums cannot overflow
    # where the average would not). 1.0 sums first and divides once at the step.
    gradient_predivide_factor: float | None = None
    # dtype of the exact gradient reductions (communication_data_type); None: working dtype.
    communication_dtype: torch.dtype | None = None
    # Blocks reused within this many parameter elements stay gathered from their forward to
    # their backward (stage3_max_reuse_distance, zeropp.prefetch.blocks_kept_for_backward).
    # 0 here keeps none; the DeepSpeed config's default is 1e9, as in DeepSpeed.
    max_reuse_distance: int = 0
    # Blocks with more parameters than this are split into units below the block
    # ([Note: units]); None keeps whole blocks. The DeepSpeed config sets it to a quarter
    # of stage3_max_live_parameters (``unit_cap``), as here for the default budget.
    max_unit_numel: int | None = unit_cap(1_000_000_000)


def _param_owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, attr))
    return owners


# Every live ShardedModel, so that ``zeropp.zero.GatheredParameters`` finds the unit holding a
# parameter from the parameter alone: nothing is attached to the parameters themselves.
_LIVE_MODELS: weakref.WeakSet[ShardedModel] = weakref.WeakSet()
_SERIAL = itertools.count()  # construction order: the same on every rank


def find_unit(param: torch.Tensor) -> tuple[ShardedModel, int] | None:
    """(the sharded model, the index of its unit) holding ``param``; None if no engine does."""
    for sharded in list(_LIVE_MODELS):
        index = sharded.unit_index_of(param)
        if index is not None:
            return sharded, index
    return None


class ShardedModel:
    """Shards a model over the data-parallel world and trains it; see the module note."""

    def __init__(
        self,
        model: nn.Module,
        topology: Topology,
        options: ShardingOptions,
        dtype: torch.dtype,
        device: torch.device,
        collectives: Collectives,
        hpz_group: CommGroup | None,
        execution: Execution,
        residency: Residency,
        param_init_fn: Callable[[str], torch.Tensor] | None = None,
        unit_modules: list[nn.Module] | None = None,
        grad_dtype: torch.dtype = torch.float32,
        host_shards: HostMemory | None = None,
        host_gradients: HostMemory | None = None,
    ) -> None:
        """``host_shards`` / ``host_gradients``: where the working / gradient shards live
        when parameters / the optimizer are offloaded ([Note: offload]); None keeps them on
        ``device``."""
        self.module = model
        self.host_shards = host_shards
        self.host_gradients = host_gradients
        self.topology = topology
        self.options = options
        self.dtype = dtype
        self.device = device
        self.stats = CommStats()
        self.residency = residency
        # ``world`` is the group parameters are sharded over; ``dp_size`` the number of
        # replicas whose gradients are averaged (the same ranks unless stage 0 replicates).
        self.dp_size = topology.world_size
        reduce_world = None
        if self.residency.shard_optimizer_states:
            # The default group itself, not None: no lookup of it at every collective.
            world_group = dist.group.WORLD if dist.is_initialized() else None
            self.world = CommGroup(world_group, topology.world_size, topology.rank,
                                   topology.spans_nodes)
            if topology.reduce_world_group is not None:
                reduce_world = CommGroup(topology.reduce_world_group, topology.world_size,
                                         topology.rank, topology.spans_nodes)
        else:
            self.world = CommGroup(None, 1, 0, False)
        self.comm = UnitComm(
            world=self.world,
            hpz=hpz_group,
            gather=collectives.gather,
            reduce=collectives.reduce,
            secondary_gather=collectives.secondary_gather,
            stats=self.stats,
            execution=execution,
            alignment=shard_alignment(self.residency, collectives.alignment),
            reduce_dtype=collectives.reduce.output_dtype or options.communication_dtype,
            predivide_factor=float(options.gradient_predivide_factor or self.dp_size),
            grad_dtype=grad_dtype,
            reduce_world=reduce_world,
            gradient_delivery=None if host_gradients is None else GradientDelivery(device),
        )
        # A model DeepSpeed's zero.Init partitioned: meta stand-ins now, values per unit
        # ([Note: adopting DeepSpeed's partitions]).
        deepspeed_sources = stand_in_for_deepspeed(model)
        self.units, self.initial_masters = self._build_units(
            model, unit_modules if unit_modules is not None else default_unit_modules(
                model, options.max_unit_numel, options.persistence_threshold),
            param_init_fn, DeepSpeedValues(deepspeed_sources) if deepspeed_sources else None,
        )
        self.root = self.units[0]
        # Reductions in flight, oldest first (a unit, or the persistent units' joint one),
        # with the gradient elements each holds; ``_reducing_numel`` is their sum.
        self._reducing: deque[tuple[ShardedUnit | PersistentUnits, int]] = deque()
        self._reducing_numel = 0
        self._reduce_this_backward = True  # False on stage 1's micro-batches before the boundary
        # Called with a unit's index after its working shard was written outside a step
        # (zeropp.zero.GatheredParameters with a modifier_rank): whoever keeps another copy
        # of the weights, the optimizer's fp32 masters, brings it up to date.
        self.shard_write_listeners: list[Callable[[int], None]] = []
        self._param_units = {id(p): (index, p) for index, unit in enumerate(self.units)
                             for p in unit.params}
        # The root's reduction comes last, when nothing follows it to overlap: not a measure.
        self._largest_gradient_buffer = max(
            (u.layout.padded_numel for u in self.units[1:] if u.num_grad_params), default=0)
        self.serial = next(_SERIAL)
        self.hooks = UnitHooks(self.units, options, self.comm, self._make_room,
                               self._unit_backward_done)
        self._guard_handles = self._install_state_dict_guards()
        # [Note: persistent units] Small units other than the root, at stage 3: joint
        # collectives (one-by-one gathers with a gather that keeps state per unit).
        self.persistent_units = PersistentUnits(
            [u for u in self.units if u.joins_persistent_gather], self.comm)
        self._persistent = set(self.persistent_units.units)  # for membership tests
        self._gather_persistent()
        # Compiled here, not inside the first iteration: launch variants prepared (0 where
        # the Triton kernels do not run: CPU, the simulated cluster, the reference forced).
        self.prepared_kernels = prepare_variants(device, self.kernel_variants())
        _LIVE_MODELS.add(self)

    # ---- construction --------------------------------------------------------------------
    def _build_units(self, model, unit_modules, param_init_fn, deepspeed_values=None):
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        owners = _param_owners(model)
        module_names = {id(m): n for n, m in model.named_modules()}
        plan = [("<root>" if module is model else module_names.get(id(module), "?"), module, params)
                for module, params in unit_parameters(model, unit_modules)]
        check_no_sharing(plan, unit_modules)

        layouts = [FlatLayout.build([(names[id(p)], tuple(p.shape)) for p in params],
                                    num_shards=self.world.size, align=self.comm.alignment)
                   for _name, _module, params in plan]
        # [Note: flat shards] Every unit's working shard and gradient shard are views of one
        # flat buffer each, in unit order, so the optimizer step reads all gradients and
        # writes all weights with one kernel each (zeropp.optimizer) instead of a few per
        # unit. Replicated units (stages 0-2) keep their shard inside their whole weights.
        total = sum(layout.shard_numel for layout in layouts)
        self.grad_shards_flat = (
            self.host_gradients.zeros(total, self.comm.grad_dtype) if self.host_gradients
            is not None else torch.zeros(total, dtype=self.comm.grad_dtype, device=self.device))
        self.shards_flat = None
        if self.host_shards is not None:
            if self.residency.weights_replicated:
                raise ValueError("offloaded parameters need stage 3 (stages 0-2 keep whole "
                                 "weights on every device)")
            self.shards_flat = self.host_shards.zeros(total, self.dtype)
        elif not self.residency.weights_replicated:
            self.shards_flat = torch.zeros(total, dtype=self.dtype, device=self.device)
        units, masters, offset = [], [], 0
        for (name, module, params), layout in zip(plan, layouts, strict=True):
            start, offset = offset, offset + layout.shard_numel
            initial = UnitInitialValues(module, module_names.get(id(module), ""),
                                        {names[id(p)]: p for p in params}, param_init_fn,
                                        deepspeed_values)
            master = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.device)
            if master.device.type != "meta":  # the simulated cluster: no values to make
                if deepspeed_values is not None:  # collective: every rank, every unit
                    deepspeed_values.gather_unit(params)
                layout.fill_shard(master, self.world.rank, initial)
            refs = [ParamRef(p, owners[id(p)]) for p in params]
            unit = ShardedUnit(
                name, module, refs, layout, self.comm, self.dtype, self.device,
                persistent=stays_gathered(layout.numel, self.options.persistence_threshold),
                replicated=self.residency.weights_replicated, is_root=module is model,
                shard=None if self.shards_flat is None else self.shards_flat[start:offset],
                grad_shard=self.grad_shards_flat[start:offset],
                shard_in_host_memory=self.host_shards is not None,
            )
            unit.shard.copy_(master)
            initial.clear()
            if deepspeed_values is not None:
                deepspeed_values.clear()
            units.append(unit)
            masters.append(master)
        leftovers = [n for n, b in model.named_buffers() if b.is_meta]
        if leftovers:
            raise ValueError(
                f"buffers still on the meta device after sharding: {leftovers}: the engine "
                "materializes parameters only, so register buffers with real values (e.g. "
                "after leaving zeropp.zero.Init)"
            )
        return units, masters

    def _install_state_dict_guards(self) -> list:
        """``module.state_dict()`` (Hugging Face's ``save_pretrained`` calls it) while weights
        it would read are sharded returns their empty placeholders, as DeepSpeed's does, and
        warns once ([Note: state_dict of sharded weights]). Every module holding parameters
        gets the check, for the units under it.
        """
        if self.residency.weights_replicated:
            return []  # stages 0-2: the weights stay whole
        handles = []
        warned = [False]  # once per engine, whichever module is read first
        unit_of = {id(p): unit for unit in self.units for p in unit.params}
        for name, module in self.module.named_modules():
            units = {id(unit_of[id(p)]): unit_of[id(p)] for p in module.parameters()}
            if not units:
                continue
            label = f"{name} ({type(module).__name__})" if name else type(module).__name__
            handles.append(module.register_state_dict_pre_hook(
                partial(_warn_sharded_state_dict, warned, list(units.values()), label)))
        return handles

    # ---- the gradient path ---------------------------------------------------------------
    def _unit_backward_done(self, unit: ShardedUnit) -> None:
        """All of ``unit``'s gradients are in (``UnitHooks._post_backward``): reduce them,
        unless stage 1 holds them to the boundary or the persistent units' joint reduction
        takes them at the end of backward."""
        if self._reduce_this_backward and unit not in self._persistent:
            self._start_reduction(unit)

    def _start_reduction(self, unit: ShardedUnit | PersistentUnits) -> None:
        unit.start_reduce()
        self._reducing.append((unit, unit.reduction_numel))
        self._reducing_numel += unit.reduction_numel
        self._make_room(0)

    def _finish_oldest_reduction(self) -> None:
        unit, numel = self._reducing.popleft()
        self._reducing_numel -= numel
        unit.finish_reduce()

    def _gather_persistent(self) -> None:
        self.persistent_units.gather_now("forward_all_gather")

    def _make_room(self, numel: int) -> None:
        """[Note: reductions in flight] Reductions still running hold their units' flat
        gradient buffers. Before a unit's buffer of ``numel`` elements opens, and whenever a
        reduction starts, the oldest are waited for until those buffers and the new one fit
        ``max_inflight_reductions`` + 1 of the largest unit's: gradient memory is bounded by
        that, not by depth, while a reduction of a large unit keeps overlapping the backward
        of the smaller units after it (a block's dense projection after its MLP) instead of
        being waited for after the next unit's backward alone.
        """
        budget = (self.options.max_inflight_reductions + 1) * self._largest_gradient_buffer
        while self._reducing and numel + self._reducing_numel > budget:
            self._finish_oldest_reduction()

    def _finish_reductions(self) -> None:
        while self._reducing:
            self._finish_oldest_reduction()

    def close(self) -> None:
        """Finish the reductions in flight, stop communication threads, remove the hooks.

        The module hooks make a reference cycle through the model that the collector breaks
        only when it runs; removing them frees a closed engine's shards at once, before a
        program builds a second engine (a resumed run in the same process). The gradient
        hooks hold their unit weakly (``UnitHooks``).
        """
        self._finish_reductions()
        self.comm.execution.close()
        self.hooks.remove()
        for handle in self._guard_handles:
            handle.remove()
        self._guard_handles.clear()
        _LIVE_MODELS.discard(self)

    def kernel_variants(self) -> list[KernelVariant]:
        """The quantization kernels this model's collectives launch in an iteration, as each
        collective names them for its buffers (``Collective.kernel_variants``): every unit's
        gather (stage 3) and hpZ backward gather, every unit's reduction, and the persistent
        units' joint reduction. An iteration launches no other (tests/test_kernel_variants.py
        records one and compares)."""
        comm, variants = self.comm, []
        sharded_weights = self.residency.reshard_after_use
        for unit in self.units:
            if unit in self._persistent:  # exact joint gather; the joint reduction is below
                continue
            numel = unit.layout.shard_numel
            if sharded_weights:
                variants += comm.gather.kernel_variants(numel, unit.dtype, comm.world)
            if sharded_weights and comm.hpz is not None:
                variants += comm.secondary_gather.kernel_variants(
                    unit.layout.padded_numel // comm.hpz.size, unit.dtype, comm.hpz)
            if unit.num_grad_params:
                variants += comm.reduce.kernel_variants(numel, unit.dtype, comm.reduce_group)
        joint = [u for u in self.persistent_units.units if u.num_grad_params]
        if joint:
            variants += comm.reduce.kernel_variants(sum(u.layout.shard_numel for u in joint),
                                                    joint[0].dtype, comm.reduce_group)
        return variants  # repeats (units of one size) are prepared once

    # ---- public API ----------------------------------------------------------------------
    @property
    def phase(self) -> TrainingPhase:
        """Where the iteration is: set by the hooks (``UnitHooks``) and ``run_backward``."""
        return self.hooks.phase

    @property
    def error_feedback(self):
        """qgZ's ``ErrorFeedback`` when it carries quantization errors, else None."""
        return self.comm.reduce.error_feedback

    @property
    def weight_deltas(self) -> DeltaWeightGather | None:
        """The forward gather when it keeps per-unit bases ([Note: weight deltas])."""
        gather = self.comm.gather
        return gather if isinstance(gather, DeltaWeightGather) else None

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def run_backward(self, scaled_loss: torch.Tensor, accumulation_boundary: bool = True) -> None:
        """Backward of an already scaled loss, then flush every unit's gradient reduction.

        Stage 1 reduces only on the accumulation boundary's micro-batch; before it every
        unit's gradients stay whole in its flat buffer ([Note: residency]).
        """
        self.hooks.begin_backward()
        self._reduce_this_backward = (accumulation_boundary
                                      or self.residency.reduce_every_micro_batch)
        try:
            scaled_loss.backward()
            # The persistent units' joint reduction, then the units with no post-backward
            # point (the root, a block whose inputs need no gradient), in the unit list's
            # reverse order: the same order on every rank.
            for unit in self.persistent_units.units:
                unit.backward_done = True
            if self._reduce_this_backward and self._persistent:
                self._start_reduction(self.persistent_units)
            for unit in reversed(self.units):
                if not unit.backward_done:
                    unit.backward_done = True
                    if self._reduce_this_backward:
                        self._start_reduction(unit)
            if not self._reduce_this_backward:
                for unit in self.units:
                    unit.hold_gradients()
            self._finish_reductions()
        finally:
            self.hooks.end_backward()
        release_all(self.units)

    def zero_grad(self) -> None:
        """Forget every gradient not yet applied: held, flattened and reduced ones."""
        self._finish_reductions()
        for unit in self.units:
            unit.drop_gradients()

    def refresh_after_update(self, cause: str = "edit") -> None:
        """The shards changed (``cause``: "step", "load" or "edit", see
        ``ShardedUnit.refresh_after_update``): rebuild every derived copy."""
        for unit in self.units:
            unit.refresh_after_update(cause, regather=unit not in self._persistent)
        self._gather_persistent()

    def unit_index_of(self, param: torch.Tensor) -> int | None:
        """Index of the unit holding ``param`` (one of the model's parameters), else None."""
        entry = self._param_units.get(id(param))
        return entry[0] if entry is not None and entry[1] is param else None

    def settle(self) -> None:
        """Finish every collective in flight (prefetches, reductions): a collective issued
        next from this thread then follows them on every rank."""
        self._finish_reductions()
        for unit in self.units:
            if unit.gathering:
                unit.wait_gather()

    def shard_written(self, index: int) -> None:
        """Unit ``index``'s working shard was written outside a step: tell the listeners."""
        for listener in self.shard_write_listeners:
            listener(index)

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[nn.Module]:
        """Full, exact weights on every rank for the duration of the block (read-only use)."""
        # Units that stay gathered may hold qwZ's dequantized weights: they are gathered
        # exactly for the block, and training gets its own copy back afterwards.
        training_copies: dict[ShardedUnit, torch.Tensor] = {}
        self.settle()
        for unit in self.units:
            inexact = unit.state is ShardState.GATHERED and not unit.gathers_exactly
            if inexact and not unit.holds:
                training_copies[unit] = unit.full.clone()
            unit.gather_exact(self.stats, refresh=inexact and not unit.holds)
        try:
            yield self.module
        finally:
            for unit, full in training_copies.items():
                unit.full.copy_(full)
            release_all(self.units)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """What ``state_dict()`` of the unwrapped model holds, unsharded, as CPU copies
        (collective: all ranks call it). Parameters are in the working dtype; every name of
        a tied parameter is there and the names share one tensor, as in ``state_dict()``.
        """
        with self.gathered_parameters():
            # Inside the gather the state_dict guards pass; keep_vars keeps the parameter
            # objects, so tied names are recognized by identity.
            state = self.module.state_dict(keep_vars=True)
            copies: dict[int, torch.Tensor] = {}
            out = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    if id(value) not in copies:
                        copies[id(value)] = value.detach().to("cpu", copy=True)
                    value = copies[id(value)]
                out[key] = value
        return out


def _warn_sharded_state_dict(warned: list[bool], units: list[ShardedUnit], label: str, module,
                             prefix, keep_vars) -> None:
    """[Note: state_dict of sharded weights] DeepSpeed's ZeRO-3 ``module.state_dict()``
    returns the released parameters' empty placeholders, and scripts rely on that not
    failing: DeepSpeed-Chat's ``save_hf_format`` calls it on rank 0 alone (a gather there
    would be a collective one rank enters), then ``save_zero_three_model`` writes the
    gathered weights over that file. So it returns the same empty tensors here
    ([Note: released parameters] in zeropp/unit.py), and says once per engine how to read
    the whole weights."""
    if warned[0] or all(unit.state is ShardState.GATHERED for unit in units):
        return
    warned[0] = True
    warnings.warn(
        f"state_dict(): the weights of {label} are sharded by ZeRO stage 3 and read as empty "
        "tensors, as in DeepSpeed; read them inside engine.gathered_parameters() or "
        "zeropp.zero.GatheredParameters(...), or use engine.full_state_dict() / "
        "engine.save_16bit_model()", stacklevel=3)
