"""A torch.distributed backend that moves no data but enforces what NCCL requires.

One process plays rank ``r`` of ``N`` with its tensors on the ``meta`` device. The gloo/CPU
path hides mistakes that NCCL punishes, so every collective issued through this backend is
checked and recorded:

1. device: every tensor must be on the engine's device (NCCL rejects a CPU tensor);
2. thread: every collective must come from the thread that opened the simulation (NCCL
   issues on the caller's current stream; a collective from a helper thread races the
   training thread's issue order across ranks and deadlocks);
3. order: per communicator, the sequence of operations (NCCL matches collectives by their
   position in the communicator's stream, so ranks must issue the same sequence);
4. async lifetime: an async collective's Work holds its input and output tensors until
   ``wait()``, as ProcessGroupNCCL does, so memory measurements see that cost;
5. counts and input bytes, by op and communicator.

Plumbing (torch 2.13): the backend is a Python subclass of ``ProcessGroup``. When a
registered creator returns a ``ProcessGroup`` subclass, ``_new_process_group_helper`` uses
that object *as* the group, so ``dist.all_reduce`` etc. call the Python methods below
directly (the C++ per-device dispatch is bypassed, which is what lets meta tensors through).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.futures import Future

from zeropp.comm import collectives as engine_collectives
from zeropp.deepspeed_api.initialize import SIMULATED_BACKEND

# zeropp.initialize puts the engine on the meta device when the process group is this one.
BACKEND_NAME = SIMULATED_BACKEND

# A communicator is named by the global ranks of its group. A second group over the same
# ranks is a different NCCL communicator with its own order, so it gets a "#2" suffix
# (new_group is called in the same order on every rank, so the suffixes agree across ranks).
CommKey = tuple  # tuple[int, ...] or tuple[int, ..., str]


class OpRecord(NamedTuple):
    """One issued operation, comparable across ranks."""

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    detail: str | None  # the reduce op ("SUM"), or the root of a rooted op ("root=0")

    def __str__(self) -> str:
        parts = [f"{tuple(s)} {d}" for s, d in zip(self.shapes, self.dtypes, strict=True)]
        if self.detail:
            parts.append(self.detail)
        return f"{self.op}({', '.join(parts)})"


@dataclass(frozen=True)
class Violation:
    rule: str  # "device" or "thread"
    message: str
    site: str  # "path:line in function" of the program's call

    def __str__(self) -> str:
        return f"{self.message} (at {self.site})"


def format_comm(key: CommKey) -> str:
    """``[0..63]`` for a contiguous rank range, else the list; ``#k`` for repeated groups."""
    ranks = [r for r in key if isinstance(r, int)]
    suffix = "".join(f" {s}" for s in key if isinstance(s, str))
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"[{ranks[0]}..{ranks[-1]}]{suffix}"
    return f"{ranks}{suffix}"


