"""qgZ error feedback: what quantization dropped from a send, added back next time.

[Note: error feedback]
The error is kept where the first hop's reduction lands: each rank sums its node's int4
slices of one chunk (the node's partial sums for the ranks with its local index, one slice
per node) and requantizes that partial sum for the inter-node hop. That requantization is
the one fed back: before it, the stored error e of the chunk is added, h' = p + s * e,
where s is the factor the gradients carry now (loss scale / pre-division factor); after it
the new error is (h' - Q(h')) / s, so the stored error is in true gradient units and stays
right when the fp16 loss scale changes. LoCo's moving average (DeepSpeed's
``zeropp_loco_param``): e <- beta * e + (1 - beta) * new error; beta = 0 is plain error
feedback.

Why there and not at the first hop's send: a rank's first-hop send is its gradients of the
whole bucket, every rank's slices, so its error is the size of the unsharded model (17 GiB
per GPU at 18B even in int8). The chunk is 1/ranks-per-node of it, nodes x the rank's
gradient shard, and the requantization of a sum of ranks-per-node values is the larger of
the two errors and the one that crosses the slow link. The first hop's error is not fed
back. Errors are stored int4, block-quantized with one fp32 scale per block (the qgZ block
size): at 4 nodes the size of a 16-bit gradient shard (0.55 GiB at the tutorial's 18B).

With ``zero_quantized_gradients_inter_node_bits: 2`` that requantization is ternary (int2,
{-s, 0, +s} per block): alone it would drop most of every partial sum (every value under
half its block's absmax), which is why the engine refuses int2 without error feedback; with
it, what one step drops is sent over the following steps.

They start again from zero after a skipped (non-finite) step, since a NaN error would
otherwise turn every later step into an overflow, and every ``reset_interval`` applied
steps (LoCo's reset_T; 0 = never). They are part of a checkpoint: a resumed run continues
bit for bit.
"""

from __future__ import annotations

import torch

from zeropp import kernels

# int4 keeps the error within a 16-bit gradient shard's bytes up to 4 nodes (see above).
STORAGE_BITS = 4


class ErrorFeedback:
    def __init__(self, block_size: int, beta: float = 0.0, reset_interval: int = 0) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"error feedback beta must be in [0, 1), got {beta}")
        self.block_size = block_size
        self.beta = beta
        self.reset_interval = reset_interval
        self.gradient_scale = 1.0  # what the gradients being reduced are multiplied by
        self.applied_steps = 0
        # Per reduction key: the error of its chunk as an int4 block-quantized payload.
        self.errors: dict[str, torch.Tensor] = {}

    @staticmethod
    def key_name(key: object) -> str:
        """A reduction key as a checkpointable string ((unit, offset) -> 'unit@offset')."""
        if isinstance(key, tuple):
            return "@".join(str(part) for part in key)
        return str(key)

    @staticmethod
    def nbytes(numel: int, block_size: int) -> int:
        """Bytes the error of a ``numel``-element chunk takes (for the memory planner)."""
        return kernels.quantized_nbytes(numel, STORAGE_BITS, block_size)

    def kernel_variants(self, numel: int) -> tuple[kernels.KernelVariant, ...]:
        """The kernels that store and read back the error of a ``numel``-element chunk."""
        return (kernels.KernelVariant(numel, torch.float32, STORAGE_BITS, self.block_size),)

    def _error(self, name: str, numel: int) -> torch.Tensor | None:
        payload = self.errors.get(name)
        if payload is None or payload.numel() != self.nbytes(numel, self.block_size):
            return None  # none yet, or saved for another bucket size: start from zero
        return kernels.dequantize_blockwise(payload, numel, STORAGE_BITS, self.block_size,
                                            torch.float32)

    def compensate(self, key: object, send: torch.Tensor) -> torch.Tensor:
        """The fp32 values to quantize: this send plus the stored error, in the send's units."""
        compensated = send.float()
        error = self._error(self.key_name(key), send.numel())
        if error is not None:
            compensated = compensated + error * self.gradient_scale
        return compensated

    def record(self, key: object, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Store what quantization dropped (``compensated - sent``), in true gradient units."""
        name = self.key_name(key)
        error = (compensated - sent) / self.gradient_scale
        if self.beta:
            previous = self._error(name, error.numel())
            if previous is not None:
                error = self.beta * previous + (1.0 - self.beta) * error
            else:
                error = (1.0 - self.beta) * error
        self.errors[name] = kernels.quantize_blockwise(error, STORAGE_BITS, self.block_size)

    def after_step(self, skipped: bool) -> None:
        """Called once per optimizer step, with the step's agreed overflow verdict."""
        if skipped:
            self.reset()
            return
        self.applied_steps += 1
        if self.reset_interval and self.applied_steps % self.reset_interval == 0:
            self.reset()

    def reset(self) -> None:
        self.errors.clear()

    def state_dict(self) -> dict:
        return {"applied_steps": self.applied_steps,
                "errors": {name: payload.detach().cpu() for name, payload in self.errors.items()}}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.applied_steps = int(state["applied_steps"])
        # Checkpoints written while units were reduced in buckets name them 'unit@offset':
        # the first bucket's errors are the unit's when the unit was one bucket (sizes are
        # checked when read); errors of later buckets have no reduction to go to now.
        errors = {}
        for name, payload in state["errors"].items():
            unit, _, offset = name.rpartition("@")
            if not unit:
                errors[name] = payload.to(device)
            elif offset == "0":
                errors.setdefault(unit, payload.to(device))
        self.errors = errors
