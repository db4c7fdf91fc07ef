"""Tests of the ZeRO++ quantization kernels (zeropp.kernels).

The torch reference is checked against hand-made payloads, an independent numpy quantizer
and the per-block error bound; the Triton kernels are checked byte for byte against the
reference (on CUDA, or on CPU through Triton's interpreter when Triton is installed).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import zeropp.kernels as kernels
from zeropp.kernels import launch_specs, reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Half an ulp of the output dtype relative to the value, and its smallest subnormal step.
OUTPUT_RELATIVE_ROUNDING = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
OUTPUT_ABSOLUTE_ROUNDING = {torch.float32: 0.0, torch.float16: 2.0**-25, torch.bfloat16: 0.0}
AWKWARD_SHAPES = ((1, 1), (7, 3), (255, 64), (257, 256), (1000, 2048), (4097, 1), (999, 6))


def _sample(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values spanning several orders of magnitude, finite in fp16."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 3.0 ** torch.randint(-8, 8, (numel,), generator=gen)
    return (torch.randn(numel, generator=gen) * magnitudes).to(dtype)


def _numpy_quantize(x: torch.Tensor, bits: int, block_size: int) -> bytes:
    """Independent numpy statement of the payload format (see zeropp.kernels.reference)."""
    values = x.reshape(-1).float().numpy()
    qmax = 2 ** (bits - 1) - 1
    nblocks = math.ceil(values.size / block_size)
    padded = np.zeros(nblocks * block_size, dtype=np.float32)
    padded[: values.size] = values
    blocks = padded.reshape(nblocks, block_size)
    with np.errstate(invalid="ignore", divide="ignore"):
        absmax = np.abs(blocks).max(axis=1)
        # 1 / qmax rounded to fp64, then fp32 (as torch.tensor(1.0 / qmax) rounds it)
        scales = (absmax * np.float32(1.0 / qmax)).astype(np.float32)
        scales[~np.isfinite(absmax)] = np.nan
        usable = scales > 0
        # Values times the reciprocal; scales under 2**-64 through exact power-of-two
        # prescaling, so the reciprocal stays finite (the reference's module doc).
        prescale = np.where(scales < np.float32(2.0**-64), np.float32(2.0**64), np.float32(1))
        reciprocal = np.float32(1) / np.where(usable, scales * prescale, np.float32(1))
        codes = np.rint((blocks * prescale[:, None]) * reciprocal[:, None])
        codes = np.clip(codes, -qmax, qmax)
        codes[~usable] = 0
    codes = codes.astype(np.int8).ravel()
    if bits == 8:
        data = codes.view(np.uint8)
    else:  # offset-binary codes, 8 // bits a byte, lowest index in the lowest bits
        per_byte, offset = 8 // bits, 2 ** (bits - 1)
        stored = (codes + offset).astype(np.uint8)
        stored = np.append(stored, np.full(-stored.size % per_byte, offset, dtype=np.uint8))
        data = np.zeros(stored.size // per_byte, dtype=np.uint8)
        for slot in range(per_byte):
            data |= stored[slot::per_byte] << np.uint8(bits * slot)
    return data.tobytes() + scales.astype("<f4").tobytes()


def _payload_scales(payload: torch.Tensor, numel: int, bits: int, block_size: int) -> np.ndarray:
    layout = kernels.payload_layout(numel, bits, block_size)
    return np.frombuffer(payload.numpy().tobytes()[layout.data_nbytes :], dtype="<f4")


def _assert_within_block_bound(
    x: torch.Tensor, restored: torch.Tensor, scales: np.ndarray, block_size: int
) -> None:
    """|x - restored| <= scale/2 per block, plus fp32 slack and the output dtype's rounding."""
    original = x.reshape(-1).double().numpy()
    back = restored.double().numpy()
    per_value_scale = np.repeat(scales.astype(np.float64), block_size)[: original.size]
    tolerance = (
        per_value_scale * (0.5 + 2.0**-12)
        + np.abs(original) * 2.0**-22
        + np.abs(back) * OUTPUT_RELATIVE_ROUNDING[restored.dtype]
        + OUTPUT_ABSOLUTE_ROUNDING[restored.dtype]
    )
    error = np.abs(original - back)
    worst = int(np.argmax(error - tolerance))
    assert error[worst] <= tolerance[worst], (
        f"value {worst}: |{original[worst]} - {back[worst]}| > {tolerance[worst]}"
    )


# ---------------------------------------------------------------------------------------------
# Layout.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("numel", "bits", "block_size", "expected"),
    [
        (1000, 8, 256, 4 * 256 + 4 * 4),
        (1000, 4, 256, 4 * 128 + 4 * 4),
        (7, 4, 3, 5 + 3 * 4),  # 9 padded nibbles -> 5 bytes
        (1000, 2, 256, 4 * 64 + 4 * 4),
        (7, 2, 3, 3 + 3 * 4),  # 9 padded 2-bit codes -> 3 bytes
        (1, 8, 2048, 2048 + 4),
        (0, 4, 64, 0),
    ],
)
def test_quantized_nbytes(numel: int, bits: int, block_size: int, expected: int) -> None:
    assert kernels.quantized_nbytes(numel, bits, block_size) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 3, 4), "bits"),
        ((10, 1, 4), "bits"),
        ((10, 8, 0), "block_size"),
        ((-1, 8, 4), "numel"),
        ((10, 8.0, 4), "bits"),
        ((10.0, 8, 4), "numel"),
        ((True, 8, 4), "numel"),
        (([10], 8, 4), "numel"),  # unhashable: not a TypeError from the layouts kept
        ((10, 8, [4]), "block_size"),
    ],
)
def test_quantized_nbytes_rejects_bad_arguments(args: tuple, message: str) -> None:
    # the same values as ints first: a kept layout must not answer for a float or a bool
    kernels.quantized_nbytes(10, 8, 4)
    kernels.quantized_nbytes(1, 8, 4)
    with pytest.raises(ValueError, match=message):
        kernels.quantized_nbytes(*args)


def test_a_layout_is_worked_out_once_and_compares_by_its_arguments() -> None:
    layout = kernels.payload_layout(1000, 4, 256)
    assert kernels.payload_layout(1000, 4, 256) is layout
    assert (layout.nblocks, layout.padded_numel, layout.data_nbytes, layout.nbytes) == \
        (4, 1024, 512, 512 + 4 * 4)
    fresh = reference.PayloadLayout(1000, 4, 256)
    assert fresh == layout and hash(fresh) == hash(layout) and fresh is not layout
    assert reference.PayloadLayout(1001, 4, 256) != layout


