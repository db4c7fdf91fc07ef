"""Where collectives run relative to compute: one execution model per engine.

[Note: execution models]
The engine issues every collective through an ``Execution``; the collectives and the units
never branch on the device themselves.

- ``CudaExecution`` (FSDP2's pattern): a gather stream and a reduce stream, and a
  completion stream beside a lane whose collectives have a completion step (the gather
  lane's). Before issuing, the side stream waits for the compute stream (its inputs were
  written there); the collective is issued synchronously *on the side stream* (NCCL orders
  it on that stream, the host does not block) and an event is recorded; its completion step
  runs where [Note: completion steps] says. ``Pending.wait()`` makes the compute stream
  wait for the last event and only then drops the references to the buffers, so a buffer
  allocated on the compute stream is never reused while a side stream still reads it: no
  ``record_stream``. An event then goes back to its lane to be
  recorded again: a stream waits for the record an event held when the wait was enqueued
  (``cudaStreamWaitEvent``), so a later record does not move that wait, and a collective
  takes a free event rather than creating one (a host cost per collective). Everything is
  issued from the thread running forward and backward, so every rank issues the same order
  on every communicator, and kernels launch on the engine's device (``launch`` makes it
  current while it issues, [Note: lane switch]).
- ``InlineExecution``: the same protocol with no streams (each collective runs when
  issued, references still held until ``wait()``). ``CUDA_MODEL`` is the CUDA model on the
  meta device (the simulated GPU cluster: memory and order exactly as on GPUs; a sequence
  completes at ``wait()``, as on CUDA); ``SYNCHRONOUS`` is ``overlap_comm: false`` on any
  device: everything, a sequence's last hop included, completes when issued.
- ``HostThreadExecution`` (CPU / gloo): single collectives use gloo's own async work; a
  sequence of collectives (qgZ's two hops) is issued by one worker thread, the CPU's
  stand-in for a reduce stream. Only that thread issues on the groups it is given (qgZ's
  intra- and inter-node groups), so the order per communicator is still the same on every
  rank. Every ``finish`` runs at ``wait()``; the worker prepares the next sequence while the
  last collective of one is in flight (qgZ's inter-node hop, summed at ``wait()``).

[Note: completion steps]
A collective's ``finish`` is its completion step on the device: qwZ's dequantize into the
unit, qgZ's receive and last sum. Where it runs decides what waits behind it:
- on the side stream after the transfer, the lane's next transfer would queue behind the
  kernel (NCCL's stream waits for the side stream when a collective is issued);
- on the compute stream at ``wait()``, compute would run it (FSDP2's copy-out).
The step-time model ranked both for the 18B: on the gather stream, the forward's gathers
are the bound on 8 x 8 H100 (compute idles behind them); on the compute stream, backward's
compute is the bound on the paper's DGX-2 cluster at 400 and 800 Gbit/s (5% and 8%
slower). So a single collective's ``finish`` runs on the lane's *completion stream*, issued
at once after the transfer's event: it overlaps compute and the next transfer both, and the
compute stream waits for the completion's event. What the completion reads (qwZ's received
payloads) is held by the ``Pending`` until that wait, and freed blocks of the lane are
reused only after the next launch's wait for compute, which follows it.
A *sequence* (qgZ's two hops, the weight-delta gather's) leaves its last collectives in
flight on their own communicators; its ``finish`` waits for them, so it runs at ``wait()``
on the compute stream: the side stream goes on to the next unit's first hop while this one's
slow hop is still on the wire. ``InlineExecution`` keeps the same lifetimes, and allocates a
completion's buffers on the lane's completion pool (``COMPLETION_LANES``), so traces and
measured memory show all of this.

The number of reductions in flight is bounded by the caller (``ShardedModel``), so memory
held by in-flight collectives does not grow with the model's depth on any execution.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from zeropp.comm import flight_recorder

# issue(async_op) -> a torch Work (or None when it completed synchronously)
IssueFn = Callable[[bool], object | None]


class Pending:
    """A collective in flight; ``wait()`` finishes it once and releases what it holds.

    ``work``: a torch Work or a Future to wait for; ``finish``: the completion step to run
    after it (a sequence's, or any on host executions); ``event``: the side-stream event the
    compute stream must wait for (CUDA); ``keep``: tensors that must outlive the collective
    (or a dict the issue fills with the buffers it allocates).
    """

    def __init__(self, work: object | None = None, finish: Callable[[], None] | None = None,
                 *, event: object | None = None, keep: tuple = (),
                 record=flight_recorder.NO_RECORD,
                 free_events: list | None = None, device_index: int | None = None) -> None:
        self._record = record  # [Note: flight recorder]
        self._work = work
        self._finish = finish
        self._event = event
        self._free_events = free_events  # where ``event`` goes once waited for (CUDA)
        # The engine's GPU, whose current stream waits for ``event`` (None: the current GPU)
        self._device_index = device_index
        self._keep = keep
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        record = self._record  # (no calls at all without a flight recorder: every collective)
        if record is not flight_recorder.NO_RECORD:
            record.waiting()
        if self._event is not None:
            torch.cuda.current_stream(self._device_index).wait_event(self._event)
            if self._free_events is not None:
                self._free_events.append(self._event)
            self._event = None
        if self._work is not None:
            if hasattr(self._work, "wait"):
                self._work.wait()
            else:  # a concurrent.futures.Future from the host worker
                self._work.result()
        if self._finish is not None:
            self._finish()
        self._keep = ()
        self.done = True
        if record is not flight_recorder.NO_RECORD:
            record.finished()


class Execution(abc.ABC):
    """Issues collectives on a lane ("gather" or "reduce"); see [Note: execution models]."""

    name = "base"

    @abc.abstractmethod
    def launch(self, lane: str, issue: IssueFn, *, finish: Callable[[], None] | None = None,
               keep: tuple = (), sequence: bool = False) -> Pending:
        """Issue a collective (``sequence``: several collectives and kernels, the last
        ones possibly left in flight for ``finish``, which then runs at ``wait()``)."""

    def close(self) -> None:  # noqa: B027 (most executions hold nothing to release)
        """Release threads or streams (the engine calls it when it is done)."""

    def staging(self, lane: str) -> contextlib.AbstractContextManager:
        """Where a collective's input is brought to the device before it is issued (an
        offloaded shard's host-to-device copy, [Note: offload]): the lane's pool, and on CUDA
        the lane's stream, so the copy overlaps compute as the collective does."""
        return allocating_on(lane)


# [Note: allocation lanes]
# On CUDA what a collective allocates while issued or completed (quantized payloads, receive
# buffers; hpZ's kept secondary on the completion stream) comes from the pool of the stream
# it runs on ([Note: completion steps]) in the caching allocator,
# and a freed block there is reused only by allocations on that stream: the device holds
# each stream's peak, not the peak of their sum. The executions without streams say which
# lane they stand in for while they run a collective's steps (``allocation_lane``), so the
# simulated GPU cluster's memory tracker can hold a pool per lane as the allocator does.
# Host buffers of ZeRO-Offload ([Note: offload] in zeropp/offload.py) are allocated on a lane
# of their own, which the tracker counts as host memory, not the device's.
_lanes = threading.local()
COMPUTE_LANE = "compute"
HOST_LANE = "host"


# The pool of each lane's completion stream ([Note: completion steps]).
COMPLETION_LANES = {"gather": "gather completion", "reduce": "reduce completion"}


def allocation_lane() -> str:
    """The stream whose pool an allocation on this thread comes from ([Note: allocation
    lanes]): "gather" or "reduce" inside a collective's steps, else "compute"."""
    return getattr(_lanes, "current", COMPUTE_LANE)


@contextlib.contextmanager
def allocating_on(lane: str) -> Iterator[None]:
    previous = allocation_lane()
    _lanes.current = lane
    try:
        yield
    finally:
        _lanes.current = previous


class InlineExecution(Execution):
    """Run each collective when issued and hold its buffers until ``wait()``; a sequence's
    completion too, unless ``defer_sequences`` (the CUDA model: at ``wait()``)."""

    name = "inline"

    def __init__(self, defer_sequences: bool = False) -> None:
        self.defer_sequences = defer_sequences

    def launch(self, lane, issue, *, finish=None, keep=(), sequence=False) -> Pending:
        record = flight_recorder.issued(lane, issue, keep)
        # Allocations come from the lane, as CudaExecution's side stream would make them
        # (``allocating_on``, inlined: this runs for every collective).
        previous = getattr(_lanes, "current", COMPUTE_LANE)
        _lanes.current = lane
        try:
            work = issue(False)
            if work is not None:
                work.wait()
            if finish is not None and not (sequence and self.defer_sequences):
                # [Note: completion steps]: on the lane's completion stream, or for a
                # sequence run synchronously, where its hops ran
                _lanes.current = lane if sequence else COMPLETION_LANES[lane]
                finish()
                finish = None
        finally:
            _lanes.current = previous
        # A deferred sequence completes at wait(), on the compute lane.
        return Pending(finish=finish, keep=keep, record=record)


# CUDA's stream priorities: lower is higher; -1 is the highest torch's API exposes everywhere.
HIGH_STREAM_PRIORITY = -1


class CudaExecution(Execution):
    """A gather stream and a reduce stream on one CUDA device; events to the compute stream."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Gathers and reductions on separate streams so a reduction of block i overlaps the
        # gather of block i-1 in backward, and neither blocks compute. At high priority (as
        # FSDP2's): the block scheduler serves their few small kernels (quantization, NCCL's)
        # before the compute stream's queue, instead of a large GEMM starving them while the
        # next unit's weights are late.
        self.streams = {lane: torch.cuda.Stream(device=device, priority=HIGH_STREAM_PRIORITY)
                        for lane in ("gather", "reduce")}
        # Where a single collective's completion step runs ([Note: completion steps]),
        # made at a lane's first (only the gather lane's collectives have one today).
        self.completion_streams: dict[str, object] = {}
        # Events waited for, ready to be recorded again (see [Note: execution models]).
        self.free_events: dict[str, list] = {lane: [] for lane in self.streams}
        # Where a side stream joins the compute stream before each collective: recorded on
        # the compute stream, then waited for, so one event serves every launch
        # (``Stream.wait_stream`` would create an event per call).
        self.compute_mark = torch.cuda.Event()
        self.device_index = (device.index if device.index is not None
                             else torch.cuda.current_device())

    def completion_stream(self, lane: str):
        """The stream of ``lane``'s completion steps ([Note: completion steps])."""
        stream = self.completion_streams.get(lane)
        if stream is None:
            stream = self.completion_streams[lane] = torch.cuda.Stream(
                device=self.device, priority=HIGH_STREAM_PRIORITY)
        return stream

    @contextlib.contextmanager
    def staging(self, lane: str) -> Iterator[None]:
        # What is allocated here is used on this stream only (the copy, then the lane's
        # collective issued after it: a collective on another stream stages there instead,
        # ``zeropp.unit.to_device``), so the allocator's per-stream reuse is safe without
        # events once the stream waits for compute, where a completion step may still read a
        # block this lane freed ([Note: completion steps]); ``launch`` waits the same way.
        stream = self.streams[lane]
        self.compute_mark.record(torch.cuda.current_stream(self.device_index))
        stream.wait_event(self.compute_mark)
        with torch.cuda.stream(stream):
            yield

    # [Note: lane switch]
    # ``launch`` runs for every collective, so it switches streams with ``set_stream`` and
    # back rather than ``torch.cuda.stream(...)``, whose context object looks up the current
    # device's index through torch's generic device helpers when made and again on entry
    # (with ``Stream.wait_stream``'s new event, 215 calls a gather with a completion step,
    # launched and waited for, against 62 now: ``python -m scripts.bench.cuda_host_calls``).
    # The two are the same switch when the engine's device is the current one: torch's
    # context then saves and restores that device's current stream, as here. When it is
    # not, the context also makes the engine's device current while it runs and restores
    # both devices' streams after: ``launch`` then runs inside ``torch.cuda.device(...)``,
    # which restores the current device as the context does. One event, ``compute_mark``,
    # serves every launch's join because launches come from one host thread at a time
    # ([Note: execution models]): another thread recording it between this record and this
    # wait would move what the wait waits for.
    def launch(self, lane, issue, *, finish=None, keep=(), sequence=False) -> Pending:
        if torch.cuda.current_device() != self.device_index:
            with torch.cuda.device(self.device_index):
                return self.launch(lane, issue, finish=finish, keep=keep, sequence=sequence)
        compute = torch.cuda.current_stream(self.device_index)  # (an index: the cheap lookup)
        record = flight_recorder.issued(lane, issue, keep)
        stream = self.streams[lane]
        # The side stream starts after what compute enqueued so far (its inputs are written
        # there); a wait takes the mark's record of the moment, so one event serves all.
        self.compute_mark.record(compute)
        stream.wait_event(self.compute_mark)
        free = self.free_events[lane]
        torch.cuda.set_stream(stream)
        try:
            issue(False)
            event = free.pop() if free else torch.cuda.Event()
            event.record(stream)
            if finish is not None and not sequence:  # [Note: completion steps]
                completion = self.completion_stream(lane)
                completion.wait_event(event)
                torch.cuda.set_stream(completion)
                finish()
                event.record(completion)  # the wait above took the transfer's record
                finish = None
        finally:
            torch.cuda.set_stream(compute)
        # A sequence's finish runs at wait(), after the compute stream waits for the event.
        return Pending(finish=finish, event=event, keep=keep, record=record, free_events=free,
                       device_index=self.device_index)


class HostThreadExecution(Execution):
    """gloo: async work for single collectives, one worker thread for blocking sequences."""

    name = "host-threads"

    def __init__(self) -> None:
        self._worker: ThreadPoolExecutor | None = None

    def launch(self, lane, issue, *, finish=None, keep=(), sequence=False) -> Pending:
        record = flight_recorder.issued(lane, issue, keep)
        if not sequence:
            return Pending(issue(True), finish, keep=keep, record=record)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeropp-reduce")
        return Pending(self._worker.submit(issue, False), finish, keep=keep, record=record)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


SYNCHRONOUS = InlineExecution()
CUDA_MODEL = InlineExecution(defer_sequences=True)


def execution_for(device: torch.device, overlap: bool) -> Execution:
    """The execution model of an engine on ``device`` (see [Note: execution models])."""
    if not overlap:
        return SYNCHRONOUS
    if device.type == "cuda":
        return CudaExecution(device)
    if device.type == "cpu":
        return HostThreadExecution()
    # meta (the simulated GPU cluster) and any other accelerator take the CUDA model's order
    # and lifetimes without real streams (the inline execution holds no state).
    return CUDA_MODEL

