"""Conversion between `GPTModel` and Hugging Face `LlamaForCausalLM` checkpoints.

A Llama is GPTModel with Megatron's Llama switches (rotary positions, RMSNorm, SwiGLU,
grouped-query attention, untied head, no biases); the converter only renames and restacks:

- Llama's q_proj, k_proj and v_proj (nh*d, groups*d, groups*d rows) stack, in that order,
  into our fused `attention.query_key_value`; gate_proj and up_proj (F rows each) stack into
  SwiGLU's `mlp.dense_h_to_4h` as [gate | up]. Export splits them at the same rows.
- Both use `nn.Linear` weights (out, in) and the "rotate half" rotary layout, so nothing is
  transposed or permuted.
- Our vocabulary (embedding and untied output layer) is padded to a multiple of
  `make_vocab_size_divisible_by`; the padded rows are dropped on export and, on import, get
  the values our own initialization gives them (as for GPT-2).

Hugging Face Llama has no hidden dropout: a model trained with hidden_dropout > 0 exports
as the same network without it (dropout only acts in training), and imports with 0.

Everything is local: a directory is read with `local_files_only=True`, nothing is downloaded.
`megatron_lite.hf` dispatches here on `model_type == "llama"`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megatron_lite.hf_tensors import (
    TensorMapping,
    hf_state_from_model,
    model_from_hf_state,
    write_hf_directory,
)
from megatron_lite.model import GPTConfig, GPTModel

LLAMA_NEEDS = ("Llama needs rope on every channel, RMSNorm, SwiGLU and hidden_size divisible "
               "by the heads")


def llama_from_hf(hf_model: LlamaForCausalLM, *, make_vocab_size_divisible_by: int = 128,
                  seed: int = 1234) -> GPTModel:
    """An fp32 CPU `GPTModel` holding the weights of `hf_model`.

    `seed` only decides the padded vocabulary rows, which HF does not have, and becomes the
    seed of the returned model's config.
    """
    config = gpt_config_from_llama(hf_model.config,
                                   make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                   seed=seed)
    return model_from_hf_state(config, hf_model.state_dict(), _tensor_map(config), "Llama")


def llama_to_hf(model: GPTModel, out_dir: str | os.PathLike, *, bos_token_id: int | None = None,
                eos_token_id: int | None = None) -> None:
    """Write `model` as a Llama checkpoint directory (config.json, generation_config.json,
    model.safetensors) that `LlamaForCausalLM.from_pretrained(out_dir)` loads.

    The model must be Llama-shaped (`llama_problems` is empty) and hold full parameters (not
    sharded, not on the meta device); tensors are written in the parameters' own dtype.
    bos/eos ids belong to the tokenizer, which a GPTModel does not know: they are written
    when given and left unset (None) otherwise. HF Llama has no hidden dropout, so
    `config.hidden_dropout` is dropped (it only acts in training).
    """
    config = model.config
    hf_config = llama_config_from_gpt(config, bos_token_id=bos_token_id,
                                      eos_token_id=eos_token_id)  # refuses other shapes
    tensors = hf_state_from_model(model, _tensor_map(config))
    write_hf_directory(out_dir, hf_config, tensors, next(model.parameters()).dtype,
                       generation_config=True)


def gpt_config_from_llama(hf_config: LlamaConfig, *, make_vocab_size_divisible_by: int = 128,
                          seed: int = 1234) -> GPTConfig:
    """The `GPTConfig` of an HF Llama config; ValueError for features GPTModel lacks."""
    check_llama_representable(hf_config)
    heads = hf_config.num_attention_heads
    kv_heads = hf_config.num_key_value_heads or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return GPTConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        ffn_hidden_size=hf_config.intermediate_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        hidden_dropout=0.0,  # HF Llama has none
        attention_dropout=float(hf_config.attention_dropout or 0.0),
        init_method_std=hf_config.initializer_range,
        layernorm_epsilon=hf_config.rms_norm_eps,
        seed=seed,
        position_embedding_type="rope",
        rotary_base=float(_rope_parameters(hf_config)["rope_theta"]),
        rotary_percent=1.0,
        normalization="RMSNorm",
        swiglu=True,
        # None when they equal the defaults, so a model that round-trips keeps its config
        num_query_groups=kv_heads if kv_heads != heads else None,
        kv_channels=head_dim if head_dim * heads != hf_config.hidden_size else None,
        untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
        add_bias_linear=bool(hf_config.attention_bias),
    )


def llama_config_from_gpt(config: GPTConfig, *, bos_token_id: int | None = None,
                          eos_token_id: int | None = None) -> LlamaConfig:
    """The HF `LlamaConfig` describing the Llama-shaped `GPTModel(config)` (real vocabulary,
    no padding); special token ids only as given."""
    problems = llama_problems(config)
    if problems:
        raise ValueError(f"not a Llama-shaped model: {', '.join(problems)} ({LLAMA_NEEDS})")
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.init_method_std,
        rms_norm_eps=config.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base},
        attention_bias=config.add_bias_linear,
        mlp_bias=config.add_bias_linear,
        attention_dropout=config.attention_dropout,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        architectures=["LlamaForCausalLM"],
    )


def llama_problems(config: GPTConfig) -> list[str]:
    """What keeps `config` from being an HF Llama, each as a short phrase; [] when it is one."""
    problems = []
    if config.position_embedding_type != "rope":
        problems.append(f"{config.position_embedding_type} positions")
    if config.normalization != "RMSNorm":
        problems.append(config.normalization)
    if not config.swiglu:
        problems.append("a GELU MLP")
    if config.position_embedding_type == "rope" and config.rotary_percent != 1.0:
        problems.append(f"rotary_percent {config.rotary_percent}")
    if config.hidden_size % config.num_attention_heads:
        # LlamaConfig validates this even when head_dim is given explicitly
        problems.append(f"hidden_size {config.hidden_size} not divisible by "
                        f"{config.num_attention_heads} heads")
    return problems


def check_llama_representable(hf_config: object) -> None:
    """ValueError (one line) naming the first setting of an HF Llama config GPTModel lacks."""
    if getattr(hf_config, "model_type", None) != "llama":
        raise ValueError(f"not a Llama checkpoint: model_type is "
                         f"{getattr(hf_config, 'model_type', None)!r}, expected 'llama'")
    rope_type = _rope_parameters(hf_config).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"Llama config has rope_type {rope_type!r} (scaled rotary positions), "
                         f"which GPTModel cannot represent: only 'default' rope is supported")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"Llama config has hidden_act={hf_config.hidden_act!r}, which "
                         f"GPTModel cannot represent: its SwiGLU gates with 'silu'")
    if bool(hf_config.attention_bias) != bool(hf_config.mlp_bias):
        raise ValueError(f"Llama config has attention_bias={hf_config.attention_bias} but "
                         f"mlp_bias={hf_config.mlp_bias}; GPTModel has one add_bias_linear "
                         f"switch for both")


def _rope_parameters(hf_config: object) -> dict:
    """rope_theta and rope_type of an HF config: `rope_parameters` in transformers 5,
    `rope_theta` and `rope_scaling` attributes in configs from before it."""
    parameters = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy_scaling = getattr(hf_config, "rope_scaling", None) or {}
    if "rope_type" not in parameters:
        parameters["rope_type"] = legacy_scaling.get("rope_type",
                                                     legacy_scaling.get("type", "default"))
    parameters.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return parameters


def _tensor_map(config: GPTConfig) -> list[TensorMapping]:
    """Our parameters and the HF tensors stacked along dim 0 to make them, in state-dict
    order; q|k|v and gate|up carry the rows of each piece."""
    d, groups, f = config.head_dim, config.num_key_value_heads, config.ffn_hidden_size
    assert f is not None  # filled in by GPTConfig.__post_init__
    qkv_rows = (config.num_attention_heads * d, groups * d, groups * d)
    kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
    mappings = [TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        attn, mlp = f"{theirs}self_attn.", f"{theirs}mlp."
        mappings.append(TensorMapping(f"{ours}input_layernorm.weight",
                                      (f"{theirs}input_layernorm.weight",)))
        for kind in kinds:
            mappings.append(TensorMapping(
                f"{ours}attention.query_key_value.{kind}",
                (f"{attn}q_proj.{kind}", f"{attn}k_proj.{kind}", f"{attn}v_proj.{kind}"),
                rows=qkv_rows))
        for kind in kinds:
            mappings.append(TensorMapping(f"{ours}attention.dense.{kind}",
                                          (f"{attn}o_proj.{kind}",)))
        mappings.append(TensorMapping(f"{ours}post_attention_layernorm.weight",
                                      (f"{theirs}post_attention_layernorm.weight",)))
        for kind in kinds:
            mappings.append(TensorMapping(f"{ours}mlp.dense_h_to_4h.{kind}",
                                          (f"{mlp}gate_proj.{kind}", f"{mlp}up_proj.{kind}"),
                                          rows=(f, f)))
        for kind in kinds:
            mappings.append(TensorMapping(f"{ours}mlp.dense_4h_to_h.{kind}",
                                          (f"{mlp}down_proj.{kind}",)))
    mappings.append(TensorMapping("final_layernorm.weight", ("model.norm.weight",)))
    if config.untie_embeddings_and_output_weights:
        mappings.append(TensorMapping("output_layer.weight", ("lm_head.weight",)))
    return mappings


def load_llama(path: Path) -> LlamaForCausalLM:
    """`LlamaForCausalLM` in fp32 from a local directory, its config checked first so an
    unsupported checkpoint fails before gigabytes of weights are read."""
    hf_config = LlamaConfig.from_pretrained(path, local_files_only=True)
    check_llama_representable(hf_config)
    model, info = LlamaForCausalLM.from_pretrained(path, local_files_only=True,
                                                   dtype=torch.float32, output_loading_info=True)
    check_loading_info(path, info)
    return model


def check_loading_info(path: Path, info: dict) -> None:
    """from_pretrained fills weights missing from the files with random values and only
    warns: an import must refuse them instead of training on noise."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    if missing:
        raise ValueError(f"{path}: the weights lack {len(missing)} tensors, e.g. {missing[0]}")
    if mismatched:
        raise ValueError(f"{path}: tensors of the wrong shape, e.g. {mismatched[0]}")
