"""A step-time model: seconds per iteration of one rank's trace on a described cluster.

``predict(trace, cluster)`` replays an ``IterationTrace`` (zeropp/simulation/trace.py) with
roofline costs for kernels and alpha-beta costs for collectives, under the CUDA execution
model of zeropp/comm/streams.py: one compute stream, two side lanes ("gather", "reduce"),
each with a completion stream.

[Note: collective cost model]
Notation: a collective's group has n ranks on k nodes, m of them on this rank's node (rank r
is on node r // ranks_per_node; groups are assumed symmetric, as ZeRO's are: every node holds
the same number of the group's ranks). S is the full buffer: the all_gather's output, the
reduce_scatter's and all_reduce's input, the broadcast's output, the all_to_all's input.
Bandwidths are bytes/s, latencies seconds. The model is the alpha-beta (Hockney) model with
NCCL's conventions: nccl-tests' "bus bandwidth" (doc/PERFORMANCE.md: busbw = algbw *
(n-1)/n for all_gather/reduce_scatter, * 2(n-1)/n for all_reduce) and NCCL's own tuning
model (src/graph/tuning.cc, ncclTopoTuneModel: ring latency = (nsteps - nInterSteps) *
intraLat + nInterSteps * interLat, nInterSteps = nNodes - 1 for all_gather/reduce_scatter).

Ring all_gather / reduce_scatter ("ring", NCCL's only algorithm for them):
    t = (n-1)/n * S / B  +  (n-k) * alpha_intra + (k-1) * alpha_inter
  k == 1: B = B_intra (NVLink/NVSwitch per GPU, one direction).
  k > 1:  B = min(B_intra if m > 1, B_nic_node * m / ranks_per_node), B_nic_node = nics *
  bw_per_nic. Why m / ranks_per_node: a ring ordered by node crosses each node boundary once
  per direction (per channel; NCCL spreads its channels over the node's NICs, so one ring
  can use all of them: nccl-tests busbw across DGX nodes approaches the node's NIC total).
  Every rank runs the same collective on its own group (SPMD), so ranks_per_node / m
  disjoint groups cross the same NICs at once and share them. For ZeRO-3's world group
  (m = ranks_per_node) the ring gets the whole node's NICs; for ZeRO++ qgZ's inter-node
  groups (m = 1) each of the node's ranks gets 1/ranks_per_node of them.
  (The brief that asked for this module proposed B = nics * bw_per_nic / m. For the world
  group that is m times below NCCL's measured bus bandwidth, because only one ring edge per
  node crosses the network, so it is not used; the rule above agrees with it when m = 1 and
  ranks_per_node = 1, and in the NIC-count scaling: 4 NICs make the inter-node term 4x
  faster either way.)
all_reduce = reduce_scatter(S) + all_gather(S) for "ring" and "direct" (Rabenseifner; NCCL's
  ring all_reduce is exactly these two passes: 2(n-1) steps, 2(n-1)/n * S bytes per rank).
  "tree" (NCCL's double binary tree, all_reduce only): t = 2 * S / B + 2 * ((m-1) *
  alpha_intra + ceil(log2 k) * alpha_inter) (tuning.cc: tree algbw = busbw / 2, tree latency).
broadcast (pipelined ring/chain): t = S / B + (n-k) * alpha_intra + (k-1) * alpha_inter
  ("tree": latency 2 * ((m-1) * alpha_intra + ceil(log2 k) * alpha_inter)).
all_to_all, and all_gather/reduce_scatter under "direct" (every rank exchanges with every
  peer at once, e.g. gloo or NCCL's grouped send/recv): each rank sends (n-1)/n * S, of
  which (m-1)/n * S stays in the node and (n-m)/n * S crosses it. All ranks_per_node ranks of
  the node do so at once, so each gets B_nic_node / ranks_per_node of the NICs:
    t = max((m-1)/n * S / B_intra, (n-m)/n * S / (B_nic_node / ranks_per_node)) + alpha
  with alpha = alpha_inter if k > 1 else alpha_intra (one round of concurrent messages).
A group of one rank costs nothing.

[Note: replay and link contention]
Events are issued in order. A ComputeOp advances the compute stream by its roofline time
``max(flops / (peak * gemm_fraction), bytes / (hbm * hbm_fraction))`` (ops with flops == 0
are memory-bound by the same formula). A side-lane Launch starts at max(compute stream time
at its issue point, the lane's free time) (the lane first waits for the compute stream, as
CudaExecution does) and runs its ``compute_ops`` (quantize kernels, copies), then its
collectives in order; the lane is free again once it has issued those the launch leaves in
flight (``Launch.in_flight``: a sequence's slow hop; a later collective of the lane on the
same communicator still waits for it), else when all are done. Its
``completion_ops`` (qwZ's dequantize) then run on the lane's completion stream, in order
with the lane's earlier completions, and the launch ends with them. On
GPUs side-lane kernels are not charged against the compute stream's SMs (on CPU ranks they
are: [Note: host-driven transports]). A Wait sets compute = max(compute, launch end); the
gap is the launch's *exposed* time. A Launch on lane "compute" runs in place: all exposed.
Contention rule: the node's NICs are one timeline. Any collective that crosses nodes (k > 1),
from either lane or in place, starts no earlier than the previous cross-node collective
ended, in issue order, and holds the timeline for its whole duration (its intra-node part
included, so this slightly over-serializes). Intra-node traffic of the two lanes is not
contended (NVSwitch is non-blocking; two rings on one GPU's links would share them, which
this ignores). The iteration ends when the compute stream and both lanes are done.

[Note: host-driven transports]
On CPU ranks (the lab) gloo moves every byte through the kernel's TCP stack with the same
cores that run the rank's kernels, so communication is not free even when a side lane hides
its latency: the bytes a rank sends and receives cost ``bytes / host_transport_bandwidth``
seconds of its compute stream, taken where the launch is issued. The rate is measured (TCP
goodput between two lab nodes over an unshaped link, shared by the ranks of a core). The
launch's kernels (qwZ's and qgZ's quantization, the copies around a collective) run on those
same cores, so on such a cluster they are charged to the compute stream there too, not to
the lane. GPUs leave the rate None: NCCL's traffic is driven by NICs and copy engines, and a
side stream's kernels run beside the compute stream's (their SM share is ignored).

[Note: host in the step-time model]
The host issues every kernel and collective in trace order and a GPU cannot start work
before it was issued. Replay keeps a host clock: each op that launches a kernel
(``launches_kernel``: views, allocations and metadata reach no GPU and are free) and each
collective costs ``host_seconds_per_op`` of it; a compute-stream op starts no earlier than
the host clock, a side-lane launch no earlier than the host issued its last op, and a
``HostSync`` stops the host until the compute stream has run everything before it. The time
the compute stream spends waiting for the host is reported (``gpu_waits_for_host_seconds``),
and an iteration whose host issue time exceeds the compute stream's busy time is
host-bound. The default per-op cost is the low end of the 5-20 us CPU-side launch time
that PyTorch's Holistic Trace Analysis documents for CUDA kernels (its "CUDA kernel launch
statistics" feature): eager PyTorch's dispatch plus ``cudaLaunchKernel``. The GPU check
measures it on a lent GPU (scripts/gpu_check.sh), and ``--dry-run-kernel-rates`` takes the
measured figure. CPU ranks (the lab) set it to 0: their kernel rates were measured with
the dispatch included.

[Note: offload in the step-time model]
With ZeRO-Offload ([Note: offload] in zeropp/offload.py) the trace marks the ops that run on
host memory ("host": the offloaded step's copies, norm and Adam update) and the copies across
PCIe ("to_host": each unit's reduced gradients; "to_device": the updated weights, and with
offloaded parameters each gather's shard). Host ops are memory-bound on the CPU: bytes /
(the node's host memory bandwidth / ranks per node x ``memory_fraction``), since every rank
of a node steps at once; they advance the host clock, after what they read has crossed the
bus, so the next op the host issues waits for the step. Each PCIe direction is a timeline of
its own (the link is full duplex): a copy starts after the device work issued before it, the
host's issue, and the previous copy that way; a side-lane gather starts after the weights
brought to the device so far, a ``HostSync`` waits for the gradients sent to the host. A
cluster without host figures (CPU ranks, whose host memory is their device memory) charges
these ops as kernels. The DGX descriptions take host memory bandwidth from their CPUs'
memory channels (theoretical) and PCIe from the generation's x16 rate x 0.8 (an assumption).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

# The GPU check's measured rates (read there, applied by ``with_kernel_rates`` here).
from zeropp.planning.kernel_rates import MeasuredKernelRates
from zeropp.simulation.trace import (
    Collective,
    ComputeOp,
    HostSync,
    IterationTrace,
    Launch,
    Wait,
    launches_kernel,
)

ALGORITHMS = ("ring", "tree", "direct")
# Holistic Trace Analysis (facebookresearch/HolisticTraceAnalysis, docs "CUDA kernel launch
# statistics"): "the launch time on the CPU side is between 5-20 microseconds"; the low end.
DEFAULT_HOST_SECONDS_PER_OP = 5e-6
SIDE_LANES = ("gather", "reduce")


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous GPU (or CPU) cluster; all rates are achievable-peak inputs, SI units."""

    name: str
    peak_flops: float  # FLOP/s of the 16-bit working dtype (fp16/bf16 tensor cores), dense
    peak_flops_fp32: float  # FLOP/s for an fp32 working dtype
    gemm_fraction: float  # achievable fraction of peak for ops with flops > 0
    memory_bandwidth: float  # HBM bytes/s
    memory_fraction: float  # achievable fraction of HBM bandwidth for memory-bound ops
    ranks_per_node: int
    intra_node_bandwidth: float  # bytes/s per GPU, one direction (NVLink/NVSwitch)
    intra_node_latency: float  # seconds per ring step inside a node
    nics_per_node: int
    nic_bandwidth: float  # bytes/s per NIC, one direction
    inter_node_latency: float  # seconds per ring step across nodes
    algorithm: str = "ring"
    # Fraction of the NICs' line rate a collective gets (protocol overheads, imperfect
    # pipelining): a calibration constant, 1.0 where nothing has been calibrated.
    network_efficiency: float = 1.0
    nodes: int | None = None  # None: as many as the trace's world size needs
    # CPU ranks only: bytes/s of a rank's traffic (sent plus received) that its own cores can
    # push through the transport (gloo's TCP stack). Those cores also compute, so the cost is
    # taken from the compute stream; see [Note: host-driven transports]. None on GPUs: NCCL
    # moves data with the NICs and copy engines, not with the cores that run the kernels.
    host_transport_bandwidth: float | None = None
    # Measured bytes/s of particular kernels, keyed by the trace's op name (e.g.
    # "zeropp.quantize_blockwise.default"): they replace the memory roofline for those ops.
    # The lab's CPU ranks run the quantization kernels as chains of pure-torch ops, far from
    # one pass over memory; GPUs leave this empty (the Triton kernels stream at HBM rate).
    kernel_bandwidth: dict[str, float] = field(default_factory=dict)
    # Host seconds to issue one kernel or collective ([Note: host in the step-time model]);
    # 0 for CPU ranks, whose measured kernel rates include it.
    host_seconds_per_op: float = DEFAULT_HOST_SECONDS_PER_OP
    # ZeRO-Offload ([Note: offload in the step-time model]): the node's host memory
    # bandwidth (bytes/s, all sockets, theoretical; the node's ranks share it and get
    # ``memory_fraction`` of it) and one GPU's PCIe link (bytes/s one direction, achievable).
    # None: host memory is the device's (CPU ranks); offloaded work is charged as kernels.
    host_memory_bandwidth: float | None = None
    pcie_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {self.algorithm!r} not in {ALGORITHMS}")
        if self.ranks_per_node < 1 or self.nics_per_node < 1:
            raise ValueError("ranks_per_node and nics_per_node must be at least 1")
        if not self.host_seconds_per_op >= 0:
            raise ValueError(f"host_seconds_per_op must be >= 0, got {self.host_seconds_per_op}")

    @property
    def host_driven(self) -> bool:
        """CPU ranks: the transport and the side lanes' kernels run on the compute cores."""
        return self.host_transport_bandwidth is not None

    @property
    def node_nic_bandwidth(self) -> float:
        """All of one node's NICs together, bytes/s one direction, as collectives get it."""
        return self.nics_per_node * self.nic_bandwidth * self.network_efficiency

    @property
    def offload_modelled(self) -> bool:
        return self.host_memory_bandwidth is not None and self.pcie_bandwidth is not None

    def peak_for(self, dtype_bytes: int) -> float:
        """Peak FLOP/s for the working dtype: 16-bit types use the tensor-core figure."""
        return self.peak_flops if dtype_bytes <= 2 else self.peak_flops_fp32


