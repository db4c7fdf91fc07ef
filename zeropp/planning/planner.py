"""Per-rank memory and communication of one training iteration, computed without running it.

The planner answers "does this model fit, and how many bytes cross the nodes?" for any
cluster from the per-unit parameter counts alone: no process group, no device, no tensor.
It asks the engine's own objects for every rule, so its figures are the ones a real run
measures:

- Units and padding come from ``FlatLayout.build`` with the engine's alignment
  (``zeropp.residency.shard_alignment`` of the residency policy and the collectives).
- Units with fewer elements than ``stage3_param_persistence_threshold`` stay gathered
  (``zeropp.residency.stays_gathered``): gathered once per optimizer step, after the
  update, and never in backward.
- Bytes are the ``bytes_sent`` of the collectives the engine would run
  (``zeropp.comm.registry.collectives_for``), one reduction per unit as the engine issues
  them ([Note: one reduction per unit]).

[Note: what one iteration sends, per rank]
With m micro-batches per optimizer step, for every unit of S = padded / N elements per shard:
  forward   m x gather(S) over the world (qwZ: the int8 payload of S values), except
            persistent units: one gather per step, after the update;
  backward  m x the same world gather, except the root (it stays gathered from forward to
            backward) and persistent units; with hpZ instead m x (padded / hpz) x (hpz - 1)
            elements in the compute dtype, inside the node;
  gradients m x reduce-scatter of the unit, padded x (N - 1) / N in the compute
            dtype; with qgZ one intra-node all-to-all of its int4 payload
            (x (alpha - 1) / alpha) and one inter-node all-to-all of n slices (x (n - 1) / n);
  optimizer one fp32 all-reduce of the squared gradient norm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeropp.comm.accounting import LOCALITIES, PHASES, all_reduce_bytes, locality
from zeropp.comm.collectives import CommGroup, all_gather
from zeropp.comm.registry import Collectives, collectives_for
from zeropp.config import ZeroConfig
from zeropp.deepspeed_api.initialize import gradient_shard_dtype, options_from_config
from zeropp.flat_layout import FlatLayout
from zeropp.prefetch import PlannedUnit, blocks_kept_for_backward, units_to_prefetch
from zeropp.residency import Residency, shard_alignment, stays_gathered
from zeropp.sharded_model import ShardingOptions
from zeropp.topology import ClusterShape, Topology, TopologyError
from zeropp.unit_modules import default_unit_modules, unit_parameters

FP32_BYTES = 4
_DTYPES = {2: torch.float16, 4: torch.float32}  # bytes per working element -> a dtype that wide
CommVolume = dict[str, dict[str, int]]  # {phase: {locality: bytes}}, as CommStats.snapshot()


@dataclass(frozen=True)
class UnitPlan:
    """One unit of sharding as the engine lays it out on this cluster."""

    numel: int  # real parameters
    padded_numel: int  # flat buffer length, a multiple of world size x alignment
    shard_numel: int  # this rank's share
    is_root: bool  # embeddings and final norm: gathered from forward through backward
    persistent: bool  # below the persistence threshold: never released


@dataclass(frozen=True)
class MemoryPlan:
    """Peak bytes one rank holds, by kind; the first six are ``ZeroEngine.memory_breakdown``'s.

    [Note: phases of the peak] Model states and hpZ secondary shards are resident; the rest
    peaks at different times. The end of forward holds the forward's gathered units and the
    logits; the backward holds its gathered units, the gradient buffers and the recompute.
    ``peak`` takes the larger phase instead of adding every transient as if they coincided
    (which overstated the simulated GPU cluster's measurement by 18% for a 1.3B model).
    """

    working_shards: int  # this rank's 16-bit (or fp32) weights
    gradient_shards: int  # one per unit, 16-bit with one micro-batch per step, else fp32
    fp32_master_shards: int
    optimizer_moments: int  # Adam's two fp32 moments
    hpz_secondary_shards: int  # every block's 1/hpz copy, alive between forward and backward
    gathered_parameters: int  # peak of whole units gathered at once (root and prefetch included)
    gradient_buffers: int  # transient: unit gradient buffers held, filling and in flight
    gathered_forward: int  # the peak of gathered units during forward alone
    # qgZ error feedback: int8 errors of every bucket this rank sends (resident)
    error_feedback: int = 0
    # The largest call's own buffers on the gather stream plus the reduce stream's: CUDA's
    # caching allocator keeps each stream's pool beside the compute stream's ([Note:
    # allocation lanes]), so they add to what it reserves, not to what is allocated at once.
    stream_buffers: int = 0
    # ZeRO-Offload ([Note: offload]): the optimizer's states and the gradient shards, and
    # with ``offload_params`` the working shards, live in host memory, not in the peak.
    offload_optimizer: bool = False
    offload_params: bool = False

    @property
    def model_states(self) -> int:
        """What ZeRO partitions: weights, gradients and optimizer state (device and host)."""
        return (self.working_shards + self.gradient_shards + self.fp32_master_shards
                + self.optimizer_moments)

    @property
    def device_model_states(self) -> int:
        """The model states left in device memory."""
        return self.model_states - self.host_model_states

    @property
    def host_model_states(self) -> int:
        kept = 0
        if self.offload_optimizer:
            kept += self.gradient_shards + self.fp32_master_shards + self.optimizer_moments
        if self.offload_params:
            kept += self.working_shards
        return kept

    @property
    def host_bytes(self) -> int:
        """Host memory per rank: the offloaded states, and with the optimizer the step's fp32
        gradients and the squares its norm sums (each the size of the fp32 masters)."""
        step = 2 * self.fp32_master_shards if self.offload_optimizer else 0
        return self.host_model_states + step

    def peak(self, forward_activations: int, backward_activations: int) -> int:
        """Peak device bytes with the activations alive at the end of forward and in backward."""
        forward = self.gathered_forward + forward_activations
        backward = self.gathered_parameters + self.gradient_buffers + backward_activations
        resident = self.device_model_states + self.hpz_secondary_shards + self.error_feedback
        return resident + max(forward, backward)

    def reserved(self, forward_activations: int, backward_activations: int) -> int:
        """What the caching allocator holds at the peak: the peak and the side streams' pools."""
        return self.peak(forward_activations, backward_activations) + self.stream_buffers

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SystemPlan:
    """Memory and communication of one configuration (ZeRO-3, or ZeRO++) on one cluster."""

    name: str
    zero: ZeroConfig
    cluster: ClusterShape
    units: tuple[UnitPlan, ...]
    memory: MemoryPlan
    comm: CommVolume  # bytes sent per rank per iteration (all micro-batches of one step)
    pcie: dict[str, int] = dataclasses.field(default_factory=dict)  # plan_pcie's

    def comm_total(self, locality: str) -> int:
        if locality not in LOCALITIES:
            raise ValueError(f"unknown locality {locality!r}; expected one of {LOCALITIES}")
        return sum(by_locality[locality] for by_locality in self.comm.values())


# ---- units ------------------------------------------------------------------------------


def unit_parameter_counts(model: nn.Module, unit_modules: list[nn.Module] | None = None,
                          zero: ZeroConfig | None = None) -> list[int]:
    """Parameters per unit, root first, grouped exactly as ``ShardedModel`` groups them
    ([Note: units]): blocks split below themselves as ``zero`` (None: the engine's
    defaults) makes the engine split them, unless ``unit_modules`` names the units.

    Works on a meta-device model. A parameter shared by several modules counts once, in the
    first unit that owns it; whatever no block owns (embeddings, final norm) is the root.
    """
    if unit_modules is None:
        options = options_from_config(zero)[0] if zero is not None else ShardingOptions()
        unit_modules = default_unit_modules(model, options.max_unit_numel,
                                            options.persistence_threshold)
    return [sum(p.numel() for p in params)
            for _module, params in unit_parameters(model, unit_modules)]


def engine_objects(zero: ZeroConfig, cluster: ClusterShape) -> tuple[Residency, Collectives]:
    """The residency policy and the collectives the engine would build for ``zero`` on
    ``cluster`` (rank 0 of it, without process groups): the planner asks them its rules."""
    _, quant = options_from_config(dataclasses.replace(zero, stage=3))
    residency = Residency.for_stage(3, quant.hpz_size)
    topology = Topology.planned(cluster, quant.hpz_size)
    return residency, collectives_for(3, quant, topology)


def plan_units(unit_numels: Sequence[int], cluster: ClusterShape,
               zero: ZeroConfig) -> list[UnitPlan]:
    """Padded sizes and persistence of each unit; ``unit_numels[0]`` is the root."""
    if not unit_numels:
        raise ValueError("unit_numels is empty: give the root unit's count, then each block's")
    residency, collectives = engine_objects(zero, cluster)
    align = shard_alignment(residency, collectives.alignment)
    units = []
    for index, numel in enumerate(unit_numels):
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"unit_numels[{index}] must be a non-negative integer, got {numel!r}")
        layout = FlatLayout.build([(f"unit{index}", (numel,))], cluster.world_size, align)
        persistent = stays_gathered(numel, zero.stage3_param_persistence_threshold)
        units.append(UnitPlan(numel, layout.padded_numel, layout.shard_numel, index == 0,
                              persistent))
    return units


