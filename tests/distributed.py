"""Run a function on N gloo ranks in fresh processes and collect what each rank returns."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, fn, args, out_dir, env):
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A file store, not a TCP port: nothing to collide with when many tests run back to back.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException as exc:  # report the failure to the parent with its traceback
        payload = ("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}")
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(payload, f)
    # The result is on disk: leave without C++ teardown. Under load a worker sometimes aborted
    # in it ("terminate called without an active exception") after its work was done, which
    # failed a test that had passed; what a test checks never depends on the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, env: dict | None = None, timeout: float = 300) -> list:
    """``fn(rank, world_size, *args)`` on each rank; returns the per-rank results in order.

    ``fn`` must be a module-level function (it is pickled into spawned processes).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, fn, args, out_dir, dict(env or {})),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise AssertionError(f"{world_size} ranks did not finish within {timeout} s")
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(value)
            results.append(value)
        return results
