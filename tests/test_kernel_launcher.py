"""The cached kernel launcher (zeropp.kernels.launcher) without a GPU: its key agrees with
Triton's own specialization of the arguments, a key compiles once and then launches
through the compiled kernel's run() with the raw stream, and it falls back to kernel[grid]
where it must."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from zeropp.kernels import launcher

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")

INTS = (0, 1, 2, 3, 15, 16, 17, 32, 48, 1000, 1024, -1, -16, 2**31 - 16, 2**31 - 1, 2**31,
        2**31 + 16, 2**32, -(2**31), -(2**31) - 16, 2**63 - 16, 2**63, 2**64 - 16)


@needs_triton
def test_argument_key_is_at_least_as_fine_as_tritons_specialization():
    """Two arguments with the same key get the same specialization from Triton's
    native_specialize_impl (what JITFunction.run keys its compiled kernels on), so one
    cached compiled kernel per key launches exactly what Triton would have launched."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    def triton_specialization(arg):
        return native_specialize_impl(BaseBackend, arg, False, True, True)

    storage = torch.empty(256, dtype=torch.uint8)
    tensors = [storage[offset:] for offset in (0, 1, 4, 8, 16, 32, 100)]
    tensors += [storage[16:].view(torch.float32), storage[4:68].view(torch.float16)]
    seen: dict[tuple, set] = {}
    for arg in (*INTS, *tensors):
        key = (type(arg).__name__, getattr(arg, "dtype", None), launcher.argument_key([arg]))
        seen.setdefault(key, set()).add(triton_specialization(arg))
    ambiguous = {key: specs for key, specs in seen.items() if len(specs) > 1}
    assert not ambiguous
    # And it tells apart what Triton tells apart in these kernels' arguments.
    assert launcher.int_class(16) != launcher.int_class(17) != launcher.int_class(1)
    assert launcher.int_class(16) != launcher.int_class(2**32)
    assert launcher.argument_key([storage]) != launcher.argument_key([storage[4:]])
    assert launcher.argument_key([storage[16:]]) == launcher.argument_key([storage[32:]])


class _FakeCompiled:
    """A CompiledKernel's face: run (the launcher), function, packed_metadata."""

    def __init__(self, log: list) -> None:
        self.function, self.packed_metadata = "function-handle", "packed-metadata"
        self.run = lambda *call: log.append(("direct", call))


class _FakeKernel:
    """A JITFunction's face: run() compiles (once per specialization) and launches;
    kernel[grid](...) launches through run()."""

    def __init__(self) -> None:
        self.log: list = []
        self.compiles = 0

    def run(self, *args, grid, warmup, **kwargs):
        self.compiles += 1
        self.log.append(("warmup" if warmup else "plain", grid, args, kwargs))
        return _FakeCompiled(self.log)

    def warmup(self, *args, grid, **kwargs):
        return self.run(*args, grid=grid, warmup=True, **kwargs)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)