class Simulation:
    """What one simulated rank observed. Shared by every group of the process."""

    def __init__(self, rank: int, world_size: int, device: torch.device, strict: bool):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.strict = strict
        self.thread = threading.current_thread()
        self.violations: list[Violation] = []
        self.counts: Counter[tuple[str, CommKey]] = Counter()  # (op, communicator) -> issued
        self.bytes: Counter[tuple[str, CommKey]] = Counter()  # (op, communicator) -> input bytes
        self.async_counts: Counter[str] = Counter()  # op -> issued with async_op=True
        self.in_flight = 0  # async works not yet waited
        self.max_in_flight = 0
        self._orders: dict[CommKey, list[OpRecord]] = {}
        # Communicators that existed at the last communicators_ready(): a first collective on
        # one of them is a violation.
        self._ready: set[CommKey] = set()

    def communicators_ready(self) -> None:
        """Training starts: every communicator that exists now must have been used (so
        created, on NCCL) already ([Note: eager communicators] in zeropp.topology)."""
        self._ready = set(self._orders)

    # -- results -------------------------------------------------------------------------

    def order_signature(self) -> dict[CommKey, list[OpRecord]]:
        """``{communicator: [OpRecord, ...]}`` for every group this rank belongs to."""
        return {key: list(ops) for key, ops in self._orders.items()}

    def counts_by_op(self) -> Counter[str]:
        totals: Counter[str] = Counter()
        for (op, _), n in self.counts.items():
            totals[op] += n
        return totals

    def summary(self) -> str:
        lines = [f"rank {self.rank}/{self.world_size} on {self.device}: "
                 f"{sum(self.counts.values())} collectives, max {self.max_in_flight} in flight, "
                 f"{self.in_flight} never waited, {len(self.violations)} violations"]
        for (op, key), n in sorted(self.counts.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            lines.append(f"  {op:<24} {format_comm(key):<20} x{n:<6} "
                         f"{self.bytes[(op, key)] / 2**20:12.1f} MiB in")
        lines += [f"  ! {v}" for v in self.violations]
        return "\n".join(lines)

    # -- used by the groups ----------------------------------------------------------------

    def _new_communicator(self, ranks: tuple[int, ...]) -> CommKey:
        key: CommKey = ranks
        copy = 1
        while key in self._orders:
            copy += 1
            key = (*ranks, f"#{copy}")
        self._orders[key] = []
        return key

    def _violation(self, rule: str, message: str, site: str) -> None:
        violation = Violation(rule, message, site)
        if self.strict:
            raise RuntimeError(str(violation))
        self.violations.append(violation)


_current: Simulation | None = None
_registered = False


def current_simulation() -> Simulation | None:
    """The simulation opened by ``simulated_process_group``, if one is open."""
    return _current


# -- call sites ------------------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# Wrappers between the program and torch (``typing_extensions.deprecated`` wraps
# ``all_gather_into_tensor``) are not the program's call site either.
_SKIP_FILES = {__file__} | {
    getattr(sys.modules.get(name), "__file__", None)
    for name in ("typing_extensions", "warnings", "functools", "contextlib")
}
# The engine's own functions that call a group's methods ([Note: issued to the process group]):
# the call site is what called them.
_ISSUING_CODES = {function.__code__ for function in (
    engine_collectives.all_gather_into_tensor, engine_collectives.reduce_scatter_tensor,
    engine_collectives.all_to_all)}  # the first two are one code object, which all_to_all calls
# torch's object collectives put their pickles on the backend's object device (the current
# CUDA device under NCCL; here the CPU, since a Python group registers no device). That is
# legitimate, so their tensors are exempt from the device rule.
_OBJECT_COLLECTIVES = {
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
    "send_object_list", "recv_object_list",
}


def _call_site() -> tuple[str, bool]:
    """The innermost frame outside torch and this file, and whether an object collective
    of torch's is on the way there."""
    frame = sys._getframe(1)
    from_object_collective = False
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(_TORCH_DIR):
            from_object_collective |= code.co_name in _OBJECT_COLLECTIVES
        elif code.co_filename not in _SKIP_FILES and code not in _ISSUING_CODES:
            return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}", from_object_collective
        frame = frame.f_back
    return "<unknown>", from_object_collective


# -- object collectives ----------------------------------------------------------------------
# No data moves, but torch unpickles what object collectives receive, so their CPU buffers
# get plausible contents: a gather delivers this rank's object from every rank (the SPMD
# assumption), and a receive from another rank (broadcast/scatter/recv) delivers ``None``
# objects, since what another rank holds is unknown here.

_NONE_PICKLE = torch.tensor(list(pickle.dumps(None)), dtype=torch.uint8)


def _copy_to_all(outputs: Sequence[torch.Tensor], source: torch.Tensor) -> None:
    for out in outputs:
        if out.numel() == source.numel():
            out.copy_(source.reshape(out.shape))


