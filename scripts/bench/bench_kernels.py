"""Micro-benchmark of the ZeRO++ quantization kernels.

Measures quantize and dequantize throughput as GB/s of the fp32/fp16/bf16 tensor that is
quantized (or produced): input bytes divided by the median wall time. The torch reference
runs on CPU (and on CUDA when present); on CUDA the Triton kernels run too. Every row also
carries the device's copy bandwidth measured the same way (`x.clone()`, bytes of x per
second) and the ratio to it, which says how close a kernel is to being memory-bound.

    python -m scripts.bench.bench_kernels --out bench_kernels.json
    python -m scripts.bench.bench_kernels --sizes-mib 16 64 --dtypes bf16 --bits 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

from zeropp.kernels import reference

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MIB = 1 << 20


@dataclass(frozen=True)
class Measurement:
    device: str
    backend: str
    op: str  # quantize | dequantize | clone
    dtype: str
    bits: int | None
    block_size: int | None
    size_mib: int
    numel: int
    median_s: float
    gbps: float
    copy_gbps: float
    ratio_to_copy: float


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.bench_kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes-mib",
        type=int,
        nargs="+",
        default=[16, 64, 256],
        help="tensor sizes in MiB of the input dtype",
    )
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    parser.add_argument("--bits", type=int, nargs="+", choices=[2, 4, 8], default=[8, 4, 2])
    parser.add_argument("--block-size", type=int, default=2048)
    parser.add_argument(
        "--devices",
        nargs="+",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cpu, plus cuda when available",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if any(size < 1 for size in args.sizes_mib):
        parser.error("--sizes-mib must be positive")
    if args.devices is None:
        args.devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    if "cuda" in args.devices and not torch.cuda.is_available():
        parser.error("--devices cuda asked for, but CUDA is not available")
    return args


def _median_seconds(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int
) -> float:
    """Median wall time of fn(); on CUDA, synchronised around each run."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _backends(device: torch.device) -> list[tuple[str, ModuleType]]:
    backends = [("reference", reference)]
    if device.type == "cuda":
        from zeropp.kernels import triton_kernels

        if triton_kernels.is_available():
            backends.append(("triton", triton_kernels))
        else:
            print("triton is not installed: CUDA rows cover the torch reference only")
    return backends


def _bench_tensor(
    x: torch.Tensor,
    dtype_name: str,
    size_mib: int,
    args: argparse.Namespace,
    backends: list[tuple[str, ModuleType]],
) -> list[Measurement]:
    device = x.device
    nbytes = x.numel() * x.element_size()

    def row(backend: str, op: str, bits: int | None, seconds: float, copy_gbps: float):
        gbps = nbytes / seconds / 1e9
        return Measurement(
            device=device.type,
            backend=backend,
            op=op,
            dtype=dtype_name,
            bits=bits,
            block_size=None if bits is None else args.block_size,
            size_mib=size_mib,
            numel=x.numel(),
            median_s=seconds,
            gbps=gbps,
            copy_gbps=copy_gbps,
            ratio_to_copy=gbps / copy_gbps,
        )

    copy_s = _median_seconds(x.clone, device, args.warmup, args.repeats)
    copy_gbps = nbytes / copy_s / 1e9
    rows = [row("torch", "clone", None, copy_s, copy_gbps)]
    for bits in args.bits:
        for name, backend in backends:
            quantize = partial(backend.quantize_blockwise, x, bits, args.block_size)
            dequantize = partial(
                backend.dequantize_blockwise,
                quantize(),
                x.numel(),
                bits,
                args.block_size,
                x.dtype,
                out=torch.empty_like(x),
            )
            quantize_s = _median_seconds(quantize, device, args.warmup, args.repeats)
            dequantize_s = _median_seconds(dequantize, device, args.warmup, args.repeats)
            rows.append(row(name, "quantize", bits, quantize_s, copy_gbps))
            rows.append(row(name, "dequantize", bits, dequantize_s, copy_gbps))
    return rows


def run(args: argparse.Namespace) -> list[Measurement]:
    results: list[Measurement] = []
    for device_name in args.devices:
        device = torch.device(device_name)
        backends = _backends(device)
        for size_mib in args.sizes_mib:
            for dtype_name in args.dtypes:
                dtype = DTYPES[dtype_name]
                numel = size_mib * MIB // dtype.itemsize
                x = torch.randn(numel, device=device, dtype=torch.float32).to(dtype)
                for measurement in _bench_tensor(x, dtype_name, size_mib, args, backends):
                    results.append(measurement)
                    _print_row(measurement)
                del x
    return results


def _print_header() -> None:
    print(
        f"{'device':6} {'backend':9} {'op':10} {'dtype':5} {'bits':>4} {'MiB':>5} "
        f"{'ms':>9} {'GB/s':>8} {'copy GB/s':>9} {'/copy':>6}",
        flush=True,
    )


def _print_row(m: Measurement) -> None:
    bits = "-" if m.bits is None else str(m.bits)
    print(
        f"{m.device:6} {m.backend:9} {m.op:10} {m.dtype:5} {bits:>4} {m.size_mib:>5} "
        f"{m.median_s * 1e3:>9.2f} {m.gbps:>8.2f} {m.copy_gbps:>9.2f} {m.ratio_to_copy:>6.2f}",
        flush=True,
    )


def _metadata(args: argparse.Namespace) -> dict[str, object]:
    meta: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "block_size": args.block_size,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "metric": "GB/s = bytes of the fp tensor / median seconds",
    }
    if "cuda" in args.devices:
        meta["cuda_device"] = torch.cuda.get_device_name()
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            meta["triton"] = None
    return meta


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    _print_header()
    results = run(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"meta": _metadata(args), "results": [asdict(m) for m in results]}
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {len(results)} rows to {args.out}")


if __name__ == "__main__":
    main()
