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
