"""Pure-torch reference for the ZeRO++ quantization kernels.

Every kernel of `zeropp.kernels` exists here first; the Triton versions are checked against
these functions bit for bit. They run on any device torch runs on (CPU included), accept
fp32/fp16/bf16 and any length, and are vectorised over blocks (a tensor is viewed as
[nblocks, block_size], on CPU a cache-sized run of blocks at a time, see `block_runs`; no
Python loop touches individual blocks).

Payload layout (one flat uint8 tensor, so that a single collective moves it):

    [ packed codes of all blocks, block after block | one fp32 scale per block, as bytes ]

- int8: one two's-complement byte per value.
- int4: two values per byte, the even index in the low nibble, stored offset-binary (q + 8),
  packed as one stream over all blocks (so with an odd block size a byte can straddle two
  blocks). The data region is ceil(padded_numel * bits / 8) bytes; an odd padded length
  leaves one spare high nibble that holds the code of zero.
- int2: four values per byte the same way (value i of a byte in bits 2i..2i+1), stored
  offset-binary (q + 2); with qmax = 1 the grid is ternary, {-scale, 0, +scale}, and spare
  slots of the last byte hold the code of zero. Meant for sends whose error is fed back.
- The last block is padded with zeros up to block_size before quantizing.
- Scales are little-endian fp32 bytes right after the data. Their offset need not be a
  multiple of 4 (block size 3, say), so readers must not assume alignment.

Quantization is symmetric and computed in fp32: scale = absmax(block) * (1 / qmax),
q = round_half_to_even(x * (1 / scale)) clamped to [-qmax, qmax], qmax = 127 (int8), 7 (int4)
or 1 (int2); 1 / qmax is the fp32 constant nearest to it. Multiplying by reciprocals (one
division a block, not one a value; none for the scale) is what the GPU kernels do at memory
speed; it moves a value that lies within an ulp of a rounding boundary to the other code
now and then, and a scale by an ulp, which leaves the error bound (half a scale) and the
measured error unchanged. A scale under 2**-64, whose reciprocal could overflow, is
applied as (x * 2**64) * (1 / (scale * 2**64)): the same products, exact.

Non-finite input (decision): a block holding any inf or NaN gets a NaN scale and all-zero
codes, so every value of that block dequantizes to NaN. The overflow stays visible to the
loss scaler instead of becoming finite garbage; an inf cannot be represented by a finite
scale anyway. An all-zero block has scale 0 and dequantizes to exact zeros (never NaN).

Reductions (`dequantize_reduce*`) add the k dequantized payloads in fp32 in payload order,
starting from the first one, so that every backend produces bit-identical sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache, lru_cache

import torch
from torch import Tensor

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_BITS: tuple[int, ...] = (2, 4, 8)
SCALE_NBYTES = 4  # one fp32 scale per block
# Scales below PRESCALE_BELOW are applied through values and scales both multiplied by
# PRESCALE (powers of two: exact), so that 1 / scale stays finite (see the module doc).
PRESCALE_BELOW = 2.0**-64
PRESCALE = 2.0**64


@cache
def reciprocal_of_qmax(qmax: int) -> float:
    """1 / qmax as the scales use it: the fp32 nearest to it (as a Python float, exact), the
    constant the GPU kernels multiply by too ([Note: scales by a multiply] in
    zeropp/kernels/triton_device.py)."""
    return float(torch.tensor(1.0 / qmax, dtype=torch.float32))


def qmax_for_bits(bits: int) -> int:
    """Largest code magnitude of the symmetric `bits`-bit grid (127, 7, 1 for int8/4/2)."""
    _check_bits(bits)
    return (1 << (bits - 1)) - 1


def code_offset(bits: int) -> int:
    """Offset-binary bias of sub-byte codes (stored = q + offset): 8 for int4, 2 for int2."""
    _check_bits(bits)
    return 1 << (bits - 1)


@dataclass(frozen=True)
class PayloadLayout:
    """Byte layout of the payload that quantizes `numel` values in blocks of `block_size`."""

    numel: int
    bits: int
    block_size: int
    # Worked out once: every kernel call reads them several times.
    nblocks: int = field(init=False, compare=False, repr=False)
    padded_numel: int = field(init=False, compare=False, repr=False)
    data_nbytes: int = field(init=False, compare=False, repr=False)  # the packed codes
    nbytes: int = field(init=False, compare=False, repr=False)  # codes and fp32 scales

    def __post_init__(self) -> None:
        nblocks = -(-self.numel // self.block_size)
        padded = nblocks * self.block_size
        data_nbytes = -(-padded * self.bits // 8)
        for name, value in (("nblocks", nblocks), ("padded_numel", padded),
                            ("data_nbytes", data_nbytes),
                            ("nbytes", data_nbytes + nblocks * SCALE_NBYTES)):
            object.__setattr__(self, name, value)


def payload_layout(numel: int, bits: int, block_size: int) -> PayloadLayout:
    """Validated layout of a payload; raises ValueError naming the bad argument. Layouts are
    kept per (numel, bits, block_size), told apart by type (a bool or a float is refused,
    not taken for the int it equals)."""
    try:
        return _cached_layout(numel, bits, block_size)
    except TypeError:  # an unhashable argument: the checks name it
        return _checked_layout(numel, bits, block_size)


def _checked_layout(numel: int, bits: int, block_size: int) -> PayloadLayout:
    _check_bits(bits)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return PayloadLayout(numel=numel, bits=bits, block_size=block_size)


_cached_layout = lru_cache(maxsize=4096, typed=True)(_checked_layout)


def quantized_nbytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of the payload for `numel` values: packed codes plus one fp32 scale per block."""
    return payload_layout(numel, bits, block_size).nbytes


