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

The same ops are not enough: a replay also reads the memory the capture read. An op's
tensor argument either lives in memory the iteration allocated (the pool hands out the same
blocks again) or in memory held from before (weights, optimizer state, flat buffers), which
a replay reads at the same address. If an iteration leaves state in memory it allocated
(say, a regather into a fresh buffer that the next forward reads), an eager run is right
but a replay reads the memory of the capture's predecessor, freed since: 2026-11-28's first
graph on an H200 did this with the persistent units and trained to a loss of 28. So
``OpSequence(storage_flow=True)`` also records where each argument's memory comes from:
("made", i, j) for output j of the iteration's op i, ("held", n) for a storage the
iteration did not allocate, n numbered in the order first seen ("host" for an op wholly on
the CPU, which a graph does not capture; a host tensor read by a device op is held memory).
A storage given memory again (``UntypedStorage.resize_``, how units free and regather their
weights, which no dispatch mode sees) is new memory from there: ("made", i, "resize") where
it happened before op i, and a new number once the iteration is over. Two steady iterations must
record the same flow, which a leftover like that breaks (iteration 3 reads what iteration 2
made, where iteration 2 read what iteration 1 made or held from the start).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeropp.comm.streams import allocation_lane
from zeropp.simulation.measure import restore_method, wrap_storage_resize


class IssuedOp(NamedTuple):
    """One op as the host issued it."""

    op: str
    inputs: tuple  # (shape, dtype) of each tensor argument, in order
    outputs: tuple  # (shape, dtype, bytes of its storage) of each tensor output
    lane: str  # "compute", "gather", "reduce" or "gather completion": the stream it runs on
    sources: tuple = ()  # with storage_flow: where each tensor argument's memory comes from


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
    values), so it sees each op as issued. ``storage_flow``: also record each argument's
    ``sources`` ([Note: replay safety]); every storage seen is then kept alive until the
    recorder is dropped, so that no two are ever confused (use it on meta tensors, or small
    ones)."""

    def __init__(self, storage_flow: bool = False) -> None:
        super().__init__()
        self.ops: list[IssuedOp] = []
        self.enabled = True
        self.storage_flow = storage_flow
        # storage key -> (number, the op index and output slot, or "resize", that made it in
        # the current segment, or None) and the storages themselves, kept alive (see above)
        self._seen: dict[int, tuple[int, tuple[int, int | str] | None]] = {}
        self._alive: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.enabled:
            arguments = _tensor_leaves((args, kwargs))
            results = _tensor_leaves(out)
            inputs = tuple((tuple(t.shape), t.dtype) for t in arguments)
            outputs = tuple((tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
                            for t in results)
            sources = self._flow(arguments, results) if self.storage_flow else ()
            self.ops.append(IssuedOp(str(func), inputs, outputs, allocation_lane(), sources))
        return out

    def _flow(self, arguments: list[torch.Tensor], results: list[torch.Tensor]) -> tuple:
        if all(t.device.type == "cpu" for t in (*arguments, *results)):
            # The host's own arithmetic (the simulated cluster's optimizer counts its steps
            # on the CPU, where a capturable one counts on the device): not in a graph.
            return ("host",) * len(arguments)
        storages = [t.untyped_storage() for t in arguments]
        sources = []
        for storage in storages:
            number, made = self._entry(storage, None)
            sources.append(("made", *made) if made is not None else ("held", number))
        argument_keys = {storage._cdata for storage in storages}
        for slot, tensor in enumerate(results):
            storage = tensor.untyped_storage()
            # An output in an argument's memory (in place, a view, out=) is not new memory.
            if storage._cdata not in argument_keys:
                self._entry(storage, (len(self.ops), slot))
        return tuple(sources)

    def _entry(self, storage, made: tuple | None, anew: bool = False) -> tuple:
        key = storage._cdata
        if anew or key not in self._seen:
            self._seen[key] = (len(self._alive), made)
            self._alive.append(storage)
        return self._seen[key]

    def _on_resize(self, storage, nbytes: int) -> None:
        if self.enabled and nbytes > 0:
            self._entry(storage, (len(self.ops), "resize"), anew=True)

    def __enter__(self) -> OpSequence:
        if self.storage_flow:  # UntypedStorage.resize_ is not dispatched: wrapped while on
            self._saved_resize = wrap_storage_resize(self._on_resize)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        if self.storage_flow:
            restore_method(torch.UntypedStorage, "resize_", self._saved_resize)
        return super().__exit__(*exc)

    def take(self) -> list[IssuedOp]:
        """The ops recorded since the last ``take``, which starts a new segment: memory made
        before it is held memory from then on."""
        ops, self.ops = self.ops, []
        self._seen = {key: (number, None) for key, (number, _) in self._seen.items()}
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
