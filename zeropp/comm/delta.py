"""Weight deltas: the forward gather sends each shard's change since the last gather, 4-bit.

[Note: weight deltas]
qwZ sends every rank's whole shard (int8) to every other rank at every forward, across the
nodes' links: 85% of ZeRO++'s inter-node bytes. Between two steps a weight moves by one
optimizer update, which 4 bits per value (one fp32 scale per block of 2048, as SDP4Bit
groups them) carry well. So the forward gather becomes, on N = n nodes x a ranks per node
with hpZ over the node (``zero_hpz_partition_size`` = a):

1. Every rank keeps a *base*: the weights of the shards of the n ranks with its local index
   (one per node), as last reconstructed, in the working dtype. Together, the a ranks of a
   node hold the whole unit: the base is the hpZ secondary shard, kept across steps.
2. Inter-node (ranks with the same local index): each rank sends Q4(shard - base of its own
   shard); every receiver, the sender included, adds the dequantized delta to its base with
   the same kernel and the same fp32 arithmetic, so all copies of a base stay bit-identical.
   The rounding error is not carried forward as error: the next delta is taken against the
   reconstructed base, so a base is always within one delta's quantization error of the
   master's working weights and never drifts.
3. Intra-node: the a ranks all-gather their bases (the working dtype, over the fast link) and
   every rank computes with the base, in forward and, as hpZ's secondary, in backward.

Which step a gather takes: the first gather of a unit (or one after ``forget``: a checkpoint
from another topology, weights edited by hand) sends the exact shards instead (step 2 with
raw values); a gather after ``mark_updated`` (the optimizer step) sends deltas; any other
(further micro-batches, recomputation, evaluation) is step 3 alone. Every rank makes the same
choice, because these calls happen on every rank at the same point of the program.

Inter-node bytes per rank and gather: (n - 1) x a 4-bit payload of one shard, against qwZ's
(N - 1) x an int8 one. ``bits=2`` sends ternary deltas (-s, 0, +s per block): half that, and
still no drift, since whatever a delta rounds away stays in the difference to the master
and goes with the next one (Adam moves most weights by about +-lr a step, which a ternary
grid carries well; on the convergence bench the loss ends within 0.2% of ZeRO++'s). The
bases cost (working dtype) x P / a per rank for every unit, held between steps (the 16-bit
hpZ secondary, kept); ``bytes_sent`` and ``base_nbytes`` answer for the planner.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeropp import kernels
from zeropp.comm.accounting import CommStats, all_gather_bytes, locality
from zeropp.comm.collectives import Collective, CommGroup, all_gather_into_tensor
from zeropp.comm.streams import SYNCHRONOUS, Execution, Pending
from zeropp.topology import Topology

LOCAL, DELTA, EXACT = "local", "delta", "exact"


class _Base:
    """One unit's base on this rank: [n, S] weights, and whether it matches the shards now."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values
        self.current = True


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group: CommGroup, async_op: bool):
    if group.size == 1:
        output.copy_(tensor.reshape(-1))
        return None
    return all_gather_into_tensor(output, tensor.reshape(-1), group=group.group, async_op=async_op)


class _AllOf:
    """Several collectives in flight, waited for together (``Pending`` takes one work)."""

    def __init__(self, works: list) -> None:
        self.works = [work for work in works if work is not None]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _gather_bases(output: torch.Tensor, base: torch.Tensor, group: CommGroup,
                  async_op: bool) -> _AllOf:
    """The node's bases, in rank order, straight into ``output``: local rank l's base row m
    is the shard of rank m * a + l, so gathering row m of every base fills output's node-m
    run [a, S] in rank order. One gather per node row instead of one gather and a transposing
    copy of the whole unit (which cost as much as the gather itself on the host)."""
    rows = output.view(base.shape[0], -1)
    return _AllOf([_all_gather(rows[m], base[m], group, async_op) for m in range(base.shape[0])])


