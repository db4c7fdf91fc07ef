"""GPU check sections a and b: the quantization kernels on CUDA.

a. Every kernel, through the dispatcher the engine uses (`zeropp.kernels`), equals the torch
   reference run on CPU (`zeropp.kernels.reference`, the specification) bit for bit: fp32,
   fp16 and bf16 values, int4 and int8 codes, block sizes 64, 256 (one register tile) and
   2048 (two passes), a length that is a multiple of every block and an awkward one. Inputs
   hold an all-zero block, a NaN and an inf, so the special cases of the contract are on the
   GPU path too. NaN only has to be NaN: the GPU's NaN bits may differ from the CPU's.
b. Each kernel's bandwidth on 64 MiB tensors (and, reported besides, 1 MiB and 8 MiB: a
   unit's per-rank payload at real scale), as the step-time trace counts bytes (the
   tensors an op reads plus those it writes; `zeropp/kernels/meta.py`), timed with CUDA
   events (median after warmup), against the device's peak. Every variant is also compared
   with the reference on the CPU (as in a), to check the large grids. The per-op rates become
   the report's `kernel_rates`, keyed by the trace's op names. Then the host's microseconds
   per call of each kernel, through the cached launcher and the plain `kernel[grid]` path.
   On its own, in under a minute: `python -m scripts.gpu_check.kernels --section b
   --out DIR`.

The functions take a device and sizes, so the tests run their plumbing on CPU (reference
kernels, a wall-clock timer) and their CUDA paths with small sizes where a GPU exists.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from scripts.gpu_check.report import (
    BANDWIDTH_TARGET,
    Outcome,
    bytes_per_second,
    combined_rate,
    format_rate,
    median_seconds,
    one_line,
)
from zeropp import kernels
from zeropp.kernels import meta as _meta  # noqa: F401 (registers torch.ops.zeropp.*)
from zeropp.kernels import reference

TRITON_BACKEND = "zeropp.kernels.triton_kernels"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BITS = (4, 8)
BLOCK_SIZES = (64, 256, 2048)
# The int4 reductions' word sums ([Note: word sums]) where the matrix above does not reach:
# the smallest block they read as words (16), one that is not a power of two (24: masked
# word columns) and one walked in two passes (8192); reductions only, at the first length,
# so few kernels compile for them.
WORD_SUM_BLOCK_SIZES = (16, 24, 8192)
# A multiple of every block size above, and a length that is a multiple of none (nor of 16,
# which Triton specializes integer arguments on).
REGULAR_NUMEL = 5 * 3 * 2048
AWKWARD_NUMEL = 33_333
ROWS = 3  # payloads per batched or reduced call
MAX_FAILURES_LISTED = 20


def trace_op_name(op: str) -> str:
    """The name the step-time trace gives a kernel: its dispatcher op (str(OpOverload))."""
    return str(getattr(torch.ops.zeropp, op).default)


# ---- comparisons -----------------------------------------------------------------------------

_SAME_SIZE_INT = {torch.float32: torch.int32, torch.float16: torch.int16,
                  torch.bfloat16: torch.int16}


def first_value_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> int | None:
    """Index of the first element whose bits differ (NaN matches any NaN), or None. Also
    -1 when the shapes or dtypes differ."""
    actual, expected = actual.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return -1
    if actual.dtype in _SAME_SIZE_INT:
        int_type = _SAME_SIZE_INT[actual.dtype]
        same = (actual.view(int_type) == expected.view(int_type)) | (
            torch.isnan(actual) & torch.isnan(expected))
    else:
        same = actual == expected
    bad = (~same).nonzero()
    return None if bad.numel() == 0 else int(bad[0, 0])


def first_payload_mismatch(actual: torch.Tensor, expected: torch.Tensor,
                           layout: reference.PayloadLayout) -> str | None:
    """Where two payloads differ (codes byte for byte, scales as fp32 bits with NaN equal to
    any NaN), or None when they are the same."""
    actual, expected = actual.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
    if actual.shape != expected.shape or actual.dtype != torch.uint8:
        return f"payload shape/dtype {tuple(actual.shape)} {actual.dtype}, expected " \
               f"{tuple(expected.shape)} uint8"
    data = slice(0, layout.data_nbytes)
    bad_byte = first_value_mismatch(actual[data], expected[data])
    if bad_byte is not None:
        return f"code byte {bad_byte} ({int(actual[bad_byte])} != {int(expected[bad_byte])})"
    scales = [reference.decode_scales(p.view(1, -1), layout)[0] for p in (actual, expected)]
    bad_block = first_value_mismatch(*scales)
    if bad_block is not None:
        return f"scale of block {bad_block} ({float(scales[0][bad_block])!r} != " \
               f"{float(scales[1][bad_block])!r})"
    return None


# ---- section a -------------------------------------------------------------------------------


def sample_values(numel: int, dtype: torch.dtype, block_size: int, seed: int) -> torch.Tensor:
    """CPU values whose blocks span magnitudes 1e-3..1e3, with block 1 all zero, a NaN in
    block 2 and an inf in block 3 (where the tensor has that many blocks)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    nblocks = -(-numel // block_size)
    magnitudes = 10.0 ** (6 * torch.rand(nblocks, generator=generator) - 3)
    values *= magnitudes.repeat_interleave(block_size)[:numel]
    for block, special in ((1, 0.0), (2, float("nan")), (3, float("inf"))):
        start = block * block_size
        if start + block_size <= numel:
            if special == 0.0:
                values[start:start + block_size] = 0.0
            else:
                values[start + block_size // 2] = special
    return values.to(dtype)


@dataclass
class CaseResults:
    """Outcome of the bit-exactness cases so far."""

    total: int = 0
    passed: int = 0
    not_run: int = 0
    failures: list[str] | None = None
    backends: set[str] | None = None

    def record(self, case: str, compare: Callable[[], str | None]) -> None:
        """Run one comparison (None: equal, else where it differs); an exception (a kernel
        that does not compile or launch) fails this case, and the next cases still run."""
        self.total += 1
        try:
            mismatch = compare()
        except Exception as error:  # noqa: BLE001 (recorded as the case's failure)
            mismatch = one_line(error)
        if mismatch is None:
            self.passed += 1
        else:
            self.failures = (self.failures or []) + [f"{case}: {mismatch}"]


def _check_value_kernels(results: CaseResults, device: torch.device, dtype_name: str,
                         bits: int, block: int, numel: int, seed: int) -> None:
    """quantize, dequantize (and its out= form) and dequantize_many for one configuration,
    each against the reference on CPU."""
    dtype = DTYPES[dtype_name]
    layout = kernels.payload_layout(numel, bits, block)
    label = f"{dtype_name} int{bits} block {block} numel {numel}"
    inputs = [sample_values(numel, dtype, block, seed + row) for row in range(ROWS)]
    x = inputs[0].to(device)
    results.backends = (results.backends or set()) | {kernels.backend_for(x, block).__name__}

    expected = [reference.quantize_blockwise(v, bits, block) for v in inputs]
    results.record(f"quantize {label}", lambda: first_payload_mismatch(
        kernels.quantize_blockwise(x, bits, block), expected[0], layout))

    # Dequantize the reference's payloads, so a quantize bug cannot hide a dequantize bug.
    payload = expected[0].to(device)
    want = reference.dequantize_blockwise(expected[0], numel, bits, block, dtype)
    results.record(f"dequantize {label}", lambda: _value_mismatch(
        kernels.dequantize_blockwise(payload, numel, bits, block, dtype), want))

    def into_out() -> str | None:
        out = torch.empty(numel, dtype=dtype, device=device)
        kernels.dequantize_blockwise(payload, numel, bits, block, dtype, out=out)
        return _value_mismatch(out, want)

    results.record(f"dequantize out= {label}", into_out)
    batch = torch.stack(expected)
    want_many = reference.dequantize_blockwise_many(batch, numel, bits, block, dtype)
    results.record(f"dequantize_many k={ROWS} {label}", lambda: _value_mismatch(
        kernels.dequantize_blockwise_many(batch.to(device), numel, bits, block, dtype),
        want_many))


def _check_reductions(results: CaseResults, device: torch.device, bits: int, block: int,
                      numel: int, seed: int) -> None:
    """dequantize_reduce and dequantize_reduce_quantize (to int4 and int8): they read and
    write payloads only, so one value dtype covers them."""
    batch = torch.stack([reference.quantize_blockwise(
        sample_values(numel, torch.float32, block, seed + row), bits, block)
        for row in range(ROWS)])
    on_device = batch.to(device)
    label = f"int{bits} block {block} numel {numel} k={ROWS}"
    want = reference.dequantize_reduce(batch, numel, bits, block)
    results.record(f"dequantize_reduce {label}", lambda: _value_mismatch(
        kernels.dequantize_reduce(on_device, numel, bits, block), want))
    for bits_out in BITS:
        want_payload = reference.dequantize_reduce_quantize(batch, numel, bits, bits_out, block)
        results.record(f"dequantize_reduce_quantize -> int{bits_out} {label}",
                       lambda bits_out=bits_out, want_payload=want_payload: first_payload_mismatch(
                           kernels.dequantize_reduce_quantize(on_device, numel, bits, bits_out,
                                                              block),
                           want_payload, kernels.payload_layout(numel, bits_out, block)))


def _value_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    index = first_value_mismatch(actual, expected)
    if index is None:
        return None
    if index < 0:
        return f"got {tuple(actual.shape)} {actual.dtype}, expected " \
               f"{tuple(expected.shape)} {expected.dtype}"
    a, e = actual.reshape(-1)[index].item(), expected.reshape(-1)[index].item()
    return f"element {index} ({a!r} != {e!r})"


def check_bit_exact(device: torch.device | str = "cuda", *,
                    dtypes: Sequence[str] = tuple(DTYPES), bits: Sequence[int] = BITS,
                    block_sizes: Sequence[int] = BLOCK_SIZES,
                    word_sum_block_sizes: Sequence[int] = WORD_SUM_BLOCK_SIZES,
                    numels: Sequence[int] = (REGULAR_NUMEL, AWKWARD_NUMEL),
                    require_backend: str | None = TRITON_BACKEND,
                    budget_s: float | None = None) -> Outcome:
    """Section a. Fails on any mismatch, when the dispatcher picked another backend than
    `require_backend`, or when the time budget ran out before every case ran."""
    device = torch.device(device)
    deadline = None if budget_s is None else time.monotonic() + budget_s
    # Every dtype and width at one length before the next length: if the time budget runs
    # out, what ran still covers the whole matrix once.
    configurations = [(d, b, s, n) for n in numels for s in block_sizes for b in bits
                      for d in dtypes]
    # After the first length's matrix, the reductions alone at the word-sum blocks (None as
    # the dtype: they read and write payloads only).
    first_length = len(configurations) // len(numels)
    configurations[first_length:first_length] = [
        (None, 4, s, numels[0]) for s in word_sum_block_sizes if 4 in bits]
    results = CaseResults()
    for index, (dtype_name, nbits, block, numel) in enumerate(configurations):
        if deadline is not None and time.monotonic() > deadline:
            results.not_run = len(configurations) - index
            break
        seed = 1000 * index
        if dtype_name is not None:
            _check_value_kernels(results, device, dtype_name, nbits, block, numel, seed)
        if dtype_name in (None, dtypes[0]):
            _check_reductions(results, device, nbits, block, numel, seed + 500)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    backends = sorted(results.backends or ())
    failures = results.failures or []
    figures = {"cases": results.total, "passed": results.passed,
               "configurations": len(configurations),
               "configurations_not_run": results.not_run, "backends": backends,
               "failures": failures[:MAX_FAILURES_LISTED], "dtypes": list(dtypes),
               "bits": list(bits), "block_sizes": list(block_sizes),
               "word_sum_block_sizes": list(word_sum_block_sizes), "numels": list(numels),
               "reference_device": "cpu", "device": str(device)}
    scope = (f"{'/'.join(dtypes)}, {'/'.join(f'int{b}' for b in bits)}, blocks "
             f"{'/'.join(map(str, block_sizes))}"
             + (f"; int4 reductions at blocks {'/'.join(map(str, word_sum_block_sizes))}"
                if word_sum_block_sizes and 4 in bits else ""))
    if failures:
        return Outcome("fail", f"{len(failures)} of {results.total} cases differ, first: "
                       f"{failures[0]}", figures)
    if require_backend is not None and backends != [require_backend]:
        return Outcome("fail", f"the dispatcher ran {', '.join(backends) or 'nothing'}, not "
                       f"{require_backend}", figures)
    if results.not_run:
        return Outcome("fail", f"time budget ran out: {results.not_run} of "
                       f"{len(configurations)} configurations not run ({results.passed} "
                       "cases bit-exact so far)", figures)
    return Outcome("pass", f"{results.total} cases bit-exact ({scope})", figures)


# ---- section b -------------------------------------------------------------------------------

MiB = 2**20
FULL_TENSOR_BYTES = 64 * MiB
QUICK_TENSOR_BYTES = 16 * MiB
PAYLOADS_PER_CALL = 8  # ranks per node on DGX machines: qgZ's first hop, qwZ's gather rows


def _engine_block_size() -> int:
    from zeropp.deepspeed_api.initialize import QuantizationOptions

    return QuantizationOptions().block_size


@dataclass
class KernelWorkload:
    """One kernel call as the engine makes it, with the bytes the trace charges for it."""

    label: str
    ops: tuple[str, ...]  # trace op names whose rate this call measures
    call: Callable[[], torch.Tensor]
    nbytes: int  # bytes of the tensors it reads plus the tensors it writes
    reference: Callable[[], torch.Tensor]  # the same call on the CPU reference


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def kernel_workloads(device: torch.device, tensor_bytes: int, block: int | None = None,
                     rows: int = PAYLOADS_PER_CALL) -> list[KernelWorkload]:
    """The engine's kernel calls at its default block size, each moving about `tensor_bytes`
    of values: qwZ quantizes 16-bit weights to int8 and dequantizes `rows` gathered payloads;
    qgZ quantizes 16-bit gradients to int4, reduces `rows` int4 payloads and requantizes them
    (hop 1), then reduces them to fp32 (hop 2)."""
    block = block or _engine_block_size()
    generator = torch.Generator(device=device).manual_seed(0)
    numel = tensor_bytes // 2 // (rows * block) * (rows * block)  # 16-bit values, whole blocks
    x = torch.randn(numel, device=device, generator=generator).to(torch.bfloat16)
    q8, q4 = (kernels.quantize_blockwise(x, bits, block) for bits in (8, 4))
    row_numel = numel // rows
    q8_rows = torch.stack([kernels.quantize_blockwise(r, 8, block) for r in x.view(rows, -1)])
    reduce_numel = tensor_bytes // 4 // block * block  # fp32 sum of `tensor_bytes`
    values = torch.randn(rows, reduce_numel, device=device, generator=generator)
    q4_rows = torch.stack([kernels.quantize_blockwise(v, 4, block) for v in values])
    del values
    out16 = torch.empty(numel, dtype=torch.bfloat16, device=device)
    many_out = torch.empty(rows, row_numel, dtype=torch.bfloat16, device=device)
    sum_out = torch.empty(reduce_numel, dtype=torch.float32, device=device)
    requantized_nbytes = kernels.quantized_nbytes(reduce_numel, 4, block)
    name = trace_op_name
    ref = reference
    # The reference runs on the CPU, as in section a: the CPU reference is the contract. The
    # same torch code on CUDA is not bit-identical to it (seen on an H100: bf16 codes and a
    # reduction's scales differ in the last bit), so it cannot be the yardstick.
    x_cpu, q8_cpu, q8_rows_cpu, q4_rows_cpu = (t.cpu() for t in (x, q8, q8_rows, q4_rows))
    return [
        KernelWorkload("quantize bf16 -> int8 (qwZ)", (name("quantize_blockwise"),),
                       lambda: kernels.quantize_blockwise(x, 8, block), _nbytes(x, q8),
                       lambda: ref.quantize_blockwise(x_cpu, 8, block)),
        KernelWorkload("quantize bf16 -> int4 (qgZ)", (name("quantize_blockwise"),),
                       lambda: kernels.quantize_blockwise(x, 4, block), _nbytes(x, q4),
                       lambda: ref.quantize_blockwise(x_cpu, 4, block)),
        KernelWorkload("dequantize int8 -> bf16, out=",
                       (name("dequantize_blockwise"), name("dequantize_blockwise_into")),
                       lambda: kernels.dequantize_blockwise(q8, numel, 8, block, torch.bfloat16,
                                                            out=out16),
                       _nbytes(q8, out16),
                       lambda: ref.dequantize_blockwise(q8_cpu, numel, 8, block, torch.bfloat16)),
        KernelWorkload(f"dequantize_many {rows} x int8 -> bf16 (qwZ)",
                       (name("dequantize_blockwise_many"),),
                       lambda: kernels.dequantize_blockwise_many(q8_rows, row_numel, 8, block,
                                                                 torch.bfloat16),
                       _nbytes(q8_rows, many_out),
                       lambda: ref.dequantize_blockwise_many(q8_rows_cpu, row_numel, 8, block,
                                                             torch.bfloat16)),
        KernelWorkload(f"dequantize_reduce {rows} x int4 -> fp32 (qgZ hop 2)",
                       (name("dequantize_reduce"),),
                       lambda: kernels.dequantize_reduce(q4_rows, reduce_numel, 4, block),
                       _nbytes(q4_rows, sum_out),
                       lambda: ref.dequantize_reduce(q4_rows_cpu, reduce_numel, 4, block)),
        KernelWorkload(f"dequantize_reduce_quantize {rows} x int4 -> int4 (qgZ hop 1)",
                       (name("dequantize_reduce_quantize"),),
                       lambda: kernels.dequantize_reduce_quantize(q4_rows, reduce_numel, 4, 4,
                                                                  block),
                       _nbytes(q4_rows) + requantized_nbytes,
                       lambda: ref.dequantize_reduce_quantize(q4_rows_cpu, reduce_numel, 4, 4,
                                                              block)),
    ]


class CudaEventTimer:
    """Median seconds of a call on the GPU's timeline (CUDA events), each run after the L2
    cache is flushed. The flush and a short spin keep the GPU busy while the host launches
    the call, so the start event is not reached before the kernel is queued: the events then
    time the kernel, not the host's launch overhead (tens of microseconds of Python, as long
    as a 64 MiB kernel itself)."""

    L2_FLUSH_BYTES = 256 * MiB  # above every L2 so far (H100: 50 MB, H200: 60 MB)
    HOST_HEAD_START_S = 300e-6

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flush = torch.empty(self.L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
        clock_khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 2e6
        self._spin_cycles = int(self.HOST_HEAD_START_S * clock_khz * 1e3)

    def _occupy_gpu(self) -> None:
        self._flush.zero_()
        if hasattr(torch.cuda, "_sleep"):  # private but long-standing: a spinning kernel
            torch.cuda._sleep(self._spin_cycles)

    def median_seconds(self, call: Callable[[], object], repeats: int, warmup: int) -> float:
        for _ in range(warmup):
            call()
        torch.cuda.synchronize(self.device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for start, end in zip(starts, ends, strict=True):
            self._occupy_gpu()
            start.record()
            call()
            end.record()
        torch.cuda.synchronize(self.device)
        return median_seconds(start.elapsed_time(end) / 1e3
                              for start, end in zip(starts, ends, strict=True))


class WallTimer:
    """Median wall seconds of a call (CPU tensors: the call is synchronous)."""

    def median_seconds(self, call: Callable[[], object], repeats: int, warmup: int) -> float:
        for _ in range(warmup):
            call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return median_seconds(max(t, 1e-9) for t in times)


def _measure_workloads(device: torch.device, tensor_bytes: int, peak: float | None,
                       repeats: int, warmup: int, timer, compare: bool
                       ) -> tuple[list[dict], dict[str, list], list[str], int]:
    """(a row per workload, (bytes, seconds) per trace op, errors, workload count)."""
    workloads = kernel_workloads(device, tensor_bytes)
    rows, per_op, errors = [], {}, []
    for workload in workloads:
        try:
            seconds = timer.median_seconds(workload.call, repeats, warmup)
            mismatch = (_output_mismatch(workload.call(), workload.reference()) if compare
                        else None)
        except Exception as error:  # noqa: BLE001 (one kernel failing does not stop the rest)
            errors.append(f"{workload.label}: {one_line(error)}")
            continue
        rate = bytes_per_second(workload.nbytes, seconds)
        rows.append({"kernel": workload.label, "ops": list(workload.ops),
                     "bytes": workload.nbytes, "seconds": seconds, "bytes_per_second": rate,
                     "fraction_of_peak": rate / peak if peak else None,
                     "matches_reference": mismatch is None if compare else None,
                     "mismatch": mismatch})
        for op in workload.ops:
            per_op.setdefault(op, []).append((workload.nbytes, seconds))
    return rows, per_op, errors, len(workloads)


# Sizes of a unit's per-rank payload at real scale, where launch latency matters as much as
# bandwidth: measured besides the main size on a GPU, reported, not judged.
EXTRA_TENSOR_BYTES = (1 * MiB, 8 * MiB)
LAUNCH_TIMING_NUMEL = 64 * 1024  # values of the tiny calls whose host time is measured
LAUNCH_TIMING_CALLS = 200


def host_launch_costs(device: torch.device, calls: int = LAUNCH_TIMING_CALLS,
                      numel: int = LAUNCH_TIMING_NUMEL) -> dict:
    """Host microseconds per call of each kernel on tiny tensors (`calls` back-to-back calls
    timed with the host clock, after a warm-up), through the cached launcher
    (`zeropp.kernels.launcher`) and through the plain `kernel[grid]` path. Only on the
    Triton backend; the whole public call is timed (checks, allocation, launch)."""
    from zeropp.kernels import launcher

    workloads = kernel_workloads(device, numel * 2 * PAYLOADS_PER_CALL)
    launch = launcher.LAUNCHER

    def per_call_us(call: Callable[[], object]) -> float:
        for _ in range(5):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times = []
        for _ in range(3):  # the median of three timed runs of `calls` calls
            start = time.perf_counter()
            for _ in range(calls):
                call()
            times.append((time.perf_counter() - start) / calls * 1e6)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return median_seconds(times)

    rows = []
    saved = launch._direct
    try:
        for workload in workloads:
            launch._direct = None  # decided again: direct where the API allows it
            direct_before = launch.direct_launches
            direct = per_call_us(workload.call)
            took_direct = launch.direct_launches > direct_before
            launch._direct = False
            plain = per_call_us(workload.call)
            rows.append({"kernel": workload.label, "direct_us": direct, "plain_us": plain,
                         "direct_path_taken": took_direct})
    finally:
        launch._direct = saved
    return {"numel": numel, "calls": calls, "kernels": rows,
            "compiled_variants": launch.compiled_variants()}


def measure_bandwidth(device: torch.device | str, tensor_bytes: int, peak: float | None,
                      repeats: int = 10, warmup: int = 3, timer=None,
                      target: float = BANDWIDTH_TARGET,
                      extra_sizes: tuple[int, ...] | None = None,
                      launch_costs: bool | None = None) -> Outcome:
    """Section b: bytes/s of each workload, its share of `peak`, whether its output equals
    the CPU reference's, and `kernel_rates` per trace op name. Passes when
    every kernel reaches `target` of the peak and matches the reference. On a GPU (by
    default) the same kernels are also measured at `extra_sizes` (`by_size`, reported, not
    judged), and the host's microseconds per call through the cached launcher and the
    plain path (`host_launch_us`)."""
    device = torch.device(device)
    if timer is None:
        timer = CudaEventTimer(device) if device.type == "cuda" else WallTimer()
    if extra_sizes is None:
        extra_sizes = EXTRA_TENSOR_BYTES if device.type == "cuda" else ()
    if launch_costs is None:
        launch_costs = device.type == "cuda"
    rows, per_op, errors, count = _measure_workloads(device, tensor_bytes, peak, repeats,
                                                     warmup, timer, compare=True)
    workloads = range(count)
    by_size = {}
    for size in extra_sizes:
        size_rows, _, size_errors, _ = _measure_workloads(device, size, peak, repeats, warmup,
                                                          timer, compare=False)
        by_size[f"{size // MiB} MiB" if size >= MiB else f"{size} B"] = size_rows
        errors += [f"{size // MiB} MiB: {error}" for error in size_errors]
    copy_source = torch.empty(tensor_bytes // 2, dtype=torch.bfloat16, device=device)
    copy_target = torch.empty_like(copy_source)
    copy_seconds = timer.median_seconds(lambda: copy_target.copy_(copy_source), repeats, warmup)
    figures = {
        "tensor_bytes": tensor_bytes, "block_size": _engine_block_size(),
        "payloads_per_call": PAYLOADS_PER_CALL, "repeats": repeats, "warmup": warmup,
        "peak_bytes_per_second": peak, "target_fraction": target, "kernels": rows,
        "kernel_rates": {op: combined_rate(pairs) for op, pairs in per_op.items()},
        "copy_bytes_per_second": bytes_per_second(2 * _nbytes(copy_source), copy_seconds),
        "backend": kernels.backend_for(copy_source, _engine_block_size()).__name__,
        "errors": errors,
        "by_size": {f"{tensor_bytes // MiB} MiB": rows, **by_size},
    }
    if launch_costs:
        try:
            figures["host_launch_us"] = host_launch_costs(device)
        except Exception as error:  # noqa: BLE001 (a side measurement; the rates stand)
            figures["host_launch_us"] = {"error": one_line(error)}
    if errors:
        return Outcome("fail", f"{len(errors)} of {len(workloads)} kernels failed, first: "
                       f"{errors[0]}", figures)
    wrong = [r["kernel"] for r in rows if not r["matches_reference"]]
    slowest = min(rows, key=lambda r: r["bytes_per_second"])
    if wrong:
        return Outcome("fail", f"{len(wrong)} kernels differ from the reference on "
                       f"{tensor_bytes // MiB} MiB: {', '.join(wrong)}", figures)
    if not peak:
        return Outcome("fail", "peak bandwidth unknown (no memory clock and an unlisted "
                       f"device); slowest {slowest['kernel']} at "
                       f"{format_rate(slowest['bytes_per_second'])}", figures)
    below = [r for r in rows if r["fraction_of_peak"] < target]
    lowest = (f"lowest {slowest['kernel']} at {slowest['fraction_of_peak']:.0%} of "
              f"{format_rate(peak)}")
    if below:
        return Outcome("fail", f"{len(below)} of {len(rows)} kernels below {target:.0%} of "
                       f"peak; {lowest}", figures)
    return Outcome("pass", f"all {len(rows)} kernels >= {target:.0%} of peak; {lowest}", figures)


def _output_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    if actual.dtype == torch.uint8:  # a payload: no NaN in these inputs, so bytes decide
        index = first_value_mismatch(actual, expected)
        return None if index is None else f"byte {index}"
    return _value_mismatch(actual, expected)


# ---- standalone ------------------------------------------------------------------------------


def format_section_b(figures: dict) -> str:
    """Section b's figures as a table: GB/s and % of peak per kernel and size, then the
    host's microseconds per call through the cached launcher and the plain path."""
    peak = figures.get("peak_bytes_per_second")
    sizes = list(figures.get("by_size") or {})
    lines = [f"peak {format_rate(peak) if peak else 'unknown'}; copy "
             f"{format_rate(figures['copy_bytes_per_second'])}; backend {figures['backend']}",
             "", "| kernel | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes)]
    labels = [row["kernel"] for row in figures["kernels"]]
    for label in labels:
        cells = []
        for size in sizes:
            row = next((r for r in figures["by_size"][size] if r["kernel"] == label), None)
            if row is None:
                cells.append("-")
                continue
            share = f" ({row['fraction_of_peak']:.0%})" if row["fraction_of_peak"] else ""
            cells.append(f"{row['bytes_per_second'] / 1e9:.0f} GB/s{share}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    launches = figures.get("host_launch_us")
    if launches and "kernels" in launches:
        lines += ["", f"host us per call ({launches['calls']} calls of {launches['numel']} "
                  "values):", "", "| kernel | cached launcher | kernel[grid] |", "|---|---|---|"]
        for row in launches["kernels"]:
            direct = f"{row['direct_us']:.1f}" + ("" if row["direct_path_taken"] else " (plain)")
            lines.append(f"| {row['kernel']} | {direct} | {row['plain_us']:.1f} |")
    elif launches:
        lines += ["", f"host us per call: {launches.get('error')}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m scripts.gpu_check.kernels --section b --out DIR`: one section of the
    GPU check on its own (under a minute on an H100/H200), its JSON in DIR/kernels_<s>.json."""
    import argparse
    import json
    from pathlib import Path

    from scripts.gpu_check.report import json_safe

    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_check.kernels",
                                     description=main.__doc__.split("\n")[0])
    parser.add_argument("--section", choices=("a", "b"), default="b")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (a folder)")
    parser.add_argument("--quick", action="store_true", help="16 MiB instead of 64, 5 repeats")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    from scripts.gpu_check.report import describe_device

    device_facts, environment = describe_device()
    started = time.perf_counter()
    if args.section == "a":
        outcome = check_bit_exact("cuda")
    else:
        peak = device_facts["peak_memory_bandwidth"]
        outcome = measure_bandwidth(
            "cuda", QUICK_TENSOR_BYTES if args.quick else FULL_TENSOR_BYTES,
            peak["bytes_per_second"] if peak else None, repeats=5 if args.quick else 10,
            warmup=2 if args.quick else 3)
    seconds = time.perf_counter() - started
    print(f"section {args.section}: {outcome.status}: {outcome.summary} ({seconds:.0f} s)")
    if args.section == "b":
        print(format_section_b(outcome.figures))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"kernels_{args.section}.json"
        record = {"section": args.section, "status": outcome.status, "summary": outcome.summary,
                  "seconds": seconds, "device": device_facts, "environment": environment,
                  "figures": outcome.figures}
        path.write_text(json.dumps(json_safe(record), indent=1, allow_nan=False))
        print(f"wrote {path}")
    return 0 if outcome.status == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
