"""Host time per public quantization-kernel call, measured on the CPU.

    python -m scripts.bench.kernel_host_cost [--calls 2000] [--repeats 5] [--json FILE]

On a GPU every call of ``zeropp.kernels`` (``quantize_blockwise``, ``dequantize_blockwise_many``,
...) costs the host its Python (backend choice, checks, layout, output allocation, launch
key) plus the compiled kernel's C launch (``CompiledKernel.run``, then ``cudaLaunchKernel``).
The Python part is the same on any machine, so it is measured here, on the CPU: each call
goes through the Triton backend's host side and the launcher's direct path
(``zeropp/kernels/launcher.py``) exactly as on a GPU, with the compiled kernel's launch
replaced by a no-op (its first launch of each key runs in Triton's interpreter, once). What
this reports is therefore the host time per call *before* the C launch: on a GPU add that
launch (the H200 profile in docs/gpu_runs.md measured `cudaLaunchKernel` alone at 9 us; the
GPU check's section b times the whole call).

Per call: the best of ``--repeats`` timings of ``--calls`` calls on tiny tensors (so no
kernel work hides in it), and the share of cProfile's self-time per file of one more pass.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from collections import defaultdict


def _setup():
    """The kernels' Triton host side on CPU tensors, launching nothing after first use."""
    os.environ["TRITON_INTERPRET"] = "1"  # the backend takes CPU tensors (read at import)
    os.environ["ZEROPP_KERNELS"] = "triton"
    import torch

    import zeropp.kernels as kernels
    from zeropp.kernels import launcher, triton_kernels

    class CompiledLaunchStub:
        """What the launcher keeps of a compiled kernel, with a launch that does nothing."""

        __slots__ = ("run", "function", "metadata")

        def __init__(self, compiled) -> None:
            self.run = lambda *args: None
            self.function = self.metadata = None

    launcher._Launch = CompiledLaunchStub
    launcher._interpreting = lambda: False  # the direct path, as without the interpreter
    launcher._raw_stream = lambda device: 0
    triton_kernels.LAUNCHER._direct = True
    return torch, kernels, triton_kernels.LAUNCHER


def calls(torch, kernels) -> dict:
    """The public calls an iteration makes, on 4096-value tensors (bf16, block 256)."""
    numel, block, rows = 4096, 256, 8
    x = torch.randn(numel, dtype=torch.bfloat16)
    full = torch.randn(rows * numel, dtype=torch.bfloat16)
    int8 = torch.zeros(kernels.quantized_nbytes(numel, 8, block), dtype=torch.uint8)
    int8_rows = torch.zeros(rows, int8.numel(), dtype=torch.uint8)
    int4_rows = torch.zeros(rows, kernels.quantized_nbytes(numel, 4, block), dtype=torch.uint8)
    unit = torch.empty(rows * numel, dtype=torch.bfloat16)
    one = torch.empty(numel, dtype=torch.bfloat16)
    shard = torch.empty(numel, dtype=torch.float32)
    return {
        "quantize_blockwise int8 (qwZ's send)":
            lambda: kernels.quantize_blockwise(x, 8, block),
        "dequantize_blockwise int8":
            lambda: kernels.dequantize_blockwise(int8, numel, 8, block, torch.bfloat16, out=one),
        "dequantize_blockwise_many, 8 x int8 (qwZ's receive)":
            lambda: kernels.dequantize_blockwise_many(int8_rows, numel, 8, block,
                                                      torch.bfloat16, out=unit),
        "quantize_swizzled 2 x 4, int4 (qgZ's first send)":
            lambda: kernels.quantize_swizzled(full, 2, 4, 4, block),
        "dequantize_reduce_quantize, 8 x int4 (qgZ's hop 1)":
            lambda: kernels.dequantize_reduce_quantize(int4_rows, numel, 4, 4, block, parts=2),
        "dequantize_reduce, 8 x int4 (qgZ's last sum)":
            lambda: kernels.dequantize_reduce(int4_rows, numel, 4, block, out=shard),
    }


def _owner(filename: str) -> str:
    for part in ("zeropp/kernels/launcher.py", "zeropp/kernels/triton_kernels.py",
                 "zeropp/kernels/launch_specs.py", "zeropp/kernels/reference.py",
                 "zeropp/kernels/__init__.py"):
        if filename.endswith(part):
            return part.removeprefix("zeropp/kernels/")
    return "builtins" if filename == "~" else "other Python"


def measure(call, n: int, repeats: int) -> dict:
    call()  # the first launch of a key takes the plain path (and compiles, or interprets)
    for _ in range(min(n, 50)):
        call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            call()
        best = min(best, (time.perf_counter() - start) / n)
    # The least disturbed of three profiles: on a busy machine a preemption is charged to
    # whichever function it interrupted, which in 20 calls of a few us can be most of one
    # profile. (A CPU-time timer would dodge that but costs a system call an event, which
    # overcharges the functions of many small calls.)
    profiles = []
    for _ in range(3):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(n):
            call()
        profile.disable()
        stats = pstats.Stats(profile).stats
        profiles.append((sum(entry[2] for entry in stats.values()), stats))
    shares: dict[str, float] = defaultdict(float)
    for (filename, _, _), (_, _, self_time, _, _) in min(profiles, key=lambda p: p[0])[1].items():
        shares[_owner(filename)] += self_time
    total = sum(shares.values()) or 1.0
    return {"us_per_call": best * 1e6,
            "self_time_share": {k: v / total for k, v in sorted(shares.items())}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        parser.error("--calls and --repeats must be at least 1")
    torch, kernels, launcher = _setup()
    results = {name: measure(call, args.calls, args.repeats)
               for name, call in calls(torch, kernels).items()}
    if launcher.direct_launches == 0:
        print("error: no call took the launcher's direct path", file=sys.stderr)
        return 1
    width = max(map(len, results))
    print(f"host Python per call before the C launch (best of {args.repeats} x {args.calls}, "
          "tiny tensors, this CPU):")
    for name, figures in results.items():
        top = max(figures["self_time_share"].items(), key=lambda item: item[1])
        print(f"  {name:{width}s} {figures['us_per_call']:6.1f} us"
              f"   (most: {top[0]} {100 * top[1]:.0f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calls": args.calls, "repeats": args.repeats, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
