"""The one source of truth for where each parameter sits in a unit's flat buffer.

[Note: flat layout]
A unit's parameters are laid end to end in one flat buffer, in registration order, then
padded with zeros so the buffer splits evenly into ``num_shards`` shards (and every shard into
``align`` pieces, e.g. the hpZ group). Rank i owns elements
``[i * shard_numel, (i + 1) * shard_numel)``. Every offset, every padding length and every
shard range in the engine, the optimizer and the checkpoints comes from this module, so they
cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat buffer."""

    name: str  # qualified name in the model, e.g. "layers.3.mlp.dense_h_to_4h.weight"
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[ParamSlot, ...]
    numel: int  # real elements, without padding
    padded_numel: int
    num_shards: int

    @classmethod
    def build(
        cls, named_shapes: Iterable[tuple[str, tuple[int, ...]]], num_shards: int, align: int = 1
    ) -> FlatLayout:
        slots, offset = [], 0
        for name, shape in named_shapes:
            slot = ParamSlot(name, tuple(int(s) for s in shape), offset)
            slots.append(slot)
            offset = slot.end
        multiple = num_shards * max(1, align)
        padded = max(multiple, math.ceil(offset / multiple) * multiple)
        return cls(tuple(slots), offset, padded, num_shards)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    def shard_range(self, shard_index: int) -> tuple[int, int]:
        start = shard_index * self.shard_numel
        return start, start + self.shard_numel

    def filled_in_shard(self, start: int) -> int:
        """Elements of the shard starting at flat offset ``start`` that hold parameters; the
        rest of it is padding."""
        return min(max(self.numel - start, 0), self.shard_numel)

    def overlap(self, slot: ParamSlot, start: int, end: int) -> tuple[int, int] | None:
        """The part of ``slot`` inside flat range [start, end), as offsets into the slot."""
        lo, hi = max(slot.offset, start), min(slot.end, end)
        if lo >= hi:
            return None
        return lo - slot.offset, hi - slot.offset

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter as a view into a gathered flat buffer (same order as ``slots``)."""
        return [flat[s.offset : s.end].view(s.shape) for s in self.slots]

    def fill_shard(self, shard: torch.Tensor, shard_index: int, full_value_of) -> None:
        """Write this shard's elements from ``full_value_of(slot) -> full tensor``.

        Only one parameter's full value exists at a time, so a model too large for one rank
        can still be materialized shard by shard. Padding is zero.
        """
        start, end = self.shard_range(shard_index)
        shard.zero_()
        for slot in self.slots:
            part = self.overlap(slot, start, end)
            if part is None:
                continue
            value = full_value_of(slot).reshape(-1)
            lo, hi = part
            dst = slot.offset + lo - start
            shard[dst : dst + hi - lo].copy_(value[lo:hi])

    def shard_runs(self, shard_index: int, predicate) -> list[tuple[int, int]]:
        """(start, end) offsets inside this shard of the parameters satisfying ``predicate``."""
        start, end = self.shard_range(shard_index)
        runs = []
        for slot in self.slots:
            part = self.overlap(slot, start, end)
            if part is not None and predicate(slot):
                lo, hi = part
                runs.append((slot.offset + lo - start, slot.offset + hi - start))
        return runs
