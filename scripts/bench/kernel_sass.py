"""Instructions a program of each Triton kernel executes, in the SASS a real GPU would run,
on a machine without one.

The kernels that the GPU check's section b times (`scripts/gpu_check/kernels.py`), at one
block size, as launched on tensors that fill every program (unmasked), are compiled for
one architecture (`zeropp.kernels.compile_check`, Triton's bundled ptxas) and listed with
Triton's bundled nvdisasm. Per kernel: the instructions a program runs (those on the
listing's shortest path to an EXIT: the plain rows' path and the divisions' fast path,
what ordinary values take; `compile_check.path_opcodes`), the listing's size (every path
once), values the program handles, instructions run a value (a value and payload for the
reductions), and those run by the unit that runs them. A kernel bound by its
instructions, not by memory, gets faster by the ratio of two such counts; only a GPU says
which kernels are so bound (section b).

    python -m scripts.bench.kernel_sass                      # sm_90, block 256, 8 payloads
    python -m scripts.bench.kernel_sass --arch sm_80 --json counts.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from scripts.bench.run_lab import write_json
from zeropp.kernels import compile_check, launch_specs

MODULE = "scripts.bench.kernel_sass"
# The largest block every listed kernel holds in one tile (int8 quantize: 2048 values).
MAX_SINGLE_PASS_BLOCK = launch_specs.tile_config(1 << 20, 8).cols
# Beyond two unrolled groups of payloads the reductions keep a loop (sm_90 SASS, K = 17).
MAX_PAYLOADS = 16

# Opcodes by the unit that issues them (Hopper and Ampere SMs): the 32-bit float pipe, the
# integer pipe (logic, shifts, byte permutes, compares), memory and the rest.
FLOAT_OPCODES = frozenset({"FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK", "HFMA2",
                           "HADD2", "HMUL2", "F2F", "F2FP", "FRND"})
INTEGER_OPCODES = frozenset({"LOP3", "SHF", "PRMT", "SGXT", "IADD3", "IMAD", "LEA", "SEL",
                             "ISETP", "IABS", "IMNMX", "VIADD", "VIMNMX", "BMSK", "FLO",
                             "POPC", "I2F", "F2I", "MOV", "PLOP3", "LOP"})
MEMORY_OPCODES = frozenset({"LDG", "STG", "LDS", "STS", "LDSM", "STSM", "SHFL", "LDC",
                            "REDUX", "ATOMS", "ATOMG", "RED"})


class Kernel(NamedTuple):
    name: str  # as section b names it
    label: str  # the launch spec's label
    bits: int  # the payload's code width
    payloads: int  # the reductions' K; 1 otherwise


def kernels(payloads: int) -> list[Kernel]:
    return [
        Kernel("quantize bf16 -> int8 (qwZ)", "quantize bf16 -> int8", 8, 1),
        Kernel("quantize bf16 -> int4 (qgZ)", "quantize bf16 -> int4", 4, 1),
        Kernel("dequantize int8 -> bf16", "dequantize int8 -> bf16", 8, 1),
        Kernel(f"dequantize_reduce {payloads} x int4 -> fp32 (qgZ hop 2)",
               f"dequantize-reduce {payloads} x int4 -> fp32", 4, payloads),
        Kernel(f"dequantize_reduce {payloads} x int4 -> bf16",
               f"dequantize-reduce {payloads} x int4 -> bf16", 4, payloads),
        Kernel(f"dequantize_reduce_quantize {payloads} x int4 -> int4 (qgZ hop 1)",
               f"dequantize-reduce-quantize {payloads} x int4 -> int4", 4, payloads),
    ]


def spec_for(kernel: Kernel, block_size: int) -> launch_specs.LaunchSpec:
    specs = launch_specs.launch_specs(block_size, kernel.bits, torch.bfloat16,
                                      payloads=kernel.payloads, even=True)
    found = [spec for spec in specs if spec.label == kernel.label]
    if not found:
        raise ValueError(f"no launch spec labelled {kernel.label!r} at block {block_size}")
    return found[0]


def by_unit(opcodes: dict[str, int]) -> dict[str, int]:
    units = {"float": 0, "integer": 0, "memory": 0, "other": 0}
    for opcode, count in opcodes.items():
        unit = ("float" if opcode in FLOAT_OPCODES else "integer" if opcode in INTEGER_OPCODES
                else "memory" if opcode in MEMORY_OPCODES else "other")
        units[unit] += count
    return units


def measure(arch: str, block_size: int, payloads: int, workers: int = 2) -> list[dict]:
    chosen = kernels(payloads)
    specs = [spec_for(kernel, block_size) for kernel in chosen]
    results = compile_check.compile_specs([(spec, arch) for spec in specs], workers=workers)
    rows = []
    for kernel, spec, result in zip(chosen, specs, results, strict=True):
        if result.error is not None:
            raise RuntimeError(f"{kernel.name} did not compile for {arch}: {result.error}")
        if result.sass_opcodes is None:
            raise RuntimeError(f"no SASS to count: Triton's nvdisasm is missing or cannot "
                               f"read {arch} cubins")
        if result.sass_path_opcodes is None:
            raise RuntimeError(f"{kernel.name}: no way to an EXIT found in its {arch} SASS")
        values = spec.constants["ROWS"] * spec.constants["COLS"]
        threads = spec.num_warps * 32
        run = result.sass_path_instructions
        rows.append({
            "kernel": kernel.name, "label": kernel.label, "constants": spec.constants,
            "registers": result.registers, "occupancy": result.occupancy,
            "instructions_run": run, "instructions_listed": result.sass_instructions,
            "values_per_program": values,
            # every thread runs the path once: a value and payload costs this many
            "instructions_per_value": run * threads / (values * kernel.payloads),
            "by_unit": by_unit(result.sass_path_opcodes),
            "opcodes_run": result.sass_path_opcodes, "opcodes_listed": result.sass_opcodes,
        })
    return rows


def table(rows: list[dict], arch: str) -> str:
    lines = [f"| kernel ({arch}) | instructions a program runs | listed | values a program |"
             " run a value (and payload) | run: float / integer / memory / other |",
             "|---|---:|---:|---:|---:|---|"]
    for row in rows:
        units = row["by_unit"]
        lines.append(f"| {row['kernel']} | {row['instructions_run']} | "
                     f"{row['instructions_listed']} | {row['values_per_program']}"
                     f" | {row['instructions_per_value']:.2f} | {units['float']} / "
                     f"{units['integer']} / {units['memory']} / {units['other']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=list(compile_check.ARCHS), default="sm_90")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--payloads", type=int, default=launch_specs.DEFAULT_PAYLOADS,
                        help="the reductions' payload count K")
    parser.add_argument("--workers", type=int, default=2, help="compiler processes")
    parser.add_argument("--json", type=Path, default=None, help="also write the counts here")
    args = parser.parse_args(argv)
    # A power of two that one tile holds whole: every program then handles ROWS x COLS
    # values in one pass, so a listing's count is a program's.
    if not (1 <= args.block_size <= MAX_SINGLE_PASS_BLOCK
            and args.block_size & (args.block_size - 1) == 0):
        parser.error(f"--block-size must be a power of two in 1..{MAX_SINGLE_PASS_BLOCK} (a "
                     "larger or padded block is walked in a loop its listing counts once)")
    if not 1 <= args.payloads <= MAX_PAYLOADS:
        parser.error(f"--payloads must be in 1..{MAX_PAYLOADS} (more leaves a loop over groups "
                     "of payloads in the code, whose body the count would take once)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = compile_check.ptxas_missing_reason()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    try:
        rows = measure(args.arch, args.block_size, args.payloads, args.workers)
    except (RuntimeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(table(rows, args.arch), end="")
    if args.json is not None:
        write_json(args.json, {"arch": args.arch, "block_size": args.block_size,
                               "payloads": args.payloads, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