# ---------------------------------------------------------------------------------------------
# Argument checks shared with the Triton backend.
# ---------------------------------------------------------------------------------------------


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be 2, 4 or 8, got {bits!r}")


def check_float_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what} must be float32, float16 or bfloat16, got {dtype}")


def check_quantize_input(x: Tensor, bits: int, block_size: int) -> PayloadLayout:
    """Validate a tensor to quantize and return its payload layout."""
    if not isinstance(x, Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_float_dtype(x.dtype, "x.dtype")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous (shape {tuple(x.shape)}, stride {x.stride()})")
    return payload_layout(x.numel(), bits, block_size)


def check_payloads(payloads: Tensor, layout: PayloadLayout, ndim: int) -> None:
    """Validate a payload (ndim 1) or a batch of payloads (ndim 2, one per row)."""
    if not isinstance(payloads, Tensor):
        raise ValueError(f"payload must be a torch.Tensor, got {type(payloads).__name__}")
    if payloads.dtype != torch.uint8:
        raise ValueError(f"payload must be uint8, got {payloads.dtype}")
    if payloads.dim() != ndim:
        raise ValueError(
            f"payload must have {ndim} dimension(s), got shape {tuple(payloads.shape)}"
        )
    if payloads.shape[-1] != layout.nbytes:
        raise ValueError(
            f"payload has {payloads.shape[-1]} bytes per row, expected {layout.nbytes} for "
            f"numel={layout.numel}, bits={layout.bits}, block_size={layout.block_size}"
        )
    if payloads.stride(-1) != 1:
        raise ValueError(f"payload rows must be contiguous, got stride {payloads.stride()}")


def check_out(out: Tensor, numel: int, dtype: torch.dtype, device: torch.device) -> None:
    """Validate a caller-provided output buffer for `numel` values of `dtype`."""
    if out.dtype != dtype:
        raise ValueError(f"out.dtype is {out.dtype}, expected {dtype}")
    if out.numel() != numel:
        raise ValueError(f"out has {out.numel()} elements, expected {numel}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous (stride {out.stride()})")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, payload is on {device}")


def decode_scales(payloads: Tensor, layout: PayloadLayout) -> Tensor:
    """fp32 scales (k, nblocks) read from the tail of each row of `payloads` (k, nbytes)."""
    raw = payloads[:, layout.data_nbytes :]
    # A float32 view needs 4-byte aligned offset and row stride; the scale region starts
    # unaligned for some block sizes and so do rows of odd length, so copy when needed.
    if raw.storage_offset() % SCALE_NBYTES or raw.stride(0) % SCALE_NBYTES:
        raw = raw.clone(memory_format=torch.contiguous_format)
    return raw.view(torch.float32)


# ---------------------------------------------------------------------------------------------
# Runs of blocks.
# ---------------------------------------------------------------------------------------------

# On CPU every kernel walks the blocks in runs of about this many values, so that each of its
# passes (scales, divide, round, clamp, cast, pack, decode) finds the previous pass's output
# in cache instead of memory: about 2x faster than whole-tensor passes for 8M values on a
# 2-core x86 host (64K-value runs lose it again to per-call overhead). Blocks are independent
# and sums go element by element, so results do not depend on the run length. Other devices
# (the reference on a GPU) take one run: there every pass is a kernel launch.
CPU_RUN_NUMEL = 1 << 18


def block_runs(layout: PayloadLayout, device: torch.device) -> list[tuple[int, int]]:
    """Block ranges [first, end) covering the payload in order. Runs are multiples of 8
    blocks, so each starts on a whole byte of packed codes at every width."""
    if torch.device(device).type != "cpu":
        return [(0, layout.nblocks)]
    per_run = max(8, CPU_RUN_NUMEL // layout.block_size // 8 * 8)
    return [(first, min(first + per_run, layout.nblocks))
            for first in range(0, layout.nblocks, per_run)]


def _code_bytes(layout: PayloadLayout, first: int, end: int) -> slice:
    """The packed code bytes of blocks [first, end) (`first` a multiple of 8)."""
    bits_per_block = layout.block_size * layout.bits
    stop = layout.data_nbytes if end == layout.nblocks else end * bits_per_block // 8
    return slice(first * bits_per_block // 8, stop)


def _values(layout: PayloadLayout, first: int, end: int) -> slice:
    """The (unpadded) values that blocks [first, end) hold."""
    return slice(first * layout.block_size, min(end * layout.block_size, layout.numel))


# ---------------------------------------------------------------------------------------------
# Quantization.
# ---------------------------------------------------------------------------------------------


def _fp32_blocks(values: Tensor, block_size: int) -> tuple[Tensor, bool]:
    """fp32 (blocks, block_size) of a run's unpadded `values`, the last block zero-padded,
    and whether it is a private copy (which the encoder may then overwrite instead of
    allocating again)."""
    padding = -values.numel() % block_size
    if padding:
        padded = torch.zeros(values.numel() + padding, dtype=torch.float32, device=values.device)
        padded[: values.numel()] = values
        return padded.view(-1, block_size), True
    return values.to(torch.float32).view(-1, block_size), values.dtype != torch.float32


def _block_scales(blocks: Tensor, qmax: int) -> Tensor:
    """absmax * (1 / qmax) per row; NaN for rows holding inf or NaN."""
    # amax and amin propagate NaN and allocate nothing of the input's size (measured
    # several times faster on CPU than aminmax or abs().amax).
    absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())
    # + 0.0 turns a -0.0 absmax (an all-zero block: maximum(0, -0) may return either
    # zero, depending on where the block falls in a vector register) into the +0.0 scale
    # the Triton kernels write, so the payload bytes do not depend on the run length.
    scales = absmax.mul_(reciprocal_of_qmax(qmax)).add_(0.0)
    return torch.where(torch.isfinite(absmax), scales, torch.full_like(scales, float("nan")))


def _block_codes(blocks: Tensor, scales: Tensor, qmax: int, overwrite: bool) -> Tensor:
    """Signed codes (flat int8) of each row under its scale: the values times the scale's
    reciprocal, rounded half to even, clamped; zero codes where scale is 0/NaN.

    With `overwrite`, `blocks` is consumed to hold the codes (saves one allocation).
    """
    usable = scales > 0  # NaN > 0 is false
    prescale = torch.where(scales < PRESCALE_BELOW, PRESCALE, 1.0)
    # A zero reciprocal (scale 0 or NaN) sends every finite value of the row to code 0
    # without a masking pass; what is left, the inf and NaN values of a NaN-scale row,
    # multiply to NaN and become 0 in one cheap pass (testing for them first would sync a
    # GPU's host).
    reciprocal = torch.where(usable, 1.0 / torch.where(usable, scales * prescale, 1.0), 0.0)
    codes = blocks if overwrite else blocks.clone()
    # x * 1.0 is x: the prescaling pass runs only where a tiny scale needs it (on the CPU,
    # where asking costs no host sync).
    if codes.device.type != "cpu" or bool((prescale != 1.0).any()):
        codes.mul_(prescale[:, None])
    codes.mul_(reciprocal[:, None])
    codes.round_().clamp_(-qmax, qmax).nan_to_num_(nan=0.0)
    return codes.to(torch.int8).view(-1)


def _pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Data bytes of the payload from flat signed codes."""
    if bits == 8:
        return codes.view(torch.uint8)
    return pack_stored_codes((codes + code_offset(bits)).view(torch.uint8), bits)


# Sub-byte packing moves whole words: a little-endian int16 (int4) or int32 (int2) holds
# the 8 // bits codes of one payload byte, one per byte, and shifts gather them into its low
# byte (or spread them back out). One pass over contiguous words instead of one strided
# pass per code slot: about 4x faster on CPU. Payload bytes, scales included, are
# little-endian by definition, as on every platform torch runs on.
_WORD_DTYPE = {4: torch.int16, 2: torch.int32}
_SPREAD_MASK = {4: 0x0F0F, 2: 0x03030303}


def pack_stored_codes(stored: Tensor, bits: int) -> Tensor:
    """Data bytes from one offset-binary code per byte (int4/int2): 8 // bits codes a byte,
    the lowest index in the lowest bits; a short last byte is filled with the code of zero."""
    per_byte = 8 // bits
    spare = -stored.numel() % per_byte
    if spare:
        stored = torch.cat([stored, stored.new_full((spare,), code_offset(bits))])
    elif stored.storage_offset() % per_byte or not stored.is_contiguous():
        stored = stored.clone(memory_format=torch.contiguous_format)  # word-aligned
    words = stored.view(_WORD_DTYPE[bits])
    packed = words | (words >> (8 - bits))  # code i of a word moves from bit 8i to bits*i
    for slot in range(2, per_byte):
        packed |= words >> ((8 - bits) * slot)
    return packed.to(torch.uint8)  # the low byte


def _encode_run(blocks: Tensor, overwrite: bool, layout: PayloadLayout, first: int,
                payload: Tensor) -> None:
    """Write blocks [first, first + len(blocks)) of `payload` from their fp32 values;
    `overwrite` lets it reuse `blocks`."""
    end = first + blocks.shape[0]
    qmax = qmax_for_bits(layout.bits)
    scales = _block_scales(blocks, qmax)
    codes = _block_codes(blocks, scales, qmax, overwrite)
    payload[_code_bytes(layout, first, end)] = _pack_codes(codes, layout.bits)
    scale_bytes = layout.data_nbytes + first * SCALE_NBYTES
    payload[scale_bytes : scale_bytes + scales.numel() * SCALE_NBYTES] = scales.view(torch.uint8)


def quantize_blockwise(x: Tensor, bits: int, block_size: int) -> Tensor:
    """Quantize the flattened `x` block-wise into one flat uint8 payload (see module doc)."""
    layout = check_quantize_input(x, bits, block_size)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)
    flat = x.reshape(-1)
    for first, end in block_runs(layout, x.device):
        blocks, is_private = _fp32_blocks(flat[_values(layout, first, end)], block_size)
        _encode_run(blocks, is_private, layout, first, payload)
    return payload


# ---------------------------------------------------------------------------------------------
# Dequantization and reductions.
# ---------------------------------------------------------------------------------------------


def _unpack_codes(data: Tensor, layout: PayloadLayout, nblocks: int) -> Tensor:
    """Signed int8 codes (k, nblocks, block_size) from rows of packed code bytes `data`
    (k, bytes) that start on a block boundary."""
    k = data.shape[0]
    if layout.bits == 8:
        codes = data.view(torch.int8)
    else:  # the inverse of pack_stored_codes: code i of a byte to byte i of a word
        bits = layout.bits
        words = data.to(_WORD_DTYPE[bits])
        spread = words | (words << (8 - bits))
        for slot in range(2, 8 // bits):
            spread |= words << ((8 - bits) * slot)
        stored = spread.bitwise_and_(_SPREAD_MASK[bits]).view(torch.int8).view(k, -1)
        codes = stored[:, : nblocks * layout.block_size] - code_offset(bits)
    return codes.reshape(k, nblocks, layout.block_size)


def _decode_run(payloads: Tensor, scales: Tensor, layout: PayloadLayout, first: int,
                end: int, into: Tensor | None = None) -> Tensor:
    """fp32 values (k, values of blocks [first, end), unpadded) of a batch of payloads
    (k, nbytes) whose scales (k, nblocks) are `scales`; decoded in place into `into`
    (fp32, (k, end - first, block_size)) when given."""
    k = payloads.shape[0]
    codes = _unpack_codes(payloads[:, _code_bytes(layout, first, end)], layout, end - first)
    # Convert, then scale in place: a mixed int8 * fp32 multiply is about 2x slower on CPU.
    values = codes.to(torch.float32) if into is None else into.copy_(codes)
    values.mul_(scales[:, first:end, None])
    span = _values(layout, first, end)
    return values.view(k, -1)[:, : span.stop - span.start]


def dequantize_blockwise(
    payload: Tensor,
    numel: int,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
    out: Tensor | None = None,
) -> Tensor:
    """Inverse of `quantize_blockwise`: flat `numel` values in `dtype` (into `out` if given)."""
    layout = payload_layout(numel, bits, block_size)
    check_payloads(payload, layout, ndim=1)
    check_float_dtype(dtype, "dtype")
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=payload.device)
    else:
        check_out(out, numel, dtype, payload.device)
    _decode_into(payload.view(1, -1), layout, out.view(1, -1))
    return out


def _decode_into(payloads: Tensor, layout: PayloadLayout, out: Tensor) -> None:
    """Dequantize payloads (k, nbytes) into `out` (k, numel), run by run."""
    if layout.numel == 0:
        return
    scales = decode_scales(payloads, layout)
    k = payloads.shape[0]
    for first, end in block_runs(layout, payloads.device):
        target = out[:, _values(layout, first, end)]
        if out.dtype == torch.float32 and target.shape[1] == (end - first) * layout.block_size:
            # Whole blocks into fp32: decoded in place, without a temporary.
            _decode_run(payloads, scales, layout, first, end,
                        into=target.view(k, end - first, layout.block_size))
        else:
            target.copy_(_decode_run(payloads, scales, layout, first, end))


def dequantize_blockwise_many(
    payloads: Tensor, numel: int, bits: int, block_size: int, dtype: torch.dtype,
    out: Tensor | None = None,
) -> Tensor:
    """Dequantize k payloads at once: (k, nbytes) uint8 -> (k, numel) in `dtype`, written
    into `out` (contiguous, k x numel elements) if given."""
    layout = payload_layout(numel, bits, block_size)
    check_payloads(payloads, layout, ndim=2)
    check_float_dtype(dtype, "dtype")
    if out is None:
        out = torch.empty(payloads.shape[0], numel, dtype=dtype, device=payloads.device)
    else:
        check_out(out, payloads.shape[0] * numel, dtype, payloads.device)
    if payloads.shape[0]:
        _decode_into(payloads, layout, out.view(payloads.shape[0], numel))
    return out


def _reduce_run(payloads: Tensor, scales: Tensor, layout: PayloadLayout, first: int,
                end: int) -> Tensor:
    """fp32 sum over the k payloads of the values of blocks [first, end), in payload order
    from the first one (not from zeros: [Note: sums from the first payload]): the fixed
    order makes the sum reproducible across backends."""
    if not payloads.shape[0]:
        span = _values(layout, first, end)
        return torch.zeros(span.stop - span.start, dtype=torch.float32, device=payloads.device)
    rows = _decode_run(payloads, scales, layout, first, end)
    total = rows[0].clone()
    for row in rows[1:]:
        total += row  # k is a rank count, never a block count
    return total


def dequantize_reduce(payloads: Tensor, numel: int, bits: int, block_size: int,
                      out: Tensor | None = None) -> Tensor:
    """Sum of the k dequantized payloads (k, nbytes), in fp32, in payload order; written
    into `out` (contiguous, `numel` elements, any supported dtype: the sum rounded once to
    it) if given."""
    layout = payload_layout(numel, bits, block_size)
    check_payloads(payloads, layout, ndim=2)
    if out is None:
        total = torch.empty(numel, dtype=torch.float32, device=payloads.device)
    else:
        check_float_dtype(out.dtype, "out.dtype")
        check_out(out, numel, out.dtype, payloads.device)
        total = out  # contiguous, so indexing it flat below is safe
    if numel == 0:
        return total
    scales = decode_scales(payloads, layout)
    for first, end in block_runs(layout, payloads.device):
        total.view(-1)[_values(layout, first, end)] = _reduce_run(payloads, scales, layout,
                                                                  first, end)
    return total


def dequantize_reduce_quantize(
    payloads: Tensor, numel: int, bits_in: int, bits_out: int, block_size: int,
    parts: int = 1,
) -> Tensor:
    """qgZ's middle step: dequantize k payloads, sum in fp32, quantize the sum to `bits_out`.

    With `parts` > 1 the sum is quantized as `parts` equal slices, their payloads one after
    another (`split_payload`'s layout, [Note: payload pieces]): what qgZ's second all-to-all
    sends, slice m to node m. The bytes are the same, only their order differs."""
    layout_in = payload_layout(numel, bits_in, block_size)
    layout_out = payload_layout(numel, bits_out, block_size)
    check_payloads(payloads, layout_in, ndim=2)
    out = torch.empty(layout_out.nbytes, dtype=torch.uint8, device=payloads.device)
    if numel == 0:
        return out
    scales = decode_scales(payloads, layout_in)
    for first, end in block_runs(layout_in, payloads.device):
        total = _reduce_run(payloads, scales, layout_in, first, end)
        blocks, _ = _fp32_blocks(total, block_size)
        _encode_run(blocks, True, layout_out, first, out)  # the sum is ours to reuse
    if parts == 1:
        return out
    return split_payload(out, parts, numel // parts, bits_out, block_size).view(-1)


# ---------------------------------------------------------------------------------------------
# Payload pieces.
# ---------------------------------------------------------------------------------------------

# [Note: payload pieces] A payload of `parts * numel` values is [codes | scales]; the payload
# of each slice of `numel` values is [its codes | its scales]. When a slice is a whole number
# of blocks whose codes are whole bytes, the slice's codes and scales are contiguous runs of
# the big payload's two regions, so the pieces are a shuffle of the payload's bytes: the
# same bytes quantizing each slice on its own would give. qgZ's all-to-alls send pieces,
# and the kernels below write them directly.


def _payload_regions(payload: Tensor, parts: int, numel: int, bits: int,
                     block_size: int) -> tuple[Tensor, Tensor]:
    """The codes and the scales of a payload of ``parts * numel`` values, as [parts, bytes]
    views ([Note: payload pieces])."""
    whole = payload_layout(parts * numel, bits, block_size)
    piece = payload_layout(numel, bits, block_size)
    if numel % block_size or whole.data_nbytes != parts * piece.data_nbytes:
        raise ValueError(
            f"cannot split a payload of {parts} x {numel} values at block size {block_size}: "
            "slices must be whole blocks of whole bytes"
        )
    codes = payload[: whole.data_nbytes].view(parts, piece.data_nbytes)
    scales = payload[whole.data_nbytes :].view(parts, piece.nbytes - piece.data_nbytes)
    return codes, scales


def split_payload(payload: Tensor, parts: int, numel: int, bits: int, block_size: int) -> Tensor:
    """One payload of ``parts * numel`` values -> ``parts`` payloads of ``numel`` values each
    ([parts, bytes]), a byte shuffle ([Note: payload pieces])."""
    codes, scales = _payload_regions(payload, parts, numel, bits, block_size)
    return torch.cat([codes, scales], dim=1)


def swizzle_payload(payload: Tensor, nodes: int, per_node: int, slice_numel: int,
                    bits: int, block_size: int) -> Tensor:
    """The payload of N = nodes x per_node rank slices in rank order -> per_node payloads
    ([per_node, bytes]), payload l holding the slices of ranks {m * per_node + l for every
    node m}: ``split_payload(quantize(swizzle(x)), per_node, ...)``'s bytes, by a shuffle."""
    codes, scales = _payload_regions(payload, nodes * per_node, slice_numel, bits, block_size)

    def by_local_rank(region: Tensor) -> Tensor:
        return region.view(nodes, per_node, -1).transpose(0, 1).reshape(per_node, -1)

    return torch.cat([by_local_rank(codes), by_local_rank(scales)], dim=1)


def quantize_swizzled(x: Tensor, nodes: int, per_node: int, bits: int,
                      block_size: int) -> Tensor:
    """qgZ's first send in one step: ``x`` holds N = nodes x per_node slices in rank order;
    the result is per_node payloads one after another (flat uint8), payload l quantizing
    the slices of ranks {m * per_node + l for every node m} in node order."""
    slice_numel = _slice_numel(x.reshape(-1), nodes, per_node)
    payload = quantize_blockwise(x, bits, block_size)
    return swizzle_payload(payload, nodes, per_node, slice_numel, bits, block_size).view(-1)


# ---------------------------------------------------------------------------------------------
# qgZ reorder.
# ---------------------------------------------------------------------------------------------


def _slice_numel(flat: Tensor, nodes: int, ranks_per_node: int) -> int:
    for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(flat, Tensor) or flat.dim() != 1:
        shape = tuple(flat.shape) if isinstance(flat, Tensor) else type(flat).__name__
        raise ValueError(f"flat must be a 1-D tensor, got {shape}")
    world = nodes * ranks_per_node
    if flat.numel() % world:
        raise ValueError(
            f"flat has {flat.numel()} elements, not divisible by nodes*ranks_per_node = {world}"
        )
    return flat.numel() // world


def swizzle(flat: Tensor, nodes: int, ranks_per_node: int) -> Tensor:
    """Reorder rank slices [node, local, S] -> [local, node, S] for qgZ's first all-to-all.

    `flat` holds the slices of global ranks 0..N-1 in order; chunk l of the result holds
    the slices of ranks {n * ranks_per_node + l for each node n}, so that after the
    intra-node all-to-all local rank l owns exactly what it forwards across nodes.
    Always returns a new tensor.
    """
    slice_numel = _slice_numel(flat, nodes, ranks_per_node)
    by_rank = flat.view(nodes, ranks_per_node, slice_numel).transpose(0, 1)
    return by_rank.clone(memory_format=torch.contiguous_format).view(-1)


def unswizzle(flat: Tensor, nodes: int, ranks_per_node: int) -> Tensor:
    """Inverse of `swizzle`: [local, node, S] -> [node, local, S]. Always a new tensor."""
    slice_numel = _slice_numel(flat, nodes, ranks_per_node)
    by_node = flat.view(ranks_per_node, nodes, slice_numel).transpose(0, 1)
    return by_node.clone(memory_format=torch.contiguous_format).view(-1)
