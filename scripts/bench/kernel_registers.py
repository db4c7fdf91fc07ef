"""Registers, spills and occupancy of every Triton kernel variant, for real GPUs, on a
machine without one.

Compiles each variant the host launches (`zeropp.kernels.compile_check`) for each
architecture and tabulates, per arch, registers a thread / spill store+load bytes /
theoretical occupancy. A markdown table goes to stdout and, with --out, to that file, with
the same data as JSON next to it (same name, .json).

    python -m scripts.bench.kernel_registers --out docs/kernel_registers.md
    python -m scripts.bench.kernel_registers --block-sizes 256 --archs sm_80
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import sys
import time
from pathlib import Path

from scripts.bench.run_lab import write_json
from zeropp.kernels import compile_check, launch_specs, triton_device
from zeropp.kernels.compile_check import KernelResources, Variant

MODULE = "scripts.bench.kernel_registers"
DEFAULT_ARCHS = ("sm_70", "sm_80", "sm_90", "sm_100")
# Past this a thread holds more than half an SM's register file at 4 warps a program
# (under 50% occupancy): [Note: kernel tiles] in zeropp/kernels/launch_specs.py.
REGISTER_BUDGET = 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-sizes", type=int, nargs="+",
                        default=list(compile_check.DEFAULT_BLOCK_SIZES))
    parser.add_argument("--even-block-sizes", type=int, nargs="*", default=[256],
                        help="block sizes whose unmasked variants (launches that fill every "
                        "tile) are listed too")
    parser.add_argument("--archs", nargs="+", choices=list(compile_check.ARCHS),
                        default=list(DEFAULT_ARCHS))
    parser.add_argument("--workers", type=int, default=2, help="compiler processes")
    parser.add_argument("--note", default=None, help="a line under the title, e.g. which "
                        "kernels these are")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the markdown here and the JSON next to it")
    args = parser.parse_args(argv)
    maximum = compile_check.triton_kernels.MAX_BLOCK_SIZE
    if any(not 1 <= size <= maximum for size in args.block_sizes):
        parser.error(f"--block-sizes must be in 1..{maximum}")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    return args


def measure(variants: list[Variant], archs: list[str], workers: int
            ) -> dict[str, list[KernelResources]]:
    """Per arch, the resources of each variant (in the variants' order)."""
    jobs = [(variant.spec, arch) for arch in archs for variant in variants]
    results = compile_check.compile_specs(jobs, workers=workers)
    return {arch: results[i * len(variants):(i + 1) * len(variants)]
            for i, arch in enumerate(archs)}


def unsupported_archs(results: dict[str, list[KernelResources]]) -> dict[str, str]:
    """Archs the toolchain refused outright, with its reason."""
    return {arch: rows[0].error for arch, rows in results.items()
            if rows and all(row.arch_unsupported for row in rows)}


def _tile(variant: Variant) -> str:
    constants = variant.spec.constants
    masks = "" if constants["MASK_VALUES"] or constants["MASK_ROWS"] else ", unmasked"
    return f"{constants['ROWS']} x {constants['COLS']} / {variant.spec.num_warps}{masks}"


def _cell(result: KernelResources) -> str:
    if result.error is not None:
        return "error"
    # Occupancy is a multiple of 1/64, so :g prints it exactly (12.5%, 56.25%, 100%).
    text = (f"{result.registers} / {result.spill_store_bytes}+{result.spill_load_bytes}"
            f" / {result.occupancy * 100:g}%")
    return f"**{text}**" if result.spill_bytes else text


def _summary(archs: list[str], results: dict[str, list[KernelResources]],
             unsupported: dict[str, str]) -> list[str]:
    lines = []
    for arch in archs:
        if arch in unsupported:
            lines.append(f"- {arch}: not compiled, the toolchain refused it ({unsupported[arch]})")
            continue
        rows = [row for row in results[arch] if row.error is None]
        if not rows:
            lines.append(f"- {arch}: nothing compiled")
            continue
        spilling = [row for row in rows if row.spill_bytes]
        over_budget = [row for row in rows if row.registers > REGISTER_BUDGET]
        worst = max(rows, key=lambda row: (row.spill_bytes, row.registers))
        line = (f"- {arch}: at most {max(row.registers for row in rows)} registers, "
                f"{len(over_budget)} of {len(rows)} over {REGISTER_BUDGET}, "
                f"{len(spilling)} spilling")
        if spilling:
            line += (f" (most: {worst.label}, ROWS x COLS {worst.constants['ROWS']} x "
                     f"{worst.constants['COLS']}, {worst.spill_store_bytes}+"
                     f"{worst.spill_load_bytes} bytes)")
        failed = len(results[arch]) - len(rows)
        lines.append(line + (f", {failed} failed to compile" if failed else ""))
    return lines


def markdown(command: str, note: str | None, variants: list[Variant], archs: list[str],
             results: dict[str, list[KernelResources]], header_facts: dict) -> str:
    unsupported = unsupported_archs(results)
    lines = ["# Triton kernels: registers, spills and occupancy", ""]
    if note:
        lines += [note, ""]
    lines += [
        f"Compiled without a GPU for each architecture by Triton {header_facts['triton']} "
        f"and assembled by its bundled ptxas ({header_facts['ptxas']}). Regenerate with "
        f"`{command}`.",
        "",
        "Each arch cell: registers a thread / spill store+load bytes / theoretical occupancy "
        "(active warps over the SM's 64, from registers, warps and shared memory). **bold**: "
        "spills. ROWS x COLS / warps is the program's tile (unmasked: the variant for "
        "launches that fill every tile); dtype `any`: the kernel only reads and writes "
        "payloads. Reductions are over 8 payloads (K = 8). sm_90 and later are compiled as "
        "sm_90a etc., as Triton does.",
        "",
        *_summary(archs, results, unsupported),
        "",
        "| kernel | dtype | bits | block | ROWS x COLS / warps | " + " | ".join(archs) + " |",
        "|---|---|---|---|---|" + "---|" * len(archs),
    ]
    for index, variant in enumerate(variants):
        cells = ["unsupported" if arch in unsupported else _cell(results[arch][index])
                 for arch in archs]
        lines.append(f"| {variant.spec.kernel} | {variant.dtype} | {variant.bits} | "
                     f"{variant.block_size} | {_tile(variant)} | " + " | ".join(cells) + " |")
    errors = [f"- {row.arch} {row.label} {row.constants}: {row.error}"
              for arch in archs if arch not in unsupported for row in results[arch] if row.error]
    if errors:
        lines += ["", "Compile errors:", "", *errors]
    return "\n".join(lines) + "\n"


def record(command: str, note: str | None, variants: list[Variant], archs: list[str],
           results: dict[str, list[KernelResources]], header_facts: dict) -> dict:
    fields = ("registers", "spill_store_bytes", "spill_load_bytes", "shared_bytes",
              "programs_per_sm", "occupancy", "ptxas", "error")
    rows = []
    for index, variant in enumerate(variants):
        rows.append({
            "kernel": variant.spec.kernel, "label": variant.spec.label, "dtype": variant.dtype,
            "bits": variant.bits, "block_size": variant.block_size,
            "constants": variant.spec.constants, "num_warps": variant.spec.num_warps,
            "archs": {arch: {field: getattr(results[arch][index], field) for field in fields}
                      for arch in archs},
        })
    return {"command": command, "note": note, **header_facts, "archs": archs,
            "unsupported_archs": unsupported_archs(results), "rows": rows}


def _header_facts() -> dict:
    import triton

    # The kernels and the tiles they are launched with: a change to either changes the table.
    kernels_source = b"".join(Path(module.__file__).read_bytes()
                              for module in (compile_check.triton_kernels, triton_device,
                                             launch_specs))
    ptxas = []
    for tool in ("ptxas", "ptxas_blackwell"):
        try:
            found = getattr(triton.knobs.nvidia, tool)
            ptxas.append(f"{Path(found.path).name} {found.version}")
        except (RuntimeError, AttributeError):
            pass
    return {"triton": triton.__version__, "ptxas": ", ".join(ptxas) or "none",
            "kernels_sha256": hashlib.sha256(kernels_source).hexdigest()[:16]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = compile_check.ptxas_missing_reason()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    command = shlex.join(["python", "-m", MODULE, *(sys.argv[1:] if argv is None else argv)])
    variants = list(compile_check.enumerate_variants(
        args.block_sizes, per_block_size=True,
        even_block_sizes=[size for size in args.even_block_sizes if size in args.block_sizes]))
    started = time.perf_counter()
    results = measure(variants, args.archs, args.workers)
    print(f"compiled {len(variants)} variants for {len(args.archs)} archs in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    facts = _header_facts()
    text = markdown(command, args.note, variants, args.archs, results, facts)
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        write_json(args.out.with_suffix(".json"),
                   record(command, args.note, variants, args.archs, results, facts))
        print(f"wrote {args.out} and {args.out.with_suffix('.json')}", file=sys.stderr)
    failed = any(row.error and not row.arch_unsupported
                 for rows in results.values() for row in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
