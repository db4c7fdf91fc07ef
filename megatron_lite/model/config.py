"""Shape and initialization settings of the Megatron GPT-2 model.

`GPTConfig` is the single description of a model: the CLI builds one from Megatron-style
flags, the Hugging Face converter builds one from a `GPT2Config`, and everything that needs a
size (parameter counts, FLOPs for the throughput log line) reads it from here without
allocating a tensor, so an 18B-parameter configuration can be inspected on a laptop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Kept within int64 so the seed can also be stored in checkpoints and passed to torch RNGs.
MAX_SEED = 2**63 - 1


@dataclass
class GPTConfig:
    """Architecture of a pre-LayerNorm GPT-2 with a tied LM head (Megatron-LM's GPT model)."""

    num_layers: int
    """Number of transformer layers (L)."""
    hidden_size: int
    """Model width (h); every residual-stream tensor is (batch, seq, h)."""
    num_attention_heads: int
    """Attention heads per layer; must divide hidden_size."""
    vocab_size: int
    """Real tokenizer vocabulary, e.g. 50257 for GPT-2's BPE."""
    max_position_embeddings: int = 1024
    """Rows of the learned position table, hence the longest sequence the model accepts."""
    ffn_hidden_size: int | None = None
    """Width of the MLP's inner layer; None means 4 * hidden_size (set in __post_init__)."""
    make_vocab_size_divisible_by: int = 128
    """The embedding table is padded to a multiple of this so its GEMMs stay tile aligned."""
    hidden_dropout: float = 0.1
    """Dropout on the embeddings and on each residual branch."""
    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""
    init_method_std: float = 0.02
    """Std of the normal initialization of weights and embeddings."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm."""
    checkpoint_activations: bool = False
    """Recompute each chunk of layers in backward instead of keeping its activations."""
    checkpoint_num_layers: int = 1
    """Consecutive layers per activation-checkpoint chunk."""
    seed: int = 1234
    """Initialization seed; together with a parameter's name it fixes that parameter's value."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_position_embeddings", "make_vocab_size_divisible_by",
                     "checkpoint_num_layers"):
            _require_positive_int(name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        _require_positive_int("ffn_hidden_size", self.ffn_hidden_size)
        for name in ("hidden_dropout", "attention_dropout"):
            probability = getattr(self, name)
            if not 0.0 <= probability < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {probability}")
        for name in ("init_method_std", "layernorm_epsilon"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        seed_is_int = isinstance(self.seed, int) and not isinstance(self.seed, bool)
        if not (seed_is_int and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of make_vocab_size_divisible_by (Megatron)."""
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Exact parameter count of `GPTModel(self)`; the tied LM head adds nothing."""
        h, f = self.hidden_size, self.ffn_hidden_size
        assert f is not None  # filled in by __post_init__
        layernorm = 2 * h
        attention = (3 * h * h + 3 * h) + (h * h + h)
        mlp = (h * f + f) + (f * h + h)
        per_layer = 2 * layernorm + attention + mlp
        embeddings = (self.padded_vocab_size + self.max_position_embeddings) * h
        return embeddings + self.num_layers * per_layer + layernorm


def flops_per_token(config: GPTConfig, seq_length: int, checkpoint_activations: bool) -> float:
    """Model FLOPs per trained token: Megatron's formula (Narayanan et al., 2021, eq. 3),
    as Megatron-DeepSpeed's throughput calculator applies it, so TFLOPs figures stay
    comparable with the ZeRO++ paper's.

        24*L*h^2 * (1 + s/(6h) + V/(16*L*h)) * passes

    Per token and per forward pass a layer does 24h^2 FLOPs of dense GEMMs (QKV 6h^2,
    attention output 2h^2, MLP 16h^2, with ffn = 4h) and 4sh in the score and context GEMMs
    (the s/(6h) term); V is the padded vocabulary that the LM head multiplies. `passes` is 3
    (forward, then backward at twice the forward) or 4 when activation checkpointing
    recomputes the forward. With 4 the vocabulary term is exactly the LM head's 6Vh (it is
    not recomputed); with 3 the formula keeps the same bracket and so counts 4.5Vh, a small
    undercount that Megatron's published numbers share.
    """
    _require_positive_int("seq_length", seq_length)
    L, h, s = config.num_layers, config.hidden_size, seq_length
    V = config.padded_vocab_size
    passes = 4 if checkpoint_activations else 3
    return 24.0 * L * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * L * h)) * passes


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
