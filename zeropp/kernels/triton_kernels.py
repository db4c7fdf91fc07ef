"""Triton kernels for ZeRO++ block quantization on CUDA.

Same contracts and payload layout as `zeropp.kernels.reference` (read its module docstring),
and bit-identical results: the reference is the specification, the tests compare the two.

Kernel shape ([Note: kernel tiles], in `zeropp.kernels.launch_specs`, which also says how
the host launches each kernel variant): the block size, the tile and the payload count K
are compile-time constants. One program owns ROWS whole quantization blocks; each thread
moves 16 bytes of every packed-code stream (16 int8 codes, 32 int4 codes) and unpacks
or packs sub-byte codes in registers (a join or split of nibbles, no per-value byte
gathers). The quantize kernel codes a tile whose scales are all 0 or at least 2**-64 with
one multiply a value ([Note: plain rows] in `zeropp.kernels.triton_device`). A block that
fits a tile is one tile, so absmax, scale, rounding and packing happen in one pass and the
scale never round-trips through memory; a larger block is read twice (absmax, then
quantize). Reductions read the K payloads in one unrolled loop (all
loads in flight together; int4 codes a 32-bit word at a time, unpacked by one byte
permute a value, [Note: word sums] in `zeropp.kernels.triton_device`) and quantize the
fp32 sum in the same tile, so qgZ's
dequantize-sum-requantize reads each payload byte once (twice for blocks larger than a
tile) and writes the result once. Programs whose tile lies wholly inside the tensor are
compiled without masks when the whole launch is such (`EVEN`). Scales are read and written
as fp32 words where the payload keeps them 4-byte aligned (`SCALES_F32*`), else as bytes.

Bit-exactness with torch, and why each choice is needed:
- The scale is absmax times the fp32 constant 1 / qmax ([Note: scales by a multiply]); the
  reciprocal 1 / scale uses `tl.div_rn` (IEEE division, once per block); values are
  multiplied by the reciprocal, as the reference does.
- Rounding is half-to-even by adding 1.5 * 2**23 (exact for |v| < 2**22, and codes are
  at most 127 in magnitude), which matches `torch.round` on every backend, the
  interpreter included (libdevice's rint has no interpreter implementation); the sum's
  low bits are the code, so no float-to-int conversion follows. Sub-byte codes read back
  become floats the same way (ORed into 2**23's bits), without int-to-float conversions,
  which run at a quarter of the float rate (int8 codes keep the conversion, which reads
  the byte in place: measured faster there).
- The absmax propagates NaN (a max that keeps NaN), so non-finite blocks are found by one
  reduction: a NaN or inf absmax.
- Kernels are launched with `enable_fp_fusion=False`: acc + q * scale fused into an FMA
  would round differently from torch's separate multiply and add.
- fp32 -> bf16 is rounded by hand: Triton's interpreter truncates where compiled code
  rounds to nearest-even, and one explicit rule keeps both equal to torch.

qgZ's sends are pieces ([Note: payload pieces] in the reference): `quantize_swizzled` and
`dequantize_reduce_quantize(parts=...)` launch the same two kernels with extra grid
dimensions, one per slice, and each program writes its codes and scales straight to their
place in its piece, so the pieces cost no pass of their own.

Int4 with an odd block size (int2: one not a multiple of 4) lets a byte straddle two blocks,
which a per-block tile cannot pack; that rare configuration writes one code per byte to
scratch, packs with torch and, for pieces, shuffles the bytes with torch too (and reads
such payloads a code at a time).

Launches go through `zeropp.kernels.launcher` (a cached compiled kernel's launcher with the
raw stream); each call's layout and launch plan are computed once per shape and cached.

Triton is imported at module import, and this module is only imported by
`zeropp.kernels` when a CUDA tensor (or ZEROPP_KERNELS=triton) asks for it; without Triton
the module still imports and `is_available()` is False. With TRITON_INTERPRET=1 set before
import, the kernels run on CPU tensors through Triton's interpreter (used by the tests).
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

from zeropp.kernels import reference
from zeropp.kernels.launch_specs import (  # noqa: F401 (launch_specs: callers list variants here)
    MAX_UNROLLED_PAYLOADS,
    LaunchSpec,
    _packs_in_kernel,
    _spec_dequantize,
    _spec_dequantize_reduce,
    _spec_dequantize_reduce_quantize,
    _spec_quantize,
    is_even,
    launch_specs,
    scales_are_words,
    tile_config,
)
from zeropp.kernels.launcher import LAUNCHER
from zeropp.kernels.reference import PayloadLayout, code_offset
from zeropp.kernels.triton_device import (
    INTERPRETED,
    _absmax,
    _block_scales,
    _full_codes,
    _jit,
    _load,
    _load_codes,
    _load_scales,
    _max_keeping_nan,
    _quantize_second_pass,
    _requantized_sum,
    _store_codes,
    _store_scales,
    _store_values,
    _sum_chunk,
    _tile,
    _tile_codes,
)

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


# ---------------------------------------------------------------------------------------------
# Kernels. [Note: kernel tiles] A program owns ROWS whole blocks and walks them COLS columns
# at a time. When a block fits one chunk (SINGLE_PASS) its values stay in registers from
# absmax to store; a larger block is read twice, once for its absmax and once to quantize
# (the second read mostly hits L2), instead of holding up to 16384 values per program in
# registers, which spilled.
# ---------------------------------------------------------------------------------------------


@_jit
def quantize_kernel(
    x_ptr,
    codes_ptr,
    payload_ptr,
    scale_offset,
    numel,
    nblocks,
    piece_nbytes,
    BLOCK: tl.constexpr,
    QMAX: tl.constexpr,
    BITS: tl.constexpr,
    PACK: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    MASK_VALUES: tl.constexpr,
    SCALES_F32: tl.constexpr,
):
    # [Note: payload pieces] Program (b, l, m) quantizes blocks b * ROWS.. of the slice of
    # rank m * per_node + l (numel values, nblocks blocks) into piece l, whose slices are
    # whole bytes in node order: there they are blocks m * nblocks.. of the piece's payload.
    # A plain quantization is one slice in one piece. Codes go to `codes_ptr` (the payload,
    # or scratch for blocks not of whole bytes), scales to the payload at `scale_offset`.
    first = tl.program_id(0).to(tl.int64) * ROWS
    rank = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    x = x_ptr + rank.to(tl.int64) * numel + first * BLOCK
    first_out = tl.program_id(2).to(tl.int64) * nblocks + first
    piece = tl.program_id(1).to(tl.int64) * piece_nbytes
    codes_ptr += piece
    scales_ptr = payload_ptr + piece + scale_offset
    if SINGLE_PASS:
        rows, local, row_valid, in_block, in_range = _tile(first, 0, nblocks, numel, BLOCK,
                                                           ROWS, COLS)
        values = _load(x + local, in_range, 0.0, MASK_VALUES).to(tl.float32)
        scales = _block_scales(_absmax(values), QMAX)
        codes = _tile_codes(values, scales, QMAX, QMAX + 1 if BITS < 8 else 0)
        _store_codes(codes_ptr, codes, first_out, rows, 0, local, in_block, row_valid, BLOCK,
                     BITS, PACK, ROWS, COLS, MASK_VALUES)
    else:
        rows, local, row_valid, in_block, in_range = _tile(first, 0, nblocks, numel, BLOCK,
                                                           ROWS, COLS)
        absmax = tl.zeros([ROWS], dtype=tl.float32)
        for c0 in range(0, BLOCK, COLS):
            rows, local, row_valid, in_block, in_range = _tile(first, c0, nblocks, numel,
                                                               BLOCK, ROWS, COLS)
            values = _load(x + local, in_range, 0.0, MASK_VALUES).to(tl.float32)
            absmax = _max_keeping_nan(absmax, _absmax(values))
        scales = _block_scales(absmax, QMAX)
        _quantize_second_pass(x, codes_ptr, scales, first, first_out, nblocks, numel, BLOCK,
                              QMAX, BITS, PACK, ROWS, COLS, MASK_VALUES)
    _store_scales(scales_ptr, first_out + rows, scales, row_valid, SCALES_F32, MASK_ROWS)


@_jit
def dequantize_kernel(
    payload_ptr,
    out_ptr,
    payload_stride,
    out_stride,
    numel,
    nblocks,
    data_nbytes,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    UNPACK: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    MASK_VALUES: tl.constexpr,
    SCALES_F32: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * ROWS
    payload_row = tl.program_id(1).to(tl.int64)
    payload = payload_ptr + payload_row * payload_stride
    out = out_ptr + payload_row * out_stride + first * BLOCK
    rows, local, row_valid, in_block, in_range = _tile(first, 0, nblocks, numel, BLOCK, ROWS,
                                                       COLS)
    scales = _load_scales(payload + data_nbytes, first + rows, row_valid, SCALES_F32,
                          MASK_ROWS)
    for c0 in range(0, BLOCK, COLS):
        rows, local, row_valid, in_block, in_range = _tile(first, c0, nblocks, numel, BLOCK,
                                                           ROWS, COLS)
        codes = _load_codes(payload, first, rows, c0, local, in_block, row_valid, BLOCK, BITS,
                            UNPACK, ROWS, COLS, MASK_VALUES)
        _store_values(out + local, codes * scales[:, None], in_range, MASK_VALUES)


@_jit
def _dequantize_reduce_kernel(
    payload_ptr,
    out_ptr,
    payload_stride,
    numel,
    nblocks,
    data_nbytes,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    UNPACK: tl.constexpr,
    K: tl.constexpr,
    UNROLL: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    MASK_VALUES: tl.constexpr,
    SCALES_F32: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * ROWS
    out = out_ptr + first * BLOCK
    for c0 in range(0, BLOCK, COLS):
        rows, local, row_valid, in_block, in_range = _tile(first, c0, nblocks, numel, BLOCK,
                                                           ROWS, COLS)
        total = _sum_chunk(payload_ptr, payload_stride, data_nbytes, first, rows, c0, local,
                           in_block, row_valid, BLOCK, BITS, UNPACK, K, UNROLL, ROWS, COLS,
                           MASK_VALUES, MASK_ROWS, SCALES_F32)
        # The fp32 sum rounded once to the output's dtype (a 16-bit gradient shard).
        _store_values(out + local, total, in_range, MASK_VALUES)


@_jit
def dequantize_reduce_quantize_kernel(
    payload_ptr,
    codes_ptr,
    out_ptr,
    scale_offset,
    payload_stride,
    numel,
    nblocks,
    data_nbytes_in,
    piece_nbytes,
    BLOCK: tl.constexpr,
    BITS_IN: tl.constexpr,
    UNPACK: tl.constexpr,
    QMAX_OUT: tl.constexpr,
    BITS_OUT: tl.constexpr,
    PACK: tl.constexpr,
    K: tl.constexpr,
    UNROLL: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    MASK_VALUES: tl.constexpr,
    SCALES_F32_IN: tl.constexpr,
    SCALES_F32_OUT: tl.constexpr,
):
    # [Note: payload pieces] Program (b, j) sums blocks b * ROWS.. of slice j (numel values,
    # nblocks blocks) and writes them into piece j of the output. The inputs are addressed
    # by their global block, `first_in`, since their slices need not start on a whole byte.
    first = tl.program_id(0).to(tl.int64) * ROWS
    part = tl.program_id(1).to(tl.int64)
    first_in = part * nblocks + first
    codes_ptr += part * piece_nbytes
    scales_ptr = out_ptr + part * piece_nbytes + scale_offset
    if SINGLE_PASS:
        total, rows, local, row_valid, in_block = _requantized_sum(
            payload_ptr, payload_stride, data_nbytes_in, first_in, first, 0, nblocks, numel,
            BLOCK, BITS_IN, UNPACK, K, UNROLL, ROWS, COLS, MASK_VALUES, MASK_ROWS,
            SCALES_F32_IN)
        scales = _block_scales(_absmax(total), QMAX_OUT)
        if BITS_IN == 2:  # [Note: plain rows]: the plain path costs int2 inputs registers
            codes = _full_codes(total, scales, QMAX_OUT, QMAX_OUT + 1 if BITS_OUT < 8 else 0)
        else:
            codes = _tile_codes(total, scales, QMAX_OUT, QMAX_OUT + 1 if BITS_OUT < 8 else 0)
        _store_codes(codes_ptr, codes, first, rows, 0, local, in_block, row_valid, BLOCK,
                     BITS_OUT, PACK, ROWS, COLS, MASK_VALUES)
    else:
        # Two passes over the K payloads (see [Note: kernel tiles]): the sums are recomputed,
        # in the same order, so both passes see the same fp32 values. (The tile before the
        # loops defines what the loops carry.)
        rows, local, row_valid, in_block, in_range = _tile(first, 0, nblocks, numel, BLOCK,
                                                           ROWS, COLS)
        absmax = tl.zeros([ROWS], dtype=tl.float32)
        for c0 in range(0, BLOCK, COLS):
            total, rows, local, row_valid, in_block = _requantized_sum(
                payload_ptr, payload_stride, data_nbytes_in, first_in, first, c0, nblocks,
                numel, BLOCK, BITS_IN, UNPACK, K, UNROLL, ROWS, COLS, MASK_VALUES, MASK_ROWS,
                SCALES_F32_IN)
            absmax = _max_keeping_nan(absmax, _absmax(total))
        scales = _block_scales(absmax, QMAX_OUT)
        for c0 in range(0, BLOCK, COLS):
            total, rows, local, row_valid, in_block = _requantized_sum(
                payload_ptr, payload_stride, data_nbytes_in, first_in, first, c0, nblocks,
                numel, BLOCK, BITS_IN, UNPACK, K, UNROLL, ROWS, COLS, MASK_VALUES, MASK_ROWS,
                SCALES_F32_IN)
            codes = _full_codes(total, scales, QMAX_OUT, QMAX_OUT + 1 if BITS_OUT < 8 else 0)
            _store_codes(codes_ptr, codes, first, rows, c0, local, in_block, row_valid, BLOCK,
                         BITS_OUT, PACK, ROWS, COLS, MASK_VALUES)
    _store_scales(scales_ptr, first + rows, scales, row_valid, SCALES_F32_OUT, MASK_ROWS)


# ---------------------------------------------------------------------------------------------
# Host side. Everything a call derives from its sizes (layouts, launch specs, grids) is
# computed once per shape and cached; per call the host checks its tensors, allocates its
# output and launches.
# ---------------------------------------------------------------------------------------------


def _check_runnable(tensor: Tensor, layout: PayloadLayout) -> None:
    if triton is None:
        raise RuntimeError("the Triton kernels need the 'triton' package, which is not installed")
    if not tensor.is_cuda and not INTERPRETED:
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


class _Variant:
    """A spec as the launcher takes it, checked against its kernel once."""

    __slots__ = ("kernel", "key", "constants", "num_warps", "rows", "arity")

    def __init__(self, spec: LaunchSpec) -> None:
        self.kernel = kernel_function(spec)
        names = list(self.kernel.arg_names)
        if names != [*spec.signature, *spec.constants]:
            raise TypeError(f"{spec.kernel}: the spec's arguments {[*spec.signature]} + "
                            f"{[*spec.constants]} are not the kernel's {names}")
        self.key = (spec.kernel, tuple(spec.signature.values()),
                    tuple(spec.constants.values()), spec.num_warps)
        self.constants = dict(spec.constants)
        self.num_warps = spec.num_warps
        self.rows = spec.constants["ROWS"]
        self.arity = len(spec.signature)


_variants: dict[LaunchSpec, _Variant] = {}


def _variant(spec: LaunchSpec) -> _Variant:
    # Specs are cached by their builders, so the same spec object comes back: look up by id
    # first (hashing a spec hashes its dicts' items).
    variant = _variants.get(id(spec))
    if variant is None:
        variant = _variants[id(spec)] = _Variant(spec)
        _keep_alive.append(spec)  # ids stay unique while the spec lives
    return variant


_keep_alive: list[LaunchSpec] = []


def _grid(variant: _Variant, nblocks: int, grid: tuple[int, ...]) -> tuple[int, ...]:
    return (-(-nblocks // variant.rows), *grid)


def _launch(spec: LaunchSpec, nblocks: int, *args, grid: tuple[int, ...] = ()) -> None:
    """Launch ``spec`` over ``nblocks`` blocks, ROWS a program, times the extra ``grid``
    dimensions (payload rows, pieces, slices)."""
    variant = _variant(spec)
    if len(args) != variant.arity:
        raise TypeError(f"{spec.kernel}: {len(args)} arguments for {list(spec.signature)}")
    LAUNCHER.launch(variant.kernel, variant.key, variant.constants, variant.num_warps,
                    _grid(variant, nblocks, grid), args)


def _prepare(spec: LaunchSpec, nblocks: int, *args, grid: tuple[int, ...] = ()) -> bool:
    """Compile what `_launch` with these arguments would launch, without launching it."""
    variant = _variant(spec)
    return LAUNCHER.prepare(variant.kernel, variant.key, variant.constants, variant.num_warps,
                            _grid(variant, nblocks, grid), args)


_layout = reference.payload_layout  # validated and kept per (numel, bits, block_size) there


def _scales_readable_as_words(payloads: Tensor, layout: PayloadLayout) -> bool:
    """Whether every row's scale region of `payloads` (rows of `layout`) is 4-byte aligned."""
    return (scales_are_words(layout) and payloads.data_ptr() % 4 == 0
            and (payloads.dim() == 1 or payloads.stride(0) % 4 == 0))


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


