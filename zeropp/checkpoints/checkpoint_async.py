"""Asynchronous checkpoint saves: host staging buffers and the save in flight.

[Note: asynchronous checkpoint saves]
``save(..., async_save=True)`` returns as soon as the rank's state is safe from training:
1. On the training thread, the small state (counters, loss scaler, schedules, RNG states,
   qgZ's error feedback, the client state) is copied to the host, and ``TAG.tmp`` created
   (one agreement, as a synchronous save).
2. The large state, each unit's fp32 master shard and optimizer moments, goes into staging
   buffers (``ShardStaging``) that live as long as the engine and are reused by every save, so
   host memory does not grow with the number of saves. On CUDA they are pinned and filled by
   copies on a side stream, issued from the training thread: the next update's stream waits
   for them on the device, the host never does. On the CPU the background thread copies them,
   and the next optimizer update waits until it has (``PartitionedOptimizer.before_update``):
   forward and backward of the next iteration run meanwhile, since they do not write the
   masters or moments.
3. The background thread writes the shard file exactly as a synchronous save does
   ([Note: checkpoint writes at disk speed]): CRC-32 on the way, fsync at the end, at the
   lowest CPU priority ([Note: the writer yields to training]). It issues
   no collective: on NCCL a collective from a second thread could interleave differently with
   the training thread's on different ranks ([Note: GPU execution model] in DESIGN.md).
4. Publishing needs every rank's file to be durable. The ranks agree on that from the
   training thread at iteration boundaries: ``finish_pending(wait=False)`` all-reduces one
   flag (MIN of "my writer is done"), so all ranks see the same answer at the same boundary,
   and once all are done the synchronous save's own commit runs (gather the checksums, rank 0
   writes ``meta.json``, renames ``TAG.tmp`` to ``TAG``, then replaces ``latest``). A failed
   writer is reported there, on every rank, as the synchronous save reports it. The flag
   costs one small all-reduce per iteration while a save is in flight, and nothing otherwise.
   A file marker per rank that rank 0 waits for would avoid it, but leaves the other ranks
   without word of a failure, and a shared file system without a reliable view of it.
At most one save is in flight: the next save, a load and the end of training finish it
first (``finish_pending(wait=True)``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from zeropp.checkpoints.checkpoint_io import save_to_file
from zeropp.offload import HostMemory


class ShardStaging:
    """Host buffers for each unit's fp32 master shard and element-wise optimizer state,
    made at the first save and reused (pinned where the engine runs on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        # Host memory as the engine allocates it for offload: pinned CPU memory on CUDA, the
        # meta device on the simulated cluster, counted there on the host lane.
        self._host = HostMemory(device, pin_memory=True)
        self.state_keys: tuple[str, ...] = ()
        self._buffers: list[dict[str, torch.Tensor]] = []

    def refresh(self, optimizer, units) -> None:
        """Buffers for this save's fields (the optimizer's state appears at its first step)."""
        self.state_keys = tuple(optimizer.state_keys())
        fields = ("master", *self.state_keys)
        while len(self._buffers) < len(units):
            self._buffers.append({})
        for buffers, unit in zip(self._buffers, units, strict=False):
            numel = unit.layout.shard_numel
            for field in fields:
                if field not in buffers or buffers[field].numel() != numel:
                    buffers[field] = self._host.empty(numel, torch.float32)
            for field in [f for f in buffers if f not in fields]:
                del buffers[field]

    def unit_buffers(self, index: int) -> dict[str, torch.Tensor]:
        return self._buffers[index]

    def fill(self, optimizer) -> None:
        """Copy every unit's master shard and moments into the buffers (non-blocking copies
        into pinned memory on CUDA: the caller orders them)."""
        with torch.no_grad():
            for index, buffers in enumerate(self._buffers):
                optimizer.shard_master(index, out=buffers["master"])
                if self.state_keys:
                    optimizer.shard_state(index, out=buffers)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self._buffers for t in b.values())


def staging_nbytes(units, state_keys: int) -> int:
    """Host bytes an asynchronous save stages for these units: an fp32 master and
    ``state_keys`` fp32 moments per shard element (what ``ShardStaging`` allocates)."""
    return sum(unit.layout.shard_numel for unit in units) * 4 * (1 + state_keys)