def _gbit(gbps: float) -> float:
    """Network rates are quoted in decimal Gbit/s; the model works in bytes/s."""
    return gbps * 1e9 / 8


# Achievable fractions are *assumptions*, not datasheet figures: large cuBLAS GEMMs reach
# roughly 70-85% of tensor-core peak and STREAM-like kernels 80-90% of HBM bandwidth on
# V100/A100/H100; calibrate with measured kernels before trusting absolute numbers.
_GEMM_FRACTION = 0.7
_MEMORY_FRACTION = 0.8
# Per-step latencies from NCCL's tuning model (src/graph/tuning.cc, hwLat, Ring/Simple):
# NVLink 3.4 us, network 9.6 us (baseLat's per-call constant is left out).
_NVLINK_LATENCY = 3.4e-6
_NET_LATENCY = 9.6e-6


# PCIe's achievable share of its line rate (TLP and flow-control overhead): an assumption
# (host-to-device copies from pinned memory reach about 12-13 GB/s of Gen3 x16's 15.75).
_PCIE_FRACTION = 0.8


def _pcie(gen: int) -> float:
    """One x16 link, one direction, bytes/s: PCIe 3.0 is 8 GT/s per lane with 128b/130b
    encoding (0.985 GB/s per lane, 15.75 GB/s x16); each later generation doubles it."""
    return 16 * 8e9 * 128 / 130 / 8 * 2 ** (gen - 3) * _PCIE_FRACTION


