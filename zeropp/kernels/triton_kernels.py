"""Triton kernels for ZeRO++ block quantization on CUDA.

Same contracts and payload layout as `zeropp.kernels.reference` (read its module docstring),
and bit-identical results: the reference is the specification, the tests compare the two.

Kernel shape ([Note: kernel tiles], in `zeropp.kernels.launch_specs`, which also says how
the host launches each kernel variant): one program owns ROWS whole quantization blocks and
walks them in [ROWS, COLS] register tiles of 1024 values (8 per thread; 512 for the qgZ
reductions). A block that fits a tile is one tile, so absmax, scale, rounding and int4/int2
packing happen in one pass and the scale never round-trips through memory; a larger block is
read twice (absmax, then quantize). Reductions loop over the k payloads inside the program
and quantize the fp32 sum in the same tile, so qgZ's dequantize-sum-requantize reads each
payload byte once (twice for blocks larger than a tile) and writes the result once. Element
offsets inside a program are int32 from an int64 base: half the registers of int64 offsets.

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

qgZ's sends are pieces ([Note: payload pieces] in the reference): `quantize_swizzled` and
`dequantize_reduce_quantize(parts=...)` launch the same two kernels with extra grid
dimensions, one per slice, and each program writes its codes and scales straight to their
place in its piece, so the pieces cost no pass of their own.

Int4 with an odd block size (int2: one not a multiple of 4) lets a byte straddle two blocks,
which a per-block tile cannot pack; that rare configuration writes one code per byte to
scratch, packs with torch and, for pieces, shuffles the bytes with torch too.

Triton is imported at module import, and this module is only imported by
`zeropp.kernels` when a CUDA tensor (or ZEROPP_KERNELS=triton) asks for it; without Triton
the module still imports and `is_available()` is False. With TRITON_INTERPRET=1 set before
import, the kernels run on CPU tensors through Triton's interpreter (used by the tests).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from zeropp.kernels import reference
from zeropp.kernels.launch_specs import (  # noqa: F401 (launch_specs: callers list variants here)
    LaunchSpec,
    _packs_in_kernel,
    _spec_dequantize,
    _spec_dequantize_reduce,
    _spec_dequantize_reduce_quantize,
    _spec_quantize,
    launch_specs,
)
from zeropp.kernels.reference import PayloadLayout, code_offset

try:
    import triton
    import triton.language as tl
except ImportError:  # the module stays importable; is_available() reports the absence
    triton = None
    tl = None

MAX_BLOCK_SIZE = 16384  # one block must fit a register tile


def is_available() -> bool:
    """True when Triton is importable (CUDA tensors, or CPU under TRITON_INTERPRET=1)."""
    return triton is not None


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


# Kernels may only read module globals that are constexpr.
_NIBBLE_BIAS = tl.constexpr(code_offset(4)) if triton is not None else code_offset(4)
_CRUMB_BIAS = tl.constexpr(code_offset(2)) if triton is not None else code_offset(2)


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
def _program_blocks(nblocks, ROWS: tl.constexpr):
    """This program's first block (int64) and its [ROWS] row indices and row mask."""
    first = tl.program_id(0).to(tl.int64) * ROWS
    rows = tl.arange(0, ROWS)
    return first, rows, first + rows < nblocks


@_jit
def _elements_left(numel, first, block_size, ROWS: tl.constexpr):
    """Elements from this program's first one to the end, capped at its tile (int32)."""
    return tl.minimum(numel - first * block_size, ROWS * block_size).to(tl.int32)


@_jit
def _chunk(rows, c0, block_size, elements_left, row_valid, COLS: tl.constexpr):
    """Offsets (int32, from the program's first element) of columns c0..c0+COLS of every
    row, which lie in a block, and which lie in the tensor."""
    cols = c0 + tl.arange(0, COLS)
    local = rows[:, None] * block_size + cols[None, :]
    in_block = row_valid[:, None] & (cols[None, :] < block_size)
    return local, in_block, in_block & (local < elements_left)


@_jit
def _tile_stats(values):
    """Per row: absmax (NaN ignored, as tl.max does on CUDA) and whether any is non-finite."""
    is_nonfinite = (values != values) | (tl.abs(values) == float("inf"))
    return tl.max(tl.abs(values), axis=1), tl.max(is_nonfinite.to(tl.int32), axis=1)


@_jit
def _block_scales(absmax, nonfinite, QMAX: tl.constexpr):
    scales = tl.div_rn(absmax, tl.zeros_like(absmax) + QMAX)
    return tl.where(nonfinite > 0, float("nan"), scales)