@cache
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


@cache
def _even(numel: int, layout: PayloadLayout, bits: int | None = None,
          reduction: bool = False) -> bool:
    return is_even(numel, layout.block_size,
                   tile_config(layout.block_size, bits if bits is not None else layout.bits,
                               reduction))


# ---- quantize ------------------------------------------------------------------------------


def _quantize_launch(x: Tensor, payload: Tensor, codes_target: Tensor, layout: PayloadLayout,
                     prepare: bool = False) -> bool:
    # One slice in one piece: the piece strides are never multiplied by a nonzero index.
    spec = _spec_quantize(layout, x.dtype, _even(layout.numel, layout))
    run = _prepare if prepare else _launch
    return run(spec, layout.nblocks, x, codes_target, payload, layout.data_nbytes,
               layout.numel, layout.nblocks, layout.nbytes, grid=(1, 1))


def quantize_blockwise(x: Tensor, bits: int, block_size: int) -> Tensor:
    """Triton version of `reference.quantize_blockwise`."""
    layout = reference.check_quantize_input(x, bits, block_size)
    _check_runnable(x, layout)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)
    if layout.numel == 0:
        return payload
    codes_target = _codes_target(payload, layout)
    _quantize_launch(x, payload, codes_target, layout)
    _finish_codes(payload, codes_target, layout)
    return payload