def test_int8_layout_of_hand_made_blocks() -> None:
    # Scales 1, 2 and 0.5 are exact, so every code is known: 2.5 -> 2 and 0.5 -> 0 and
    # 1.5 -> 2 check round-half-to-even; the last block is padded with zeros.
    x = torch.tensor([127.0, -3.4, 0.6, 2.5, -254.0, 1.0, 0.0, 3.0, 63.5])
    payload = kernels.quantize_blockwise(x, bits=8, block_size=4)
    codes = [127, -3, 1, 2, -127, 0, 0, 2, 127, 0, 0, 0]
    expected = bytes(c & 0xFF for c in codes) + struct.pack("<3f", 1.0, 2.0, 0.5)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numpy().tobytes() == expected
    assert payload.numel() == kernels.quantized_nbytes(9, 8, 4)


def test_int4_layout_packs_even_index_in_low_nibble() -> None:
    x = torch.tensor([7.0, -3.4, 0.6, 2.5, -14.0, 1.0, 0.0, 3.0, 3.5])
    payload = kernels.quantize_blockwise(x, bits=4, block_size=4)
    # Codes [7,-3,1,2 | -7,0,0,2 | 7,pad,pad,pad] stored as q + 8, even index low.
    data = bytes([0x5F, 0xA9, 0x81, 0xA8, 0x8F, 0x88])
    assert payload.numpy().tobytes() == data + struct.pack("<3f", 1.0, 2.0, 0.5)


def test_int4_odd_block_packs_across_block_boundary() -> None:
    # Block size 3: values 0..2 are block 0, value 3 starts block 1 inside byte 1.
    x = torch.tensor([7.0, -7.0, 1.0, 14.0])
    payload = kernels.quantize_blockwise(x, bits=4, block_size=3)
    # Nibbles 15, 1, 9 | 15, 8, 8: byte 1 holds the last code of block 0 and the first of 1.
    assert payload.numpy().tobytes() == bytes([0x1F, 0xF9, 0x88]) + struct.pack("<2f", 1.0, 2.0)
    restored = kernels.dequantize_blockwise(payload, 4, 4, 3, torch.float32)
    assert restored.tolist() == [7.0, -7.0, 1.0, 14.0]


def test_int2_layout_is_ternary_four_codes_a_byte() -> None:
    # qmax 1: scale = absmax; codes -1, 0, +1 stored as q + 2, value i of a byte in bits 2i.
    x = torch.tensor([2.0, -0.9, 1.1, -2.0, 0.0, 4.0, 1.9, -2.1, 3.0])
    payload = kernels.quantize_blockwise(x, bits=2, block_size=4)
    # Codes [1,0,1,-1 | 0,1,0,-1 | 1,pad,pad,pad] -> stored [3,2,3,1 | 2,3,2,1 | 3,2,2,2].
    data = bytes([3 | 2 << 2 | 3 << 4 | 1 << 6, 2 | 3 << 2 | 2 << 4 | 1 << 6,
                  3 | 2 << 2 | 2 << 4 | 2 << 6])
    assert payload.numpy().tobytes() == data + struct.pack("<3f", 2.0, 4.0, 3.0)
    restored = kernels.dequantize_blockwise(payload, 9, 2, 4, torch.float32)
    assert restored.tolist() == [2.0, 0.0, 2.0, -2.0, 0.0, 4.0, 0.0, -4.0, 3.0]


# ---------------------------------------------------------------------------------------------
# Round trip and independent reference.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_bound_for_awkward_shapes(bits: int, dtype: torch.dtype) -> None:
    for seed, (numel, block_size) in enumerate(AWKWARD_SHAPES):
        x = _sample(numel, dtype, seed)
        payload = kernels.quantize_blockwise(x, bits, block_size)
        assert payload.numel() == kernels.quantized_nbytes(numel, bits, block_size)
        assert payload.numpy().tobytes() == _numpy_quantize(x, bits, block_size)
        restored = kernels.dequantize_blockwise(payload, numel, bits, block_size, dtype)
        assert restored.dtype == dtype and restored.shape == (numel,)
        scales = _payload_scales(payload, numel, bits, block_size)
        _assert_within_block_bound(x, restored, scales, block_size)


@pytest.mark.parametrize(("bits", "block_size"), [(8, 2048), (4, 256), (2, 256)])
def test_round_trip_of_a_large_odd_length(bits: int, block_size: int) -> None:
    x = _sample(1_000_003, torch.bfloat16, seed=7)
    payload = kernels.quantize_blockwise(x, bits, block_size)
    assert payload.numpy().tobytes() == _numpy_quantize(x, bits, block_size)
    for out_dtype in (torch.float32, torch.bfloat16):
        restored = kernels.dequantize_blockwise(payload, x.numel(), bits, block_size, out_dtype)
        scales = _payload_scales(payload, x.numel(), bits, block_size)
        _assert_within_block_bound(x, restored, scales, block_size)


def test_any_shape_is_quantized_as_its_flattening() -> None:
    x = _sample(17 * 257, torch.float16).view(17, 257)
    assert torch.equal(
        kernels.quantize_blockwise(x, 4, 64), kernels.quantize_blockwise(x.view(-1), 4, 64)
    )


def test_dequantize_writes_into_out() -> None:
    x = _sample(1000, torch.float32)
    payload = kernels.quantize_blockwise(x, 8, 64)
    out = torch.full((10, 100), 99.0, dtype=torch.float16)
    result = kernels.dequantize_blockwise(payload, 1000, 8, 64, torch.float16, out=out)
    assert result is out
    assert torch.equal(
        out.view(-1), kernels.dequantize_blockwise(payload, 1000, 8, 64, torch.float16)
    )
    with pytest.raises(ValueError, match="out.dtype"):
        kernels.dequantize_blockwise(payload, 1000, 8, 64, torch.float32, out=out)
    with pytest.raises(ValueError, match="elements"):
        kernels.dequantize_blockwise(payload, 1000, 8, 64, torch.float16, out=out[:5])


