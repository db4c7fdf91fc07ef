"""Device functions of the Triton quantization kernels (`zeropp.kernels.triton_kernels`,
whose module docstring says why each numeric choice keeps them bit-exact with the torch
reference): loads and stores that drop their masks at compile time, the NaN-keeping absmax,
scales and codes, packing and unpacking sub-byte codes in registers, the sum over payloads.

Importable without Triton (the functions are then plain, never called).
"""

from __future__ import annotations

from zeropp.kernels.launch_specs import SMALL_BLOCK
from zeropp.kernels.reference import PRESCALE, PRESCALE_BELOW, code_offset

try:
    import triton
    import triton.language as tl
except ImportError:  # importable without Triton; triton_kernels.is_available() says so
    triton = None
    tl = None


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def _constexpr(value):
    return tl.constexpr(value) if triton is not None else value


# Kernels may only read module globals that are constexpr.
_NIBBLE_BIAS = _constexpr(code_offset(4))
_NIBBLE_BIAS_WORD = _constexpr(code_offset(4) * 0x11111111)  # eight codes of zero
_CRUMB_BIAS = _constexpr(code_offset(2))
# Adding 1.5 * 2**23 to |v| < 2**22 leaves no fraction bits: the sum is rounded half to even
# to an integer, which its low mantissa bits hold (1.5 * 2**23's are zero). Going back, an
# integer n < 2**22 ORed into 2**23's bits is the float 2**23 + n: code <-> float without
# the (quarter-rate) conversion instructions.
_ROUNDING_MAGIC = _constexpr(1.5 * 2.0**23)
_FLOAT_BITS_OF_2_POW_23 = _constexpr(0x4B000000)
_TWO_POW_23 = _constexpr(2.0**23)
_PRESCALE = _constexpr(PRESCALE)
_PRESCALE_BELOW = _constexpr(PRESCALE_BELOW)
# Under this block size the reductions hold 4 values a thread, less than a word of int4
# codes: reading words there costs instructions (block 8: 320 -> 424 a program, sm_90).
_SMALL_BLOCK = _constexpr(SMALL_BLOCK)


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels, as triton.jit decides it when it
    decorates them (its TRITON_INTERPRET knob, which takes 1, true, yes and on)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


# Read at import, as triton.jit reads it when it decorates the kernels: the kernels here run
# interpreted or compiled for good. The interpreter runs no inline PTX.
INTERPRETED = interpreting()
_INTERPRETED = _constexpr(INTERPRETED)


# ---------------------------------------------------------------------------------------------
# Device functions. MASKED arguments are compile-time: False drops the mask (and with it
# the mask's arithmetic) from a load or store.
# ---------------------------------------------------------------------------------------------


