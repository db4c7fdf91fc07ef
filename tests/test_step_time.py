"""The step-time model on hand-built traces: formulas, overlap, exposure, built-in figures."""

import dataclasses
import math

import pytest

from zeropp.planning.step_time import (
    CLUSTERS,
    DEFAULT_HOST_SECONDS_PER_OP,
    V100_GEMM_FRACTION,
    V100_NETWORK_EFFICIENCY,
    ClusterSpec,
    collective_seconds,
    compute_seconds,
    host_transport_bytes,
    lab_cluster,
    predict,
)
from zeropp.simulation.trace import (
    Collective,
    ComputeOp,
    HostSync,
    IterationTrace,
    Launch,
    Wait,
)

GB = 1e9
MiB = 2**20


def toy_cluster(ranks_per_node=4, nics=1, **kw) -> ClusterSpec:
    """Round numbers so expected values are easy to write out; no latency and no host cost
    unless asked."""
    spec = dict(name="toy", peak_flops=100e12, peak_flops_fp32=10e12, gemm_fraction=0.5,
                memory_bandwidth=1000 * GB, memory_fraction=0.5, ranks_per_node=ranks_per_node,
                intra_node_bandwidth=100 * GB, intra_node_latency=0.0, nics_per_node=nics,
                nic_bandwidth=10 * GB, inter_node_latency=0.0, host_seconds_per_op=0.0)
    spec.update(kw)
    return ClusterSpec(**spec)


def trace_of(events, cluster, world_size=8, flops=1e12, rank=0):
    return IterationTrace(rank=rank, world_size=world_size,
                          ranks_per_node=cluster.ranks_per_node, tokens_per_iteration=1024,
                          model_flops_per_iteration=flops, dtype_bytes=2, events=list(events))


def gemm(seconds, cluster, phase="forward"):
    """A compute-bound op that takes ``seconds`` on ``cluster`` (16-bit)."""
    return ComputeOp("aten.mm.default", seconds * cluster.peak_flops * cluster.gemm_fraction,
                     0, phase)


def quantize(seconds, cluster, phase="forward"):
    """A memory-bound kernel (no FLOPs) that takes ``seconds`` on ``cluster``."""
    return ComputeOp("quantize", 0, int(seconds * cluster.memory_bandwidth
                                        * cluster.memory_fraction), phase)