def test_scales_are_absmax_times_the_nearest_fp32_to_one_over_qmax() -> None:
    """[Note: scales by a multiply]: the constant is 1 / qmax to the nearest fp32, and a
    block's scale is its absmax times it, one rounding (here an ulp off the quotient)."""
    from fractions import Fraction

    for bits in reference.SUPPORTED_BITS:
        qmax = reference.qmax_for_bits(bits)
        constant = reference.reciprocal_of_qmax(qmax)
        half_ulp = Fraction(float(np.spacing(np.float32(constant)))) / 2
        assert abs(Fraction(constant) - Fraction(1, qmax)) <= half_ulp
    x = torch.zeros(64)
    absmax = np.float32(float.fromhex("0x1.a30fecp+0"))  # its product and quotient differ
    x[5] = -float(absmax)
    payload = kernels.quantize_blockwise(x, 4, 64)
    scale = _payload_scales(payload, 64, 4, 64)[0]
    assert scale == absmax * np.float32(reference.reciprocal_of_qmax(7))
    assert scale != absmax / np.float32(7)


def test_all_zero_blocks_have_zero_scale_and_restore_exactly() -> None:
    x = _sample(64 * 5, torch.float32)
    x[64:192] = 0.0  # blocks 1 and 2
    for bits in (8, 4, 2):
        payload = kernels.quantize_blockwise(x, bits, 64)
        scales = _payload_scales(payload, x.numel(), bits, 64)
        assert scales[1] == 0.0 and scales[2] == 0.0 and (scales[[0, 3, 4]] > 0).all()
        restored = kernels.dequantize_blockwise(payload, x.numel(), bits, 64, torch.float32)
        assert not torch.isnan(restored).any()
        assert torch.equal(restored[64:192], torch.zeros(128))
    zeros = torch.zeros(1000, dtype=torch.bfloat16)
    restored = kernels.dequantize_blockwise(
        kernels.quantize_blockwise(zeros, 4, 3), 1000, 4, 3, torch.bfloat16
    )
    assert torch.equal(restored, zeros)


