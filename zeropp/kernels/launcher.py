"""Launching the Triton kernels at inductor's cost: a cached CompiledKernel's launcher,
called with the raw CUDA stream.

`kernel[grid](...)` goes through `JITFunction.run` on every call: it binds the arguments,
specializes each one, builds a cache key string and looks the compiled kernel up (about
8-12 us of host time a launch, more with our keyword constexprs). Inductor's generated
launchers call the compiled kernel's `run` directly (3-6 us). This module does the same:

- The key of a launch is its spec (one compiled variant's constexprs and warps, see
  `launch_specs`), the device, and the class of each runtime argument under Triton's own
  specialization ([Note: specialization key]). The first launch of a key goes through
  `JITFunction.run`, which compiles if needed and returns the CompiledKernel; later
  launches of the key call `CompiledKernel.run(grid, stream, function, metadata, ...)`.
- `prepare` compiles a key without launching (`JITFunction.warmup`), so the engine can
  build every variant it will use before its first iteration.
- Under TRITON_INTERPRET=1, with a launch hook installed (a profiler reads launch
  metadata) or with a Triton whose API differs from the one this was written against
  (3.6 to 3.9: `CompiledKernel.run`, `.function`, `.packed_metadata`), every launch takes
  the plain `kernel[grid](...)` path; the API case warns once.

[Note: specialization key] Triton specializes a pointer on whether its address is a
multiple of 16, and an int on its type (i32, i64 or u64 by range), whether it is a multiple
of 16, and whether it equals 1 (then it becomes a constant). Checked against
`native_specialize_impl` of Triton 3.6 and 3.9 (tests/test_kernel_launcher.py checks the
installed one): two argument lists with the same key get the same compiled kernel.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from functools import cache

import torch

from zeropp.kernels.triton_device import interpreting

_INT32 = (-(2**31), 2**31)
_INT64_MAX = 2**63


def int_class(value: int) -> int:
    """Triton's specialization class of an int argument ([Note: specialization key])."""
    if value == 1:
        return 1
    kind = 0 if _INT32[0] <= value < _INT32[1] else (2 if value < _INT64_MAX else 4)
    return kind + (8 if value % 16 == 0 else 16)


# int_class of the ints launches pass (sizes and counts, a few per unit), looked up rather
# than worked out at every launch; cleared when it grows past any model's needs.
_int_classes: dict[int, int] = {}


def argument_key(args: Sequence) -> tuple:
    """The specialization class of each argument ([Note: specialization key]): for a
    tensor whether its address is 16-byte aligned, for an int its `int_class`."""
    classes = _int_classes
    key = []
    for arg in args:
        if type(arg) is int:
            found = classes.get(arg)
            if found is None:
                if len(classes) > 65536:
                    classes.clear()
                found = classes[arg] = int_class(arg)
            key.append(found)
        else:
            key.append(arg.data_ptr() % 16 == 0)
    return tuple(key)


