"""The simulated GPU cluster: one process plays rank r of N GPUs, on the meta device.

- ``simulated_process_group``: torch.distributed with a backend that moves no data but
  enforces what NCCL requires (tensors on the engine's device, collectives from the training
  thread, async tensors held until ``wait()``) and records each communicator's issue order.
- ``MemoryTracker``: live and peak bytes of the simulated device, by category.
- ``TraceRecorder``: one iteration as an ``IterationTrace`` (kernels with FLOPs and bytes,
  launches of collectives on lanes, waits), for the step-time model.
- ``HostSyncCounter``: host reads of device values (``item``, ``bool``, ``tolist``, ``cpu``),
  by call site.
- ``OpCounter``: every op dispatched, by name, as the host issues it.

Under it, ``zeropp.initialize`` puts the engine on the meta device with the CUDA execution
model (streams become no-ops), so what is measured is the GPU path, not the CPU one.
``megatron_lite.simulate`` runs the training program this way.
"""

from zeropp.simulation.backend import compare_orders, simulated_process_group
from zeropp.simulation.measure import HostSyncCounter, MemoryTracker, OpCounter
from zeropp.simulation.tracing import TraceRecorder

__all__ = ["HostSyncCounter", "MemoryTracker", "OpCounter", "TraceRecorder", "compare_orders",
           "simulated_process_group"]
