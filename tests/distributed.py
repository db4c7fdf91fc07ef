"""Run a function on N gloo ranks in worker processes and collect what each rank returns.

[Note: rank pool]
Starting a rank costs a Python interpreter importing torch (about 1.7 s of CPU), more than
many of the tests spend in their ranks. So ranks come from a pool of workers per world size,
started once per test session and reused: each call builds a process group in a fresh file
store, runs the function, leaves the group together (a barrier), destroys it and restores
the environment. A call that fails (on any rank: the parent does not wait for the others)
or times out kills its pool, so the next test starts from fresh processes, as does a call with
an ``env`` (a variable may be read at import time). ``ZEROPP_TEST_FRESH_RANKS=1`` starts fresh
processes for every call.

Pool workers are forked from a server (multiprocessing's forkserver) that imported torch,
torch._dynamo (which torch imports at the first optimizer or meta-tensor operation, about
1.2 s of CPU) and the engine once: a worker starts without importing any of them again. The
server imports nothing else, starts no thread and touches no device, so forking it is safe;
fresh ranks (an ``env``) are spawned, since what they import must see that environment.

A worker retires after a call that leaves it with more than ``RETIRE_THREADS`` native threads,
and the next call starts a fresh pool. Some calls leave threads behind that
destroy_process_group does not return, and the suite's pools live for its whole run: once a
4-rank pool after 6 calls spent 12% of a core idle, and one late in a suite run held about
550 threads per rank. A call that builds, trains and closes a ZeRO-3 or ZeRO++ engine (hpZ,
qwZ, qgZ or CPU offload) leaves none, so what stays behind comes from some tests' own
objects; the retirement bounds it whatever holds it.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp

RETIRE_THREADS = 128
# What the pool's fork server imports once for all its workers ([Note: rank pool]).
FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zeropp",
                       "tests.distributed"]


def _native_threads() -> int:
    """This process's threads as the kernel counts them (0 where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


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


def _pool_worker(rank: int, world_size: int, tasks, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    base_env = dict(os.environ)
    while (task := tasks.get()) is not None:
        fn, args, store = task
        try:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                    world_size=world_size)
            payload = ("ok", fn(rank, world_size, *args))
            # Leave the group together: a rank that destroyed it at once could close its
            # connections while another rank is still making them (gloo's full mesh).
            dist.barrier()
        except BaseException as exc:  # reported to the parent with its traceback
            payload = ("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}")
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(base_env)
        try:
            data = pickle.dumps(payload)
        except Exception as exc:  # an unpicklable result: say so instead of losing it
            data = pickle.dumps(("error", f"rank {rank}: result not picklable: {exc!r}"))
        retire = _native_threads() > RETIRE_THREADS
        results.put((rank, data, retire))
        sys.stdout.flush()
        sys.stderr.flush()
        if retire:
            return


class _RankPool:
    """``world_size`` workers waiting for calls ([Note: rank pool])."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)  # read when the server starts
        self.world_size = world_size
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.retiring = False
        self.processes = [ctx.Process(target=_pool_worker, daemon=True,
                                      args=(rank, world_size, self.tasks[rank], self.results))
                          for rank in range(world_size)]
        for process in self.processes:
            process.start()

    def alive(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def run(self, fn, args: tuple, timeout: float) -> list:
        with tempfile.TemporaryDirectory() as store_dir:
            for queue in self.tasks:
                queue.put((fn, args, os.path.join(store_dir, "store")))
            payloads: dict[int, tuple] = {}
            deadline = time.monotonic() + timeout
            while len(payloads) < self.world_size:
                try:
                    rank, data, retire = self.results.get(timeout=1.0)
                except queue_module.Empty:
                    if not self.alive() and not self.retiring:
                        raise AssertionError(f"a rank of {self.world_size} died") from None
                    if time.monotonic() > deadline:
                        raise AssertionError(f"{self.world_size} ranks did not finish within "
                                             f"{timeout} s") from None
                    continue
                payloads[rank] = pickle.loads(data)
                self.retiring |= retire
                if payloads[rank][0] != "ok":  # the other ranks may wait for it forever
                    raise AssertionError(payloads[rank][1])
        results = []
        for rank in range(self.world_size):
            status, value = payloads[rank]
            if status != "ok":
                raise AssertionError(value)
            results.append(value)
        return results

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.join()


_POOLS: dict[int, _RankPool] = {}


def run_ranks(fn, world_size: int, *args, env: dict | None = None, timeout: float = 300) -> list:
    """``fn(rank, world_size, *args)`` on each rank; returns the per-rank results in order.

    ``fn`` must be a module-level function (it is pickled into the rank processes).
    """
    if env or os.environ.get("ZEROPP_TEST_FRESH_RANKS") == "1":
        return _run_fresh(fn, world_size, args, env, timeout)
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        pool = _POOLS[world_size] = _RankPool(world_size)
    try:
        results = pool.run(fn, args, timeout)
        if pool.retiring:  # its workers have returned or are idle: replace them next call
            _POOLS.pop(world_size, None)
            pool.kill()
        return results
    except BaseException:
        # a failed call may leave a rank inside a collective: the next call starts afresh
        _POOLS.pop(world_size, None)
        pool.kill()
        raise


def _run_fresh(fn, world_size: int, args: tuple, env: dict | None, timeout: float) -> list:
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