@_jit
def _load(pointers, mask, other, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(pointers, mask=mask, other=other)
    else:
        return tl.load(pointers)


@_jit
def _store(pointers, values, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(pointers, values, mask=mask)
    else:
        tl.store(pointers, values)


@_jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@_jit
def _absmax(values):
    """Per row: the largest magnitude, NaN if the row holds a NaN (inf if an inf)."""
    return tl.reduce(tl.abs(values), 1, _max_keeping_nan)


# [Note: scales by a multiply] A block's scale is absmax * (1 / QMAX), the reciprocal an
# fp32 constant, not the IEEE quotient absmax / QMAX: a division by a variable costs a
# program's every row a Newton sequence, a range check and a branch around the slow path
# (with 2 or 4 rows a thread, 24 of the int8 quantize's 424 instructions and 64 of the
# int4's 800 at block 256 on sm_90; the int8 one also drops from 40 registers to 32, 75%
# -> 100% occupancy), and the reference takes the same formula, so the two
# stay bit-identical (`reference.reciprocal_of_qmax`). The scale moves by an ulp now and
# then; the error bound and the measured error stay (docs/results.md). 1.0 / QMAX rounds
# to fp64 and then to fp32 here as there (`torch.tensor(1.0 / qmax, dtype=torch.float32)`).
@_jit
def _block_scales(absmax, QMAX: tl.constexpr):
    """absmax * (1 / qmax) ([Note: scales by a multiply]), NaN for a row holding inf or
    NaN."""
    scales = absmax * (1.0 / QMAX)
    return tl.where((absmax == absmax) & (absmax != float("inf")), scales, float("nan"))


@_jit
def _code_factors(scales):
    """Per row of a tile, what its codes are worked out with: (the reciprocal of the scale,
    prescaled where the scale is tiny, 1 where it is 0 or NaN; the prescale; whether every
    row is plain, a scalar, [Note: plain rows])."""
    usable = scales > 0.0
    prescale = tl.where(scales < _PRESCALE_BELOW, _PRESCALE, 1.0)
    inverse = tl.div_rn(tl.zeros_like(scales) + 1.0, tl.where(usable, scales * prescale, 1.0))
    plain = tl.max(tl.where((scales >= _PRESCALE_BELOW) | (scales == 0.0), 0, 1), 0) == 0
    return inverse, prescale, plain


@_jit
def _codes(values, scales, inverse, prescale, QMAX: tl.constexpr, BIAS: tl.constexpr,
           PLAIN: tl.constexpr):
    """Stored codes of a [ROWS, COLS] tile under its rows' scales, as int32 whose low byte is
    q + BIAS: q is the value times the reciprocal of the scale, clamped to [-QMAX, QMAX] and
    rounded half to even (clamping first is the same, QMAX being an integer); 0 where the
    scale is 0 or NaN. A scale so small that its reciprocal would overflow is prescaled (as
    the reference). The rounding is the magic addition; BIAS is even, so ties go to the even
    q as torch.round sends them. ``inverse`` and ``prescale``: ``_code_factors``'. ``PLAIN``:
    every row of the tile is plain, so the multiply alone gives the same codes."""
    # [Note: plain rows] A row whose scale is 0 or at least PRESCALE_BELOW (a normal float)
    # needs neither the prescale, nor the clamp, nor the select for NaN rows: its values are
    # finite, |value| <= absmax, and 1 / QMAX, scale = RN(absmax * (1 / QMAX)) and the
    # product each round by at most 2**-24 relative, 1 / scale too unless it is subnormal
    # (QMAX 1, whose reciprocal is exact, and a scale of 2**126 or more, where its absolute
    # error of 2**-150 times the scale is still below 2**-22), so |value * (1 / scale)| <
    # QMAX (1 + 2**-21) < QMAX + 1/2, which rounds to at most QMAX: the clamp changes
    # nothing. A zero scale comes from an absmax below about half a subnormal step times
    # QMAX (all values, times 1 / 1, round to code 0) or of +-0. (A subnormal scale is
    # RN(absmax * (1 / QMAX)) to an absolute, not a relative, half-step, so
    # its values can round past QMAX: those rows, tiny-scale rows and NaN rows take the full
    # formula.) The
    # quantize kernel chooses per program (``_tile_codes``: both compiled, one run), so a
    # plain tile costs a multiply and the rounding a value; so does the requantizing
    # reduction in one pass over int4 or int8 inputs (8 x int4 -> int4 at block 256 on
    # sm_90: 1460 -> 1359 instructions run a program, registers unchanged). With int2
    # inputs the second path cost it registers (56 -> 85 on sm_90, occupancy 56% -> 31%),
    # and two passes would check every chunk: those take the full formula (``_full_codes``).
    if PLAIN:
        scaled = values * inverse[:, None]
    else:
        scaled = tl.where((scales > 0.0)[:, None], (values * prescale[:, None]) * inverse[:, None],
                          0.0)
        scaled = tl.minimum(tl.maximum(scaled, -QMAX), QMAX)
    return (scaled + (_ROUNDING_MAGIC + BIAS)).to(tl.int32, bitcast=True)


@_jit
def _full_codes(values, scales, QMAX: tl.constexpr, BIAS: tl.constexpr):
    """``_codes`` by the full formula whatever the rows: where the plain path would cost
    more than it saves ([Note: plain rows])."""
    inverse, prescale, _ = _code_factors(scales)
    return _codes(values, scales, inverse, prescale, QMAX, BIAS, False)


@_jit
def _tile_codes(values, scales, QMAX: tl.constexpr, BIAS: tl.constexpr):
    """``_codes`` of a tile, plain where every row is ([Note: plain rows]): the quantize
    kernel's choice, per program."""
    inverse, prescale, plain = _code_factors(scales)
    if plain:
        codes = _codes(values, scales, inverse, prescale, QMAX, BIAS, True)
    else:
        codes = _codes(values, scales, inverse, prescale, QMAX, BIAS, False)
    return codes


@_jit
def _quantize_chunks(x, codes_ptr, scales, inverse, prescale, first, first_out, nblocks, numel,
                     BLOCK: tl.constexpr, QMAX: tl.constexpr, BITS: tl.constexpr,
                     PACK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                     MASK_VALUES: tl.constexpr, PLAIN: tl.constexpr):
    """A large block's second pass: codes of every chunk, under scales known already."""
    for c0 in range(0, BLOCK, COLS):
        rows, local, row_valid, in_block, in_range = _tile(first, c0, nblocks, numel, BLOCK,
                                                           ROWS, COLS)
        values = _load(x + local, in_range, 0.0, MASK_VALUES).to(tl.float32)
        codes = _codes(values, scales, inverse, prescale, QMAX, QMAX + 1 if BITS < 8 else 0,
                       PLAIN)
        _store_codes(codes_ptr, codes, first_out, rows, c0, local, in_block, row_valid, BLOCK,
                     BITS, PACK, ROWS, COLS, MASK_VALUES)


@_jit
def _quantize_second_pass(x, codes_ptr, scales, first, first_out, nblocks, numel,
                          BLOCK: tl.constexpr, QMAX: tl.constexpr, BITS: tl.constexpr,
                          PACK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                          MASK_VALUES: tl.constexpr):
    """A large block's second pass, plain where every row is ([Note: plain rows]): the choice
    is made outside the loop, so one loop runs, with no branch in it."""
    inverse, prescale, plain = _code_factors(scales)
    if plain:
        _quantize_chunks(x, codes_ptr, scales, inverse, prescale, first, first_out, nblocks,
                         numel, BLOCK, QMAX, BITS, PACK, ROWS, COLS, MASK_VALUES, True)
    else:
        _quantize_chunks(x, codes_ptr, scales, inverse, prescale, first, first_out, nblocks,
                         numel, BLOCK, QMAX, BITS, PACK, ROWS, COLS, MASK_VALUES, False)


# [Note: clean code bits] `_codes` returns the float bits of 1.5 * 2**23 + q + BIAS, that
# is 0x4B400000 + q + BIAS, and for sub-byte codes q + BIAS is in [0, 2**BITS) (q within
# +-QMAX, BIAS = QMAX + 1): the bits from BITS up to bit 7 are zero. So codes are packed
# into bytes by shifts and adds alone, with no mask a code: a shifted code's stray bits
# land at bit 8 or above, which the byte store drops, and below bit 8 the addends' bits do
# not overlap, so the adds are ORs there (an add and a shift fuse into one multiply-add,
# which an OR does not: the int4 quantize at block 256, 16 of a program's instructions).
@_jit
def _store_codes(codes_ptr, codes, first, rows, c0, local, in_block, row_valid,
                 BLOCK: tl.constexpr, BITS: tl.constexpr, PACK: tl.constexpr,
                 ROWS: tl.constexpr, COLS: tl.constexpr, MASK_VALUES: tl.constexpr):
    """Store `_codes`' output (int32 whose low byte is the stored code)."""
    if BITS == 8:
        _store(codes_ptr + first * BLOCK + local, codes.to(tl.uint8), in_block, MASK_VALUES)
    elif PACK and BITS == 4:
        low, high = tl.split(tl.reshape(codes, [ROWS, COLS // 2, 2]))
        pair_cols = c0 // 2 + tl.arange(0, COLS // 2)
        byte_local = rows[:, None] * (BLOCK // 2) + pair_cols[None, :]
        pair_mask = row_valid[:, None] & (pair_cols[None, :] < BLOCK // 2)
        packed = low + (high << 4)  # no masks: [Note: clean code bits]
        _store(codes_ptr + first * (BLOCK // 2) + byte_local, packed.to(tl.uint8), pair_mask,
               MASK_VALUES)
    elif PACK:  # int2, blocks of whole bytes: four codes a byte, as for int4's two
        # Column 4g + 2i + j of the tile lands at [g, i, j]: split j, then i.
        even, odd = tl.split(tl.reshape(codes, [ROWS, COLS // 4, 2, 2]))
        c0_codes, c2_codes = tl.split(even)
        c1_codes, c3_codes = tl.split(odd)
        packed = c0_codes + (c1_codes << 2) + (c2_codes << 4) + (c3_codes << 6)
        quad_cols = c0 // 4 + tl.arange(0, COLS // 4)
        byte_local = rows[:, None] * (BLOCK // 4) + quad_cols[None, :]
        quad_mask = row_valid[:, None] & (quad_cols[None, :] < BLOCK // 4)
        _store(codes_ptr + first * (BLOCK // 4) + byte_local, packed.to(tl.uint8), quad_mask,
               MASK_VALUES)
    else:  # blocks not of whole bytes: one code per byte into scratch, packed by the host
        _store(codes_ptr + first * BLOCK + local, codes.to(tl.uint8), in_block, MASK_VALUES)


@_jit
def _store_scales(scales_ptr, block_index, scales, row_valid, SCALES_F32: tl.constexpr,
                  MASK_ROWS: tl.constexpr):
    """Scales of blocks `block_index` into the scale region at `scales_ptr` (a byte pointer):
    as fp32 words when the region is 4-byte aligned, else byte by byte."""
    if SCALES_F32:
        _store(scales_ptr.to(tl.pointer_type(tl.float32)) + block_index, scales, row_valid,
               MASK_ROWS)
    else:
        bits = scales.to(tl.uint32, bitcast=True)
        base = scales_ptr + block_index * 4
        _store(base, (bits & 0xFF).to(tl.uint8), row_valid, MASK_ROWS)
        _store(base + 1, ((bits >> 8) & 0xFF).to(tl.uint8), row_valid, MASK_ROWS)
        _store(base + 2, ((bits >> 16) & 0xFF).to(tl.uint8), row_valid, MASK_ROWS)
        _store(base + 3, ((bits >> 24) & 0xFF).to(tl.uint8), row_valid, MASK_ROWS)


@_jit
def _load_scales(scales_ptr, block_index, row_valid, SCALES_F32: tl.constexpr,
                 MASK_ROWS: tl.constexpr):
    if SCALES_F32:
        return _load(scales_ptr.to(tl.pointer_type(tl.float32)) + block_index, row_valid, 0.0,
                     MASK_ROWS)
    else:
        base = scales_ptr + block_index * 4
        b0 = _load(base, row_valid, 0, MASK_ROWS).to(tl.uint32)
        b1 = _load(base + 1, row_valid, 0, MASK_ROWS).to(tl.uint32)
        b2 = _load(base + 2, row_valid, 0, MASK_ROWS).to(tl.uint32)
        b3 = _load(base + 3, row_valid, 0, MASK_ROWS).to(tl.uint32)
        return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@_jit
def _code_of_float_bits(bits, BIAS: tl.constexpr):
    """fp32 code q of the float bits of 2**23 + q + BIAS: that float minus 2**23 + BIAS,
    both exact."""
    return bits.to(tl.float32, bitcast=True) - (_TWO_POW_23 + BIAS)


@_jit
def _as_float(stored, BIAS: tl.constexpr):
    """fp32 value of stored codes (int32 in [0, 256), q + BIAS): 2**23 + stored as float
    bits, minus 2**23 + BIAS, both exact."""
    return _code_of_float_bits(stored | _FLOAT_BITS_OF_2_POW_23, BIAS)


@_jit
def _load_codes(payload_ptr, first, rows, c0, local, in_block, row_valid,
                BLOCK: tl.constexpr, BITS: tl.constexpr, UNPACK: tl.constexpr,
                ROWS: tl.constexpr, COLS: tl.constexpr, MASK_VALUES: tl.constexpr):
    """Signed codes (fp32) of one payload over a [ROWS, COLS] chunk of blocks from block
    `first` (padding included; masked-off columns read the code of zero)."""
    if BITS == 8:
        # One conversion a value (it reads the byte in place): measured faster on an H200
        # than the byte extraction and magic addition the sub-byte codes take.
        raw = _load(payload_ptr + first * BLOCK + local, in_block, 0, MASK_VALUES)
        codes = raw.to(tl.int8, bitcast=True).to(tl.float32)
    elif UNPACK and BITS == 4:
        # 16 bytes a thread, split into their two nibbles in registers: even values low.
        pair_cols = c0 // 2 + tl.arange(0, COLS // 2)
        byte_local = rows[:, None] * (BLOCK // 2) + pair_cols[None, :]
        pair_mask = row_valid[:, None] & (pair_cols[None, :] < BLOCK // 2)
        packed = _load(payload_ptr + first * (BLOCK // 2) + byte_local, pair_mask,
                       _NIBBLE_BIAS, MASK_VALUES).to(tl.int32)
        nibbles = tl.reshape(tl.join(packed & 0xF, packed >> 4), [ROWS, COLS])
        codes = _as_float(nibbles, _NIBBLE_BIAS)
    elif UNPACK:  # int2, blocks of whole bytes: code i of a byte in bits 2i..2i+1
        quad_cols = c0 // 4 + tl.arange(0, COLS // 4)
        byte_local = rows[:, None] * (BLOCK // 4) + quad_cols[None, :]
        quad_mask = row_valid[:, None] & (quad_cols[None, :] < BLOCK // 4)
        packed = _load(payload_ptr + first * (BLOCK // 4) + byte_local, quad_mask,
                       _CRUMB_BIAS, MASK_VALUES).to(tl.int32)
        # The inverse of _store_codes' splits: [g, i, j] is column 4g + 2i + j.
        even = tl.join(packed & 0x3, (packed >> 4) & 0x3)
        odd = tl.join((packed >> 2) & 0x3, packed >> 6)
        codes = _as_float(tl.reshape(tl.join(even, odd), [ROWS, COLS]), _CRUMB_BIAS)
    elif BITS == 4:
        # Blocks not of whole bytes: neighbours read the same byte and pick their nibble by
        # the global index's parity.
        base = first * BLOCK
        index = local + (base & 1).to(tl.int32)
        packed = tl.load(payload_ptr + base // 2 + index // 2, mask=in_block,
                         other=_NIBBLE_BIAS)
        codes = _as_float((packed.to(tl.int32) >> ((index & 1) * 4)) & 0xF, _NIBBLE_BIAS)
    else:  # int2 blocks not of whole bytes: four neighbours share a byte
        base = first * BLOCK
        index = local + (base & 3).to(tl.int32)
        packed = tl.load(payload_ptr + base // 4 + index // 4, mask=in_block,
                         other=_CRUMB_BIAS)
        codes = _as_float((packed.to(tl.int32) >> ((index & 3) * 2)) & 0x3, _CRUMB_BIAS)
    return codes


@_jit
def _payload_products(payload, data_nbytes, first, rows, c0, local, in_block, row_valid,
                      BLOCK: tl.constexpr, BITS: tl.constexpr, UNPACK: tl.constexpr,
                      ROWS: tl.constexpr, COLS: tl.constexpr, MASK_VALUES: tl.constexpr,
                      MASK_ROWS: tl.constexpr, SCALES_F32: tl.constexpr):
    """One payload's codes times its blocks' scales, over a chunk."""
    scales = _load_scales(payload + data_nbytes, first + rows, row_valid, SCALES_F32,
                          MASK_ROWS)
    codes = _load_codes(payload, first, rows, c0, local, in_block, row_valid, BLOCK, BITS,
                        UNPACK, ROWS, COLS, MASK_VALUES)
    return codes * scales[:, None]


# [Note: word sums] The reductions' int4 payloads, when their codes are whole 32-bit words
# (every block a multiple of 8 values, rows 4-byte aligned: when scales are read as words)
# and blocks are not small (16 values or more), are read a word at a time and summed in
# eight accumulators, one per position j of a code in its word, joined into the tile's
# order once at the end (sums are elementwise, so summing in another order of positions
# changes nothing). Unpacking then takes 11 integer instructions a word of 8 values: two
# masks split the word into its even and odd nibbles, a byte each, and one `prmt` a value
# moves a byte under 2**23's exponent bits (the float 2**23 + stored code). ptxas turns
# the same formula written with shifts and masks into a shift, a zero-extension and an OR
# a value, hence the inline PTX; Triton's interpreter
# cannot run PTX, so it takes that formula in plain operations (the suite runs the PTX on
# a model of its instructions against it, `tests/test_kernel_ptx.py`). When they came,
# `python -m scripts.bench.kernel_sass` (sm_90, block 256, 8 payloads) listed a program of
# the fp32 sum at 1744 -> 1304 instructions, of the bf16 sum 1880 -> 1480, of the
# requantizing sum 2056 -> 1648; integer instructions a value and payload 3.5 -> 1.8 for the
# fp32 sum (docs/results.md has today's counts). Three floating-point operations a value
# and payload remain (the code's bias, the multiply by the scale, the sum's add), which
# bit-exactness keeps apart.
WORD_CODES_PTX = """{
    .reg .b32 even, odd, exponent;
    and.b32 even, $8, 0x0F0F0F0F;
    shr.u32 odd, $8, 4;
    and.b32 odd, odd, 0x0F0F0F0F;
    mov.b32 exponent, 0x4B000000;
    prmt.b32 $0, even, exponent, 0x7440;
    prmt.b32 $1, odd, exponent, 0x7440;
    prmt.b32 $2, even, exponent, 0x7441;
    prmt.b32 $3, odd, exponent, 0x7441;
    prmt.b32 $4, even, exponent, 0x7442;
    prmt.b32 $5, odd, exponent, 0x7442;
    prmt.b32 $6, even, exponent, 0x7443;
    prmt.b32 $7, odd, exponent, 0x7443;
}"""
_WORD_CODES_PTX = _constexpr(WORD_CODES_PTX)


@_jit
def _word_code_bits(words):
    """Per 32-bit word of int4 codes, the eight float bit patterns 2**23 + stored code of
    value j (bits 4j..4j+3), j = 0..7 ([Note: word sums])."""
    if _INTERPRETED:
        return (
            (words & 0xF) | _FLOAT_BITS_OF_2_POW_23,
            ((words >> 4) & 0xF) | _FLOAT_BITS_OF_2_POW_23,
            ((words >> 8) & 0xF) | _FLOAT_BITS_OF_2_POW_23,
            ((words >> 12) & 0xF) | _FLOAT_BITS_OF_2_POW_23,
            ((words >> 16) & 0xF) | _FLOAT_BITS_OF_2_POW_23,
            ((words >> 20) & 0xF) | _FLOAT_BITS_OF_2_POW_23,
            ((words >> 24) & 0xF) | _FLOAT_BITS_OF_2_POW_23,
            (words >> 28) | _FLOAT_BITS_OF_2_POW_23,
        )
    else:
        return tl.inline_asm_elementwise(
            _WORD_CODES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.uint32,) * 8,
            is_pure=True, pack=1)


@_jit
def _word_payload_products(payload, data_nbytes, first, rows, c0, row_valid,
                           BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                           MASK_VALUES: tl.constexpr, MASK_ROWS: tl.constexpr):
    """``_payload_products`` for int4 codes read as 32-bit words: the eight products of
    value j of every word, the chunk's values 8w + j ([Note: word sums])."""
    scales = _load_scales(payload + data_nbytes, first + rows, row_valid, True, MASK_ROWS)
    scales = scales[:, None]
    word_cols = c0 // 8 + tl.arange(0, COLS // 8)
    word_local = rows[:, None] * (BLOCK // 8) + word_cols[None, :]
    mask = row_valid[:, None] & (word_cols[None, :] < BLOCK // 8)
    words = _load(payload.to(tl.pointer_type(tl.uint32)) + first * (BLOCK // 8) + word_local,
                  mask, _NIBBLE_BIAS_WORD, MASK_VALUES)
    b0, b1, b2, b3, b4, b5, b6, b7 = _word_code_bits(words)
    return (_code_of_float_bits(b0, _NIBBLE_BIAS) * scales,
            _code_of_float_bits(b1, _NIBBLE_BIAS) * scales,
            _code_of_float_bits(b2, _NIBBLE_BIAS) * scales,
            _code_of_float_bits(b3, _NIBBLE_BIAS) * scales,
            _code_of_float_bits(b4, _NIBBLE_BIAS) * scales,
            _code_of_float_bits(b5, _NIBBLE_BIAS) * scales,
            _code_of_float_bits(b6, _NIBBLE_BIAS) * scales,
            _code_of_float_bits(b7, _NIBBLE_BIAS) * scales)


@_jit
def _add_word_payload(t0, t1, t2, t3, t4, t5, t6, t7, payload, data_nbytes, first, rows, c0,
                      row_valid, BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                      MASK_VALUES: tl.constexpr, MASK_ROWS: tl.constexpr):
    p0, p1, p2, p3, p4, p5, p6, p7 = _word_payload_products(
        payload, data_nbytes, first, rows, c0, row_valid, BLOCK, ROWS, COLS, MASK_VALUES,
        MASK_ROWS)
    return t0 + p0, t1 + p1, t2 + p2, t3 + p3, t4 + p4, t5 + p5, t6 + p6, t7 + p7


# [Note: sums from the first payload] A reduction's sum starts as the first payload's
# products, not as zeros plus them, in the reference too: 0 + x is x except for x = -0,
# which it makes +0. A -0 product needs a negative code under a zero scale, which no
# quantize writes (a zero scale comes with all codes 0), so the sums are those from zeros
# for every payload this project makes, and nothing reads a zero's sign anyway (absmax
# takes magnitudes; both zeros round to code 0). The add costs an instruction a value:
# 32 of a program's ~1300-1650 at block 256 with 8 x int4 payloads.
@_jit
def _sum_chunk_words(payload_ptr, payload_stride, data_nbytes, first, rows, c0, row_valid,
                     BLOCK: tl.constexpr, K: tl.constexpr, UNROLL: tl.constexpr,
                     ROWS: tl.constexpr, COLS: tl.constexpr, MASK_VALUES: tl.constexpr,
                     MASK_ROWS: tl.constexpr):
    """``_sum_chunk`` of K >= 1 int4 payloads whose codes are whole 32-bit words ([Note:
    word sums]): eight sums of a value position each, in payload order from the first
    payload's products ([Note: sums from the first payload]), joined."""
    tl.static_assert(BLOCK % 8 == 0, "int4 word sums need blocks of whole 32-bit words")
    t0, t1, t2, t3, t4, t5, t6, t7 = _word_payload_products(
        payload_ptr, data_nbytes, first, rows, c0, row_valid, BLOCK, ROWS, COLS, MASK_VALUES,
        MASK_ROWS)
    rest: tl.constexpr = K - 1
    for group in range(rest // UNROLL):
        for i in tl.static_range(UNROLL):
            payload = payload_ptr + (1 + group * UNROLL + i) * payload_stride
            t0, t1, t2, t3, t4, t5, t6, t7 = _add_word_payload(
                t0, t1, t2, t3, t4, t5, t6, t7, payload, data_nbytes, first, rows, c0,
                row_valid, BLOCK, ROWS, COLS, MASK_VALUES, MASK_ROWS)
    for i in tl.static_range(rest % UNROLL):
        payload = payload_ptr + (1 + (rest // UNROLL) * UNROLL + i) * payload_stride
        t0, t1, t2, t3, t4, t5, t6, t7 = _add_word_payload(
            t0, t1, t2, t3, t4, t5, t6, t7, payload, data_nbytes, first, rows, c0, row_valid,
            BLOCK, ROWS, COLS, MASK_VALUES, MASK_ROWS)
    # Value j = 4a + 2b + c of word w lands at [w, a, b, c]: joined over a, then b, then c.
    even = tl.join(tl.join(t0, t4), tl.join(t2, t6))  # [w, a, b]: value 4a + 2b
    odd = tl.join(tl.join(t1, t5), tl.join(t3, t7))
    return tl.reshape(tl.join(even, odd), [ROWS, COLS])


@_jit
def _sum_chunk(payload_ptr, payload_stride, data_nbytes, first, rows, c0, local, in_block,
               row_valid, BLOCK: tl.constexpr, BITS: tl.constexpr, UNPACK: tl.constexpr,
               K: tl.constexpr, UNROLL: tl.constexpr, ROWS: tl.constexpr,
               COLS: tl.constexpr, MASK_VALUES: tl.constexpr, MASK_ROWS: tl.constexpr,
               SCALES_F32: tl.constexpr):
    """fp32 sum over the K payloads of one chunk, in payload order, from the first one's
    products ([Note: sums from the first payload]). UNROLL payloads at a time are
    unrolled, so their loads are in flight together."""
    if K == 0:  # nothing to sum (the reference's zeros)
        return tl.zeros([ROWS, COLS], dtype=tl.float32)
    if BITS == 4 and UNPACK and SCALES_F32 and BLOCK >= _SMALL_BLOCK:
        return _sum_chunk_words(payload_ptr, payload_stride, data_nbytes, first, rows, c0,
                                row_valid, BLOCK, K, UNROLL, ROWS, COLS, MASK_VALUES,
                                MASK_ROWS)
    total = _payload_products(payload_ptr, data_nbytes, first, rows, c0, local, in_block,
                              row_valid, BLOCK, BITS, UNPACK, ROWS, COLS, MASK_VALUES,
                              MASK_ROWS, SCALES_F32)
    rest: tl.constexpr = K - 1
    for group in range(rest // UNROLL):
        for i in tl.static_range(UNROLL):
            payload = payload_ptr + (1 + group * UNROLL + i) * payload_stride
            total += _payload_products(payload, data_nbytes, first, rows, c0, local,
                                       in_block, row_valid, BLOCK, BITS, UNPACK, ROWS, COLS,
                                       MASK_VALUES, MASK_ROWS, SCALES_F32)
    for i in tl.static_range(rest % UNROLL):
        payload = payload_ptr + (1 + (rest // UNROLL) * UNROLL + i) * payload_stride
        total += _payload_products(payload, data_nbytes, first, rows, c0, local, in_block,
                                   row_valid, BLOCK, BITS, UNPACK, ROWS, COLS, MASK_VALUES,
                                   MASK_ROWS, SCALES_F32)
    return total


@_jit
def _to_bfloat16_rtne(values):
    """fp32 -> bf16 rounded to nearest-even, NaN -> 0x7FC0, exactly as torch converts."""
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = tl.where(values != values, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@_jit
def _store_values(out_ptr, values, mask, MASKED: tl.constexpr):
    if out_ptr.dtype.element_ty == tl.bfloat16:
        _store(out_ptr, _to_bfloat16_rtne(values), mask, MASKED)
    else:
        _store(out_ptr, values.to(out_ptr.dtype.element_ty), mask, MASKED)


@_jit
def _tile(first, c0, nblocks, numel, BLOCK: tl.constexpr, ROWS: tl.constexpr,
          COLS: tl.constexpr):
    """Rows and offsets (int32, from the program's first value) of columns c0..c0+COLS of
    the program's blocks; which rows are blocks, which columns lie in a block and which
    values lie in the tensor."""
    rows = tl.arange(0, ROWS)
    cols = c0 + tl.arange(0, COLS)
    local = rows[:, None] * BLOCK + cols[None, :]
    row_valid = first + rows < nblocks
    in_block = row_valid[:, None] & (cols[None, :] < BLOCK)
    left = tl.minimum(numel - first * BLOCK, ROWS * BLOCK).to(tl.int32)
    return rows, local, row_valid, in_block, in_block & (local < left)


@_jit
def _requantized_sum(payload_ptr, payload_stride, data_nbytes, first_in, first, c0, nblocks,
                     numel, BLOCK: tl.constexpr, BITS: tl.constexpr, UNPACK: tl.constexpr,
                     K: tl.constexpr, UNROLL: tl.constexpr, ROWS: tl.constexpr,
                     COLS: tl.constexpr, MASK_VALUES: tl.constexpr, MASK_ROWS: tl.constexpr,
                     SCALES_F32: tl.constexpr):
    """``_sum_chunk`` of columns c0..c0+COLS as the requantizing reduction reads it, with its
    tile: (total, rows, local, row_valid, in_block). The reference requantizes a zero-padded
    sum; NaN scales would leak into the padding, hence zeros outside the tensor."""
    rows, local, row_valid, in_block, in_range = _tile(first, c0, nblocks, numel, BLOCK, ROWS,
                                                       COLS)
    total = _sum_chunk(payload_ptr, payload_stride, data_nbytes, first_in, rows, c0, local,
                       in_block, row_valid, BLOCK, BITS, UNPACK, K, UNROLL, ROWS, COLS,
                       MASK_VALUES, MASK_ROWS, SCALES_F32)
    if MASK_VALUES:
        total = tl.where(in_range, total, 0.0)
    return total, rows, local, row_valid, in_block