def staging_for(engine) -> ShardStaging:
    staging = engine._checkpoint_staging
    if staging is None:
        staging = ShardStaging(engine.sharded.device)
        engine._checkpoint_staging = staging
    staging.refresh(engine.optimizer, engine.sharded.units)
    return staging


WRITER_NICENESS = 19  # the lowest priority: the writer runs on what training leaves idle


def yield_to_training() -> None:
    """Lower the calling thread's CPU priority for the rest of its life ([Note: the writer
    yields to training]); where the system cannot (no per-thread priority), nothing changes.

    [Note: the writer yields to training]
    Once the shards are staged, the writer still has CPU work to do (torch.save's pickling
    and record CRCs, the copy into the aligned chunks, the file's CRC-32, the system calls),
    and it competes with training for the cores: with the other processes of a busy host,
    or with training's own threads where they fill every core. At the lowest priority the
    writer runs mostly on cycles training leaves idle (a spare core, the host threads of a
    GPU job waiting on the device): the save takes longer to publish, training slows less
    (docs/checkpoints.md has the figures). The staging copy runs at normal priority, since
    the next optimizer update waits for it. On Linux priority is per thread, so only the
    writer (and the chunk-writing thread it starts, which inherits it) is lowered.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    except (AttributeError, OSError):  # no per-thread priority here: the write still happens
        pass


class PendingSave:
    """One rank's shard of a save: staged, written (here or on a background thread), then
    committed by ``zeropp.checkpoints.checkpoint._commit``."""

    def __init__(self, engine, staging: ShardStaging, state: dict, path: Path, tmp_dir: Path,
                 final_dir: Path, tag: str, save_latest: bool = True) -> None:
        self.engine = engine
        self.save_latest = save_latest  # read by the commit, now or when the writer is done
        self.staging = staging
        self.state = state
        self.path, self.tmp_dir, self.final_dir, self.tag = path, tmp_dir, final_dir, tag
        self.crc32, self.nbytes = 0, 0
        self.error: BaseException | None = None
        self._staged = threading.Event()
        self._copied_on_device: torch.cuda.Event | None = None
        self._thread: threading.Thread | None = None

    def run_here(self) -> None:
        """The synchronous save: stage and write on the calling thread."""
        try:
            self.staging.fill(self.engine.optimizer)
            if self.staging.pinned:
                torch.cuda.current_stream().synchronize()
            self._write()
        except Exception as error:  # agreed in the commit, so no rank waits for one that failed
            self.error = error

    def start(self) -> None:
        optimizer = self.engine.optimizer
        if self.staging.pinned:
            # Copies on a side stream, after the work queued so far; the next update's stream
            # waits for them on the device.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.staging.fill(optimizer)
            self._copied_on_device = torch.cuda.Event()
            self._copied_on_device.record(side)
            self._staged.set()
            event = self._copied_on_device
            optimizer.before_update = lambda: torch.cuda.current_stream().wait_event(event)
        else:
            optimizer.before_update = self._staged.wait
        self._thread = threading.Thread(target=self._run_in_background, daemon=True,
                                        name=f"checkpoint-writer-{self.tag}")
        self._thread.start()

    def _run_in_background(self) -> None:
        try:
            if self._copied_on_device is not None:
                self._copied_on_device.synchronize()
            else:
                self.staging.fill(self.engine.optimizer)
        except Exception as error:
            self.error = error
        finally:
            self._staged.set()
        if self.error is None:
            yield_to_training()
            try:
                self._write()
            except Exception as error:
                self.error = error

    def _write(self) -> None:
        self.crc32, self.nbytes = save_to_file(self.state, self.path)

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def all_ranks_done(self) -> bool:
        """Collective: whether every rank's writer has finished (written or failed)."""
        flag = torch.tensor([1 if self.done else 0], device=self.engine.sharded.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def join(self) -> None:
        """Wait for this rank's writer; the optimizer no longer waits for anything."""
        if self._thread is not None:
            self._thread.join()
        self.engine.optimizer.before_update = None
        self.state = {}  # the staging buffers stay; the rest of the snapshot goes
