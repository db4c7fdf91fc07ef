"""Byte accounting for every collective the engine issues.

Convention: a collective records the bytes that leave this rank for other ranks, counting
each peer's piece as sent directly (what a ring or a direct exchange both move per rank):

- all-gather in a group of G ranks: ``input_bytes * (G - 1)``
- reduce-scatter and all-to-all in a group of G: ``input_bytes * (G - 1) / G``
- all-reduce in a group of G: ``2 * input_bytes * (G - 1) / G`` (reduce-scatter + all-gather)

A collective counts as ``inter_node`` when its process group spans more than one node, else
``intra_node``. Quantization scales travel inside the payload, so they are counted.
"""

from __future__ import annotations

from collections import defaultdict

PHASES = ("forward_all_gather", "backward_all_gather", "gradient_reduce", "optimizer")
LOCALITIES = ("intra_node", "inter_node")


def locality(spans_nodes: bool) -> str:
    return "inter_node" if spans_nodes else "intra_node"


def all_gather_bytes(input_bytes: int, group_size: int) -> int:
    return input_bytes * (group_size - 1)


def reduce_scatter_bytes(input_bytes: int, group_size: int) -> int:
    return input_bytes * (group_size - 1) // group_size


all_to_all_bytes = reduce_scatter_bytes


def all_reduce_bytes(input_bytes: int, group_size: int) -> int:
    return 2 * input_bytes * (group_size - 1) // group_size


class CommStats:
    """Bytes sent by this rank, by phase and locality, since the last ``reset``."""

    def __init__(self) -> None:
        self._bytes: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(LOCALITIES, 0))
        self.enabled = True

    def record(self, phase: str, spans_nodes: bool, nbytes: int) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown communication phase {phase!r}; expected one of {PHASES}")
        if self.enabled and nbytes:
            self._bytes[phase]["inter_node" if spans_nodes else "intra_node"] += int(nbytes)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{phase: {intra_node: int, inter_node: int}}`` for every phase (zeros included)."""
        return {phase: dict(self._bytes[phase]) for phase in PHASES}

    def total(self, locality: str) -> int:
        return sum(self._bytes[phase][locality] for phase in PHASES)

    def reset(self) -> None:
        self._bytes.clear()
