"""The whole training iteration as one CUDA graph, opt-in (``"cuda_graph": {"enabled": true}``
in the DeepSpeed JSON, ``--cuda-graph`` on the command line).

[Note: iteration graphs]
On a GPU the host issues every kernel and collective of an iteration, and a ZeRO-3 iteration
issues thousands. Captured once as a CUDA graph, the iteration is launched with one call:
the host's cost per iteration stops depending on how many ops it has. This engine can
capture its iteration where other ZeRO-3 implementations cannot, because an iteration starts
and ends in the same state: units sharded, persistent units gathered, flat buffers and
reduction buffers in place, and (where the device decides the step, [Note: step outcome on
the device] in zeropp/engine.py) nothing read back by the host.

How ``IterationGraph`` runs a caller's iteration function ``fn(*inputs) -> outputs``:
- The first ``warmup_iterations`` calls run eagerly: autograd's buffers, the optimizer's
  state, the communicators, the Triton kernels and the engine's learned prefetch order are
  all set up outside the graph.
- The next call captures ``fn`` on static copies of the inputs, on a side stream in a
  private memory pool (``torch.cuda.graph``), then replays it once: capture records work,
  it does not run it. The Python code of the engine runs exactly once during capture, so
  every host-side record (unit states, step counts, byte counters) advances as after one
  eager iteration.
- Every later call copies its inputs into the static ones, replays the graph, adds what the
  capture added to the host-side counters (``HostCounters``), and returns copies of the
  outputs (the graph's own outputs are overwritten by the next replay).

What must hold for a replay to equal an eager iteration, and how it is kept:
- No host read inside the iteration (a read during capture is an error from CUDA, so a
  violation cannot go unseen).
- Tensors that change between iterations are updated in place: the learning rate is a device
  tensor each param group holds (``AnnealingLR.step_on_device`` writes into it, and so does
  every other writer of a group's lr, through ``set_group_lr``: the host's schedule step at a
  log line or a checkpoint, DeepSpeed's schedules, a checkpoint's load; a replay refuses a
  replaced one), step counts and the skipped-step count live on the device and are added to
  in place.
- The fused optimizer runs with ``capturable`` state.
- The host queues at most ``MAX_REPLAYS_AHEAD`` replays ahead of the GPU (each replay records
  an event, and the host waits for the one two replays back), so a later read waits for one
  or two iterations, not for as many as CUDA's launch queue holds.
- An asynchronous checkpoint's copies of the masters and moments land before the next update
  ([Note: asynchronous checkpoint saves]): the eager step waits for them inside, which a
  capture may not do and a replay does not run, so the graph waits before the capture and
  before every replay.
Where one of these cannot hold (CPU, offload, a step decided on the host, a host-stepped lr
schedule, fp16's dynamic loss scaler, whose window counts on the host, DeepSpeed's unused
parameter check, its synchronized throughput timer or its wall-clock breakdown), ``capture_blockers``
names it, the engine says so in one line, and the iteration runs eagerly: nothing wrong is
ever captured.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_WARMUP_ITERATIONS = 3
# Replays the host may queue ahead of the GPU. A replay is one launch, so without a bound the
# host would run up to CUDA's queue depth ahead, and a log line's read would then wait for
# all of them at once (the watchdog, which times the host's steps, would see a stall).
MAX_REPLAYS_AHEAD = 2


@dataclass(frozen=True)
class CudaGraphOptions:
    """Whether and when to capture the iteration ([Note: iteration graphs])."""

    enabled: bool = False
    # Eager iterations before the capture: the first sets up optimizer state and the
    # engine's prefetch order, the second and third run as every later one will.
    warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS

    def __post_init__(self) -> None:
        if self.warmup_iterations < 1:
            raise ValueError("cuda_graph.warmup_iterations must be at least 1 (the first "
                             f"iteration sets up state a graph cannot), got {self.warmup_iterations}")


def capture_blockers(engine) -> list[str]:
    """Why ``engine``'s iteration cannot be captured; empty when it can."""
    reasons = []
    if engine.device.type != "cuda":
        reasons.append(f"the engine runs on {engine.device.type}, not CUDA")
        return reasons
    if engine.optimizer.offloaded:
        reasons.append("the optimizer step is offloaded to the host (ZeRO-Offload)")
    if not engine.defers_step_outcome:
        reasons.append("the step is decided on the host (a host read per step: fp16 with an "
                       "engine-owned schedule, qgZ error feedback, or an optimizer without a "
                       "fused device step)")
    if engine.loss_scaler.dynamic:
        reasons.append("fp16's dynamic loss scaler counts its window on the host")
    if engine.lr_scheduler is not None:
        reasons.append("the lr schedule is stepped on the host by the engine (the DeepSpeed "
                       "JSON's scheduler block); the training loop's schedule steps on the "
                       "device")
    if engine.sharded.weight_deltas is not None:
        reasons.append("weight deltas decide their keyframes on the host")
    if getattr(engine, "_params_with_gradient", None) is not None:
        reasons.append("zero_optimization.ignore_unused_parameters false counts the unused "
                       "parameters on the host at every step")
    config = getattr(engine, "config", None)
    if config is not None and config.timers.throughput.enabled \
            and config.timers.throughput.synchronized:
        reasons.append("timers.throughput.synchronized waits for the GPU at every step")
    if config is not None and config.wall_clock_breakdown:
        reasons.append("wall_clock_breakdown times every phase with CUDA events, which a "
                       "replay does not record")
    return reasons