def _ddr_channels(channels: int, mega_transfers: int) -> float:
    """Theoretical bytes/s of ``channels`` 64-bit DDR channels at ``mega_transfers`` MT/s."""
    return channels * mega_transfers * 1e6 * 8


# [Note: the V100 calibration] (scripts/bench/predict_paper.py): the two constants of the
# DGX-2 descriptions, the least-squares fit of the ZeRO++ paper's 16 TFLOPs figures and the
# tutorial's two step times; every other DGX-2 figure is from a datasheet.
V100_GEMM_FRACTION = 0.37
V100_NETWORK_EFFICIENCY = 0.95


def _dgx2(gbps_per_node: int) -> ClusterSpec:
    # NVIDIA DGX-2 datasheet: 16x Tesla V100 32GB, 2 PFLOPS tensor (= 125 TFLOP/s per GPU,
    # also the V100 datasheet's fp16 tensor-core peak), V100 fp32 15.7 TFLOP/s (SXM2
    # datasheet), HBM2 900 GB/s, NVSwitch 300 GB/s bidirectional per GPU = 150 GB/s each
    # way. The datasheet ships 8x 100 Gb/s InfiniBand; the variants model nodes with fewer
    # of them in use (100, 200, 400, 800 Gb/s per node = 1, 2, 4, 8 NICs of 100 Gb/s), the
    # low-bandwidth settings the ZeRO++ paper targets.
    nics = gbps_per_node // 100
    return ClusterSpec(
        name=f"dgx2_{gbps_per_node}g", peak_flops=125e12, peak_flops_fp32=15.7e12,
        gemm_fraction=V100_GEMM_FRACTION, memory_bandwidth=900e9,
        memory_fraction=_MEMORY_FRACTION, ranks_per_node=16, intra_node_bandwidth=150e9,
        intra_node_latency=_NVLINK_LATENCY, nics_per_node=nics, nic_bandwidth=_gbit(100),
        inter_node_latency=_NET_LATENCY, network_efficiency=V100_NETWORK_EFFICIENCY,
        # DGX-2 datasheet: 2x Xeon Platinum 8168 (6 DDR4-2666 channels each, Intel ARK),
        # 1.5 TB; each V100 on a PCIe 3.0 x16 link through the PCIe switches.
        host_memory_bandwidth=_ddr_channels(2 * 6, 2666), pcie_bandwidth=_pcie(3))