@_jit
def _codes(values, scales, QMAX: tl.constexpr):
    """Signed codes (fp32) of a [ROWS, COLS] tile under its rows' scales."""
    usable = scales > 0.0
    numerator, divisor = tl.broadcast(values, tl.where(usable, scales, 1.0)[:, None])
    codes = _round_half_even(tl.div_rn(numerator, divisor))
    codes = tl.minimum(tl.maximum(codes, -QMAX), QMAX)
    return tl.where(usable[:, None], codes, 0.0)


@_jit
def _store_codes(
    codes_ptr,
    codes,
    first,
    rows,
    c0,
    local,
    in_block,
    row_valid,
    block_size,
    BITS: tl.constexpr,
    PACK_NIBBLES: tl.constexpr,
    COLS: tl.constexpr,
):
    if BITS == 8:
        tl.store(codes_ptr + first * block_size + local,
                 codes.to(tl.int8).to(tl.uint8, bitcast=True), mask=in_block)
    elif PACK_NIBBLES and BITS == 4:
        nibbles = (codes + _NIBBLE_BIAS).to(tl.uint8)
        low, high = tl.split(tl.reshape(nibbles, [nibbles.shape[0], COLS // 2, 2]))
        pairs_per_block = block_size // 2
        pair_cols = c0 // 2 + tl.arange(0, COLS // 2)
        byte_local = rows[:, None] * pairs_per_block + pair_cols[None, :]
        pair_mask = row_valid[:, None] & (pair_cols[None, :] < pairs_per_block)
        tl.store(codes_ptr + first * pairs_per_block + byte_local, low | (high << 4),
                 mask=pair_mask)
    elif PACK_NIBBLES:  # int2, blocks of whole bytes: four codes a byte, as for int4's two
        crumbs = (codes + _CRUMB_BIAS).to(tl.uint8)
        # Column 4g + 2i + j of the tile lands at [g, i, j]: split j, then i.
        even, odd = tl.split(tl.reshape(crumbs, [crumbs.shape[0], COLS // 4, 2, 2]))
        c0_codes, c2_codes = tl.split(even)
        c1_codes, c3_codes = tl.split(odd)
        packed = c0_codes | (c1_codes << 2) | (c2_codes << 4) | (c3_codes << 6)
        quads_per_block = block_size // 4
        quad_cols = c0 // 4 + tl.arange(0, COLS // 4)
        byte_local = rows[:, None] * quads_per_block + quad_cols[None, :]
        quad_mask = row_valid[:, None] & (quad_cols[None, :] < quads_per_block)
        tl.store(codes_ptr + first * quads_per_block + byte_local, packed, mask=quad_mask)
    else:  # blocks not of whole bytes: one code per byte into scratch, packed by the host
        bias = _NIBBLE_BIAS if BITS == 4 else _CRUMB_BIAS
        tl.store(codes_ptr + first * block_size + local, (codes + bias).to(tl.uint8),
                 mask=in_block)


@_jit
def _store_scales(scale_bytes_ptr, first, rows, scales, row_valid):
    bits = scales.to(tl.uint32, bitcast=True)
    base = scale_bytes_ptr + (first + rows) * 4
    tl.store(base, (bits & 0xFF).to(tl.uint8), mask=row_valid)
    tl.store(base + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=row_valid)
    tl.store(base + 2, ((bits >> 16) & 0xFF).to(tl.uint8), mask=row_valid)
    tl.store(base + 3, ((bits >> 24) & 0xFF).to(tl.uint8), mask=row_valid)


@_jit
def _load_scales(scale_bytes_ptr, first, rows, row_valid):
    base = scale_bytes_ptr + (first + rows) * 4
    b0 = tl.load(base, mask=row_valid, other=0).to(tl.uint32)
    b1 = tl.load(base + 1, mask=row_valid, other=0).to(tl.uint32)
    b2 = tl.load(base + 2, mask=row_valid, other=0).to(tl.uint32)
    b3 = tl.load(base + 3, mask=row_valid, other=0).to(tl.uint32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@_jit
def _load_chunk(payload_ptr, scales, first, local, in_block, block_size, BITS: tl.constexpr):
    """fp32 dequantized values of one payload over a chunk (padding included)."""
    base = first * block_size
    if BITS == 8:
        raw = tl.load(payload_ptr + base + local, mask=in_block, other=0)
        codes = raw.to(tl.int8, bitcast=True).to(tl.float32)
    elif BITS == 4:
        # Two neighbours read the same byte; the nibble is picked by the global index's
        # parity, so any block size works.
        index = local + (base & 1).to(tl.int32)
        packed = tl.load(payload_ptr + base // 2 + index // 2, mask=in_block, other=_NIBBLE_BIAS)
        nibble = (packed.to(tl.int32) >> ((index & 1) * 4)) & 0xF
        codes = (nibble - _NIBBLE_BIAS).to(tl.float32)
    else:  # int2: four neighbours share a byte, picked by the global index modulo 4
        index = local + (base & 3).to(tl.int32)
        packed = tl.load(payload_ptr + base // 4 + index // 4, mask=in_block, other=_CRUMB_BIAS)
        crumb = (packed.to(tl.int32) >> ((index & 3) * 2)) & 0x3
        codes = (crumb - _CRUMB_BIAS).to(tl.float32)
    return codes * scales[:, None]


@_jit
def _sum_chunk(
    payload_ptr,
    payload_stride,
    k,
    data_nbytes,
    first,
    rows,
    local,
    in_block,
    row_valid,
    block_size,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """fp32 sum over k payloads of one chunk; each payload's scales are read here, since k
    is only known at run time."""
    total = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for i in range(0, k):
        payload = payload_ptr + i * payload_stride
        scales = _load_scales(payload + data_nbytes, first, rows, row_valid)
        total += _load_chunk(payload, scales, first, local, in_block, block_size, BITS)
    return total


@_jit
def _to_bfloat16_rtne(values):
    """fp32 -> bf16 rounded to nearest-even, NaN -> 0x7FC0, exactly as torch converts."""
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = tl.where(values != values, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@_jit
def _store_values(out_ptr, values, local, in_range):
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(out_ptr + local, _to_bfloat16_rtne(values), mask=in_range)
    else:
        tl.store(out_ptr + local, values.to(out_ptr.dtype.element_ty), mask=in_range)


# ---------------------------------------------------------------------------------------------
# Kernels. [Note: kernel tiles] A program owns ROWS whole blocks and walks them COLS columns
# at a time (ROWS x COLS = 8 values a thread, 4 in the reductions). When a block fits one
# chunk (SINGLE_PASS) its values stay in registers from absmax to store; a larger block is
# read twice, once for its absmax and once to quantize (the second read mostly hits L2),
# instead of holding up to 16384 values per program in registers, which spilled.
# ---------------------------------------------------------------------------------------------


@_jit
def quantize_kernel(
    x_ptr,
    codes_ptr,
    scale_bytes_ptr,
    numel,
    nblocks,
    block_size,
    piece_nbytes,
    QMAX: tl.constexpr,
    BITS: tl.constexpr,
    PACK_NIBBLES: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):
    # [Note: payload pieces] Program (b, l, m) quantizes blocks b * ROWS.. of the slice of
    # rank m * per_node + l (numel values, nblocks blocks) into piece l, whose slices are
    # whole bytes in node order: there they are blocks m * nblocks.. of the piece's payload.
    # A plain quantization is one slice in one piece.
    first, rows, row_valid = _program_blocks(nblocks, ROWS)
    left = _elements_left(numel, first, block_size, ROWS)
    rank = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    x = x_ptr + rank.to(tl.int64) * numel + first * block_size
    first_out = tl.program_id(2).to(tl.int64) * nblocks + first
    piece = tl.program_id(1).to(tl.int64) * piece_nbytes
    codes_ptr += piece
    scale_bytes_ptr += piece
    if SINGLE_PASS:
        local, in_block, in_range = _chunk(rows, 0, block_size, left, row_valid, COLS)
        values = tl.load(x + local, mask=in_range, other=0.0).to(tl.float32)
        absmax, nonfinite = _tile_stats(values)
        scales = _block_scales(absmax, nonfinite, QMAX)
        _store_codes(codes_ptr, _codes(values, scales, QMAX), first_out, rows, 0, local,
                     in_block, row_valid, block_size, BITS, PACK_NIBBLES, COLS)
    else:
        absmax = tl.zeros([ROWS], dtype=tl.float32)
        nonfinite = tl.zeros([ROWS], dtype=tl.int32)
        for c0 in range(0, block_size, COLS):
            local, in_block, in_range = _chunk(rows, c0, block_size, left, row_valid, COLS)
            chunk_max, chunk_nonfinite = _tile_stats(
                tl.load(x + local, mask=in_range, other=0.0).to(tl.float32))
            absmax = tl.maximum(absmax, chunk_max)
            nonfinite = tl.maximum(nonfinite, chunk_nonfinite)
        scales = _block_scales(absmax, nonfinite, QMAX)
        for c0 in range(0, block_size, COLS):
            local, in_block, in_range = _chunk(rows, c0, block_size, left, row_valid, COLS)
            values = tl.load(x + local, mask=in_range, other=0.0).to(tl.float32)
            _store_codes(codes_ptr, _codes(values, scales, QMAX), first_out, rows, c0, local,
                         in_block, row_valid, block_size, BITS, PACK_NIBBLES, COLS)
    _store_scales(scale_bytes_ptr, first_out, rows, scales, row_valid)


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
    first, rows, row_valid = _program_blocks(nblocks, ROWS)
    left = _elements_left(numel, first, block_size, ROWS)
    payload_row = tl.program_id(1).to(tl.int64)
    payload = payload_ptr + payload_row * payload_stride
    out = out_ptr + payload_row * out_stride + first * block_size
    scales = _load_scales(payload + data_nbytes, first, rows, row_valid)
    for c0 in range(0, block_size, COLS):
        local, in_block, in_range = _chunk(rows, c0, block_size, left, row_valid, COLS)
        values = _load_chunk(payload, scales, first, local, in_block, block_size, BITS)
        _store_values(out, values, local, in_range)


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
    first, rows, row_valid = _program_blocks(nblocks, ROWS)
    left = _elements_left(numel, first, block_size, ROWS)
    out = out_ptr + first * block_size
    for c0 in range(0, block_size, COLS):
        local, in_block, in_range = _chunk(rows, c0, block_size, left, row_valid, COLS)
        total = _sum_chunk(payload_ptr, payload_stride, k, data_nbytes, first, rows, local,
                           in_block, row_valid, block_size, BITS, ROWS, COLS)
        # The fp32 sum rounded once to the output's dtype (a 16-bit gradient shard).
        _store_values(out, total, local, in_range)


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
    piece_nbytes,
    BITS_IN: tl.constexpr,
    QMAX_OUT: tl.constexpr,
    BITS_OUT: tl.constexpr,
    PACK_NIBBLES: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):
    # [Note: payload pieces] Program (b, j) sums blocks b * ROWS.. of slice j (numel values,
    # nblocks blocks) and writes them into piece j of the output. The inputs are addressed
    # by their global block, `first_in`, since their slices need not start on a whole byte.
    first, rows, row_valid = _program_blocks(nblocks, ROWS)
    left = _elements_left(numel, first, block_size, ROWS)
    part = tl.program_id(1).to(tl.int64)
    first_in = part * nblocks + first
    codes_ptr += part * piece_nbytes
    scale_bytes_ptr += part * piece_nbytes
    # The reference requantizes a zero-padded sum; NaN scales would leak into the padding,
    # hence the where() on every sum.
    if SINGLE_PASS:
        local, in_block, in_range = _chunk(rows, 0, block_size, left, row_valid, COLS)
        total = _sum_chunk(payload_ptr, payload_stride, k, data_nbytes_in, first_in, rows,
                           local, in_block, row_valid, block_size, BITS_IN, ROWS, COLS)
        total = tl.where(in_range, total, 0.0)
        absmax, nonfinite = _tile_stats(total)
        scales = _block_scales(absmax, nonfinite, QMAX_OUT)
        _store_codes(codes_ptr, _codes(total, scales, QMAX_OUT), first, rows, 0, local,
                     in_block, row_valid, block_size, BITS_OUT, PACK_NIBBLES, COLS)
    else:
        # Two passes over the k payloads (see [Note: kernel tiles]): the sums are recomputed,
        # in the same order, so both passes see the same fp32 values.
        absmax = tl.zeros([ROWS], dtype=tl.float32)
        nonfinite = tl.zeros([ROWS], dtype=tl.int32)
        for c0 in range(0, block_size, COLS):
            local, in_block, in_range = _chunk(rows, c0, block_size, left, row_valid, COLS)
            total = _sum_chunk(payload_ptr, payload_stride, k, data_nbytes_in, first_in, rows,
                               local, in_block, row_valid, block_size, BITS_IN, ROWS, COLS)
            chunk_max, chunk_nonfinite = _tile_stats(tl.where(in_range, total, 0.0))
            absmax = tl.maximum(absmax, chunk_max)
            nonfinite = tl.maximum(nonfinite, chunk_nonfinite)
        scales = _block_scales(absmax, nonfinite, QMAX_OUT)
        for c0 in range(0, block_size, COLS):
            local, in_block, in_range = _chunk(rows, c0, block_size, left, row_valid, COLS)
            total = _sum_chunk(payload_ptr, payload_stride, k, data_nbytes_in, first_in, rows,
                               local, in_block, row_valid, block_size, BITS_IN, ROWS, COLS)
            total = tl.where(in_range, total, 0.0)
            _store_codes(codes_ptr, _codes(total, scales, QMAX_OUT), first, rows, c0, local,
                         in_block, row_valid, block_size, BITS_OUT, PACK_NIBBLES, COLS)
    _store_scales(scale_bytes_ptr, first, rows, scales, row_valid)


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


def kernel_function(spec: LaunchSpec):
    """The @triton.jit kernel that ``spec`` launches (a spec names its kernel)."""
    return globals()[spec.kernel]


def _launch(spec: LaunchSpec, nblocks: int, *args, grid: tuple[int, ...] = ()) -> None:
    """Launch ``spec`` over ``nblocks`` blocks, ROWS a program, times the extra ``grid``
    dimensions (payload rows, pieces, slices)."""
    if len(args) != len(spec.signature):
        raise TypeError(f"{spec.kernel}: {len(args)} arguments for {list(spec.signature)}")
    grid = (triton.cdiv(nblocks, spec.constants["ROWS"]), *grid)
    kernel_function(spec)[grid](*args, **spec.constants, num_warps=spec.num_warps,
                        enable_fp_fusion=False)


def _codes_target(payload: Tensor, layout: PayloadLayout) -> Tensor:
    """Where the kernel writes codes: the payload, or one-code-per-byte scratch."""
    if _packs_in_kernel(layout):
        return payload
    # Pre-filled with the code of zero so the spare slots of the last byte are set.
    return torch.full((8 // layout.bits * layout.data_nbytes,), code_offset(layout.bits),
                      dtype=torch.uint8, device=payload.device)


def _finish_codes(payload: Tensor, codes_target: Tensor, layout: PayloadLayout) -> None:
    if codes_target is not payload:
        payload[: layout.data_nbytes] = reference.pack_stored_codes(codes_target, layout.bits)


def _check_pieces(parts: int, numel: int, bits: int, block_size: int) -> PayloadLayout:
    """The layout of one of ``parts`` slices of ``numel`` values, which must be whole blocks
    of whole code bytes ([Note: payload pieces]); the reference's error otherwise."""
    whole = reference.payload_layout(parts * numel, bits, block_size)
    piece = reference.payload_layout(numel, bits, block_size)
    if numel % block_size or whole.data_nbytes != parts * piece.data_nbytes:
        raise ValueError(
            f"cannot split a payload of {parts} x {numel} values at block size {block_size}: "
            "slices must be whole blocks of whole bytes"
        )
    return piece


def quantize_blockwise(x: Tensor, bits: int, block_size: int) -> Tensor:
    """Triton version of `reference.quantize_blockwise`."""
    layout = reference.check_quantize_input(x, bits, block_size)
    _check_runnable(x, layout)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)
    if layout.numel == 0:
        return payload
    codes_target = _codes_target(payload, layout)
    # One slice in one piece: the piece strides are never multiplied by a nonzero index.
    _launch(_spec_quantize(layout, x.dtype), layout.nblocks, x, codes_target,
            payload[layout.data_nbytes :], layout.numel, layout.nblocks, layout.block_size,
            layout.nbytes, grid=(1, 1))
    _finish_codes(payload, codes_target, layout)
    return payload


def _dequantize_rows(payloads: Tensor, out: Tensor, layout: PayloadLayout) -> None:
    """Dequantize each row of `payloads` (k, nbytes) into the row of `out` (k, numel)."""
    _launch(_spec_dequantize(layout, out.dtype), layout.nblocks, payloads, out,
            payloads.stride(0), out.stride(0), layout.numel, layout.nblocks, layout.block_size,
            layout.data_nbytes, grid=(payloads.shape[0],))


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
    payloads: Tensor, numel: int, bits: int, block_size: int, dtype: torch.dtype,
    out: Tensor | None = None,
) -> Tensor:
    """Triton version of `reference.dequantize_blockwise_many`."""
    layout = reference.payload_layout(numel, bits, block_size)
    reference.check_payloads(payloads, layout, ndim=2)
    reference.check_float_dtype(dtype, "dtype")
    _check_runnable(payloads, layout)
    if out is None:
        out = torch.empty(payloads.shape[0], numel, dtype=dtype, device=payloads.device)
    else:
        reference.check_out(out, payloads.shape[0] * numel, dtype, payloads.device)
    if numel and payloads.shape[0]:
        _dequantize_rows(payloads, out.view(payloads.shape[0], numel), layout)
    return out


def dequantize_reduce(payloads: Tensor, numel: int, bits: int, block_size: int,
                      out: Tensor | None = None) -> Tensor:
    """Triton version of `reference.dequantize_reduce`."""
    layout = reference.payload_layout(numel, bits, block_size)
    reference.check_payloads(payloads, layout, ndim=2)
    _check_runnable(payloads, layout)
    if out is None:
        total = torch.empty(numel, dtype=torch.float32, device=payloads.device)
    else:
        reference.check_float_dtype(out.dtype, "out.dtype")
        reference.check_out(out, numel, out.dtype, payloads.device)
        total = out
    if numel == 0:
        return total
    _launch(_spec_dequantize_reduce(layout, total.dtype), layout.nblocks, payloads, total, payloads.stride(0),
            payloads.shape[0], numel, layout.nblocks, block_size, layout.data_nbytes)
    return total


def quantize_swizzled(x: Tensor, nodes: int, per_node: int, bits: int,
                      block_size: int) -> Tensor:
    """Triton version of `reference.quantize_swizzled`: one launch that writes every slice
    straight into its piece ([Note: payload pieces])."""
    layout = reference.check_quantize_input(x, bits, block_size)
    _check_runnable(x, layout)
    slice_numel = reference._slice_numel(x.reshape(-1), nodes, per_node)
    if not _packs_in_kernel(layout):
        # Codes that straddle blocks are packed on the host, so the pieces are shuffled there.
        payload = quantize_blockwise(x, bits, block_size)
        return reference.swizzle_payload(payload, nodes, per_node, slice_numel, bits,
                                         block_size).view(-1)
    one_slice = _check_pieces(nodes * per_node, slice_numel, bits, block_size)
    pieces = torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)
    if slice_numel == 0:
        return pieces
    _launch(_spec_quantize(layout, x.dtype), one_slice.nblocks, x, pieces,
            pieces[nodes * one_slice.data_nbytes :], slice_numel, one_slice.nblocks,
            block_size, nodes * one_slice.nbytes, grid=(per_node, nodes))
    return pieces


def dequantize_reduce_quantize(
    payloads: Tensor, numel: int, bits_in: int, bits_out: int, block_size: int,
    parts: int = 1,
) -> Tensor:
    """Triton version of `reference.dequantize_reduce_quantize`: one fused kernel, which
    also writes the `parts` payloads in place ([Note: payload pieces])."""
    layout_in = reference.payload_layout(numel, bits_in, block_size)
    layout_out = reference.payload_layout(numel, bits_out, block_size)
    reference.check_payloads(payloads, layout_in, ndim=2)
    _check_runnable(payloads, layout_in)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1 or numel % parts:
        raise ValueError(f"parts must be a positive int dividing numel={numel}, got {parts!r}")
    piece = (_check_pieces(parts, numel // parts, bits_out, block_size) if parts > 1
             else layout_out)
    payload = torch.empty(layout_out.nbytes, dtype=torch.uint8, device=payloads.device)
    if numel == 0:
        return payload
    spec = _spec_dequantize_reduce_quantize(layout_in, layout_out)
    if _packs_in_kernel(layout_out):
        _launch(spec, piece.nblocks, payloads, payload, payload[piece.data_nbytes :],
                payloads.stride(0), payloads.shape[0], piece.numel, piece.nblocks, block_size,
                layout_in.data_nbytes, piece.nbytes, grid=(parts,))
        return payload
    codes_target = _codes_target(payload, layout_out)
    _launch(spec, layout_out.nblocks, payloads, codes_target,
            payload[layout_out.data_nbytes :], payloads.stride(0), payloads.shape[0], numel,
            layout_out.nblocks, block_size, layout_in.data_nbytes, layout_out.nbytes,
            grid=(1,))
    _finish_codes(payload, codes_target, layout_out)
    if parts == 1:
        return payload
    # Codes that straddle blocks are packed on the host, so the pieces are shuffled there.
    return reference.split_payload(payload, parts, numel // parts, bits_out, block_size).view(-1)