class HostCounters:
    """What an iteration adds to the engine's host-side records, taken around the capture
    and added again after every replay, so that step counts and byte counters stay true."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._before: dict | None = None
        self.delta: dict | None = None

    def _read(self) -> dict:
        engine = self.engine
        # snapshot() returns fresh dicts: nothing here changes with the engine afterwards.
        return {"micro_steps": engine.micro_steps, "global_steps": engine.global_steps,
                "comm": engine.comm_stats.snapshot()}

    def begin(self) -> None:
        self._before = self._read()

    def end(self) -> None:
        after = self._read()
        before = self._before
        self.delta = {
            "micro_steps": after["micro_steps"] - before["micro_steps"],
            "global_steps": after["global_steps"] - before["global_steps"],
            "comm": {phase: {where: after["comm"][phase][where] - before["comm"][phase][where]
                             for where in after["comm"][phase]}
                     for phase in after["comm"]},
        }

    def apply(self) -> None:
        """Advance the records by one iteration's worth (after a replay)."""
        engine, delta = self.engine, self.delta
        engine.micro_steps += delta["micro_steps"]
        engine.global_steps += delta["global_steps"]
        for phase, sent in delta["comm"].items():
            for where, nbytes in sent.items():
                engine.comm_stats.record(phase, where == "inter_node", nbytes)


class IterationGraph:
    """``fn(*inputs) -> tensor or tuple of tensors``, run eagerly for the warm-up, then
    captured once and replayed ([Note: iteration graphs]). The host queues at most
    ``MAX_REPLAYS_AHEAD`` replays ahead of the GPU.

    ``inputs`` are device tensors of the same shapes and dtypes at every call (one per
    micro-batch, say). ``extra_blockers``: reasons the caller knows of why ``fn`` cannot be
    captured (said with the engine's). ``graph_factory`` and ``capture`` are for tests: the
    CUDA graph and its capture context by default, and ``event_factory`` the events that
    bound the run-ahead (CUDA events on CUDA; none elsewhere unless given)."""

    def __init__(self, engine, fn: Callable, options: CudaGraphOptions | None = None,
                 log: Callable[[str], None] | None = None,
                 graph_factory: Callable[[], object] | None = None,
                 capture: Callable | None = None, extra_blockers: Sequence[str] = (),
                 event_factory: Callable[[], object] | None = None) -> None:
        self.engine = engine
        self.fn = fn
        self.options = options or CudaGraphOptions(enabled=True)
        # A test's stand-in graph runs on the CPU, which the blockers would refuse.
        self.blockers = [*(capture_blockers(engine) if graph_factory is None else []),
                         *extra_blockers]
        self._log = log or (lambda message: None)
        self._graph_factory = graph_factory or torch.cuda.CUDAGraph
        self._capture = capture or _cuda_capture
        self._eager_left = self.options.warmup_iterations
        self._graph = None
        self._static_inputs: tuple[torch.Tensor, ...] = ()
        self._static_outputs = None
        self._counters = HostCounters(engine)
        self._lrs: list = []  # each param group's lr as the capture read it
        if event_factory is None and engine.device.type == "cuda":
            event_factory = torch.cuda.Event
        # A ring: replay i records event i % len and waits for the one recorded
        # MAX_REPLAYS_AHEAD replays before, which is the next to be recorded again.
        self._replay_done = ([event_factory() for _ in range(MAX_REPLAYS_AHEAD + 1)]
                             if event_factory is not None else [])
        self.replays = 0
        if self.blockers:
            self._log("cuda_graph: running eagerly, the iteration cannot be captured: "
                      + "; ".join(self.blockers))
        else:
            _prepare_optimizer_for_capture(engine)

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self, *inputs: torch.Tensor):
        if self.blockers:
            return self.fn(*inputs)
        if self._eager_left > 0:
            self._eager_left -= 1
            return self.fn(*inputs)
        if self._graph is None:
            self._record(inputs)
        else:
            _check_same_inputs(self._static_inputs, inputs)
            self._check_same_lrs()
            for static, given in zip(self._static_inputs, inputs, strict=True):
                static.copy_(given, non_blocking=True)
            self._counters.apply()
            # An asynchronous checkpoint's copies of the masters and moments come first:
            # the eager step waits for them inside (``before_update``), a replay runs no
            # Python, so the wait is issued here, before it.
            self.engine.optimizer.wait_for_checkpoint_copy()
        self._graph.replay()
        self.replays += 1
        self._bound_run_ahead()
        return _copied(self._static_outputs)

    def _record(self, inputs: Sequence[torch.Tensor]) -> None:
        self._static_inputs = tuple(x.detach().clone() for x in inputs)
        graph = self._graph_factory()
        self._counters.begin()
        # Again: a checkpoint loaded since the warm-up began may have brought step counts
        # back to the host.
        _prepare_optimizer_for_capture(self.engine)
        # A save in flight: its copies are waited for before the capture, and the step's own
        # wait is left out of it (a capture may not wait for work outside it).
        optimizer = self.engine.optimizer
        optimizer.wait_for_checkpoint_copy()
        wait, optimizer.before_update = optimizer.before_update, None
        try:
            with self._capture(graph):
                self._static_outputs = self.fn(*self._static_inputs)
        finally:
            if optimizer.before_update is None:
                optimizer.before_update = wait
        self._counters.end()
        self.engine.iteration_captured = True
        # The lr tensors the graph reads: every later write must go into them.
        self._lrs = [group["lr"] for group in optimizer.inner.param_groups]
        self._graph = graph
        self._log(f"cuda_graph: captured the iteration after {self.options.warmup_iterations} "
                  "eager ones; every later iteration is one graph launch")

    def _bound_run_ahead(self) -> None:
        ring = self._replay_done
        if not ring:
            return
        ring[self.replays % len(ring)].record()
        if self.replays > MAX_REPLAYS_AHEAD:
            ring[(self.replays - MAX_REPLAYS_AHEAD) % len(ring)].synchronize()

    def _check_same_lrs(self) -> None:
        groups = self.engine.optimizer.inner.param_groups
        if len(groups) != len(self._lrs) or any(
                group["lr"] is not lr for group, lr in zip(groups, self._lrs, strict=True)):
            raise RuntimeError("cuda_graph: a param group's lr was replaced after the capture, "
                               "which replays read from the tensor they captured: set it "
                               "with zeropp.acceleration.cuda_graph.set_group_lr (in place)")