def _check_hpz(zero: ZeroConfig, cluster: ClusterShape) -> None:
    hpz = zero.zero_hpz_partition_size
    if cluster.ranks_per_node % hpz:
        raise TopologyError(f"zero_hpz_partition_size={hpz} must divide the ranks per node "
                            f"({cluster.ranks_per_node}): hpZ groups live inside one node")


# ---- memory -----------------------------------------------------------------------------


def kept_for_backward(units: Sequence[UnitPlan], zero: ZeroConfig) -> set[int]:
    """ids of the units that stay gathered from forward to backward (the engine's rule)."""
    blocks = list(units[1:])
    kept = blocks_kept_for_backward([u.padded_numel for u in blocks], units[0].padded_numel,
                                    zero.stage3_max_reuse_distance)
    return {id(blocks[index]) for index in kept if not blocks[index].persistent}


def peak_gathered_numel(units: Sequence[UnitPlan], zero: ZeroConfig, backward: bool) -> int:
    """Largest gathered set while blocks run in order, replaying the engine's prefetch rule.

    The root and persistent units are always gathered. At each block (and, in forward, at
    the root before the first block) the engine prefetches the following blocks while they
    fit the prefetch rule (``zeropp.prefetch``). In backward, the block after
    the current one (in forward order) may still be gathered until its last gradient lands,
    so it is counted too: an upper estimate.
    """
    always = sum(u.padded_numel for u in units if u.is_root or u.persistent)
    released = [u for u in units if not (u.is_root or u.persistent)]
    kept_units = kept_for_backward(units, zero)
    blocks = [u.padded_numel for u in released]
    kept = {i for i, u in enumerate(released) if id(u) in kept_units}
    if backward:
        blocks.reverse()
        kept = {len(blocks) - 1 - i for i in kept}
    in_flight: set[int] = set()
    peak = always
    # Position -1 is the root's forward, which prefetches the first blocks.
    for index in range(0 if backward else -1, len(blocks)):
        in_flight.discard(index)
        current = blocks[index] if index >= 0 else 0
        finishing = blocks[index - 1] if backward and index > 0 else 0
        # Blocks kept from forward to backward: behind the current one in forward, ahead of
        # it in backward, and never prefetched (they are gathered already).
        held = [j for j in kept if (j > index if backward else j < index)]
        live = (always + current + finishing + sum(blocks[j] for j in in_flight)
                + sum(blocks[j] for j in held))
        upcoming = [j for j in range(index + 1, len(blocks)) if not (backward and j in kept)]
        chosen = units_to_prefetch(
            [PlannedUnit(blocks[c], c in in_flight) for c in upcoming], live,
            zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters,
        )
        for position in chosen:
            in_flight.add(upcoming[position])
            live += blocks[upcoming[position]]
        peak = max(peak, live)
    return peak


