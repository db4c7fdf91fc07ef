"""Model-architecture flags of the Megatron command line, their validation, and the GPTConfig
they describe.

Megatron-LM and Megatron-DeepSpeed select the same Llama-style switches with different
spellings; both are accepted and resolve to one ``GPTConfig``:

    rotary positions    --position-embedding-type rope   | --use-rotary-position-embeddings
    no position table   --position-embedding-type none   | --no-position-embedding
    RMSNorm             --normalization RMSNorm          | --normalization rmsnorm
    grouped-query attn  --group-query-attention --num-query-groups N | --num-key-value-heads N
    recomputation       --recompute-granularity full|selective, --recompute-method,
                        --recompute-num-layers, --recompute-activations
                        | --checkpoint-activations, --checkpoint-num-layers

Flags that choose kernels rather than what the network computes (fusions, flash attention,
the attention backend) are accepted and have no effect: attention always runs through torch's
``scaled_dot_product_attention``, which picks a flash or memory-efficient kernel on the GPU.

``ArgumentError`` lives here, in the module that ``megatron_lite.arguments`` builds on, and
is re-exported by it; so do the bookkeeping helpers (``flag``, ``describe``, ``derive``).
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_lite.model.config import (
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    RECOMPUTE_METHODS,
    default_ffn_hidden_size,
)

RECOMPUTE_GRANULARITIES = ("full", "selective")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
_NO_EFFECT_KERNEL = ("accepted, no effect: a kernel choice; the computed function is the same")


class ArgumentError(ValueError):
    """A command-line or DeepSpeed-config problem, described in one line."""


# -------------------- bookkeeping shared with megatron_lite.arguments ---------------------------


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def describe(args: argparse.Namespace, dest: str) -> str:
    """Where a value came from, for error messages: '--flag 4' or 'key 4 in ds.json'."""
    value = getattr(args, dest)
    if dest in args.ds_config_sources:
        key, source = args.ds_config_sources[dest]
        return f"{key} in {source}" if isinstance(value, bool) else f"{key} {value} in {source}"
    if dest in args.derived_values:
        return f"derived {dest.replace('_', ' ')} {value}"
    return flag(dest) if isinstance(value, bool) else f"{flag(dest)} {value}"


def derive(args: argparse.Namespace, dest: str, value: Any) -> None:
    """Fill ``dest`` with a value computed from others; a re-validation recomputes it."""
    setattr(args, dest, value)
    args.derived_values[dest] = value


def int_or_float(text: str) -> int | float:
    """Megatron-LM reads --rotary-base as an int; scripts also write 5e5 or 1e6."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None


# -------------------- parser -------------------------------------------------------------------