def test_zero_scales_are_positive_zero_wherever_the_block_falls() -> None:
    # An all-zero block (of +0.0 or -0.0) has the scale +0.0 (as the Triton kernels write
    # it), at every offset in a vector register and in a run: the payload bytes are the
    # contract, so a -0.0 scale would be a different payload.
    x = _sample(64 * 67, torch.float32)
    x[64 * 3 : 64 * 40] = 0.0
    x[64 * 50 : 64 * 60] = -0.0
    for bits in (8, 4, 2):
        scales = _payload_scales(kernels.quantize_blockwise(x, bits, 64), x.numel(), bits, 64)
        zero = np.r_[3:40, 50:60]
        assert (scales[zero] == 0).all() and not np.signbit(scales[zero]).any()


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize(("numel", "block_size"), [(10_001, 3), (40_000, 64), (70_001, 255)])
def test_cpu_runs_do_not_change_any_result(monkeypatch, bits, numel, block_size) -> None:
    """The CPU walks blocks in cache-sized runs (reference.CPU_RUN_NUMEL): every kernel's
    output is the same bytes with runs of 8 blocks as with one run, at odd block sizes where
    packed int4/int2 bytes straddle blocks, through NaN, inf and zero blocks."""
    x = _sample(numel, torch.float32, seed=bits)
    x[5], x[numel // 2], x[numel // 3 : numel // 3 + 3 * block_size] = float("nan"), float("inf"), 0
    payloads = torch.stack([kernels.quantize_blockwise(x * (1 + r), bits, block_size)
                            for r in range(3)])

    def every_output() -> list[torch.Tensor]:
        outputs = [kernels.quantize_blockwise(x, bits, block_size),
                   kernels.quantize_blockwise(x.to(torch.bfloat16), bits, block_size),
                   kernels.dequantize_reduce(payloads, numel, bits, block_size)]
        outputs += [kernels.dequantize_reduce_quantize(payloads, numel, bits, out, block_size)
                    for out in (8, 4, 2)]
        outputs += [kernels.dequantize_blockwise_many(payloads, numel, bits, block_size, dtype)
                    for dtype in DTYPES]
        outputs.append(kernels.dequantize_blockwise(payloads[1], numel, bits, block_size,
                                                    torch.float32))
        return [o.view(torch.uint8) if o.is_floating_point() else o for o in outputs]

    monkeypatch.setattr(reference, "CPU_RUN_NUMEL", 1 << 40)
    assert reference.block_runs(kernels.payload_layout(numel, bits, block_size), "cpu") == [
        (0, -(-numel // block_size))]
    one_run = every_output()
    monkeypatch.setattr(reference, "CPU_RUN_NUMEL", 1)
    runs = reference.block_runs(kernels.payload_layout(numel, bits, block_size), "cpu")
    assert len(runs) > 30 and all(end - first == 8 for first, end in runs[:-1])
    for expected, got in zip(one_run, every_output(), strict=True):
        assert torch.equal(expected, got)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_values_turn_their_block_into_nan(dtype: torch.dtype) -> None:
    x = _sample(64 * 4, dtype)
    x[70] = float("nan")  # block 1
    x[200] = float("-inf")  # block 3
    for bits in (8, 4, 2):
        payload = kernels.quantize_blockwise(x, bits, 64)
        scales = _payload_scales(payload, x.numel(), bits, 64)
        assert np.isnan(scales[[1, 3]]).all() and np.isfinite(scales[[0, 2]]).all()
        restored = kernels.dequantize_blockwise(payload, x.numel(), bits, 64, dtype)
        assert torch.isnan(restored[64:128]).all() and torch.isnan(restored[192:]).all()
        finite = torch.cat([restored[:64], restored[128:192]])
        assert torch.isfinite(finite).all()
        _assert_within_block_bound(torch.cat([x[:64], x[128:192]]), finite, scales[[0, 2]], 64)
        summed = kernels.dequantize_reduce(torch.stack([payload, payload]), x.numel(), bits, 64)
        assert torch.isnan(summed[64:128]).all() and torch.isfinite(summed[:64]).all()


# ---------------------------------------------------------------------------------------------
# Batched dequantization and reductions.
# ---------------------------------------------------------------------------------------------


def _payload_batch(k: int, numel: int, bits: int, block_size: int) -> torch.Tensor:
    return torch.stack(
        [
            kernels.quantize_blockwise(_sample(numel, torch.float32, seed), bits, block_size)
            for seed in range(k)
        ]
    )


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize(("numel", "block_size"), [(1001, 64), (7, 3), (5, 2048)])
def test_dequantize_many_equals_one_by_one(bits: int, numel: int, block_size: int) -> None:
    payloads = _payload_batch(3, numel, bits, block_size)
    for dtype in DTYPES:
        many = kernels.dequantize_blockwise_many(payloads, numel, bits, block_size, dtype)
        one_by_one = torch.stack(
            [kernels.dequantize_blockwise(p, numel, bits, block_size, dtype) for p in payloads]
        )
        assert many.shape == (3, numel) and torch.equal(many, one_by_one)


@pytest.mark.parametrize("bits_in", [8, 4, 2])
@pytest.mark.parametrize("bits_out", [8, 4, 2])
@pytest.mark.parametrize(("numel", "block_size"), [(1001, 64), (7, 3), (4096, 2048)])
def test_reductions_equal_dequantize_then_sum(
    bits_in: int, bits_out: int, numel: int, block_size: int
) -> None:
    payloads = _payload_batch(4, numel, bits_in, block_size)
    expected_sum = torch.zeros(numel)
    for payload in payloads:  # payload order, fp32, from zero: the documented contract
        expected_sum = expected_sum + kernels.dequantize_blockwise(
            payload, numel, bits_in, block_size, torch.float32
        )
    total = kernels.dequantize_reduce(payloads, numel, bits_in, block_size)
    assert total.dtype == torch.float32 and torch.equal(total, expected_sum)
    fused = kernels.dequantize_reduce_quantize(payloads, numel, bits_in, bits_out, block_size)
    assert fused.numel() == kernels.quantized_nbytes(numel, bits_out, block_size)
    assert torch.equal(fused, kernels.quantize_blockwise(expected_sum, bits_out, block_size))


# ---------------------------------------------------------------------------------------------
# Swizzle.
# ---------------------------------------------------------------------------------------------


def _swizzle_by_index_list(flat: torch.Tensor, nodes: int, ranks_per_node: int) -> torch.Tensor:
    slice_numel = flat.numel() // (nodes * ranks_per_node)
    order = []
    for local in range(ranks_per_node):
        for node in range(nodes):
            start = (node * ranks_per_node + local) * slice_numel
            order.extend(range(start, start + slice_numel))
    return flat[torch.tensor(order, dtype=torch.long)]


@pytest.mark.parametrize(("nodes", "ranks_per_node"), [(2, 2), (3, 4), (4, 3), (2, 8)])
def test_swizzle_matches_index_list_and_unswizzle_inverts(nodes: int, ranks_per_node: int) -> None:
    flat = torch.arange(nodes * ranks_per_node * 5, dtype=torch.float32)
    swizzled = kernels.swizzle(flat, nodes, ranks_per_node)
    assert torch.equal(swizzled, _swizzle_by_index_list(flat, nodes, ranks_per_node))
    assert not torch.equal(swizzled, flat)
    assert torch.equal(kernels.unswizzle(swizzled, nodes, ranks_per_node), flat)
    assert torch.equal(
        kernels.swizzle(kernels.unswizzle(flat, nodes, ranks_per_node), nodes, ranks_per_node), flat
    )


@pytest.mark.parametrize(("nodes", "ranks_per_node"), [(1, 8), (6, 1), (1, 1)])
def test_swizzle_is_identity_copy_with_one_node_or_one_rank_per_node(
    nodes: int, ranks_per_node: int
) -> None:
    flat = torch.randn(nodes * ranks_per_node * 3).to(torch.bfloat16)
    for reorder in (kernels.swizzle, kernels.unswizzle):
        result = reorder(flat, nodes, ranks_per_node)
        assert torch.equal(result, flat)
        assert result.data_ptr() != flat.data_ptr()


def test_swizzle_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        kernels.swizzle(torch.zeros(10), 2, 2)
    with pytest.raises(ValueError, match="1-D"):
        kernels.swizzle(torch.zeros(4, 4), 2, 2)
    with pytest.raises(ValueError, match="nodes"):
        kernels.unswizzle(torch.zeros(4), 0, 2)


# ---------------------------------------------------------------------------------------------
# Argument checks and dispatch.
# ---------------------------------------------------------------------------------------------


def test_bad_inputs_raise_one_precise_error() -> None:
    x = torch.randn(16, 16)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.quantize_blockwise(x.t(), 8, 16)
    with pytest.raises(ValueError, match="x.dtype"):
        kernels.quantize_blockwise(torch.ones(8, dtype=torch.int32), 8, 4)
    with pytest.raises(ValueError, match="bits"):
        kernels.quantize_blockwise(x, 3, 16)
    payload = kernels.quantize_blockwise(x, 8, 16)
    with pytest.raises(ValueError, match="bytes per row"):
        kernels.dequantize_blockwise(payload[:-1], 256, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        kernels.dequantize_blockwise(payload.to(torch.int8), 256, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        kernels.dequantize_blockwise(payload, 256, 8, 16, torch.float64)
    with pytest.raises(ValueError, match="2 dimension"):
        kernels.dequantize_reduce(payload, 256, 8, 16)


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_tensor = torch.zeros(4)
    monkeypatch.delenv(kernels.BACKEND_ENV_VAR, raising=False)
    assert kernels.backend_for(cpu_tensor, 64) is reference
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "reference")
    assert kernels.backend_for(cpu_tensor, 64) is reference
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=kernels.BACKEND_ENV_VAR):
        kernels.quantize_blockwise(cpu_tensor, 8, 64)


def test_triton_module_imports_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    monkeypatch.setitem(sys.modules, "triton.language", None)
    path = Path(reference.__file__).with_name("triton_kernels.py")
    spec = importlib.util.spec_from_file_location("_triton_kernels_without_triton", path)
    module = importlib.util.module_from_spec(spec)
    # Its device functions are imported without Triton too; that copy must not outlive the
    # test, or later imports of the kernels would find plain functions.
    with _fresh_modules(TRITON_MODULES):
        spec.loader.exec_module(module)
    assert not module.is_available()
    with pytest.raises(RuntimeError, match="triton"):
        module.quantize_blockwise(torch.zeros(8), 8, 4)


TRITON_MODULES = ("zeropp.kernels.triton_kernels", "zeropp.kernels.triton_device")


@contextlib.contextmanager
def _fresh_modules(names: tuple[str, ...]):
    """Import `names` afresh inside the block; afterwards the previous imports are back."""
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


# ---------------------------------------------------------------------------------------------
# Triton kernels against the reference.
# ---------------------------------------------------------------------------------------------

class _OnTheCpu:
    """The reference run on the CPU, the specification: section a of the GPU check compares
    with it too. (Torch's own CUDA kernels were not bit-exact with it when scales were a
    division by qmax, which is a multiplication by its reciprocal there; they are now that
    multiplication everywhere, [Note: scales by a multiply], but only a GPU can say whether
    every other op agrees to the bit.)"""

    def __getattr__(self, name: str):
        function = getattr(reference, name)

        def on_the_cpu(*args, **kwargs):
            args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
            kwargs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            return function(*args, **kwargs)

        return on_the_cpu


cpu_reference = _OnTheCpu()


def _same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal values, and for floats equal signs too (torch.equal takes -0 for +0)."""
    actual, expected = actual.cpu(), expected.cpu()
    if not torch.equal(actual, expected):
        return False
    return not actual.is_floating_point() or torch.equal(torch.signbit(actual),
                                                         torch.signbit(expected))



@pytest.fixture(scope="module")
def triton_device():
    """(triton_kernels module, device): CUDA if present, else Triton's CPU interpreter."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed; the Triton kernels cannot be compared")
    if torch.cuda.is_available():
        yield importlib.import_module("zeropp.kernels.triton_kernels"), torch.device("cuda")
        return
    with pytest.MonkeyPatch.context() as patch, _fresh_modules(TRITON_MODULES):
        # Kernels become interpreted when decorated, so (re)import with the variable set.
        patch.setenv("TRITON_INTERPRET", "1")
        module = importlib.import_module("zeropp.kernels.triton_kernels")
        yield module, torch.device("cpu")


# Whole, partial, non-power-of-two and odd large blocks (odd: int4 nibbles straddle blocks);
# blocks over a tile (2048 int8 values, 4096 int4 or int2) are walked in two passes
# ([Note: kernel tiles]): see test_triton_int4_word_sums_match_reference and the tiny-scale
# test for those.
TRITON_SHAPES = ((1, 1), (7, 3), (300, 6), (257, 64), (1000, 2048), (5000, 1500),
                 (3000, 1025))


def _assert_same_payload(actual: torch.Tensor, expected: torch.Tensor, layout) -> None:
    """Byte equality, except that NaN scales only need to be NaN."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.shape == expected.shape
    data = slice(0, layout.data_nbytes)
    assert _same(actual[data], expected[data])
    scales = [reference.decode_scales(p.view(1, -1), layout) for p in (actual, expected)]
    torch.testing.assert_close(scales[0], scales[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_quantize_dequantize_match_reference(triton_device, bits, dtype) -> None:
    triton_kernels, device = triton_device
    for seed, (numel, block_size) in enumerate(TRITON_SHAPES):
        x = _sample(numel, dtype, seed).to(device)
        layout = kernels.payload_layout(numel, bits, block_size)
        expected = cpu_reference.quantize_blockwise(x, bits, block_size)
        payload = triton_kernels.quantize_blockwise(x, bits, block_size)
        _assert_same_payload(payload, expected, layout)
        for out_dtype in (dtype, torch.float32):
            restored = triton_kernels.dequantize_blockwise(
                payload, numel, bits, block_size, out_dtype
            )
            assert _same(
                restored,
                cpu_reference.dequantize_blockwise(payload, numel, bits, block_size, out_dtype),
            )


# The interpreter evaluates masked-off lanes too (inf - inf, fp16 overflow) and numpy warns.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_triton_handles_extremes_like_reference(triton_device) -> None:
    triton_kernels, device = triton_device
    x = _sample(64 * 6, torch.float32).to(device)
    x[:64] = torch.linspace(-1.0, 1.0, 64) * 3.39e38  # bf16/fp16 outputs round to +-inf
    x[64:128] = torch.linspace(-1.0, 1.0, 64) * 1e-39  # subnormal values and scale
    x[128:192] = 0.0
    x[200] = float("nan")
    x[300] = float("inf")
    for bits in (8, 4, 2):
        # Scale exactly 1 and every other value a tie: checks round-half-to-even.
        qmax = 2 ** (bits - 1) - 1
        span = min(qmax, 7)
        ties = torch.arange(63) % (2 * span) - (span - 0.5)
        x[320:] = torch.cat([torch.tensor([float(qmax)]), ties]).to(device)
        layout = kernels.payload_layout(x.numel(), bits, 64)
        payload = triton_kernels.quantize_blockwise(x, bits, 64)
        _assert_same_payload(payload, cpu_reference.quantize_blockwise(x, bits, 64), layout)
        scales = _payload_scales(payload.cpu(), x.numel(), bits, 64)
        assert np.isfinite(scales[:2]).all() and 0 < scales[1] < np.finfo(np.float32).tiny
        for dtype in DTYPES:
            restored = triton_kernels.dequantize_blockwise(payload, x.numel(), bits, 64, dtype)
            expected = cpu_reference.dequantize_blockwise(payload, x.numel(), bits, 64, dtype)
            torch.testing.assert_close(restored.cpu(), expected, rtol=0, atol=0, equal_nan=True)


def _subnormal(ulps) -> torch.Tensor:
    """float32 values that are whole multiples of the smallest subnormal (2**-149)."""
    return torch.ldexp(torch.as_tensor(ulps, dtype=torch.float32), torch.tensor(-149))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's inf arithmetic
@pytest.mark.parametrize("block", [64, 8192])  # one tile a block; two passes over 8192
def test_triton_tiny_scales_take_the_full_formula(triton_device, block) -> None:
    """[Note: plain rows]: a tile of finite blocks skips the prescale and the clamp, which is
    exact only for scales of 0 or at least PRESCALE_BELOW. Here the blocks are finite (no
    NaN row sends the tile to the full formula anyway) and include a subnormal scale whose
    values round past QMAX without the clamp, a scale whose reciprocal overflows without the
    prescale, one just under PRESCALE_BELOW, and a zero block: quantized alone and through
    the requantizing reduction, the kernels equal the reference."""
    triton_kernels, device = triton_device
    x = _sample(block * 6, torch.float32)
    gen = torch.Generator().manual_seed(3)
    signs = torch.where(torch.rand(block, generator=gen) < 0.5, -1.0, 1.0)
    x[block:2 * block] = _subnormal(torch.randint(0, 11, (block,), generator=gen)) * signs
    x[block] = _subnormal(10)  # int4: RN(10 / 7 ulps) = 1 ulp, 10 ulps / 1 ulp = 10 > 7
    x[2 * block:3 * block] = _subnormal(torch.randint(0, 191, (block,), generator=gen)) * signs
    x[2 * block] = -_subnormal(190)  # int8: RN(190 / 127 ulps) = 1 ulp, 190 > 127
    x[3 * block:4 * block] = torch.linspace(-1.0, 1.0, block) * 1e-39  # 1 / scale overflows
    x[4 * block:5 * block] = torch.linspace(-1.0, 1.0, block) * (2.0**-64 * 7 * 0.999)
    x[5 * block:] = 0.0
    for bits, tight in ((4, 1), (8, 2)):
        assert launch_specs.tile_config(block, bits).single_pass == (block == 64)
        qmax = 2 ** (bits - 1) - 1
        values = x[tight * block:(tight + 1) * block].numpy()
        scale = np.float32(np.abs(values).max()) * np.float32(1.0 / qmax)
        assert np.abs(values / scale).max() > qmax + 0.5  # the clamp decides these codes
        layout = kernels.payload_layout(x.numel(), bits, block)
        expected = cpu_reference.quantize_blockwise(x, bits, block)
        _assert_same_payload(triton_kernels.quantize_blockwise(x.to(device), bits, block),
                             expected, layout)
        # The same blocks as a reduction's sum: one payload holding them plus zero payloads.
        payloads = torch.stack([expected, cpu_reference.quantize_blockwise(0 * x, bits, block)])
        for bits_out in (bits, 8 if bits == 4 else 4):
            assert _same(triton_kernels.dequantize_reduce_quantize(
                payloads.to(device), x.numel(), bits, bits_out, block),
                cpu_reference.dequantize_reduce_quantize(payloads, x.numel(), bits, bits_out,
                                                         block))


@pytest.mark.parametrize(("numel", "block_size"),
                         [(7, 3), (1000, 64), (300, 6), (5000, 2048), (3000, 1025)])
def test_triton_reductions_match_reference(triton_device, numel, block_size) -> None:
    triton_kernels, device = triton_device
    for bits_in in (8, 4, 2):
        payloads = _payload_batch(3, numel, bits_in, block_size).to(device)
        many = triton_kernels.dequantize_blockwise_many(
            payloads, numel, bits_in, block_size, torch.bfloat16
        )
        assert _same(
            many,
            cpu_reference.dequantize_blockwise_many(
                payloads, numel, bits_in, block_size, torch.bfloat16
            ),
        )
        total = triton_kernels.dequantize_reduce(payloads, numel, bits_in, block_size)
        assert _same(total, cpu_reference.dequantize_reduce(payloads, numel, bits_in, block_size))
        for dtype in (torch.float16, torch.bfloat16):  # into a 16-bit gradient shard
            into = torch.empty(numel, dtype=dtype, device=device)
            triton_kernels.dequantize_reduce(payloads, numel, bits_in, block_size, out=into)
            expected = cpu_reference.dequantize_reduce(payloads, numel, bits_in, block_size,
                                                   out=torch.empty(numel, dtype=dtype))
            assert _same(into.cpu(), expected)
        for bits_out in (8, 4, 2):
            fused = triton_kernels.dequantize_reduce_quantize(
                payloads, numel, bits_in, bits_out, block_size
            )
            expected = cpu_reference.dequantize_reduce_quantize(
                payloads, numel, bits_in, bits_out, block_size
            )
            assert _same(fused, expected)


@pytest.mark.parametrize(("payloads", "numel", "block_size"),
                         [(10, 208, 16), (9, 1000, 24), (10, 3 * 8192 - 100, 8192)])
def test_triton_int4_word_sums_match_reference(triton_device, payloads, numel,
                                               block_size) -> None:
    """[Note: word sums] where it is most easily wrong: the smallest blocks it reads (16, two
    words), blocks that are not a power of two (24: masked word columns), blocks walked in two
    passes (8192, with a partial last block), and payload counts past the unrolled group of 8
    (9, 10)."""
    triton_kernels, device = triton_device
    batch = _payload_batch(payloads, numel, 4, block_size)
    on_device = batch.to(device)
    for dtype in (torch.float32, torch.bfloat16):
        total = triton_kernels.dequantize_reduce(on_device, numel, 4, block_size,
                                                 out=torch.empty(numel, dtype=dtype,
                                                                 device=device))
        expected = cpu_reference.dequantize_reduce(batch, numel, 4, block_size,
                                                   out=torch.empty(numel, dtype=dtype))
        assert _same(total.cpu(), expected)
    for bits_out in (4, 2, 8):
        assert _same(
            triton_kernels.dequantize_reduce_quantize(on_device, numel, 4, bits_out,
                                                      block_size).cpu(),
            cpu_reference.dequantize_reduce_quantize(batch, numel, 4, bits_out, block_size))


@pytest.mark.parametrize(("bits", "block_size"), [(8, 64), (4, 64), (4, 6)])
def test_triton_sums_start_from_the_first_payload(triton_device, bits, block_size) -> None:
    """[Note: sums from the first payload]: negative codes under a zero scale (which no
    quantize writes) give -0 products, and their sum stays -0 in the kernels as in the
    reference; a sum from zeros would make it +0. Int4 at block 64 takes the word sums."""
    triton_kernels, device = triton_device
    numel = 3 * block_size
    layout = reference.payload_layout(numel, bits, block_size)
    batch = _payload_batch(2, numel, bits, block_size)
    batch[:, : block_size * bits // 8] = 0xFD if bits == 8 else 0x55  # code -3 (int4: q + 8)
    batch[:, layout.data_nbytes: layout.data_nbytes + 4] = 0  # block 0's scale: +0.0
    expected = cpu_reference.dequantize_reduce(batch, numel, bits, block_size)
    assert torch.signbit(expected[:block_size]).all() and (expected[:block_size] == 0).all()
    for dtype in (torch.float32, torch.bfloat16):
        total = triton_kernels.dequantize_reduce(batch.to(device), numel, bits, block_size,
                                                 out=torch.empty(numel, dtype=dtype,
                                                                 device=device))
        assert _same(total, expected.to(dtype))
    assert _same(triton_kernels.dequantize_reduce_quantize(batch.to(device), numel, bits, 4,
                                                           block_size),
                 cpu_reference.dequantize_reduce_quantize(batch, numel, bits, 4, block_size))


# Pieces ([Note: payload pieces]) as (nodes, per_node, values a slice, block size): one node,
# one rank a node and both; blocks of one tile with a partial last program in every slice
# (64), large blocks that are not powers of two (1500), and blocks that are not whole bytes
# at some width (6 for int2; 3 for int4 and int2), which keep the host's pack and shuffle.
SWIZZLE_CASES = ((1, 3, 64 * 20, 64), (3, 1, 3000, 1500), (2, 2, 1500, 1500), (2, 3, 12, 6),
                 (3, 2, 12, 3))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's inf arithmetic
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_quantize_swizzled_matches_reference(triton_device, bits, dtype) -> None:
    triton_kernels, device = triton_device
    for seed, (nodes, per_node, slice_numel, block_size) in enumerate(SWIZZLE_CASES):
        x = _sample(nodes * per_node * slice_numel, dtype, seed)
        x[slice_numel + 1] = float("inf")  # rank 1's first block: a NaN scale mid-piece
        expected = cpu_reference.quantize_swizzled(x, nodes, per_node, bits, block_size)
        pieces = triton_kernels.quantize_swizzled(x.to(device), nodes, per_node, bits,
                                                  block_size)
        assert pieces.shape == expected.shape
        piece = kernels.payload_layout(nodes * slice_numel, bits, block_size)
        for got, want in zip(pieces.view(per_node, -1), expected.view(per_node, -1),
                             strict=True):
            _assert_same_payload(got, want, piece)


# (values a slice, block size): one tile with a partial last program in every slice, two
# passes, and odd blocks, where int4/int2 outputs keep the host's pack and shuffle. Int2
# inputs at (6, 3) put the slices' first codes inside a byte.
REQUANTIZE_CASES = ((640, 64), (1200, 600), (12, 3), (6, 3))


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize(("bits_in", "bits_out"), [(4, 4), (4, 2), (8, 8), (2, 8)])
def test_triton_requantized_parts_match_reference(triton_device, parts, bits_in,
                                                  bits_out) -> None:
    triton_kernels, device = triton_device
    for slice_numel, block_size in REQUANTIZE_CASES:
        if slice_numel * bits_out % 8:
            continue  # slices of part bytes cannot be pieces
        numel = parts * slice_numel
        payloads = _payload_batch(3, numel, bits_in, block_size)
        expected = cpu_reference.dequantize_reduce_quantize(payloads, numel, bits_in, bits_out,
                                                        block_size, parts)
        fused = triton_kernels.dequantize_reduce_quantize(payloads.to(device), numel, bits_in,
                                                          bits_out, block_size, parts)
        assert _same(fused.cpu(), expected)


def test_triton_pieces_are_one_launch_without_host_shuffles(triton_device, monkeypatch) -> None:
    """Where programs pack their own codes, each piece writer is a single kernel launch that
    writes the pieces in place: no host pack, shuffle or copy after it."""
    triton_kernels, device = triton_device
    x = _sample(2 * 3 * 256, torch.bfloat16)
    payloads = _payload_batch(2, 3 * 256, 4, 64)
    expected_pieces = cpu_reference.quantize_swizzled(x, 2, 3, 4, 64)
    expected_parts = cpu_reference.dequantize_reduce_quantize(payloads, 3 * 256, 4, 2, 64, parts=3)
    launched = []
    launch = triton_kernels._launch

    def counting_launch(spec, *args, **kwargs):
        launched.append(spec.kernel)
        launch(spec, *args, **kwargs)

    def host_shuffle(*args, **kwargs):
        raise AssertionError("pieces were shuffled on the host")

    monkeypatch.setattr(triton_kernels, "_launch", counting_launch)
    for name in ("swizzle_payload", "split_payload", "pack_stored_codes"):
        monkeypatch.setattr(reference, name, host_shuffle)
    pieces = triton_kernels.quantize_swizzled(x.to(device), 2, 3, 4, 64)
    parts = triton_kernels.dequantize_reduce_quantize(payloads.to(device), 3 * 256, 4, 2, 64,
                                                      parts=3)
    assert launched == ["quantize_kernel", "dequantize_reduce_quantize_kernel"]
    assert _same(pieces.cpu(), expected_pieces)
    assert _same(parts.cpu(), expected_parts)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's inf arithmetic
def test_triton_qgz_payloads_are_read_as_words(triton_device, monkeypatch) -> None:
    """qgZ's reductions read the payloads its all-to-alls receive ([Note: word sums]): fresh
    buffers whose rows are whole words of codes and scales. Both hops take the word path
    (and with it the scales' words) and equal the reference."""
    triton_kernels, device = triton_device
    nodes, per_node, block = 2, 3, 64
    numel = nodes * per_node * 15 * block  # slices of 15 blocks: an odd count of rows
    x = _sample(numel, torch.bfloat16)
    launched = []
    launch = triton_kernels._launch

    def recording_launch(spec, *args, **kwargs):
        launched.append((spec.kernel, spec.constants.get("SCALES_F32",
                                                         spec.constants.get("SCALES_F32_IN"))))
        launch(spec, *args, **kwargs)

    monkeypatch.setattr(triton_kernels, "_launch", recording_launch)
    send = triton_kernels.quantize_swizzled(x.to(device), nodes, per_node, 4, block)
    received = torch.empty_like(send)  # as the intra-node all-to-all receives it
    received.copy_(send)
    received = received.view(per_node, -1)
    chunk = numel // per_node
    send2 = triton_kernels.dequantize_reduce_quantize(received, chunk, 4, 4, block, parts=nodes)
    across = torch.empty_like(send2)
    across.copy_(send2)
    total = triton_kernels.dequantize_reduce(across.view(nodes, -1), chunk // nodes, 4, block)
    assert launched == [("quantize_kernel", True), ("dequantize_reduce_quantize_kernel", True),
                        ("_dequantize_reduce_kernel", True)]
    want2 = cpu_reference.dequantize_reduce_quantize(received.cpu(), chunk, 4, 4, block,
                                                     parts=nodes)
    assert _same(send2.cpu(), want2)
    want = cpu_reference.dequantize_reduce(want2.view(nodes, -1), chunk // nodes, 4, block)
    assert _same(total.cpu(), want)


def test_triton_pieces_reject_what_the_reference_rejects(triton_device) -> None:
    triton_kernels, device = triton_device
    x = _sample(2 * 2 * 100, torch.float32).to(device)
    with pytest.raises(ValueError, match="whole blocks"):
        triton_kernels.quantize_swizzled(x, 2, 2, 8, 64)  # slices of 100 values
    with pytest.raises(ValueError, match="not divisible"):
        triton_kernels.quantize_swizzled(x[:-1], 2, 2, 8, 4)
    payloads = _payload_batch(2, 200, 8, 4).to(device)
    with pytest.raises(ValueError, match="whole blocks"):
        triton_kernels.dequantize_reduce_quantize(payloads, 200, 8, 8, 4, parts=8)
    with pytest.raises(ValueError, match="parts"):
        triton_kernels.dequantize_reduce_quantize(payloads, 200, 8, 8, 4, parts=3)


def test_forced_triton_backend_dispatches_to_it(triton_device, monkeypatch) -> None:
    triton_kernels, device = triton_device
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "triton")
    x = _sample(515, torch.float16).to(device)
    assert kernels.backend_for(x, 128) is triton_kernels
    payload = kernels.quantize_blockwise(x, 4, 128)
    assert _same(payload, cpu_reference.quantize_blockwise(x, 4, 128))


# Run in a fresh interpreter: after interpreted launches in this process, Triton's language
# module is left patched for the interpreter and real compilation fails.
_COMPILE_FOR_HOPPER = """
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from zeropp.kernels import triton_kernels as kernels

import torch

out_dir = Path(sys.argv[1])
# The host's own launch specs: one block that fits a tile, one walked in two passes.
for block_size in (256, 8192):
    for spec in kernels.launch_specs(block_size, 4, torch.bfloat16):
        signature = {**spec.signature, **{key: "constexpr" for key in spec.constants}}
        source = ASTSource(fn=kernels.kernel_function(spec), signature=signature,
                           constexprs=spec.constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": spec.num_warps,
                                           "enable_fp_fusion": False})
        name = f"{spec.kernel.strip('_')}_{block_size}"
        (out_dir / f"{name}.ptx").write_text(compiled.asm["ptx"])
        (out_dir / f"{name}.cubin").write_bytes(compiled.asm["cubin"])
"""


def test_triton_kernels_compile_for_hopper_without_a_gpu(tmp_path: Path) -> None:
    """Lower the kernels to sm_90 PTX and cubin (no GPU needed): checks the types the
    interpreter lets through, IEEE division, and that no FMA changes the reduction's rounding."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compile for real, touch no home dir
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
    )
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=360,  # 14 variants compiled in one process, on a busy 2-core machine too
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for block_size in (256, 8192):
        quantize_ptx = (tmp_path / f"quantize_kernel_{block_size}.ptx").read_text()
        assert "div.rn.f32" in quantize_ptx and "div.full.f32" not in quantize_ptx
        assert (tmp_path / f"dequantize_kernel_{block_size}.cubin").stat().st_size > 0
        fused_ptx = (tmp_path / f"dequantize_reduce_quantize_kernel_{block_size}.ptx").read_text()
        assert "fma.rn.f32" not in fused_ptx and "div.rn.f32" in fused_ptx


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_triton_two_pass_blocks_find_non_finite_values_in_any_chunk(triton_device) -> None:
    """A NaN or inf in a large block's later chunk still makes its whole block NaN (blocks
    of 8192 are walked in chunks of 2048 int8 or 4096 int4/int2 values)."""
    triton_kernels, device = triton_device
    block = 8192
    for bits in (8, 4, 2):
        assert not launch_specs.tile_config(block, bits).single_pass
    x = _sample(3 * block, torch.float32).to(device)
    x[block + 5000] = float("nan")  # block 1, second chunk
    x[2 * block + block - 1] = float("-inf")  # block 2, last value
    for bits in (8, 4, 2):
        layout = kernels.payload_layout(x.numel(), bits, block)
        payload = triton_kernels.quantize_blockwise(x, bits, block)
        _assert_same_payload(payload, cpu_reference.quantize_blockwise(x, bits, block), layout)
        scales = _payload_scales(payload.cpu(), x.numel(), bits, block)
        assert np.isfinite(scales[0]) and np.isnan(scales[1:]).all()
        flipped = cpu_reference.quantize_blockwise(x.flip(0), bits, block).to(device)
        payloads = torch.stack([payload, flipped])
        fused = triton_kernels.dequantize_reduce_quantize(payloads, x.numel(), bits, bits, block)
        expected = cpu_reference.dequantize_reduce_quantize(payloads, x.numel(), bits, bits,
                                                            block)
        _assert_same_payload(fused, expected, layout)


@pytest.mark.parametrize("bits", [8, 4])
def test_prepared_variants_are_the_ones_the_calls_launch(triton_device, monkeypatch, bits):
    """`prepare` (behind zeropp.kernels.prepare_kernels) compiles, for fresh tensors, the
    very keys the calls then launch: the same spec, grid and specialization of every
    argument, so an engine that prepares at build compiles nothing in its first step."""
    triton_kernels, device = triton_device
    from zeropp.kernels import launcher

    seen = {"launch": set(), "prepare": set()}

    class Recorder:
        def launch(self, kernel, key, constants, num_warps, grid, args):
            seen["launch"].add((key, grid, launcher.argument_key(args)))

        def prepare(self, kernel, key, constants, num_warps, grid, args):
            seen["prepare"].add((key, grid, launcher.argument_key(args)))
            return True

    monkeypatch.setattr(triton_kernels, "LAUNCHER", Recorder())
    numel, block, k = 8 * 1024, 256, 8
    prepared = triton_kernels.prepare(device, numel, bits, block, torch.bfloat16, payloads=k,
                                      parts=2, swizzles=((2, 4),))
    assert prepared == len(seen["prepare"]) == 7
    x = torch.zeros(numel, dtype=torch.bfloat16, device=device)
    payload = triton_kernels.quantize_blockwise(x, bits, block)
    triton_kernels.quantize_swizzled(x, 2, 4, bits, block)
    triton_kernels.dequantize_blockwise(payload, numel, bits, block, torch.bfloat16)
    batch = payload.repeat(k, 1)
    triton_kernels.dequantize_blockwise_many(batch, numel, bits, block, torch.bfloat16)
    triton_kernels.dequantize_reduce(batch, numel, bits, block)
    triton_kernels.dequantize_reduce(batch, numel, bits, block,
                                     out=torch.empty(numel, dtype=torch.bfloat16, device=device))
    triton_kernels.dequantize_reduce_quantize(batch, numel, bits, bits, block, parts=2)
    assert len(seen["launch"]) == 7 and seen["launch"] <= seen["prepare"]
