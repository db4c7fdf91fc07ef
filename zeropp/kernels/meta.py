"""The kernels on the meta device: outputs of the right shapes, nothing computed.

The simulated GPU cluster runs on the meta device. There the kernels must allocate what the
Triton kernels allocate on a GPU (their outputs only), not the pure-torch reference's fp32
temporaries, or the measured peak would be a CPU's, not a GPU's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zeropp.kernels.reference import check_quantize_input, payload_layout


def quantize_blockwise(x: Tensor, bits: int, block_size: int) -> Tensor:
    layout = check_quantize_input(x, bits, block_size)
    return torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)


def dequantize_blockwise(payload: Tensor, numel: int, bits: int, block_size: int,
                         dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    return out if out is not None else torch.empty(numel, dtype=dtype, device=payload.device)


def dequantize_blockwise_many(payloads: Tensor, numel: int, bits: int, block_size: int,
                              dtype: torch.dtype) -> Tensor:
    return torch.empty(payloads.shape[0], numel, dtype=dtype, device=payloads.device)


def dequantize_reduce(payloads: Tensor, numel: int, bits: int, block_size: int) -> Tensor:
    return torch.empty(numel, dtype=torch.float32, device=payloads.device)


def dequantize_reduce_quantize(payloads: Tensor, numel: int, bits_in: int, bits_out: int,
                               block_size: int) -> Tensor:
    nbytes = payload_layout(numel, bits_out, block_size).nbytes
    return torch.empty(nbytes, dtype=torch.uint8, device=payloads.device)
