"""Compile the Triton quantization kernels for real GPUs without a GPU, and read what
ptxas gives them: registers a thread, spill bytes, shared memory, theoretical occupancy.

Why: without a GPU the kernels only ever run under Triton's CPU interpreter, which checks
their results and says nothing about registers or spills: a kernel can pass every
interpreter test and need 255 registers a thread and spill on sm_70. Triton's compiler
needs a target, not a GPU, so this compiles exactly the variants the host launches
(`triton_kernels.launch_specs`) for a chosen compute capability and assembles the PTX with
Triton's bundled ptxas.

Why ptxas is run here: a CompiledKernel's `n_regs` and `n_spills` are filled in by the
CUDA driver when the kernel is loaded, so they stay unset without a GPU, and Triton runs
`ptxas -v` itself but throws the log away (and skips ptxas on a disk-cache hit). The flags
mirror Triton's own (`--fmad=false` for enable_fp_fusion=False, `--regAllocOptLevel=2`)
so the counts are those of the cubin that would run.

Compiles run in spawned worker processes: under TRITON_INTERPRET=1 (the test suite) every
`@triton.jit` function is an interpreter object that cannot be compiled, and the switch
is read when a kernel is decorated, so only a fresh process without it can compile.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from zeropp.kernels import triton_kernels
from zeropp.kernels.triton_kernels import LaunchSpec


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM limits of one architecture (CUDA programming guide, compute capabilities)."""

    name: str  # "sm_80"
    capability: int
    shared_bytes_per_sm: int
    reserved_shared_per_program: int  # the CUDA runtime keeps 1 KiB a block from sm_80 on
    registers_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_programs_per_sm: int = 32
    # Registers go to a warp in units of 256, and each warp lives on one of the SM's four
    # sub-partitions (a quarter of the register file each).
    register_unit: int = 256
    subpartitions: int = 4


ARCHS = {
    "sm_70": ArchLimits("sm_70", 70, 96 * 1024, 0),
    "sm_80": ArchLimits("sm_80", 80, 164 * 1024, 1024),
    "sm_90": ArchLimits("sm_90", 90, 228 * 1024, 1024),
    "sm_100": ArchLimits("sm_100", 100, 228 * 1024, 1024),
}
REQUIRED_ARCHS = ("sm_70", "sm_80", "sm_90")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BITS = (8, 4, 2)
# The smallest block the host accepts, odd blocks (int4/int2 pack them on the host), powers
# of two up to the largest block a tile takes.
DEFAULT_BLOCK_SIZES = (1, 2, 7, 64, 256, 2048, triton_kernels.MAX_BLOCK_SIZE)


class PtxasReport(NamedTuple):
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    static_shared_bytes: int


@dataclass(frozen=True)
class KernelResources:
    """What one kernel variant costs on one architecture; `error` is set instead of the
    numbers when it did not compile (`arch_unsupported` when the toolchain refused the arch)."""

    arch: str
    kernel: str
    label: str
    constants: dict
    num_warps: int
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    shared_bytes: int | None = None
    programs_per_sm: int | None = None
    occupancy: float | None = None  # active warps / the SM's maximum
    ptxas: str | None = None
    # SASS instructions of the kernel by opcode (static counts, as nvdisasm lists them;
    # None without nvdisasm): what a program executes when it takes every path once.
    sass_opcodes: dict[str, int] | None = None
    # Those on its shortest path to an EXIT (`path_opcodes`): what a program of ordinary
    # values runs.
    sass_path_opcodes: dict[str, int] | None = None
    error: str | None = None
    arch_unsupported: bool = False

    @property
    def spill_bytes(self) -> int:
        return (self.spill_store_bytes or 0) + (self.spill_load_bytes or 0)

    @property
    def sass_instructions(self) -> int | None:
        return None if self.sass_opcodes is None else sum(self.sass_opcodes.values())

    @property
    def sass_path_instructions(self) -> int | None:
        return None if self.sass_path_opcodes is None else sum(self.sass_path_opcodes.values())


class UnsupportedArchError(RuntimeError):
    """No bundled ptxas takes this architecture (or this PTX version for it)."""


class Variant(NamedTuple):
    dtype: str  # "fp32" | "fp16" | "bf16", or "any" for kernels that never see the dtype
    bits: int
    block_size: int
    spec: LaunchSpec