def _cuda_capture(graph):
    # thread_local: only this thread's unsafe calls abort the capture (NCCL's watchdog
    # thread queries its events meanwhile).
    return torch.cuda.graph(graph, capture_error_mode="thread_local")


def _prepare_optimizer_for_capture(engine) -> None:
    """The torch optimizer's state capturable (step counts on the device, read there) and
    each group's lr a device tensor updated in place ([Note: iteration graphs])."""
    inner = engine.optimizer.inner
    on_cuda = engine.device.type == "cuda"
    for group in inner.param_groups:
        if on_cuda:  # the capture health check of torch's optimizers asks for it
            group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor):
            # The dtype each fused step reads a tensor lr in (as AnnealingLR's tables hold it).
            dtype = torch.float32 if on_cuda else torch.float64
            group["lr"] = torch.tensor(float(group["lr"]), dtype=dtype, device=engine.device)
        hold_lr(group["lr"])
    for state in inner.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != engine.device:
            state["step"] = step.to(engine.device, torch.float32)


# The lr tensors captured iterations read, by id (with a weak reference, so a reused id is
# not taken for one): ``set_group_lr`` writes these in place.
_held_lrs: dict[int, weakref.ref] = {}


def hold_lr(tensor: torch.Tensor) -> None:
    """Mark a param group's 0-dim lr tensor as read by a captured iteration: from now on
    ``set_group_lr`` writes into it instead of replacing it."""
    key = id(tensor)
    # The entry goes with the tensor (the callback runs before its id can be reused).
    _held_lrs[key] = weakref.ref(tensor, lambda _, key=key: _held_lrs.pop(key, None))


def set_group_lr(group: dict[str, Any], lr: float) -> None:
    """Set a param group's lr (every schedule and a checkpoint's load set it through this).
    An lr tensor a captured iteration reads (``hold_lr``) is written in place, never
    replaced: a replayed graph reads the tensor it captured, so a new one would leave it
    stepping with memory freed since. Any other value is replaced by ``lr``, a float, as
    torch's non-fused optimizers need."""
    held = group["lr"]
    ref = _held_lrs.get(id(held))
    if ref is not None and ref() is held:
        held.fill_(lr)
    else:
        group["lr"] = lr


def _check_same_inputs(static: tuple[torch.Tensor, ...], given: Sequence[torch.Tensor]) -> None:
    if len(static) != len(given) or any(
            s.shape != g.shape or s.dtype != g.dtype for s, g in zip(static, given, strict=True)):
        shapes = [tuple(g.shape) for g in given]
        raise ValueError(f"cuda_graph: the iteration's inputs changed shape or dtype after the "
                         f"capture ({[tuple(s.shape) for s in static]} captured, {shapes} "
                         "given); a captured iteration needs fixed shapes")


def _copied(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(o.clone() if isinstance(o, torch.Tensor) else o for o in outputs)
    return outputs
