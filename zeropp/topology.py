"""Where each rank sits: nodes, local ranks, and the process groups ZeRO++ needs.

Ranks are laid out node-major, as every launcher does: global rank r lives on node
``r // ranks_per_node`` with local index ``r % ranks_per_node``. On one machine,
``--ranks-per-node 2`` with 4 processes simulates 2 nodes; every algorithm then behaves as it
would across real nodes, because all of them take their groups from here and nothing else.

Groups, built once (``dist.new_group`` must be called by every rank in the same order):

- ``world``: all ranks; ZeRO-3 shards parameters, gradients and optimizer state over it.
- ``intra_node``: the ranks of this rank's node (qgZ's first all-to-all).
- ``inter_node``: the ranks that share this rank's local index, one per node (qgZ's second
  all-to-all).
- ``hpz``: ``hpz_size`` consecutive ranks inside a node that hold hpZ secondary shards
  together (the backward all-gather runs in it).
- ``weight_inter``: the inter-node groups again, built only for weight deltas (their
  forward gather, [Note: weight deltas]), so the gather and reduce lanes never share one.
- ``reduce_world``: all ranks again, for the gradient reductions. NCCL runs one stream per
  communicator, so gathers and reductions on one world group would queue behind each other
  (the reduce-scatter of unit k waiting for the gather of unit k+1) where the engine means
  them to overlap, as the step-time model times them.

[Note: eager communicators] NCCL creates a communicator at its first collective unless the
group was made with a device (``device_id``). First uses from two side streams at once can
deadlock, and the time they take lands in iteration 1. So ``warm_up`` runs one small
all-reduce on every group this rank belongs to, in the order above on every rank, from the
training thread, before the engine is returned; the simulated cluster reports a
communicator first used after that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class TopologyError(ValueError):
    """A node layout that cannot work (one-line message)."""


def resolve_ranks_per_node(explicit: int | None, world_size: int) -> int:
    """Ranks per node: ``--ranks-per-node`` when given, else what the launcher says.

    torchrun exports LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE; with neither, each
    rank is treated as its own node (the conservative choice: every group spans nodes).
    """
    source = "--ranks-per-node"
    value = explicit
    if value is None:
        for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            if os.environ.get(var):
                source, value = var, int(os.environ[var])
                break
    if value is None:
        return 1
    if value < 1:
        raise TopologyError(f"{source}={value}: ranks per node must be at least 1")
    if world_size % value != 0:
        raise TopologyError(
            f"{source}={value} does not divide the world size {world_size}: "
            "every node must hold the same number of ranks"
        )
    return value


@dataclass(frozen=True)
class ClusterShape:
    """The one description of a cluster's shape: ``world_size`` ranks, ``ranks_per_node``
    on each node. ``Topology`` (a rank's place in a running job) and the dry run's planned
    cluster (plus a memory budget) extend it."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.world_size % self.ranks_per_node:
            raise TopologyError(f"ranks per node {self.ranks_per_node} does not divide the world "
                                f"size {self.world_size}: every node must hold the same number")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def spans_nodes(self) -> bool:
        """Whether a group of the whole world crosses a node boundary."""
        return self.num_nodes > 1


@dataclass(frozen=True, kw_only=True)
class Topology(ClusterShape):
    """This rank's place in the cluster and the process groups built for it."""

    rank: int
    hpz_size: int = 1
    # Process groups; None means the default (world) group. Not part of equality.
    intra_node_group: object = field(default=None, compare=False, repr=False)
    inter_node_group: object = field(default=None, compare=False, repr=False)
    hpz_group: object = field(default=None, compare=False, repr=False)
    # The inter-node group again, for the weight-delta gather ([Note: weight deltas]): a
    # communicator of its own, so the gather lane never shares one with qgZ's reduce lane.
    weight_inter_group: object = field(default=None, compare=False, repr=False)
    # All ranks, for the reductions: a communicator apart from the gathers' world group.
    reduce_world_group: object = field(default=None, compare=False, repr=False)

    def groups(self) -> list[object]:
        """Every process group this rank belongs to, in creation order (the default group
        first): what ``warm_up`` initializes."""
        built = [self.intra_node_group, self.inter_node_group, self.hpz_group,
                 self.weight_inter_group, self.reduce_world_group]
        return [dist.group.WORLD, *(g for g in built if g is not None)]

    def warm_up(self, device) -> None:
        """[Note: eager communicators] One small all-reduce on each of this rank's groups."""
        for group in self.groups():
            dist.all_reduce(torch.zeros(1, device=device), group=group)

    @classmethod
    def planned(cls, shape: ClusterShape, hpz_size: int = 1) -> Topology:
        """Rank 0 of a cluster that is not running: no process groups, for planning."""
        return cls(world_size=shape.world_size, ranks_per_node=shape.ranks_per_node,
                   rank=0, hpz_size=hpz_size)

    @property
    def node_index(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def hpz_rank(self) -> int:
        """Index of this rank inside its hpZ group."""
        return self.rank % self.hpz_size

    def describe(self) -> str:
        return (
            f"{self.world_size} ranks = {self.num_nodes} node(s) x {self.ranks_per_node}, "
            f"hpZ group size {self.hpz_size}"
        )

    def as_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "num_nodes": self.num_nodes,
            "hpz_size": self.hpz_size,
        }


def node_ranks(node: int, ranks_per_node: int) -> list[int]:
    return list(range(node * ranks_per_node, (node + 1) * ranks_per_node))


def build_topology(ranks_per_node: int | None = None, hpz_size: int = 1,
                   weight_deltas: bool = False) -> Topology:
    """Build the topology and its process groups. Collective: every rank must call it.
    ``weight_deltas`` adds the weight-delta gather's inter-node group."""
    if not dist.is_initialized():
        raise TopologyError("torch.distributed is not initialized; call zeropp.init_distributed()")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_node = resolve_ranks_per_node(ranks_per_node, world_size)
    if hpz_size < 1:
        raise TopologyError(f"zero_hpz_partition_size={hpz_size} must be at least 1")
    if per_node % hpz_size != 0:
        raise TopologyError(
            f"zero_hpz_partition_size={hpz_size} must divide the ranks per node ({per_node}): "
            "hpZ groups live inside one node"
        )
    num_nodes = world_size // per_node

    intra = inter = hpz = None
    # new_group is collective over the world: create every group on every rank, keep ours.
    for node in range(num_nodes):
        group = dist.new_group(node_ranks(node, per_node))
        if node == rank // per_node:
            intra = group
    for local in range(per_node):
        group = dist.new_group([node * per_node + local for node in range(num_nodes)])
        if local == rank % per_node:
            inter = group
    for start in range(0, world_size, hpz_size):
        group = dist.new_group(list(range(start, start + hpz_size)))
        if start <= rank < start + hpz_size:
            hpz = group
    weight_inter = None
    for local in range(per_node if weight_deltas else 0):
        group = dist.new_group([node * per_node + local for node in range(num_nodes)])
        if local == rank % per_node:
            weight_inter = group
    reduce_world = dist.new_group(list(range(world_size)))
    return Topology(world_size=world_size, ranks_per_node=per_node, rank=rank, hpz_size=hpz_size,
                    intra_node_group=intra, inter_node_group=inter, hpz_group=hpz,
                    weight_inter_group=weight_inter, reduce_world_group=reduce_world)
