"""The inline PTX of the Triton kernels, checked without a GPU.

Triton's interpreter runs no PTX, so the kernels take the same formula in plain operations
there ([Note: word sums] in `zeropp.kernels.triton_device`), and the suite's bit-exactness
tests run that formula. This file runs the PTX itself on a small model of the instructions
it uses, written from the PTX ISA's definitions, and checks it computes that formula: a
selector or mask typed wrong would otherwise show only on a GPU.
"""

from __future__ import annotations

import random
import re

import pytest

from zeropp.kernels.triton_device import WORD_CODES_PTX

MASK32 = 0xFFFFFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX `prmt.b32 d, a, b, c` (default mode): byte k of d is byte (c's nibble k & 7) of
    the 8 bytes {b, a} (a the low four), replicated from its sign bit when the nibble's bit
    3 is set."""
    source = (b << 32) | a
    out = 0
    for k in range(4):
        nibble = (selector >> (4 * k)) & 0xF
        byte = (source >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * k)
    return out


def _number(token: str, registers: dict[str, int]) -> int:
    token = token.strip()
    if token in registers:
        return registers[token]
    return int(token, 0) & MASK32


def run_ptx(source: str, inputs: dict[str, int]) -> dict[str, int]:
    """Run a PTX block of `.reg` declarations and and/shr/mov/prmt on 32-bit values;
    ``inputs`` maps operands ("$8") to values; returns every register and operand."""
    registers = dict(inputs)
    body = source.strip()
    assert body.startswith("{") and body.endswith("}"), body
    for line in body[1:-1].split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        match = re.fullmatch(r"([a-z0-9.]+)\s+(.*)", line)
        assert match, line
        op, operands = match.group(1), [o.strip() for o in match.group(2).split(",")]
        target, args = operands[0], [_number(o, registers) for o in operands[1:]]
        if op == "and.b32":
            registers[target] = args[0] & args[1]
        elif op == "shr.u32":
            registers[target] = args[0] >> args[1]
        elif op == "mov.b32":
            registers[target] = args[0]
        elif op == "prmt.b32":
            registers[target] = _prmt(*args)
        else:
            raise AssertionError(f"no model of {op!r}")
    return registers


def test_the_model_of_prmt_follows_the_ptx_isa():
    # CUB's documented example of cub::PRMT (cub/util_ptx.cuh), which issues this instruction
    assert _prmt(0x03020100, 0x07060504, 0x7531) == 0x07050301
    # the PTX ISA's generic form: bytes {b, a} numbered 0-7 from a's lowest, one selector
    # nibble a result byte, whose bit 3 replicates the selected byte's sign
    a, b = 0x44332211, 0x88776655
    assert _prmt(a, b, 0x3210) == a
    assert _prmt(a, b, 0x7654) == b
    assert _prmt(a, b, 0x0123) == 0x11223344
    assert _prmt(a, b, 0x8888) == 0x00000000 and _prmt(a, b, 0xFFFF) == 0xFFFFFFFF


@pytest.mark.parametrize("seed", range(4))
def test_word_codes_ptx_gives_each_nibble_under_the_exponent_of_2_pow_23(seed):
    """Output j is the float bits of 2**23 + nibble j (bits 4j..4j+3) of the input word:
    the formula the interpreter runs, in payload order."""
    rng = random.Random(seed)
    words = [0, MASK32, 0x88888888, 0x76543210, 0xFEDCBA98] + [
        rng.getrandbits(32) for _ in range(500)]
    for word in words:
        out = run_ptx(WORD_CODES_PTX, {"$8": word})
        expected = [0x4B000000 | ((word >> (4 * j)) & 0xF) for j in range(8)]
        assert [out[f"${j}"] for j in range(8)] == expected, hex(word)


def test_the_model_rejects_an_instruction_it_does_not_know():
    with pytest.raises(AssertionError, match="no model"):
        run_ptx("{ add.u32 $0, $1, 1; }", {"$1": 0})