def _swizzled_launch(x: Tensor, pieces: Tensor, nodes: int, per_node: int,
                     one_slice: PayloadLayout, prepare: bool = False) -> bool:
    spec = _spec_quantize(one_slice, x.dtype, _even(one_slice.numel, one_slice))
    run = _prepare if prepare else _launch
    return run(spec, one_slice.nblocks, x, pieces, pieces, nodes * one_slice.data_nbytes,
               one_slice.numel, one_slice.nblocks, nodes * one_slice.nbytes,
               grid=(per_node, nodes))


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
    _swizzled_launch(x, pieces, nodes, per_node, one_slice)
    return pieces


# ---- dequantize ----------------------------------------------------------------------------


def _dequantize_rows(payloads: Tensor, out: Tensor, layout: PayloadLayout,
                     prepare: bool = False) -> bool:
    """Dequantize each row of `payloads` (k, nbytes) into the row of `out` (k, numel)."""
    spec = _spec_dequantize(layout, out.dtype, _even(layout.numel, layout),
                            _scales_readable_as_words(payloads, layout))
    run = _prepare if prepare else _launch
    return run(spec, layout.nblocks, payloads, out, payloads.stride(0), out.stride(0),
               layout.numel, layout.nblocks, layout.data_nbytes, grid=(payloads.shape[0],))


