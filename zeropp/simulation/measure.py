"""Measuring tools for the simulated cluster: device memory by category, host syncs, and
ops dispatched.

All are ``TorchDispatchMode``s, so they see every aten op below autograd (forward, backward
and optimizer alike) while a meta-device training program runs. Use them together::

    with MemoryTracker() as mem, HostSyncCounter() as syncs, OpCounter() as ops:
        mem.track_existing(model)            # model states built before measuring
        with mem.phase("forward"):
            loss = model(batch)
    mem.peak_bytes, mem.peak_by_category, syncs.counts, ops.total

What they cannot see (torch 2.13):
- ``torch.tensor(data, device=...)`` and the ``torch.UntypedStorage(n, device=...)``
  constructor allocate without dispatching an op; such storages are counted only once an op
  returns a view of them (``set_``), or via ``track_existing``.
- ``Tensor.numpy()`` checks the device before dispatching, so the counter patches
  ``torch.Tensor.numpy`` while active; ``UntypedStorage.resize_`` is not dispatched either,
  so the tracker patches it while active.
- Modes are thread-local: ops issued from a thread the program started itself are not seen
  (autograd's backward on meta runs on the calling thread, so it is seen).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeropp.comm.streams import HOST_LANE, allocation_lane

__all__ = ["CATEGORY_RULES", "DEFAULT_CATEGORY", "HostSyncCounter", "MemoryTracker", "OpCounter",
           "Rule", "collective_ops", "default_category", "dispatched_ops"]

aten = torch.ops.aten
_META = torch.device("meta")


# ---- attribution ---------------------------------------------------------------------------
class Rule(NamedTuple):
    """Frames of files whose path ends with ``path`` (or lies under it, when it ends with
    "/"), in one of ``functions`` (None: any function), allocate memory of ``category``."""

    path: str
    functions: frozenset[str] | None
    category: str


def _rule(path: str, category: str, *functions: str) -> Rule:
    return Rule(path, frozenset(functions) or None, category)


DEFAULT_CATEGORY = "activations"  # autograd's saved tensors, activation and parameter grads

# Checked per frame, innermost frame first; within a frame, the first matching rule wins.
CATEGORY_RULES: list[Rule] = [
    _rule("zeropp/kernels/", "quantization buffers"),
    # hpZ's int8 secondary: the payload rows a unit keeps (QuantizedSecondaryGather.take)
    _rule("zeropp/comm/quantized.py", "hpZ secondary shards", "take"),
    _rule("zeropp/comm/quantized.py", "quantization buffers"),
    _rule("zeropp/unit.py", "gathered weights", "_alloc_full"),
    _rule("zeropp/unit.py", "hpZ secondary shards", "release", "_retain_secondary_payload"),
    _rule("zeropp/comm/delta.py", "hpZ secondary shards", "_new_base", "load_state_dict"),
    _rule("zeropp/unit.py", "gradients in flight", "_flatten_gradients", "start_reduce",
          "finish_reduce"),
    _rule("zeropp/comm/collectives.py", "gradients in flight"),
    _rule("zeropp/comm/streams.py", "gradients in flight"),
    _rule("zeropp/optimizer.py", "model states"),
    _rule("zeropp/checkpoints/checkpoint.py", "model states"),
    _rule("zeropp/unit.py", "model states", "__init__"),
    _rule("zeropp/sharded_model.py", "model states", "_build_units"),
]


def _match(rules: tuple[Rule, ...], filename: str, function: str) -> str | None:
    path = filename.replace(os.sep, "/")
    for rule in rules:
        if rule.path.endswith("/"):
            hit = ("/" + rule.path) in path or path.startswith(rule.path)
        else:
            hit = path.endswith("/" + rule.path) or path == rule.path
        if hit and (rule.functions is None or function in rule.functions):
            return rule.category
    return None


# A code object always has the same file and name, so its verdict is cached; the cache is
# dropped whenever the rule table changes (tests and integrators may edit CATEGORY_RULES).
_code_verdicts: dict[Any, str | None] = {}
_verdicts_for: tuple[Rule, ...] = ()


def default_category() -> str:
    """Category of the innermost frame on the Python stack that matches ``CATEGORY_RULES``."""
    global _verdicts_for
    rules = tuple(CATEGORY_RULES)
    if rules != _verdicts_for:
        _code_verdicts.clear()
        _verdicts_for = rules
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        verdict = _code_verdicts.get(code, _code_verdicts)  # the dict itself means "unseen"
        if verdict is _code_verdicts:
            verdict = _code_verdicts[code] = _match(rules, code.co_filename, code.co_name)
        if verdict is not None:
            return verdict
        frame = frame.f_back
    return DEFAULT_CATEGORY


# ---- helpers ------------------------------------------------------------------------------
def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's outputs or arguments (tensors, nested lists/tuples, dict values)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _device_matcher(device: torch.device | str) -> Callable[[torch.device], bool]:
    device = torch.device(device)
    if device.index is None:  # "cuda" means any cuda device
        return lambda d: d.type == device.type
    return lambda d: d == device


def save_method(owner: type, name: str) -> tuple[bool, Any]:
    """(whether ``owner`` defines ``name`` itself, the method now) before patching it."""
    return name in owner.__dict__, getattr(owner, name)


def restore_method(owner: type, name: str, saved: tuple[bool, Any]) -> None:
    own, previous = saved
    if own:
        setattr(owner, name, previous)
    else:
        delattr(owner, name)  # it was inherited from torch's C base class


def wrap_storage_resize(after: Callable[[torch.UntypedStorage, int], None]) -> tuple[bool, Any]:
    """Wrap ``UntypedStorage.resize_``, which no dispatch mode sees, so that
    ``after(storage, nbytes)`` runs after every call (chaining whatever is installed, e.g. an
    outer recorder's wrapper). Returns what ``restore_method(torch.UntypedStorage,
    "resize_", ...)`` takes to undo it."""
    saved = save_method(torch.UntypedStorage, "resize_")
    previous = torch.UntypedStorage.resize_

    @functools.wraps(previous)
    def resize_(storage: torch.UntypedStorage, nbytes: int):
        result = previous(storage, nbytes)
        after(storage, nbytes)
        return result

    torch.UntypedStorage.resize_ = resize_
    return saved


# ---- memory --------------------------------------------------------------------------------
class _Entry:
    __slots__ = ("nbytes", "category", "lane", "ref")

    def __init__(self, nbytes: int, category: str | None, lane: str, ref: weakref.ref) -> None:
        self.nbytes = nbytes
        self.category = category  # None while the storage holds 0 bytes
        self.lane = lane  # the stream whose allocator pool the bytes come from
        self.ref = ref  # kept alive here: a weakref that is itself collected never calls back


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the storages on ``device``, by category (see module doc).

    Also by allocation lane ([Note: allocation lanes] in zeropp/comm/streams.py): CUDA's
    caching allocator keeps a freed block for the stream that allocated it, so without
    ``empty_cache`` it holds each stream's own peak at once. ``lane_peaks`` are those peaks
    and ``reserved_peak_bytes`` their sum: what ``torch.cuda.max_memory_reserved`` would
    show at least (fragmentation aside), next to ``peak_bytes``, which is
    ``max_memory_allocated``'s counterpart.
    """

    def __init__(self, device: torch.device | str = _META,
                 categorize: Callable[[], str] = default_category) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.categorize = categorize
        self._on_device = _device_matcher(self.device)
        self._live: dict[int, _Entry] = {}  # id(storage) -> entry; removed by the finalizer
        self._by_category: dict[str, int] = {}
        self._peak_by_category: dict[str, int] = {}
        # Each category's own peak, whenever it happened (not only at the overall peak).
        self.category_peaks: dict[str, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self._by_lane: dict[str, int] = {}
        self.lane_peaks: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}
        # Host memory ([Note: offload] in zeropp/offload.py): storages allocated on the host
        # lane, kept apart from every device figure above.
        self.host_bytes = 0
        self.host_peak_bytes = 0
        self._phases: list[str] = []
        self._saved_resize: list[Any] = []

    # -- results --
    @property
    def current_by_category(self) -> dict[str, int]:
        return {k: v for k, v in self._by_category.items() if v}

    @property
    def peak_by_category(self) -> dict[str, int]:
        """Live bytes per category at the moment ``peak_bytes`` was reached."""
        return {k: v for k, v in self._peak_by_category.items() if v}

    @property
    def reserved_peak_bytes(self) -> int:
        """The caching allocator's hold: every lane's own peak, at once (see class doc)."""
        return sum(self.lane_peaks.values())

    def in_host_memory(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` was allocated on the host lane ([Note: offload])."""
        entry = self._live.get(id(storage))
        return entry is not None and entry.lane == HOST_LANE

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (``phase_peaks`` are kept)."""
        self.peak_bytes = self.current_bytes
        self._peak_by_category = dict(self._by_category)
        self.category_peaks = dict(self._by_category)
        self.lane_peaks = dict(self._by_lane)
        self.host_peak_bytes = self.host_bytes

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[MemoryTracker]:
        """Record into ``phase_peaks[label]`` the peak reached while the block runs; phases
        nest, and a label used again keeps the larger peak."""
        self.phase_peaks[label] = max(self.phase_peaks.get(label, 0), self.current_bytes)
        self._phases.append(label)
        try:
            yield self
        finally:
            self._phases.remove(label)

    def track_existing(self, objs: Any, category: str = "model states") -> None:
        """Count storages allocated before the tracker started. ``objs``: tensors, storages,
        modules (their parameters and buffers), or any nesting of lists, tuples, dicts and
        iterables of them. Storages already tracked are left as they are."""
        for obj in self._flatten(objs):
            st = obj if isinstance(obj, torch.UntypedStorage) else obj.untyped_storage()
            if self._on_device(st.device) and id(st) not in self._live:
                self._add(st, category)

    def _flatten(self, objs: Any) -> Iterator[torch.Tensor | torch.UntypedStorage]:
        if isinstance(objs, (torch.Tensor, torch.UntypedStorage)):
            yield objs
        elif isinstance(objs, torch.nn.Module):
            yield from objs.parameters()
            yield from objs.buffers()
        elif isinstance(objs, dict):
            for v in objs.values():
                yield from self._flatten(v)
        elif isinstance(objs, Iterable) and not isinstance(objs, (str, bytes)):
            for v in objs:
                yield from self._flatten(v)

    # -- bookkeeping --
    def _add(self, st: torch.UntypedStorage, category: str | None = None) -> None:
        nbytes = st.nbytes()
        if nbytes and category is None:
            category = self.categorize()
        key = id(st)  # ids are unique among live objects, and the finalizer drops the entry
        ref = weakref.ref(st, functools.partial(self._on_free, key))
        entry = self._live[key] = _Entry(nbytes, category if nbytes else None,
                                         allocation_lane(), ref)
        if nbytes:
            self._bump(entry, nbytes)

    def _resized(self, entry: _Entry, nbytes: int) -> None:
        old = entry.nbytes
        if old == nbytes:
            return
        if old == 0:  # re-allocated: attribute to whoever grows it now, from its lane
            entry.category, entry.lane = self.categorize(), allocation_lane()
        else:
            self._bump(entry, -old)
        entry.nbytes = nbytes
        if nbytes:
            self._bump(entry, nbytes)
        else:
            entry.category = None

    def _on_free(self, key: int, _ref: weakref.ref) -> None:
        entry = self._live.pop(key, None)
        if entry is not None and entry.nbytes:
            self._bump(entry, -entry.nbytes)

    def _bump(self, entry: _Entry, delta: int) -> None:
        category, lane = entry.category, entry.lane
        if lane == HOST_LANE:  # ZeRO-Offload's host buffers: not the device's memory
            self.host_bytes += delta
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
            return
        self._by_lane[lane] = self._by_lane.get(lane, 0) + delta
        if delta > 0 and self._by_lane[lane] > self.lane_peaks.get(lane, 0):
            self.lane_peaks[lane] = self._by_lane[lane]
        self.current_bytes += delta
        self._by_category[category] = self._by_category.get(category, 0) + delta
        if delta > 0:
            if self._by_category[category] > self.category_peaks.get(category, 0):
                self.category_peaks[category] = self._by_category[category]
            cur = self.current_bytes
            if cur > self.peak_bytes:
                self.peak_bytes = cur
                self._peak_by_category = dict(self._by_category)
            for label in self._phases:
                if cur > self.phase_peaks[label]:
                    self.phase_peaks[label] = cur

    # -- hooks --
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        input_storages = None
        for t in _tensors(out):
            if t.layout is not torch.strided or not self._on_device(t.device):
                continue  # cheap exit: no stack walk for other devices
            st = t.untyped_storage()
            entry = self._live.get(id(st))
            if entry is not None:  # a view or in-place result; aten.resize_/out= may grow it
                self._resized(entry, st.nbytes())
                continue
            if input_storages is None:  # computed once per op, only when needed
                input_storages = {id(a.untyped_storage()) for a in _tensors((args, kwargs))
                                  if a.layout is torch.strided}
            if id(st) not in input_storages:  # else a view of a storage that predates us
                self._add(st)
        return out

    def _on_resize(self, st: torch.UntypedStorage) -> None:
        if not self._on_device(st.device):
            return
        entry = self._live.get(id(st))
        if entry is None:  # predates the tracker: counted from this resize on
            self._add(st)
        else:
            self._resized(entry, st.nbytes())

    def __enter__(self) -> MemoryTracker:
        # UntypedStorage.resize_ is not dispatched: wrapped, and restored on exit.
        self._saved_resize.append(wrap_storage_resize(lambda st, _: self._on_resize(st)))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        restore_method(torch.UntypedStorage, "resize_", self._saved_resize.pop())
        return super().__exit__(*exc)


# ---- host syncs ----------------------------------------------------------------------------
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _call_site(root: str) -> str:
    """'path:LINE in function' of the innermost frame outside torch and this file."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != _THIS_FILE and not filename.startswith(_TORCH_DIR):
            break
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    path = filename
    if os.path.isabs(path):
        rel = os.path.relpath(path, root)
        if not rel.startswith(".."):
            path = rel
    return f"{path.replace(os.sep, '/')}:{frame.f_lineno} in {frame.f_code.co_name}"


_THIS_FILE = _call_site.__code__.co_filename  # exactly as frames of this module spell it


def _zero_scalar(dtype: torch.dtype) -> bool | int | float | complex:
    if dtype is torch.bool:
        return False
    if dtype.is_floating_point:
        return 0.0
    if dtype.is_complex:
        return 0j
    return 0


# Ops that return a Python bool computed from device data in one dispatched op.
_COMPARISONS = (aten.allclose.default, aten.equal.default)


def reads_device_value(func, args, kwargs, on_device: Callable[[torch.device], bool]) -> bool:
    """Whether dispatching ``func`` makes the host read a value from a device ``on_device``
    accepts: ``_local_scalar_dense`` (``item``, ``bool``, ...), ``allclose`` / ``equal``, a
    ``_to_copy`` to the CPU, a ``copy_`` into a CPU tensor. The one rule the host-sync
    counter and the trace recorder share."""
    if func is aten._local_scalar_dense.default or func in _COMPARISONS:
        return on_device(args[0].device)
    if func is aten._to_copy.default:
        target = kwargs.get("device")
        return (on_device(args[0].device) and target is not None
                and torch.device(target).type == "cpu")
    if func is aten.copy_.default:
        return (args[0].device.type == "cpu" and isinstance(args[1], torch.Tensor)
                and on_device(args[1].device))
    return False


class HostSyncCounter(TorchDispatchMode):
    """Counts reads of ``device`` values by the host, by call site ("path:LINE in function",
    path relative to ``root``, default the working directory).

    Counted: ``_local_scalar_dense`` (``item``, ``bool``, ``int``, ``float``), ``allclose``
    and ``equal`` (True on meta), ``_to_copy`` to the CPU
    (``cpu()``, ``to("cpu")``, ``tolist()``: one count per call), ``copy_`` into a CPU
    tensor (non_blocking copies included), and ``Tensor.numpy()``. On the meta device, where
    they would raise, they return zeros (False / 0 / 0.0, CPU tensors of zeros); on a real
    device they run as usual.
    """

    def __init__(self, device: torch.device | str = _META,
                 root: str | os.PathLike | None = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self._on_device = _device_matcher(self.device)
        self.root = os.path.abspath(root if root is not None else os.getcwd())
        self.counts: Counter[str] = Counter()
        self._saved_numpy: list[Any] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()

    def _record(self) -> None:
        self.counts[_call_site(self.root)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not reads_device_value(func, args, kwargs, self._on_device):
            return func(*args, **kwargs)
        self._record()  # comparisons are dispatched whole, reading the scalar inside
        source = args[1] if func is aten.copy_.default else args[0]
        if source.device.type != "meta":
            return func(*args, **kwargs)
        # On meta the read would raise: the harmless answers.
        if func is aten._local_scalar_dense.default:
            return _zero_scalar(args[0].dtype)
        if func in _COMPARISONS:
            return True  # "equal": for checks like `assert equal(...)`
        if func is aten._to_copy.default:
            # One zero broadcast to the shape: a meta shard read out (a checkpoint save)
            # costs no host memory and writes one element, not gigabytes.
            dtype = kwargs.get("dtype") or args[0].dtype
            return torch.zeros((), dtype=dtype).expand(args[0].shape)
        return args[0].zero_()

    def __enter__(self) -> HostSyncCounter:
        # Tensor.numpy() rejects non-CPU tensors before any op is dispatched: wrap it.
        self._saved_numpy.append(save_method(torch.Tensor, "numpy"))
        prev = torch.Tensor.numpy

        @functools.wraps(prev)
        def numpy(t: torch.Tensor, *, force: bool = False):
            if self._on_device(t.device):
                self._record()
                if t.device.type == "meta":
                    return torch.zeros(t.shape, dtype=t.dtype).numpy()
            return prev(t, force=force)

        torch.Tensor.numpy = numpy
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        restore_method(torch.Tensor, "numpy", self._saved_numpy.pop())
        return super().__exit__(*exc)


# ---- ops dispatched ------------------------------------------------------------------------
# Namespaces of dispatched ops that are not compute: c10d's collectives (dispatched when a
# C++ process group issues them; the simulated backend's Python groups dispatch none, and
# collectives are counted per kind by the backend) and the profiler's range markers.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
MARKER_NAMESPACES = ("profiler",)


def _namespace(name: str) -> str:
    return name.split(".", 1)[0]


def dispatched_ops(op_counts: dict[str, int]) -> int:
    """Ops of ``OpCounter.by_name()`` other than collectives and profiler markers: aten ops
    and custom kernels (``zeropp::``, FSDP2's ``fsdp::``), one each."""
    return sum(count for name, count in op_counts.items()
               if _namespace(name) not in COLLECTIVE_NAMESPACES + MARKER_NAMESPACES)


def collective_ops(op_counts: dict[str, int]) -> dict[str, int]:
    """The collectives among the ops of ``OpCounter.by_name()`` (a C++ process group's)."""
    return {name: count for name, count in op_counts.items()
            if _namespace(name) in COLLECTIVE_NAMESPACES}


class OpCounter(TorchDispatchMode):
    """Counts every op that reaches ``__torch_dispatch__``, as dispatched, by name
    ("aten.mm.default"): what the host issues, never decomposed (the trace recorder records
    the parts of an op without a FLOP formula where it has a composite decomposition). An op
    on a tensor subclass (DTensor) counts once, at the subclass's level: the ops it runs
    inside are below this mode. Enter it after the other modes: ``HostSyncCounter`` answers
    reads of meta values itself, so a mode below it does not see them.

    Ops are counted while ``enabled`` (the mode can stay on the stack across a window).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[Any] = Counter()  # OpOverload -> count (names made on demand)
        self.enabled = True

    @property
    def total(self) -> int:
        """Every op counted, collectives and markers included (see ``dispatched_ops``)."""
        return sum(self.counts.values())

    def by_name(self) -> dict[str, int]:
        names: Counter[str] = Counter()
        for func, count in self.counts.items():
            names[str(func)] += count
        return dict(names.most_common())

    def reset(self) -> None:
        self.counts.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.enabled:
            self.counts[func] += 1
        return func(*args, **(kwargs or {}))
