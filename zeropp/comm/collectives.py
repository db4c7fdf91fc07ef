"""Exact collectives as objects with one protocol, and their byte accounting.

[Note: collective protocol]
Every collective the engine issues for weights and gradients is an object with
- ``__call__(output, input, group, stats, phase, key=None) -> Pending``: the transfer; after
  ``wait()`` the result is in ``output`` (and usable on the compute stream);
- ``lane``: "gather" or "reduce", the stream (CUDA) or queue it runs on, through the
  ``Execution`` it was built with (``zeropp.comm.streams``);
- ``alignment``: elements every per-rank slice must be a multiple of (the flat layouts and
  reduce buckets are padded to it);
- ``output_dtype``: the dtype it delivers (None: the output tensor's own);
- ``bytes_sent(numel, dtype, group)``: ``{locality: bytes}`` this rank sends for one call
  whose per-rank slice holds ``numel`` elements of ``dtype``;
- ``error_feedback``: the quantization residuals it carries (None for exact ones);
- ``kernel_variants(numel, dtype, group)``: the quantization kernels one call launches
  (``zeropp.kernels.KernelVariant``; none for exact ones), which an engine compiles ahead.
The engine records exactly ``bytes_sent`` when it issues a call, and the planner asks the
same objects, so a plan and a measurement cannot disagree on a rule. The quantized
collectives (``zeropp.comm.quantized``) keep these contracts; a new one is one class and one
entry in ``zeropp.comm.registry``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllToAllOptions,
    ReduceScatterOptions,
    _get_default_group,
)

from zeropp import kernels
from zeropp.comm.accounting import (
    CommStats,
    all_gather_bytes,
    all_reduce_bytes,
    locality,
    reduce_scatter_bytes,
)
from zeropp.comm.streams import SYNCHRONOUS, Execution, Pending
from zeropp.kernels import KernelVariant

# [Note: issued to the process group]
# The engine's transfers call the process group's own methods, which is where c10d's Python
# functions (``dist.all_gather_single`` and the like) end. Those functions first check their
# arguments and that this rank is in the group, look the default group up, test for a
# coalescing context, dispatch tensor subclasses with ``__torch_function__``, and wrap the call
# in an exception logger: about 6-12 us of Python per call on the CPU (measured on torch's
# fake process group), paid by every gather and reduction of every unit. None of it applies
# here: the engine issues on groups it made and belongs to, with plain contiguous tensors of
# one dtype it allocated, never inside a coalescing manager. The backend still checks what it
# must (device, size, contiguity) in C++. torch 2.13 renamed the methods (``_allgather_base``
# -> ``all_gather_single``); older releases keep the old names.
_GATHER, _REDUCE_SCATTER, _ALL_TO_ALL = (
    ("all_gather_single", "reduce_scatter_single", "all_to_all_single")
    if hasattr(dist.ProcessGroup, "all_gather_single")
    else ("_allgather_base", "_reduce_scatter_base", "alltoall_base"))


def _options(kind, async_op: bool, **fields):
    """An options object as c10d's functions fill it; made once per kind and flag (the
    backends read them, nothing writes them). ``asyncOp`` only where the type has it:
    older releases have none on some types, and their objects take no new attribute."""
    options = kind()
    if hasattr(options, "asyncOp"):
        options.asyncOp = async_op
    for name, value in fields.items():
        setattr(options, name, value)
    return options


_GATHER_OPTIONS = {flag: _options(AllgatherOptions, flag) for flag in (False, True)}
_SUM_OPTIONS = {flag: _options(ReduceScatterOptions, flag, reduceOp=dist.ReduceOp.SUM)
                for flag in (False, True)}
_ALL_TO_ALL_OPTIONS = {flag: _options(AllToAllOptions, flag) for flag in (False, True)}


def _issued_to_the_group(method: str, options: dict[bool, object], doc: str,
                         split_sizes: tuple = ()):
    """A function ``(output, input, group=None, async_op=False)`` that calls ``method`` on the
    group as c10d's function of that name does ([Note: issued to the process group]);
    ``split_sizes``: the all-to-all's (empty: equal chunks)."""

    def issue(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
        work = getattr(group or _get_default_group(), method)(output, input, *split_sizes,
                                                              options[async_op])
        if async_op or work is None:
            return work
        work.wait()  # as c10d's functions do: done on return
        return None

    issue.__doc__ = doc
    return issue


all_gather_into_tensor = _issued_to_the_group(
    _GATHER, _GATHER_OPTIONS, "``dist.all_gather_single``, issued to the group.")
reduce_scatter_tensor = _issued_to_the_group(
    _REDUCE_SCATTER, _SUM_OPTIONS, "``dist.reduce_scatter_single`` with SUM, issued to the group.")
_all_to_all_in_equal_chunks = _issued_to_the_group(
    _ALL_TO_ALL, _ALL_TO_ALL_OPTIONS, "``dist.all_to_all_single`` in equal chunks, issued to "
    "the group.", split_sizes=([], []))


@dataclass(frozen=True)
class CommGroup:
    """A process group plus the facts the engine and the accounting need about it."""

    group: object  # a ProcessGroup, or None for the default group
    size: int
    rank: int  # this rank's index inside the group
    spans_nodes: bool


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Collective(abc.ABC):
    """Base of [Note: collective protocol]: the facts every collective answers."""

    lane: ClassVar[str]
    alignment: int = 1
    output_dtype: torch.dtype | None = None
    error_feedback = None
    # A secondary gather whose secondary shard a unit takes from its forward gather
    # (``take``), not from the gathered weights.
    secondary_from_gather: ClassVar[bool] = False

    def __init__(self, execution: Execution = SYNCHRONOUS) -> None:
        self.execution = execution
        # (numel, dtype, group) -> ((inter-node?, bytes), ...): ``bytes_sent`` of a call,
        # worked out once per buffer size rather than at every call.
        self._sent: dict[tuple, tuple[tuple[bool, int], ...]] = {}
        self._backends: dict[str, object] = {}  # device type -> kernels (``_kernels_for``)

    @abc.abstractmethod
    def bytes_sent(self, numel: int, dtype: torch.dtype, group: CommGroup) -> dict[str, int]:
        """{locality: bytes} this rank sends for one call with per-rank slices of ``numel``."""

    def stream_buffer_nbytes(self, numel: int, dtype: torch.dtype, group: CommGroup) -> int:
        """Bytes one call (per-rank slices of ``numel``) allocates while it runs and frees
        when it ends: on CUDA from its side stream's pool, which the caching allocator keeps
        for that stream ([Note: allocation lanes]). The exact collectives write into buffers
        the caller allocated: 0."""
        return 0

    @abc.abstractmethod
    def __call__(self, output: torch.Tensor, input: torch.Tensor, group: CommGroup,
                 stats: CommStats, phase: str, key: object = None) -> Pending:
        """Issue the collective; ``key`` names the buffer (for error feedback)."""

    def kernel_variants(self, numel: int, dtype: torch.dtype,
                        group: CommGroup) -> tuple[KernelVariant, ...]:
        """The quantization kernels one call with per-rank slices of ``numel`` elements of
        ``dtype`` launches; the exact collectives launch none."""
        return ()

    def step_bytes(self, numel: int, dtype: torch.dtype, group: CommGroup,
                   calls: int) -> dict[str, int]:
        """{locality: bytes} of ``calls`` calls on one buffer within one optimizer step (a
        stateful gather sends less after the first, [Note: weight deltas])."""
        return {where: nbytes * calls for where, nbytes in self.bytes_sent(numel, dtype,
                                                                            group).items()}

    # A gather that keeps state per unit ([Note: weight deltas]) hears of its shards here.
    def mark_updated(self, key: object) -> None:  # noqa: B027 (stateless ones ignore it)
        """The unit's shards changed by an optimizer step."""

    def forget(self, key: object) -> None:  # noqa: B027
        """The unit's shards changed in any other way (edited, loaded from elsewhere)."""

    def _kernels_for(self, tensor: torch.Tensor):
        """The quantization kernels' module for tensors on ``tensor``'s device
        (``zeropp.kernels.backend_for`` at this collective's ``block_size``), chosen at the
        first launch on a device type and kept: the environment read and the checks behind
        the choice are not repeated at every launch, so ``ZEROPP_KERNELS`` counts as it was
        at a collective's first launch on a device."""
        backend = self._backends.get(tensor.device.type)
        if backend is None:
            backend = self._backends[tensor.device.type] = kernels.backend_for(
                tensor, self.block_size)
        return backend

    def _record(self, stats: CommStats, phase: str, numel: int, dtype: torch.dtype,
                group: CommGroup) -> None:
        key = (numel, dtype, group)
        sent = self._sent.get(key)
        if sent is None:
            sent = self._sent[key] = tuple(
                (where == "inter_node", nbytes)
                for where, nbytes in self.bytes_sent(numel, dtype, group).items())
        for inter_node, nbytes in sent:
            stats.record(phase, inter_node, nbytes)


class AllGather(Collective):
    """``output`` (group.size * shard.numel()) <- the shards of all ranks, in rank order."""

    lane = "gather"

    def bytes_sent(self, numel, dtype, group):
        return {locality(group.spans_nodes): all_gather_bytes(numel * dtype.itemsize, group.size)}

    def __call__(self, output: torch.Tensor, shard: torch.Tensor, group: CommGroup,
                 stats: CommStats, phase: str, key: object = None) -> Pending:
        if output.numel() != shard.numel() * group.size:
            raise ValueError(
                f"all_gather: output has {output.numel()} elements, expected "
                f"{group.size} x {shard.numel()}"
            )
        self._record(stats, phase, shard.numel(), shard.dtype, group)
        if group.size == 1:
            output.copy_(shard)
            return Pending()
        return self.execution.launch(
            self.lane,
            lambda async_op: all_gather_into_tensor(output, shard, group=group.group,
                                                async_op=async_op),
            keep=(output, shard),
        )


class ReduceScatter(Collective):
    """``output`` <- this rank's slice of the element-wise SUM of ``full`` over the group.

    ``full`` holds the group's slices in rank order: flat, or a ``[group.size, width]`` view
    that may be strided (a bucket cut out of a unit's gradients). A strided view is made
    contiguous only when the reduction is issued, where it runs, so the copy is transient
    instead of living as long as the reduction is in flight. The reduction runs in
    ``output``'s dtype (``communication_data_type``): ``full`` is cast there too.

    ``key`` names the buffer being reduced; exact reductions ignore it, quantized ones with
    error feedback keep their residuals under it.

    Sum, not average: the engine divides exactly once, at the optimizer step (and gloo has no
    AVG for integer tensors).
    """

    lane = "reduce"

    def bytes_sent(self, numel, dtype, group):
        wire = numel * group.size * dtype.itemsize
        return {locality(group.spans_nodes): reduce_scatter_bytes(wire, group.size)}

    def __call__(self, output: torch.Tensor, full: torch.Tensor, group: CommGroup,
                 stats: CommStats, phase: str, key: object = None) -> Pending:
        if full.numel() != output.numel() * group.size:
            raise ValueError(
                f"reduce_scatter: input has {full.numel()} elements, expected "
                f"{group.size} x {output.numel()}"
            )
        self._record(stats, phase, output.numel(), output.dtype, group)
        if group.size == 1:
            output.copy_(full.reshape(-1))
            return Pending()
        return self.execution.launch(
            self.lane,
            lambda async_op: reduce_scatter_tensor(
                output, full.reshape(-1).to(output.dtype), group=group.group,
                async_op=async_op),
            keep=(output, full),
        )


class ReplicatedAllReduce(Collective):
    """Stage 0's reduction under ``ReduceScatter``'s contract: the shard group is one rank,
    so ``output`` is the whole buffer, summed over the data-parallel world."""

    lane = "reduce"

    def __init__(self, data_parallel: CommGroup, execution: Execution = SYNCHRONOUS) -> None:
        super().__init__(execution)
        self.data_parallel = data_parallel

    def bytes_sent(self, numel, dtype, group):
        world = self.data_parallel
        return {locality(world.spans_nodes): all_reduce_bytes(numel * dtype.itemsize, world.size)}

    def __call__(self, output: torch.Tensor, full: torch.Tensor, group: CommGroup,
                 stats: CommStats, phase: str, key: object = None) -> Pending:
        if group.size != 1 or output.numel() != full.numel():
            raise ValueError("ReplicatedAllReduce needs a shard group of one rank")
        output.copy_(full.reshape(-1))  # in output's dtype (communication_data_type)
        self._record(stats, phase, output.numel(), output.dtype, group)
        if self.data_parallel.size == 1:
            return Pending()
        return self.execution.launch(
            self.lane,
            lambda async_op: dist.all_reduce(output, op=dist.ReduceOp.SUM,
                                             group=self.data_parallel.group, async_op=async_op),
            keep=(output,),
        )


# Synchronous instances, for callers outside the engine's streams (reading weights out, tests).
all_gather = AllGather()
reduce_scatter_sum = ReduceScatter()


def all_to_all(output: torch.Tensor, send: torch.Tensor, group: CommGroup,
               async_op: bool = False):
    """Chunk j of ``send`` goes to group rank j; chunk j of ``output`` comes from rank j
    (``dist.all_to_all_single`` in equal chunks, issued to the group: [Note: issued to the
    process group]).

    A hop inside a collective that records its own bytes (qgZ's), so it records none.
    Blocking on the host executions; on CUDA ordered on the current (side) stream. With
    ``async_op`` it returns the work to wait for (None when it completed: a group of one).
    """
    if group.size == 1:
        output.copy_(send)
        return None
    return _all_to_all_in_equal_chunks(output, send, group.group, async_op)


def all_reduce_sum(tensor: torch.Tensor, group: CommGroup, stats: CommStats, phase: str) -> None:
    """In-place SUM over the group (blocking)."""
    stats.record(phase, group.spans_nodes, all_reduce_bytes(_nbytes(tensor), group.size))
    if group.size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group.group)
