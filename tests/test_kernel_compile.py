"""The Triton kernels compiled for real GPUs (sm_70, sm_80, sm_90) without a GPU: no
variant spills, and at the default block size every kernel keeps >= 25% occupancy.

The interpreter tests (test_kernels.py) check results only; these check what a GPU would
run. Needs Triton with its bundled ptxas, not a GPU. Every variant is compiled once, in two
worker processes, and the results are shared by the tests (144 variants an arch: the block
size is a compile-time constant, so each block size is its own variant, and the default
one also has its unmasked variants).
"""

from __future__ import annotations

import json
import re

import pytest

from zeropp.kernels import compile_check
from zeropp.kernels.compile_check import ARCHS, REQUIRED_ARCHS, KernelResources

# The smallest block (odd: the int4 scratch path too), the default (masked and unmasked),
# and the largest (two passes). 2, 7, 64 and 2048 are in the bench table; they add compile
# time and no kernel shape these do not already cover.
SUITE_BLOCK_SIZES = (1, 256, 16384)
DEFAULT_BLOCK_SIZE = 256
# 4 warps a program move 16 bytes a thread of every code stream ([Note: kernel tiles]): the
# reductions hold 32 values a thread and every payload's codes in flight. At 128 registers
# 4 programs fit an SM (25% occupancy), with 8 payloads x 16 bytes a thread in flight.
MAX_REGISTERS_AT_DEFAULT = 128

_missing = compile_check.ptxas_missing_reason()
needs_compiler = pytest.mark.skipif(_missing is not None,
                                    reason=f"cannot compile for GPUs here: {_missing}")


def _describe(variant, result: KernelResources) -> str:
    constants = variant.spec.constants
    where = (f"{result.arch} {variant.spec.label} block {variant.block_size}"
             f" [ROWS x COLS {constants['ROWS']} x {constants['COLS']}, "
             f"{variant.spec.num_warps} warps]")
    if result.error is not None:
        return f"{where}: did not compile: {result.error.splitlines()[0]}"
    return (f"{where}: {result.registers} registers, {result.spill_store_bytes} B spill "
            f"stores, {result.spill_load_bytes} B spill loads, {result.occupancy:.1%} occupancy")


@pytest.fixture(scope="module")
def compiled():
    """(variant, KernelResources) for every suite variant on every required arch."""
    variants = list(compile_check.enumerate_variants(
        SUITE_BLOCK_SIZES, per_block_size=True, even_block_sizes=(DEFAULT_BLOCK_SIZE,)))
    jobs = [(variant.spec, arch) for variant in variants for arch in REQUIRED_ARCHS]
    results = compile_check.compile_specs(jobs, workers=2)
    pairs = [(variant, arch) for variant in variants for arch in REQUIRED_ARCHS]
    return [(variant, result) for (variant, _), result in zip(pairs, results, strict=True)]


# ---- (a) everything compiles, nothing spills ---------------------------------------------


@needs_compiler
def test_every_variant_compiles_without_spills(compiled):
    offenders = [_describe(variant, result) for variant, result in compiled
                 if result.error is not None or result.spill_bytes]
    if offenders:  # pytest.fail: one line an offender, without the list's repr
        pytest.fail(f"{len(offenders)} of {len(compiled)} kernel compiles spill or fail:\n  "
                    + "\n  ".join(offenders), pytrace=False)


def test_suite_covers_the_host_block_size_range():
    assert SUITE_BLOCK_SIZES[0] == min(compile_check.DEFAULT_BLOCK_SIZES) == 1
    assert SUITE_BLOCK_SIZES[-1] == compile_check.triton_kernels.MAX_BLOCK_SIZE
    assert DEFAULT_BLOCK_SIZE in SUITE_BLOCK_SIZES


# ---- (b) registers and occupancy at the default block size --------------------------------


@needs_compiler
def test_default_block_size_keeps_half_occupancy(compiled):
    at_default = [(variant, result) for variant, result in compiled
                  if variant.block_size == DEFAULT_BLOCK_SIZE]
    kernels = {variant.spec.kernel for variant, _ in at_default}
    assert len(kernels) == 4, kernels
    offenders = [_describe(variant, result) for variant, result in at_default
                 if result.error is not None or result.registers > MAX_REGISTERS_AT_DEFAULT
                 or result.occupancy < 0.25]
    if offenders:
        pytest.fail(
            f"{len(offenders)} of {len(at_default)} kernels at block {DEFAULT_BLOCK_SIZE} use "
            f"more than {MAX_REGISTERS_AT_DEFAULT} registers a thread (under 25% occupancy):\n  "
            + "\n  ".join(offenders), pytrace=False)


