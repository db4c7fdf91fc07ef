"""The Llama-style GPT (rotary positions, RMSNorm, SwiGLU, grouped-query attention, untied
head, no biases) on the sharded engine, held to the guarantees the GPT-2 shape has: ZeRO-3 on
4 gloo ranks reproduces the unsharded torch loop (AdamW with Megatron's two groups and
clip_grad_norm_), hpZ changes nothing, qwZ+hpZ+qgZ track ZeRO-3 and still learn. Plus the
model-level properties that make the architecture what it is.

Awkward sizes on purpose: hidden 40 with 5 heads of 8 channels, 1 key/value group, ffn 72,
vocabulary 203 padded to 208; nothing divides 4 ranks evenly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.model import GPTConfig, GPTModel, flops_per_token, lm_loss
from tests.distributed import run_ranks

LR, WD, CLIP = 3e-3, 0.1, 0.5
# Adam's first step moves every weight by about lr * g / (|g| + eps): for the few gradient
# elements near 1e-8 it turns summation-order rounding (4 ranks vs 1) into a visible share of
# lr. eps 1e-6 keeps that amplification 100x smaller; it is the same in both loops.
EPS = 1e-6
VOCAB, SEQ = 203, 12

LLAMA_STYLE = dict(
    num_layers=3, hidden_size=40, num_attention_heads=5, vocab_size=VOCAB,
    max_position_embeddings=SEQ, ffn_hidden_size=72, make_vocab_size_divisible_by=16,
    hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-6, seed=7,
    position_embedding_type="rope", rotary_base=500000.0, normalization="RMSNorm",
    swiglu=True, num_query_groups=1, untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
)


def llama_config(**changes) -> GPTConfig:
    return GPTConfig(**(LLAMA_STYLE | changes))


def batches(steps: int, micro: int, batch: int, repeat: bool = False) -> torch.Tensor:
    """Random token ids (steps, micro, batch, SEQ + 1); with `repeat` every step sees the
    first step's batches, which a model can learn (random text it cannot)."""
    generator = torch.Generator().manual_seed(3)
    data = torch.randint(0, VOCAB, (steps, micro, batch, SEQ + 1), generator=generator)
    return data[:1].expand_as(data) if repeat else data


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    labels = tokens[:, 1:]
    return lm_loss(logits, labels, torch.ones_like(labels))


def reference_run(config: GPTConfig, steps: int, micro: int, batch: int):
    """One process, unsharded: what every sharded run must reproduce."""
    model = GPTModel(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=LR, eps=EPS, foreach=False)
    data = batches(steps, micro, batch)
    losses = []
    for step in range(steps):
        total = 0.0
        for m in range(micro):
            tokens = data[step, m]
            loss = loss_of(model(tokens[:, :-1]), tokens) / micro
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def sharded_run(rank, world, config_fields, steps, micro, batch, per_node, quant, repeat):
    from zeropp.deepspeed_api.initialize import QuantizationOptions, build_engine
    from zeropp.sharded_model import ShardingOptions

    with torch.device("meta"):
        model = GPTModel(GPTConfig(**config_fields))
    engine = build_engine(
        model, lr=LR, eps=EPS, weight_decay=WD, gradient_accumulation_steps=micro,
        gradient_clipping=CLIP, ranks_per_node=per_node,
        sharding=ShardingOptions(persistence_threshold=0, prefetch_bucket_numel=3000),
        quantization=QuantizationOptions(**quant),
    )
    data = batches(steps, micro, batch, repeat)
    per_rank = batch // world
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for m in range(micro):
            tokens = data[step, m, rank * per_rank:(rank + 1) * per_rank]
            loss = loss_of(engine(tokens[:, :-1]), tokens)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / micro
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses, engine.full_state_dict()


def run_sharded(config: GPTConfig, steps: int, micro: int, batch: int, per_node: int = 2,
                quant: dict | None = None, repeat: bool = False):
    return run_ranks(sharded_run, 4, dataclasses.asdict(config), steps, micro, batch, per_node,
                     quant or {}, repeat)


# ---- ZeRO-3 and ZeRO++ on 4 ranks ----------------------------------------------------------