class DeltaWeightGather(Collective):
    """``AllGather``'s contract (output = every rank's shard, in rank order, as all ranks will
    compute with it) through [Note: weight deltas]. ``key`` names the unit; calls without
    one are refused, since the base belongs to a unit."""

    lane = "gather"

    def __init__(self, topology: Topology, bits: int = 4, block_size: int = 2048,
                 execution: Execution = SYNCHRONOUS) -> None:
        super().__init__(execution)
        if topology.hpz_size != topology.ranks_per_node:
            raise ValueError(
                f"weight deltas keep each node's weights split over its ranks: they need "
                f"zero_hpz_partition_size = ranks per node ({topology.ranks_per_node}), "
                f"got {topology.hpz_size}")
        self.nodes = topology.num_nodes
        self.per_node = topology.ranks_per_node
        self.inter = CommGroup(topology.weight_inter_group, self.nodes, topology.node_index,
                               topology.num_nodes > 1)
        self.intra = CommGroup(topology.hpz_group, self.per_node, topology.local_rank, False)
        self.bits = bits
        self.block_size = block_size
        self.bases: dict[str, _Base] = {}

    # ---- what each call costs ----------------------------------------------------------
    def _bytes(self, mode: str, numel: int, dtype: torch.dtype) -> dict[str, int]:
        sent = {"intra_node": all_gather_bytes(self.nodes * numel * dtype.itemsize,
                                               self.per_node), "inter_node": 0}
        if mode == DELTA:
            payload = kernels.quantized_nbytes(numel, self.bits, self.block_size)
        elif mode == EXACT:
            payload = numel * dtype.itemsize
        else:
            return sent
        sent[locality(self.inter.spans_nodes)] += all_gather_bytes(payload, self.nodes)
        return sent

    def bytes_sent(self, numel, dtype, group):
        """A training step's gather: the deltas (the first, exact gather is not counted)."""
        return self._bytes(DELTA, numel, dtype)

    def kernel_variants(self, numel, dtype, group):
        # a step's first gather: this shard's fp32 delta quantized, the nodes' dequantized
        return (kernels.KernelVariant(numel, torch.float32, self.bits, self.block_size,
                                      self.nodes),)

    def step_bytes(self, numel, dtype, group, calls):
        """The first gather of a step sends the deltas; the others assemble the bases."""
        sent = self._bytes(DELTA, numel, dtype)
        for where, nbytes in self._bytes(LOCAL, numel, dtype).items():
            sent[where] += nbytes * (calls - 1)
        return sent

    def base_nbytes(self, unit_numel: int, dtype: torch.dtype) -> int:
        """Bytes of one unit's base on a rank: its node slice, held between steps."""
        return unit_numel // self.per_node * dtype.itemsize

    # ---- base bookkeeping (called on every rank at the same point) -----------------------
    def mark_updated(self, key: object) -> None:
        """The unit's shards changed by an optimizer step: the next gather sends deltas."""
        base = self.bases.get(str(key))
        if base is not None:
            base.current = False

    def forget(self, key: object) -> None:
        """The shards changed arbitrarily: the next gather sends them exactly."""
        self.bases.pop(str(key), None)

    def state_dict(self) -> dict:
        return {name: {"values": base.values.detach().cpu(), "current": base.current}
                for name, base in self.bases.items()}

    def load_state_dict(self, state: dict, device: torch.device,
                        dtype: torch.dtype | None = None) -> None:
        """``dtype``: the working dtype the bases must be in (a checkpoint of an fp32 run
        resumed in bf16, say); None keeps the saved one."""
        self.bases = {}
        for name, saved in state.items():
            self.bases[name] = _Base(saved["values"].to(device=device, dtype=dtype))
            self.bases[name].current = bool(saved["current"])

    # ---- the gather -----------------------------------------------------------------------
    def __call__(self, output: torch.Tensor, shard: torch.Tensor, group: CommGroup,
                 stats: CommStats, phase: str, key: object = None,
                 retain: Callable[[torch.Tensor], None] | None = None) -> Pending:
        """``retain``, if given, is handed the unit's base once it is up to date (hpZ keeps it
        as the secondary shard)."""
        if key is None:
            raise ValueError("weight-delta gather: a key naming the unit is required")
        numel, name = shard.numel(), str(key)
        if output.numel() != numel * self.nodes * self.per_node:
            raise ValueError(f"weight-delta gather: output has {output.numel()} elements, "
                             f"expected {self.nodes * self.per_node} x {numel}")
        base = self.bases.get(name)
        if base is not None and base.values.shape != (self.nodes, numel):
            base = None  # another layout (a checkpoint of other shapes): start exactly
        mode = EXACT if base is None else (LOCAL if base.current else DELTA)
        for where, nbytes in self._bytes(mode, numel, shard.dtype).items():
            stats.record(phase, where == "inter_node", nbytes)
        if mode == LOCAL:  # the bases are current: only the intra-node gather
            return self.execution.launch(
                self.lane, lambda async_op: _gather_bases(output, base.values, self.intra,
                                                          async_op),
                finish=None if retain is None else lambda: retain(base.values.view(-1)),
                keep=(output, shard))
        in_flight: dict[str, object] = {}  # the updated base and its intra-node gathers

        def transfer(async_op: bool) -> None:
            """Both hops issued as one sequence: on gloo the host worker runs it while
            compute goes on (the intra-node gather waits for the inter-node one, so a gather
            whose second hop were issued at wait() would put the node's whole exchange on
            the critical path). The intra-node gathers are left in flight, waited for by
            ``finish``: the worker goes on to the next unit's inter-node hop meanwhile."""
            if mode == EXACT:
                values = _new_base(self.nodes, shard)
                _AllOf([_all_gather(values.view(-1), shard, self.inter, False)]).wait()
                current = _Base(values)
            else:
                current = base
                own = current.values[self.inter.rank]
                backend = self._kernels_for(shard)
                delta = backend.quantize_blockwise(shard.float() - own.float(), self.bits,
                                                   self.block_size)
                received = torch.empty(self.nodes, delta.numel(), dtype=torch.uint8,
                                       device=shard.device)
                _AllOf([_all_gather(received.view(-1), delta, self.inter, False)]).wait()
                deltas = backend.dequantize_blockwise_many(
                    received, numel, self.bits, self.block_size, torch.float32)
                if current.values.dtype == torch.float32:
                    current.values.add_(deltas)  # the same fp32 sum as below, without a copy
                else:
                    current.values.copy_(current.values.float() + deltas)
                current.current = True
            # The node's bases changed: gather them now (the fast link).
            in_flight["base"] = current
            in_flight["gathers"] = _gather_bases(output, current.values, self.intra,
                                                 async_op=True)

        def finish() -> None:
            in_flight.pop("gathers").wait()
            self.bases[name] = current = in_flight.pop("base")
            if retain is not None:
                retain(current.values.view(-1))

        return self.execution.launch(self.lane, transfer, finish=finish, keep=(output, shard),
                                     sequence=True)


