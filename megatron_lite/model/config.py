"""Shape and initialization settings of the Megatron GPT model, GPT-2 or Llama style.

`GPTConfig` is the single description of a model: the CLI builds one from Megatron-style
flags, the Hugging Face converters build one from a `GPT2Config` or a `LlamaConfig`, and
everything that needs a size (parameter counts, FLOPs for the throughput log line) reads it
from here without allocating a tensor, so an 18B-parameter configuration can be inspected on
a laptop.

The defaults describe Megatron's GPT-2 (learned positions, LayerNorm, GELU MLP, biases, tied
LM head). Megatron-LM's switches turn it into a Llama-style model: rotary positions, RMSNorm,
SwiGLU, grouped-query attention, an untied output layer and bias-free linears.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

# Kept within int64 so the seed can also be stored in checkpoints and passed to torch RNGs.
MAX_SEED = 2**63 - 1

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE_METHODS = ("uniform", "block")

# The fields that decide what the weights are and what the network computes: a checkpoint
# only resumes into a model that agrees on all of them. (Dropout, recomputation and the init
# seed may change between runs.)
ARCHITECTURE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings",
    "ffn_hidden_size", "make_vocab_size_divisible_by", "position_embedding_type",
    "rotary_base", "rotary_percent", "normalization", "swiglu", "num_query_groups",
    "kv_channels", "untie_embeddings_and_output_weights", "add_bias_linear",
)


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default MLP width: 4h, or for SwiGLU (two input projections) 2/3 of
    that rounded down to a multiple of 64, which keeps the parameter count near the 4h MLP's."""
    if swiglu:
        return int((4 * hidden_size * 2 / 3) / 64) * 64
    return 4 * hidden_size