# ---- (b2) what the int4 reductions execute --------------------------------------------------


@needs_compiler
def test_int4_reductions_unpack_codes_with_one_byte_permute_a_value(compiled):
    """[Note: word sums]: the int4 reductions' GPU code is the inline PTX (one PRMT a value
    and payload), not the interpreter's formula (a shift, a zero-extension and an OR), and
    its integer instructions stay under 2.75 a value and payload (3.5 or more when codes
    were read a byte at a time)."""
    from scripts.bench.kernel_sass import by_unit

    checked = []
    for variant, result in compiled:
        constants = variant.spec.constants
        reduction = variant.spec.kernel in ("_dequantize_reduce_kernel",
                                            "dequantize_reduce_quantize_kernel")
        if not (reduction and variant.bits == 4 and variant.block_size == DEFAULT_BLOCK_SIZE
                and result.sass_opcodes is not None):
            continue
        values_and_payloads = (constants["ROWS"] * constants["COLS"] * constants["K"]
                               // (variant.spec.num_warps * 32))
        where = _describe(variant, result)
        assert result.sass_opcodes.get("PRMT", 0) >= values_and_payloads, where
        assert by_unit(result.sass_opcodes)["integer"] < 2.75 * values_and_payloads, where
        checked.append(result.arch)
    if compile_check.nvdisasm_path() is None:
        pytest.skip("Triton has no nvdisasm here")
    assert {"sm_80", "sm_90"} <= set(checked), checked  # nvdisasm reads these arches' cubins


def test_sass_opcodes_are_counted_from_the_listing():
    listing = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0140*/                   LDG.E.128 R4, desc[UR8][R8.64] ;
        /*0150*/              @!P0 PRMT R21, R5, 0x7440, R3 ;
        /*0160*/               @P1 PRMT R22, R5, 0x7441, R3 ;
        /*0170*/                   EXIT ;
    """
    assert compile_check.count_opcodes(listing) == {"LDC": 1, "LDG": 1, "PRMT": 2, "EXIT": 1}


# A kernel as nvdisasm lists it, cut down: a branch whose taken side is shorter, a call to a
# slow path on the other side, a predicated EXIT, dead code after the EXIT, and a second
# function whose instructions are not the kernel's.
PATH_LISTING = """
        .type           quantize_kernel,@function
quantize_kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   FCHK P0, R19, 7 ;
        /*0020*/              @!P0 BRA `(.L_x_1) ;
        /*0030*/                   MOV R46, 0xa00 ;
        /*0040*/                   CALL.REL.NOINC `($__internal_0_slowpath) ;
        /*0050*/                   MOV R16, R0 ;
.L_x_1:
        /*0060*/                   FMUL R2, R2, R3 ;
        /*0070*/                   ISETP.NE.AND P1, PT, R2, RZ, PT ;
        /*0080*/               @P1 BRA `(.L_x_2) ;
        /*0090*/                   FADD R2, R2, 1 ;
        /*00a0*/                   FADD R2, R2, 1 ;
        /*00b0*/                   FADD R2, R2, 1 ;
        /*00c0*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*00d0*/                   FADD R2, R2, 2 ;
.L_x_3:
        /*00e0*/               @P0 EXIT ;
        /*00f0*/                   STG.E desc[UR16][R4.64], R3 ;
        /*0100*/                   EXIT ;
        /*0110*/                   FADD R9, R9, R9 ;
        .type           $__internal_0_slowpath,@function
$__internal_0_slowpath:
        /*0120*/                   FFMA R0, R1, R2, R3 ;
        /*0130*/                   RET.REL.NODEC R46 `(quantize_kernel) ;
"""


def test_the_run_path_takes_each_branchs_shorter_side():
    """path_opcodes: LDC, FCHK, the branch over the call, FMUL, ISETP, the branch to the
    one-FADD side, the predicated EXIT (other threads go on), STG and the EXIT: 10
    instructions, no call, no FFMA of the slow path's function, nothing after the EXIT."""
    assert compile_check.path_opcodes(PATH_LISTING) == {
        "LDC": 1, "FCHK": 1, "BRA": 2, "FMUL": 1, "ISETP": 1, "FADD": 1, "EXIT": 2, "STG": 1}
    # ptxas writes some branches as a predicated call to a label of the kernel
    as_call = PATH_LISTING.replace("@P1 BRA `(.L_x_2)", "@P1 CALL.REL.NOINC `(.L_x_2)")
    assert compile_check.path_opcodes(as_call) == {
        "LDC": 1, "FCHK": 1, "BRA": 1, "CALL": 1, "FMUL": 1, "ISETP": 1, "FADD": 1,
        "EXIT": 2, "STG": 1}
    # the listing's counts take every instruction, the other function's included
    counts = compile_check.count_opcodes(PATH_LISTING)
    assert sum(counts.values()) == 20 and counts["FADD"] == 5 and counts["FFMA"] == 1
    without_exit = PATH_LISTING.replace("EXIT", "NOP")
    assert compile_check.path_opcodes(without_exit) is None


@needs_compiler
def test_a_cubin_nvdisasm_cannot_read_has_no_counts_and_no_error():
    assert compile_check.sass_opcodes(b"not a cubin") is None


@needs_compiler
def test_kernel_sass_script_reports_each_section_b_kernel(tmp_path, capsys):
    import json

    from scripts.bench import kernel_sass

    assert kernel_sass.main(["--arch", "sm_90", "--json", str(tmp_path / "sass.json")]) == 0
    rows = json.loads((tmp_path / "sass.json").read_text())["rows"]
    assert [row["kernel"] for row in rows] == [k.name for k in kernel_sass.kernels(8)]
    for row in rows:
        assert row["instructions_run"] == sum(row["opcodes_run"].values()) == sum(
            row["by_unit"].values())
        assert row["instructions_listed"] == sum(row["opcodes_listed"].values())
        assert 0 < row["instructions_run"] <= row["instructions_listed"]
        assert "CALL" not in row["opcodes_run"]
        if row["label"].startswith(("quantize", "dequantize-reduce-quantize")):
            # these divide once a row (1 / scale) and choose a row formula per program:
            # the division's slow path and the full formula are listed, not run
            assert "CALL" in row["opcodes_listed"]
            assert row["instructions_run"] < 0.85 * row["instructions_listed"]
        assert row["registers"] > 0
    printed = capsys.readouterr().out
    assert all(row["kernel"] in printed for row in rows)
    with pytest.raises(SystemExit):  # one line from argparse, nothing compiled
        kernel_sass.main(["--block-size", "0"])
    assert "--block-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # 17 payloads leave a loop the path would count once
        kernel_sass.main(["--payloads", "17"])
    assert "--payloads must be in 1..16" in capsys.readouterr().err


# ---- (c) ptxas parsing and occupancy arithmetic --------------------------------------------

PTXAS_SPILLING = """\
ptxas info    : 11 bytes gmem, 8 bytes cmem[4]
ptxas info    : Compiling entry function 'quantize_kernel' for 'sm_70'
ptxas info    : Function properties for quantize_kernel
    96 bytes stack frame, 96 bytes spill stores, 104 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 2048 bytes smem, 440 bytes cmem[0]
ptxas info    : Compile time = 25.943 ms
"""

PTXAS_CLEAN = """\
ptxas-blackwell info    : 11 bytes gmem
ptxas-blackwell info    : Compiling entry function 'dequantize_kernel' for 'sm_90a'
ptxas-blackwell info    : Function properties for dequantize_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas-blackwell info    : Used 40 registers, used 1 barriers
"""


def test_parse_ptxas_output():
    assert compile_check.parse_ptxas_output(PTXAS_SPILLING) == (128, 96, 104, 2048)
    assert compile_check.parse_ptxas_output(PTXAS_CLEAN) == (40, 0, 0, 0)
    with pytest.raises(ValueError, match="no register"):
        compile_check.parse_ptxas_output("ptxas fatal   : Unsupported .version 9.4")


@pytest.mark.parametrize(
    "arch, registers, threads, shared, programs, occupancy",
    [
        ("sm_70", 255, 128, 0, 2, 0.125),  # 8192 registers a warp: 8 warps an SM
        ("sm_70", 64, 128, 0, 8, 0.5),
        ("sm_90", 32, 128, 0, 16, 1.0),
        ("sm_80", 65, 128, 0, 7, 0.4375),  # 2080 registers a warp round up to 2304
        ("sm_70", 96, 128, 0, 5, 0.3125),  # 3072 registers a warp: 20 warps
        ("sm_70", 96, 32, 0, 20, 0.3125),  # 5 warps a sub-partition, not 65536 // 3072 = 21
        ("sm_70", 128, 512, 0, 1, 0.25),
        ("sm_80", 16, 32, 0, 32, 0.5),  # 32 programs an SM at most
        ("sm_70", 32, 128, 48 * 1024, 2, 0.125),  # 96 KiB of shared memory
        ("sm_80", 32, 128, 48 * 1024, 3, 0.1875),  # 164 KiB, 1 KiB reserved a program
        ("sm_70", 255, 1024, 0, 0, 0.0),  # a program that cannot launch at all
    ],
)
def test_occupancy_arithmetic(arch, registers, threads, shared, programs, occupancy):
    limits = ARCHS[arch]
    assert compile_check.programs_per_sm(registers, threads, shared, limits) == programs
    assert compile_check.occupancy(registers, threads, shared, limits) == pytest.approx(occupancy)


# ---- (d) the bench's table and JSON ----------------------------------------------------------


@needs_compiler
def test_bench_table_and_json(tmp_path, capsys):
    from scripts.bench import kernel_registers

    out = tmp_path / "registers.md"
    code = kernel_registers.main(["--block-sizes", "256", "--archs", "sm_80",
                                  "--out", str(out)])
    assert code == 0
    text = out.read_text()
    assert text == capsys.readouterr().out
    assert "python -m scripts.bench.kernel_registers --block-sizes 256 --archs sm_80" in text
    lines = text.splitlines()
    header = lines.index("| kernel | dtype | bits | block | ROWS x COLS / warps | sm_80 |")
    rows = [line for line in lines[header + 2:] if line.startswith("|")]
    variants = list(compile_check.enumerate_variants([256], per_block_size=True,
                                                     even_block_sizes=[256]))
    # Per width (8, 4, 2): quantize and dequantize per dtype (3 + 3), the reduction into
    # fp32 and into each 16-bit dtype (1 + 2), and the requantization to each width (3);
    # masked and unmasked.
    assert len(rows) == len(variants) == 2 * 3 * (3 + 3 + 1 + 2 + 3)
    for row, variant in zip(rows, variants, strict=True):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[:4] == [variant.spec.kernel, variant.dtype, str(variant.bits), "256"]
        unmasked = not (variant.spec.constants["MASK_ROWS"] or variant.spec.constants["MASK_VALUES"])
        assert re.fullmatch(r"\d+ x \d+ / \d+" + (", unmasked" if unmasked else ""), cells[4])
        assert re.fullmatch(r"(\*\*)?\d+ / \d+\+\d+ / [\d.]+%(\*\*)?", cells[5]), cells[5]

    record = json.loads(out.with_suffix(".json").read_text())
    assert record["archs"] == ["sm_80"] and record["unsupported_archs"] == {}
    assert record["triton"] and record["command"].startswith("python -m ")
    assert len(record["rows"]) == len(variants)
    first = record["rows"][0]
    assert {"kernel", "dtype", "bits", "block_size", "constants", "num_warps"} <= set(first)
    assert isinstance(first["archs"]["sm_80"]["registers"], int)
    assert 0 < first["archs"]["sm_80"]["occupancy"] <= 1


def test_bench_marks_an_unsupported_arch():
    from scripts.bench import kernel_registers
    from zeropp.kernels.triton_kernels import LaunchSpec

    spec = LaunchSpec("quantize_kernel", {"x_ptr": "*fp32"},
                      {"ROWS": 4, "COLS": 256, "MASK_ROWS": True, "MASK_VALUES": True}, 4, "q")
    variant = compile_check.Variant("fp32", 8, 256, spec)
    done = KernelResources("sm_90", spec.kernel, "q", spec.constants, 4, registers=40,
                           spill_store_bytes=8, spill_load_bytes=8, shared_bytes=0,
                           programs_per_sm=12, occupancy=0.75)
    refused = KernelResources("sm_100", spec.kernel, "q", spec.constants, 4,
                              error="no ptxas takes sm_100a", arch_unsupported=True)
    results = {"sm_90": [done], "sm_100": [refused]}
    facts = {"triton": "x", "ptxas": "y", "kernels_sha256": "z"}
    text = kernel_registers.markdown("cmd", None, [variant], ["sm_90", "sm_100"], results, facts)
    assert "| quantize_kernel | fp32 | 8 | 256 | 4 x 256 / 4 | **40 / 8+8 / 75%** | unsupported |" \
        in text
    assert "- sm_100: not compiled, the toolchain refused it (no ptxas takes sm_100a)" in text
    record = kernel_registers.record("cmd", None, [variant], ["sm_90", "sm_100"], results, facts)
    assert record["unsupported_archs"] == {"sm_100": "no ptxas takes sm_100a"}
