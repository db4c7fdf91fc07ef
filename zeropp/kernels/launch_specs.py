"""How the host launches each Triton quantization kernel: the tile a layout takes and, per
kernel variant, its argument types, constexprs and warps.

`zeropp.kernels.triton_kernels` launches from these specifications, and the compile check
(`zeropp.kernels.compile_check`) compiles exactly these for real GPUs, so the variants it
checks are the variants that run. A specification names its kernel rather than holding it:
this module is plain Python, importable without Triton, and the kernels import it, not the
reverse (`triton_kernels.kernel_function` turns the name into the kernel). Specifications
are cached: the host builds each one once, not per call.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch

from zeropp.kernels import reference
from zeropp.kernels.reference import PayloadLayout, qmax_for_bits

# [Note: kernel tiles] A program is 4 warps and owns ROWS whole quantization blocks of
# BLOCK values (a compile-time constant), walked COLS columns at a time. Each thread moves
# 16 bytes of every packed-code stream: 16 int8 codes, or 32 int4 / int2 codes (int2: 8
# bytes, to keep 32 values a thread in registers), so a program moves 2048 values (int8) or
# 4096 (int4, int2) at once. At the default block of 256 a warp holds whole blocks, so each
# block's absmax is a reduction inside one warp (shuffles, no shared memory, no barrier).
# Blocks larger than a program's tile are walked in two passes (absmax, then quantize).
# The reductions read their K payloads (a compile-time constant) in one unrolled loop, so
# all of a tile's payload loads are in flight together. Registers, spills and occupancy per
# arch: `python -m scripts.bench.kernel_registers` (docs/kernel_registers.md).
NUM_WARPS = 4
# The reductions unroll at most this many payloads at a time (a runtime loop over groups
# beyond it), so a large K does not hold every payload's codes in registers at once.
MAX_UNROLLED_PAYLOADS = 8
# qgZ's first hop reduces the payloads of a node's ranks (8 on DGX machines): the variant
# the compile check and the register table list for the reductions.
DEFAULT_PAYLOADS = 8


# Values a thread holds, by code width: 16 bytes of int8 codes, 16 of int4, 8 of int2.
VALUES_PER_THREAD = {8: 16, 4: 32, 2: 32}


def values_per_thread(bits: int) -> int:
    return VALUES_PER_THREAD[bits]


class Tile(NamedTuple):
    rows: int  # whole blocks per program
    cols: int  # columns of a block handled at a time
    num_warps: int
    single_pass: bool  # the block fits one chunk: its values stay in registers


def _next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as `triton.next_power_of_2`."""
    return 1 << (n - 1).bit_length()


# Blocks under this many values carry a scale every few values: the reductions, which hold
# every payload's scales too, take 4 values a thread and a payload at a time there (as many
# registers as 32 values and 8 payloads otherwise spill); bandwidth is the scales' anyway.
SMALL_BLOCK = 16
_SMALL_BLOCK_VALUES_PER_THREAD = 4


