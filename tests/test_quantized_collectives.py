"""qwZ and qgZ collectives against the exact collectives they replace (gloo, 4 ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _shard(rank: int, numel: int, dtype: torch.dtype, integer: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    if integer:  # exactly representable sums: any order of additions gives the same bits
        return torch.randint(-8, 8, (numel,), generator=g).to(dtype)
    return (torch.randn(numel, generator=g) * (1 + rank)).to(dtype)


def gather_case(rank, world, per_node, numel, block):
    from zeropp.comm import CommGroup, CommStats, all_gather
    from zeropp.comm.quantized import QuantizedAllGather
    from zeropp.topology import build_topology

    topo = build_topology(per_node)
    group = CommGroup(None, world, rank, topo.spans_nodes)
    out = {}
    for dtype in DTYPES:
        shard = _shard(rank, numel, dtype)
        exact = torch.empty(world * numel, dtype=dtype)
        quant = torch.empty(world * numel, dtype=dtype)
        stats = CommStats()
        all_gather(exact, shard, group, stats, "forward_all_gather").wait()
        QuantizedAllGather(bits=8, block_size=block)(quant, shard, group, stats,
                                                     "forward_all_gather").wait()
        out[str(dtype)] = (exact, quant)
    return out


@pytest.mark.parametrize("numel,block", [(1001, 256), (37, 5)])
def test_qwz_all_gather_within_block_bound(numel, block):
    world = 4
    results = run_ranks(gather_case, world, 2, numel, block)
    for dtype in DTYPES:
        exact, quant = results[0][str(dtype)]
        # every rank sees identical weights, the sender's own shard included
        for other in results[1:]:
            assert torch.equal(other[str(dtype)][1], quant)
        for r in range(world):
            x = exact[r * numel:(r + 1) * numel].float()
            q = quant[r * numel:(r + 1) * numel].float()
            pad = (-numel) % block
            xb = torch.nn.functional.pad(x, (0, pad)).view(-1, block)
            qb = torch.nn.functional.pad(q, (0, pad)).view(-1, block)
            scale = xb.abs().amax(1, keepdim=True) / 127
            slack = 0 if dtype == torch.float32 else xb.abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
            assert ((xb - qb).abs() <= scale / 2 + slack + 1e-7).all(), (dtype, r)


def reduce_case(rank, world, per_node, slice_numel, bits, integer):
    from zeropp.comm import CommGroup, CommStats, reduce_scatter_sum
    from zeropp.comm.quantized import HierarchicalReduceScatter
    from zeropp.topology import build_topology

    topo = build_topology(per_node)
    group = CommGroup(None, world, rank, topo.spans_nodes)
    qgz = HierarchicalReduceScatter(topo, bits=bits, block_size=64)
    out = {}
    for dtype in DTYPES:
        full = _shard(rank, world * slice_numel, dtype, integer)
        exact = torch.empty(slice_numel, dtype=dtype)
        hier = torch.empty(slice_numel, dtype=dtype)
        stats = CommStats()
        reduce_scatter_sum(exact, full, group, stats, "gradient_reduce").wait()
        qgz(hier, full, group, stats, "gradient_reduce").wait()
        out[str(dtype)] = (exact.float(), hier.float())
    return out


@pytest.mark.parametrize("per_node", [2, 4, 1], ids=["2x2", "1x4", "4x1"])
def test_qgz_hierarchy_without_quantization_is_exact(per_node):
    results = run_ranks(reduce_case, 4, per_node, 128, None, True)
    for rank_result in results:
        for dtype in DTYPES:
            exact, hier = rank_result[str(dtype)]
            assert torch.equal(exact, hier), (per_node, dtype)


@pytest.mark.parametrize("per_node,bits,bound", [(2, 4, 0.2), (4, 4, 0.2), (1, 4, 0.2), (2, 8, 0.012)],
                         ids=["2x2-int4", "1x4-int4", "4x1-int4", "2x2-int8"])
def test_qgz_close_to_exact_reduce_scatter(per_node, bits, bound):
    results = run_ranks(reduce_case, 4, per_node, 640, bits, False)
    for rank_result in results:
        for dtype in DTYPES:
            exact, hier = rank_result[str(dtype)]
            rel = (hier - exact).norm() / exact.norm()
            assert rel < bound, (per_node, bits, dtype, rel.item())
            assert rel > 0  # it really was quantized


# ---- qgZ with a narrower inter-node hop (int2, ternary) -------------------------------------
def repeated_reduce_case(rank, world, per_node, slice_numel, inter_bits, feedback, repeats):
    """The same gradients reduced ``repeats`` times (one bucket key): each output, the exact
    reduce-scatter, and the bytes recorded against what ``bytes_sent`` promises."""
    from zeropp.comm import CommGroup, CommStats, reduce_scatter_sum
    from zeropp.comm.quantized import HierarchicalReduceScatter
    from zeropp.topology import build_topology

    topo = build_topology(per_node)
    group = CommGroup(None, world, rank, topo.spans_nodes)
    qgz = HierarchicalReduceScatter(topo, bits=4, block_size=64, inter_node_bits=inter_bits,
                                    error_feedback=(0.0, 0) if feedback else None)
    full = _shard(rank, world * slice_numel, torch.float32)
    exact = torch.empty(slice_numel)
    reduce_scatter_sum(exact, full, group, CommStats(), "gradient_reduce").wait()
    stats, outputs = CommStats(), []
    for _ in range(repeats):
        out = torch.empty(slice_numel)
        qgz(out, full, group, stats, "gradient_reduce", key="bucket").wait()
        outputs.append(out)
    promised = qgz.bytes_sent(slice_numel, torch.float32, group)
    recorded = stats.snapshot()["gradient_reduce"]
    return exact, torch.stack(outputs), promised, recorded, qgz.alignment


def _relative(error: torch.Tensor, exact: torch.Tensor) -> float:
    return (error.norm() / exact.norm()).item()


def test_qgz_int2_inter_node_hop_bytes_and_error_feedback():
    """int2 across nodes: a quarter of int8's bytes, half of int4's, on the inter-node hop
    only; alone it is coarse, and error feedback sends what one reduction drops in the next
    ones, so the mean of repeated reductions of one gradient closes on the exact sum."""
    slice_numel, repeats = 256, 16
    int4 = run_ranks(repeated_reduce_case, 4, 2, slice_numel, None, False, 1)
    int2 = run_ranks(repeated_reduce_case, 4, 2, slice_numel, 2, False, repeats)
    int2_fed = run_ranks(repeated_reduce_case, 4, 2, slice_numel, 2, True, repeats)
    for rank in range(4):
        exact, out4, promised4, recorded4, align4 = int4[rank]
        _, out2, promised2, recorded2, align2 = int2[rank]
        _, fed, _, _, _ = int2_fed[rank]
        # Accounting: what was recorded per call is what bytes_sent promises.
        assert recorded4["inter_node"] == promised4["inter_node"]
        assert recorded2["inter_node"] == repeats * promised2["inter_node"]
        assert recorded2["intra_node"] == repeats * promised4["intra_node"]  # hop 1 unchanged
        # Each rank sends the other node its partial sum of one slice: codes and fp32 scales.
        codes4, codes2 = slice_numel // 2, slice_numel // 4
        scales = slice_numel // 64 * 4
        assert promised4["inter_node"] == codes4 + scales
        assert promised2["inter_node"] == codes2 + scales
        assert (align4, align2) == (2 * 64, 4 * 64)
        # Without feedback the ternary hop repeats the same error: coarser than int4.
        error4, error2 = _relative(out4[0] - exact, exact), _relative(out2[0] - exact, exact)
        assert error4 < error2 < 0.9
        assert torch.equal(out2[0], out2[-1])
        # With feedback the first reduction is the plain one; the mean error then shrinks.
        assert torch.equal(fed[0], out2[0])
        mean_error = _relative(fed.mean(0) - exact, exact)
        assert mean_error < error2 / 4, (rank, error2, mean_error)


def _correlated_gradient(rank: int, numel: int) -> torch.Tensor:
    """Data-parallel gradients: a component every rank shares plus a little of its own."""
    shared = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    own = torch.randn(numel, generator=torch.Generator().manual_seed(200 + rank))
    return shared + 0.1 * own


def once_quantized_case(rank, world, per_node, slice_numel, bits, block):
    """qgZ's reduce-scatter, the exact one, and the sum of every rank's gradient quantized
    once (each rank builds all ranks' gradients from their seeds)."""
    from zeropp import kernels
    from zeropp.comm import CommGroup, CommStats, reduce_scatter_sum
    from zeropp.comm.quantized import HierarchicalReduceScatter
    from zeropp.topology import build_topology

    topo = build_topology(per_node)
    group = CommGroup(None, world, rank, topo.spans_nodes)
    numel = world * slice_numel
    full = _correlated_gradient(rank, numel)
    exact = torch.empty(slice_numel)
    reduce_scatter_sum(exact, full, group, CommStats(), "gradient_reduce").wait()
    qgz = torch.empty(slice_numel)
    HierarchicalReduceScatter(topo, bits=bits, block_size=block)(
        qgz, full, group, CommStats(), "gradient_reduce").wait()
    mine = slice(rank * slice_numel, (rank + 1) * slice_numel)
    once = sum(kernels.dequantize_blockwise(
        kernels.quantize_blockwise(_correlated_gradient(r, numel), bits, block), numel, bits,
        block, torch.float32)[mine] for r in range(world))
    return exact, qgz, once


@pytest.mark.parametrize(("world", "per_node"), [(4, 4), (8, 8), (8, 1)],
                         ids=["1x4", "1x8", "8x1"])
def test_qgz_quantizes_each_gradient_once_with_one_node_or_one_rank_per_node(world, per_node):
    """[Note: no quantized send to itself] With one node the inter-node hop, with one rank
    per node the intra-node hop, would send to itself: neither quantizes, so the reduction's
    error is one quantization's (it was 1.98x that on 1 x 4 when both hops quantized)."""
    for exact, qgz, once in run_ranks(once_quantized_case, world, per_node, 512, 4, 64):
        error = (qgz - exact).norm() / exact.norm()
        error_once = (once - exact).norm() / exact.norm()
        assert error > 0 and error <= 1.05 * error_once, (error.item(), error_once.item())


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 2), (2, 4), (1, 3), (4, 1)])
@pytest.mark.parametrize(("bits", "block"), [(8, 64), (4, 64), (4, 3), (2, 5)])
def test_qgz_quantizes_straight_into_the_swizzled_payloads(nodes, per_node, bits, block):
    """qgZ's first send is quantized in one step into per-local-rank payloads: the same
    bytes as quantizing, on its own, each local rank's chunk (the slices of ranks
    m * per_node + l, in node order)."""
    from zeropp import kernels

    slice_numel = block * 4  # whole int2 bytes for any block
    flat = torch.randn(nodes * per_node * slice_numel, generator=torch.Generator().manual_seed(3))
    flat[slice_numel : slice_numel + block] = 0.0
    by_rank = flat.view(nodes, per_node, slice_numel)
    expected = torch.cat([kernels.quantize_blockwise(by_rank[:, local].reshape(-1), bits, block)
                          for local in range(per_node)])
    got = kernels.quantize_swizzled(flat, nodes, per_node, bits, block)
    assert torch.equal(got, expected)
    # The swizzle of the values followed by a split of the payload: the same bytes.
    chunk_numel = nodes * slice_numel
    assert torch.equal(got.view(per_node, -1), kernels.reference.split_payload(
        kernels.quantize_blockwise(kernels.swizzle(flat, nodes, per_node), bits, block),
        per_node, chunk_numel, bits, block))
    with pytest.raises(ValueError, match="whole blocks"):
        kernels.quantize_swizzled(flat[: -nodes * per_node], nodes, per_node, bits, block)


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize(("bits_in", "bits_out", "block"), [(4, 4, 64), (4, 2, 64), (8, 8, 5)])
def test_qgz_requantizes_into_one_payload_per_node(parts, bits_in, bits_out, block):
    """qgZ's middle step writes the node's partial sums as one payload per destination node:
    the bytes of quantizing each slice of the sum on its own; and the last step sums
    straight into a caller's fp32 buffer, equal to the sum it returns."""
    from zeropp import kernels

    generator = torch.Generator().manual_seed(5)
    numel = parts * block * 4
    payloads = torch.stack([kernels.quantize_blockwise(torch.randn(numel, generator=generator),
                                                       bits_in, block) for _ in range(3)])
    total = kernels.dequantize_reduce(payloads, numel, bits_in, block)
    expected = torch.cat([kernels.quantize_blockwise(piece, bits_out, block)
                          for piece in total.view(parts, -1)])
    got = kernels.dequantize_reduce_quantize(payloads, numel, bits_in, bits_out, block,
                                             parts=parts)
    assert torch.equal(got, expected)
    into = torch.full((numel,), float("nan"))
    assert kernels.dequantize_reduce(payloads, numel, bits_in, block, out=into) is into
    assert torch.equal(into, total)
    rows = torch.full((3, numel), float("nan"), dtype=torch.bfloat16)
    kernels.dequantize_blockwise_many(payloads, numel, bits_in, block, torch.bfloat16, out=rows)
    assert torch.equal(rows, kernels.dequantize_blockwise_many(payloads, numel, bits_in, block,
                                                               torch.bfloat16))
    rounded = torch.empty(numel, dtype=torch.bfloat16)
    kernels.dequantize_reduce(payloads, numel, bits_in, block, out=rounded)
    assert torch.equal(rounded, total.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out.dtype"):
        kernels.dequantize_reduce(payloads, numel, bits_in, block,
                                  out=torch.empty(numel, dtype=torch.int32))


def test_quantized_gather_chooses_its_kernels_once_per_device_type(monkeypatch):
    """The backend choice (environment read and checks) is made at a collective's first launch
    on a device type, not at every launch; CPU and meta tensors still get their own."""
    from zeropp import kernels
    from zeropp.comm import CommGroup, CommStats
    from zeropp.comm.quantized import QuantizedAllGather
    from zeropp.kernels import meta, reference

    chosen = []
    choose = kernels.backend_for

    def counted(tensor, block_size):
        chosen.append(tensor.device.type)
        return choose(tensor, block_size)

    monkeypatch.setattr(kernels, "backend_for", counted)
    gather, group = QuantizedAllGather(bits=8, block_size=64), CommGroup(None, 1, 0, False)
    shard = _shard(0, 300, torch.float32)
    for _ in range(3):
        out = torch.empty(300)
        gather(out, shard, group, CommStats(), "forward_all_gather").wait()
        assert (out - shard).abs().max() <= shard.abs().max() / 127
    assert chosen == ["cpu"]
    # The choice is the one backend_for makes, per device type.
    gather(torch.empty(300, device="meta"), shard.to("meta"), group, CommStats(),
           "forward_all_gather").wait()
    assert chosen == ["cpu", "meta"]
    assert gather._backends == {"cpu": reference, "meta": meta}


def test_qgz_chooses_its_kernels_once_per_device_type(monkeypatch):
    """qgZ's send and receive (a one-rank cluster: its quantize and its sum) launch with the
    kernels chosen at its first call."""
    from zeropp import kernels
    from zeropp.comm import CommGroup, CommStats
    from zeropp.comm.quantized import HierarchicalReduceScatter
    from zeropp.kernels import reference
    from zeropp.topology import ClusterShape, Topology

    chosen = []
    choose = kernels.backend_for
    monkeypatch.setattr(kernels, "backend_for",
                        lambda tensor, block: chosen.append(tensor.device.type) or choose(tensor,
                                                                                          block))
    reduce = HierarchicalReduceScatter(Topology.planned(ClusterShape(world_size=1,
                                                                     ranks_per_node=1)),
                                       bits=8, block_size=64)
    full = _shard(0, 256, torch.float32)
    for _ in range(3):
        out = torch.empty(256)
        reduce(out, full, CommGroup(None, 1, 0, False), CommStats(), "gradient_reduce").wait()
        assert (out - full).abs().max() <= full.abs().max() / 127
    assert chosen == ["cpu"] and reduce._backends == {"cpu": reference}