@dataclass
class GPTConfig:
    """Architecture of a pre-norm decoder-only transformer (Megatron-LM's GPT model)."""

    num_layers: int
    """Number of transformer layers (L)."""
    hidden_size: int
    """Model width (h); every residual-stream tensor is (batch, seq, h)."""
    num_attention_heads: int
    """Query heads per layer (nh)."""
    vocab_size: int
    """Real tokenizer vocabulary, e.g. 50257 for GPT-2's BPE."""
    max_position_embeddings: int = 1024
    """Longest sequence the model accepts; with learned positions, the rows of their table."""
    ffn_hidden_size: int | None = None
    """Width of the MLP's inner layer (F); None means `default_ffn_hidden_size`."""
    make_vocab_size_divisible_by: int = 128
    """The embedding table is padded to a multiple of this so its GEMMs stay tile aligned."""
    hidden_dropout: float = 0.1
    """Dropout on the embeddings and on each residual branch."""
    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""
    init_method_std: float = 0.02
    """Std of the normal initialization of weights and embeddings."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm or RMSNorm."""
    checkpoint_activations: bool = False
    """Full recomputation: recompute whole layers in backward instead of keeping their
    activations (Megatron's --recompute-granularity full)."""
    checkpoint_num_layers: int = 1
    """With full recomputation: layers per checkpointed chunk ("uniform"), or how many of
    the first layers are checkpointed ("block") (Megatron's --recompute-num-layers)."""
    recompute_method: str = "uniform"
    """How full recomputation picks its layers: "uniform" or "block" (Megatron's names)."""
    recompute_attention: bool = False
    """Selective recomputation: keep every layer's activations except the core attention's
    (scores, softmax, dropout, context), recomputed in backward (Megatron's
    --recompute-granularity selective)."""
    seed: int = 1234
    """Initialization seed; together with a parameter's name it fixes that parameter's value."""
    position_embedding_type: str = "learned_absolute"
    """"learned_absolute" (GPT-2's table), "rope" (rotary, Llama) or "none"."""
    rotary_base: float = 10000.0
    """Base (theta) of the rotary frequencies: 10000 for Llama 2, 500000 for Llama 3."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary positions rotate (the first ones)."""
    normalization: str = "LayerNorm"
    """"LayerNorm" (with bias) or "RMSNorm" (scale only)."""
    swiglu: bool = False
    """MLP with a SiLU-gated linear unit: silu(x W_gate) * (x W_up), then W_down."""
    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention); None means one per query head."""
    kv_channels: int | None = None
    """Channels per attention head (d); None means hidden_size / num_attention_heads."""
    untie_embeddings_and_output_weights: bool = False
    """Give the LM head its own weight instead of reusing the token embedding table."""
    add_bias_linear: bool = True
    """Biases on the attention and MLP linears (Megatron's --disable-bias-linear clears it)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_position_embeddings", "make_vocab_size_divisible_by",
                     "checkpoint_num_layers"):
            _require_positive_int(name, getattr(self, name))
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by "
                    f"num_attention_heads ({self.num_attention_heads}), or give kv_channels"
                )
        else:
            _require_positive_int("kv_channels", self.kv_channels)
        if self.num_query_groups is not None:
            _require_positive_int("num_query_groups", self.num_query_groups)
            if self.num_attention_heads % self.num_query_groups != 0:
                raise ValueError(
                    f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                    f"num_query_groups ({self.num_query_groups})"
                )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.swiglu)
        _require_positive_int("ffn_hidden_size", self.ffn_hidden_size)
        _require_choice("position_embedding_type", self.position_embedding_type,
                        POSITION_EMBEDDING_TYPES)
        _require_choice("normalization", self.normalization, NORMALIZATIONS)
        _require_choice("recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        for name in ("hidden_dropout", "attention_dropout"):
            probability = getattr(self, name)
            if not 0.0 <= probability < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {probability}")
        for name in ("init_method_std", "layernorm_epsilon", "rotary_base"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding_type == "rope":
            rotary_dim = self.rotary_dim
            if rotary_dim < 2 or rotary_dim % 2:
                raise ValueError(
                    f"rotary positions need an even number of rotated channels per head; "
                    f"kv_channels {self.head_dim} x rotary_percent {self.rotary_percent} "
                    f"gives {rotary_dim}"
                )
        seed_is_int = isinstance(self.seed, int) and not isinstance(self.seed, bool)
        if not (seed_is_int and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of make_vocab_size_divisible_by (Megatron)."""
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    @property
    def uses_dropout(self) -> bool:
        """Whether training draws random numbers (a recompute must then replay them)."""
        return self.hidden_dropout > 0 or self.attention_dropout > 0

    @property
    def head_dim(self) -> int:
        """Channels per attention head (d)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        """Key/value heads: num_query_groups, or one per query head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels per head that rotary positions rotate (Megatron rounds down)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_size(self) -> int:
        """Output width of the fused QKV projection: nh*d queries, then 2 x groups*d."""
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    def num_parameters(self) -> int:
        """Exact parameter count of `GPTModel(self)` (a tied LM head adds nothing)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        assert f is not None  # filled in by __post_init__
        bias = 1 if self.add_bias_linear else 0
        norm = 2 * h if self.normalization == "LayerNorm" else h
        attention_width = self.num_attention_heads * d
        attention = (h * self.qkv_size + bias * self.qkv_size) + (attention_width * h + bias * h)
        mlp_in = 2 * f if self.swiglu else f
        mlp = (h * mlp_in + bias * mlp_in) + (f * h + bias * h)
        per_layer = 2 * norm + attention + mlp
        embeddings = self.padded_vocab_size * h
        if self.position_embedding_type == "learned_absolute":
            embeddings += self.max_position_embeddings * h
        output_layer = self.padded_vocab_size * h if self.untie_embeddings_and_output_weights \
            else 0
        return embeddings + self.num_layers * per_layer + norm + output_layer

    def architecture_differences(self, other: dict) -> list[str]:
        """'key: theirs != ours' for every architecture field where the config `other` (a
        checkpoint's `dataclasses.asdict`, perhaps written before a field existed, which then
        reads as its default) describes a different network."""
        defaults = {field.name: field.default for field in fields(self)}
        differences = []
        for key in ARCHITECTURE_FIELDS:
            theirs = other.get(key, defaults[key])
            if key == "ffn_hidden_size" and theirs is None:
                theirs = default_ffn_hidden_size(other.get("hidden_size", self.hidden_size),
                                                 other.get("swiglu", False))
            if theirs != getattr(self, key):
                differences.append(f"{key}={theirs!r} (this run: {getattr(self, key)!r})")
        return differences


def flops_per_token(config: GPTConfig, seq_length: int, checkpoint_activations: bool) -> float:
    """Model FLOPs per trained token: Megatron's formula (Narayanan et al., 2021, eq. 3),
    as Megatron-DeepSpeed's throughput calculator applies it, so TFLOPs figures stay
    comparable with the ZeRO++ paper's; generalized, as Megatron-LM's current
    `num_floating_point_operations` is, to grouped-query attention, SwiGLU and any
    kv_channels.

        passes * (L * (2 * dense_weights_per_layer + 4*s*nh*d) + 1.5*V*h)

    A layer's dense GEMMs cost 2 FLOPs per weight per token and forward pass (for GPT-2,
    with ffn = 4h: QKV 6h^2 + output 2h^2 + MLP 16h^2 = 24h^2); the score and context GEMMs
    add 4*s*nh*d (Megatron counts the full s x s square, not the causal half). V is the
    padded vocabulary that the LM head multiplies. `passes` is 3 (forward, then backward at
    twice the forward) or 4 when activation checkpointing recomputes the forward. With 4 the
    vocabulary term is exactly the LM head's 6Vh (it is not recomputed); with 3 the formula
    keeps the same 1.5Vh per pass and so counts 4.5Vh, a small undercount that Megatron's
    published numbers share. For GPT-2 shapes this is exactly
    24*L*h^2 * (1 + s/(6h) + V/(16*L*h)) * passes.
    """
    _require_positive_int("seq_length", seq_length)
    h, f = config.hidden_size, config.ffn_hidden_size
    assert f is not None  # filled in by __post_init__
    attention_width = config.num_attention_heads * config.head_dim
    dense_weights = h * config.qkv_size + attention_width * h + h * f * (3 if config.swiglu else 2)
    per_layer = 2.0 * dense_weights + 4.0 * seq_length * attention_width
    passes = 4 if checkpoint_activations else 3
    return passes * (config.num_layers * per_layer + 1.5 * config.padded_vocab_size * h)


def _require_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def describe_count(count: int) -> str:
    return f"{count:,} ({count / 1e9:.2f}B)" if count >= 1e9 else f"{count:,} ({count / 1e6:.1f}M)"