def tile_config(block_size: int, bits: int, reduction: bool = False) -> Tile:
    """The host's tile for blocks of `block_size` whose codes are `bits` wide, in a
    reduction over payloads or not ([Note: kernel tiles])."""
    small = reduction and block_size < SMALL_BLOCK
    elements = NUM_WARPS * 32 * (_SMALL_BLOCK_VALUES_PER_THREAD if small
                                 else values_per_thread(bits))
    width = _next_power_of_2(block_size)
    cols = min(width, elements)
    return Tile(rows=max(1, elements // cols), cols=cols, num_warps=NUM_WARPS,
                single_pass=width <= elements)


def _packs_in_kernel(layout: PayloadLayout) -> bool:
    """Whether every block is whole bytes of codes (then each program packs its own and
    unpacks its own in registers)."""
    return layout.bits == 8 or layout.block_size % (8 // layout.bits) == 0


def scales_are_words(layout: PayloadLayout) -> bool:
    """Whether a payload's scales sit on 4-byte boundaries whenever the payload does: every
    block is a whole number of 4-byte words of codes, so the data region and every piece
    of whole blocks are too (then the kernels read and write scales as fp32 words)."""
    return layout.block_size * layout.bits % 32 == 0


def is_even(numel: int, block_size: int, tile: Tile) -> bool:
    """Whether `numel` values fill every program's tile: no program needs a mask."""
    return numel % (tile.rows * block_size) == 0


def _masks(block_size: int, tile: Tile, even: bool) -> dict[str, bool]:
    """Which masks a variant compiles: rows past the last block and values past the tensor
    only when the launch is not `even`; columns past a block's end whenever the block does
    not fill its chunks (a block size that is not a power of two)."""
    return {"MASK_ROWS": not even, "MASK_VALUES": not even or block_size % tile.cols != 0}


# ---- launch specifications: the one place that says how each kernel is launched ------------

_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class LaunchSpec(NamedTuple):
    """One compiled variant of a kernel, as the host launches it.

    ``kernel`` is the name of a kernel in `zeropp.kernels.triton_kernels`; ``signature``
    maps every runtime argument, in order, to its Triton type ("*fp16", "*u8", "i64",
    ...); ``constants`` are the constexpr arguments.
    """

    kernel: str
    signature: dict[str, str]
    constants: dict[str, int | bool]
    num_warps: int
    label: str = ""


def _unroll(payloads: int, block_size: int) -> int:
    if block_size < SMALL_BLOCK:
        return 1
    return max(1, min(payloads, MAX_UNROLLED_PAYLOADS))


def clear_caches() -> None:
    """Forget the built specs (after a change to the tile constants, as a tuning sweep
    makes)."""
    for builder in (_spec_quantize, _spec_dequantize, _spec_dequantize_reduce,
                    _spec_dequantize_reduce_quantize):
        builder.cache_clear()


@cache
def _spec_quantize(layout: PayloadLayout, dtype: torch.dtype, even: bool = False
                   ) -> LaunchSpec:
    tile = tile_config(layout.block_size, layout.bits)
    pack = _packs_in_kernel(layout)
    return LaunchSpec(
        "quantize_kernel",
        {"x_ptr": "*" + _TRITON_TYPES[dtype], "codes_ptr": "*u8", "payload_ptr": "*u8",
         "scale_offset": "i64", "numel": "i64", "nblocks": "i64", "piece_nbytes": "i64"},
        {"BLOCK": layout.block_size, "QMAX": qmax_for_bits(layout.bits), "BITS": layout.bits,
         # True: the kernel packs sub-byte codes itself (int4 nibbles, or four int2 codes a byte)
         "PACK": pack and layout.bits < 8,
         "ROWS": tile.rows, "COLS": tile.cols, "SINGLE_PASS": tile.single_pass,
         **_masks(layout.block_size, tile, even),
         "SCALES_F32": pack and scales_are_words(layout)},
        tile.num_warps, f"quantize {_TRITON_TYPES[dtype]} -> int{layout.bits}")


@cache
def _spec_dequantize(layout: PayloadLayout, dtype: torch.dtype, even: bool = False,
                     scales_f32: bool = False) -> LaunchSpec:
    tile = tile_config(layout.block_size, layout.bits)
    return LaunchSpec(
        "dequantize_kernel",
        {"payload_ptr": "*u8", "out_ptr": "*" + _TRITON_TYPES[dtype], "payload_stride": "i64",
         "out_stride": "i64", "numel": "i64", "nblocks": "i64", "data_nbytes": "i64"},
        {"BLOCK": layout.block_size, "BITS": layout.bits, "UNPACK": _packs_in_kernel(layout),
         "ROWS": tile.rows, "COLS": tile.cols, **_masks(layout.block_size, tile, even),
         "SCALES_F32": scales_f32},
        tile.num_warps, f"dequantize int{layout.bits} -> {_TRITON_TYPES[dtype]}")


@cache
def _spec_dequantize_reduce(layout: PayloadLayout, dtype: torch.dtype = torch.float32,
                            payloads: int = DEFAULT_PAYLOADS, even: bool = False,
                            scales_f32: bool = False) -> LaunchSpec:
    """``dtype``: the output's; qgZ's last sum lands in the gradient shard, fp32 or 16-bit."""
    tile = tile_config(layout.block_size, layout.bits, reduction=True)
    return LaunchSpec(
        "_dequantize_reduce_kernel",
        {"payload_ptr": "*u8", "out_ptr": "*" + _TRITON_TYPES[dtype], "payload_stride": "i64",
         "numel": "i64", "nblocks": "i64", "data_nbytes": "i64"},
        {"BLOCK": layout.block_size, "BITS": layout.bits, "UNPACK": _packs_in_kernel(layout),
         "K": payloads, "UNROLL": _unroll(payloads, layout.block_size), "ROWS": tile.rows,
         "COLS": tile.cols, **_masks(layout.block_size, tile, even), "SCALES_F32": scales_f32},
        tile.num_warps, f"dequantize-reduce {payloads} x int{layout.bits} -> "
                        f"{_TRITON_TYPES[dtype]}")


@cache
def _spec_dequantize_reduce_quantize(layout_in: PayloadLayout, layout_out: PayloadLayout,
                                     payloads: int = DEFAULT_PAYLOADS, even: bool = False,
                                     scales_f32_in: bool = False) -> LaunchSpec:
    # The tile follows the input's width: the wider stream of codes sets the values a thread.
    tile = tile_config(layout_in.block_size, min(layout_in.bits, layout_out.bits),
                       reduction=True)
    pack = _packs_in_kernel(layout_out)
    return LaunchSpec(
        "dequantize_reduce_quantize_kernel",
        {"payload_ptr": "*u8", "codes_ptr": "*u8", "out_ptr": "*u8", "scale_offset": "i64",
         "payload_stride": "i64", "numel": "i64", "nblocks": "i64", "data_nbytes_in": "i64",
         "piece_nbytes": "i64"},
        {"BLOCK": layout_in.block_size, "BITS_IN": layout_in.bits,
         "UNPACK": _packs_in_kernel(layout_in), "QMAX_OUT": qmax_for_bits(layout_out.bits),
         "BITS_OUT": layout_out.bits, "PACK": pack and layout_out.bits < 8,
         "K": payloads, "UNROLL": _unroll(payloads, layout_in.block_size), "ROWS": tile.rows,
         "COLS": tile.cols, "SINGLE_PASS": tile.single_pass, **_masks(layout_in.block_size, tile, even),
         "SCALES_F32_IN": scales_f32_in,
         "SCALES_F32_OUT": pack and scales_are_words(layout_out)},
        tile.num_warps, f"dequantize-reduce-quantize {payloads} x int{layout_in.bits} -> "
                        f"int{layout_out.bits}")


def launch_specs(block_size: int, bits: int, dtype: torch.dtype,
                 payloads: int = DEFAULT_PAYLOADS, even: bool = False) -> list[LaunchSpec]:
    """Every kernel variant the host launches for payloads of ``bits`` at ``block_size``
    with values in ``dtype`` (the quantized input, the dequantized output), reductions over
    ``payloads`` payloads; ``even``: the variants for tensors that fill every program's
    tile (no masks), else those that mask. qgZ's kernels read payloads, and write payloads
    or fp32 sums, except that its last sum may land in a gradient shard of ``dtype``. The
    requantization between qgZ's hops may narrow the width (int4 in, int2 out), so it is
    listed for every output width. Payloads are read as fp32 scale words where their layout
    allows it (the host checks each call's pointers and falls back to bytes)."""
    layout = reference.payload_layout(block_size, bits, block_size)
    words = scales_are_words(layout)
    requantize = [_spec_dequantize_reduce_quantize(
        layout, reference.payload_layout(block_size, bits_out, block_size), payloads, even,
        words) for bits_out in reference.SUPPORTED_BITS]
    return [_spec_quantize(layout, dtype, even), _spec_dequantize(layout, dtype, even, words),
            _spec_dequantize_reduce(layout, torch.float32, payloads, even, words), *requantize,
            *([_spec_dequantize_reduce(layout, dtype, payloads, even, words)]
              if dtype != torch.float32 else [])]
