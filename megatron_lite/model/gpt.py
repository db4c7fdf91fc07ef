"""Megatron-LM's GPT: a pre-norm decoder-only transformer, GPT-2 or Llama style.

Module tree (the sharding engine attaches its hooks to these modules, so the names are part
of the interface):

    GPTModel
      embedding: Embedding            word_embeddings (padded_vocab, h)
                                      [position_embeddings (max_pos, h): learned positions]
      layers: ModuleList[TransformerLayer]
        input_layernorm -> attention (query_key_value, [rotary], sdpa, dense) -> + residual
        post_attention_layernorm -> mlp (dense_h_to_4h, gelu | swiglu, dense_4h_to_h)
                                                                          -> + residual
      final_layernorm
      [output_layer (padded_vocab, h): untied LM head]
    logits = final_layernorm(x) @ (output_layer or embedding.word_embeddings).weight.T

GPTConfig's switches choose each part: learned positions or rotary (RoPE) applied to queries
and keys; LayerNorm or RMSNorm (the modules keep Megatron's "layernorm" names either way);
a GELU MLP or SwiGLU; multi-head or grouped-query attention; a tied or untied LM head; linears
with or without biases. The defaults are GPT-2.

The fused query_key_value projection produces [q | k | v]: nh*d query channels, then
groups*d key and groups*d value channels, heads contiguous inside each. With GPT-2 shapes
that is Hugging Face GPT-2's c_attn (the Conv1D weight transposed); with grouped queries it
is Llama's q_proj, k_proj and v_proj stacked. SwiGLU's dense_h_to_4h is [gate | up], as in
Megatron, so Llama's gate_proj and up_proj stack into it.

Initial values are a pure function of (config.seed, parameter name): `initial_value` is what
lets a sharded engine materialize only its own slice of a meta-device model and still get
the same model at any world size.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_lite.model.config import GPTConfig

# Output projections write into the residual stream once per layer, so Megatron (after GPT-2)
# scales their init by 1/sqrt(2L) to keep the residual's variance independent of depth.
SCALED_INIT_MODULES = ("attention.dense", "mlp.dense_4h_to_h")
NORM_MODULES = (nn.LayerNorm, nn.RMSNorm)


def build_norm(config: GPTConfig) -> nn.Module:
    """LayerNorm (scale and bias) or RMSNorm (scale only), as config.normalization says."""
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


@dataclass(frozen=True)
class RotaryTables:
    """cos and sin of every (position, frequency) pair, each (B or 1, 1, T, rotary_dim)."""

    cos: torch.Tensor
    sin: torch.Tensor


def rotary_tables(position_ids: torch.Tensor, config: GPTConfig,
                  dtype: torch.dtype) -> RotaryTables:
    """RoPE's tables for `position_ids` (B or 1, T), computed in fp32 then cast to `dtype`.

    Frequencies base^(-2i/rotary_dim) for i < rotary_dim/2, each used twice ([f | f], the
    "rotate half" layout of Megatron-LM and Hugging Face Llama, not the interleaved one).
    Positions beyond a few thousand lose precision in 16-bit angles, hence fp32 here.
    """
    rotary_dim = config.rotary_dim
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64,
                             device=position_ids.device).float() / rotary_dim
    inverse_frequencies = 1.0 / (config.rotary_base ** exponents)  # (rotary_dim/2,)
    angles = position_ids.float()[..., None] * inverse_frequencies  # (B or 1, T, rotary_dim/2)
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # (B or 1, 1, T, rotary_dim)
    return RotaryTables(angles.cos().to(dtype), angles.sin().to(dtype))


def apply_rotary(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """Rotate the first rotary_dim channels of every head of x (B, heads, T, d)."""
    rotary_dim = tables.cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rotated.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    rotated = rotated * tables.cos + rotated_half * tables.sin
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated


class Embedding(nn.Module):
    """Token embeddings, plus learned position embeddings for GPT-2, then dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                    config.hidden_size)
        self.dropout_p = config.hidden_dropout

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # (B, T, C)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)  # + (B or 1, T, C)
        return F.dropout(x, self.dropout_p, self.training)  # (B, T, C)