def add_model_args(group: argparse._ArgumentGroup) -> None:
    """Shape, initialization and the GPT-2 / Llama architecture switches."""
    group.add_argument("--num-layers", type=int, default=None, help="Transformer blocks.")
    group.add_argument("--hidden-size", type=int, default=None, help="Model width.")
    group.add_argument("--num-attention-heads", type=int, default=None, help="Attention heads.")
    group.add_argument("--seq-length", type=int, default=None, help="Tokens per sample.")
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Longest sequence the model accepts; with learned positions, the "
                       "rows of their table (default: --seq-length).")
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="MLP inner width (default: 4 x --hidden-size; with --swiglu, "
                       "2/3 of that rounded down to a multiple of 64, as Megatron-LM).")
    group.add_argument("--kv-channels", type=int, default=None,
                       help="Channels per attention head (default: --hidden-size / "
                       "--num-attention-heads; when given, the hidden size need not divide).")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocabulary to a multiple of this (default: 128).")
    group.add_argument("--hidden-dropout", type=float, default=0.1,
                       help="Dropout after attention and MLP (default: 0.1).")
    group.add_argument("--attention-dropout", type=float, default=0.1,
                       help="Dropout on attention probabilities (default: 0.1).")
    group.add_argument("--init-method-std", type=float, default=0.02,
                       help="Std of the normal weight init (default: 0.02).")
    group.add_argument("--layernorm-epsilon", type=float, default=1e-5,
                       help="Epsilon of every LayerNorm or RMSNorm (default: 1e-5).")
    # Positions. The default is None so that the deprecated spellings can be told apart from
    # an explicit choice (a contradiction between them is an error).
    group.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES,
                       default=None, help="learned_absolute (GPT-2's table), rope (rotary, "
                       "Llama) or none (default: learned_absolute).")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="Megatron-DeepSpeed's spelling of --position-embedding-type rope.")
    group.add_argument("--no-position-embedding", action="store_false",
                       dest="add_position_embedding",
                       help="Megatron-DeepSpeed: no learned position table (with "
                       "--use-rotary-position-embeddings: rotary positions; alone: none).")
    group.add_argument("--rotary-base", "--rotary-position-embeddings-theta", type=int_or_float,
                       default=10000, help="Base (theta) of the rotary frequencies: 10000 "
                       "for Llama 2, 500000 for Llama 3 (default: 10000).")
    group.add_argument("--rotary-percent", type=float, default=1.0,
                       help="Fraction of each head's channels that rotary positions rotate "
                       "(default: 1.0).")
    group.add_argument("--normalization", default="LayerNorm",
                       help="LayerNorm or RMSNorm, any case (Megatron-DeepSpeed writes "
                       "rmsnorm) (default: LayerNorm).")
    group.add_argument("--apply-layernorm-1p", action="store_true",
                       help="Accepted; trains the same network: Megatron stores each norm gain "
                       "as 1 + w with w from 0, which matters under weight decay (gains get "
                       "none here) and in precision (master weights are fp32 here; only a "
                       "16-bit working copy of a gain rounds differently).")
    group.add_argument("--swiglu", action="store_true",
                       help="SwiGLU MLP: silu(x W_gate) * (x W_up), then W_down (Llama).")
    group.add_argument("--group-query-attention", action="store_true",
                       help="Grouped-query attention with --num-query-groups key/value heads.")
    group.add_argument("--num-query-groups", type=int, default=None,
                       help="Key/value heads with --group-query-attention (default then: 1, "
                       "as Megatron-LM); an error without it.")
    group.add_argument("--num-key-value-heads", type=int, default=None,
                       help="Megatron-DeepSpeed: key/value heads; equal to "
                       "--num-attention-heads means multi-head attention.")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="Give the LM head its own weight instead of the embedding table.")
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                       help="No biases on the attention and MLP linears (Llama).")
    group.add_argument("--add-bias-linear", action="store_true", dest="add_bias_linear",
                       default=True, help="Biases on the attention and MLP linears (default).")


def add_recompute_args(group: argparse._ArgumentGroup) -> None:
    """Activation recomputation: Megatron-LM's flags and the older Megatron-DeepSpeed ones."""
    group.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                       help="full: recompute whole layers in backward; selective: keep each "
                       "layer's activations but the core attention's (scores, softmax, "
                       "dropout), recomputed in backward.")
    group.add_argument("--recompute-activations", action="store_true",
                       help="Megatron-LM: the same as --recompute-granularity selective.")
    group.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None,
                       help="With full granularity: uniform (chunks of --recompute-num-layers "
                       "layers) or block (only the first --recompute-num-layers layers) "
                       "(default: uniform).")
    group.add_argument("--recompute-num-layers", type=int, default=None,
                       help="With full granularity: layers per chunk (uniform) or layers "
                       "recomputed (block) (default: 1).")
    group.add_argument("--checkpoint-activations", action="store_true",
                       help="Older spelling of --recompute-granularity full "
                       "--recompute-method uniform.")
    group.add_argument("--checkpoint-num-layers", type=int, default=1,
                       help="Older spelling of --recompute-num-layers (default: 1).")
    group.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                       help="Accepted for Megatron-DeepSpeed compatibility; recomputation is "
                       "turned on by the flags above.")