def _receive_none(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.dtype == torch.long:  # the sizes of the pickled objects
            t.fill_(len(_NONE_PICKLE))
        elif t.dtype == torch.uint8 and t.numel() % len(_NONE_PICKLE) == 0:  # the pickles
            t.copy_(_NONE_PICKLE.repeat(t.numel() // len(_NONE_PICKLE)).reshape(t.shape))


# -- work ------------------------------------------------------------------------------------


class _SimWork(dist.Work):
    """A completed collective. Async ones hold their tensors until ``wait()`` like NCCL."""

    def __init__(self, sim: Simulation, held: tuple[torch.Tensor, ...],
                 outputs: list[torch.Tensor], pending: bool):
        super().__init__()
        self._sim = sim
        self._held = held
        self._outputs = outputs
        self._pending = pending

    def wait(self, timeout=None) -> bool:
        if self._pending:
            self._pending = False
            self._sim.in_flight -= 1
        # Releasing here is the point: the tensors may be freed once the consumer waited.
        self._held = ()
        self._outputs = []
        return True

    @property
    def awaiting_wait(self) -> bool:
        """An async collective nobody has waited for yet (its tensors still held)."""
        return self._pending

    def is_completed(self) -> bool:
        return True  # the (instantaneous) transfer is done; only the hold waits for wait()

    def block_current_stream(self) -> None:
        pass  # no streams here (the base class would fail to build a stream block)

    def result(self) -> list[torch.Tensor]:
        return list(self._outputs)

    def get_future(self) -> Future:
        future: Future = Future()
        future.set_result(list(self._outputs))
        return future


# -- the process group -----------------------------------------------------------------------


def _flat(tensors) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return [t for item in tensors for t in _flat(item)]


def _reduce_name(opts) -> str | None:
    op = getattr(opts, "reduceOp", None)
    return None if op is None else op.op.name


class _SimProcessGroup(dist.ProcessGroup):
    def __init__(self, sim: Simulation, ranks: tuple[int, ...], group_rank: int):
        super().__init__(group_rank, len(ranks))
        self._sim = sim
        self._key = sim._new_communicator(ranks)

    def name(self) -> str:
        return BACKEND_NAME

    getBackendName = name

    def __repr__(self) -> str:
        return f"SimulatedProcessGroup({format_comm(self._key)}, rank {self.rank()})"

    def _issue(self, op: str, opts, inputs, outputs=(), detail: str | None = None,
               on_object=None) -> _SimWork:
        """Check the rules, record the op, and return its Work. ``on_object`` fills the
        CPU buffers of torch's object collectives (see above)."""
        sim = self._sim
        inputs, outputs = _flat(inputs), _flat(outputs)
        site, from_object_collective = _call_site()
        where = f"{op} on group {format_comm(self._key)}"
        if threading.current_thread() is not sim.thread:
            sim._violation("thread", f"{where}: issued from thread "
                           f"{threading.current_thread().name!r}, expected {sim.thread.name!r}",
                           site)
        if not from_object_collective:
            for t in inputs + outputs:
                if t.device.type != sim.device.type or (
                        sim.device.index is not None and t.device.index != sim.device.index):
                    sim._violation("device", f"{where}: tensor on {t.device}, "
                                   f"expected {sim.device}", site)
                    break
        if from_object_collective:
            # Pickle sizes differ between ranks; only the sequence of ops must agree.
            record = OpRecord(f"{op}(object)", (), (), detail)
            if on_object is not None:
                on_object()
        else:
            both = inputs + outputs
            record = OpRecord(op, tuple(tuple(t.shape) for t in both),
                              tuple(str(t.dtype).removeprefix("torch.") for t in both), detail)
        if op not in ("send", "recv"):  # point-to-point is not part of the collective order
            if self._key in sim._ready and not sim._orders[self._key]:
                sim._violation("lazy communicator", f"{where}: the communicator's first "
                               "collective, after training started", site)
            sim._orders[self._key].append(record)
        sim.counts[(op, self._key)] += 1
        sim.bytes[(op, self._key)] += sum(t.numel() * t.element_size() for t in inputs)

        # torch's blocking calls pass asyncOp=False and wait() at once: nothing to hold.
        pending = bool(getattr(opts, "asyncOp", True)) if opts is not None else True
        if not pending:
            return _SimWork(sim, (), outputs or inputs, False)
        sim.async_counts[op] += 1
        sim.in_flight += 1
        sim.max_in_flight = max(sim.max_in_flight, sim.in_flight)
        return _SimWork(sim, tuple(inputs + outputs), outputs or inputs, True)

    # In-place and rooted collectives.

    def allreduce(self, tensors, opts=None):
        return self._issue("all_reduce", opts, tensors, detail=_reduce_name(opts))

    def allreduce_coalesced(self, tensors, opts=None):
        return self._issue("all_reduce_coalesced", opts, tensors, detail=_reduce_name(opts))

    def reduce(self, tensors, opts=None):
        detail = f"{_reduce_name(opts)} root={opts.rootRank}" if opts is not None else None
        return self._issue("reduce", opts, tensors, detail=detail)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        on_object = None if root == self.rank() else (lambda: _receive_none(_flat(tensors)))
        return self._issue("broadcast", opts, tensors, detail=f"root={root}",
                           on_object=on_object)

    def barrier(self, opts=None):
        # NCCL runs a barrier as a one-element all-reduce on the communicator, so it takes
        # a place in the order like any collective.
        return self._issue("barrier", opts, ())

    # Gathers.

    def allgather(self, output_lists, input_list, opts=None):
        return self._issue("all_gather", opts, input_list, output_lists,
                           on_object=lambda: _copy_to_all(_flat(output_lists), input_list[0]))

    def all_gather_single(self, output, input, opts=None):
        return self._issue("all_gather_single", opts, input, output,
                           on_object=lambda: _copy_to_all(output.chunk(self.size()), input))

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self._issue("all_gather_coalesced", opts, input_list, output_lists)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._issue("all_gather_single_coalesced", opts, inputs, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists, input_list, opts=None):
        root = opts.rootRank if opts is not None else 0
        return self._issue("gather", opts, input_list, output_lists, detail=f"root={root}",
                           on_object=lambda: _copy_to_all(_flat(output_lists), input_list[0]))

    # Reductions to shards.

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._issue("reduce_scatter", opts, input_lists, outputs,
                           detail=_reduce_name(opts))

    def reduce_scatter_single(self, output, input, opts=None):
        return self._issue("reduce_scatter_single", opts, input, output,
                           detail=_reduce_name(opts))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._issue("reduce_scatter_single_coalesced", opts, inputs, outputs,
                           detail=_reduce_name(opts))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # Scatters and exchanges.

    def scatter(self, outputs, input_lists, opts=None):
        root = opts.rootRank if opts is not None else 0

        def on_object():
            if root == self.rank():  # the root keeps its own slot
                _copy_to_all(outputs, input_lists[0][self.rank()])
            else:
                _receive_none(_flat(outputs))
        return self._issue("scatter", opts, input_lists, outputs, detail=f"root={root}",
                           on_object=on_object)

    def all_to_all_single(self, output, input, output_split_sizes=None,
                          input_split_sizes=None, opts=None):
        # Split sizes may differ between ranks (NCCL allows it), so they are not recorded.
        return self._issue("all_to_all_single", opts, input, output)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        return self._issue("all_to_all", opts, inputs, outputs)

    # Point to point: counted and checked, but not in the order (only two ranks take part).

    def send(self, tensors, dst, tag=0):
        return self._issue("send", None, tensors, detail=f"dst={dst}")

    def recv(self, tensors, src, tag=0):
        return self._issue("recv", None, (), tensors, detail=f"src={src}",
                           on_object=lambda: _receive_none(_flat(tensors)))

    def recv_anysource(self, tensors, tag=0):
        return self.recv(tensors, -1, tag)

    # Group lifecycle: nothing to coalesce, connect or tear down.

    def _start_coalescing(self, device):
        pass

    def _end_coalescing(self, device):
        return _SimWork(self._sim, (), [], False)

    def shutdown(self):
        pass

    def abort(self):
        pass


def _create_group(common_opts, backend_opts) -> _SimProcessGroup:
    """Creator for ``Backend.register_backend(extended_api=True)``: called once per group
    this rank belongs to (torch returns NON_GROUP_MEMBER for the others without calling)."""
    if _current is None:
        raise RuntimeError(f"the {BACKEND_NAME!r} backend is only usable inside "
                           "zeropp.simulation.simulated_process_group()")
    # The default group arrives with an empty rank list.
    ranks = tuple(common_opts.global_ranks_in_group) or tuple(range(common_opts.group_size))
    return _SimProcessGroup(_current, ranks, common_opts.group_rank)


class _NullStore(dist.Store):
    """No rendezvous: there is one process. Any store use (a store-based barrier under
    TORCH_DIST_INIT_BARRIER=1) fails at once instead of waiting for absent ranks."""


def _register_backend() -> None:
    global _registered
    if not _registered:
        # The device list only sets the backend's declared capability; a Python
        # ProcessGroup bypasses per-device dispatch anyway. cpu/cuda keep gloo/nccl as
        # their defaults (register_backend only claims devices that have none).
        dist.Backend.register_backend(BACKEND_NAME, _create_group, extended_api=True,
                                      devices=["meta", "cpu", "cuda"])
        _registered = True


@contextlib.contextmanager
def simulated_process_group(rank: int, world_size: int,
                            device: torch.device | str = "meta",
                            strict: bool = False) -> Iterator[Simulation]:
    """Initialise torch.distributed as rank ``rank`` of ``world_size`` on the simulated
    backend; every later ``dist.new_group`` uses it too. Destroys the groups on exit."""
    global _current
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised")
    _register_backend()
    sim = Simulation(rank, world_size, torch.device(device), strict)
    _current = sim
    # init_process_group wraps sys.excepthook with a "[rankN]" prefix and nothing undoes
    # it, so simulations in sequence would stack prefixes: restore it on exit.
    excepthook = sys.excepthook
    try:
        dist.init_process_group(BACKEND_NAME, store=_NullStore(), rank=rank,
                                world_size=world_size)
        try:
            yield sim
        finally:
            dist.destroy_process_group()
    finally:
        _current = None
        sys.excepthook = excepthook


def compare_orders(a: Simulation | dict, b: Simulation | dict) -> list[str]:
    """Mismatches between two ranks' issue orders, on the communicators both belong to.

    Takes ``Simulation`` objects or their ``order_signature()``; one message per
    communicator, at its first divergence (later ops would only repeat the shift)."""
    name_a = f"rank {a.rank}" if isinstance(a, Simulation) else "a"
    name_b = f"rank {b.rank}" if isinstance(b, Simulation) else "b"
    sig_a = a.order_signature() if isinstance(a, Simulation) else a
    sig_b = b.order_signature() if isinstance(b, Simulation) else b
    mismatches = []
    for key in sorted(sig_a.keys() & sig_b.keys(), key=str):
        ops_a, ops_b = sig_a[key], sig_b[key]
        comm = f"communicator {format_comm(key)}"
        for i, (op_a, op_b) in enumerate(zip(ops_a, ops_b, strict=False)):
            if op_a != op_b:
                mismatches.append(f"{comm}: op #{i}: {name_a} issued {op_a}, "
                                  f"{name_b} issued {op_b}")
                break
        else:
            if len(ops_a) != len(ops_b):
                longer, name = (ops_a, name_a) if len(ops_a) > len(ops_b) else (ops_b, name_b)
                i = min(len(ops_a), len(ops_b))
                mismatches.append(f"{comm}: {name_a} issued {len(ops_a)} ops, {name_b} "
                                  f"{len(ops_b)}; op #{i} only on {name}: {longer[i]}")
    return mismatches