class SelfAttention(nn.Module):
    """Causal self-attention with one fused QKV projection, multi-head or grouped-query.

    nh query heads share groups = num_key_value_heads key/value heads, nh/groups each (query
    head i reads group i // (nh/groups)). Scores go through scaled_dot_product_attention,
    which runs flash attention on the GPU.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.dropout_p = config.attention_dropout
        self.recompute_core = config.recompute_attention
        self.query_key_value = nn.Linear(config.hidden_size, config.qkv_size,
                                         bias=config.add_bias_linear)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size,
                               bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor, rotary: RotaryTables | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        nh, ng, d = self.num_heads, self.num_groups, self.head_dim
        qkv = self.query_key_value(x)  # (B, T, (nh + 2*ng)*d)
        q, k, v = qkv.split((nh * d, ng * d, ng * d), dim=2)
        q = q.view(B, T, nh, d).transpose(1, 2)  # (B, nh, T, d)
        k = k.view(B, T, ng, d).transpose(1, 2)  # (B, ng, T, d)
        v = v.view(B, T, ng, d).transpose(1, 2)  # (B, ng, T, d)
        if rotary is not None:
            q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            # Selective recomputation: the s x s scores, softmax and dropout mask are the
            # largest activations of a layer and the cheapest to redo (Korthikanti et al.).
            # The random state is kept for the recompute only where dropout draws from it:
            # reading it is a host op, and one a CUDA graph capture refuses.
            y = checkpoint(self._core_attention, q, k, v, use_reentrant=False,
                           preserve_rng_state=self.dropout_p > 0)
        else:
            y = self._core_attention(q, k, v)  # (B, nh, T, d)
        y = y.transpose(1, 2).reshape(B, T, nh * d)  # (B, T, nh*d)
        return self.dense(y)  # (B, T, C)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> torch.Tensor:
        dropout_p = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                              enable_gqa=self.num_groups != self.num_heads)


class MLP(nn.Module):
    """Position-wise feed-forward block: GPT-2's tanh-approximated GELU, or SwiGLU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.ffn_hidden_size is not None  # filled in by GPTConfig.__post_init__
        self.swiglu = config.swiglu
        inner = 2 * config.ffn_hidden_size if config.swiglu else config.ffn_hidden_size
        self.dense_h_to_4h = nn.Linear(config.hidden_size, inner, bias=config.add_bias_linear)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size,
                                       bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dense_h_to_4h(x)  # (B, T, F) or, for SwiGLU, (B, T, 2F)
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)  # 2 x (B, T, F)
            x = F.silu(gate) * up
        else:
            # tanh approximation: bit-compatible with HF GPT-2's "gelu_new" checkpoints
            x = F.gelu(x, approximate="tanh")
        return self.dense_4h_to_h(x)  # (B, T, C)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.input_layernorm = build_norm(config)
        self.attention = SelfAttention(config)
        self.post_attention_layernorm = build_norm(config)
        self.mlp = MLP(config)
        self.dropout_p = config.hidden_dropout

    def forward(self, x: torch.Tensor, rotary: RotaryTables | None = None) -> torch.Tensor:
        attention_out = self.attention(self.input_layernorm(x), rotary)  # (B, T, C)
        x = x + F.dropout(attention_out, self.dropout_p, self.training)
        mlp_out = self.mlp(self.post_attention_layernorm(x))  # (B, T, C)
        return x + F.dropout(mlp_out, self.dropout_p, self.training)  # (B, T, C)


@dataclass(frozen=True)
class _InitRule:
    """How one parameter starts: normal(0, std) when std is set, else filled with constant."""

    shape: tuple[int, ...]
    std: float | None = None
    constant: float = 0.0