@pytest.mark.parametrize("recompute", [
    {},
    {"checkpoint_activations": True, "recompute_method": "block", "checkpoint_num_layers": 2},
    {"recompute_attention": True},
], ids=["plain", "full-block-recompute", "selective-recompute"])
def test_zero3_on_4_ranks_matches_the_unsharded_loop(recompute):
    config = llama_config(**recompute)
    ref_losses, ref_params = reference_run(config, steps=4, micro=2, batch=8)
    for losses, params in run_sharded(config, steps=4, micro=2, batch=8):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert set(params) == set(ref_params)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_hpz_alone_changes_nothing_and_zeropp_tracks_zero3():
    config = llama_config()
    zero3 = run_sharded(config, steps=8, micro=1, batch=8, repeat=True)
    hpz = run_sharded(config, steps=8, micro=1, batch=8, quant={"hpz_size": 2}, repeat=True)
    zeropp = run_sharded(config, steps=8, micro=1, batch=8, repeat=True, quant={
        "quantized_weights": True, "hpz_size": 2, "quantized_gradients": True})
    assert hpz[0][0] == pytest.approx(zero3[0][0], rel=1e-6, abs=0)
    base, quantized = zero3[0][0], zeropp[0][0]
    assert quantized != base  # quantization really happened
    assert quantized[-1] < quantized[0]  # and it still learns
    for exact, approximate in zip(base, quantized, strict=True):
        assert abs(exact - approximate) / exact < 0.02


# ---- the architecture itself ---------------------------------------------------------------


def test_rotary_attention_depends_only_on_relative_positions():
    # Shifting every position by the same amount rotates queries and keys alike: scores, and
    # so logits, are unchanged. Learned absolute positions have no such symmetry.
    ids = torch.randint(0, VOCAB, (2, SEQ - 3), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ - 3).unsqueeze(0)
    rope = GPTModel(llama_config(max_position_embeddings=64)).eval()
    with torch.no_grad():
        torch.testing.assert_close(rope(ids, positions + 29), rope(ids, positions),
                                   rtol=1e-4, atol=1e-5)
    learned = GPTModel(llama_config(max_position_embeddings=64,
                                    position_embedding_type="learned_absolute")).eval()
    with torch.no_grad():
        assert not torch.allclose(learned(ids, positions + 29), learned(ids, positions),
                                  atol=1e-3)


def test_rotary_percent_leaves_the_other_channels_unrotated():
    from megatron_lite.model.gpt import apply_rotary, rotary_tables

    config = llama_config(rotary_percent=0.5)  # 4 of 8 channels per head
    tables = rotary_tables(torch.arange(SEQ).unsqueeze(0), config, torch.float32)
    x = torch.randn(1, 5, SEQ, config.head_dim)
    rotated = apply_rotary(x, tables)
    torch.testing.assert_close(rotated[..., 4:], x[..., 4:], rtol=0, atol=0)
    assert not torch.allclose(rotated[:, :, 1:, :4], x[:, :, 1:, :4])
    # a rotation: the rotated pairs (i, i + 2) keep their length
    pairs = lambda t: t[..., :2] ** 2 + t[..., 2:4] ** 2  # noqa: E731
    torch.testing.assert_close(pairs(rotated), pairs(x))


def test_grouped_queries_equal_multi_head_with_repeated_key_value_heads():
    # 6 query heads over 2 groups: the same network as 6 independent heads whose key/value
    # projections repeat each group's rows for its 3 heads (head i reads group i // 3).
    gqa_config = llama_config(hidden_size=48, num_attention_heads=6, num_query_groups=2)
    mha_config = llama_config(hidden_size=48, num_attention_heads=6, num_query_groups=None)
    gqa, mha = GPTModel(gqa_config).eval(), GPTModel(mha_config).eval()
    gqa_params = dict(gqa.named_parameters())
    d = gqa_config.head_dim
    with torch.no_grad():
        for name, param in mha.named_parameters():
            source = gqa_params[name]
            if name.endswith("query_key_value.weight"):
                q, k, v = source.split((6 * d, 2 * d, 2 * d))
                repeat = lambda t: t.view(2, d, -1).repeat_interleave(3, 0).reshape(6 * d, -1)  # noqa: E731
                source = torch.cat((q, repeat(k), repeat(v)))
            param.copy_(source)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids), mha(ids), rtol=1e-5, atol=1e-6)