@cache
def _interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels, read once rather than at every launch:
    Triton reads the variable when it decorates the kernels (their module's import), so a
    later change would not switch them anyway."""
    return interpreting()


@cache
def _runtime_knobs():
    from triton import knobs

    return knobs.runtime


def _is_hook(hook) -> bool:
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)  # a HookChain
    return bool(calls) if calls is not None else True


def _raw_stream(device_index: int) -> int:
    """The current CUDA stream's handle, as inductor's launchers read it."""
    return torch._C._cuda_getCurrentRawStream(device_index)


class _Launch:
    """What a direct launch of one compiled kernel needs, read once from it."""

    __slots__ = ("run", "function", "metadata")

    def __init__(self, compiled) -> None:
        if hasattr(compiled, "result"):  # an asynchronous compile's future (Triton 3.6)
            compiled = compiled.result()
        self.run = compiled.run  # the property loads the module on the current device
        self.function = compiled.function
        self.metadata = compiled.packed_metadata


class KernelLauncher:
    """Launches @triton.jit kernels through cached compiled kernels (see the module doc).
    One per process (`LAUNCHER`); not thread-safe beyond what the GIL gives dict updates."""

    def __init__(self) -> None:
        self._launches: dict[tuple, _Launch] = {}
        self._direct: bool | None = None  # None: not decided yet
        self.direct_launches = 0
        self.plain_launches = 0

    # ---- deciding the path ------------------------------------------------------------------

    def _direct_available(self) -> bool:
        if self._direct is None:
            self._direct = self._api_matches()
        return self._direct

    def _api_matches(self) -> bool:
        try:
            import triton
            from triton.compiler.compiler import CompiledKernel
            from triton.runtime.jit import JITFunction
        except ImportError:
            return False
        import inspect

        parameters = inspect.signature(JITFunction.run).parameters
        if not ({"grid", "warmup"} <= set(parameters) and hasattr(CompiledKernel, "run")
                and hasattr(CompiledKernel, "launch_metadata")):
            self._give_up(f"Triton {triton.__version__}'s JITFunction.run or CompiledKernel "
                          "differ from 3.6-3.9's")
            return False
        return True

    def _give_up(self, why: str) -> None:
        self._direct = False
        warnings.warn(f"zeropp.kernels: launching Triton kernels through kernel[grid] "
                      f"(about 10 us more host time a launch): {why}", RuntimeWarning,
                      stacklevel=3)

    @staticmethod
    def _hooked() -> bool:
        """Whether a launch hook is installed (Triton 3.6+ keeps them in HookChains, which
        are never None: an empty chain is no hook)."""
        runtime = _runtime_knobs()
        return _is_hook(runtime.launch_enter_hook) or _is_hook(runtime.launch_exit_hook)

    # ---- launching --------------------------------------------------------------------------

    def launch(self, kernel, spec_key: tuple, constants: dict, num_warps: int,
               grid: tuple[int, ...], args: Sequence) -> None:
        """Launch `kernel` over `grid` with runtime `args` (its leading arguments, in order)
        and `constants` (its constexprs, the arguments after them, in order); `spec_key`
        names the variant."""
        if _interpreting() or not self._direct_available() or self._hooked():
            self._plain(kernel, constants, num_warps, grid, args)
            return
        device = args[0].device.index
        key = (spec_key, device, argument_key(args))
        launch = self._launches.get(key)
        if launch is None:  # the first launch of this key compiles (if needed) and launches
            compiled = kernel.run(*args, grid=grid, warmup=False, **constants,
                                  num_warps=num_warps, enable_fp_fusion=False)
            self.plain_launches += 1
            self._remember(key, compiled)
            return
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        stream = _raw_stream(device)
        try:
            launch.run(grid_x, grid_y, grid_z, stream, launch.function, launch.metadata,
                       None, None, None, *args, *constants.values())
        except TypeError as error:  # the launcher's arguments differ: raised before launching
            self._give_up(f"CompiledKernel.run refused its arguments ({error})")
            self._plain(kernel, constants, num_warps, grid, args)
            return
        self.direct_launches += 1

    def _plain(self, kernel, constants: dict, num_warps: int, grid: tuple[int, ...],
               args: Sequence) -> None:
        kernel[grid](*args, **constants, num_warps=num_warps, enable_fp_fusion=False)
        self.plain_launches += 1

    def _remember(self, key: tuple, compiled) -> None:
        try:
            self._launches[key] = _Launch(compiled)
        except AttributeError as error:
            self._give_up(f"the compiled kernel lacks {error.name or error}")

    # ---- compiling ahead --------------------------------------------------------------------

    def prepare(self, kernel, spec_key: tuple, constants: dict, num_warps: int,
                grid: tuple[int, ...], args: Sequence) -> bool:
        """Compile (and load) the variant a launch with these arguments would use, without
        launching it. False when nothing was done (interpreter, plain path)."""
        if _interpreting() or not self._direct_available():
            return False
        key = (spec_key, args[0].device.index, argument_key(args))
        if key not in self._launches:
            compiled = kernel.warmup(*args, grid=grid, **constants, num_warps=num_warps,
                                     enable_fp_fusion=False)
            self._remember(key, compiled)
        return True

    def compiled_variants(self) -> int:
        return len(self._launches)


LAUNCHER = KernelLauncher()
