"""Which collective carries the weights and which the gradients, for one configuration.

A new collective is one class with the protocol of [Note: collective protocol] and one entry
in ``WEIGHT_GATHERS``, ``GRADIENT_REDUCTIONS`` or ``SECONDARY_GATHERS``; the engine and the planner both get theirs
from ``collectives_for``, so they run and count the same objects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zeropp.comm.collectives import (
    AllGather,
    Collective,
    CommGroup,
    ReduceScatter,
    ReplicatedAllReduce,
)
from zeropp.comm.delta import DeltaSecondaryGather, DeltaWeightGather
from zeropp.comm.options import QuantizationOptions
from zeropp.comm.quantized import (
    HierarchicalReduceScatter,
    QuantizedAllGather,
    QuantizedSecondaryGather,
)
from zeropp.comm.streams import SYNCHRONOUS, Execution
from zeropp.topology import Topology

Factory = Callable[["QuantizationOptions", Topology, Execution], Collective]

WEIGHT_GATHERS: dict[str, Factory] = {
    "exact": lambda quant, topology, execution: AllGather(execution),
    "qwZ": lambda quant, topology, execution: QuantizedAllGather(
        quant.weight_bits, quant.block_size, execution),
    "weight_deltas": lambda quant, topology, execution: DeltaWeightGather(
        topology, quant.delta_bits, quant.delta_block_size, execution),
}

GRADIENT_REDUCTIONS: dict[str, Factory] = {
    # Stage 0 has no shards to reduce into: the whole gradient is summed on every rank.
    "all_reduce": lambda quant, topology, execution: ReplicatedAllReduce(
        CommGroup(None, topology.world_size, topology.rank, topology.spans_nodes),
        execution),
    "exact": lambda quant, topology, execution: ReduceScatter(execution),
    "qgZ": lambda quant, topology, execution: HierarchicalReduceScatter(
        topology, bits=quant.gradient_bits, block_size=quant.block_size,
        error_feedback=quant.error_feedback, execution=execution,
        inter_node_bits=quant.gradient_inter_node_bits),
}


SECONDARY_GATHERS: dict[str, Factory] = {
    "exact": lambda quant, topology, execution: AllGather(execution),
    # hpZ with qwZ: the secondary shard is the forward's int8 payload
    "int8": lambda quant, topology, execution: QuantizedSecondaryGather(
        topology.world_size, quant.weight_bits, quant.block_size, execution),
    # weight deltas: the secondary shard is the gather's base ([Note: weight deltas])
    "weight_deltas": lambda quant, topology, execution: DeltaSecondaryGather(
        topology, execution),
}


@dataclass(frozen=True)
class Collectives:
    """The collectives one engine runs (see ``UnitComm`` for how units use them)."""

    gather: Collective  # forward (and, without hpZ, backward) gathers over the shard group
    reduce: Collective  # gradient reduction into each rank's shard
    # hpZ's backward gather inside the node: exact from 16-bit secondary shards, or from
    # qwZ's int8 payload ([Note: int8 secondary])
    secondary_gather: Collective

    def secondary_nbytes(self, numel: int, dtype: torch.dtype, group: CommGroup) -> int:
        """Bytes one hpZ secondary shard of ``numel`` elements takes, as this configuration
        keeps it: 16-bit values, or qwZ's int8 payload ([Note: int8 secondary])."""
        if isinstance(self.secondary_gather, QuantizedSecondaryGather):
            return self.secondary_gather.payload_nbytes(numel, group)
        return numel * dtype.itemsize

    def kept_bases_nbytes(self, unit_numel: int, dtype: torch.dtype) -> int | None:
        """Bytes of the base a weight-delta gather keeps for a unit between steps ([Note:
        weight deltas]: it is then every unit's hpZ secondary); None for other gathers."""
        if isinstance(self.gather, DeltaWeightGather):
            return self.gather.base_nbytes(unit_numel, dtype)
        return None

    def error_feedback_nbytes(self, unit_numel: int) -> int:
        """Bytes the reduction's stored quantization errors take for a unit of
        ``unit_numel`` (padded) elements; 0 without error feedback."""
        if isinstance(self.reduce, HierarchicalReduceScatter):
            return self.reduce.error_feedback_nbytes(unit_numel)
        return 0

    @property
    def alignment(self) -> int:
        """Elements every per-rank slice is padded to, for the gather and the reduction."""
        return math.lcm(self.gather.alignment, self.reduce.alignment)


def collectives_for(stage: int, quant: QuantizationOptions, topology: Topology,
                    execution: Execution = SYNCHRONOUS) -> Collectives:
    """The registry's choice: ZeRO++'s quantized collectives where switched on."""
    gather = "qwZ" if quant.quantized_weights else "exact"
    if stage == 0:
        reduce = "all_reduce"
    else:
        reduce = "qgZ" if quant.quantized_gradients else "exact"
    secondary = ("int8" if quant.quantized_weights and quant.quantized_secondary
                 and quant.hpz_size > 1 else "exact")
    if quant.weight_deltas and stage == 3:
        gather = secondary = "weight_deltas"
    return Collectives(
        gather=WEIGHT_GATHERS[gather](quant, topology, execution),
        reduce=GRADIENT_REDUCTIONS[reduce](quant, topology, execution),
        secondary_gather=SECONDARY_GATHERS[secondary](quant, topology, execution),
    )