@pytest.fixture
def direct_launcher(monkeypatch):
    """A fresh launcher that takes the direct path, with a fake raw stream."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    launcher._interpreting.cache_clear()  # read once per process: read again here
    monkeypatch.setattr(launcher, "_raw_stream", lambda index: 1234)
    monkeypatch.setattr(launcher.KernelLauncher, "_hooked", staticmethod(lambda: False))
    fresh = launcher.KernelLauncher()
    fresh._direct = True
    yield fresh
    launcher._interpreting.cache_clear()


CONSTANTS = {"BLOCK": 256, "ROWS": 8}


def _launch(fresh, kernel, *args, key=("quantize_kernel", 1)):
    fresh.launch(kernel, key, CONSTANTS, 4, (5, 2), args)


def test_a_key_compiles_once_then_launches_through_the_compiled_kernel(direct_launcher):
    kernel = _FakeKernel()
    buffer = torch.empty(64, dtype=torch.uint8)
    _launch(direct_launcher, kernel, buffer, 4096, 32)
    assert kernel.compiles == 1 and kernel.log[0][0] == "plain"
    _launch(direct_launcher, kernel, buffer[16:], 8192, 48)  # same classes: 16-aligned, D, D
    assert kernel.compiles == 1
    kind, call = kernel.log[-1]
    assert kind == "direct"
    # grid padded to 3, the raw stream, the handle and metadata, no hooks, then every
    # argument in the kernel's order: the runtime ones, then the constexprs.
    assert call[:9] == (5, 2, 1, 1234, "function-handle", "packed-metadata", None, None, None)
    assert call[9].data_ptr() == buffer[16:].data_ptr() and call[10:] == (8192, 48, 256, 8)
    assert direct_launcher.direct_launches == 1 and direct_launcher.plain_launches == 1


@pytest.mark.parametrize("other", [
    lambda buffer: (buffer[4:], 4096, 32),  # a pointer no longer 16-byte aligned
    lambda buffer: (buffer, 4097, 32),  # an int no longer a multiple of 16
    lambda buffer: (buffer, 1, 32),  # an int equal to 1 (a constant to Triton)
    lambda buffer: (buffer, 2**32, 32),  # an int past int32
])
def test_a_new_specialization_is_a_new_key(direct_launcher, other):
    kernel = _FakeKernel()
    buffer = torch.empty(64, dtype=torch.uint8)
    _launch(direct_launcher, kernel, buffer, 4096, 32)
    _launch(direct_launcher, kernel, *other(buffer))
    assert kernel.compiles == 2 and direct_launcher.direct_launches == 0
    _launch(direct_launcher, kernel, *other(buffer))
    assert kernel.compiles == 2 and direct_launcher.direct_launches == 1


def test_variants_and_devices_are_separate_keys(direct_launcher):
    kernel = _FakeKernel()
    buffer = torch.empty(64, dtype=torch.uint8)
    _launch(direct_launcher, kernel, buffer, 4096, 32, key=("quantize_kernel", 1))
    _launch(direct_launcher, kernel, buffer, 4096, 32, key=("quantize_kernel", 2))
    assert kernel.compiles == 2
    assert direct_launcher.compiled_variants() == 2


def test_prepare_compiles_without_launching(direct_launcher):
    kernel = _FakeKernel()
    buffer = torch.empty(64, dtype=torch.uint8)
    assert direct_launcher.prepare(kernel, ("quantize_kernel", 1), CONSTANTS, 4, (5, 2),
                                   (buffer, 4096, 32))
    assert [entry[0] for entry in kernel.log] == ["warmup"]
    _launch(direct_launcher, kernel, buffer, 4096, 32)
    assert kernel.compiles == 1 and [entry[0] for entry in kernel.log] == ["warmup", "direct"]


def test_a_refused_direct_launch_falls_back_once_with_a_warning(direct_launcher):
    kernel = _FakeKernel()
    buffer = torch.empty(64, dtype=torch.uint8)
    _launch(direct_launcher, kernel, buffer, 4096, 32)

    def refuse(*call):
        raise TypeError("function takes exactly 12 arguments")

    next(iter(direct_launcher._launches.values())).run = refuse
    with pytest.warns(RuntimeWarning, match="refused its arguments"):
        _launch(direct_launcher, kernel, buffer, 4096, 32)
    assert kernel.log[-1][0] == "plain"  # relaunched through kernel[grid]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        _launch(direct_launcher, kernel, buffer, 4096, 32)
    assert kernel.log[-1][0] == "plain" and direct_launcher.direct_launches == 0


def test_the_interpreter_and_launch_hooks_take_the_plain_path(direct_launcher, monkeypatch):
    kernel = _FakeKernel()
    buffer = torch.empty(64, dtype=torch.uint8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launcher._interpreting.cache_clear()
    for _ in range(2):
        _launch(direct_launcher, kernel, buffer, 4096, 32)
    assert [entry[0] for entry in kernel.log] == ["plain", "plain"]
    assert not direct_launcher.prepare(kernel, ("quantize_kernel", 1), CONSTANTS, 4, (5, 2),
                                       (buffer, 4096, 32))
    monkeypatch.delenv("TRITON_INTERPRET")
    launcher._interpreting.cache_clear()
    monkeypatch.setattr(launcher.KernelLauncher, "_hooked", staticmethod(lambda: True))
    for _ in range(2):
        _launch(direct_launcher, kernel, buffer, 4096, 32)
    assert [entry[0] for entry in kernel.log] == ["plain"] * 4


@needs_triton
def test_the_installed_triton_offers_the_direct_path():
    """The API the direct path calls exists in the installed Triton (3.6 on the GPU
    machines, what torch pulls here): JITFunction.run(grid=, warmup=) returning the
    CompiledKernel, whose run/function/packed_metadata the launcher reads."""
    fresh = launcher.KernelLauncher()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh._api_matches()