def spec_key(spec: LaunchSpec) -> tuple:
    """What makes two specs the same compiled kernel (the label does not)."""
    return (spec.kernel, tuple(spec.signature.items()), tuple(sorted(spec.constants.items())),
            spec.num_warps)


def enumerate_variants(block_sizes: Iterable[int] = DEFAULT_BLOCK_SIZES,
                       per_block_size: bool = False,
                       even_block_sizes: Iterable[int] = ()) -> Iterator[Variant]:
    """Every distinct kernel variant the host launches at these block sizes (the masked
    variants; at `even_block_sizes` also the unmasked ones that launches filling every
    tile take), ordered by kernel, bits, dtype, block size. A variant is listed once, at
    the first block size and dtype that launches it: "any" when every dtype does (the qgZ
    kernels), unless `per_block_size` lists it again at each block size (for tables;
    compiles are cached). The block size is a compile-time constant: every block size is
    its own variant."""
    first_seen: dict[tuple, Variant] = {}
    dtypes_seen: dict[tuple, set[str]] = {}
    position: dict[str, int] = {}  # kernel -> its place in launch_specs' list
    even_block_sizes = set(even_block_sizes)
    runs = [(block_size, False) for block_size in block_sizes]
    runs += [(block_size, True) for block_size in block_sizes if block_size in even_block_sizes]
    for block_size, even in runs:
        for bits in BITS:
            for dtype_name, dtype in DTYPES.items():
                for index, spec in enumerate(triton_kernels.launch_specs(block_size, bits, dtype,
                                                                         even=even)):
                    position.setdefault(spec.kernel, index)
                    key = spec_key(spec) + ((block_size, even) if per_block_size else ())
                    first_seen.setdefault(key, Variant(dtype_name, bits, block_size, spec))
                    dtypes_seen.setdefault(key, set()).add(dtype_name)
    variants = [variant._replace(dtype="any") if len(dtypes_seen[key]) == len(DTYPES) else variant
                for key, variant in first_seen.items()]
    dtype_rank = {"any": -1, **{name: rank for rank, name in enumerate(DTYPES)}}
    yield from sorted(variants, key=lambda v: (position[v.spec.kernel], -v.bits,
                                               dtype_rank[v.dtype], v.block_size))


# ---- ptxas ----------------------------------------------------------------------------------

_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SHARED = re.compile(r"(\d+) bytes smem")
_REFUSED = ("Unsupported .version", "is not defined for option 'gpu-name'", "Unknown option")
_PTXAS_FLAGS = ("-v", "--fmad=false", "--regAllocOptLevel=2")


def parse_ptxas_output(text: str) -> PtxasReport:
    """The counts in `ptxas -v` output for a PTX file with one kernel."""
    registers = _REGISTERS.search(text)
    spills = _SPILLS.search(text)
    if registers is None or spills is None:
        raise ValueError(f"no register or spill counts in ptxas output:\n{text}")
    shared = _SHARED.search(text)
    return PtxasReport(int(registers.group(1)), int(spills.group(1)), int(spills.group(2)),
                       int(shared.group(1)) if shared else 0)


def _ptxas_candidates() -> list[str]:
    """Triton's plain ptxas first (it refuses PTX newer than its CUDA), then the newer
    ptxas-blackwell, which Triton itself uses from sm_90 on."""
    import triton

    paths = []
    for tool in ("ptxas", "ptxas_blackwell"):
        try:
            paths.append(getattr(triton.knobs.nvidia, tool).path)
        except (RuntimeError, AttributeError):
            pass
    return paths


def ptxas_missing_reason() -> str | None:
    """Why nothing can be compiled here, or None."""
    if not triton_kernels.is_available():
        return "triton is not installed"
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        return "triton has no nvidia backend"
    if not _ptxas_candidates():
        return "neither ptxas nor ptxas-blackwell was found in triton's nvidia backend"
    return None