def dequantize_blockwise(
    payload: Tensor,
    numel: int,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
    out: Tensor | None = None,
) -> Tensor:
    """Triton version of `reference.dequantize_blockwise`."""
    layout = _layout(numel, bits, block_size)
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
    layout = _layout(numel, bits, block_size)
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


# ---- reductions ----------------------------------------------------------------------------


def _reduce_launch(payloads: Tensor, total: Tensor, layout: PayloadLayout,
                   prepare: bool = False) -> bool:
    spec = _spec_dequantize_reduce(layout, total.dtype, payloads.shape[0],
                                   _even(layout.numel, layout, reduction=True),
                                   _scales_readable_as_words(payloads, layout))
    run = _prepare if prepare else _launch
    return run(spec, layout.nblocks, payloads, total, payloads.stride(0), layout.numel,
               layout.nblocks, layout.data_nbytes)


def dequantize_reduce(payloads: Tensor, numel: int, bits: int, block_size: int,
                      out: Tensor | None = None) -> Tensor:
    """Triton version of `reference.dequantize_reduce`."""
    layout = _layout(numel, bits, block_size)
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
    _reduce_launch(payloads, total, layout)
    return total


def _requantize_launch(payloads: Tensor, codes_target: Tensor, payload: Tensor,
                       layout_in: PayloadLayout, layout_out: PayloadLayout,
                       piece: PayloadLayout, parts: int, prepare: bool = False) -> bool:
    """Launch the fused requantization of `parts` slices, each a `piece` of the output
    (one slice of the whole output when its codes are packed on the host)."""
    spec = _spec_dequantize_reduce_quantize(
        layout_in, layout_out, payloads.shape[0],
        _even(piece.numel, layout_in, min(layout_in.bits, layout_out.bits), True),
        _scales_readable_as_words(payloads, layout_in))
    run = _prepare if prepare else _launch
    return run(spec, piece.nblocks, payloads, codes_target, payload, piece.data_nbytes,
               payloads.stride(0), piece.numel, piece.nblocks, layout_in.data_nbytes,
               piece.nbytes, grid=(parts,))