def _new_base(nodes: int, shard: torch.Tensor) -> torch.Tensor:
    """A unit's base ([n, S], held between steps; the simulated cluster counts it as hpZ's
    secondary by this function's name)."""
    return torch.empty(nodes, shard.numel(), dtype=shard.dtype, device=shard.device)


class DeltaSecondaryGather(Collective):
    """hpZ's backward gather when the secondary shard is the base of [Note: weight deltas]:
    the node's bases gathered inside the node and laid out in rank order. ``bytes_sent``
    takes the secondary's element count (P / a), as for the exact gather."""

    lane = "gather"
    secondary_from_gather = True

    def __init__(self, topology: Topology, execution: Execution = SYNCHRONOUS) -> None:
        super().__init__(execution)
        self.nodes = topology.num_nodes

    def bytes_sent(self, numel, dtype, group):
        return {locality(group.spans_nodes): all_gather_bytes(numel * dtype.itemsize,
                                                              group.size)}

    def take(self, base: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """The secondary shard a unit keeps from its forward gather: the base itself (the
        gather owns it between steps; no copy)."""
        return base

    def __call__(self, output: torch.Tensor, secondary: torch.Tensor, group: CommGroup,
                 stats: CommStats, phase: str, key: object = None) -> Pending:
        if output.numel() != secondary.numel() * group.size:
            raise ValueError(f"weight-delta secondary gather: output has {output.numel()} "
                             f"elements, expected {group.size} x {secondary.numel()}")
        self._record(stats, phase, secondary.numel(), output.dtype, group)
        base = secondary.view(self.nodes, -1)
        return self.execution.launch(
            self.lane, lambda async_op: _gather_bases(output, base, group, async_op),
            keep=(output, secondary))
