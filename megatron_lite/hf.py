"""Conversion between `GPTModel` and Hugging Face checkpoints: GPT-2 and Llama.

`from_hf` reads either architecture (dispatching on `config.model_type`); `to_hf` writes the
one a `GPTConfig` describes: GPT-2 for learned positions, LayerNorm, GELU, biases and a tied
head; Llama (`megatron_lite.hf_llama`) for rotary positions, RMSNorm and SwiGLU. Any other
mix of Megatron's switches has no Hugging Face counterpart here and is refused.

GPT-2 is the same network as GPTModel's defaults under different names, with three
differences in storage that the converter handles:

- HF GPT-2 keeps its projections in `Conv1D` modules whose weight is (in, out), the
  transpose of `nn.Linear`'s (out, in).
- Our embedding table is padded to a multiple of `make_vocab_size_divisible_by`; the padded
  rows are dropped on export and, on import, get the values our own initialization gives
  them, so an imported model equals a freshly initialized one wherever HF has no data.
- Both tie the LM head to the token embeddings, so only the embedding is stored.

Everything is local: a directory is read with `local_files_only=True`, nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
)

from megatron_lite.hf_llama import (
    LLAMA_NEEDS,
    check_loading_info,
    gpt_config_from_llama,
    llama_config_from_gpt,
    llama_from_hf,
    llama_problems,
    llama_to_hf,
    load_llama,
)
from megatron_lite.hf_tensors import (
    TensorMapping,
    hf_state_from_model,
    model_from_hf_state,
    write_hf_directory,
)
from megatron_lite.model import GPTConfig, GPTModel

# Activations numerically identical to F.gelu(approximate="tanh"), the one GPTModel uses.
TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh")
# GPT-2's tokenizer puts <|endoftext|> (its BOS and EOS) at the last of its 50257 ids.
GPT2_END_OF_TEXT_ID = 50256
SUPPORTED_MODEL_TYPES = ("gpt2", "llama")
HF_MODEL_CLASSES = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}
# What each Hugging Face architecture needs, for the error that names a mix neither has.
REQUIREMENTS = ("GPT-2 needs learned positions, LayerNorm, GELU, biases, a tied head and "
                f"one key/value head per query head; {LLAMA_NEEDS}")


def from_hf(path_or_model: str | os.PathLike | PreTrainedModel, *,
            make_vocab_size_divisible_by: int = 128, seed: int = 1234) -> GPTModel:
    """Build an fp32 CPU `GPTModel` holding the weights of a Hugging Face GPT-2 or Llama.

    `path_or_model` is a local checkpoint directory (config.json + weights) or a
    `GPT2LMHeadModel` / `LlamaForCausalLM` instance. `seed` only decides the padded
    vocabulary rows, which HF does not have, and becomes the seed of the returned model's
    config.
    """
    hf_model = _load_hf_model(path_or_model)
    if hf_model.config.model_type == "llama":
        return llama_from_hf(hf_model, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                             seed=seed)
    config = gpt_config_from_hf(hf_model.config,
                                make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                seed=seed)
    return model_from_hf_state(config, hf_model.state_dict(), _tensor_pairs(config.num_layers),
                               "GPT-2")


def to_hf(model: GPTModel, out_dir: str | os.PathLike, *, bos_token_id: int | None = None,
          eos_token_id: int | None = None) -> None:
    """Write `model` as the Hugging Face checkpoint directory its config describes (see
    `hf_architecture`): GPT-2 (config.json + model.safetensors, `GPT2LMHeadModel`) or Llama
    (plus generation_config.json, `LlamaForCausalLM`).

    The model must hold full parameters (not sharded, not on the meta device); tensors are
    written in the parameters' own dtype. bos/eos ids belong to the tokenizer: written when
    given; otherwise GPT-2 gets its <|endoftext|> when the vocabulary is as large as GPT-2's
    and Llama gets none. HF Llama has no hidden dropout: a Llama-shaped model trained with
    hidden_dropout > 0 exports without it (dropout only acts in training).
    """
    if hf_architecture(model.config) == "llama":
        llama_to_hf(model, out_dir, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
        return
    config = model.config
    hf_config = hf_config_from_gpt(config, bos_token_id=bos_token_id,
                                   eos_token_id=eos_token_id)
    tensors = hf_state_from_model(model, _tensor_pairs(config.num_layers))
    write_hf_directory(out_dir, hf_config, tensors, next(model.parameters()).dtype)


def hf_architecture(config: GPTConfig) -> str:
    """"gpt2" or "llama": the Hugging Face architecture that represents `GPTModel(config)`;
    ValueError (one line) naming the mix of switches that neither represents."""
    gpt2, llama = gpt2_problems(config), llama_problems(config)
    if not llama:
        return "llama"
    if not gpt2:
        return "gpt2"
    # Positions decide which architecture the model was meant to be; name what breaks it.
    if config.position_embedding_type == "rope":
        mix = "rope with " + ", ".join(llama)
    elif config.position_embedding_type == "learned_absolute":
        mix = "learned positions with " + ", ".join(gpt2)
    else:
        mix = f"position_embedding_type {config.position_embedding_type!r}"
    raise ValueError(f"no Hugging Face architecture here can represent {mix} ({REQUIREMENTS})")


def gpt2_problems(config: GPTConfig) -> list[str]:
    """What keeps `config` from being an HF GPT-2, each as a short phrase; [] when it is one."""
    problems = []
    if config.position_embedding_type != "learned_absolute":
        problems.append(f"{config.position_embedding_type} positions")
    if config.normalization != "LayerNorm":
        problems.append(config.normalization)
    if config.swiglu:
        problems.append("SwiGLU")
    if config.num_key_value_heads != config.num_attention_heads:
        problems.append(f"grouped-query attention ({config.num_key_value_heads} key/value "
                        f"heads)")
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        problems.append(f"kv_channels {config.head_dim} (hidden_size / heads is "
                        f"{config.hidden_size / config.num_attention_heads:g})")
    if config.untie_embeddings_and_output_weights:
        problems.append("an untied output layer")
    if not config.add_bias_linear:
        problems.append("linears without biases")
    return problems


def gpt_config_from_hf(hf_config: PreTrainedConfig, *, make_vocab_size_divisible_by: int = 128,
                       seed: int = 1234) -> GPTConfig:
    """The `GPTConfig` of an HF GPT-2 or Llama config; ValueError for features GPTModel
    lacks."""
    model_type = _supported_model_type(hf_config)
    if model_type == "llama":
        return gpt_config_from_llama(hf_config,
                                     make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                     seed=seed)
    _check_representable(hf_config)
    return GPTConfig(
        num_layers=hf_config.n_layer,
        hidden_size=hf_config.n_embd,
        num_attention_heads=hf_config.n_head,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.n_positions,
        ffn_hidden_size=hf_config.n_inner,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        hidden_dropout=float(hf_config.resid_pdrop),
        attention_dropout=float(hf_config.attn_pdrop),
        init_method_std=hf_config.initializer_range,
        layernorm_epsilon=hf_config.layer_norm_epsilon,
        seed=seed,
    )


def hf_config_from_gpt(config: GPTConfig, *, bos_token_id: int | None = None,
                       eos_token_id: int | None = None) -> PreTrainedConfig:
    """The HF `GPT2Config` or `LlamaConfig` describing `GPTModel(config)` (real vocabulary,
    no padding); ValueError when neither can (`hf_architecture`)."""
    if hf_architecture(config) == "llama":
        return llama_config_from_gpt(config, bos_token_id=bos_token_id,
                                     eos_token_id=eos_token_id)
    # GPT-2's end-of-text id only exists in vocabularies as large as GPT-2's own.
    special_id = GPT2_END_OF_TEXT_ID if config.vocab_size > GPT2_END_OF_TEXT_ID else None
    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size,
        activation_function="gelu_new",
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.layernorm_epsilon,
        initializer_range=config.init_method_std,
        bos_token_id=special_id if bos_token_id is None else bos_token_id,
        eos_token_id=special_id if eos_token_id is None else eos_token_id,
        tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
    )


def _load_hf_model(path_or_model: str | os.PathLike | PreTrainedModel) -> PreTrainedModel:
    """The HF model itself, or loaded (fp32) from a local directory after its config has
    been checked, so an unsupported checkpoint fails before gigabytes of weights are read."""
    if isinstance(path_or_model, PreTrainedModel):
        model_type = _supported_model_type(path_or_model.config)
        expected = HF_MODEL_CLASSES[model_type]
        if not isinstance(path_or_model, expected):
            raise TypeError(f"expected a {expected.__name__} for model_type {model_type!r}, "
                            f"got {type(path_or_model).__name__}")
        return path_or_model
    if not isinstance(path_or_model, (str, os.PathLike)):
        raise TypeError(f"expected a checkpoint directory, a GPT2LMHeadModel or a "
                        f"LlamaForCausalLM, got {type(path_or_model).__name__}")
    path = Path(path_or_model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint directory "
                                f"(no config.json)")
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    if _supported_model_type(hf_config) == "llama":
        return load_llama(path)
    _check_representable(hf_config)
    model, info = GPT2LMHeadModel.from_pretrained(path, local_files_only=True,
                                                  dtype=torch.float32, output_loading_info=True)
    check_loading_info(path, info)
    return model


def _supported_model_type(hf_config: object) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported: expected "
                         f"{' or '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)}")
    return model_type


def _check_representable(hf_config: object) -> None:
    if getattr(hf_config, "model_type", None) != "gpt2":
        raise ValueError(f"not a GPT-2 checkpoint: model_type is "
                         f"{getattr(hf_config, 'model_type', None)!r}, expected 'gpt2'")
    unsupported = {
        "activation_function": hf_config.activation_function not in TANH_GELU_NAMES,
        "scale_attn_weights": not hf_config.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx": hf_config.scale_attn_by_inverse_layer_idx,
        "reorder_and_upcast_attn": hf_config.reorder_and_upcast_attn,
        "add_cross_attention": hf_config.add_cross_attention,
        "tie_word_embeddings": not hf_config.tie_word_embeddings,
    }
    for key, is_unsupported in unsupported.items():
        if is_unsupported:
            raise ValueError(f"GPT-2 config has {key}={getattr(hf_config, key)!r}, "
                             f"which GPTModel cannot represent")
    # GPTModel has one hidden dropout for the embeddings and the residual branches.
    if hf_config.embd_pdrop != hf_config.resid_pdrop:
        raise ValueError(f"GPT-2 config has embd_pdrop={hf_config.embd_pdrop} != "
                         f"resid_pdrop={hf_config.resid_pdrop}; GPTModel uses one "
                         f"hidden dropout for both")


def _tensor_pairs(num_layers: int) -> list[TensorMapping]:
    """Every stored tensor of GPT-2 with its GPTModel name, in state-dict order; the
    projections' Conv1D weights are transposed."""
    pairs = [
        TensorMapping("embedding.word_embeddings.weight", ("transformer.wte.weight",)),
        TensorMapping("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
    ]
    for i in range(num_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        for our_module, their_module, has_conv1d_weight in (
            ("input_layernorm", "ln_1", False),
            ("attention.query_key_value", "attn.c_attn", True),
            ("attention.dense", "attn.c_proj", True),
            ("post_attention_layernorm", "ln_2", False),
            ("mlp.dense_h_to_4h", "mlp.c_fc", True),
            ("mlp.dense_4h_to_h", "mlp.c_proj", True),
        ):
            pairs.append(TensorMapping(f"{ours}{our_module}.weight",
                                       (f"{theirs}{their_module}.weight",),
                                       transpose=has_conv1d_weight))
            pairs.append(TensorMapping(f"{ours}{our_module}.bias",
                                       (f"{theirs}{their_module}.bias",)))
    pairs.append(TensorMapping("final_layernorm.weight", ("transformer.ln_f.weight",)))
    pairs.append(TensorMapping("final_layernorm.bias", ("transformer.ln_f.bias",)))
    return pairs