def _assemble(ptx: str, arch: ArchLimits) -> tuple[bytes, str, str]:
    """Assemble `ptx` with the first ptxas that takes it: the cubin, the `-v` log and that
    ptxas' name."""
    gpu_name = f"sm_{arch.capability}" + ("a" if arch.capability >= 90 else "")  # as Triton
    refusals = []
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        cubin = os.path.join(folder, "kernel.cubin")
        with open(source, "w") as handle:
            handle.write(ptx)
        for ptxas in _ptxas_candidates():
            done = subprocess.run([ptxas, *_PTXAS_FLAGS, f"--gpu-name={gpu_name}", source,
                                   "-o", cubin], capture_output=True, text=True)
            log = done.stdout + done.stderr
            if done.returncode == 0:
                with open(cubin, "rb") as handle:
                    return handle.read(), log, os.path.basename(ptxas)
            if not any(marker in log for marker in _REFUSED):
                raise RuntimeError(f"{os.path.basename(ptxas)} failed for {gpu_name}:\n{log}")
            refusals.append(f"{os.path.basename(ptxas)}: {log.strip().splitlines()[-1]}")
    raise UnsupportedArchError(f"no ptxas takes {gpu_name}: " + "; ".join(refusals))


# An instruction line of nvdisasm's listing, "/*0140*/  @!P0 LDG.E.128 R4, desc[UR8][R8.64] ;",
# as its predicate, opcode (the mnemonic before its first '.') and operands; a label; a
# function's start; a branch target.
_SASS_INSTRUCTION = re.compile(
    r"^[ \t]+/\*[0-9a-f]{4,}\*/[ \t]+(?:(@!?U?P[T0-9]+)[ \t]+)?([A-Z][A-Z0-9_]*)\S*[ \t]*(.*)$",
    re.MULTILINE)
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):\s*$")
_SASS_FUNCTION = re.compile(r"^\s+\.type\s+\S+,@function")
_SASS_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def nvdisasm_path() -> str | None:
    """Triton's bundled nvdisasm, or None."""
    import triton

    try:
        return triton.knobs.nvidia.nvdisasm.path
    except (RuntimeError, AttributeError):
        return None


def disassemble(cubin: bytes) -> str | None:
    """nvdisasm's listing of a cubin; None when there is no nvdisasm or it cannot read the
    cubin (CUDA 12.9's refuses sm_70's)."""
    nvdisasm = nvdisasm_path()
    if nvdisasm is None:
        return None
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        try:
            done = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.SubprocessError):  # the counts are optional
            return None
    return done.stdout if done.returncode == 0 else None


def count_opcodes(listing: str) -> dict[str, int]:
    """Instructions of an nvdisasm listing by opcode (the mnemonic before its first '.')."""
    counts: dict[str, int] = {}
    for _, opcode, _ in _SASS_INSTRUCTION.findall(listing):
        counts[opcode] = counts.get(opcode, 0) + 1
    return counts


def sass_opcodes(cubin: bytes) -> dict[str, int] | None:
    listing = disassemble(cubin)
    return None if listing is None else count_opcodes(listing)


def path_opcodes(listing: str) -> dict[str, int] | None:
    """Opcodes on the shortest way through the listing's first function (the kernel) from
    its first instruction to its last EXIT, by opcode: what a program runs when each branch
    that its data decides takes its shorter side. In these kernels that is the plain rows'
    path ([Note: plain rows]) and the divisions' fast path, so it is what a program of
    ordinary values runs. A predicated EXIT ends some threads, not the path (the others go
    on: the scales' store). A call to a function counts as one instruction; one to a label
    of the kernel (ptxas makes some branches so) is a branch. A loop's body counts once or
    not at all (its exit test may come first), so only a kernel without loops is counted
    right: blocks that one tile holds and at most 16 payloads. None when the listing
    reaches no EXIT."""
    instructions: list[tuple[str | None, str, str]] = []  # (predicate, opcode, operands)
    labels: dict[str, int] = {}
    functions = 0
    for line in listing.splitlines():
        if _SASS_FUNCTION.match(line):
            functions += 1
            if functions > 1:
                break
        elif (label := _SASS_LABEL.match(line)) is not None:
            labels[label.group(1)] = len(instructions)
        elif (found := _SASS_INSTRUCTION.match(line)) is not None:
            instructions.append(found.groups())
    # Breadth first: every instruction costs one, so the first EXIT reached is the nearest.
    parent: dict[int, int | None] = {0: None} if instructions else {}
    frontier = list(parent)
    while frontier:
        following = []
        for index in frontier:
            predicate, opcode, operands = instructions[index]
            always = predicate in (None, "@PT")
            if opcode == "EXIT" and always:
                path: dict[str, int] = {}
                at: int | None = index
                while at is not None:
                    path[instructions[at][1]] = path.get(instructions[at][1], 0) + 1
                    at = parent[at]
                return path
            targets = []
            if (opcode in ("BRA", "CALL")
                    and (target := _SASS_TARGET.search(operands)) is not None
                    and target.group(1) in labels):  # a branch, or a call used as one
                targets.append(labels[target.group(1)])
            if not (always and opcode in ("BRA", "RET", "EXIT")):
                targets.append(index + 1)
            for target in targets:
                if target < len(instructions) and target not in parent:
                    parent[target] = index
                    following.append(target)
        frontier = following
    return None