CLUSTERS: dict[str, ClusterSpec] = {
    **{c.name: c for c in (_dgx2(g) for g in (100, 200, 400, 800))},
    # NVIDIA DGX A100 datasheet / A100 datasheet: 8x A100-SXM4-80GB, 312 TFLOP/s bf16 dense,
    # 19.5 TFLOP/s fp32 (non-tensor), 2,039 GB/s HBM2e (~2.0 TB/s), NVLink3 600 GB/s
    # bidirectional = 300 GB/s each way, 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand.
    "dgx_a100": ClusterSpec(
        name="dgx_a100", peak_flops=312e12, peak_flops_fp32=19.5e12,
        gemm_fraction=_GEMM_FRACTION, memory_bandwidth=2.0e12,
        memory_fraction=_MEMORY_FRACTION, ranks_per_node=8, intra_node_bandwidth=300e9,
        intra_node_latency=_NVLINK_LATENCY, nics_per_node=8, nic_bandwidth=_gbit(200),
        inter_node_latency=_NET_LATENCY,
        # 2x AMD EPYC 7742 (8 DDR4-3200 channels each, AMD's product page), 1 TB; A100s on
        # PCIe 4.0 x16.
        host_memory_bandwidth=_ddr_channels(2 * 8, 3200), pcie_bandwidth=_pcie(4)),
    # NVIDIA DGX H100 datasheet / H100 SXM5 datasheet: 8x H100 80GB, 989 TFLOP/s bf16 dense
    # (1,979 with sparsity), 67 TFLOP/s fp32, 3.35 TB/s HBM3, NVLink4 900 GB/s bidirectional
    # = 450 GB/s each way, 8x single-port ConnectX-7 400 Gb/s NDR InfiniBand.
    "dgx_h100": ClusterSpec(
        name="dgx_h100", peak_flops=989e12, peak_flops_fp32=67e12,
        gemm_fraction=_GEMM_FRACTION, memory_bandwidth=3.35e12,
        memory_fraction=_MEMORY_FRACTION, ranks_per_node=8, intra_node_bandwidth=450e9,
        intra_node_latency=_NVLINK_LATENCY, nics_per_node=8, nic_bandwidth=_gbit(400),
        inter_node_latency=_NET_LATENCY,
        # 2x Xeon Platinum 8480C (8 DDR5-4800 channels each, Intel ARK), 2 TB; H100 SXM5 on
        # PCIe 5.0 x16.
        host_memory_bandwidth=_ddr_channels(2 * 8, 4800), pcie_bandwidth=_pcie(5)),
}

