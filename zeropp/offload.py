"""ZeRO-Offload: model states in host memory, the optimizer step on the host.

[Note: offload]
``offload_optimizer: {"device": "cpu"}`` keeps each rank's fp32 master shard, its optimizer
moments and the step's fp32 gradients in host memory (pinned on CUDA, so the copies are DMA
transfers that do not stall the host): at each step the reduced gradient shards cross to the
host in one copy, the torch optimizer's multi-tensor update runs there, and the updated
weights cross back already cast to the working 16-bit dtype (half the bytes of fp32). The
device keeps only the 16-bit working and gradient shards. ``offload_param: {"device":
"cpu"}`` (stage 3) moves the 16-bit working shards to the host too: every gather starts with
its shard's host-to-device copy, made on the gather's lane so it overlaps compute as the
gather does.

The arithmetic is the arithmetic without offload: the same casts, the same sums in the same
order, the same torch update. On a CPU job host and device are one memory, so an offloaded
run is bit-exact with the run without offload (the tests hold it there); on CUDA the update
runs on the CPU's kernels instead of the GPU's, which round alike for AdamW's element-wise
arithmetic.

With the optimizer offloaded the gradient shards live in host memory too: each unit's
reduction delivers into a device buffer, which crosses to the host as soon as that reduction
completes (``GradientDelivery``: on CUDA a copy on a stream of its own into pinned memory,
overlapped with the rest of backward, added into the shard once it has landed), so the
device holds no gradient shard between a unit's reduction and the step.

The host step needs the gradient norm before it can update, and the weights it writes are
read by the next forward: an offloaded step reads the norm on the host (one sync per step,
as DeepSpeed's offloaded step has) instead of deciding on the device ([Note: step outcome on
the device]).

On the simulated GPU cluster (meta tensors), host tensors are meta tensors allocated on the
host lane ([Note: allocation lanes]): the memory tracker counts them as host memory, apart
from the device's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from zeropp.comm.streams import HOST_LANE, allocating_on


@dataclass(frozen=True)
class OffloadOptions:
    """Which model states live in host memory ([Note: offload])."""

    optimizer: bool = False  # fp32 masters, optimizer moments, the step's fp32 gradients
    params: bool = False  # the 16-bit working shards (stage 3)
    pin_memory: bool = True  # page-locked host buffers on CUDA (DeepSpeed's pin_memory)

    @classmethod
    def from_zero_config(cls, zero) -> OffloadOptions:
        """``zero_optimization``'s ``offload_optimizer`` / ``offload_param`` blocks."""
        optimizer, params = zero.offloads_optimizer, zero.offloads_params
        pinned = [block.pin_memory for block, on in ((zero.offload_optimizer, optimizer),
                                                     (zero.offload_param, params)) if on]
        return cls(optimizer=optimizer, params=params, pin_memory=any(pinned))


class HostMemory:
    """Allocates host buffers for a device: ``cpu`` for a CUDA or CPU job (pinned on CUDA
    where asked), the meta device on the simulated cluster, counted on the host lane."""

    def __init__(self, device: torch.device, pin_memory: bool = True) -> None:
        self.device = torch.device("meta") if device.type == "meta" else torch.device("cpu")
        self.pin = pin_memory and device.type == "cuda"

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with allocating_on(HOST_LANE):
            return torch.zeros(numel, dtype=dtype, device=self.device, pin_memory=self.pin)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with allocating_on(HOST_LANE):
            return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pin)

    def running(self):
        """A context in which what torch allocates counts as host memory (the host step)."""
        return allocating_on(HOST_LANE)


class GradientDelivery:
    """Reduced gradients into shards held in host memory ([Note: offload]).

    On CUDA ``add`` starts the device-to-host copy on a stream of its own and returns: the
    host adds the landed values into the shard later (``finish``, also called at the next
    ``add`` for copies already done), holding the device buffer until its copy has read it.
    Elsewhere host and device memory are one and the addition happens at once.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        # (copy done, host values, target shard, device buffers kept alive until then)
        self._in_flight: deque[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor,
                                     tuple[torch.Tensor, ...]]] = deque()

    def add(self, grad_shard: torch.Tensor, reduced: torch.Tensor) -> None:
        if self._stream is None:
            with allocating_on(HOST_LANE):  # the host's work (a cast's temporary included)
                grad_shard.add_(reduced)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            # In the shard's dtype before it crosses (qgZ delivers fp32 sums): half the bytes
            # for 16-bit shards, which hold one reduction per step, so rounding first and
            # adding to their zeros rounds exactly once, as the addition would.
            crossing = reduced.to(grad_shard.dtype)
            landed = torch.empty(crossing.shape, dtype=crossing.dtype, pin_memory=True)
            landed.copy_(crossing, non_blocking=True)
            done = self._stream.record_event()
        # Both device buffers are read on this stream: held until the copy is done, so the
        # allocator does not hand them to the compute stream meanwhile.
        self._in_flight.append((done, landed, grad_shard, (reduced, crossing)))
        self._settle(wait=False)

    def finish(self) -> None:
        """Every delivery added into its shard (before anything reads the shards)."""
        self._settle(wait=True)

    def _settle(self, wait: bool) -> None:
        while self._in_flight and (wait or self._in_flight[0][0].query()):
            done, landed, grad_shard, _ = self._in_flight.popleft()
            done.synchronize()
            grad_shard.add_(landed)
