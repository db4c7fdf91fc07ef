"""How the host launches each Triton quantization kernel: the tile a layout takes and, per
kernel variant, its argument types, constexprs and warps.

`zeropp.kernels.triton_kernels` launches from these specifications, and the compile check
(`zeropp.kernels.compile_check`) compiles exactly these for real GPUs, so the variants it
checks are the variants that run. A specification names its kernel rather than holding it:
this module is plain Python, importable without Triton, and the kernels import it, not the
reverse (`triton_kernels.kernel_function` turns the name into the kernel).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zeropp.kernels import reference
from zeropp.kernels.reference import PayloadLayout, qmax_for_bits

# [Note: kernel tiles] 4 warps x 32 threads x 8 values: a tile of 1024 values. 8 fp32 values
# a thread keep quantize and dequantize within 64 registers (>= 50% occupancy) on
# sm_70/80/90 with two 16-byte loads a thread in flight. The qgZ reductions keep a running
# fp32 sum and each payload's scales live across their loop over k payloads: at 8 values a
# thread they need up to 96 registers on sm_70, at 4 at most 56, so they take tiles of 512.
# Measured by `python -m scripts.bench.kernel_registers`.
_NUM_WARPS = 4
_VALUES_PER_THREAD = 8
_REDUCTION_VALUES_PER_THREAD = 4
_TILE_ELEMENTS = _NUM_WARPS * 32 * _VALUES_PER_THREAD


class Tile(NamedTuple):
    rows: int  # whole blocks per program
    cols: int  # columns of a block handled at a time
    num_warps: int
    single_pass: bool  # the block fits one chunk: its values stay in registers


def _next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as `triton.next_power_of_2`."""
    return 1 << (n - 1).bit_length()


def _tile_config(layout: PayloadLayout, values_per_thread: int = _VALUES_PER_THREAD) -> Tile:
    """The host's tile for a layout ([Note: kernel tiles])."""
    elements = _NUM_WARPS * 32 * values_per_thread
    width = _next_power_of_2(layout.block_size)
    cols = min(width, elements)
    return Tile(rows=max(1, elements // cols), cols=cols, num_warps=_NUM_WARPS,
                single_pass=width <= elements)


def _packs_in_kernel(layout: PayloadLayout) -> bool:
    """Whether every block is whole bytes of codes (then each program packs its own)."""
    return layout.bits == 8 or layout.block_size % (8 // layout.bits) == 0


# ---- launch specifications: the one place that says how each kernel is launched ------------

_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class LaunchSpec(NamedTuple):
    """One compiled variant of a kernel, as the host launches it.

    ``kernel`` is the name of a kernel in `zeropp.kernels.triton_kernels`; ``signature``
    maps every runtime argument, in order, to its Triton type ("*fp16", "*u8", "i32",
    ...); ``constants`` are the constexpr arguments.
    """

    kernel: str
    signature: dict[str, str]
    constants: dict[str, int | bool]
    num_warps: int
    label: str = ""


def _spec_quantize(layout: PayloadLayout, dtype: torch.dtype) -> LaunchSpec:
    tile = _tile_config(layout)
    return LaunchSpec(
        "quantize_kernel",
        {"x_ptr": "*" + _TRITON_TYPES[dtype], "codes_ptr": "*u8", "scale_bytes_ptr": "*u8",
         "numel": "i64", "nblocks": "i64", "block_size": "i32", "piece_nbytes": "i64"},
        {"QMAX": qmax_for_bits(layout.bits), "BITS": layout.bits,
         # True: the kernel packs sub-byte codes itself (int4 nibbles, or four int2 codes a byte)
         "PACK_NIBBLES": _packs_in_kernel(layout) and layout.bits < 8,
         "ROWS": tile.rows, "COLS": tile.cols, "SINGLE_PASS": tile.single_pass},
        tile.num_warps, f"quantize {_TRITON_TYPES[dtype]} -> int{layout.bits}")


def _spec_dequantize(layout: PayloadLayout, dtype: torch.dtype) -> LaunchSpec:
    tile = _tile_config(layout)
    return LaunchSpec(
        "dequantize_kernel",
        {"payload_ptr": "*u8", "out_ptr": "*" + _TRITON_TYPES[dtype], "payload_stride": "i64",
         "out_stride": "i64", "numel": "i64", "nblocks": "i64", "block_size": "i32",
         "data_nbytes": "i64"},
        {"BITS": layout.bits, "ROWS": tile.rows, "COLS": tile.cols},
        tile.num_warps, f"dequantize int{layout.bits} -> {_TRITON_TYPES[dtype]}")


def _spec_dequantize_reduce(layout: PayloadLayout,
                            dtype: torch.dtype = torch.float32) -> LaunchSpec:
    """``dtype``: the output's; qgZ's last sum lands in the gradient shard, fp32 or 16-bit."""
    tile = _tile_config(layout, _REDUCTION_VALUES_PER_THREAD)
    return LaunchSpec(
        "_dequantize_reduce_kernel",
        {"payload_ptr": "*u8", "out_ptr": "*" + _TRITON_TYPES[dtype], "payload_stride": "i64",
         "k": "i32", "numel": "i64", "nblocks": "i64", "block_size": "i32",
         "data_nbytes": "i64"},
        {"BITS": layout.bits, "ROWS": tile.rows, "COLS": tile.cols},
        tile.num_warps, f"dequantize-reduce int{layout.bits} -> {_TRITON_TYPES[dtype]}")


def _spec_dequantize_reduce_quantize(layout_in: PayloadLayout,
                                     layout_out: PayloadLayout) -> LaunchSpec:
    tile = _tile_config(layout_out, _REDUCTION_VALUES_PER_THREAD)
    return LaunchSpec(
        "dequantize_reduce_quantize_kernel",
        {"payload_ptr": "*u8", "codes_ptr": "*u8", "scale_bytes_ptr": "*u8",
         "payload_stride": "i64", "k": "i32", "numel": "i64", "nblocks": "i64",
         "block_size": "i32", "data_nbytes_in": "i64", "piece_nbytes": "i64"},
        {"BITS_IN": layout_in.bits, "QMAX_OUT": qmax_for_bits(layout_out.bits),
         "BITS_OUT": layout_out.bits,
         "PACK_NIBBLES": _packs_in_kernel(layout_out) and layout_out.bits < 8,
         "ROWS": tile.rows, "COLS": tile.cols, "SINGLE_PASS": tile.single_pass},
        tile.num_warps, f"dequantize-reduce-quantize int{layout_in.bits} -> int{layout_out.bits}")


def launch_specs(block_size: int, bits: int, dtype: torch.dtype) -> list[LaunchSpec]:
    """Every kernel variant the host launches for payloads of ``bits`` at ``block_size``
    with values in ``dtype`` (the quantized input, the dequantized output); qgZ's kernels
    read payloads, and write payloads or fp32 sums, except that its last sum may land in a
    gradient shard of ``dtype``. The requantization between qgZ's hops may narrow the width
    (int4 in, int2 out), so it is listed for every output width."""
    layout = reference.payload_layout(block_size, bits, block_size)
    requantize = [_spec_dequantize_reduce_quantize(
        layout, reference.payload_layout(block_size, bits_out, block_size))
        for bits_out in reference.SUPPORTED_BITS]
    return [_spec_quantize(layout, dtype), _spec_dequantize(layout, dtype),
            _spec_dequantize_reduce(layout), *requantize,
            *([_spec_dequantize_reduce(layout, dtype)] if dtype != torch.float32 else [])]