def dequantize_reduce_quantize(
    payloads: Tensor, numel: int, bits_in: int, bits_out: int, block_size: int,
    parts: int = 1,
) -> Tensor:
    """Triton version of `reference.dequantize_reduce_quantize`: one fused kernel, which
    also writes the `parts` payloads in place ([Note: payload pieces])."""
    layout_in = _layout(numel, bits_in, block_size)
    layout_out = _layout(numel, bits_out, block_size)
    reference.check_payloads(payloads, layout_in, ndim=2)
    _check_runnable(payloads, layout_in)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1 or numel % parts:
        raise ValueError(f"parts must be a positive int dividing numel={numel}, got {parts!r}")
    piece = (_check_pieces(parts, numel // parts, bits_out, block_size) if parts > 1
             else layout_out)
    payload = torch.empty(layout_out.nbytes, dtype=torch.uint8, device=payloads.device)
    if numel == 0:
        return payload
    if _packs_in_kernel(layout_out):
        _requantize_launch(payloads, payload, payload, layout_in, layout_out, piece, parts)
        return payload
    codes_target = _codes_target(payload, layout_out)
    _requantize_launch(payloads, codes_target, payload, layout_in, layout_out, layout_out, 1)
    _finish_codes(payload, codes_target, layout_out)
    if parts == 1:
        return payload
    # Codes that straddle blocks are packed on the host, so the pieces are shuffled there.
    return reference.split_payload(payload, parts, numel // parts, bits_out, block_size).view(-1)


# ---- compiling ahead -----------------------------------------------------------------------


class _Placeholder:
    """Stands for a contiguous tensor in a launch that is compiled, not run: what the host
    and Triton's specialization read of it. Its address is 0, as 16-byte aligned as a fresh
    allocation."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, device
        self.is_cuda = device.type == "cuda"

    def data_ptr(self) -> int:
        return 0

    def dim(self) -> int:
        return len(self.shape)

    def stride(self, dim: int) -> int:
        stride = 1
        for size in self.shape[dim + 1:]:
            stride *= size
        return stride

    def view(self, *shape: int) -> _Placeholder:
        return _Placeholder(shape, self.dtype, self.device)


def prepare(device: torch.device, numel: int, bits: int, block_size: int, dtype: torch.dtype,
            payloads: int = 1, parts: int = 1,
            swizzles: tuple[tuple[int, int], ...] = (), bits_out: int | None = None) -> int:
    """Compile, without launching, what the calls on `numel` values would launch (the kernels
    of `zeropp.kernels.KernelVariant`), for fresh (16-byte aligned) tensors. Returns how many
    were prepared (0 where launches take the plain path: the interpreter, another Triton)."""
    layout = _layout(numel, bits, block_size)
    layout_out = layout if bits_out is None else _layout(numel, bits_out, block_size)
    if numel == 0 or block_size > MAX_BLOCK_SIZE:
        return 0

    def tensor(*shape: int, kind: torch.dtype = torch.uint8) -> _Placeholder:
        return _Placeholder(shape, kind, device)

    done = 0
    payload = tensor(layout.nbytes)
    if _packs_in_kernel(layout):
        done += _quantize_launch(tensor(numel, kind=dtype), payload, payload, layout, True)
        for nodes, per_node in swizzles:
            ranks = nodes * per_node
            if numel % ranks == 0 and (numel // ranks) % block_size == 0:
                one_slice = _check_pieces(ranks, numel // ranks, bits, block_size)
                done += _swizzled_launch(tensor(numel, kind=dtype), payload, nodes, per_node,
                                         one_slice, True)
    for rows in sorted({1, payloads}):
        done += _dequantize_rows(tensor(rows, layout.nbytes), tensor(rows, numel, kind=dtype),
                                 layout, True)
    batch = tensor(payloads, layout.nbytes)
    for out_dtype in sorted({torch.float32, dtype}, key=str):
        done += _reduce_launch(batch, tensor(numel, kind=out_dtype), layout, True)
    if numel % parts == 0:
        try:
            piece = (_check_pieces(parts, numel // parts, layout_out.bits, block_size)
                     if parts > 1 else layout_out)
        except ValueError:
            piece = None
        if piece is not None and _packs_in_kernel(layout_out):
            done += _requantize_launch(batch, payload, payload, layout, layout_out, piece,
                                       parts, True)
    return done