def hpz_secondary_nbytes(units: Sequence[UnitPlan], secondaries: Sequence[UnitPlan],
                         hpz: int, dtype: torch.dtype, collectives: Collectives) -> int:
    """Secondary shards at the backward's peak: every unit's kept base with weight deltas,
    else those of the units released between forward and backward."""
    bases = [collectives.kept_bases_nbytes(u.padded_numel, dtype) for u in units]
    if all(nbytes is not None for nbytes in bases):
        return sum(bases)
    group = CommGroup(None, hpz, 0, False)
    return sum(collectives.secondary_nbytes(u.padded_numel // hpz, dtype, group)
               for u in secondaries)


def plan_memory(units: Sequence[UnitPlan], zero: ZeroConfig, dtype_bytes: int,
                collectives: Collectives, micro_batches: int = 1) -> MemoryPlan:
    """Peak per-rank bytes of model states and of the engine's gathered buffers."""
    shard_numel = sum(u.shard_numel for u in units)
    hpz = zero.zero_hpz_partition_size
    # Blocks keep their secondary shard from their forward to their backward; the root, the
    # blocks reused soon and persistent units are not released in between, so keep none.
    kept = kept_for_backward(units, zero)  # gathered from forward to backward: no secondary
    secondaries = [u for u in units
                   if hpz > 1 and not (u.is_root or u.persistent or id(u) in kept)]
    forward_gathered = peak_gathered_numel(units, zero, backward=False)
    gathered_numel = max(forward_gathered, peak_gathered_numel(units, zero, backward=True))
    # The root's gradients exist through the whole backward (the tied head produces them
    # first). A unit's gradients accumulate in its flat buffer ([Note: gradient buffer]),
    # plus the one autograd is producing (at most half the unit, counted as such); buffers
    # in flight and filling fit ``max_inflight_reductions`` + 1 of the largest unit's
    # ([Note: reductions in flight]).
    root = units[0].padded_numel
    largest_unit = max((u.padded_numel for u in units[1:]), default=0)
    in_flight = ShardingOptions().max_inflight_reductions
    gradient_numel = root + (in_flight + 1) * largest_unit + largest_unit // 2
    return MemoryPlan(
        working_shards=shard_numel * dtype_bytes,
        gradient_shards=shard_numel * gradient_shard_dtype(_DTYPES[dtype_bytes],
                                                           micro_batches).itemsize,
        fp32_master_shards=shard_numel * FP32_BYTES,
        optimizer_moments=2 * shard_numel * FP32_BYTES,
        hpz_secondary_shards=hpz_secondary_nbytes(units, secondaries, hpz,
                                                  _DTYPES[dtype_bytes], collectives),
        gathered_parameters=gathered_numel * dtype_bytes,
        gradient_buffers=gradient_numel * dtype_bytes,
        gathered_forward=forward_gathered * dtype_bytes,
        error_feedback=sum(collectives.error_feedback_nbytes(u.padded_numel) for u in units),
        stream_buffers=stream_buffer_nbytes(units, hpz, _DTYPES[dtype_bytes], collectives),
        offload_optimizer=zero.offloads_optimizer,
        offload_params=zero.offloads_params,
    )


def stream_buffer_nbytes(units: Sequence[UnitPlan], hpz: int, dtype: torch.dtype,
                         collectives: Collectives) -> int:
    """The largest single call's buffers on the gather stream (forward gather, or hpZ's
    backward one) plus on the reduce stream: each stream reuses its pool call after call.
    (qwZ's received payloads and qgZ's last hop live until their unit's wait, [Note:
    completion steps], so the calls in flight at once hold theirs together; at the 18B the
    plan, which adds every transient as if simultaneous, stays above the measured reserve:
    9.40 against 9.16 GiB.)"""
    world_size = units[0].padded_numel // units[0].shard_numel
    world = CommGroup(None, world_size, 0, False)
    node = CommGroup(None, hpz, 0, False)
    gather = max(max(collectives.gather.stream_buffer_nbytes(u.shard_numel, dtype, world),
                     collectives.secondary_gather.stream_buffer_nbytes(
                         u.padded_numel // hpz, dtype, node) if hpz > 1 else 0)
                 for u in units)
    reduce = max(collectives.reduce.stream_buffer_nbytes(u.shard_numel, dtype, world)
                 for u in units)
    return gather + reduce


# ---- communication ----------------------------------------------------------------------


class _Volume:
    def __init__(self) -> None:
        self.bytes: CommVolume = {phase: dict.fromkeys(LOCALITIES, 0) for phase in PHASES}

    def add(self, phase: str, sent: dict[str, int], times: int = 1) -> None:
        for where, nbytes in sent.items():
            self.bytes[phase][where] += nbytes * times


def world_gathers_per_step(unit: UnitPlan, kept: set[int], hpz: int, micro_batches: int) -> int:
    """How often a unit's shard is read by a gather over the world in one optimizer step:
    persistent units once, after the update ([Note: persistent units]); the others in each
    micro-batch's forward, and again in its backward unless the unit stays gathered until
    then (the root, blocks reused soon) or hpZ gathers it inside the node."""
    if unit.persistent:
        return 1
    regathered = not (unit.is_root or id(unit) in kept or hpz > 1)
    return micro_batches * (2 if regathered else 1)


def plan_communication(units: Sequence[UnitPlan], cluster: ClusterShape, zero: ZeroConfig,
                       dtype_bytes: int, micro_batches: int) -> CommVolume:
    """Bytes this rank sends in one optimizer step of ``micro_batches`` micro-batches, as the
    engine's own collectives count them (``bytes_sent``)."""
    volume = _Volume()
    residency, collectives = engine_objects(zero, cluster)
    dtype = _DTYPES[dtype_bytes]
    world = CommGroup(None, cluster.world_size, 0, cluster.spans_nodes)
    hpz = residency.secondary_group_size
    secondary = CommGroup(None, hpz, 0, False)
    kept = kept_for_backward(units, zero)
    for unit in units:
        def world_gathers(calls: int, unit=unit) -> dict[str, int]:
            return collectives.gather.step_bytes(unit.shard_numel, dtype, world, calls)

        if unit.persistent and not unit.is_root:
            # Re-gathered once, when the update refreshes it, exactly ([Note: persistent
            # units]): 16-bit values, whatever the other units' gather sends.
            volume.add("forward_all_gather", all_gather.bytes_sent(unit.shard_numel, dtype, world))
        elif unit.persistent:
            volume.add("forward_all_gather", world_gathers(1))
        else:
            volume.add("forward_all_gather", world_gathers(micro_batches))
            if unit.is_root or id(unit) in kept:  # gathered still when backward needs it
                pass
            elif hpz > 1:
                volume.add("backward_all_gather", collectives.secondary_gather.bytes_sent(
                    unit.padded_numel // hpz, dtype, secondary), micro_batches)
            else:
                volume.add("backward_all_gather", world_gathers(micro_batches))
        volume.add("gradient_reduce", collectives.reduce.bytes_sent(unit.shard_numel, dtype, world),
                   micro_batches)
    volume.add("optimizer", {locality(cluster.spans_nodes):
                             all_reduce_bytes(FP32_BYTES, cluster.world_size)})
    return volume.bytes


def plan_pcie(units: Sequence[UnitPlan], zero: ZeroConfig, dtype_bytes: int,
              micro_batches: int) -> dict[str, int]:
    """Bytes one GPU moves over PCIe per iteration with ZeRO-Offload ([Note: offload]):
    "to_host", each micro-batch's reduced gradient shards (in the gradient shards' dtype,
    ``GradientDelivery``); "to_device", the updated 16-bit weights once per step, or with offloaded
    parameters each world gather's shard instead (hpZ's backward gathers read the device's
    secondary shards)."""
    to_host = to_device = 0
    if zero.offloads_optimizer:
        shard_dtype = gradient_shard_dtype(_DTYPES[dtype_bytes], micro_batches)
        to_host = micro_batches * sum(u.shard_numel for u in units) * shard_dtype.itemsize
        if not zero.offloads_params:
            to_device = sum(u.shard_numel for u in units) * dtype_bytes
    if zero.offloads_params:
        kept = kept_for_backward(units, zero)
        to_device += sum(world_gathers_per_step(unit, kept, zero.zero_hpz_partition_size,
                                                micro_batches) * unit.shard_numel
                         for unit in units) * dtype_bytes
    return {"to_host": to_host, "to_device": to_device}


# ---- whole plans ------------------------------------------------------------------------


def plan_system(name: str, unit_numels: Sequence[int], cluster: ClusterShape, zero: ZeroConfig,
                dtype_bytes: int, micro_batches: int = 1) -> SystemPlan:
    """Memory and communication of ``zero`` (read as stage 3) for these units on ``cluster``."""
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes must be 2 (fp16/bf16) or 4 (fp32), got {dtype_bytes!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    _check_hpz(zero, cluster)
    units = plan_units(unit_numels, cluster, zero)
    return SystemPlan(
        name=name,
        zero=zero,
        cluster=cluster,
        units=tuple(units),
        memory=plan_memory(units, zero, dtype_bytes, engine_objects(zero, cluster)[1],
                           micro_batches),
        comm=plan_communication(units, cluster, zero, dtype_bytes, micro_batches),
        pcie=plan_pcie(units, zero, dtype_bytes, micro_batches),
    )


def zero3_baseline(zero: ZeroConfig) -> ZeroConfig:
    """The same config with qwZ, hpZ, qgZ and weight deltas off: the ZeRO-3 run ZeRO++ is
    compared with."""
    return dataclasses.replace(
        zero, stage=3, zero_quantized_weights=False, zero_hpz_partition_size=1,
        zero_quantized_gradients=False, zero_quantized_gradients_error_feedback=False,
        zeropp_loco_param=None, zero_quantized_weight_deltas=False,
        zero_quantized_gradients_inter_node_bits=None)


def plan_zero3_and_zeropp(unit_numels: Sequence[int], world_size: int, ranks_per_node: int,
                          zero: ZeroConfig, dtype_bytes: int,
                          micro_batches: int = 1) -> tuple[SystemPlan, SystemPlan]:
    """(ZeRO-3 baseline, the configured ZeRO++) for the same model, cluster and batch."""
    cluster = ClusterShape(world_size, ranks_per_node)
    configured = dataclasses.replace(zero, stage=3)
    return (
        plan_system("ZeRO-3", unit_numels, cluster, zero3_baseline(zero), dtype_bytes,
                    micro_batches),
        plan_system("ZeRO++", unit_numels, cluster, configured, dtype_bytes, micro_batches),
    )
