"""One training iteration of one rank as a trace: what the step-time model replays.

Recorded on the simulated GPU cluster (meta tensors, the engine's CUDA execution model run
inline), in the order the training thread issues things:

- ``ComputeOp``: one kernel on the compute stream, with its FLOPs and the bytes it reads and
  writes;
- ``Launch``: one or more collectives issued together on a side lane ("gather" or "reduce",
  the CUDA execution model's side streams; see zeropp/comm/streams.py). The lane first waits
  for the compute stream (its inputs were written there), then runs its collectives in order,
  and the kernels the launch runs on the lane itself (``compute_ops``: qwZ's quantize, qgZ's
  swizzle and requantization, a reduce-scatter's input cast); its completion kernels
  (``completion_ops``: qwZ's dequantize) run after them on the lane's completion stream;
- ``Wait``: the compute stream waits for a launch to finish (``Pending.wait()``); a
  sequence's completion (qgZ's last sum) follows it as compute-stream ops;
- a collective issued on the compute stream itself (the gradient norm's all-reduce) is a
  ``Launch`` with lane "compute": the compute stream runs it in place;
- ``HostSync``: the host reads a device value (``item()``, ``cpu()``): it waits until the
  compute stream has run everything issued before, and issues nothing meanwhile.

The host issues every kernel and collective, in this order: [Note: host in the step-time
model] in zeropp/planning/step_time.py says what that costs.

The trace holds no times: a cluster description turns FLOPs and bytes into seconds
(zeropp.planning.step_time). ``zeropp.simulation.tracing.TraceRecorder`` records one (its rules:
[Note: trace recording rules]); ``megatron_lite.simulate`` records a steady iteration
(``--trace FILE.json``), ``IterationTrace.to_json``/``from_json`` store it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ComputeOp:
    """One operator on the compute stream."""

    name: str  # the aten op, e.g. "aten.mm.default"
    flops: float  # torch.utils.flop_counter's count; 0 for ops it does not count
    bytes: int  # bytes of the device tensors it reads plus those it writes
    phase: str  # "forward", "backward" or "optimizer"
    # Where it runs with ZeRO-Offload ([Note: offload] in zeropp/offload.py): "device" (a
    # kernel), "host" (the host's CPU, on host memory: the offloaded optimizer step), or
    # "to_host" / "to_device" (a copy across PCIe; ``bytes`` is what crosses the bus).
    where: str = "device"


@dataclass(frozen=True)
class Collective:
    """One collective as this rank sees it."""

    name: str  # "all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast"
    group: tuple[int, ...]  # the global ranks of its communicator
    input_bytes: int  # this rank's input buffer
    output_bytes: int  # this rank's output buffer


@dataclass(frozen=True)
class Launch:
    """Collectives issued together on one lane, run in order there."""

    id: int
    lane: str  # "gather", "reduce" or "compute"
    collectives: tuple[Collective, ...]
    phase: str
    # Kernels run on the lane itself, around its collectives (their relative order is not
    # kept: a lane runs all of it serially). Always () on lane "compute".
    compute_ops: tuple[ComputeOp, ...] = ()
    # How many of the last collectives the lane leaves in flight on their own communicators
    # (a sequence's slow hop, received at ``Wait``): the lane goes on to its next launch
    # once they are issued, and the launch ends when they do.
    in_flight: int = 0
    # Kernels of its completion step on the lane's completion stream, after its collectives
    # (qwZ's dequantize); a Wait for the launch waits for them too.
    completion_ops: tuple[ComputeOp, ...] = ()


@dataclass(frozen=True)
class Wait:
    """The compute stream waits until launch ``launch_id`` has finished."""

    launch_id: int


@dataclass(frozen=True)
class HostSync:
    """The host reads a device value, at ``site`` ("path:LINE in function")."""

    site: str = ""


Event = ComputeOp | Launch | Wait | HostSync


def launches_kernel(op: ComputeOp) -> bool:
    """Whether the op runs a kernel (it moves bytes or computes): views, allocations and
    metadata do not reach the GPU, so they are not charged as launches."""
    return op.where != "host" and (op.bytes > 0 or op.flops > 0)


@dataclass
class IterationTrace:
    """One rank's steady-state iteration (all its micro-batches and the optimizer step)."""

    rank: int
    world_size: int
    ranks_per_node: int
    tokens_per_iteration: int  # this rank's tokens (micro batch x seq x accumulation)
    model_flops_per_iteration: float  # Megatron's formula for those tokens (the TFLOPs basis)
    dtype_bytes: int  # bytes per element of the working dtype
    events: list[Event] = field(default_factory=list)

    # -- helpers ---------------------------------------------------------------------------
    def compute_ops(self, phase: str | None = None) -> list[ComputeOp]:
        """The compute stream's ops (``phase``: only those of that phase)."""
        return [e for e in self.events if isinstance(e, ComputeOp)
                and (phase is None or e.phase == phase)]

    def launches(self, lane: str | None = None) -> list[Launch]:
        return [e for e in self.events if isinstance(e, Launch)
                and (lane is None or e.lane == lane)]

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data: the header fields and ``events``, a list of dicts with a "type" key
        ("compute", "launch", "wait" or "sync"); a launch's collectives and compute_ops are lists of
        dicts, a collective's group a list of ranks."""
        out = {k: v for k, v in asdict(self).items() if k != "events"}
        out["events"] = [_event_to_dict(e) for e in self.events]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IterationTrace:
        header = {k: v for k, v in data.items() if k != "events"}
        return cls(**header, events=[_event_from_dict(e) for e in data["events"]])

    def to_json(self, path: str | None = None) -> str:
        """The trace as JSON text (also written to ``path`` when given)."""
        text = json.dumps(self.to_dict())
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text: str) -> IterationTrace:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str) -> IterationTrace:
        with open(path) as f:
            return cls.from_json(f.read())


def _event_to_dict(event: Event) -> dict[str, Any]:
    if isinstance(event, ComputeOp):
        return {"type": "compute", **asdict(event)}
    if isinstance(event, Launch):
        return {"type": "launch", "id": event.id, "lane": event.lane, "phase": event.phase,
                "collectives": [asdict(c) | {"group": list(c.group)} for c in event.collectives],
                "compute_ops": [asdict(op) for op in event.compute_ops],
                "in_flight": event.in_flight,
                "completion_ops": [asdict(op) for op in event.completion_ops]}
    if isinstance(event, Wait):
        return {"type": "wait", "launch_id": event.launch_id}
    if isinstance(event, HostSync):
        return {"type": "sync", "site": event.site}
    raise TypeError(f"not a trace event: {event!r}")


def _event_from_dict(data: dict[str, Any]) -> Event:
    kind = data["type"]
    fields = {k: v for k, v in data.items() if k != "type"}
    if kind == "compute":
        return ComputeOp(**fields)
    if kind == "launch":
        fields["collectives"] = tuple(
            Collective(**(c | {"group": tuple(c["group"])})) for c in fields["collectives"])
        for key in ("compute_ops", "completion_ops"):
            fields[key] = tuple(ComputeOp(**op) for op in fields.get(key, ()))
        return Launch(**fields)
    if kind == "wait":
        return Wait(**fields)
    if kind == "sync":
        return HostSync(**fields)
    raise ValueError(f"unknown trace event type {kind!r}")
