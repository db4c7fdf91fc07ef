"""qwZ and qgZ: quantized collectives with the contracts of the exact ones they replace.

- ``QuantizedAllGather`` (qwZ) is ``AllGather``: output = every rank's shard, in rank order, but
  each shard crosses the wire block-quantized (int8 by default) and is dequantized after the
  gather. Every rank, the sender included, uses the dequantized values, so all ranks compute
  with identical weights.
- ``HierarchicalReduceScatter`` (qgZ) is ``ReduceScatter``: output = this rank's slice of the
  element-wise sum over all ranks, computed as ZeRO++'s two all-to-alls.

[Note: qgZ data path]
N = n nodes x a ranks per node; the input holds N slices of S elements, slice r for rank r.
1. Swizzle: chunk l (of a) = the slices of global ranks {m*a + l for every node m}.
2. Quantize (int4), all-to-all inside the node: local rank l receives chunk l from each of
   the a ranks of its node. (Quantized first, then the payload's bytes are swizzled: blocks
   never straddle a slice, so the bytes are the same, for 1/8 of the copy.)
3. Dequantize, sum in fp32, requantize: the node's partial sums of the n slices that belong to
   ranks with local index l (the fused kernel), at the inter-node width (the same, or
   narrower: int2 with error feedback, [Note: error feedback]).
4. All-to-all across nodes among ranks with the same local index: slice m goes to node m.
5. Dequantize and sum in fp32: this rank's slice summed over all N ranks.
Reductions happen in full precision between hops, so the error does not grow with N the way
requantizing at every step of a ring would. ``bits=None`` keeps the hierarchy but sends raw
values, which must equal the exact reduce-scatter (up to the order of the fp32 additions).

[Note: no quantized send to itself]
A hop within a group of one rank sends to itself; quantizing it would add error and move no
byte. With one node, step 5 sums the intra-node hop's payloads straight into the slice (steps
3-4 do not run); with one rank per node, steps 1-2 do not run and step 3 quantizes this
rank's own values. Either way every rank's gradient is quantized exactly once, as on the
one-hop path the error is then measured against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from zeropp import kernels
from zeropp.comm.accounting import CommStats, all_gather_bytes, all_to_all_bytes, locality
from zeropp.comm.collectives import (
    Collective,
    CommGroup,
    all_gather_into_tensor,
    all_to_all,
)
from zeropp.comm.error_feedback import ErrorFeedback
from zeropp.comm.streams import SYNCHRONOUS, Execution, Pending
from zeropp.topology import Topology


class QuantizedAllGather(Collective):
    """qwZ: ``AllGather`` with the shard sent block-quantized; scales travel in the payload.

    The quantization runs where the transfer runs (the gather stream on CUDA), the
    dequantization on that lane's completion stream ([Note: completion steps]): both overlap
    compute, and the next transfer does not wait for the dequantization.
    """

    lane = "gather"

    def __init__(self, bits: int = 8, block_size: int = 256,
                 execution: Execution = SYNCHRONOUS) -> None:
        super().__init__(execution)
        self.bits = bits
        self.block_size = block_size

    def bytes_sent(self, numel, dtype, group):
        payload = kernels.quantized_nbytes(numel, self.bits, self.block_size)
        return {locality(group.spans_nodes): all_gather_bytes(payload, group.size)}

    def stream_buffer_nbytes(self, numel, dtype, group):
        # this rank's payload and the gathered payloads of every rank
        return (group.size + 1) * kernels.quantized_nbytes(numel, self.bits, self.block_size)

    def kernel_variants(self, numel, dtype, group):
        # this rank's shard quantized, the group's payloads dequantized into the unit
        return (kernels.KernelVariant(numel, dtype, self.bits, self.block_size, group.size),)

    def __call__(self, output: torch.Tensor, shard: torch.Tensor, group: CommGroup,
                 stats: CommStats, phase: str, key: object = None,
                 retain: Callable[[torch.Tensor], None] | None = None) -> Pending:
        """``retain``, if given, sees the gathered payloads ([group.size, payload bytes],
        uint8, rank order) before they are freed: hpZ keeps its slice of them
        (``QuantizedSecondaryGather``)."""
        numel, bits, block_size = shard.numel(), self.bits, self.block_size
        if output.numel() != numel * group.size:
            raise ValueError(
                f"quantized_all_gather: output has {output.numel()} elements, expected "
                f"{group.size} x {numel}"
            )
        self._record(stats, phase, numel, shard.dtype, group)
        payload_nbytes = kernels.quantized_nbytes(numel, bits, block_size)
        buffers: dict[str, torch.Tensor] = {}

        backend = self._kernels_for(shard)

        def issue(async_op: bool):
            payload = backend.quantize_blockwise(shard, bits, block_size)
            gathered = torch.empty(group.size * payload_nbytes, dtype=torch.uint8,
                                   device=shard.device)
            buffers.update(payload=payload, gathered=gathered)
            if group.size == 1:
                gathered.copy_(payload)
                return None
            return all_gather_into_tensor(gathered, payload, group=group.group, async_op=async_op)

        def finish() -> None:
            gathered = buffers["gathered"].view(group.size, -1)
            if retain is not None:
                retain(gathered)
            # Straight into the unit's buffer: no [N, numel] temporary.
            backend.dequantize_blockwise_many(gathered, numel, bits, block_size, output.dtype,
                                              out=output)

        # The payloads are held to the wait: the completion step may still read them on its
        # own stream ([Note: completion steps]).
        return self.execution.launch(self.lane, issue, finish=finish,
                                     keep=(output, shard, buffers))


class QuantizedSecondaryGather(Collective):
    """hpZ's backward gather from int8 secondary shards: ``AllGather``'s contract inside the
    node, with a secondary shard that is the node slice of qwZ's forward payload.

    [Note: int8 secondary] After qwZ's forward gather every rank holds all N shards'
    payloads (int8 codes and scales). The hpZ secondary shard of local rank j (of alpha) is
    the weights ``[j * P / alpha, (j + 1) * P / alpha)``: the shards of world ranks
    ``j * N / alpha`` to ``(j + 1) * N / alpha - 1``, so it keeps those N / alpha payloads as they
    arrived (``ShardedUnit._retain_secondary_payload``) instead of a 16-bit copy of their
    values. The backward gathers them inside the node and dequantizes every shard with the
    same kernel as the forward: backward computes with exactly the forward's weights, and
    the secondary takes about half the memory and half the intra-node bytes. DeepSpeed keeps
    it in 16 bits (and quantizes it only for frozen weights).

    ``secondary`` is a [N / alpha, payload bytes] uint8 tensor; ``output`` the unit's whole
    flat buffer. ``bytes_sent`` takes the secondary's element count (P / alpha), as for the
    exact gather.
    """

    lane = "gather"
    secondary_from_gather = True

    def __init__(self, world_size: int, bits: int = 8, block_size: int = 256,
                 execution: Execution = SYNCHRONOUS) -> None:
        super().__init__(execution)
        self.world_size = world_size
        self.bits = bits
        self.block_size = block_size

    def payload_rows(self, group: CommGroup) -> int:
        """World shards (payloads) one secondary shard holds."""
        if self.world_size % group.size:
            raise ValueError(f"hpZ group of {group.size} does not divide the world of "
                             f"{self.world_size}")
        return self.world_size // group.size

    def take(self, gathered: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """This rank's node slice of qwZ's gathered payloads ([group.size x rows, bytes]):
        the secondary shard a unit keeps."""
        rows = self.payload_rows(group)
        return gathered[group.rank * rows : (group.rank + 1) * rows].clone()

    def payload_nbytes(self, numel: int, group: CommGroup) -> int:
        """Bytes of a secondary shard of ``numel`` elements (P / alpha): its N / alpha payloads."""
        rows = self.payload_rows(group)
        return rows * kernels.quantized_nbytes(numel // rows, self.bits, self.block_size)

    def bytes_sent(self, numel, dtype, group):
        payload = self.payload_nbytes(numel, group)
        return {locality(group.spans_nodes): all_gather_bytes(payload, group.size)}

    def stream_buffer_nbytes(self, numel, dtype, group):
        return group.size * self.payload_nbytes(numel, group)  # every world shard's payload

    def kernel_variants(self, numel, dtype, group):
        # every world shard's payload dequantized, as the forward gather does
        return (kernels.KernelVariant(numel // self.payload_rows(group), dtype, self.bits,
                                      self.block_size, self.world_size),)

    def __call__(self, output: torch.Tensor, secondary: torch.Tensor, group: CommGroup,
                 stats: CommStats, phase: str, key: object = None) -> Pending:
        rows = self.payload_rows(group)
        shard_numel = output.numel() // self.world_size
        if secondary.dim() != 2 or secondary.shape[0] != rows:
            raise ValueError(f"int8 secondary: expected {rows} payload rows, got "
                             f"{tuple(secondary.shape)}")
        self._record(stats, phase, rows * shard_numel, output.dtype, group)
        buffers: dict[str, torch.Tensor] = {}

        def issue(async_op: bool):
            gathered = torch.empty(self.world_size, secondary.shape[1], dtype=torch.uint8,
                                   device=secondary.device)
            buffers["gathered"] = gathered
            if group.size == 1:
                gathered.copy_(secondary)
                return None
            return all_gather_into_tensor(gathered.view(-1), secondary.reshape(-1),
                                          group=group.group, async_op=async_op)

        backend = self._kernels_for(output)

        def finish() -> None:
            backend.dequantize_blockwise_many(
                buffers["gathered"], shard_numel, self.bits, self.block_size, output.dtype,
                out=output)

        return self.execution.launch(self.lane, issue, finish=finish,
                                     keep=(output, secondary, buffers))


class HierarchicalReduceScatter(Collective):
    """qgZ: ``ReduceScatter``'s contract through two quantized all-to-alls.

    Built from a ``Topology``; one without process groups (rank 0 of a planned cluster) is
    enough for ``bytes_sent`` and ``alignment``, which is how the planner uses it.
    """

    lane = "reduce"
    # The last sum is in fp32: delivered as is, not rounded to the working dtype and back.
    output_dtype = torch.float32

    def __init__(
        self,
        topology: Topology,
        bits: int | None = 4,
        block_size: int = 256,
        error_feedback: tuple[float, int] | None = None,
        execution: Execution = SYNCHRONOUS,
        inter_node_bits: int | None = None,
    ) -> None:
        """``error_feedback``: (beta, reset interval) of [Note: error feedback], None = off;
        ``inter_node_bits``: the width of hop 2 (None = ``bits``)."""
        super().__init__(execution)
        self.nodes = topology.num_nodes
        self.per_node = topology.ranks_per_node
        self.intra = CommGroup(topology.intra_node_group, self.per_node, topology.local_rank, False)
        self.inter = CommGroup(
            topology.inter_node_group, self.nodes, topology.node_index, topology.num_nodes > 1
        )
        self.bits = bits
        self.inter_node_bits = bits if bits is None or inter_node_bits is None else inter_node_bits
        self.block_size = block_size
        # What the requantization of this rank's node partial sums dropped, per reduction
        # key, added back before the next requantization of the same chunk ([Note: error
        # feedback]). The first hop's quantization error is not fed back.
        self.error_feedback = None
        if error_feedback is not None and bits is not None:
            beta, reset_interval = error_feedback
            self.error_feedback = ErrorFeedback(block_size, beta, reset_interval)

    @property
    def alignment(self) -> int:
        """Slices are whole pairs of quantization blocks (two int4 codes per byte), whole
        quadruples with int2 (four codes per byte), so payloads split at slice bounds."""
        if self.bits is None:
            return 1
        return (4 if min(self.bits, self.inter_node_bits) == 2 else 2) * self.block_size

    def __call__(
        self,
        output: torch.Tensor,
        full: torch.Tensor,
        group: CommGroup,
        stats: CommStats,
        phase: str,
        key: object = None,
    ) -> Pending:
        world = self.nodes * self.per_node
        if group.size != world or full.numel() != output.numel() * world:
            raise ValueError(
                f"qgZ reduce-scatter: input of {full.numel()} elements over a group of "
                f"{group.size} does not match {self.nodes} nodes x {self.per_node} ranks "
                f"with {output.numel()}-element slices"
            )
        # Bytes are recorded here, in the caller's thread: the accounting is never touched
        # from a host worker thread.
        self._record(stats, phase, output.numel(), full.dtype, group)
        # [Note: qgZ issue order] Both hops and the requantization between them are one
        # sequence on the reduce lane: on CUDA issued from the backward thread on the reduce
        # stream, on gloo on the host worker (the only user of the intra- and inter-node
        # groups), so every rank issues its all-to-alls in the same order. The inter-node
        # hop is left in flight and its sum taken at wait(): on gloo the worker goes on to
        # the next bucket's quantization and intra-node hop while this one is on the slow
        # link, instead of idling through it (which put every bucket's link time end to end
        # with its host work).
        in_flight: dict[str, object] = {}
        return self.execution.launch(
            self.lane, lambda async_op: self._send(output, full, key, in_flight),
            finish=functools.partial(self._receive, output, in_flight),
            keep=(output, full), sequence=True,
        )

    def error_feedback_nbytes(self, bucket_numel: int) -> int:
        """Bytes of the errors kept for a bucket of ``bucket_numel`` elements: one chunk,
        1 / ranks-per-node of it ([Note: error feedback]); 0 without error feedback."""
        if self.error_feedback is None or self.nodes == 1:  # one node: nothing requantized
            return 0
        return ErrorFeedback.nbytes(bucket_numel // self.per_node, self.block_size)

    def _hop_payloads(self, numel: int, dtype: torch.dtype) -> tuple[int, int]:
        """Bytes of hop 1's swizzled bucket and of hop 2's payloads, per-rank slice ``numel``."""
        chunk_numel = self.nodes * numel
        if self.bits is None:
            return self.per_node * chunk_numel * dtype.itemsize, chunk_numel * 4
        first = self.per_node * kernels.quantized_nbytes(chunk_numel, self.bits, self.block_size)
        second = self.nodes * kernels.quantized_nbytes(numel, self.inter_node_bits,
                                                       self.block_size)
        return first, second

    def stream_buffer_nbytes(self, numel, dtype, group):
        # each hop's send and receive buffers, and the node's fp32 partial sums between them
        first, second = self._hop_payloads(numel, dtype)
        return 2 * first + 2 * second + self.nodes * numel * 4

    def kernel_variants(self, numel, dtype, group):
        """What ``_send`` and ``_receive`` launch for ``numel``-element slices of ``dtype``
        values, path by path."""
        if self.bits is None:
            return ()
        Variant = kernels.KernelVariant  # noqa: N806 (a class)
        bits, inter_bits, block = self.bits, self.inter_node_bits, self.block_size
        nodes, per_node, chunk_numel = self.nodes, self.per_node, self.nodes * numel
        # step 5: the payloads that reach this rank summed into its slice
        last = Variant(numel, dtype, bits if nodes == 1 else inter_bits, block,
                       per_node if nodes == 1 else nodes)
        if per_node == 1 and nodes > 1 and self.error_feedback is None:
            return (Variant(chunk_numel, dtype, inter_bits, block, swizzles=((1, nodes),)),
                    last)
        first = Variant(per_node * chunk_numel, dtype, bits, block,
                        swizzles=((nodes, per_node),))
        if nodes == 1:
            return first, last
        if self.error_feedback is None:
            # the fused requantization of the node's sums, in one payload per node
            return (first, Variant(chunk_numel, dtype, bits, block, per_node, nodes,
                                   bits_out=inter_bits), last)
        # the node's fp32 sums, requantized with feedback (its stored errors in fp32 too)
        fed_back = (Variant(chunk_numel, torch.float32, inter_bits, block, nodes,
                            swizzles=((1, nodes),)),
                    Variant(numel, torch.float32, inter_bits, block, nodes),
                    *self.error_feedback.kernel_variants(chunk_numel))
        if per_node == 1:
            return (*fed_back, last)
        return (first, Variant(chunk_numel, dtype, bits, block, per_node), *fed_back, last)

    def bytes_sent(self, numel, dtype, group):
        """Hop 1 sends the whole swizzled bucket inside the node; hop 2 the node's partial
        sums of the n slices that belong to ranks with this rank's local index."""
        first, second = self._hop_payloads(numel, dtype)
        sent = {"intra_node": all_to_all_bytes(first, self.per_node), "inter_node": 0}
        sent[locality(self.inter.spans_nodes)] += all_to_all_bytes(second, self.nodes)
        return sent

    # The hops' bytes are recorded by __call__, in the caller's thread: ``all_to_all``
    # records none.

    def _send(self, output: torch.Tensor, full: torch.Tensor, key: object,
              in_flight: dict[str, object]) -> None:
        """Steps 1-4 of [Note: qgZ data path], leaving step 4 (the inter-node all-to-all) in
        flight in ``in_flight`` for ``_receive``."""
        slice_numel = output.numel()
        chunk_numel = self.nodes * slice_numel

        if self.bits is None:
            swizzled = kernels.swizzle(full.reshape(-1), self.nodes, self.per_node)
            received = torch.empty_like(swizzled)
            all_to_all(received, swizzled, self.intra)
            partial = received.view(self.per_node, chunk_numel).float().sum(0)
            second = torch.empty_like(partial)
            in_flight["work"] = all_to_all(second, partial, self.inter, async_op=True)
            in_flight["received"] = second
            return

        bits, inter_bits, block = self.bits, self.inter_node_bits, self.block_size
        feedback = self.error_feedback
        backend = self._kernels_for(full)
        in_flight["bits"] = inter_bits
        if self.per_node == 1 and self.nodes > 1:
            # [Note: no quantized send to itself] One rank per node: hop 1 would send this
            # rank's values to itself, so its sum is the values themselves, exact; only the
            # inter-node hop quantizes.
            if feedback is None:
                send2 = backend.quantize_swizzled(full, 1, self.nodes, inter_bits, block)
            else:
                partial = feedback.compensate(key, full.reshape(-1).float())
                send2 = self._requantize_with_feedback(key, partial, slice_numel)
            self._send_across_nodes(send2, in_flight)
            return

        # Steps 1 and 2 in one kernel: quantized straight into the swizzled order, the
        # per_node payloads one after another, as the all-to-all splits its input.
        send = backend.quantize_swizzled(full, self.nodes, self.per_node, bits, block)
        received = torch.empty_like(send)
        all_to_all(received, send, self.intra)
        del send
        received = received.view(self.per_node, -1)
        if self.nodes == 1:
            # One node: hop 2 would send the node's requantized sums to the node itself.
            # The intra-node hop's payloads are summed straight into this rank's slice: one
            # quantization, as every rank's gradient is quantized once.
            in_flight.update(work=None, received=received, bits=bits)
            return

        if feedback is None:
            # Step 3 writes the node's n slices as n payloads, the second hop's layout.
            send2 = backend.dequantize_reduce_quantize(received, chunk_numel, bits, inter_bits,
                                                       block, parts=self.nodes)
        else:
            partial = feedback.compensate(
                key, backend.dequantize_reduce(received, chunk_numel, bits, block))
            send2 = self._requantize_with_feedback(key, partial, slice_numel)
        self._send_across_nodes(send2, in_flight)

    def _requantize_with_feedback(self, key: object, partial: torch.Tensor,
                                  slice_numel: int) -> torch.Tensor:
        """The node's partial sums (already compensated) as one payload per node, and what
        that dropped kept for the next reduction ([Note: error feedback])."""
        inter_bits, block = self.inter_node_bits, self.block_size
        backend = self._kernels_for(partial)
        send = backend.quantize_swizzled(partial, 1, self.nodes, inter_bits, block)
        sent = backend.dequantize_blockwise_many(send.view(self.nodes, -1), slice_numel,
                                                 inter_bits, block, torch.float32)
        self.error_feedback.record(key, partial, sent.view(-1))
        return send

    def _send_across_nodes(self, send: torch.Tensor, in_flight: dict[str, object]) -> None:
        """Step 4, left in flight: slice m of ``send`` to node m."""
        received = torch.empty_like(send)
        in_flight["work"] = all_to_all(received, send, self.inter, async_op=True)
        in_flight["received"] = received.view(self.nodes, -1)

    def _receive(self, output: torch.Tensor, in_flight: dict[str, object]) -> None:
        """Step 5: wait for the inter-node hop, sum what it brought into ``output``."""
        work, received = in_flight.pop("work"), in_flight.pop("received")
        if work is not None:
            work.wait()
        slice_numel = output.numel()
        # The fp32 sum is written straight into the output (a gradient shard), rounded
        # once to its dtype by the kernel.
        if self.bits is None:
            output.copy_(received.view(self.nodes, slice_numel).sum(0))
            return
        bits = in_flight.pop("bits")
        backend = self._kernels_for(received)
        if output.is_contiguous():
            backend.dequantize_reduce(received, slice_numel, bits, self.block_size, out=output)
        else:
            output.copy_(backend.dequantize_reduce(received, slice_numel, bits, self.block_size))