def run_ptxas(ptx: str, arch: ArchLimits) -> tuple[PtxasReport, str]:
    """Assemble `ptx` with the first ptxas that takes it; the report and that ptxas' name."""
    _, log, ptxas = _assemble(ptx, arch)
    return parse_ptxas_output(log), ptxas


# ---- occupancy ------------------------------------------------------------------------------


def programs_per_sm(registers: int, threads: int, shared_bytes: int, arch: ArchLimits) -> int:
    """How many programs (CUDA blocks) of this shape fit on one SM at once."""
    warps = -(-threads // 32)
    unit = arch.register_unit
    registers_per_warp = -(-max(registers, 1) * 32 // unit) * unit
    warps_by_registers = (arch.subpartitions
                          * (arch.registers_per_sm // arch.subpartitions // registers_per_warp))
    limits = [warps_by_registers // warps, arch.max_warps_per_sm // warps,
              arch.max_programs_per_sm]
    shared_per_program = shared_bytes + arch.reserved_shared_per_program
    if shared_per_program:
        limits.append(arch.shared_bytes_per_sm // shared_per_program)
    return max(0, min(limits))


def occupancy(registers: int, threads: int, shared_bytes: int, arch: ArchLimits) -> float:
    """Theoretical occupancy: active warps on an SM over the most it can hold."""
    warps = -(-threads // 32)
    return programs_per_sm(registers, threads, shared_bytes, arch) * warps / arch.max_warps_per_sm


# ---- compiling ------------------------------------------------------------------------------


# [Note: one ptxas a variant] Triton's last stage assembles the PTX into a cubin with its
# own `ptxas -v` and drops the log, and ptxas is a third of a variant's compile. So while this
# module compiles, that stage runs our ptxas command instead (its cubin is what Triton
# keeps), and the log goes into the kernel's metadata, with the SASS opcode counts of the
# cubin (nvdisasm), all of them and those on its shortest path (`path_opcodes`). Triton's
# disk cache then holds them with the kernel: a cache hit reads the counts without running
# ptxas or nvdisasm at all. The stage key names the commands, so these entries are never
# those of a kernel compiled to launch, and holds this module's hash, so a change to how
# the log is read or the SASS counted is never answered from entries made before it.
_STAGE_KEY = ("zeropp-compile-check-ptxas+nvdisasm:" + " ".join(_PTXAS_FLAGS) + ":"
              + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16])


@contextmanager
def _ptxas_as_the_cubin_stage(arch: ArchLimits) -> Iterator[None]:
    from triton import knobs

    def hook(backend=None, stages=None, options=None, language=None, capability=None):
        if stages is None:  # asked for the key the stages add to the cache key
            return _STAGE_KEY, hashlib.sha256(_STAGE_KEY.encode()).hexdigest()
        stages["cubin"] = assemble_and_log

    def assemble_and_log(ptx: str, metadata: dict) -> bytes:
        cubin, metadata["ptxas_log"], metadata["ptxas_name"] = _assemble(ptx, arch)
        listing = disassemble(cubin)  # its counts are kept with the log, as it is
        metadata["sass_opcodes"] = None if listing is None else count_opcodes(listing)
        metadata["sass_path_opcodes"] = None if listing is None else path_opcodes(listing)
        return cubin

    saved = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = saved


def _compile_here(spec: LaunchSpec, arch_name: str) -> KernelResources:
    """Compile in this process (which must not be interpreting Triton)."""
    import triton
    from triton.backends.compiler import GPUTarget

    arch = ARCHS[arch_name]
    fn = triton_kernels.kernel_function(spec)
    unknown = (set(spec.signature) | set(spec.constants)) - set(fn.arg_names)
    if unknown:
        raise ValueError(f"{spec.kernel} has no arguments {sorted(unknown)}")
    # ASTSource wants every argument in order, constexprs typed "constexpr" (a KeyError
    # here is an argument the spec forgot).
    signature = {name: "constexpr" if name in spec.constants else spec.signature[name]
                 for name in fn.arg_names}
    # As a launch with 16-byte aligned tensors and sizes that are multiples of 16 (the
    # engine's case) specializes it: every runtime argument divisible by 16.
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in spec.signature}
    source = triton.compiler.ASTSource(fn, signature=signature, constexprs=spec.constants,
                                       attrs=attrs)
    with _ptxas_as_the_cubin_stage(arch):
        compiled = triton.compile(source, target=GPUTarget("cuda", arch.capability, 32),
                                  options={"num_warps": spec.num_warps, "enable_fp_fusion": False})
    report = parse_ptxas_output(compiled.metadata.ptxas_log)
    ptxas = compiled.metadata.ptxas_name
    # Triton's shared memory is dynamic (metadata.shared); ptxas counts only static smem.
    shared = compiled.metadata.shared + report.static_shared_bytes
    threads = spec.num_warps * 32
    return KernelResources(
        arch=arch_name, kernel=spec.kernel, label=spec.label, constants=dict(spec.constants),
        num_warps=spec.num_warps, registers=report.registers,
        spill_store_bytes=report.spill_store_bytes, spill_load_bytes=report.spill_load_bytes,
        shared_bytes=shared, ptxas=ptxas, sass_opcodes=compiled.metadata.sass_opcodes,
        sass_path_opcodes=compiled.metadata.sass_path_opcodes,
        programs_per_sm=programs_per_sm(report.registers, threads, shared, arch),
        occupancy=occupancy(report.registers, threads, shared, arch))


def _compile_job(spec: LaunchSpec, arch_name: str) -> KernelResources:
    """Worker entry point: a failure becomes a result, so one bad variant is reported with
    the others instead of ending the run."""
    try:
        return _compile_here(spec, arch_name)
    except Exception as error:  # noqa: BLE001 - reported per variant
        message = str(error) if isinstance(error, UnsupportedArchError) else \
            f"{type(error).__name__}: {error}".strip()[:2000]
        return KernelResources(arch=arch_name, kernel=spec.kernel, label=spec.label,
                               constants=dict(spec.constants), num_warps=spec.num_warps,
                               error=message,
                               arch_unsupported=isinstance(error, UnsupportedArchError))


@contextmanager
def _without_interpreter() -> Iterator[None]:
    """Workers inherit the environment when they start, so they start without the switch."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


_cache: dict[tuple, KernelResources] = {}


def compile_specs(jobs: Iterable[tuple[LaunchSpec, str]], workers: int = 2
                  ) -> list[KernelResources]:
    """KernelResources of each (spec, arch name), in order; cached for the process.

    Workers are spawned, not forked (a forked child would inherit the interpreter's
    kernels), so a script that calls this needs the `if __name__ == "__main__":` guard."""
    jobs = list(jobs)
    for _, arch_name in jobs:
        if arch_name not in ARCHS:
            raise ValueError(f"unknown arch {arch_name!r}; known: {', '.join(ARCHS)}")
    keys = [spec_key(spec) + (arch_name,) for spec, arch_name in jobs]
    todo = {key: job for key, job in zip(keys, jobs, strict=True) if key not in _cache}
    if todo:
        with _without_interpreter(), ProcessPoolExecutor(
                max(1, min(workers, len(todo))), mp_context=multiprocessing.get_context("spawn")
        ) as pool:
            specs, archs = zip(*todo.values(), strict=True)
            _cache.update(zip(todo, pool.map(_compile_job, specs, archs), strict=True))
    return [replace(_cache[key], label=spec.label)
            for key, (spec, _) in zip(keys, jobs, strict=True)]


def compile_spec(spec: LaunchSpec, arch_name: str) -> KernelResources:
    """KernelResources of one spec on one arch (see compile_specs)."""
    return compile_specs([(spec, arch_name)], workers=1)[0]