def add_kernel_args(group: argparse._ArgumentGroup) -> None:
    """Kernel choices of Megatron's scripts: accepted, no effect."""
    group.add_argument("--use-flash-attn", "--use-flash-attn-v1", "--use-flash-attn-v2",
                       "--use-flash-attn-triton", action="store_true", dest="use_flash_attn",
                       help="Accepted, no effect: attention always runs through torch's "
                       "scaled_dot_product_attention, which picks flash attention on the GPU "
                       "(the -v1, -v2, -triton spellings are Megatron-DeepSpeed's).")
    group.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                       help="Accepted, no effect: scaled_dot_product_attention picks the "
                       "kernel.")
    for name, dest in (("--no-masked-softmax-fusion", "masked_softmax_fusion"),
                       ("--no-bias-gelu-fusion", "bias_gelu_fusion"),
                       ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
                       ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
                       ("--no-rope-fusion", "apply_rope_fusion"),
                       ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
                       ("--no-async-tensor-model-parallel-allreduce",
                        "async_tensor_model_parallel_allreduce")):
        group.add_argument(name, action="store_false", dest=dest, help=_NO_EFFECT_KERNEL + ".")
    group.add_argument("--cross-entropy-loss-fusion", action="store_true",
                       help=_NO_EFFECT_KERNEL + ".")
    group.add_argument("--apply-query-key-layer-scaling", action="store_true",
                       dest="apply_query_key_layer_scaling",
                       help="Accepted, no effect: scaling Q.K^T by 1/layer and the softmax "
                       "input back by layer is a numerical no-op in an fp32 (or bf16-range) "
                       "softmax, which this model always uses.")
    group.add_argument("--no-query-key-layer-scaling", action="store_false",
                       dest="apply_query_key_layer_scaling",
                       help="Accepted, no effect (see --apply-query-key-layer-scaling).")
    group.add_argument("--use-mcore-models", action="store_true",
                       help="Accepted, no effect: there is one GPT implementation.")


# -------------------- validation -----------------------------------------------------------------


def check_model_shape(args: argparse.Namespace) -> None:
    """The architecture switches resolved and checked; fills the derived values (default
    position type, query groups, FFN width, max positions, recomputation)."""
    _resolve_positions(args)
    _resolve_normalization(args)
    _resolve_query_groups(args)
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ArgumentError(f"--hidden-size {args.hidden_size} is not divisible by "
                            f"--num-attention-heads {args.num_attention_heads} (or give "
                            "--kv-channels)")
    if args.ffn_hidden_size is None:
        derive(args, "ffn_hidden_size", default_ffn_hidden_size(args.hidden_size, args.swiglu))
    if args.max_position_embeddings is None:
        derive(args, "max_position_embeddings", args.seq_length)
    if args.seq_length > args.max_position_embeddings:
        raise ArgumentError(f"--seq-length {args.seq_length} exceeds "
                            f"--max-position-embeddings {args.max_position_embeddings}")
    _resolve_recomputation(args)
    try:  # every rule of GPTConfig itself (rotary channels, ...) as a command-line error
        gpt_config_from_args(args, vocab_size=1)
    except ValueError as error:
        raise ArgumentError(f"the model flags describe no valid GPT: {error}") from None


def _resolve_positions(args: argparse.Namespace) -> None:
    chosen = args.position_embedding_type
    if args.use_rotary_position_embeddings and chosen not in (None, "rope"):
        raise ArgumentError(f"--position-embedding-type {chosen} contradicts "
                            "--use-rotary-position-embeddings (rope); keep one")
    if not args.add_position_embedding and chosen == "learned_absolute":
        raise ArgumentError("--position-embedding-type learned_absolute contradicts "
                            "--no-position-embedding; keep one")
    if chosen is None:
        implied = "rope" if args.use_rotary_position_embeddings else \
            "none" if not args.add_position_embedding else "learned_absolute"
        derive(args, "position_embedding_type", implied)
    if args.position_embedding_type != "rope":
        for dest, default in (("rotary_base", 10000), ("rotary_percent", 1.0)):
            # Megatron ignores them without rope; a value set for nothing is surely a mistake.
            if getattr(args, dest) != default:
                raise ArgumentError(f"{flag(dest)} {getattr(args, dest)} applies to rotary "
                                    "positions only: add --position-embedding-type rope or "
                                    f"drop it (positions: {args.position_embedding_type})")


def _resolve_normalization(args: argparse.Namespace) -> None:
    canonical = {name.lower(): name for name in NORMALIZATIONS}.get(str(args.normalization).lower())
    if canonical is None:
        raise ArgumentError(f"--normalization {args.normalization}: use "
                            f"{' or '.join(NORMALIZATIONS)} (any case)")
    args.normalization = canonical


