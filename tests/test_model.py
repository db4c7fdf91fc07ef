"""GPT model: config validation, sizes, initialization, forward, activation checkpointing, loss."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.model import GPTConfig, GPTModel, flops_per_token, lm_loss


def small_config(**overrides) -> GPTConfig:
    fields = dict(num_layers=3, hidden_size=24, num_attention_heads=3, vocab_size=1000,
                  max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(overrides)
    return GPTConfig(**fields)


def closed_form_parameter_count(L: int, h: int, V: int, s: int) -> int:
    # 12h^2 + 13h per layer (4h MLP), token + position tables, final LayerNorm
    return 12 * L * h * h + 13 * L * h + (V + s) * h + 2 * h


# ------------------------------------------------------------------------------------------
# config


@pytest.mark.parametrize("vocab, multiple, padded",
                         [(50257, 128, 50304), (1000, 128, 1024), (128, 128, 128),
                          (129, 128, 256), (1000, 1, 1000)])
def test_padded_vocab_size_rounds_up(vocab: int, multiple: int, padded: int) -> None:
    config = small_config(vocab_size=vocab, make_vocab_size_divisible_by=multiple)
    assert config.padded_vocab_size == padded


def test_ffn_hidden_size_defaults_to_four_times_hidden() -> None:
    assert small_config().ffn_hidden_size == 96
    assert small_config(ffn_hidden_size=50).ffn_hidden_size == 50


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=25), "divisible by num_attention_heads"),
    (dict(num_layers=0), "num_layers must be a positive integer"),
    (dict(vocab_size=-3), "vocab_size must be a positive integer"),
    (dict(hidden_size=24.0), "hidden_size must be a positive integer"),
    (dict(ffn_hidden_size=0), "ffn_hidden_size must be a positive integer"),
    (dict(checkpoint_num_layers=0), "checkpoint_num_layers must be a positive integer"),
    (dict(hidden_dropout=1.0), r"hidden_dropout must be in \[0, 1\)"),
    (dict(attention_dropout=-0.1), r"attention_dropout must be in \[0, 1\)"),
    (dict(init_method_std=0.0), "init_method_std must be a positive finite number"),
    (dict(layernorm_epsilon=float("nan")), "layernorm_epsilon must be a positive finite"),
    (dict(seed=-1), "seed must be an integer"),
    (dict(seed=2**64), "seed must be an integer"),
])
def test_config_validation_names_the_bad_field(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


@pytest.mark.parametrize("overrides", [{}, dict(vocab_size=50257, num_layers=2),
                                       dict(hidden_size=36, num_attention_heads=4)])
def test_parameter_count_matches_closed_form_and_the_module(overrides: dict) -> None:
    config = small_config(**overrides)
    expected = closed_form_parameter_count(config.num_layers, config.hidden_size,
                                           config.padded_vocab_size,
                                           config.max_position_embeddings)
    assert config.num_parameters() == expected
    with torch.device("meta"):
        model = GPTModel(config)
    assert model.num_parameters() == expected
    assert sum(p.numel() for _, p in model.named_parameters()) == expected


def test_parameter_count_with_custom_ffn_width() -> None:
    config = small_config(ffn_hidden_size=50)
    with torch.device("meta"):
        model = GPTModel(config)
    assert config.num_parameters() == model.num_parameters()


def test_18b_paper_model_builds_on_meta_in_seconds_with_exact_count() -> None:
    # The ZeRO++ tutorial's 18B model: --num-layers 40 --hidden-size 6144 --seq-length 512
    config = GPTConfig(num_layers=40, hidden_size=6144, num_attention_heads=32,
                       vocab_size=50257, max_position_embeddings=512)
    start = time.perf_counter()
    with torch.device("meta"):
        model = GPTModel(config)
    elapsed = time.perf_counter() - start
    assert elapsed < 10.0
    assert all(p.is_meta for p in model.parameters())
    expected = closed_form_parameter_count(40, 6144, 50304, 512)
    assert expected == 18_434_813_952
    assert model.num_parameters() == config.num_parameters() == expected


def test_flops_per_token_counts_every_gemm() -> None:
    config = small_config(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000)
    L, h, V, s = 4, 64, 1024, 32
    # forward per token: dense GEMMs 2 * 12h^2 and attention 2 * 2sh per layer, head 2Vh
    layer_forward = L * (2 * 12 * h * h + 2 * 2 * s * h)
    head_forward = 2 * V * h
    # recompute: layers run forward twice plus backward (2x); the head is not recomputed
    recompute_total = 4 * layer_forward + 3 * head_forward
    assert flops_per_token(config, s, checkpoint_activations=True) == \
        pytest.approx(recompute_total, rel=1e-12)
    assert flops_per_token(config, s, checkpoint_activations=False) == \
        pytest.approx(recompute_total * 3 / 4, rel=1e-12)
    with pytest.raises(ValueError, match="seq_length must be a positive integer"):
        flops_per_token(config, 0, checkpoint_activations=False)


# ------------------------------------------------------------------------------------------
# initialization


def test_meta_built_model_initializes_bit_for_bit_like_cpu_built() -> None:
    config = small_config()
    cpu_model = GPTModel(config)
    with torch.device("meta"):
        meta_model = GPTModel(config)
    meta_model.to_empty(device="cpu")
    meta_model.init_weights()
    cpu_params = dict(cpu_model.named_parameters())
    assert set(cpu_params) == {name for name, _ in meta_model.named_parameters()}
    for name, param in meta_model.named_parameters():
        assert torch.equal(param, cpu_params[name]), name


def test_init_weights_overwrites_values_in_place_in_param_dtype() -> None:
    model = GPTModel(small_config()).to(torch.bfloat16)
    weight = model.layers[0].mlp.dense_h_to_4h.weight
    weight.data.fill_(7.0)
    storage = weight.data_ptr()
    model.init_weights()
    assert weight.dtype == torch.bfloat16 and weight.data_ptr() == storage
    expected = model.initial_value("layers.0.mlp.dense_h_to_4h.weight").to(torch.bfloat16)
    assert torch.equal(weight, expected)


def test_initial_value_depends_only_on_seed_and_name() -> None:
    name = "layers.1.attention.query_key_value.weight"
    reference = GPTModel(small_config()).initial_value(name)
    torch.manual_seed(999)  # global RNG state must not matter
    deeper_wider_vocab = GPTModel(small_config(num_layers=5, vocab_size=5000))
    assert torch.equal(deeper_wider_vocab.initial_value(name), reference)
    # a parameter's value is not the continuation of another's random stream
    other = deeper_wider_vocab.initial_value("layers.2.attention.query_key_value.weight")
    assert not torch.equal(other, reference)
    reseeded = GPTModel(small_config(seed=4321))
    assert not torch.equal(reseeded.initial_value(name), reference)


def test_initial_value_survives_parameter_replacement_and_reshapes_to_param() -> None:
    model = GPTModel(small_config())
    name = "layers.0.mlp.dense_4h_to_h.weight"
    reference = model.initial_value(name)
    # the sharding engine may swap a parameter for an empty flat one
    model.layers[0].mlp.dense_4h_to_h.weight = torch.nn.Parameter(torch.empty(0))
    assert torch.equal(model.initial_value(name), reference)
    flat = model.initial_value(name, torch.empty(reference.numel()))
    assert flat.shape == (reference.numel(),) and torch.equal(flat, reference.flatten())
    with pytest.raises(ValueError, match="elements"):
        model.initial_value(name, torch.empty(3))
    with pytest.raises(KeyError, match="no parameter named 'layers.9.mlp.bias'"):
        model.initial_value("layers.9.mlp.bias")


def test_init_weights_on_meta_names_the_parameter() -> None:
    with torch.device("meta"):
        model = GPTModel(small_config())
    with pytest.raises(RuntimeError, match="embedding.word_embeddings.weight is on the meta"):
        model.init_weights()


def test_initial_values_follow_megatron_scheme() -> None:
    L, h, std = 8, 256, 0.02
    config = small_config(num_layers=L, hidden_size=h, num_attention_heads=4, vocab_size=1000)
    with torch.device("meta"):
        model = GPTModel(config)
    value = model.initial_value
    for name in ("layers.0.attention.query_key_value.weight", "layers.7.mlp.dense_h_to_4h.weight",
                 "embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
        weight = value(name)
        assert weight.std().item() == pytest.approx(std, rel=0.03), name
        assert abs(weight.mean().item()) < 1e-3, name
    scaled_std = std / math.sqrt(2 * L)
    for name in ("layers.3.attention.dense.weight", "layers.5.mlp.dense_4h_to_h.weight"):
        assert value(name).std().item() == pytest.approx(scaled_std, rel=0.03), name
    # padded vocabulary rows (1000..1023) get the same normal init as the real ones
    padded_rows = value("embedding.word_embeddings.weight")[1000:]
    assert padded_rows.shape == (24, h)
    assert padded_rows.std().item() == pytest.approx(std, rel=0.1)
    for name in ("layers.0.attention.query_key_value.bias", "layers.2.mlp.dense_4h_to_h.bias",
                 "layers.1.input_layernorm.bias", "final_layernorm.bias"):
        assert torch.equal(value(name), torch.zeros(value(name).shape)), name
    for name in ("layers.4.post_attention_layernorm.weight", "final_layernorm.weight"):
        assert torch.equal(value(name), torch.ones(h)), name
    assert value("layers.0.mlp.dense_h_to_4h.weight").dtype == torch.float32


# ------------------------------------------------------------------------------------------
# forward


def test_forward_shape_dtype_and_tied_head() -> None:
    config = small_config()
    model = GPTModel(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 17))
    logits = model(input_ids)
    assert logits.shape == (2, 17, config.padded_vocab_size)
    assert logits.dtype == torch.float32
    assert len(list(model.parameters())) == len(dict(model.named_parameters()))
    assert not any("head" in name for name, _ in model.named_parameters())
    bf16_logits = model.to(torch.bfloat16)(input_ids)
    assert bf16_logits.dtype == torch.bfloat16


def test_forward_matches_explicit_reference_computation() -> None:
    config = small_config(num_layers=2)
    model = GPTModel(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 9))
    B, T, C, nh = 2, 9, config.hidden_size, config.num_attention_heads
    x = model.embedding.word_embeddings.weight[input_ids] + \
        model.embedding.position_embeddings.weight[:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in model.layers:
        ln1 = layer.input_layernorm
        h = F.layer_norm(x, (C,), ln1.weight, ln1.bias, config.layernorm_epsilon)
        qkv = h @ layer.attention.query_key_value.weight.T + layer.attention.query_key_value.bias
        q, k, v = (t.reshape(B, T, nh, C // nh).permute(0, 2, 1, 3) for t in qkv.chunk(3, -1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(C // nh)
        attention = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        attention = attention.permute(0, 2, 1, 3).reshape(B, T, C)
        x = x + attention @ layer.attention.dense.weight.T + layer.attention.dense.bias
        ln2 = layer.post_attention_layernorm
        h = F.layer_norm(x, (C,), ln2.weight, ln2.bias, config.layernorm_epsilon)
        h = h @ layer.mlp.dense_h_to_4h.weight.T + layer.mlp.dense_h_to_4h.bias
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        x = x + h @ layer.mlp.dense_4h_to_h.weight.T + layer.mlp.dense_4h_to_h.bias
    final = model.final_layernorm
    x = F.layer_norm(x, (C,), final.weight, final.bias, config.layernorm_epsilon)
    expected = x @ model.embedding.word_embeddings.weight.T
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids), expected, rtol=1e-5, atol=1e-6)


def test_forward_is_causal_and_accepts_explicit_positions() -> None:
    config = small_config()
    model = GPTModel(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 12))
    changed_future = input_ids.clone()
    changed_future[:, 8:] = (changed_future[:, 8:] + 1) % config.vocab_size
    with torch.no_grad():
        logits = model(input_ids)
        torch.testing.assert_close(model(changed_future)[:, :8], logits[:, :8])
        assert not torch.allclose(model(changed_future)[:, 8:], logits[:, 8:])
        explicit = torch.arange(12).expand(2, 12)
        torch.testing.assert_close(model(input_ids, explicit), logits)
        shifted = model(input_ids, explicit + 5)
        assert not torch.allclose(shifted, logits)


def test_sequence_longer_than_position_table_is_rejected() -> None:
    model = GPTModel(small_config(max_position_embeddings=16))
    model(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_position_embeddings"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids must have shape"):
        model(torch.zeros(1, 8, dtype=torch.long), torch.arange(7).unsqueeze(0))
    with pytest.raises(ValueError, match="input_ids must be 2-D"):
        model(torch.zeros(8, dtype=torch.long))


# ------------------------------------------------------------------------------------------
# activation checkpointing


def gradients_after_one_step(config: GPTConfig, input_ids: torch.Tensor,
                             rng_seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = GPTModel(config).train()
    torch.manual_seed(rng_seed)
    logits = model(input_ids)
    loss = lm_loss(logits[:, :-1], input_ids[:, 1:], torch.ones(input_ids[:, 1:].shape))
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("chunk, dropout", [(1, 0.0), (2, 0.0), (2, 0.2)])
def test_activation_checkpointing_gives_identical_gradients(chunk: int, dropout: float) -> None:
    config = small_config(hidden_dropout=dropout, attention_dropout=dropout)
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    loss, grads = gradients_after_one_step(config, input_ids, rng_seed=7)
    recompute_config = small_config(hidden_dropout=dropout, attention_dropout=dropout,
                                    checkpoint_activations=True, checkpoint_num_layers=chunk)
    recompute_loss, recompute_grads = gradients_after_one_step(recompute_config, input_ids,
                                                               rng_seed=7)
    assert torch.equal(recompute_loss, loss)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0 or name.endswith("bias"), name
        assert torch.equal(recompute_grads[name], grad), name


def count_layer_hook_calls(config: GPTConfig, train: bool, grad: bool) -> list[tuple[int, int]]:
    """(pre-forward, forward) hook calls per layer during one forward + backward."""
    model = GPTModel(config).train(train)
    calls = [[0, 0] for _ in model.layers]
    for index, layer in enumerate(model.layers):
        def count_pre(module, args, index=index):
            calls[index][0] += 1

        def count_post(module, args, output, index=index):
            calls[index][1] += 1

        layer.register_forward_pre_hook(count_pre)
        layer.register_forward_hook(count_post)
    input_ids = torch.randint(0, config.vocab_size, (2, 8))
    with torch.set_grad_enabled(grad):
        logits = model(input_ids)
        if grad:
            logits.float().square().mean().backward()
    return [tuple(c) for c in calls]


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_layer_hooks_fire_again_during_recompute(chunk: int) -> None:
    recompute = small_config(checkpoint_activations=True, checkpoint_num_layers=chunk)
    assert count_layer_hook_calls(recompute, train=True, grad=True) == [(2, 2)] * 3


def test_layer_hooks_fire_once_without_recompute() -> None:
    assert count_layer_hook_calls(small_config(), train=True, grad=True) == [(1, 1)] * 3
    recompute = small_config(checkpoint_activations=True)
    # recomputation only applies to training with autograd on
    assert count_layer_hook_calls(recompute, train=False, grad=True) == [(1, 1)] * 3
    assert count_layer_hook_calls(recompute, train=True, grad=False) == [(1, 1)] * 3


# ------------------------------------------------------------------------------------------
# loss


def test_lm_loss_equals_cross_entropy_over_masked_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    mask = (torch.rand(3, 7) > 0.4).float()
    mask[0, 0] = 1.0
    loss = lm_loss(logits, labels, mask)
    keep = mask.bool()
    reference_logits = logits.detach().clone().requires_grad_(True)
    reference = F.cross_entropy(reference_logits[keep], labels[keep])
    torch.testing.assert_close(loss, reference)
    loss.backward()
    reference.backward()
    torch.testing.assert_close(logits.grad, reference_logits.grad)
    full = lm_loss(logits, labels, torch.ones(3, 7, dtype=torch.bool))
    torch.testing.assert_close(full, F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1)))


def test_lm_loss_is_computed_in_fp32_for_half_logits() -> None:
    torch.manual_seed(0)
    logits = (torch.randn(2, 5, 3000) * 8).to(torch.bfloat16)
    labels = torch.randint(0, 3000, (2, 5))
    loss = lm_loss(logits, labels, torch.ones(2, 5))
    assert loss.dtype == torch.float32
    reference = F.cross_entropy(logits.float().reshape(-1, 3000), labels.reshape(-1))
    torch.testing.assert_close(loss, reference)


def test_lm_loss_all_masked_is_zero_and_shapes_are_checked() -> None:
    logits = torch.randn(2, 4, 10, requires_grad=True)
    labels = torch.randint(0, 10, (2, 4))
    loss = lm_loss(logits, labels, torch.zeros(2, 4))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    with pytest.raises(ValueError, match="must both have shape"):
        lm_loss(logits, labels[:, :3], torch.ones(2, 4))
    with pytest.raises(ValueError, match="logits must be"):
        lm_loss(logits[0], labels, torch.ones(2, 4))


# ---- the loss ([Note: chunked cross-entropy]) --------------------------------------------


@pytest.mark.parametrize("chunk_elements", [10**9, 7 * 97, 97])  # one chunk, ragged, one row
def test_chunked_cross_entropy_matches_torchs_values_and_gradients(chunk_elements) -> None:
    from megatron_lite.model.gpt import chunked_cross_entropy

    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(23, 97, generator=generator) * 4).requires_grad_()
    labels = torch.randint(0, 97, (23,), generator=generator)
    labels[5] = -100  # ignored, as torch ignores it
    upstream = torch.rand(23, generator=generator)
    expected = F.cross_entropy(logits, labels, reduction="none")
    (expected_grad,) = torch.autograd.grad(expected, logits, upstream)
    got = chunked_cross_entropy(logits, labels, chunk_elements=chunk_elements)
    (got_grad,) = torch.autograd.grad(got, logits, upstream)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-6, atol=1e-7)
    assert got[5] == 0 and (got_grad[5] == 0).all()
    # 16-bit logits: the gradient in their dtype, computed in fp32, as autograd's cast gives.
    half = logits.detach().bfloat16().requires_grad_()
    reference = F.cross_entropy(half.float(), labels, reduction="none")
    (reference_grad,) = torch.autograd.grad(reference, half, upstream)
    chunked = chunked_cross_entropy(half, labels, chunk_elements=chunk_elements)
    (chunked_grad,) = torch.autograd.grad(chunked, half, upstream)
    assert chunked_grad.dtype == torch.bfloat16
    torch.testing.assert_close(chunked, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked_grad.float(), reference_grad.float(), rtol=2**-7, atol=1e-6)


def test_the_loss_of_llama3_8b_at_8k_holds_an_eighth_of_the_fp32_logits() -> None:
    """8K tokens of a 128K vocabulary: fp32 logits are 4 GiB. Measured on the meta device:
    what the loss holds beyond the 16-bit logits and their 16-bit gradient, forward and
    backward, chunked against torch's cross-entropy of the fp32 cast."""
    from zeropp.simulation import MemoryTracker

    tokens, vocab = 8192, 128_256

    def transient(loss_of) -> int:
        logits = torch.empty(1, tokens, vocab, dtype=torch.bfloat16, device="meta",
                             requires_grad=True)
        labels = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        mask = torch.ones(1, tokens, device="meta")
        with MemoryTracker() as memory:
            loss_of(logits, labels, mask).backward()
        sixteen_bit = 2 * tokens * vocab  # the logits' gradient, which any loss produces
        return memory.peak_bytes - sixteen_bit

    def unchunked(logits, labels, mask):
        losses = F.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1),
                                 reduction="none")
        return (losses * mask.reshape(-1)).sum() / mask.sum()

    before, after = transient(unchunked), transient(lm_loss)
    assert before >= 8 * 2**30  # the fp32 copy and torch's fp32 log-softmax or gradient
    assert after <= before / 8, (after / 2**30, before / 2**30)
