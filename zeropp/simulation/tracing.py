"""Recording an ``IterationTrace`` (zeropp.simulation.trace) on the simulated GPU cluster.

    with TraceRecorder() as recorder:
        recorder.set_phase("forward")
        ...                                   # one iteration of a simulated rank
    trace_events = recorder.events

[Note: trace recording rules]
- Compute ops: every aten op the training thread dispatches (a ``TorchDispatchMode``) that
  touches a tensor on the recorder's device (meta). Ops on host tensors only (the data
  loader's) are not GPU work and are dropped.
  * FLOPs: ``torch.utils.flop_counter``'s formulas (its ``flop_registry``), exactly as
    ``FlopCounterMode`` applies them: an op without a formula is decomposed (when it has a
    composite decomposition) and its parts are recorded instead; else it counts 0 FLOPs.
  * bytes: the nbytes of the device tensors it takes plus those it returns (an in-place op
    such as ``add_`` reads and writes its target: both count). An op that moves no data
    costs 0 bytes: view ops (``func.is_view``: view, transpose, t, expand, slice, split,
    detach, as_strided, ...), any non-mutating op all of whose outputs share an input's
    storage (``_unsafe_view``, ``alias``), and allocation-only ops (``empty*``,
    ``new_empty*``, ``set_``, ``resize_``). Such ops are still recorded (0 bytes, 0 FLOPs
    unless a formula says otherwise), so the op sequence is complete.
- Launches: each ``Execution.launch`` call (the engine's lanes "gather"/"reduce") is one
  ``Launch``, placed where the training thread issued it. Its collectives are what the
  simulated process group sees while ``issue`` (and ``finish``) run, with the global ranks of
  each communicator and this rank's input and output bytes (an in-place collective such as
  all-reduce: output = input). In the CUDA execution model ``issue`` runs *on the side
  stream* (``CudaExecution.launch``), so kernels it launches (qwZ's quantize, qgZ's swizzle
  and requantization, the cast/contiguous copy of a reduce-scatter's input) are recorded in
  ``Launch.compute_ops``, not on the compute stream; a single collective's ``finish`` runs
  on the lane's completion stream: its kernels (qwZ's dequantize) are
  ``Launch.completion_ops``. A sequence's ``finish`` runs at its wait on the compute stream
  ([Note: completion steps] in zeropp/comm/streams.py): its kernels are compute ops after
  the ``Wait``. The collectives a launch issued async and had not waited for when it
  returned, at its end, are ``Launch.in_flight``.
- A collective issued outside any launch (the gradient norm's all-reduce, the logged loss's
  all-reduce) is a ``Launch`` with lane "compute" and no ``Wait``: it runs in place on the
  compute stream.
- Host reads of device values (``zeropp.simulation.measure.reads_device_value``: ``item``,
  ``cpu()``, ...) on the training thread: a ``HostSync`` after the op that reads.
- ``Pending.wait()``: a ``Wait`` for the launch that returned it, on its first wait only.
  A Pending not made by a recorded launch (a group of one rank, or launched before recording
  began) records nothing.
- Phase: whatever ``set_phase`` said last (sticky): the caller sets it when the engine's
  forward, backward and optimizer step start, so the loss computed after the model's forward
  is forward work, and what follows the step (the loss logging) is in the optimizer phase.
  Activation-checkpoint recompute runs inside backward, so it is backward work.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from zeropp.comm.streams import InlineExecution, Pending
from zeropp.simulation.backend import _flat, _SimProcessGroup
from zeropp.simulation.measure import (
    _tensors,
    reads_device_value,
    restore_method,
    save_method,
)
from zeropp.simulation.trace import Collective, ComputeOp, Event, HostSync, Launch, Wait

__all__ = ["TraceRecorder", "collective_name"]

aten = torch.ops.aten

# Allocate (or re-point) storage without reading or writing its bytes.
_NO_DATA_MOVEMENT = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor, aten.set_.default,
    aten.resize_.default, aten.lift_fresh.default,
}

# Ops torch's own flop counter skips (metadata queries).
_METADATA = {
    aten.is_contiguous.default, aten.is_contiguous.memory_format, aten.size.default,
    aten.sym_size.default, aten.stride.default, aten.sym_stride.default,
    aten.storage_offset.default, aten.sym_storage_offset.default, aten.numel.default,
    aten.sym_numel.default, aten.dim.default, torch.ops.prim.layout.default,
    torch.ops.prim.device.default,
}


def collective_name(op: str) -> str:
    """The simulated backend's op name as a trace's collective name."""
    for prefix, name in (("all_gather", "all_gather"), ("allgather", "all_gather"),
                         ("reduce_scatter", "reduce_scatter"), ("all_to_all", "all_to_all"),
                         ("alltoall", "all_to_all"), ("all_reduce", "all_reduce")):
        if op.startswith(prefix):
            return name
    return op


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _mutates(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write
               for a in func._schema.arguments)


class _OpMode(TorchDispatchMode):
    def __init__(self, recorder: TraceRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            return func(*args, **kwargs)
        if func._overloadpacket not in flop_registry:  # as FlopCounterMode: count the parts
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        self.recorder._op(func, args, kwargs, out)
        if reads_device_value(func, args, kwargs, self.recorder._on_device_type):
            self.recorder._host_sync()
        return out


class TraceRecorder:
    """Records the events of [Note: trace recording rules] while active (patches restored on
    exit). ``events`` is the trace's event list; ``next_id`` the next launch id."""

    def __init__(self, device: torch.device | str = "meta", phase: str = "forward",
                 in_host_memory: Callable[[torch.UntypedStorage], bool] | None = None) -> None:
        """``in_host_memory``: whether a storage is host memory (ZeRO-Offload's buffers, which
        on the meta device only the memory tracker's host lane tells apart); None: none is."""
        self.device = torch.device(device)
        self.phase = phase
        self.in_host_memory = in_host_memory
        self.events: list[Event] = []
        self.next_id = 0
        self._open: list[dict[str, Any]] = []  # launches whose issue/finish are running
        self._launch_of: weakref.WeakKeyDictionary[Pending, int] = weakref.WeakKeyDictionary()
        self._mode: _OpMode | None = None
        self._saved: list[tuple[type, str, tuple[bool, Any]]] = []

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    # -- recording -------------------------------------------------------------------------
    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type and (
            self.device.index is None or t.device.index == self.device.index)

    def _on_device_type(self, device: torch.device) -> bool:
        return device.type == self.device.type and (
            self.device.index is None or device.index == self.device.index)

    def _host_sync(self) -> None:
        if not self._open:  # a read inside a launch's issue would be the launch's business
            self.events.append(HostSync())

    def _op(self, func, args, kwargs, out) -> None:
        inputs = [t for t in _tensors((args, kwargs)) if self._on_device(t)]
        outputs = [t for t in _tensors(out) if self._on_device(t)]
        if not inputs and not outputs:
            return  # host work (the data loader), not a GPU kernel
        packet = func._overloadpacket
        flops = 0
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        moves = not (func.is_view or func in _NO_DATA_MOVEMENT)
        if moves and outputs and not _mutates(func):
            storages = {t.untyped_storage()._cdata for t in inputs}
            moves = not all(t.untyped_storage()._cdata in storages for t in outputs)
        nbytes = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs)) if moves else 0
        where = "device"
        if self.in_host_memory is not None and moves:
            where, nbytes = self._placement(inputs + outputs, nbytes)
        op = ComputeOp(str(func), float(flops), int(nbytes), self.phase, where)
        if self._open:
            record = self._open[-1]
            record["completion_ops" if record["completing"] else "ops"].append(op)
        else:
            self.events.append(op)

    def _placement(self, tensors: list[torch.Tensor], nbytes: int) -> tuple[str, int]:
        """("host", bytes) for an op on host memory only; for one that reads one memory and
        writes the other, its direction ("to_host" or "to_device", by where its output lies)
        and the bytes crossing the bus (the smaller side's distinct tensors: a copy's source
        or target, the gradient a host shard adds); else ("device", bytes)."""
        host, device = {}, {}
        for t in tensors:
            side = host if self.in_host_memory(t.untyped_storage()) else device
            side[(t.untyped_storage()._cdata, t.storage_offset(), t.numel())] = _nbytes(t)
        if not host:
            return "device", nbytes
        if not device:
            return "host", nbytes
        written = tensors[-1]  # an op's output (or an in-place op's target) comes last
        direction = "to_host" if self.in_host_memory(written.untyped_storage()) else "to_device"
        return direction, min(sum(host.values()), sum(device.values()))

    def _collective(self, group: _SimProcessGroup, op: str, inputs,
                    outputs) -> Collective | None:
        """Record a collective; returned when it belongs to an open launch."""
        inputs, outputs = _flat(inputs), _flat(outputs)
        in_bytes = sum(map(_nbytes, inputs))
        out_bytes = sum(map(_nbytes, outputs)) if outputs else in_bytes  # in place
        ranks = tuple(r for r in group._key if isinstance(r, int))
        collective = Collective(collective_name(op), ranks, in_bytes, out_bytes)
        if self._open:
            self._open[-1]["collectives"].append(collective)
            return collective
        # synchronous, on the compute stream
        self.events.append(Launch(self.next_id, "compute", (collective,), self.phase))
        self.next_id += 1
        return None

    def _issued(self, work: Any) -> None:
        """The Work of the collective just recorded inside an open launch."""
        self._open[-1]["works"].append(work)

    def _launch(self, lane: str, run, owner: list | None = None) -> Any:
        """Record one launch; ``owner`` receives its record (for its completion step)."""
        launch_id = self.next_id
        self.next_id += 1
        record = {"collectives": [], "ops": [], "works": [], "completion_ops": [],
                  "completing": False}
        if owner is not None:
            owner.append(record)
        self._open.append(record)
        try:
            pending = run()
        finally:
            self._open.pop()
        in_flight = 0  # the last collectives whose Work nobody waited for yet
        for work in reversed(record["works"]):
            if not getattr(work, "awaiting_wait", False):
                break
            in_flight += 1
        event = Launch(launch_id, lane, tuple(record["collectives"]), self.phase,
                       compute_ops=tuple(record["ops"]), in_flight=in_flight,
                       completion_ops=tuple(record["completion_ops"]))
        if self._open:  # a launch inside a launch runs on the outer one's lane
            outer = self._open[-1]
            for key in ("collectives", "works", "completion_ops"):
                outer[key].extend(record[key])
            outer["ops"].extend(event.compute_ops)
        else:
            self.events.append(event)
            if isinstance(pending, Pending) and not pending.done:
                self._launch_of[pending] = launch_id
        return pending

    def _completing(self, finish: Callable[[], None], owner: list) -> Callable[[], None]:
        """``finish`` recording its ops as its own launch's completion ops while that launch
        is open (a sequence's runs at its wait, later: compute-stream ops)."""
        def run() -> None:
            record = owner[0] if owner else None
            if record is None or not any(r is record for r in self._open):
                finish()
                return
            record["completing"] = True
            try:
                finish()
            finally:
                record["completing"] = False
        return run

    def _wait(self, pending: Pending) -> None:
        launch_id = self._launch_of.pop(pending, None)
        if launch_id is not None and not pending.done:
            self.events.append(Wait(launch_id))

    # -- patches ---------------------------------------------------------------------------
    def _patch(self, owner: type, name: str, make) -> None:
        self._saved.append((owner, name, save_method(owner, name)))
        setattr(owner, name, make(getattr(owner, name)))

    def __enter__(self) -> TraceRecorder:
        recorder = self

        def launch(original):
            def run(execution, lane, issue, *, finish=None, keep=(), sequence=False):
                owner: list = []
                if finish is not None:
                    finish = recorder._completing(finish, owner)
                return recorder._launch(lane, lambda: original(
                    execution, lane, issue, finish=finish, keep=keep, sequence=sequence),
                    owner)
            return run

        def wait(original):
            def run(pending):
                recorder._wait(pending)
                return original(pending)
            return run

        def issue(original):
            def run(group, op, opts, inputs, outputs=(), *args, **kwargs):
                inside = recorder._collective(group, op, inputs, outputs)
                work = original(group, op, opts, inputs, outputs, *args, **kwargs)
                if inside is not None:
                    recorder._issued(work)
                return work
            return run

        self._patch(InlineExecution, "launch", launch)
        self._patch(Pending, "wait", wait)
        self._patch(_SimProcessGroup, "_issue", issue)
        self._mode = _OpMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
                self._mode = None
        finally:
            while self._saved:
                owner, name, saved = self._saved.pop()
                restore_method(owner, name, saved)
