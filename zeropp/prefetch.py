"""The prefetch rule, shared by the engine and the planner so both decide alike."""

from __future__ import annotations

from collections.abc import Sequence


def units_to_prefetch(
    upcoming: Sequence[tuple[int, bool]], live_numel: int, bucket_numel: int, max_live_numel: int
) -> list[int]:
    """Indices into ``upcoming`` whose gathers to start now.

    ``upcoming`` lists the next units in the order they will run, as (gathered size, already
    in flight). DeepSpeed's rule: keep issuing gathers while fewer than ``bucket_numel``
    (stage3_prefetch_bucket_size) elements are in flight ahead, so one unit larger than the
    bucket is still prefetched and 0 disables prefetch; beyond the next unit, never let the
    gathered elements exceed ``max_live_numel`` (stage3_max_live_parameters).

    The next unit is always allowed (when prefetch is on): with a large model the root and
    the current block alone can exceed the live cap (18B: 312M + 453M of the default 1e9),
    and refusing the next block would expose every gather. Its memory is the cost of overlap
    and the planner counts it.
    """
    start, in_flight = [], 0
    for index, (size, flying) in enumerate(upcoming):
        if in_flight >= bucket_numel:
            break
        if not flying:
            if index > 0 and live_numel + size > max_live_numel:
                break
            start.append(index)
            live_numel += size
        in_flight += size
    return start
