"""Megatron's pretraining sampler, the data loader built on it, and batch unpacking.

Samples are consumed in the fixed global order 0, 1, 2, ... (the dataset itself is already
shuffled). Each global step takes the next micro_batch_size * data_parallel_size samples and
gives rank r the r-th contiguous slice of them, so the data a run sees depends only on the
number of samples consumed so far, and resuming from a checkpoint's `consumed_samples`
continues exactly where the interrupted run stopped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader


def _check_int_at_least(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class MegatronPretrainingSampler:
    """Yields, per step, the list of sample indices of this rank's micro-batch.

    With drop_last=False a final incomplete global batch is still split rank by rank, so the
    last micro-batch may be short, and ranks whose slice is empty yield nothing for it.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        _check_int_at_least("total_samples", total_samples, 1)
        _check_int_at_least("consumed_samples", consumed_samples, 0)
        _check_int_at_least("micro_batch_size", micro_batch_size, 1)
        _check_int_at_least("data_parallel_size", data_parallel_size, 1)
        _check_int_at_least("data_parallel_rank", data_parallel_rank, 0)
        if consumed_samples >= total_samples:
            raise ValueError(
                f"consumed_samples ({consumed_samples}) must be below total_samples "
                f"({total_samples}): nothing is left to sample"
            )
        if data_parallel_rank >= data_parallel_size:
            raise ValueError(
                f"data_parallel_rank ({data_parallel_rank}) must be below data_parallel_size "
                f"({data_parallel_size})"
            )
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.drop_last = drop_last
        self.global_batch_size = self.micro_batch_size * self.data_parallel_size

    def _rank_slice(self, global_batch: Sequence[int]) -> list[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return list(global_batch[start:start + self.micro_batch_size])

    def __iter__(self) -> Iterator[list[int]]:
        first = self.consumed_samples
        while first + self.global_batch_size <= self.total_samples:
            yield self._rank_slice(range(first, first + self.global_batch_size))
            first += self.global_batch_size
        if first < self.total_samples and not self.drop_last:
            tail = self._rank_slice(range(first, self.total_samples))
            if tail:
                yield tail

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full_steps = remaining // self.global_batch_size
        if self.drop_last:
            return full_steps
        leftover = remaining - full_steps * self.global_batch_size
        has_tail = leftover > self.data_parallel_rank * self.micro_batch_size
        return full_steps + int(has_tail)


def collate_text(samples: Sequence[dict[str, Any]]) -> torch.Tensor:
    """Stack the "text" arrays of a micro-batch into a LongTensor of shape [b, s + 1]."""
    return torch.from_numpy(np.stack([np.asarray(sample["text"]) for sample in samples])).long()


def build_pretraining_data_loader(
    dataset: Any,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
) -> DataLoader | None:
    """DataLoader yielding this rank's [micro_batch_size, s + 1] token batches, in order.

    Returns None for a missing dataset (an empty valid or test split), as Megatron does.
    """
    if dataset is None:
        return None
    _check_int_at_least("num_workers", num_workers, 0)
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_size,
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_text,
        pin_memory=torch.cuda.is_available(),
        # Workers re-open the memory maps; keeping them alive avoids doing so every epoch.
        persistent_workers=num_workers > 0,
        # Each new iterator draws a worker seed from this generator. Left to the default, it
        # would draw from the global RNG and shift every later dropout mask, so a resumed
        # run (which builds its loader at another point of the RNG stream) would diverge.
        generator=torch.Generator().manual_seed(0),
    )


def get_batch(
    batch_text: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split [b, s + 1] text into (tokens, labels, loss_mask, position_ids), each [b, s].

    tokens = text[:, :-1] and labels = text[:, 1:]; every position is trained on (float ones
    mask), and positions restart at 0 in each sample, as in Megatron without
    --reset-position-ids.
    """
    if batch_text.dim() != 2 or batch_text.size(1) < 2:
        raise ValueError(
            f"batch_text must have shape [b, s + 1] with s >= 1, got {tuple(batch_text.shape)}"
        )
    if batch_text.dtype != torch.long:
        raise ValueError(f"batch_text must be a LongTensor, got dtype {batch_text.dtype}")
    tokens = batch_text[:, :-1].contiguous()
    labels = batch_text[:, 1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float, device=batch_text.device)
    seq_length = tokens.size(1)
    position_ids = torch.arange(seq_length, device=batch_text.device).unsqueeze(0).expand_as(tokens)
    return tokens, labels, loss_mask, position_ids