class GPTModel(nn.Module):
    """GPT language model; forward maps token ids (B, T) to logits (B, T, padded_vocab).

    Built on a real device it is initialized at once; built under `torch.device("meta")`
    it allocates nothing, and `to_empty(device=...)` followed by `init_weights()` gives the
    identical model.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.final_layernorm = build_norm(config)
        self.output_layer = None
        if config.untie_embeddings_and_output_weights:
            self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size,
                                          bias=False)
        # Recorded now, while every parameter still has its full shape: a sharding engine may
        # later swap parameters for flat shards, and initial values must not change with it.
        self._init_rules = {name: self._init_rule(name, param)
                            for name, param in self.named_parameters()}
        if not self.embedding.word_embeddings.weight.is_meta:
            self.init_weights()

    # ----------------------------------------------------------------------------------
    # forward

    def forward(self, input_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        position_ids = self._checked_positions(input_ids, position_ids)  # (B or 1, T)
        x = self.embedding(input_ids, position_ids)  # (B, T, C)
        rotary = None
        if self.config.position_embedding_type == "rope":
            rotary = rotary_tables(position_ids, self.config, x.dtype)
        x = self._run_layers(x, rotary)  # (B, T, C)
        x = self.final_layernorm(x)  # (B, T, C)
        if self.output_layer is not None:
            return self.output_layer(x)  # (B, T, padded_vocab)
        # Tied LM head: the output projection is the token embedding table itself.
        return F.linear(x, self.embedding.word_embeddings.weight)  # (B, T, padded_vocab)

    def _checked_positions(self, input_ids: torch.Tensor,
                           position_ids: torch.Tensor | None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D (batch, seq), got shape "
                             f"{tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        seq_length = input_ids.shape[1]
        if seq_length > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq_length} exceeds max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )
        if position_ids is None:
            return torch.arange(seq_length, device=input_ids.device).unsqueeze(0)  # (1, T)
        if position_ids.dim() != 2 or position_ids.shape[-1] != seq_length:
            raise ValueError(f"position_ids must have shape (batch, {seq_length}) or "
                             f"(1, {seq_length}), got {tuple(position_ids.shape)}")
        return position_ids

    def _run_layers(self, x: torch.Tensor, rotary: RotaryTables | None) -> torch.Tensor:
        recompute = (self.config.checkpoint_activations and self.training
                     and torch.is_grad_enabled())
        if not recompute:
            return _forward_layers(self.layers, x, rotary)
        chunk_size = self.config.checkpoint_num_layers
        if self.config.recompute_method == "block":
            # Megatron's "block": each of the first N layers is checkpointed on its own, the
            # rest keep their activations (use the memory that is left, recompute no more).
            checkpointed = min(chunk_size, len(self.layers))
            chunks = [self.layers[i:i + 1] for i in range(checkpointed)]
        else:
            checkpointed = len(self.layers)
            chunks = [self.layers[start:start + chunk_size]
                      for start in range(0, checkpointed, chunk_size)]
        for chunk in chunks:
            # early_stop=False: the recompute must run every layer of the chunk to its end so
            # that each layer's forward hooks fire again (the sharding engine re-gathers and
            # releases weights from them); early stopping would cut the last layer short.
            # The random state is kept for the recompute only where dropout draws from it
            # (reading it is a host op, and one a CUDA graph capture refuses).
            x = checkpoint(functools.partial(_forward_layers, chunk), x, rotary,
                           use_reentrant=False, early_stop=False,
                           preserve_rng_state=self.config.uses_dropout)
        return _forward_layers(self.layers[checkpointed:], x, rotary)

    # ----------------------------------------------------------------------------------
    # initialization

    def initial_value(self, name: str, param: torch.Tensor | None = None) -> torch.Tensor:
        """The full initial value (fp32, CPU) of the parameter called `name`.

        A function of config.seed and the name only, never of construction order, device or
        of what the sharding engine has done to the parameter since. When `param` is given
        (e.g. a flattened view of it) the value is reshaped to param's shape.
        """
        rule = self._init_rules.get(name)
        if rule is None:
            raise KeyError(f"GPTModel has no parameter named {name!r}")
        if rule.std is None:
            value = torch.full(rule.shape, rule.constant, dtype=torch.float32)
        else:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(_parameter_seed(self.config.seed, name))
            value = torch.empty(rule.shape, dtype=torch.float32)
            value.normal_(mean=0.0, std=rule.std, generator=generator)
        if param is None:
            return value
        if param.numel() != value.numel():
            raise ValueError(f"{name}: param has {param.numel()} elements, the parameter "
                             f"has {value.numel()} (shape {rule.shape})")
        return value.view(param.shape)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Overwrite every parameter, in place and in its own dtype/device, with its
        initial value (call after `to_empty` on a meta-built model)."""
        for name, param in self.named_parameters():
            if param.is_meta:
                raise RuntimeError(f"{name} is on the meta device; call "
                                   f"model.to_empty(device=...) before init_weights()")
            param.copy_(self.initial_value(name, param))

    def _init_rule(self, name: str, param: torch.Tensor) -> _InitRule:
        module_name, _, kind = name.rpartition(".")
        module = self.get_submodule(module_name)
        shape = tuple(param.shape)
        std = self.config.init_method_std
        if isinstance(module, NORM_MODULES):
            return _InitRule(shape, constant=1.0 if kind == "weight" else 0.0)
        if isinstance(module, nn.Embedding):
            return _InitRule(shape, std=std)
        if isinstance(module, nn.Linear) and kind == "bias":
            return _InitRule(shape, constant=0.0)
        if isinstance(module, nn.Linear) and module_name.endswith(SCALED_INIT_MODULES):
            return _InitRule(shape, std=std / math.sqrt(2.0 * self.config.num_layers))
        if isinstance(module, nn.Linear):
            return _InitRule(shape, std=std)
        raise TypeError(f"no initialization rule for {name} ({type(module).__name__})")

    # ----------------------------------------------------------------------------------

    def num_parameters(self) -> int:
        """Number of distinct parameters (the tied head shares the embedding's)."""
        return sum(param.numel() for param in self.parameters())