# Loopback inside a lab node: docs/lab.md measured 7-18 Gbit/s; the low end is the default.
LAB_LOOPBACK_BITS_PER_SECOND = 7e9


def lab_cluster(compute_flops: float, memory_bandwidth: float, link_bits_per_second: float,
                ranks_per_node: int = 2, nodes: int = 2, *,
                host_transport_bandwidth: float | None = None,
                intra_node_bits_per_second: float = LAB_LOOPBACK_BITS_PER_SECOND,
                intra_node_latency: float = 0.0, inter_node_latency: float = 0.0,
                algorithm: str = "ring",
                kernel_bandwidth: dict[str, float] | None = None) -> ClusterSpec:
    """This machine's CPU lab (docs/lab.md; docs/results.md, "A low-bandwidth cluster").

    ``nodes`` network namespaces of ``ranks_per_node`` CPU ranks; each node has one veth
    shaped by tbf to ``link_bits_per_second`` each way (one "NIC"), ranks of a node talk over
    loopback. All inputs are measured rates (``compute_flops`` and ``memory_bandwidth`` of
    one rank as measured, hence fractions of 1.0 and one peak for every dtype), nothing is
    fitted. The latencies default to 0 because the lab has not measured them.
    """
    return ClusterSpec(
        name=f"lab_{nodes}x{ranks_per_node}_{link_bits_per_second / 1e6:g}mbit",
        peak_flops=compute_flops, peak_flops_fp32=compute_flops, gemm_fraction=1.0,
        memory_bandwidth=memory_bandwidth, memory_fraction=1.0,
        ranks_per_node=ranks_per_node, intra_node_bandwidth=intra_node_bits_per_second / 8,
        intra_node_latency=intra_node_latency, nics_per_node=1,
        nic_bandwidth=link_bits_per_second / 8, inter_node_latency=inter_node_latency,
        algorithm=algorithm, nodes=nodes, host_transport_bandwidth=host_transport_bandwidth,
        kernel_bandwidth=dict(kernel_bandwidth or {}), host_seconds_per_op=0.0)


# -- measured kernel rates -----------------------------------------------------------------

def with_kernel_rates(cluster: ClusterSpec,
                      measured: MeasuredKernelRates | Mapping[str, float]) -> ClusterSpec:
    """``cluster`` with measured kernel rates in ``kernel_bandwidth`` (they replace the
    memory roofline for those ops, see ``compute_seconds``; rates it had stay unless
    measured again) and the measured host cost per op, when the report has one."""
    rates = measured.rates if isinstance(measured, MeasuredKernelRates) else dict(measured)
    host_cost = getattr(measured, "host_seconds_per_op", None) or cluster.host_seconds_per_op
    return dataclasses.replace(cluster, kernel_bandwidth={**cluster.kernel_bandwidth, **rates},
                               host_seconds_per_op=host_cost)


# -- costs ---------------------------------------------------------------------------------

def compute_seconds(op: ComputeOp, cluster: ClusterSpec, dtype_bytes: int = 2) -> float:
    """Roofline: max(flops / (peak * gemm_fraction), bytes / (hbm * memory_fraction)), or
    bytes at the kernel's own measured rate where ``cluster.kernel_bandwidth`` has one."""
    flop_time = op.flops / (cluster.peak_for(dtype_bytes) * cluster.gemm_fraction)
    measured = cluster.kernel_bandwidth.get(op.name)
    if measured is not None:
        return max(flop_time, op.bytes / measured)
    byte_time = op.bytes / (cluster.memory_bandwidth * cluster.memory_fraction)
    return max(flop_time, byte_time)


