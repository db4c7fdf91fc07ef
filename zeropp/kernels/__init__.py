"""ZeRO++ quantization kernels: block quantization (qwZ int8, qgZ int4), fused reductions,
and the qgZ swizzle.

Each call dispatches on its tensor: CUDA tensors go to the Triton kernels when Triton is
importable and the block size fits them, meta tensors (the simulated GPU cluster) to
`meta` (the Triton kernels' allocations, no compute), everything else to the pure-torch
reference. The
two are bit-identical (see `reference` for the payload layout and the numeric contract).
`ZEROPP_KERNELS=reference|triton` forces one backend, read at every call of these
functions (the engine's quantized collectives choose once per device type, at their first
launch).

The Triton module is imported only when a call selects it, so CPU-only runs never import
Triton. Its launches go through a cached compiled kernel's launcher with the raw CUDA stream
(`launcher`), and `prepare_kernels` compiles the variants an engine will launch ahead of
its first step.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch
from torch import Tensor

from zeropp.kernels import meta, reference
from zeropp.kernels.reference import (
    SUPPORTED_BITS,
    SUPPORTED_DTYPES,
    PayloadLayout,
    payload_layout,
    quantized_nbytes,
    swizzle,
    unswizzle,
)

__all__ = [
    "BACKEND_ENV_VAR",
    "KernelVariant",
    "SUPPORTED_BITS",
    "SUPPORTED_DTYPES",
    "PayloadLayout",
    "backend_for",
    "dequantize_blockwise",
    "dequantize_blockwise_many",
    "dequantize_reduce",
    "dequantize_reduce_quantize",
    "payload_layout",
    "prepare_kernels",
    "prepare_variants",
    "quantize_blockwise",
    "quantize_swizzled",
    "quantized_nbytes",
    "swizzle",
    "unswizzle",
]

BACKEND_ENV_VAR = "ZEROPP_KERNELS"
_BACKEND_CHOICES = ("reference", "triton")


@cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@cache
def _triton_backend() -> ModuleType:
    return importlib.import_module("zeropp.kernels.triton_kernels")


def backend_for(tensor: Tensor, block_size: int) -> ModuleType:
    """The kernel module (`reference` or `triton_kernels`) that handles `tensor`."""
    forced = os.environ.get(BACKEND_ENV_VAR, "").strip().lower()
    if forced and forced not in _BACKEND_CHOICES:
        raise ValueError(
            f"{BACKEND_ENV_VAR} must be 'reference' or 'triton', got {os.environ[BACKEND_ENV_VAR]!r}"
        )
    if isinstance(tensor, Tensor) and tensor.is_meta:
        return meta
    if forced == "reference":
        return reference
    if forced == "triton":
        if not _triton_installed():
            raise RuntimeError(
                f"{BACKEND_ENV_VAR}=triton but the 'triton' package is not installed"
            )
        return _triton_backend()
    if isinstance(tensor, Tensor) and tensor.is_cuda and _triton_installed():
        backend = _triton_backend()
        if block_size <= backend.MAX_BLOCK_SIZE:
            return backend
    return reference


def quantize_blockwise(x: Tensor, bits: int, block_size: int) -> Tensor:
    """Flatten `x` and quantize it block-wise into one uint8 payload of
    `quantized_nbytes(x.numel(), bits, block_size)` bytes: [codes | fp32 scales]."""
    return backend_for(x, block_size).quantize_blockwise(x, bits, block_size)


def dequantize_blockwise(
    payload: Tensor,
    numel: int,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
    out: Tensor | None = None,
) -> Tensor:
    """Inverse of `quantize_blockwise`: `numel` values in `dtype`, written into `out` if given."""
    return backend_for(payload, block_size).dequantize_blockwise(
        payload, numel, bits, block_size, dtype, out
    )


def quantize_swizzled(x: Tensor, nodes: int, per_node: int, bits: int,
                      block_size: int) -> Tensor:
    """qgZ's first send, quantized straight into its order: `x` holds nodes x per_node
    slices in rank order; the result is per_node payloads one after another, payload l
    quantizing the slices of ranks {m * per_node + l} in node order. Slices must be whole
    blocks of whole code bytes ([Note: payload pieces] in `reference`)."""
    return backend_for(x, block_size).quantize_swizzled(x, nodes, per_node, bits, block_size)


def dequantize_blockwise_many(
    payloads: Tensor, numel: int, bits: int, block_size: int, dtype: torch.dtype,
    out: Tensor | None = None,
) -> Tensor:
    """Dequantize k payloads (k, nbytes) at once into (k, numel) values in `dtype`; or into
    `out` (contiguous, k x numel elements of any shape: a unit's flat buffer), returned."""
    return backend_for(payloads, block_size).dequantize_blockwise_many(
        payloads, numel, bits, block_size, dtype, out
    )


def dequantize_reduce(payloads: Tensor, numel: int, bits: int, block_size: int,
                      out: Tensor | None = None) -> Tensor:
    """fp32 sum of k dequantized payloads (k, nbytes): the last step of qgZ; written into
    `out` (contiguous, fp32/fp16/bf16: a gradient shard, the sum rounded once) if given."""
    return backend_for(payloads, block_size).dequantize_reduce(payloads, numel, bits,
                                                               block_size, out)


def dequantize_reduce_quantize(
    payloads: Tensor, numel: int, bits_in: int, bits_out: int, block_size: int, parts: int = 1
) -> Tensor:
    """Dequantize k payloads, sum in fp32, requantize to `bits_out`: qgZ's middle step. With
    `parts` > 1, the payloads of `parts` equal slices of the sum one after another (what the
    second all-to-all sends)."""
    return backend_for(payloads, block_size).dequantize_reduce_quantize(
        payloads, numel, bits_in, bits_out, block_size, parts
    )


@dataclass(frozen=True)
class KernelVariant:
    """The kernels the calls on tensors of `numel` values launch, as `prepare_variants`
    compiles them ahead: quantization of `dtype` values to `bits` (plain, and swizzled for
    each (nodes, per_node) of `swizzles`), dequantization of one payload and of `payloads`,
    their reduction (into fp32 and into `dtype`), and its requantization to `bits_out`
    (None: `bits`) in `parts` pieces. A collective names the variants it launches for a buffer size
    (``Collective.kernel_variants``), so an engine prepares exactly what it will run."""

    numel: int
    dtype: torch.dtype
    bits: int
    block_size: int
    payloads: int = 1
    parts: int = 1
    swizzles: tuple[tuple[int, int], ...] = ()
    bits_out: int | None = None


def prepare_variants(device: torch.device | str, variants: Iterable[KernelVariant]) -> int:
    """Compile ahead, without launching, the Triton kernels of each variant on `device`:
    meant for an engine's build, so that no compile happens inside its first iteration (a
    call whose shape was not prepared still compiles on first use). Returns how many launch
    variants were prepared: 0 where the Triton kernels would not run (not CUDA, no Triton,
    forced to the reference, Triton's interpreter, or a Triton whose launch API this does
    not know)."""
    device = torch.device(device)
    if device.type != "cuda" or not _triton_installed():
        return 0
    if device.index is None:  # launches are keyed on their tensors' device index
        device = torch.device("cuda", torch.cuda.current_device())
    if os.environ.get(BACKEND_ENV_VAR, "").strip().lower() == "reference":
        return 0
    backend = _triton_backend()
    prepared = 0
    for variant in dict.fromkeys(variants):
        reference.check_float_dtype(variant.dtype, "dtype")
        prepared += backend.prepare(device, variant.numel, variant.bits, variant.block_size,
                                    variant.dtype, variant.payloads, variant.parts,
                                    variant.swizzles, variant.bits_out)
    return prepared


def prepare_kernels(device: torch.device | str, numels: Iterable[int], *,
                    dtypes: Iterable[torch.dtype] = (torch.bfloat16,),
                    bits: Iterable[int] = (8, 4), block_sizes: Iterable[int] = (256,),
                    payload_counts: Iterable[int] = (1,), parts: Iterable[int] = (1,),
                    swizzles: Iterable[tuple[int, int]] = ()) -> int:
    """`prepare_variants` for every combination of the given numels, value dtypes, code
    widths, block sizes, payload counts (the k of the batched and reduced calls),
    requantized pieces and qgZ swizzles (nodes, per_node)."""
    # (tuples: each is walked once per combination of the ones before it)
    dtypes, bits, block_sizes = tuple(dtypes), tuple(bits), tuple(block_sizes)
    payload_counts, parts, swizzles = tuple(payload_counts), tuple(parts), tuple(swizzles)
    return prepare_variants(device, (
        KernelVariant(numel, dtype, width, block_size, count, pieces, swizzles)
        for numel in numels for dtype in dtypes for width in bits for block_size in block_sizes
        for count in payload_counts for pieces in parts))