# [Note: chunked cross-entropy] The loss of a micro-batch needs the log-sum-exp of every
# token's logits in fp32 (in 16 bits it loses the small probabilities). Casting the whole
# (tokens, vocab) logits to fp32 holds a copy twice their 16-bit size, and autograd's
# backward of that cast another fp32 gradient of the same size: at Llama 3 8B's 8K tokens
# and 128K vocabulary 4 GiB each, the largest transient of such a run. The loss below walks
# the tokens in chunks: forward keeps one fp32 value per token (its log-sum-exp), backward
# recomputes each chunk's softmax in fp32 and writes its gradient straight into a 16-bit
# buffer. Values and gradients are F.cross_entropy's (the same fp32 arithmetic per row).
LOSS_CHUNK_ELEMENTS = 1 << 26  # fp32 values of one chunk: 256 MiB


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                chunk_rows: int) -> torch.Tensor:
        rows = logits.shape[0]
        losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            chunk = logits[start:end].float()
            lse[start:end] = torch.logsumexp(chunk, dim=-1)
            target = chunk.gather(1, safe_labels[start:end, None]).squeeze(1)
            losses[start:end] = (lse[start:end] - target) * valid[start:end]
        ctx.save_for_backward(logits, safe_labels, valid, lse)
        ctx.chunk_rows = chunk_rows
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        logits, labels, valid, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        scale = grad_losses.float() * valid
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            end = min(start + ctx.chunk_rows, logits.shape[0])
            probs = (logits[start:end].float() - lse[start:end, None]).exp_()
            probs.scatter_add_(1, labels[start:end, None],
                               torch.full((end - start, 1), -1.0, device=probs.device))
            grad[start:end] = probs.mul_(scale[start:end, None])
        return grad, None, None, None


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                          chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> torch.Tensor:
    """Per-token cross-entropy of ``logits`` (tokens, vocab) in any float dtype, computed in
    fp32 chunk by chunk ([Note: chunked cross-entropy]); ``F.cross_entropy(logits.float(),
    labels, reduction="none")``'s values and gradients without its fp32 copies."""
    rows = max(1, chunk_elements // max(1, logits.shape[-1]))
    return _ChunkedCrossEntropy.apply(logits, labels, ignore_index, rows)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens where loss_mask is nonzero, in fp32.

    logits (B, T, V) in any dtype; labels (B, T) token ids; loss_mask (B, T) of 0/1 (bool or
    float). A batch whose mask is all zero yields 0 with zero gradient rather than NaN, so an
    all-padding micro-batch cannot poison the accumulated gradient.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be (batch, seq, vocab), got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:2] or loss_mask.shape != logits.shape[:2]:
        raise ValueError(f"labels {tuple(labels.shape)} and loss_mask "
                         f"{tuple(loss_mask.shape)} must both have shape "
                         f"{tuple(logits.shape[:2])}")
    vocab = logits.shape[-1]
    # fp32 softmax (in fp16/bf16 the log-sum-exp over 50K logits loses the small
    # probabilities), a chunk of tokens at a time ([Note: chunked cross-entropy]).
    token_losses = chunked_cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
    mask = loss_mask.reshape(-1).float()  # (B*T,)
    return (token_losses * mask).sum() / mask.sum().clamp(min=1.0)


def _forward_layers(layers: Sequence[nn.Module], x: torch.Tensor,
                    rotary: RotaryTables | None = None) -> torch.Tensor:
    # layer(x), not layer.forward(x): module hooks must fire, also when recomputing.
    for layer in layers:
        x = layer(x, rotary)
    return x


def _parameter_seed(model_seed: int, name: str) -> int:
    # The CPU generator (mt19937) keeps only the low 32 bits of its seed, so seed and name
    # are hashed together into 32 bits rather than packed side by side. crc32, not hash():
    # Python salts str hashes per process, and every rank must derive the same value.
    return zlib.crc32(f"{model_seed}/{name}".encode())