def test_swiglu_mlp_is_silu_gate_times_up():
    config = llama_config()
    mlp = GPTModel(config).layers[0].mlp
    x = torch.randn(2, 3, config.hidden_size)
    gate, up = mlp.dense_h_to_4h.weight.split(config.ffn_hidden_size)
    expected = (F.silu(x @ gate.T) * (x @ up.T)) @ mlp.dense_4h_to_h.weight.T
    torch.testing.assert_close(mlp(x), expected)


def test_selective_recompute_gives_the_same_gradients_with_dropout():
    # Recomputing the core attention must replay its dropout mask, not draw a new one.
    grads = []
    for selective in (False, True):
        model = GPTModel(llama_config(attention_dropout=0.2, recompute_attention=selective))
        model.train()
        tokens = batches(1, 1, 4)[0, 0]
        torch.manual_seed(11)
        loss_of(model(tokens[:, :-1]), tokens).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("changes", [
    {},
    {"num_query_groups": None, "untie_embeddings_and_output_weights": False},
    {"add_bias_linear": True, "normalization": "LayerNorm", "kv_channels": 12},
    {"swiglu": False, "position_embedding_type": "learned_absolute"},
])
def test_parameter_count_formula_matches_the_module(changes):
    config = llama_config(**changes)
    with torch.device("meta"):
        model = GPTModel(config)
    assert config.num_parameters() == model.num_parameters()


def test_swiglu_default_ffn_is_megatrons_two_thirds_rounded_to_64():
    assert GPTConfig(num_layers=1, hidden_size=4096, num_attention_heads=32, vocab_size=10,
                     swiglu=True).ffn_hidden_size == 10880
    assert GPTConfig(num_layers=1, hidden_size=4096, num_attention_heads=32,
                     vocab_size=10).ffn_hidden_size == 16384


def test_flops_formula_generalizes_the_gpt2_one():
    gpt2 = GPTConfig(num_layers=40, hidden_size=6144, num_attention_heads=48, vocab_size=50257)
    L, h, s, V = 40, 6144, 2048, gpt2.padded_vocab_size
    legacy = 24.0 * L * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * L * h)) * 3
    assert flops_per_token(gpt2, s, False) == pytest.approx(legacy, rel=1e-12)
    # Llama-2-7B: about 6 x 6.7e9 parameters per token plus the attention term
    llama = GPTConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, vocab_size=32000,
                      ffn_hidden_size=11008, swiglu=True, position_embedding_type="rope",
                      normalization="RMSNorm", untie_embeddings_and_output_weights=True,
                      add_bias_linear=False, max_position_embeddings=4096)
    dense = 6 * (llama.num_parameters() - 2 * llama.padded_vocab_size * 4096)
    attention = 3 * 32 * 4 * 4096 * 4096
    head = 4.5 * llama.padded_vocab_size * 4096
    assert flops_per_token(llama, 4096, False) == pytest.approx(dense + attention + head,
                                                                rel=1e-3)


def _bytes_kept_for_backward(config: GPTConfig, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves during one training forward."""
    model = GPTModel(config).train()
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids)
    return sum(storages.values())


def test_selective_recompute_keeps_no_sequence_squared_activation():
    # With attention dropout the CPU attention takes its math path, which keeps the
    # (batch, heads, T, T) probabilities and dropout output; selective recomputation keeps
    # only the core's inputs, like a run whose attention keeps nothing of size T^2.
    T, batch, heads, layers = 256, 2, 4, 2
    shape = dict(num_layers=layers, hidden_size=64, num_attention_heads=heads, vocab_size=100,
                 max_position_embeddings=T, hidden_dropout=0.0, position_embedding_type="rope")
    ids = torch.randint(0, 100, (batch, T), generator=torch.Generator().manual_seed(0))
    plain = _bytes_kept_for_backward(GPTConfig(**shape, attention_dropout=0.1), ids)
    selective = _bytes_kept_for_backward(
        GPTConfig(**shape, attention_dropout=0.1, recompute_attention=True), ids)
    fused = _bytes_kept_for_backward(GPTConfig(**shape, attention_dropout=0.0), ids)
    one_square_per_layer = layers * batch * heads * T * T * 4
    assert plain - selective >= 2 * one_square_per_layer
    assert selective <= fused
