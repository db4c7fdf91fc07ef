"""Exact collectives as pure functions over tensors and groups, with byte accounting.

Each returns a ``Pending`` handle; after ``wait()`` the result is in the output tensor (and
usable on the compute stream). ``execution`` decides where the transfer runs and what it
holds until then (see ``zeropp.comm.streams``); without one, the call completes at once.
The quantized collectives in ``zeropp.comm.quantized`` keep exactly these contracts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from zeropp.comm.accounting import (
    CommStats,
    all_gather_bytes,
    all_reduce_bytes,
    reduce_scatter_bytes,
)
from zeropp.comm.streams import SYNCHRONOUS, Execution, Pending

# torch 2.13 renamed the tensor collectives; keep working on older releases too.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommGroup:
    """A process group plus the facts the engine and the accounting need about it."""

    group: object  # a ProcessGroup, or None for the default group
    size: int
    rank: int  # this rank's index inside the group
    spans_nodes: bool


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: CommGroup,
    stats: CommStats,
    phase: str,
    execution: Execution = SYNCHRONOUS,
) -> Pending:
    """``output`` (group.size * shard.numel()) <- the shards of all ranks, in rank order."""
    if output.numel() != shard.numel() * group.size:
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected "
            f"{group.size} x {shard.numel()}"
        )
    stats.record(phase, group.spans_nodes, all_gather_bytes(_nbytes(shard), group.size))
    if group.size == 1:
        output.copy_(shard)
        return Pending()
    return execution.launch(
        "gather",
        lambda async_op: _all_gather_single(output, shard, group=group.group, async_op=async_op),
        keep=(output, shard),
    )


def reduce_scatter_sum(
    output: torch.Tensor,
    full: torch.Tensor,
    group: CommGroup,
    stats: CommStats,
    phase: str,
    execution: Execution = SYNCHRONOUS,
    key: object = None,
) -> Pending:
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
    if full.numel() != output.numel() * group.size:
        raise ValueError(
            f"reduce_scatter: input has {full.numel()} elements, expected "
            f"{group.size} x {output.numel()}"
        )
    wire_nbytes = full.numel() * output.element_size()
    stats.record(phase, group.spans_nodes, reduce_scatter_bytes(wire_nbytes, group.size))
    if group.size == 1:
        output.copy_(full.reshape(-1))
        return Pending()
    return execution.launch(
        "reduce",
        lambda async_op: _reduce_scatter_single(
            output, full.reshape(-1).to(output.dtype), op=dist.ReduceOp.SUM, group=group.group,
            async_op=async_op),
        keep=(output, full),
    )


def all_to_all(
    output: torch.Tensor,
    send: torch.Tensor,
    group: CommGroup,
    stats: CommStats,
    phase: str,
) -> None:
    """Chunk j of ``send`` goes to group rank j; chunk j of ``output`` comes from rank j.

    Blocking on the host executions; on CUDA ordered on the current (side) stream.
    """
    stats.record(phase, group.spans_nodes, reduce_scatter_bytes(_nbytes(send), group.size))
    if group.size == 1:
        output.copy_(send)
        return
    dist.all_to_all_single(output, send, group=group.group)


def replicated_gradient_reduce(
    output: torch.Tensor,
    full: torch.Tensor,
    group: CommGroup,
    stats: CommStats,
    phase: str,
    *,
    data_parallel: CommGroup,
    execution: Execution = SYNCHRONOUS,
    key: object = None,
) -> Pending:
    """Stage 0's reduction under ``reduce_scatter_sum``'s contract: the shard group is one
    rank, so ``output`` is the whole buffer, summed over the data-parallel world."""
    if group.size != 1 or output.numel() != full.numel():
        raise ValueError("replicated_gradient_reduce needs a shard group of one rank")
    output.copy_(full.reshape(-1))  # in output's dtype (communication_data_type)
    stats.record(phase, data_parallel.spans_nodes,
                 all_reduce_bytes(_nbytes(output), data_parallel.size))
    if data_parallel.size == 1:
        return Pending()
    return execution.launch(
        "reduce",
        lambda async_op: dist.all_reduce(output, op=dist.ReduceOp.SUM,
                                         group=data_parallel.group, async_op=async_op),
        keep=(output,),
    )


def all_reduce_sum(tensor: torch.Tensor, group: CommGroup, stats: CommStats, phase: str) -> None:
    """In-place SUM over the group (blocking)."""
    stats.record(phase, group.spans_nodes, all_reduce_bytes(_nbytes(tensor), group.size))
    if group.size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group.group)