def _resolve_query_groups(args: argparse.Namespace) -> None:
    heads, groups, kv_heads = (args.num_attention_heads, args.num_query_groups,
                               args.num_key_value_heads)
    for dest in ("num_query_groups", "num_key_value_heads"):
        if getattr(args, dest) is not None and getattr(args, dest) <= 0:
            raise ArgumentError(f"{flag(dest)} {getattr(args, dest)} must be positive")
    if groups is not None and not args.group_query_attention:
        # Megatron-LM silently ignores the group count without the switch: surely a mistake.
        raise ArgumentError(f"--num-query-groups {groups} needs --group-query-attention "
                            "(without it Megatron-LM ignores the groups)")
    if kv_heads is not None:
        if groups is not None and groups != kv_heads:
            raise ArgumentError(f"--num-query-groups {groups} contradicts "
                                f"--num-key-value-heads {kv_heads}; keep one")
        if groups is None:
            derive(args, "num_query_groups", kv_heads)
    elif args.group_query_attention and groups is None:
        derive(args, "num_query_groups", 1)  # Megatron-LM's default: one key/value head
    groups = args.num_query_groups
    if groups is not None and heads % groups:
        spelled = "--num-key-value-heads" if kv_heads is not None else "--num-query-groups"
        raise ArgumentError(f"--num-attention-heads {heads} is not divisible by "
                            f"{spelled} {groups}")


def _resolve_recomputation(args: argparse.Namespace) -> None:
    """-> checkpoint_activations / recompute_method / checkpoint_num_layers (full) or
    recompute_attention (selective), the GPTConfig fields."""
    # Values derived by an earlier validation were reset to None (``_forget_derived_values``),
    # so what is set here was given.
    granularity = args.recompute_granularity
    if args.recompute_activations:
        if granularity == "full":
            raise ArgumentError("--recompute-activations (selective) contradicts "
                                "--recompute-granularity full; keep one")
        granularity = "selective"
    if args.checkpoint_activations:
        if granularity == "selective":
            given = "--recompute-activations" if args.recompute_activations \
                else "--recompute-granularity selective"
            raise ArgumentError(f"--checkpoint-activations (full recomputation) contradicts "
                                f"{given}; keep one")
        granularity = "full"
    if granularity != "full":
        for dest in ("recompute_method", "recompute_num_layers"):
            if getattr(args, dest) is not None:
                raise ArgumentError(f"{flag(dest)} {getattr(args, dest)} needs "
                                    "--recompute-granularity full (Megatron-LM refuses it "
                                    f"otherwise; granularity: {granularity or 'none'})")
    if args.recompute_granularity is None and granularity is not None:
        derive(args, "recompute_granularity", granularity)
    full = granularity == "full"
    if full and not args.checkpoint_activations:
        derive(args, "checkpoint_activations", True)
    args.recompute_attention = granularity == "selective"
    if args.recompute_method is None:
        derive(args, "recompute_method", "uniform")
    if args.recompute_num_layers is not None:
        given_old = "checkpoint_num_layers" in args.explicit_args
        if given_old and args.checkpoint_num_layers != args.recompute_num_layers:
            raise ArgumentError(f"--checkpoint-num-layers {args.checkpoint_num_layers} "
                                f"contradicts --recompute-num-layers "
                                f"{args.recompute_num_layers}; keep one")
        if args.recompute_num_layers > args.num_layers:
            raise ArgumentError(f"--recompute-num-layers {args.recompute_num_layers} exceeds "
                                f"--num-layers {args.num_layers}")
        derive(args, "checkpoint_num_layers", args.recompute_num_layers)
    elif args.checkpoint_num_layers is None:  # forgotten by a re-validation
        derive(args, "checkpoint_num_layers", 1)
    args.checkpoint_activations = bool(args.checkpoint_activations)


# -------------------- the GPTConfig --------------------------------------------------------------


def gpt_config_from_args(args: argparse.Namespace, vocab_size: int):
    """The GPT the command line describes (``validate_args`` must have run)."""
    from megatron_lite.model import GPTConfig

    heads = args.num_attention_heads
    # Spelled-out defaults are stored as the defaults, so that a checkpoint compares equal
    # however its run spelled them (--num-key-value-heads 32 with 32 heads is MHA).
    groups = args.num_query_groups if args.num_query_groups != heads else None
    kv_channels = args.kv_channels
    if kv_channels is not None and kv_channels * heads == args.hidden_size:
        kv_channels = None
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        vocab_size=vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        layernorm_epsilon=args.layernorm_epsilon,
        checkpoint_activations=args.checkpoint_activations,
        checkpoint_num_layers=args.checkpoint_num_layers,
        recompute_method=args.recompute_method,
        recompute_attention=args.recompute_attention,
        seed=args.seed,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        normalization=args.normalization,
        swiglu=args.swiglu,
        num_query_groups=groups,
        kv_channels=kv_channels,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=args.add_bias_linear,
    )
