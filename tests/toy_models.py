"""Small models for engine tests: blocks in a ModuleList, a tied head at the root."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ToyBlock(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x, bypass: bool = False):
        if bypass:  # called (so gathered, as on every rank), but its parameters get no gradient
            return x.clone()
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ToyLM(nn.Module):
    """Awkward sizes on purpose (17 x 257 and friends): nothing divides the world size."""

    def __init__(self, vocab: int = 257, width: int = 17, hidden: int = 41, layers: int = 3,
                 checkpoint: bool | str = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(ToyBlock(width, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.checkpoint = checkpoint  # False, True, or "reentrant" (Hugging Face's default)

    def forward(self, ids, skip_layer: int | None = None):
        x = self.embed(ids)
        for index, layer in enumerate(self.layers):
            if index == skip_layer:
                x = layer(x, bypass=True)
            elif self.checkpoint and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    layer, x, use_reentrant=self.checkpoint == "reentrant")
            else:
                x = layer(x)
        return F.linear(self.norm(x), self.embed.weight)  # tied head


def toy_model(seed: int = 0, **kwargs) -> ToyLM:
    torch.manual_seed(seed)
    model = ToyLM(**kwargs)
    with torch.no_grad():  # non-trivial LayerNorm parameters so their gradients matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def toy_batches(steps: int, micro: int, batch: int, seq: int = 9, vocab: int = 257, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, micro, batch, seq + 1), generator=g)


def toy_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                           tokens[:, 1:].reshape(-1))


def train_data_parallel(engine, rank: int, world: int, data: torch.Tensor, steps: int,
                        micro: int, after_step=None) -> list[float]:
    """Train ``steps`` steps of ``micro`` micro-batches, each rank on its slice of the batch
    (the data parallelism an unsharded run on the whole batch is compared with); returns each
    step's loss averaged over ranks. ``after_step(step)`` runs after each step."""
    per_rank = data.shape[2] // world
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for m in range(micro):
            tokens = data[step, m, rank * per_rank:(rank + 1) * per_rank]
            loss = toy_loss(engine(tokens), tokens)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / micro
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        if after_step is not None:
            after_step(step)
    return losses


def train_unsharded(model: nn.Module, data: torch.Tensor, steps: int, micro: int, lr: float,
                    weight_decay: float, clip: float):
    """The plain loop every sharded run must reproduce: torch AdamW (weight decay on the
    matrices only) and clip_grad_norm_, on the whole batch in one process. Returns each
    step's loss, each step's gradient norm before clipping, and the final weights."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, foreach=False)
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for m in range(micro):
            loss = toy_loss(model(data[step, m]), data[step, m]) / micro
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}
