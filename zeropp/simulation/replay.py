"""What an iteration issues, op by op, so two iterations can be compared for replay safety.

[Note: replay safety]
A CUDA graph replays the kernels, their shapes and the addresses one capture recorded
([Note: iteration graphs] in zeropp/cuda_graph.py). An iteration is safe to capture only if
every steady iteration issues the same sequence: the same ops with the same shapes and
dtypes, on the same streams, allocating the same sizes (the graph's private pool then hands
out the same blocks), the same collectives on the same communicators, and no host read
(which a capture refuses). On the simulated GPU cluster every one of these is observable
without a GPU: ``OpSequence`` records the ops as the host dispatches them (with the lane, the
stand-in for the stream, [Note: allocation lanes] in zeropp/comm/streams.py) and the
simulated backend records the collectives, so a test compares iteration 2 with iteration 3.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeropp.comm.streams import allocation_lane


class IssuedOp(NamedTuple):
    """One op as the host issued it."""

    op: str
    inputs: tuple  # (shape, dtype) of each tensor argument, in order
    outputs: tuple  # (shape, dtype, bytes of its storage) of each tensor output
    lane: str  # "compute", "gather", "reduce" or "gather completion": the stream it runs on


def _tensor_leaves(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensor_leaves(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensor_leaves(item)]
    return []


class OpSequence(TorchDispatchMode):
    """Records every op dispatched while ``enabled`` as an ``IssuedOp``, in order. Enter it
    after the modes that answer ops themselves (``HostSyncCounter`` answers reads of meta
    values), so it sees each op as issued."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[IssuedOp] = []
        self.enabled = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.enabled:
            inputs = tuple((tuple(t.shape), t.dtype) for t in _tensor_leaves((args, kwargs)))
            outputs = tuple((tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
                            for t in _tensor_leaves(out))
            self.ops.append(IssuedOp(str(func), inputs, outputs, allocation_lane()))
        return out

    def take(self) -> list[IssuedOp]:
        """The ops recorded since the last ``take``."""
        ops, self.ops = self.ops, []
        return ops


def first_difference(a: list, b: list) -> str | None:
    """Where two recorded sequences part (None when equal), for an assertion message."""
    # (not strict: a shorter one is reported by its length below)
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"item {index}: {x} != {y}"
    if len(a) != len(b):
        return f"lengths {len(a)} != {len(b)}"
    return None
