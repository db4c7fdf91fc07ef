"""The kernels on the meta device: outputs of the right shapes, nothing computed.

The simulated GPU cluster runs on the meta device. There the kernels must allocate what the
Triton kernels allocate on a GPU (their outputs only), not the pure-torch reference's fp32
temporaries, or the measured peak would be a CPU's, not a GPU's.

Each kernel is a dispatcher op of the ``zeropp`` library (``torch.ops.zeropp.*``) with a meta
implementation only, so that whatever watches the dispatcher sees it as one kernel, as a GPU
runs it: the trace recorder (zeropp/simulation/tracing.py) records it as one compute op
whose bytes are its inputs plus its outputs, exactly the Triton kernel's memory traffic (it
reads the values or payloads once and writes its result once). A plain ``torch.empty`` here
would make the quantization kernels invisible to the step-time model.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from zeropp.kernels.reference import check_quantize_input, payload_layout


def meta_op(qualname: str, *, mutates_args: tuple[str, ...] = ()):
    """Define ``qualname`` as a dispatcher op whose only implementation is ``shape_fn`` on the
    meta device (its fake implementation, which the Meta dispatch key runs).

    Why not ``custom_op(..., device_types="meta")``: torch 2.11 gives every custom op a Meta
    kernel of its own (the fake implementation) and refuses a second one for that key, so the
    op is defined with a body for the real devices that says where their kernels are."""
    def register(shape_fn):
        @functools.wraps(shape_fn)  # the op's schema is read from shape_fn's signature
        def off_meta(*args, **kwargs):
            raise RuntimeError(f"{qualname} is the meta device's kernel: on CPU and CUDA "
                               "zeropp.kernels runs the reference or the Triton kernel")

        op = torch.library.custom_op(qualname, off_meta, mutates_args=mutates_args)
        op.register_fake(shape_fn)
        return op
    return register


@meta_op("zeropp::quantize_blockwise", mutates_args=())
def _quantize(x: Tensor, bits: int, block_size: int) -> Tensor:
    layout = check_quantize_input(x, bits, block_size)
    return torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)


@meta_op("zeropp::dequantize_blockwise", mutates_args=())
def _dequantize(payload: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    return torch.empty(numel, dtype=dtype, device=payload.device)


# The ``out=`` form: ``out`` is written, so it is an argument the op mutates (its bytes count
# once, as the kernel's writes) and nothing is returned.
@meta_op("zeropp::dequantize_blockwise_into", mutates_args=("out",))
def _dequantize_into(payload: Tensor, out: Tensor) -> None:
    return None


# These two always write into a buffer the caller allocated (their own, when the caller
# passed none): the kernel the trace sees is the same whether the engine dequantizes into a
# fresh tensor or straight into a unit's buffer.
@meta_op("zeropp::dequantize_blockwise_many", mutates_args=("out",))
def _dequantize_many(payloads: Tensor, out: Tensor) -> None:
    return None


@meta_op("zeropp::dequantize_reduce", mutates_args=("out",))
def _dequantize_reduce(payloads: Tensor, out: Tensor) -> None:
    return None


@meta_op("zeropp::dequantize_reduce_quantize", mutates_args=())
def _dequantize_reduce_quantize(payloads: Tensor, nbytes: int) -> Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=payloads.device)


def quantize_blockwise(x: Tensor, bits: int, block_size: int) -> Tensor:
    return torch.ops.zeropp.quantize_blockwise(x, bits, block_size)


def dequantize_blockwise(payload: Tensor, numel: int, bits: int, block_size: int,
                         dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    if out is None:
        return torch.ops.zeropp.dequantize_blockwise(payload, numel, dtype)
    torch.ops.zeropp.dequantize_blockwise_into(payload, out)
    return out


def quantize_swizzled(x: Tensor, nodes: int, per_node: int, bits: int,
                      block_size: int) -> Tensor:
    # The same bytes as a plain quantization, in another order: the same kernel's traffic.
    return torch.ops.zeropp.quantize_blockwise(x, bits, block_size)


def dequantize_blockwise_many(payloads: Tensor, numel: int, bits: int, block_size: int,
                              dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    if out is None:
        out = torch.empty(payloads.shape[0], numel, dtype=dtype, device=payloads.device)
    torch.ops.zeropp.dequantize_blockwise_many(payloads, out)
    return out


def dequantize_reduce(payloads: Tensor, numel: int, bits: int, block_size: int,
                      out: Tensor | None = None) -> Tensor:
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=payloads.device)
    torch.ops.zeropp.dequantize_reduce(payloads, out)
    return out


def dequantize_reduce_quantize(payloads: Tensor, numel: int, bits_in: int, bits_out: int,
                               block_size: int, parts: int = 1) -> Tensor:
    nbytes = payload_layout(numel, bits_out, block_size).nbytes
    return torch.ops.zeropp.dequantize_reduce_quantize(payloads, nbytes)