@dataclass(frozen=True)
class _Shape:
    n: int  # ranks in the group
    k: int  # nodes it spans
    m: int  # its ranks on this rank's node


def _shape(collective: Collective, cluster: ClusterSpec, rank: int) -> _Shape:
    group = collective.group
    if rank not in group:
        raise ValueError(f"rank {rank} is not in {collective.name}'s group {group}")
    nodes = {r // cluster.ranks_per_node for r in group}
    here = rank // cluster.ranks_per_node
    return _Shape(len(group), len(nodes),
                  sum(1 for r in group if r // cluster.ranks_per_node == here))


def _full_bytes(collective: Collective) -> int:
    if collective.name in ("all_gather", "broadcast"):
        return collective.output_bytes
    return collective.input_bytes  # reduce_scatter, all_reduce, all_to_all


def _ring_bandwidth(s: _Shape, cluster: ClusterSpec) -> float:
    """The slowest link a ring crosses (see [Note: collective cost model])."""
    if s.k == 1:
        return cluster.intra_node_bandwidth
    share = cluster.node_nic_bandwidth * s.m / cluster.ranks_per_node
    return min(cluster.intra_node_bandwidth, share) if s.m > 1 else share


def _ring_latency(s: _Shape, cluster: ClusterSpec) -> float:
    # NCCL: (nsteps - nInterSteps) * intraLat + nInterSteps * interLat, per pass.
    return (s.n - s.k) * cluster.intra_node_latency + (s.k - 1) * cluster.inter_node_latency


def _tree_latency(s: _Shape, cluster: ClusterSpec) -> float:
    return 2 * ((s.m - 1) * cluster.intra_node_latency
                + math.ceil(math.log2(s.k)) * cluster.inter_node_latency)


def _direct_seconds(s: _Shape, size: float, cluster: ClusterSpec) -> float:
    intra = (s.m - 1) / s.n * size / cluster.intra_node_bandwidth
    inter = 0.0
    if s.k > 1:
        inter = (s.n - s.m) / s.n * size / (cluster.node_nic_bandwidth / cluster.ranks_per_node)
    alpha = cluster.inter_node_latency if s.k > 1 else cluster.intra_node_latency
    return max(intra, inter) + alpha


def _gather_or_scatter_seconds(s: _Shape, size: float, cluster: ClusterSpec) -> float:
    if cluster.algorithm == "direct":
        return _direct_seconds(s, size, cluster)
    # "tree" has no all_gather/reduce_scatter in NCCL: they stay rings.
    return (s.n - 1) / s.n * size / _ring_bandwidth(s, cluster) + _ring_latency(s, cluster)


def collective_seconds(collective: Collective, cluster: ClusterSpec, rank: int) -> float:
    """Seconds one collective takes for ``rank`` (see [Note: collective cost model])."""
    s = _shape(collective, cluster, rank)
    if s.n == 1:
        return 0.0
    size = float(_full_bytes(collective))
    name = collective.name
    if name in ("all_gather", "reduce_scatter"):
        return _gather_or_scatter_seconds(s, size, cluster)
    if name == "all_reduce":
        if cluster.algorithm == "tree":
            return 2 * size / _ring_bandwidth(s, cluster) + _tree_latency(s, cluster)
        return 2 * _gather_or_scatter_seconds(s, size, cluster)
    if name == "all_to_all":
        return _direct_seconds(s, size, cluster)
    if name == "broadcast":
        latency = (_tree_latency(s, cluster) if cluster.algorithm == "tree"
                   else _ring_latency(s, cluster))
        return size / _ring_bandwidth(s, cluster) + latency
    raise ValueError(f"unknown collective {name!r}")


def host_transport_bytes(collective: Collective, cluster: ClusterSpec, rank: int) -> float:
    """Bytes a rank sends plus receives in ``collective`` (what its cores must move through
    a host-driven transport): 2(n-1)/n of the full buffer for a gather, a scatter or an
    all-to-all, twice that for an all-reduce, the buffer once for a broadcast."""
    s = _shape(collective, cluster, rank)
    if s.n == 1:
        return 0.0
    size = float(_full_bytes(collective))
    if collective.name == "broadcast":
        return size
    moved = 2.0 * (s.n - 1) / s.n * size
    return 2.0 * moved if collective.name == "all_reduce" else moved


def _crosses_nodes(collective: Collective, cluster: ClusterSpec) -> bool:
    return len({r // cluster.ranks_per_node for r in collective.group}) > 1


# -- replay --------------------------------------------------------------------------------

@dataclass
class StepPrediction:
    """What one iteration costs; per-(phase, lane) dicts are keyed ``(phase, lane)``."""

    cluster: str
    seconds: float  # per iteration: the compute stream and every lane done
    tflops_per_gpu: float  # model_flops_per_iteration / seconds / 1e12 (Megatron's basis)
    compute_busy_seconds: float  # sum of the compute stream's kernels
    comm_seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    exposed_comm_seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    lane_compute_seconds: dict[str, float] = field(default_factory=dict)  # side-lane kernels
    host_transport_seconds: float = 0.0  # compute-stream time spent driving the transport
    # [Note: host in the step-time model]
    host_issue_seconds: float = 0.0  # the host's time issuing kernels and collectives
    host_ops: int = 0  # kernels and collectives the host issued
    host_syncs: int = 0
    gpu_waits_for_host_seconds: float = 0.0  # the compute stream idle, waiting to be issued
    # [Note: offload in the step-time model]
    host_step_seconds: float = 0.0  # the host's work on host memory (the offloaded step)
    pcie_seconds: dict[str, float] = field(default_factory=dict)  # "to_host" / "to_device"

    @property
    def host_bound(self) -> bool:
        """The host needs longer to issue the iteration than the compute stream to run it."""
        return self.host_issue_seconds > self.compute_busy_seconds

    @property
    def total_comm_seconds(self) -> float:
        return sum(self.comm_seconds.values())

    @property
    def total_exposed_seconds(self) -> float:
        return sum(self.exposed_comm_seconds.values())


def predict(trace: IterationTrace, cluster: ClusterSpec) -> StepPrediction:
    """Replay ``trace`` on ``cluster`` (see [Note: replay and link contention])."""
    if trace.ranks_per_node != cluster.ranks_per_node:
        # The trace's groups (hpZ's, qgZ's) were built for its own placement.
        raise ValueError(f"trace has {trace.ranks_per_node} ranks per node, cluster "
                         f"{cluster.name} {cluster.ranks_per_node}")
    if cluster.nodes is not None and trace.world_size > cluster.nodes * cluster.ranks_per_node:
        raise ValueError(f"world size {trace.world_size} does not fit {cluster.name}")

    compute = 0.0  # the compute stream's clock
    busy = 0.0
    lane_free = dict.fromkeys(SIDE_LANES, 0.0)
    completion_free: dict[str, float] = {}  # each side lane's completion stream
    # each communicator's end, as (lane, ranks): a lane's collectives share communicators
    communicator_free: dict[tuple[str, tuple[int, ...]], float] = {}
    nic_free = 0.0  # the node's NICs: one timeline (the contention rule)
    ends: dict[int, tuple[float, str, str]] = {}  # launch id -> (end, phase, lane)
    comm: dict[tuple[str, str], float] = {}
    exposed: dict[tuple[str, str], float] = {}
    lane_kernels: dict[str, float] = {}
    host_seconds = 0.0
    host = 0.0  # the host's clock: when it has issued everything so far
    host_cost = cluster.host_seconds_per_op
    host_ops = host_syncs = 0
    gpu_waits = 0.0
    offload = cluster.offload_modelled
    host_step = 0.0
    bus_free = {"to_host": 0.0, "to_device": 0.0}  # each direction of the GPU's PCIe link
    bus_seconds: dict[str, float] = {}

    def issue(ops: int) -> None:
        nonlocal host, host_ops
        host += ops * host_cost
        host_ops += ops

    def compute_start() -> float:
        """The compute stream's next start: not before the host issued the op."""
        nonlocal compute, gpu_waits
        if host > compute:
            gpu_waits += host - compute
            compute = host
        return compute

    def lane_kernel_seconds(lane: str, ops: tuple[ComputeOp, ...]) -> float:
        dt = sum(compute_seconds(op, cluster, trace.dtype_bytes) for op in ops)
        lane_kernels[lane] = lane_kernels.get(lane, 0.0) + dt
        return dt

    def transport_cost(launch: Launch) -> float:
        """Compute-stream seconds a host-driven rank spends moving ``launch``'s bytes."""
        if not cluster.host_driven:
            return 0.0
        moved = sum(host_transport_bytes(c, cluster, trace.rank) for c in launch.collectives)
        return moved / cluster.host_transport_bandwidth

    def run_launch(launch: Launch, start: float) -> tuple[float, float]:
        """(when the launch's lane is free again, when the launch is done)."""
        nonlocal nic_free
        t = start
        if not cluster.host_driven:  # a GPU's side stream runs its own kernels first
            t += lane_kernel_seconds(launch.lane, launch.compute_ops)
        key = (launch.phase, launch.lane)
        held = len(launch.collectives) - launch.in_flight
        lane_end = None
        for i, c in enumerate(launch.collectives):
            if i == held:
                lane_end = t  # the lane issues the rest and moves on
            dt = collective_seconds(c, cluster, trace.rank)
            # one communicator runs its collectives in order, one left in flight included
            t = max(t, communicator_free.get((launch.lane, c.group), 0.0))
            if _crosses_nodes(c, cluster):
                t = max(t, nic_free)
                nic_free = t + dt
            t += dt
            communicator_free[(launch.lane, c.group)] = t
            comm[key] = comm.get(key, 0.0) + dt
        lane_end = t if lane_end is None else lane_end
        if launch.completion_ops and not cluster.host_driven:  # on the completion stream
            t = max(t, completion_free.get(launch.lane, 0.0))
            t += lane_kernel_seconds(launch.lane, launch.completion_ops)
            completion_free[launch.lane] = t
        return lane_end, t

    if offload:  # every rank of the node steps at once: its share of the host's bandwidth
        host_share = (cluster.host_memory_bandwidth / cluster.ranks_per_node
                      * cluster.memory_fraction)

    def host_work(op: ComputeOp) -> None:
        """The host runs ``op`` on host memory once what it reads has crossed the bus."""
        nonlocal host, host_step
        dt = op.bytes / host_share
        host = max(host, bus_free["to_host"]) + dt
        host_step += dt

    def bus_copy(op: ComputeOp) -> None:
        """A copy across PCIe, after the device work before it and the host's issue."""
        issue(1)
        dt = op.bytes / cluster.pcie_bandwidth
        start = max(compute, host, bus_free[op.where])
        bus_free[op.where] = start + dt
        bus_seconds[op.where] = bus_seconds.get(op.where, 0.0) + dt

    for event in trace.events:
        if isinstance(event, ComputeOp) and offload and event.where == "host":
            host_work(event)
        elif isinstance(event, ComputeOp) and offload and event.where != "device":
            bus_copy(event)
        elif isinstance(event, ComputeOp):
            if launches_kernel(event):
                issue(1)
                compute_start()
            dt = compute_seconds(event, cluster, trace.dtype_bytes)
            compute += dt
            busy += dt
        elif isinstance(event, Launch):
            issue(len(event.collectives)
                  + sum(map(launches_kernel, event.compute_ops + event.completion_ops)))
            # A host-driven rank moves the bytes and runs the lane's kernels on its own
            # cores: the compute stream pays for both where the launch is issued.
            dt = transport_cost(event)
            host_seconds += dt
            if cluster.host_driven:
                dt += lane_kernel_seconds(event.lane, event.compute_ops + event.completion_ops)
            compute += dt
            busy += dt
            if event.lane == "compute":
                start = compute_start()
                end = run_launch(event, start)[1]
                key = (event.phase, event.lane)
                exposed[key] = exposed.get(key, 0.0) + (end - start)
                compute = end
            elif event.lane in lane_free:
                # (a gather of offloaded weights reads what the bus brought to the device)
                lane_free[event.lane], end = run_launch(
                    event, max(compute, lane_free[event.lane], host, bus_free["to_device"]))
            else:
                raise ValueError(f"unknown lane {event.lane!r}")
            if event.id in ends:
                raise ValueError(f"launch id {event.id} issued twice")
            ends[event.id] = (end, event.phase, event.lane)
        elif isinstance(event, Wait):
            if event.launch_id not in ends:
                raise ValueError(f"wait for launch {event.launch_id} before it was issued")
            end, phase, lane = ends[event.launch_id]
            if end > compute:
                key = (phase, lane)
                exposed[key] = exposed.get(key, 0.0) + (end - compute)
                compute = end
        elif isinstance(event, HostSync):
            host = max(host, compute, bus_free["to_host"])
            host_syncs += 1
        else:
            raise TypeError(f"unknown trace event {event!r}")

    seconds = max(compute, host, *lane_free.values(), *bus_free.values(),
                  *(end for end, _, _ in ends.values()))
    tflops = trace.model_flops_per_iteration / seconds / 1e12 if seconds > 0 else 0.0
    return StepPrediction(cluster=cluster.name, seconds=seconds, tflops_per_gpu=tflops,
                          compute_busy_seconds=busy, comm_seconds=comm,
                          exposed_comm_seconds=exposed, lane_compute_seconds=lane_kernels,
                          host_transport_seconds=host_seconds,
                          host_issue_seconds=host_ops * host_cost, host_ops=host_ops,
                          host_syncs=host_syncs, gpu_waits_for_host_seconds=gpu_waits,
                          host_step_seconds=host_step, pcie_seconds=bus_seconds)
