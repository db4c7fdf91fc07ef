"""Triton kernels for ZeRO++ block quantization on CUDA.

Same contracts and payload layout as `zeropp.kernels.reference` (read its module docstring),
and bit-identical results: the reference is the specification, the tests compare the two.

Kernel shape: one program owns ROWS whole quantization blocks as a [ROWS, COLS] register
tile (COLS = next power of two >= block_size), so absmax, scale, rounding and int4 packing
all happen in one pass over the input; the scale never round-trips through memory.
Reductions loop over the k payloads inside the program and quantize the fp32 sum in the
same tile, so qgZ's dequantize-sum-requantize reads each payload byte once and writes the
result once.

Bit-exactness with torch, and why each choice is needed:
- x / scale and absmax / qmax use `tl.div_rn` (IEEE division); plain `/` may be approximate.
- Rounding is half-to-even built from floor and compares (exact for |v| < 2**23), which
  matches `torch.round` on every backend, the interpreter included.
- `tl.max` ignores NaN on CUDA, so non-finite blocks are detected explicitly.
- Kernels are launched with `enable_fp_fusion=False`: acc + q * scale fused into an FMA
  would round differently from torch's separate multiply and add.
- fp32 -> bf16 is rounded by hand: Triton's interpreter truncates where compiled code
  rounds to nearest-even, and one explicit rule keeps both equal to torch.
- Scales are written and read as four bytes each, because their offset in the payload is
  not 4-byte aligned for every block size.

Int4 with an odd block size lets a byte straddle two blocks, which a per-block tile cannot
pack; that rare configuration writes one code per byte to scratch and packs with torch.

Triton is imported at module import, and this module is only imported by
`zeropp.kernels` when a CUDA tensor (or ZEROPP_KERNELS=triton) asks for it; without Triton
the module still imports and `is_available()` is False. With TRITON_INTERPRET=1 set before
import, the kernels run on CPU tensors through Triton's interpreter (used by the tests).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from zeropp.kernels import reference
from zeropp.kernels.reference import INT4_OFFSET, PayloadLayout, qmax_for_bits

try:
    import triton
    import triton.language as tl
except ImportError:  # the module stays importable; is_available() reports the absence
    triton = None
    tl = None

MAX_BLOCK_SIZE = 16384  # one block must fit a register tile
_TILE_ELEMENTS = 4096  # elements per program: several small blocks, or one large block


def is_available() -> bool:
    """True when Triton is importable (CUDA tensors, or CPU under TRITON_INTERPRET=1)."""
    return triton is not None


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


# Kernels may only read module globals that are constexpr.
_NIBBLE_BIAS = tl.constexpr(INT4_OFFSET) if triton is not None else INT4_OFFSET


# ---------------------------------------------------------------------------------------------
# Device functions.
# ---------------------------------------------------------------------------------------------


@_jit
def _round_half_even(v):
    floor_v = tl.floor(v)
    frac = v - floor_v
    floor_is_odd = (floor_v - 2.0 * tl.floor(floor_v * 0.5)) == 1.0
    round_up = (frac > 0.5) | ((frac == 0.5) & floor_is_odd)
    return floor_v + round_up.to(tl.float32)


@_jit
def _quantize_tile(values, QMAX: tl.constexpr):
    """Signed codes (fp32) and per-row scales of an fp32 [ROWS, COLS] tile, zero-padded."""
    is_nonfinite = (values != values) | (tl.abs(values) == float("inf"))
    has_nonfinite = tl.max(is_nonfinite.to(tl.int32), axis=1) > 0
    absmax = tl.max(tl.abs(values), axis=1)
    scales = tl.div_rn(absmax, tl.zeros_like(absmax) + QMAX)
    scales = tl.where(has_nonfinite, float("nan"), scales)
    usable = scales > 0.0
    numerator, divisor = tl.broadcast(values, tl.where(usable, scales, 1.0)[:, None])
    codes = _round_half_even(tl.div_rn(numerator, divisor))
    codes = tl.minimum(tl.maximum(codes, -QMAX), QMAX)
    codes = tl.where(usable[:, None], codes, 0.0)
    return codes, scales


@_jit
def _store_codes(
    codes_ptr,
    codes,
    block_ids,
    offsets,
    in_block,
    row_valid,
    block_size,
    BITS: tl.constexpr,
    PACK_NIBBLES: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    if BITS == 8:
        tl.store(codes_ptr + offsets, codes.to(tl.int8).to(tl.uint8, bitcast=True), mask=in_block)
    elif PACK_NIBBLES:
        nibbles = (codes + _NIBBLE_BIAS).to(tl.uint8)
        low, high = tl.split(tl.reshape(nibbles, [ROWS, COLS // 2, 2]))
        pair_cols = tl.arange(0, COLS // 2)
        pairs_per_block = block_size // 2
        byte_offsets = block_ids[:, None] * pairs_per_block + pair_cols[None, :]
        pair_mask = row_valid[:, None] & (pair_cols[None, :] < pairs_per_block)
        tl.store(codes_ptr + byte_offsets, low | (high << 4), mask=pair_mask)
    else:
        tl.store(codes_ptr + offsets, (codes + _NIBBLE_BIAS).to(tl.uint8), mask=in_block)


@_jit
def _store_scales(scale_bytes_ptr, block_ids, scales, row_valid):
    bits = scales.to(tl.uint32, bitcast=True)
    base = scale_bytes_ptr + block_ids * 4
    tl.store(base, (bits & 0xFF).to(tl.uint8), mask=row_valid)
    tl.store(base + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=row_valid)
    tl.store(base + 2, ((bits >> 16) & 0xFF).to(tl.uint8), mask=row_valid)
    tl.store(base + 3, ((bits >> 24) & 0xFF).to(tl.uint8), mask=row_valid)


@_jit
def _load_scales(scale_bytes_ptr, block_ids, row_valid):
    base = scale_bytes_ptr + block_ids * 4
    b0 = tl.load(base, mask=row_valid, other=0).to(tl.uint32)
    b1 = tl.load(base + 1, mask=row_valid, other=0).to(tl.uint32)
    b2 = tl.load(base + 2, mask=row_valid, other=0).to(tl.uint32)
    b3 = tl.load(base + 3, mask=row_valid, other=0).to(tl.uint32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@_jit
def _load_values(
    payload_ptr, data_nbytes, block_ids, offsets, in_block, row_valid, BITS: tl.constexpr
):
    """fp32 dequantized values of one payload over the tile (padding included)."""
    scales = _load_scales(payload_ptr + data_nbytes, block_ids, row_valid)
    if BITS == 8:
        raw = tl.load(payload_ptr + offsets, mask=in_block, other=0)
        codes = raw.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        # Two neighbours read the same byte; the loads coalesce, and this works for any
        # block size because the nibble is picked by the global index.
        packed = tl.load(payload_ptr + offsets // 2, mask=in_block, other=_NIBBLE_BIAS)
        shift = ((offsets & 1) * 4).to(tl.int32)
        nibble = (packed.to(tl.int32) >> shift) & 0xF
        codes = (nibble - _NIBBLE_BIAS).to(tl.float32)
    return codes * scales[:, None]


@_jit
def _to_bfloat16_rtne(values):
    """fp32 -> bf16 rounded to nearest-even, NaN -> 0x7FC0, exactly as torch converts."""
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = tl.where(values != values, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@_jit
def _tile_indices(numel, nblocks, block_size, ROWS: tl.constexpr, COLS: tl.constexpr):
    block_ids = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    row_valid = block_ids < nblocks
    in_block = row_valid[:, None] & (cols[None, :] < block_size)
    offsets = block_ids[:, None] * block_size + cols[None, :]
    in_range = in_block & (offsets < numel)
    return block_ids, offsets, row_valid, in_block, in_range


# ---------------------------------------------------------------------------------------------
# Kernels.
# ---------------------------------------------------------------------------------------------


@_jit
def quantize_kernel(
    x_ptr,
    codes_ptr,
    scale_bytes_ptr,
    numel,
    nblocks,
    block_size,
    QMAX: tl.constexpr,
    BITS: tl.constexpr,
    PACK_NIBBLES: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    block_ids, offsets, row_valid, in_block, in_range = _tile_indices(
        numel, nblocks, block_size, ROWS, COLS
    )
    values = tl.load(x_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
    codes, scales = _quantize_tile(values, QMAX)
    _store_codes(
        codes_ptr,
        codes,
        block_ids,
        offsets,
        in_block,
        row_valid,
        block_size,
        BITS,
        PACK_NIBBLES,
        ROWS,
        COLS,
    )
    _store_scales(scale_bytes_ptr, block_ids, scales, row_valid)


@_jit
def dequantize_kernel(
    payload_ptr,
    out_ptr,
    payload_stride,
    out_stride,
    numel,
    nblocks,
    block_size,
    data_nbytes,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    block_ids, offsets, row_valid, in_block, in_range = _tile_indices(
        numel, nblocks, block_size, ROWS, COLS
    )
    values = _load_values(
        payload_ptr + row * payload_stride,
        data_nbytes,
        block_ids,
        offsets,
        in_block,
        row_valid,
        BITS,
    )
    out_row_ptr = out_ptr + row * out_stride
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(out_row_ptr + offsets, _to_bfloat16_rtne(values), mask=in_range)
    else:
        tl.store(out_row_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=in_range)


@_jit
def _sum_payloads(
    payload_ptr,
    payload_stride,
    k,
    data_nbytes,
    block_ids,
    offsets,
    in_block,
    row_valid,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    total = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for i in range(0, k):
        total += _load_values(
            payload_ptr + i * payload_stride,
            data_nbytes,
            block_ids,
            offsets,
            in_block,
            row_valid,
            BITS,
        )
    return total


@_jit
def _dequantize_reduce_kernel(
    payload_ptr,
    out_ptr,
    payload_stride,
    k,
    numel,
    nblocks,
    block_size,
    data_nbytes,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    block_ids, offsets, row_valid, in_block, in_range = _tile_indices(
        numel, nblocks, block_size, ROWS, COLS
    )
    total = _sum_payloads(
        payload_ptr,
        payload_stride,
        k,
        data_nbytes,
        block_ids,
        offsets,
        in_block,
        row_valid,
        BITS,
        ROWS,
        COLS,
    )
    tl.store(out_ptr + offsets, total, mask=in_range)


@_jit
def dequantize_reduce_quantize_kernel(
    payload_ptr,
    codes_ptr,
    scale_bytes_ptr,
    payload_stride,
    k,
    numel,
    nblocks,
    block_size,
    data_nbytes_in,
    BITS_IN: tl.constexpr,
    QMAX_OUT: tl.constexpr,
    BITS_OUT: tl.constexpr,
    PACK_NIBBLES: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    block_ids, offsets, row_valid, in_block, in_range = _tile_indices(
        numel, nblocks, block_size, ROWS, COLS
    )
    total = _sum_payloads(
        payload_ptr,
        payload_stride,
        k,
        data_nbytes_in,
        block_ids,
        offsets,
        in_block,
        row_valid,
        BITS_IN,
        ROWS,
        COLS,
    )
    # The reference requantizes a zero-padded sum; NaN scales would leak into the padding.
    total = tl.where(in_range, total, 0.0)
    codes, scales = _quantize_tile(total, QMAX_OUT)
    _store_codes(
        codes_ptr,
        codes,
        block_ids,
        offsets,
        in_block,
        row_valid,
        block_size,
        BITS_OUT,
        PACK_NIBBLES,
        ROWS,
        COLS,
    )
    _store_scales(scale_bytes_ptr, block_ids, scales, row_valid)


# ---------------------------------------------------------------------------------------------
# Host side.
# ---------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_runnable(tensor: Tensor, layout: PayloadLayout) -> None:
    if triton is None:
        raise RuntimeError("the Triton kernels need the 'triton' package, which is not installed")
    if not tensor.is_cuda and not _interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors, got a tensor on {tensor.device} "
            "(set TRITON_INTERPRET=1 to run them on CPU)"
        )
    if layout.block_size > MAX_BLOCK_SIZE:
        raise ValueError(
            f"block_size {layout.block_size} exceeds the Triton kernels' limit of "
            f"{MAX_BLOCK_SIZE}; use ZEROPP_KERNELS=reference for larger blocks"
        )


def _tile_config(layout: PayloadLayout) -> tuple[int, int, int]:
    """(ROWS, COLS, num_warps) for a layout: whole blocks per program, ~4K elements a tile."""
    cols = triton.next_power_of_2(layout.block_size)
    rows = max(1, _TILE_ELEMENTS // cols)
    num_warps = min(16, max(4, rows * cols // 1024))
    return rows, cols, num_warps


# ---- launch specifications: the one place that says how each kernel is launched ------------

_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class LaunchSpec(NamedTuple):
    """One compiled variant of a kernel, as the host launches it.

    ``signature`` maps every runtime argument, in order, to its Triton type ("*fp16",
    "*u8", "i32", ...); ``constants`` are the constexpr arguments. The host launches from
    these, and the compile check (``zeropp.kernels.compile_check``) compiles exactly these
    for real GPUs, so the variants it checks are the variants that run.
    """

    kernel: str
    signature: dict[str, str]
    constants: dict[str, int | bool]
    num_warps: int
    label: str = ""

    @property
    def function(self):
        return globals()[self.kernel]


def _spec_quantize(layout: PayloadLayout, dtype: torch.dtype) -> LaunchSpec:
    rows, cols, num_warps = _tile_config(layout)
    return LaunchSpec(
        "quantize_kernel",
        {"x_ptr": "*" + _TRITON_TYPES[dtype], "codes_ptr": "*u8", "scale_bytes_ptr": "*u8",
         "numel": "i64", "nblocks": "i64", "block_size": "i32"},
        {"QMAX": qmax_for_bits(layout.bits), "BITS": layout.bits,
         "PACK_NIBBLES": _packs_in_kernel(layout) and layout.bits == 4,
         "ROWS": rows, "COLS": cols},
        num_warps, f"quantize {_TRITON_TYPES[dtype]} -> int{layout.bits}")


def _spec_dequantize(layout: PayloadLayout, dtype: torch.dtype) -> LaunchSpec:
    rows, cols, num_warps = _tile_config(layout)
    return LaunchSpec(
        "dequantize_kernel",
        {"payload_ptr": "*u8", "out_ptr": "*" + _TRITON_TYPES[dtype], "payload_stride": "i64",
         "out_stride": "i64", "numel": "i64", "nblocks": "i64", "block_size": "i32",
         "data_nbytes": "i64"},
        {"BITS": layout.bits, "ROWS": rows, "COLS": cols},
        num_warps, f"dequantize int{layout.bits} -> {_TRITON_TYPES[dtype]}")


def _spec_dequantize_reduce(layout: PayloadLayout) -> LaunchSpec:
    rows, cols, num_warps = _tile_config(layout)
    return LaunchSpec(
        "_dequantize_reduce_kernel",
        {"payload_ptr": "*u8", "out_ptr": "*fp32", "payload_stride": "i64", "k": "i32",
         "numel": "i64", "nblocks": "i64", "block_size": "i32", "data_nbytes": "i64"},
        {"BITS": layout.bits, "ROWS": rows, "COLS": cols},
        num_warps, f"dequantize-reduce int{layout.bits} -> fp32")


def _spec_dequantize_reduce_quantize(layout_in: PayloadLayout,
                                     layout_out: PayloadLayout) -> LaunchSpec:
    rows, cols, num_warps = _tile_config(layout_out)
    return LaunchSpec(
        "dequantize_reduce_quantize_kernel",
        {"payload_ptr": "*u8", "codes_ptr": "*u8", "scale_bytes_ptr": "*u8",
         "payload_stride": "i64", "k": "i32", "numel": "i64", "nblocks": "i64",
         "block_size": "i32", "data_nbytes_in": "i64"},
        {"BITS_IN": layout_in.bits, "QMAX_OUT": qmax_for_bits(layout_out.bits),
         "BITS_OUT": layout_out.bits,
         "PACK_NIBBLES": _packs_in_kernel(layout_out) and layout_out.bits == 4,
         "ROWS": rows, "COLS": cols},
        num_warps, f"dequantize-reduce-quantize int{layout_in.bits} -> int{layout_out.bits}")


def launch_specs(block_size: int, bits: int, dtype: torch.dtype) -> list[LaunchSpec]:
    """Every kernel variant the host launches for payloads of ``bits`` at ``block_size``
    with values in ``dtype`` (the quantized input, the dequantized output); the qgZ
    kernels read and write payloads only, so they are the same for every dtype."""
    layout = reference.payload_layout(block_size, bits, block_size)
    return [_spec_quantize(layout, dtype), _spec_dequantize(layout, dtype),
            _spec_dequantize_reduce(layout), _spec_dequantize_reduce_quantize(layout, layout)]


def _launch(spec: LaunchSpec, grid: tuple[int, ...], *args) -> None:
    if len(args) != len(spec.signature):
        raise TypeError(f"{spec.kernel}: {len(args)} arguments for {list(spec.signature)}")
    spec.function[grid](*args, **spec.constants, num_warps=spec.num_warps,
                        enable_fp_fusion=False)


def _packs_in_kernel(layout: PayloadLayout) -> bool:
    return layout.bits == 8 or layout.block_size % 2 == 0


def _codes_target(payload: Tensor, layout: PayloadLayout) -> Tensor:
    """Where the kernel writes codes: the payload, or one-nibble-per-byte scratch."""
    if _packs_in_kernel(layout):
        return payload
    # Pre-filled with the code of zero so the spare high nibble of an odd length is set.
    return torch.full(
        (2 * layout.data_nbytes,), INT4_OFFSET, dtype=torch.uint8, device=payload.device
    )


def _finish_codes(payload: Tensor, codes_target: Tensor, layout: PayloadLayout) -> None:
    if codes_target is not payload:
        payload[: layout.data_nbytes] = codes_target[0::2] | (codes_target[1::2] << 4)


def quantize_blockwise(x: Tensor, bits: int, block_size: int) -> Tensor:
    """Triton version of `reference.quantize_blockwise`."""
    layout = reference.check_quantize_input(x, bits, block_size)
    _check_runnable(x, layout)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)
    if layout.numel == 0:
        return payload
    rows, cols, num_warps = _tile_config(layout)
    codes_target = _codes_target(payload, layout)
    grid = (triton.cdiv(layout.nblocks, rows),)
    _launch(_spec_quantize(layout, x.dtype), grid, x, codes_target,
            payload[layout.data_nbytes :], layout.numel, layout.nblocks, layout.block_size)
    _finish_codes(payload, codes_target, layout)
    return payload


def _dequantize_rows(payloads: Tensor, out: Tensor, layout: PayloadLayout) -> None:
    """Dequantize each row of `payloads` (k, nbytes) into the row of `out` (k, numel)."""
    rows, cols, num_warps = _tile_config(layout)
    grid = (triton.cdiv(layout.nblocks, rows), payloads.shape[0])
    _launch(_spec_dequantize(layout, out.dtype), grid, payloads, out, payloads.stride(0),
            out.stride(0), layout.numel, layout.nblocks, layout.block_size, layout.data_nbytes)


def dequantize_blockwise(
    payload: Tensor,
    numel: int,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
    out: Tensor | None = None,
) -> Tensor:
    """Triton version of `reference.dequantize_blockwise`."""
    layout = reference.payload_layout(numel, bits, block_size)
    reference.check_payloads(payload, layout, ndim=1)
    reference.check_float_dtype(dtype, "dtype")
    _check_runnable(payload, layout)
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=payload.device)
    else:
        reference.check_out(out, numel, dtype, payload.device)
    if numel:
        _dequantize_rows(payload.view(1, -1), out.view(1, -1), layout)
    return out


def dequantize_blockwise_many(
    payloads: Tensor, numel: int, bits: int, block_size: int, dtype: torch.dtype
) -> Tensor:
    """Triton version of `reference.dequantize_blockwise_many`."""
    layout = reference.payload_layout(numel, bits, block_size)
    reference.check_payloads(payloads, layout, ndim=2)
    reference.check_float_dtype(dtype, "dtype")
    _check_runnable(payloads, layout)
    out = torch.empty(payloads.shape[0], numel, dtype=dtype, device=payloads.device)
    if numel and payloads.shape[0]:
        _dequantize_rows(payloads, out, layout)
    return out


def dequantize_reduce(payloads: Tensor, numel: int, bits: int, block_size: int) -> Tensor:
    """Triton version of `reference.dequantize_reduce`."""
    layout = reference.payload_layout(numel, bits, block_size)
    reference.check_payloads(payloads, layout, ndim=2)
    _check_runnable(payloads, layout)
    total = torch.empty(numel, dtype=torch.float32, device=payloads.device)
    if numel == 0:
        return total
    rows, cols, num_warps = _tile_config(layout)
    grid = (triton.cdiv(layout.nblocks, rows),)
    _launch(_spec_dequantize_reduce(layout), grid, payloads, total, payloads.stride(0),
            payloads.shape[0], numel, layout.nblocks, block_size, layout.data_nbytes)
    return total


def dequantize_reduce_quantize(
    payloads: Tensor, numel: int, bits_in: int, bits_out: int, block_size: int
) -> Tensor:
    """Triton version of `reference.dequantize_reduce_quantize` (one fused kernel)."""
    layout_in = reference.payload_layout(numel, bits_in, block_size)
    layout_out = reference.payload_layout(numel, bits_out, block_size)
    reference.check_payloads(payloads, layout_in, ndim=2)
    _check_runnable(payloads, layout_in)
    payload = torch.empty(layout_out.nbytes, dtype=torch.uint8, device=payloads.device)
    if numel == 0:
        return payload
    rows, cols, num_warps = _tile_config(layout_out)
    codes_target = _codes_target(payload, layout_out)
    grid = (triton.cdiv(layout_out.nblocks, rows),)
    _launch(_spec_dequantize_reduce_quantize(layout_in, layout_out), grid, payloads,
            codes_target, payload[layout_out.data_nbytes :], payloads.stride(0),
            payloads.shape[0], numel, layout_out.nblocks, block_size, layout_in.data_nbytes)
    _finish_codes(payload, codes_target, layout_out)
    return payload
