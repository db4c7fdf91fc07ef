"""Hugging Face GPT-2 interop: logits parity both ways, padding rows, config mapping, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import GPT2Config, GPT2LMHeadModel

from megatron_lite.hf import from_hf, to_hf
from megatron_lite.model import GPTConfig, GPTModel

VOCAB = 1000  # deliberately not a multiple of 128: exercises the padded rows


def random_hf_model(**overrides) -> GPT2LMHeadModel:
    # initializer_range 0.2 rather than 0.02 makes logits large enough that a wrong
    # transpose, activation or scale shows up far above float rounding
    fields = dict(vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2, n_head=3,
                  initializer_range=0.2, bos_token_id=None, eos_token_id=None)
    fields.update(overrides)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**fields)).eval()
    with torch.no_grad():  # HF zeroes biases and sets LayerNorms to 1; randomize them too
        for name, param in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def logits_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(model, GPT2LMHeadModel):
            return model(input_ids).logits
        return model(input_ids)[..., :VOCAB]


@pytest.mark.parametrize("overrides", [
    {},
    dict(n_inner=80, layer_norm_epsilon=1e-3),
    dict(activation_function="gelu_pytorch_tanh", n_layer=3, n_head=4),
])
def test_from_hf_logits_match_hf(overrides: dict) -> None:
    hf_model = random_hf_model(**overrides)
    model = from_hf(hf_model).eval()
    input_ids = torch.randint(0, VOCAB, (2, 23))
    expected = logits_of(hf_model, input_ids)
    assert expected.std() > 1.0
    assert relative_error(logits_of(model, input_ids), expected) < 1e-5


def test_from_hf_maps_the_config() -> None:
    hf_model = random_hf_model(n_inner=80, layer_norm_epsilon=1e-3, resid_pdrop=0.05,
                               embd_pdrop=0.05, attn_pdrop=0.15)
    config = from_hf(hf_model, make_vocab_size_divisible_by=64, seed=99).config
    assert config == GPTConfig(num_layers=2, hidden_size=48, num_attention_heads=3,
                               vocab_size=VOCAB, max_position_embeddings=64,
                               ffn_hidden_size=80, make_vocab_size_divisible_by=64,
                               hidden_dropout=0.05, attention_dropout=0.15,
                               init_method_std=0.2, layernorm_epsilon=1e-3, seed=99)
    assert config.padded_vocab_size == 1024


def test_from_hf_pads_vocabulary_with_our_initialization() -> None:
    hf_model = random_hf_model()
    model = from_hf(hf_model, seed=5)
    fresh = GPTModel(model.config)
    embedding = model.embedding.word_embeddings.weight
    assert embedding.shape == (1024, 48)
    assert torch.equal(embedding[:VOCAB], hf_model.transformer.wte.weight)
    assert torch.equal(embedding[VOCAB:], fresh.embedding.word_embeddings.weight[VOCAB:])
    assert embedding[VOCAB:].abs().sum() > 0


def test_from_hf_reads_a_local_checkpoint_directory(tmp_path: Path) -> None:
    hf_model = random_hf_model()
    hf_model.save_pretrained(tmp_path)
    model = from_hf(tmp_path).eval()
    input_ids = torch.randint(0, VOCAB, (3, 17))
    assert relative_error(logits_of(model, input_ids), logits_of(hf_model, input_ids)) < 1e-5


def test_to_hf_round_trips_through_from_pretrained(tmp_path: Path) -> None:
    config = GPTConfig(num_layers=2, hidden_size=48, num_attention_heads=3, vocab_size=VOCAB,
                       max_position_embeddings=64, ffn_hidden_size=72,
                       layernorm_epsilon=1e-4, hidden_dropout=0.05, attention_dropout=0.0,
                       init_method_std=0.2, seed=11)
    model = GPTModel(config).eval()
    to_hf(model, tmp_path / "export")
    hf_model, info = GPT2LMHeadModel.from_pretrained(tmp_path / "export",
                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    hf_model.eval()
    input_ids = torch.randint(0, VOCAB, (2, 31))
    assert relative_error(logits_of(hf_model, input_ids), logits_of(model, input_ids)) < 1e-5
    saved = json.loads((tmp_path / "export" / "config.json").read_text())
    assert saved["n_inner"] == 72 and saved["layer_norm_epsilon"] == 1e-4
    assert saved["resid_pdrop"] == saved["embd_pdrop"] == 0.05 and saved["attn_pdrop"] == 0.0
    assert saved["activation_function"] == "gelu_new" and saved["tie_word_embeddings"]
    # back again: every parameter, padded rows included, survives the trip exactly
    reloaded = from_hf(tmp_path / "export", seed=11)
    assert reloaded.config == config
    reloaded_params = dict(reloaded.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(reloaded_params[name], param), name


def test_to_hf_drops_padded_rows_and_transposes_conv1d(tmp_path: Path) -> None:
    model = GPTModel(GPTConfig(num_layers=1, hidden_size=48, num_attention_heads=3,
                               vocab_size=VOCAB, max_position_embeddings=64))
    to_hf(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as tensors:
        assert "lm_head.weight" not in tensors.keys()
        wte = tensors.get_tensor("transformer.wte.weight")
        c_attn = tensors.get_tensor("transformer.h.0.attn.c_attn.weight")
        c_fc = tensors.get_tensor("transformer.h.0.mlp.c_fc.weight")
    assert torch.equal(wte, model.embedding.word_embeddings.weight[:VOCAB])
    assert c_attn.shape == (48, 144)
    assert torch.equal(c_attn, model.layers[0].attention.query_key_value.weight.T)
    assert torch.equal(c_fc, model.layers[0].mlp.dense_h_to_4h.weight.T)


def test_to_hf_keeps_the_parameter_dtype(tmp_path: Path) -> None:
    model = GPTModel(GPTConfig(num_layers=1, hidden_size=48, num_attention_heads=3,
                               vocab_size=VOCAB, max_position_embeddings=64))
    model.to(torch.bfloat16)
    to_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as tensors:
        assert tensors.get_tensor("transformer.wpe.weight").dtype == torch.bfloat16


def test_to_hf_refuses_a_meta_model(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = GPTModel(GPTConfig(num_layers=1, hidden_size=48, num_attention_heads=3,
                                   vocab_size=VOCAB))
    with pytest.raises(ValueError, match="embedding.word_embeddings.weight is on the meta"):
        to_hf(model, tmp_path)


@pytest.mark.parametrize("overrides, message", [
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True"),
    (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn=True"),
    (dict(scale_attn_weights=False), "scale_attn_weights=False"),
    (dict(activation_function="relu"), "activation_function='relu'"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings=False"),
    (dict(embd_pdrop=0.0), "embd_pdrop=0.0 != resid_pdrop=0.1"),
])
def test_unrepresentable_hf_configs_are_rejected(overrides: dict, message: str) -> None:
    hf_model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=12,
                                          n_layer=1, n_head=3, bos_token_id=None,
                                          eos_token_id=None, **overrides))
    with pytest.raises(ValueError, match=message):
        from_hf(hf_model)


def test_unsupported_model_type_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mistral", "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 100}))
    with pytest.raises(ValueError,
                       match="model_type 'mistral' is not supported: expected 'gpt2' or 'llama'"):
        from_hf(tmp_path)


def test_missing_checkpoint_directory_and_wrong_type() -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_hf("/nonexistent/gpt2-checkpoint")
    with pytest.raises(TypeError, match="got dict"):
        from_hf({"n_layer": 2})
