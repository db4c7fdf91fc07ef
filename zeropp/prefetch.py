"""The prefetch rule, shared by the engine and the planner so both decide alike."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol


class Upcoming(Protocol):
    """What the prefetch rule reads of a unit ahead: a ``ShardedUnit`` answers it, the planner
    passes ``PlannedUnit``s."""

    padded_numel: int  # elements of its gathered weights
    is_live: bool  # gathered already, or its gather in flight


class PlannedUnit(NamedTuple):
    padded_numel: int
    is_live: bool


def units_to_prefetch(upcoming: Sequence[Upcoming], live_numel: int, bucket_numel: int,
                      max_live_numel: int) -> list[int]:
    """Indices into ``upcoming`` whose gathers to start now.

    ``upcoming`` lists the next units in the order they will run; it is read only as far as
    the window reaches. DeepSpeed's rule: keep issuing gathers while fewer than
    ``bucket_numel`` (stage3_prefetch_bucket_size) elements are in flight ahead, so one unit
    larger than the bucket is still prefetched and 0 disables prefetch; beyond the next unit,
    never let the gathered elements exceed ``max_live_numel`` (stage3_max_live_parameters).

    The next unit is always allowed (when prefetch is on): with a large model the root and
    the current block alone can exceed the live cap (18B: 312M + 453M of the default 1e9),
    and refusing the next block would expose every gather. Its memory is the cost of overlap
    and the planner counts it.
    """
    start, in_flight = [], 0
    for index, unit in enumerate(upcoming):
        if in_flight >= bucket_numel:
            break
        if index > 0 and live_numel >= max_live_numel:
            # Past the next unit nothing fits any more (sizes are positive and the live count
            # only grows here): the answer is settled, the rest of the window need not be read.
            break
        size = unit.padded_numel
        if not unit.is_live:
            if index > 0 and live_numel + size > max_live_numel:
                break
            start.append(index)
            live_numel += size
        in_flight += size
    return start


def blocks_kept_for_backward(block_numels: Sequence[int], root_numel: int,
                             max_reuse_distance: int) -> set[int]:
    """Indices (forward order) of the blocks that stay gathered from forward to backward.

    DeepSpeed's ``stage3_max_reuse_distance``: a module is not released when it will be used
    again before this many parameter elements have been traversed. Between a block's forward
    and its backward run the forward and the backward of every later block and the root's
    head, so its reuse distance is ``root + 2 * (later blocks)``. The last blocks of a small
    model are kept (no backward gather at all), those of an 18B model (453M-element blocks,
    default 1e9) only the last. 0 keeps none.
    """
    kept, later = set(), 0
    for index in range(len(block_numels) - 1, -1, -1):
        if root_numel + 2 * later < max_reuse_distance:
            kept.add(index)
        later += block_numels[index]
    return kept


def distinct_ahead(plan: Sequence, start: int, skipped: Collection, reach: int) -> list:
    """The distinct units of ``plan[start:]`` not in ``skipped``, in order, as far as
    ``units_to_prefetch`` can read with a bucket of ``reach`` elements (it stops once the
    units before one hold that many): the engine's ``upcoming``, worked out once per plan
    position and kept while its plan does not change. The work is the window's, not the
    model's."""
    ahead, ids, numel = [], set(), 0
    for index in range(start, len(plan)):
        if numel >= reach:
            break
        unit = plan[index]
        if unit in skipped or id(unit) in ids:
            continue
        ids.add(id(unit))
        ahead.append(unit)
        numel += unit.padded_numel
    return ahead