def gather(group, size):
    return Collective("all_gather", tuple(group), size // len(group), size)


# -- compute ---------------------------------------------------------------------------

def test_roofline_and_compute_only_trace():
    c = toy_cluster()
    mm = ComputeOp("aten.mm.default", 5e12, 1_000_000, "forward")  # 5e12 / 50e12 = 0.1 s
    add = ComputeOp("aten.add.Tensor", 0, 50 * 10**9, "backward")  # 50e9 / 500e9 = 0.1 s
    both = ComputeOp("aten.bmm.default", 1e12, 25 * 10**9, "backward")  # max(0.02, 0.05)
    assert compute_seconds(mm, c) == pytest.approx(0.1)
    assert compute_seconds(add, c) == pytest.approx(0.1)
    assert compute_seconds(both, c) == pytest.approx(0.05)
    assert compute_seconds(mm, c, dtype_bytes=4) == pytest.approx(1.0)  # fp32 peak
    p = predict(trace_of([mm, add, both], c), c)
    assert p.seconds == pytest.approx(0.25)
    assert p.compute_busy_seconds == pytest.approx(0.25)
    assert p.total_comm_seconds == 0 and p.total_exposed_seconds == 0


# -- collective formulas ---------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4, 16])
def test_ring_all_gather_inside_a_node(n):
    c = toy_cluster(ranks_per_node=16, intra_node_latency=1e-5)
    size = 64 * MiB
    expected = (n - 1) / n * size / (100 * GB) + (n - 1) * 1e-5
    assert collective_seconds(gather(range(n), size), c, 0) == pytest.approx(expected)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_ring_all_gather_across_nodes_one_rank_per_node(n):
    # One rank per node on each of n nodes: every ring edge is a NIC.
    c = toy_cluster(ranks_per_node=1, inter_node_latency=2e-5)
    size = 64 * MiB
    expected = (n - 1) / n * size / (10 * GB) + (n - 1) * 2e-5
    assert collective_seconds(gather(range(n), size), c, 0) == pytest.approx(expected)


def test_intra_vs_inter_node_bandwidth():
    c = toy_cluster(ranks_per_node=4)
    size = 100 * MiB
    intra = collective_seconds(gather([0, 1], size), c, 0)
    inter = collective_seconds(gather([0, 4], size), c, 0)
    assert intra == pytest.approx(0.5 * size / (100 * GB))
    # A 1-rank-per-node group on a 4-rank node: 4 such groups share the NIC at once.
    assert inter == pytest.approx(0.5 * size / (10 * GB / 4))
    # The same group seen from the other end costs the same.
    assert collective_seconds(gather([0, 4], size), c, 4) == pytest.approx(inter)


def test_dgx2_world_group_one_vs_four_nics():
    size = 1 * 2**30
    group = range(32)  # 2 DGX-2 nodes x 16 GPUs: ZeRO-3's data-parallel group
    one, four = CLUSTERS["dgx2_100g"], CLUSTERS["dgx2_400g"]
    t1 = collective_seconds(gather(group, size), one, 0)
    t4 = collective_seconds(gather(group, size), four, 0)
    latency = (32 - 2) * one.intra_node_latency + 1 * one.inter_node_latency
    # The ring crosses each node once: it gets all of the node's NICs (bus bandwidth), at the
    # V100 calibration's fraction of their line rate.
    e = one.network_efficiency
    assert 0.5 < e < 1.0
    assert t1 == pytest.approx(31 / 32 * size / (12.5e9 * e) + latency)
    assert t4 == pytest.approx(31 / 32 * size / (50e9 * e) + latency)
    assert (t1 - latency) / (t4 - latency) == pytest.approx(4.0)
    # 8 NICs (77 GB/s as calibrated) are still below NVSwitch's 150 GB/s; the slower link bounds.
    t8 = collective_seconds(gather(group, size), CLUSTERS["dgx2_800g"], 0)
    assert t8 == pytest.approx(31 / 32 * size / (100e9 * e) + latency)
    fast = dataclasses.replace(one, nics_per_node=16, network_efficiency=1.0)
    assert collective_seconds(gather(group, size), fast, 0) == pytest.approx(
        31 / 32 * size / 150e9 + latency)


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    for c in (toy_cluster(intra_node_latency=1e-5, inter_node_latency=3e-5),
              toy_cluster(algorithm="direct", inter_node_latency=3e-5), CLUSTERS["dgx_a100"]):
        size = 8 * MiB
        for group in ([0, 1, 2], list(range(8)), [0, 4]):
            n = len(group)
            ar = collective_seconds(Collective("all_reduce", tuple(group), size, size), c, 0)
            rs = collective_seconds(Collective("reduce_scatter", tuple(group), size, size // n),
                                    c, 0)
            ag = collective_seconds(Collective("all_gather", tuple(group), size // n, size),
                                    c, 0)
            assert ar == pytest.approx(rs + ag)


def test_all_to_all_splits_intra_and_inter_node_traffic():
    c = toy_cluster(ranks_per_node=4, inter_node_latency=1e-5)
    size = 80 * MiB
    a2a = Collective("all_to_all", tuple(range(8)), size, size)
    intra = 3 / 8 * size / (100 * GB)
    inter = 4 / 8 * size / (10 * GB / 4)  # 4 ranks of the node share its NIC
    assert collective_seconds(a2a, c, 0) == pytest.approx(max(intra, inter) + 1e-5)
    local = Collective("all_to_all", (0, 1, 2, 3), size, size)
    assert collective_seconds(local, c, 0) == pytest.approx(3 / 4 * size / (100 * GB))


def test_single_rank_group_and_foreign_rank():
    c = toy_cluster()
    assert collective_seconds(gather([3], 1024), c, 3) == 0.0
    with pytest.raises(ValueError):
        collective_seconds(gather([1, 2], 1024), c, 0)


# -- replay ----------------------------------------------------------------------------

def _overlap_trace(c, gather_seconds, compute_seconds_):
    """Launch a gather, compute, then wait: the FSDP prefetch pattern."""
    size = int(gather_seconds * 2 * 100 * GB)  # 2-rank intra-node ring: size/2 / 100 GB/s
    launch = Launch(1, "gather", (gather([0, 1], size),), "forward")
    return [launch, gemm(compute_seconds_, c), Wait(1), gemm(0.1, c)]


def test_short_gather_overlaps_fully():
    c = toy_cluster()
    p = predict(trace_of(_overlap_trace(c, 0.2, 0.5), c), c)
    assert p.seconds == pytest.approx(0.6)
    assert p.comm_seconds[("forward", "gather")] == pytest.approx(0.2)
    assert p.exposed_comm_seconds.get(("forward", "gather"), 0.0) == 0.0


def test_long_gather_exposes_the_difference():
    c = toy_cluster()
    p = predict(trace_of(_overlap_trace(c, 0.8, 0.5), c), c)
    assert p.exposed_comm_seconds[("forward", "gather")] == pytest.approx(0.3)
    assert p.seconds == pytest.approx(0.8 + 0.1)
    assert p.compute_busy_seconds == pytest.approx(0.6)


def test_wait_right_after_launch_exposes_everything():
    c = toy_cluster()
    size = int(0.2 * 2 * 100 * GB)
    events = [Launch(1, "gather", (gather([0, 1], size),), "forward"), Wait(1),
              gemm(0.5, c)]
    p = predict(trace_of(events, c), c)
    assert p.exposed_comm_seconds[("forward", "gather")] == pytest.approx(0.2)
    assert p.seconds == pytest.approx(0.7)


def test_lane_waits_for_compute_at_issue_and_iteration_waits_for_lanes():
    c = toy_cluster()
    size = int(0.2 * 2 * 100 * GB)
    # The reduce is issued after 0.5 s of compute, so it runs 0.5 .. 0.7 and nobody waits
    # for it: the iteration still ends when it does.
    events = [gemm(0.5, c, "backward"),
              Launch(7, "reduce", (Collective("reduce_scatter", (0, 1), size, size // 2),),
                     "backward")]
    p = predict(trace_of(events, c), c)
    assert p.seconds == pytest.approx(0.7)
    assert p.total_exposed_seconds == 0.0


def test_in_place_collective_on_the_compute_stream_is_exposed():
    c = toy_cluster()
    size = int(0.2 * 100 * GB / 2)  # all_reduce of 2 ranks: 2 * (1/2) * size / bw = 0.1 s
    events = [gemm(0.3, c, "optimizer"),
              Launch(1, "compute", (Collective("all_reduce", (0, 1), size, size),),
                     "optimizer"),
              Wait(1), gemm(0.1, c, "optimizer")]
    p = predict(trace_of(events, c), c)
    assert p.exposed_comm_seconds[("optimizer", "compute")] == pytest.approx(0.1)
    assert p.seconds == pytest.approx(0.5)


def test_side_lane_kernels_run_before_the_collectives():
    c = toy_cluster()
    size = int(0.2 * 2 * 100 * GB)
    quant = quantize(0.05, c)
    launch = Launch(1, "gather", (gather([0, 1], size),), "forward", (quant,))
    p = predict(trace_of([launch, Wait(1)], c), c)
    assert p.seconds == pytest.approx(0.25)
    assert p.lane_compute_seconds["gather"] == pytest.approx(0.05)
    assert p.comm_seconds[("forward", "gather")] == pytest.approx(0.2)
    assert p.compute_busy_seconds == 0.0


def test_a_hop_left_in_flight_frees_the_lane_for_the_next_reduction():
    """qgZ's inter-node hop is received at the wait: the reduce lane runs the next
    reduction's intra-node hop while the slow hop is on the wire, instead of after it."""
    c = toy_cluster()
    size = 64 * MiB
    intra = Collective("all_to_all", (0, 1, 2, 3), size, size)
    inter = Collective("all_to_all", (0, 4), size // 4, size // 4)
    t_intra, t_inter = collective_seconds(intra, c, 0), collective_seconds(inter, c, 0)
    assert t_inter > t_intra > 0

    def predicted(in_flight):
        events = [gemm(0.1, c, "backward"),
                  Launch(1, "reduce", (intra, inter), "backward", in_flight=in_flight),
                  Launch(2, "reduce", (intra, inter), "backward", in_flight=in_flight),
                  Wait(1), Wait(2)]
        return predict(trace_of(events, c), c).seconds

    # held: each launch's two hops back to back on the lane
    assert predicted(0) == pytest.approx(0.1 + 2 * (t_intra + t_inter))
    # in flight: the second intra-node hop runs under the first inter-node one; the two
    # inter-node hops still share the NIC one after the other
    assert predicted(1) == pytest.approx(0.1 + t_intra + 2 * t_inter)
    # an iteration with nothing waiting still ends when the hop left in flight does
    events = [Launch(1, "reduce", (intra, inter), "backward", in_flight=1)]
    assert predict(trace_of(events, c), c).seconds == pytest.approx(t_intra + t_inter)
    # a collective on the communicator of one left in flight waits for it (NCCL runs a
    # communicator's collectives in order): the weight-delta gather's intra-node hops
    events = [Launch(1, "reduce", (inter, intra), "backward", in_flight=1),
              Launch(2, "reduce", (intra,), "backward"), Wait(2)]
    assert predict(trace_of(events, c), c).seconds == pytest.approx(t_inter + 2 * t_intra)


def test_completion_kernels_run_beside_the_lane_and_the_wait_takes_them():
    """qwZ's dequantize runs on the gather lane's completion stream: the next gather's
    transfer starts when the previous transfer ends, and a Wait waits for the dequantize."""
    c = toy_cluster()
    size = int(0.2 * 2 * 100 * GB)  # 0.2 s on a 2-rank intra-node ring
    dequantize = quantize(0.05, c)
    events = [Launch(1, "gather", (gather([0, 1], size),), "forward",
                     completion_ops=(dequantize,)),
              Launch(2, "gather", (gather([0, 1], size),), "forward",
                     completion_ops=(dequantize,)),
              Wait(1), gemm(0.1, c), Wait(2)]
    p = predict(trace_of(events, c), c)
    # transfers 0-0.2 and 0.2-0.4; completions 0.2-0.25 and 0.4-0.45; compute waits for the
    # first completion (0.25), runs 0.25-0.35, then waits for the second (0.45)
    assert p.seconds == pytest.approx(0.45)
    assert p.lane_compute_seconds["gather"] == pytest.approx(0.1)
    # a completion that outlasts the next transfer queues on its own stream
    slow = quantize(0.3, c)
    events = [Launch(1, "gather", (gather([0, 1], size),), "forward", completion_ops=(slow,)),
              Launch(2, "gather", (gather([0, 1], size),), "forward", completion_ops=(slow,)),
              Wait(2)]
    assert predict(trace_of(events, c), c).seconds == pytest.approx(0.2 + 0.3 + 0.3)


def test_host_driven_ranks_run_lane_kernels_on_the_compute_stream():
    # On CPU ranks the lane's quantize kernel takes the cores that compute: 0.05 s of compute
    # at the issue point, then the 0.2 s transfer overlaps the 0.3 s gemm that follows.
    gpu = toy_cluster()
    cpu = dataclasses.replace(gpu, host_transport_bandwidth=1e30)  # transport costs nothing
    size = int(0.2 * 2 * 100 * GB)
    quant = quantize(0.05, gpu)
    events = [Launch(1, "gather", (gather([0, 1], size),), "forward", (quant,)),
              gemm(0.3, gpu), Wait(1)]
    on_gpu, on_cpu = predict(trace_of(events, gpu), gpu), predict(trace_of(events, cpu), cpu)
    assert on_gpu.seconds == pytest.approx(0.3)  # quantize + transfer hide under the gemm
    assert on_gpu.compute_busy_seconds == pytest.approx(0.3)
    assert on_cpu.seconds == pytest.approx(0.35)
    assert on_cpu.compute_busy_seconds == pytest.approx(0.35)
    assert on_cpu.lane_compute_seconds["gather"] == pytest.approx(0.05)
    assert on_cpu.host_transport_seconds == pytest.approx(size / 1e30)
    # so does a completion step (qwZ's dequantize): the host runs it too
    events[0] = dataclasses.replace(events[0], completion_ops=(quantize(0.1, gpu),))
    assert predict(trace_of(events, cpu), cpu).compute_busy_seconds == pytest.approx(0.45)
    # (on a GPU it runs after the transfer, 0.25 to 0.35, beside the gemm)
    on_gpu = predict(trace_of(events, gpu), gpu)
    assert on_gpu.seconds == pytest.approx(0.35) and on_gpu.compute_busy_seconds == 0.3


def test_measured_kernel_rate_replaces_the_roofline():
    c = toy_cluster()
    quant = ComputeOp("zeropp.quantize_blockwise.default", 0, 10 * GB, "forward")
    add = ComputeOp("aten.add.Tensor", 0, 10 * GB, "forward")
    measured = dataclasses.replace(c, kernel_bandwidth={quant.name: 1 * GB})
    assert compute_seconds(quant, c) == pytest.approx(10 * GB / (500 * GB))
    assert compute_seconds(quant, measured) == pytest.approx(10.0)
    assert compute_seconds(add, measured) == compute_seconds(add, c)  # others keep the roofline
    lab = lab_cluster(1e9, 1e9, 1e8, kernel_bandwidth={quant.name: 2 * GB})
    assert compute_seconds(quant, lab) == pytest.approx(5.0)


def test_cross_node_collectives_of_two_lanes_share_the_nic():
    c = toy_cluster(ranks_per_node=1)
    size = int(0.2 * 2 * 10 * GB)  # 2-node ring: 0.2 s on the NIC
    events = [Launch(1, "gather", (gather([0, 1], size),), "backward"),
              Launch(2, "reduce", (Collective("reduce_scatter", (0, 1), size, size // 2),),
                     "backward"),
              Wait(1), Wait(2)]
    p = predict(trace_of(events, c, world_size=2), c)
    assert p.seconds == pytest.approx(0.4)  # serialized on the one NIC timeline
    # Intra-node collectives of the two lanes do not contend.
    c4 = toy_cluster(ranks_per_node=2)
    size4 = int(0.2 * 2 * 100 * GB)
    events4 = [Launch(1, "gather", (gather([0, 1], size4),), "backward"),
               Launch(2, "reduce", (Collective("reduce_scatter", (0, 1), size4, size4 // 2),),
                      "backward"),
               Wait(1), Wait(2)]
    assert predict(trace_of(events4, c4, world_size=2), c4).seconds == pytest.approx(0.2)


def test_tflops_per_gpu_is_model_flops_over_seconds():
    c = toy_cluster()
    p = predict(trace_of(_overlap_trace(c, 0.8, 0.5), c, flops=3.6e12), c)
    assert p.tflops_per_gpu == pytest.approx(3.6e12 / p.seconds / 1e12)
    assert p.tflops_per_gpu == pytest.approx(4.0)


def test_trace_errors():
    c = toy_cluster()
    with pytest.raises(ValueError):
        predict(trace_of([Wait(3)], c), c)
    other = toy_cluster(ranks_per_node=8)
    with pytest.raises(ValueError):
        predict(trace_of([], other), c)
    with pytest.raises(ValueError):
        toy_cluster(algorithm="butterfly")


# -- built-in clusters -----------------------------------------------------------------

def test_builtin_cluster_figures():
    for gbps, nics in ((100, 1), (200, 2), (400, 4), (800, 8)):
        d = CLUSTERS[f"dgx2_{gbps}g"]
        assert (d.ranks_per_node, d.peak_flops, d.memory_bandwidth) == (16, 125e12, 900e9)
        assert d.intra_node_bandwidth == 150e9  # 300 GB/s bidirectional
        assert (d.nics_per_node, d.nic_bandwidth) == (nics, 12.5e9)
        # the V100 calibration: two constants, the same on every DGX-2 description
        assert (d.gemm_fraction, d.network_efficiency) == (V100_GEMM_FRACTION,
                                                           V100_NETWORK_EFFICIENCY)
        assert d.node_nic_bandwidth * 8 == pytest.approx(gbps * 1e9 * V100_NETWORK_EFFICIENCY)
    a = CLUSTERS["dgx_a100"]
    assert (a.ranks_per_node, a.peak_flops, a.memory_bandwidth) == (8, 312e12, 2.0e12)
    assert (a.intra_node_bandwidth, a.nics_per_node, a.nic_bandwidth) == (300e9, 8, 25e9)
    h = CLUSTERS["dgx_h100"]
    assert (h.ranks_per_node, h.peak_flops, h.memory_bandwidth) == (8, 989e12, 3.35e12)
    assert (h.intra_node_bandwidth, h.nics_per_node, h.nic_bandwidth) == (450e9, 8, 50e9)
    assert all(c.algorithm == "ring" for c in CLUSTERS.values())
    assert a.network_efficiency == h.network_efficiency == 1.0  # not calibrated


def test_lab_cluster_uses_the_measured_link():
    lab = lab_cluster(50e9, 20e9, 96e6)  # docs/lab.md: 96 Mbit/s measured at "100mbit"
    assert (lab.ranks_per_node, lab.nodes, lab.nics_per_node) == (2, 2, 1)
    assert lab.nic_bandwidth == 96e6 / 8
    assert lab.peak_for(4) == lab.peak_for(2) == 50e9
    # ZeRO-3's world group of 4 ranks (2 x 2): one ring edge per node crosses the link.
    size = 4 * MiB
    expected = 3 / 4 * size / min(lab.intra_node_bandwidth, 96e6 / 8)
    assert collective_seconds(gather(range(4), size), lab, 0) == pytest.approx(expected)
    assert not math.isclose(expected, 0.0)


def test_host_driven_transport_takes_its_bytes_from_the_compute_stream():
    # A 2-rank gather of 2 GB moves 1 GB out and 1 GB in through the rank's own cores: at
    # 1 GB/s that is 2 s of the compute stream, however well the lane hides the transfer.
    gpu = toy_cluster()
    cpu = dataclasses.replace(gpu, host_transport_bandwidth=1 * GB)
    events = _overlap_trace(gpu, 0.2, 0.5)
    size = events[0].collectives[0].output_bytes
    assert host_transport_bytes(events[0].collectives[0], cpu, 0) == pytest.approx(size)
    on_gpu, on_cpu = predict(trace_of(events, gpu), gpu), predict(trace_of(events, cpu), cpu)
    assert on_gpu.host_transport_seconds == 0.0
    assert on_cpu.host_transport_seconds == pytest.approx(size / GB)
    assert on_cpu.seconds == pytest.approx(on_gpu.seconds + size / GB)
    reduce = Collective("all_reduce", (0, 1, 2, 3), 4 * GB, 4 * GB)
    assert host_transport_bytes(reduce, cpu, 0) == pytest.approx(2 * 2 * 3 / 4 * 4 * GB)


# -- the host ([Note: host in the step-time model]) ------------------------------------------

def test_small_kernels_wait_for_the_host_and_large_ones_hide_it():
    """Ten 1 us kernels issued at 5 us each: the GPU runs each as it is issued (the last
    from 50 us to 51 us, 41 us of it idle); a 1 ms GEMM before them hides the host."""
    c = toy_cluster(host_seconds_per_op=5e-6)
    small = [quantize(1e-6, c) for _ in range(10)]
    p = predict(trace_of(small, c), c)
    assert p.seconds == pytest.approx(51e-6)
    assert p.host_ops == 10 and p.host_issue_seconds == pytest.approx(50e-6)
    assert p.gpu_waits_for_host_seconds == pytest.approx(5e-6 + 9 * 4e-6)
    assert p.host_bound and p.compute_busy_seconds == pytest.approx(10e-6)
    big = predict(trace_of([gemm(1e-3, c), *small], c), c)
    assert big.seconds == pytest.approx(5e-6 + 1e-3 + 10e-6)  # issued ahead while the GEMM ran
    assert not big.host_bound
    # Views, allocations and metadata reach no GPU: not charged.
    view = ComputeOp("aten.view.default", 0, 0, "forward")
    assert predict(trace_of([view] * 100, c), c).host_ops == 0


def test_a_host_sync_drains_the_compute_stream_before_the_host_goes_on():
    """After a sync the host issues from where the GPU finished: the next kernel cannot
    start before the host has issued it again."""
    c = toy_cluster(host_seconds_per_op=5e-6)
    events = [gemm(1e-3, c), HostSync("loss.item()"), quantize(1e-6, c)]
    p = predict(trace_of(events, c), c)
    # gemm issued at 5 us, runs to 1.005 ms; the host waits, issues the next at 1.010 ms.
    assert p.seconds == pytest.approx(5e-6 + 1e-3 + 5e-6 + 1e-6)
    assert p.host_syncs == 1
    without = predict(trace_of([events[0], events[2]], c), c)
    assert without.seconds == pytest.approx(5e-6 + 1e-3 + 1e-6)


def test_a_side_lane_launch_starts_after_the_host_issued_it():
    c = toy_cluster(host_seconds_per_op=5e-6)
    world = list(range(4))
    launch = Launch(0, "gather", (gather(world, 0),), "forward",
                    compute_ops=(quantize(1e-6, c), quantize(1e-6, c)))
    p = predict(trace_of([launch, Wait(0)], c, world_size=4), c)
    # Three ops issued (two kernels, one collective: 15 us), then the lane runs its kernels.
    assert p.host_ops == 3
    assert p.seconds == pytest.approx(15e-6 + 2e-6)


def test_gpu_clusters_carry_the_cited_host_cost_and_the_lab_none():
    assert DEFAULT_HOST_SECONDS_PER_OP == 5e-6
    assert all(c.host_seconds_per_op == DEFAULT_HOST_SECONDS_PER_OP for c in CLUSTERS.values())
    assert lab_cluster(1e9, 1e9, 1e8).host_seconds_per_op == 0.0
    with pytest.raises(ValueError, match="host_seconds_per_op"):
        toy_cluster(host_seconds_per_op=-1.0)
