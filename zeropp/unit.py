"""A unit of sharding: one module's parameters in one flat buffer, and its explicit states.

[Note: parameter storage]
Each parameter of a unit is an ``nn.Parameter`` whose ``.data`` is a view into the unit's
full flat buffer ``full``. Releasing the unit frees the *storage* of ``full`` (resized to 0
bytes) instead of swapping tensors; gathering resizes it back and writes into it. The views
stay valid throughout, so tensors autograd saved in forward (e.g. ``weight.t()``) point at the
same storage and see the re-gathered values in backward, while the memory is really freed in
between. The parameters keep their own version counters (``.data`` assignment does not share
the buffer's), so the writes of a gather do not trip autograd's in-place checks. Nothing is
attached to the parameters; all state lives here.

States (``ShardState``):
- SHARDED: only ``shard``, this rank's 1/N of the working weights, exists.
- GATHERED: ``full`` holds the whole unit (a gather has completed).
- SECONDARY (hpZ): ``full`` is freed but ``secondary_shard``, this rank's 1/alpha of the
  weights as gathered in forward, is kept so backward gathers them inside the node.

A *replicated* unit (stages 0-2, [Note: residency]) never frees ``full``: its ``shard`` is a
view of this rank's range of it, so the optimizer writes the update in place and the gather
after the step fills in the other ranks' ranges.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field

import torch
from torch import nn

from zeropp.comm import CommGroup, CommStats, Pending, all_gather
from zeropp.comm.collectives import AllGather, Collective
from zeropp.comm.streams import Execution
from zeropp.deepspeed_params.param_face import (
    ZeroParamStatus,
    mirror_status,
    present_as_partitioned,
)
from zeropp.flat_layout import FlatLayout
from zeropp.offload import GradientDelivery


class ShardState(enum.Enum):
    SHARDED = "sharded"
    GATHERED = "gathered"
    SECONDARY = "secondary"


@dataclass
class UnitComm:
    """How units talk: groups, the collectives ([Note: collective protocol]), the accounting."""

    world: CommGroup
    hpz: CommGroup | None  # None when hpZ is off
    gather: Collective  # primary gather over the world: exact, or qwZ
    reduce: Collective  # gradient reduction over the world: exact, qgZ, or stage 0's all-reduce
    secondary_gather: Collective  # hpZ's backward gather inside the node
    stats: CommStats
    execution: Execution  # where collectives run: streams on CUDA, threads on gloo
    # Shards (and reduction buckets) are padded to a multiple of this many elements
    # (``zeropp.residency.shard_alignment``).
    alignment: int = 1
    # dtype the reductions deliver (None: the working dtype): communication_data_type for
    # the exact reduce-scatter, fp32 for qgZ, whose last sum is in fp32 already.
    reduce_dtype: torch.dtype | None = None
    # Gradients are divided by this before they are summed over ranks (headroom in fp16):
    # the engine scales the loss by it before backward, so they arrive divided; the
    # optimizer divides by the rest of data-parallel size x accumulation x loss scale.
    predivide_factor: float = 1.0
    # dtype of the gradient shards: the working dtype when nothing accumulates across
    # micro-batches (DeepSpeed's 16-bit gradient partitions), fp32 when gradients do.
    grad_dtype: torch.dtype = torch.float32
    # Gathered elements of all units, kept as units change state ([Note: live count]).
    live: LiveCount = field(default_factory=lambda: LiveCount())
    # The world again, on a communicator of its own: reductions overlap gathers on NCCL
    # (``zeropp.topology``'s ``reduce_world``). None: ``world``.
    reduce_world: CommGroup | None = None
    # Set where the gradient shards live in host memory ([Note: offload]): reductions land
    # in a device buffer that this sends across.
    gradient_delivery: GradientDelivery | None = None

    @property
    def reduce_group(self) -> CommGroup:
        return self.reduce_world if self.reduce_world is not None else self.world


class LiveCount:
    """[Note: live count] The elements of gathered weights (or gathers in flight) over all
    units of a model: what ``stage3_max_live_parameters`` bounds. Each unit adds or removes
    its size as it becomes live or stops being, so every prefetch and release decision reads
    one number instead of summing over the units (which made scheduling quadratic in depth)."""

    __slots__ = ("numel",)

    def __init__(self) -> None:
        self.numel = 0


@dataclass
class ParamRef:
    """Where a parameter is registered (a tied parameter may be registered in several)."""

    param: nn.Parameter
    owners: list[tuple[nn.Module, str]]


class ShardedUnit:
    def __init__(
        self,
        name: str,
        module: nn.Module,
        refs: list[ParamRef],
        layout: FlatLayout,
        comm: UnitComm,
        dtype: torch.dtype,
        device: torch.device,
        persistent: bool = False,
        replicated: bool = False,
        is_root: bool = False,
        shard: torch.Tensor | None = None,
        grad_shard: torch.Tensor | None = None,
        shard_in_host_memory: bool = False,
    ) -> None:
        """``shard`` and ``grad_shard``, when given, are the storage of this unit's working
        and gradient shards (views of the model's flat buffers, [Note: flat shards]); by
        default the unit allocates its own."""
        self.name = name
        self.module = module
        self.layout = layout
        self.padded_numel = layout.padded_numel  # elements gathered (read by the prefetch rule)
        self.comm = comm
        self.dtype = dtype
        self.device = device
        # The whole weights live on every rank between steps (stages 0-2).
        self.replicated = replicated
        # Units that stay gathered between steps: replicated ones, and small ones at stage 3
        # (stage3_param_persistence_threshold).
        self.persistent = persistent or replicated
        rank = comm.world.rank
        self.shard_start, self.shard_end = layout.shard_range(rank)

        self.full = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        self._full_nbytes = self.full.numel() * self.full.element_size()
        if replicated:
            self.shard = self.full[self.shard_start : self.shard_end]
        elif shard is not None:
            self.shard = shard  # in host memory with offloaded parameters ([Note: offload])
        else:
            self.shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        self.shard_in_host_memory = shard_in_host_memory
        # hpZ: the 16-bit weights of this rank's node slice, or with the int8 secondary the
        # payload rows of qwZ's forward gather ([Note: int8 secondary]).
        self.secondary_shard: torch.Tensor | None = None
        # Units released between forward and backward keep a secondary shard (hpZ); with the
        # int8 one, its payload is taken from each forward gather as it lands.
        # Persistent units other than the root are gathered exactly, jointly
        # ([Note: persistent units]).
        self.joins_persistent_gather = self.persistent and not (is_root or replicated)
        self._keeps_payload = (comm.hpz is not None and not (self.persistent or is_root)
                               and comm.secondary_gather.secondary_from_gather)
        self._forward_payload: torch.Tensor | None = None
        self.is_live = False  # gathered or gathering: counted in comm.live ([Note: live count])
        self._state = ShardState.SHARDED
        self._gather_pending_: Pending | None = None

        # Gradient shard (summed over ranks and micro-batches, not yet averaged), in
        # ``comm.grad_dtype``: fp32 where micro-batches accumulate into it.
        if grad_shard is None:
            grad_shard = torch.zeros(layout.shard_numel, dtype=comm.grad_dtype, device=device)
        self.grad_shard = grad_shard
        # Whether the gradient shard is known to hold zeros (a reduction may then write it).
        self.grad_shard_is_zero = True
        # The reduction in flight, and its output when it is not the gradient shard itself.
        self._reduce_pending: tuple[Pending, torch.Tensor | None] | None = None
        # Stage 1's gradients held flat through the accumulation window, in the layout of
        # ``full``; the parameters' ``.grad`` are views of it ([Note: gradient buffer]).
        self._grad_flat: torch.Tensor | None = None
        # The zeros after the last parameter in the flat buffer. Made with each flattening,
        # with the gradients: held for good they would be device memory an offloaded run
        # does not plan for (its model states live on the host).
        self._grad_padding_numel = layout.padded_numel - layout.numel
        # The unit's backward is over and its reduction started (UnitHooks._post_backward).
        self.backward_done = False
        # ``zeropp.zero.GatheredParameters`` contexts holding the whole weights: the user reads
        # or writes them until the context exits, so the engine's own releases leave them.
        self.holds = 0
        # Whole weights handed to a user, who may keep tensors of them: freed by rebinding
        # ``full`` ([Note: storage lent to the user] in zeropp/deepspeed_api/zero.py).
        self.lent_to_user = False

        self.params: list[nn.Parameter] = []
        # [Note: released parameters] While ``full`` is freed each parameter's ``.data`` is
        # this empty tensor, as DeepSpeed's partitioned parameters read; ``_views`` are the
        # views into ``full`` that a gather gives back. A view of freed storage would read
        # as garbage or crash (a null data pointer with elements); an empty tensor reads as
        # nothing, and an op that needs the weights fails with a shape error naming them.
        # Autograd's saved references to a parameter see its views again, because every
        # backward that uses a unit's weights gathers them first (its pre-backward hook).
        self._released = torch.empty(0, dtype=dtype, device=device)
        self._views: list[torch.Tensor] = []  # made once: reading ``param.data`` costs an op
        self._data_released = False
        for ref, view in zip(refs, layout.views(self.full), strict=True):
            self._views.append(view)
            param = nn.Parameter(
                torch.empty(0, dtype=dtype, device=device), requires_grad=ref.param.requires_grad
            )
            param.data = view  # see [Note: parameter storage]
            for owner, attr in ref.owners:
                owner._parameters[attr] = param
            self.params.append(param)
        self.num_grad_params = sum(p.requires_grad for p in self.params)
        # Stage 3: what a script written for DeepSpeed asks of a partitioned parameter,
        # mirrored from ``state`` ([Note: DeepSpeed's parameter attributes]).
        self._shown_status: ZeroParamStatus | None = None
        if not replicated:
            present_as_partitioned(self.params, [slot.shape for slot in layout.slots],
                                   self.persistent)
            self._shown_status = ZeroParamStatus.NOT_AVAILABLE
            self._free_full()  # the views above stay bound to the (now empty) storage

    # ---- storage -------------------------------------------------------------------------
    def _free_full(self) -> None:
        if self.lent_to_user:  # the user's tensors keep the gathered storage alive
            self.full = torch.empty_like(self.full)  # views made while it has memory
            self._views = list(self.layout.views(self.full))
            self.full.untyped_storage().resize_(0)
            self.lent_to_user = False
        else:
            self.full.untyped_storage().resize_(0)
        # [Note: released parameters] read as DeepSpeed's partitioned ones: empty.
        if not self._data_released:
            for param in self.params:
                param.data = self._released
            self._data_released = True

    def _alloc_full(self) -> None:
        storage = self.full.untyped_storage()
        if storage.nbytes() != self._full_nbytes:
            storage.resize_(self._full_nbytes)
        if self._data_released:
            for param, view in zip(self.params, self._views, strict=True):
                param.data = view
            self._data_released = False

    @property
    def gathering(self) -> bool:
        return self._gather_pending_ is not None

    @property
    def live_numel(self) -> int:
        """Elements of gathered weights this unit holds now (counts a gather in flight)."""
        return self.padded_numel if self.is_live else 0

    # The two fields that make a unit live, kept in step with ``comm.live`` on every change.
    @property
    def state(self) -> ShardState:
        return self._state

    @state.setter
    def state(self, value: ShardState) -> None:
        self._become(value, self._gather_pending_)

    def _become(self, state: ShardState, pending: Pending | None = None) -> None:
        """Set both fields at once, then ``comm.live`` and the status shown to DeepSpeed
        scripts from them: every transition goes through here, once."""
        self._state, self._gather_pending_ = state, pending
        live = state is ShardState.GATHERED or pending is not None
        if live != self.is_live:
            self.is_live = live
            self.comm.live.numel += self.padded_numel if live else -self.padded_numel
        if self._shown_status is not None:
            status = (ZeroParamStatus.AVAILABLE if state is ShardState.GATHERED else
                      ZeroParamStatus.INFLIGHT if live else ZeroParamStatus.NOT_AVAILABLE)
            if status is not self._shown_status:
                self._shown_status = status
                mirror_status(self.params, status)

    # ---- gather / release ----------------------------------------------------------------
    def start_gather(self, phase: str) -> None:
        """Begin materializing ``full`` (no-op when gathered or already gathering).

        Backward gathers come from the hpZ secondary shards inside the node when they exist;
        every other gather reads the primary shards over the whole world.
        """
        if self.is_live:  # gathered, or its gather in flight
            return
        self._alloc_full()
        if self._state is ShardState.SECONDARY:
            assert self.comm.hpz is not None and self.secondary_shard is not None
            pending = self.comm.secondary_gather(
                self.full, self.secondary_shard, self.comm.hpz, self.comm.stats, phase)
        elif self.joins_persistent_gather:  # exact on every path ([Note: persistent units])
            pending = all_gather(self.full, self.shard_on_device(on_lane=False),
                                 self.comm.world, self.comm.stats, phase)
        else:
            # A replicated unit's shard lies inside ``full``: NCCL allows that in-place
            # gather, gloo copies each input into its slot with memcpy (source == target),
            # so the shard is sent from a transient copy.
            shard = self.shard.clone() if self.replicated else self.shard_on_device()
            # qwZ hands the unit its gathered payload when the int8 secondary is kept from it.
            keep = {"retain": self._retain_secondary_payload} if self._keeps_payload else {}
            pending = self.comm.gather(self.full, shard, self.comm.world, self.comm.stats,
                                       phase, key=self.name, **keep)
        self._become(self._state, pending)

    def shard_on_device(self, on_lane: bool = True) -> torch.Tensor:
        """The working shard where collectives read it: the shard itself, or where it lives in
        host memory ([Note: offload]) a device copy, made on the gather lane (``on_lane``:
        for the unit's own gather) or on the current stream (for an exact collective issued
        there, which would not wait for the lane's copy)."""
        if not self.shard_in_host_memory:
            return self.shard
        return to_device(self.shard, self.device, self.comm.execution if on_lane else None)

    def _retain_secondary_payload(self, gathered: torch.Tensor) -> None:
        """Keep this rank's secondary shard out of the forward gather: its node slice of
        qwZ's payloads ([Note: int8 secondary]) or the weight-delta base ([Note: weight
        deltas])."""
        self._forward_payload = self.comm.secondary_gather.take(gathered, self.comm.hpz)

    def wait_gather(self) -> None:
        pending = self._gather_pending_
        if pending is not None:
            pending.wait()
            self._become(ShardState.GATHERED)
        elif self._state is not ShardState.GATHERED:
            raise RuntimeError(f"unit {self.name!r} used while {self._state.value}")

    def gather_now(self, phase: str) -> None:
        self.start_gather(phase)
        self.wait_gather()

    @property
    def gathers_exactly(self) -> bool:
        """Whether ``full``, once gathered, equals the shards (False under qwZ's gather)."""
        return (self.replicated or self.joins_persistent_gather
                or isinstance(self.comm.gather, AllGather))

    def gather_exact(self, stats: CommStats, refresh: bool = False) -> None:
        """Gather the working shards unquantized (reading weights out, not training).

        ``refresh`` gathers again a unit already gathered, whose ``full`` may hold qwZ's
        dequantized values or local changes; the shards are what counts.
        """
        self.lent_to_user = True
        if self.gathering:
            self.wait_gather()
        if self.state is ShardState.GATHERED and not refresh:
            return
        self.drop_secondary()
        self._alloc_full()
        # A replicated unit's shard lies inside ``full``: sent from a copy (see start_gather).
        shard = self.shard.clone() if self.replicated else self.shard_on_device(on_lane=False)
        all_gather(self.full, shard, self.comm.world, stats, "optimizer").wait()
        self.state = ShardState.GATHERED

    def release(self, keep_secondary: bool) -> None:
        """Free the gathered weights; with hpZ after forward, keep this rank's secondary shard."""
        if self.persistent or self.holds or self._state is not ShardState.GATHERED:
            return
        if keep_secondary and self.comm.hpz is not None:
            # A secondary shard kept already holds these weights (a recompute gathered them
            # from it): the weights change only at the step, which drops it.
            if self.secondary_shard is None and self._keeps_payload:
                self.secondary_shard = self._forward_payload  # None: not gathered by qwZ
            elif self.secondary_shard is None:
                size = self.layout.padded_numel // self.comm.hpz.size
                start = self.comm.hpz.rank * size
                self.secondary_shard = self.full[start : start + size].clone()
            has_secondary = self.secondary_shard is not None
            self._become(ShardState.SECONDARY if has_secondary else ShardState.SHARDED)
        else:
            self._become(ShardState.SHARDED)
        self._forward_payload = None
        self._free_full()

    def drop_secondary(self) -> None:
        """Secondary shards are a cache of one step's weights: never reuse them after it."""
        self.secondary_shard = None
        self._forward_payload = None
        if self._state is ShardState.SECONDARY:
            self.state = ShardState.SHARDED

    def refresh_after_update(self, cause: str = "edit", regather: bool = True) -> None:
        """The shard changed: drop every derived copy. ``cause`` tells a gather that keeps
        state per unit how: "step" (the optimizer's update), "load" (a checkpoint, which
        restored that state itself) or "edit" (anything else). ``regather=False`` leaves a
        persistent unit sharded for its owner to gather ([Note: persistent units])."""
        if cause == "step":
            self.comm.gather.mark_updated(self.name)
        elif cause == "edit":
            self.comm.gather.forget(self.name)
        elif cause != "load":
            raise ValueError(f"refresh_after_update: unknown cause {cause!r}")
        self.drop_secondary()
        if self.replicated and self.comm.world.size == 1:
            return  # stage 0: the update was written into the whole weights themselves
        if self.holds:  # a GatheredParameters context still reads them: gathered anew
            self.gather_exact(self.comm.stats, refresh=True)
            return
        if self.state is ShardState.GATHERED:
            self.state = ShardState.SHARDED
            # A persistent unit is gathered again at once into the same memory: an
            # iteration then ends with its weights where it began ([Note: iteration graphs]
            # in zeropp/acceleration/cuda_graph.py: a replayed forward reads them there).
            if not (self.replicated or self.persistent):
                self._free_full()
        if self.persistent and regather:
            self.gather_now("forward_all_gather")

    # ---- gradients -----------------------------------------------------------------------
    # [Note: gradient buffer] A unit's gradients are reduced from one flat buffer in the
    # layout of ``full`` (``contiguous_gradients``). Autograd makes each parameter's gradient
    # as its own tensor (it steals the first one it computes, so nothing is zero-filled or
    # added); when the unit's reduction starts they are copied into the flat buffer in one
    # ``torch.cat`` with the layout's padding, as FSDP2 copies gradients into its
    # reduce-scatter input: one launch per unit, where zero-filling a buffer and binding
    # every ``.grad`` to it cost a fill and one in-place add per parameter. The buffer is
    # the reduction's input, so it lives only while the reduction is in flight. Stage 1
    # holds it through the accumulation window: the first micro-batch's gradients are copied
    # in the same way, then every ``.grad`` is bound to its view and later micro-batches
    # accumulate into it in place.
    def _flatten_gradients(self) -> torch.Tensor:
        """Autograd's gradients of this unit in the layout of ``full``, one copy; the
        parameters' ``.grad`` are unset. A parameter without one (frozen, or unused on this
        rank) reduces zeros."""
        pieces = []
        for param, slot in zip(self.params, self.layout.slots, strict=True):
            grad = param.grad
            if grad is None:
                grad = torch.zeros(slot.numel, dtype=self.dtype, device=self.device)
            else:
                param.grad = None
            pieces.append(grad.reshape(-1))
        if self._grad_padding_numel:
            pieces.append(torch.zeros(self._grad_padding_numel, dtype=self.dtype,
                                      device=self.device))
        return torch.cat(pieces)

    def _unbind_gradients(self) -> None:
        for param in self.params:
            param.grad = None

    @property
    def gradient_buffer(self) -> torch.Tensor | None:
        """This micro-batch's (or stage 1's accumulated) gradients not yet reduced, if any."""
        return self._grad_flat

    def hold_gradients(self) -> None:
        """Keep this micro-batch's gradients in the flat buffer until the accumulation boundary
        (stage 1: the next micro-batches add into it, the last one reduces it)."""
        if self.num_grad_params and self._grad_flat is None:
            self._grad_flat = self._flatten_gradients()
            for param, view in zip(self.params, self.layout.views(self._grad_flat),
                                   strict=True):
                if param.requires_grad:
                    param.grad = view

    def start_reduce(self, phase: str = "gradient_reduce") -> None:
        """Launch the reduction of this micro-batch's flat gradients: one collective for the
        whole unit.

        [Note: one reduction per unit] The flat buffer is already the collective's input
        (autograd accumulated into it), so cutting it into ``reduce_bucket_size`` pieces
        would buy no memory (DeepSpeed's buckets bound its separate IPG copy, which this
        engine does not make) and would multiply the host's work: a collective, and with
        qgZ a quantize / swizzle / reduce sequence, per piece. Memory in flight is bounded
        per unit instead ([Note: reductions in flight]).

        A unit without trainable parameters sends nothing: every rank knows it (the model's
        ``requires_grad`` flags are the same everywhere) and its gradient shard stays zero.
        """
        if self.num_grad_params == 0:
            return
        flat = self.take_gradients()
        out_dtype = self.comm.reduce_dtype or self.dtype
        world = self.comm.reduce_group
        # Into the gradient shard itself while it holds nothing (the step zeroed it) and
        # the reduction rounds to its dtype anyway: no temporary and no addition. qgZ sums in
        # fp32 and rounds once on the write, as the addition to zero would.
        # (Not into a shard in host memory: a collective writes device memory.)
        direct = (self.grad_shard_is_zero and self.comm.gradient_delivery is None
                  and (out_dtype == self.grad_shard.dtype
                       or self.comm.reduce.output_dtype is not None))
        out = self.grad_shard if direct else torch.empty(self.layout.shard_numel,
                                                         dtype=out_dtype, device=self.device)
        self.grad_shard_is_zero = False
        pending = self.comm.reduce(out, flat.view(world.size, self.layout.shard_numel), world,
                                   self.comm.stats, phase, key=self.name)
        self._reduce_pending = (pending, None if direct else out)

    def finish_reduce(self) -> None:
        """Wait for this unit's reduction and add it to the gradient shard."""
        if self._reduce_pending is None:
            return
        pending, out = self._reduce_pending
        self._reduce_pending = None
        pending.wait()
        if out is not None:
            self.add_to_grad_shard(out)

    def take_gradients(self) -> torch.Tensor:
        """This micro-batch's flat gradients, handed over for a reduction: the parameters'
        ``.grad`` are unbound from them. A unit no parameter of which got a gradient still
        takes part, with zeros."""
        if self._grad_flat is None:
            return self._flatten_gradients()
        flat, self._grad_flat = self._grad_flat, None  # held through accumulation (stage 1)
        self._unbind_gradients()
        return flat

    def add_to_grad_shard(self, reduced: torch.Tensor) -> None:
        if self.comm.gradient_delivery is not None:  # across to host memory
            self.comm.gradient_delivery.add(self.grad_shard, reduced)
        else:
            self.grad_shard.add_(reduced)  # in the shard's dtype
        self.grad_shard_is_zero = False

    @property
    def reduction_numel(self) -> int:
        """Gradient elements a reduction of this unit holds while in flight."""
        return self.layout.padded_numel

    def fill_gathered(self, rows: torch.Tensor) -> None:
        """Become GATHERED from ``rows`` ([world size, shard numel], rank order), the unit's
        part of a gather made for several units ([Note: persistent units])."""
        self._alloc_full()
        self.full.view(rows.shape).copy_(rows)
        self.state = ShardState.GATHERED

    def zero_grad_shard(self) -> None:
        if self.comm.gradient_delivery is not None:
            self.comm.gradient_delivery.finish()  # nothing may land after the zeros
        self.grad_shard.zero_()
        self.grad_shard_is_zero = True

    def drop_gradients(self) -> None:
        """Discard this unit's gradients at every stage of their way to the shard."""
        self._unbind_gradients()
        self._grad_flat = None
        self.zero_grad_shard()


class PersistentUnits:
    """[Note: persistent units] Units below ``stage3_param_persistence_threshold`` (a block's
    layer norms) stay gathered between steps, as DeepSpeed keeps such parameters. Their
    collectives are joint: one all-gather of all their shards after the step, and one
    reduction of all their gradients after backward, instead of one of each per unit (40
    of each for a 40-block model, each too small to use the link). Every rank holds the same
    units in the same order, so the joint buffers line up; each unit's slices are whole
    multiples of the collectives' alignment, so a quantized reduction sends the same blocks
    as it would unit by unit.

    The gather is exact whatever the other units' is (qwZ, weight deltas): these are the
    few elements every forward uses, layer norms whose gains sit near 1.0, where int8 would
    move each in steps of about 0.8%, and DeepSpeed keeps such parameters whole and exact.
    It costs 16 bits for a few elements per block, once per step.

    The reduction is deferred to the end of backward: their gradients are the few elements
    of the norms, held in their flat buffers until then.
    """

    KEY = "<persistent units>"

    def __init__(self, units: list[ShardedUnit], comm: UnitComm) -> None:
        self.units = units
        self.comm = comm
        # Gradient elements the joint reduction holds in flight.
        self.reduction_numel = sum(u.reduction_numel for u in units)
        self._reduce_pending: tuple[Pending, torch.Tensor] | None = None

    def gather_now(self, phase: str) -> None:
        """Gather every unit not gathered yet (after the step) with one collective."""
        units = [u for u in self.units if u.state is not ShardState.GATHERED and not u.gathering]
        if not units:
            return
        world = self.comm.world
        shards = torch.cat([u.shard for u in units])
        if units[0].shard_in_host_memory:  # one copy for all of them ([Note: offload])
            shards = to_device(shards, units[0].device, None)  # read on this stream
        gathered = torch.empty(world.size * shards.numel(), dtype=shards.dtype,
                               device=shards.device)
        all_gather(gathered, shards, world, self.comm.stats, phase).wait()
        by_rank, offset = gathered.view(world.size, -1), 0
        for unit in units:
            width = unit.layout.shard_numel
            unit.fill_gathered(by_rank[:, offset : offset + width])
            offset += width

    def start_reduce(self, phase: str = "gradient_reduce") -> None:
        """One reduction of every unit's flat gradients (units without trainable parameters
        take no part, as in ``ShardedUnit.start_reduce``)."""
        units = [u for u in self.units if u.num_grad_params]
        if not units:
            return
        world = self.comm.reduce_group
        joint = torch.cat([u.take_gradients().view(world.size, -1) for u in units], dim=1)
        out = torch.empty(joint.shape[1], dtype=self.comm.reduce_dtype or units[0].dtype,
                          device=joint.device)
        pending = self.comm.reduce(out, joint, world, self.comm.stats, phase, key=self.KEY)
        self._reduce_pending = (pending, out)

    def finish_reduce(self) -> None:
        if self._reduce_pending is None:
            return
        pending, out = self._reduce_pending
        self._reduce_pending = None
        pending.wait()
        offset = 0
        for unit in self.units:
            if unit.num_grad_params:
                width = unit.layout.shard_numel
                unit.add_to_grad_shard(out[offset : offset + width])
                offset += width


def to_device(host: torch.Tensor, device: torch.device, execution) -> torch.Tensor:
    """A device copy of a host tensor, made where the gather that reads it runs: the gather
    lane's pool and stream (``Execution.staging``), or with ``execution`` None the current
    stream, for a collective issued on it; asynchronous from pinned memory."""
    with contextlib.nullcontext() if execution is None else execution.staging("gather"):
        staged = torch.empty(host.shape, dtype=host.dtype, device=device)
        staged.copy_(host, non_blocking=True)
    return staged
