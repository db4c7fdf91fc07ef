"""Where the working weights, the gradients and the optimizer state live: ZeRO's stages as one
policy of one engine.

[Note: residency]
    stage   working weights between uses    gradients                            fp32 master, Adam
    0       whole on every rank             all-reduced, whole on every rank     whole
    1       whole on every rank             held whole through the accumulation   1/N
                                            window, reduce-scattered on its last
                                            micro-batch
    2       whole on every rank             reduce-scattered after each unit's    1/N
                                            backward, kept as 1/N fp32 shards
    3       1/N, gathered around each use   as stage 2                            1/N
    3+hpZ   as 3, but after forward 1/alpha as stage 2                            1/N
            inside the node (backward
            gathers there)

Every stage runs the same units, hooks, reductions and optimizer; the policy only sets
(a) the group the flat layouts are split over (the data-parallel world from stage 1 on, one
rank at stage 0), (b) whether units are released after their use (stage 3) or stay whole,
(c) when gradients are reduced, and (d) the secondary group kept after forward (hpZ). Where
the weights stay whole, a rank's working shard is a view into them (no second copy), and
after each optimizer step the updated shards are all-gathered back into every replica, as
DeepSpeed's stages 1 and 2 do.

Per-rank bytes of model states, with d bytes per working element and Psi parameters
(DeepSpeed's formulas, K = 12 for the fp32 master and Adam's two moments):
stage 0: 2d Psi + K Psi, stage 1: 2d Psi + K Psi / N, stage 2: d Psi + (d + K) Psi / N,
stage 3: (2d + K) Psi / N. Here gradient shards are in the working dtype when each step has
one micro-batch (the formula) and fp32 when micro-batches accumulate into them
(``zeropp.deepspeed_api.initialize.gradient_shard_dtype``): then, with d = 2, stages 2 and 3 hold
(4 - d) Psi / N more than the formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Residency:
    """One ZeRO stage (plus hpZ) as four facts the engine acts on; see [Note: residency]."""

    # Optimizer states (and, from stage 2, gradients) split over the data-parallel world.
    shard_optimizer_states: bool = True
    # Gradients reduced as each unit's backward ends on every micro-batch (stages 0, 2, 3);
    # False holds them whole until the accumulation boundary's micro-batch (stage 1).
    reduce_every_micro_batch: bool = True
    # Working weights freed after each use and gathered again before the next (stage 3).
    reshard_after_use: bool = True
    # hpZ: ranks of the node-local group whose 1/alpha secondary shard a unit keeps after
    # forward, so its backward gathers inside the node; 1 = off.
    secondary_group_size: int = 1

    def __post_init__(self) -> None:
        if self.reshard_after_use and not self.shard_optimizer_states:
            raise ValueError("weights can only be sharded over the group the states are")
        if self.secondary_group_size > 1 and not self.reshard_after_use:
            raise ValueError("hpZ secondary shards need weights sharded after use (stage 3)")

    @classmethod
    def for_stage(cls, stage: int, secondary_group_size: int = 1) -> Residency:
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
        return cls(
            shard_optimizer_states=stage >= 1,
            reduce_every_micro_batch=stage != 1,
            reshard_after_use=stage == 3,
            secondary_group_size=secondary_group_size,
        )

    @property
    def stage(self) -> int:
        if self.reshard_after_use:
            return 3
        if not self.shard_optimizer_states:
            return 0
        return 1 if not self.reduce_every_micro_batch else 2

    @property
    def weights_replicated(self) -> bool:
        """Every rank holds the whole working weights between steps (stages 0, 1, 2)."""
        return not self.reshard_after_use

    @property
    def all_reduce_gradients(self) -> bool:
        """Stage 0: no shards to reduce into, so gradients are summed whole on every rank."""
        return not self.shard_optimizer_states


def shard_alignment(residency: Residency, collective_alignment: int) -> int:
    """Elements every shard of a flat layout is a multiple of: whole hpZ secondary pieces and
    whatever the collectives need (``Collectives.alignment``); engine and planner share it."""
    return math.lcm(residency.secondary_group_size, collective_alignment)


def stays_gathered(numel: int, persistence_threshold: int) -> bool:
    """stage3_param_persistence_threshold: units this small are gathered once per step,
    after the update, and never released (engine and planner share the rule)."""
    return 0 < numel < persistence_threshold
