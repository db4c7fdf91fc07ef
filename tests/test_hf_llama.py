"""Hugging Face Llama interop: logits parity both ways, greedy generation, bit-exact round
trips, export of a checkpoint, import for continued pretraining (resumed at 2 ranks), and the
refusals. Tiny random models built here; nothing is downloaded.

Awkward shapes on purpose: hidden 96 with 6 heads over 2 key/value groups, ffn 160, vocab
211 (padded to 256); and hidden 64 with 4 heads of 24 channels (not 64/4) over 2 groups, a
tied head, rope_theta 500000, vocab 157.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from megatron_lite.hf import from_hf, to_hf
from megatron_lite.model import GPTConfig, GPTModel
from tests.distributed import run_ranks
from tests.test_pretrain_cli import ENTRY_POINT, TINY_RUN, run

SEQ = 37
SHAPE_A = dict(vocab_size=211, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
               intermediate_size=160, num_hidden_layers=2, max_position_embeddings=64)
SHAPE_B = dict(vocab_size=157, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=24, intermediate_size=100, num_hidden_layers=2,
               max_position_embeddings=64, tie_word_embeddings=True, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
BIASED_A = SHAPE_A | dict(attention_bias=True, mlp_bias=True)
# Our Llama-shaped model in the same awkward sizes, for the export direction.
OURS = dict(num_layers=2, hidden_size=96, num_attention_heads=6, vocab_size=211,
            max_position_embeddings=64, ffn_hidden_size=160, make_vocab_size_divisible_by=128,
            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2,
            layernorm_epsilon=1e-6, seed=11, position_embedding_type="rope",
            rotary_base=500000.0, normalization="RMSNorm", swiglu=True, num_query_groups=2,
            untie_embeddings_and_output_weights=True, add_bias_linear=False)


def random_llama(**fields) -> LlamaForCausalLM:
    # initializer_range 0.2 makes logits large enough that a wrong split, rotation or scale
    # shows far above float rounding
    fields = dict(initializer_range=0.2, bos_token_id=None, eos_token_id=None) | fields
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    with torch.no_grad():  # HF sets norms to 1 and biases to 0; randomize them too
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def token_ids(vocab: int, shape=(2, SEQ)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


def logits_of(model: torch.nn.Module, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(model, LlamaForCausalLM):
            return model(ids).logits
        return model(ids)[..., :vocab]


def greedy(model: GPTModel, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(new_tokens):
            next_id = model(ids)[:, -1, : model.config.vocab_size].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    return ids


@pytest.mark.parametrize("fields", [SHAPE_A, SHAPE_B, BIASED_A],
                         ids=["gqa-untied", "head-dim-24-tied-theta-5e5", "biases"])
def test_from_hf_logits_match_hf(fields: dict) -> None:
    hf_model = random_llama(**fields)
    model = from_hf(hf_model).eval()
    vocab = fields["vocab_size"]
    expected = logits_of(hf_model, token_ids(vocab), vocab)
    assert expected.std() > 1.0
    torch.testing.assert_close(logits_of(model, token_ids(vocab), vocab), expected,
                               rtol=0, atol=1e-5)


def test_from_hf_maps_the_config_and_pads_with_our_initialization() -> None:
    hf_model = random_llama(**SHAPE_B, attention_dropout=0.1)
    model = from_hf(hf_model, make_vocab_size_divisible_by=64, seed=5)
    assert model.config == GPTConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=157,
        max_position_embeddings=64, ffn_hidden_size=100, make_vocab_size_divisible_by=64,
        hidden_dropout=0.0, attention_dropout=0.1, init_method_std=0.2, layernorm_epsilon=1e-5,
        seed=5, position_embedding_type="rope", rotary_base=500000.0, normalization="RMSNorm",
        swiglu=True, num_query_groups=2, kv_channels=24,
        untie_embeddings_and_output_weights=False, add_bias_linear=False)
    embedding = model.embedding.word_embeddings.weight  # (192, 64)
    fresh = GPTModel(model.config).embedding.word_embeddings.weight
    assert embedding.shape == (192, 64) and model.output_layer is None
    assert torch.equal(embedding[:157], hf_model.model.embed_tokens.weight)
    assert torch.equal(embedding[157:], fresh[157:]) and embedding[157:].abs().sum() > 0
    qkv = model.layers[1].attention.query_key_value.weight  # (4*24 + 2*2*24, 64)
    attention = hf_model.model.layers[1].self_attn
    assert torch.equal(qkv, torch.cat([attention.q_proj.weight, attention.k_proj.weight,
                                       attention.v_proj.weight]))


def test_to_hf_loads_in_llama_with_our_logits_and_greedy_tokens(tmp_path: Path) -> None:
    # Trained with hidden dropout, which HF Llama lacks: exported all the same (eval mode).
    model = GPTModel(GPTConfig(**OURS | dict(hidden_dropout=0.1))).eval()
    to_hf(model, tmp_path)
    hf_model, info = LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    hf_model.eval()
    ids = token_ids(211)
    torch.testing.assert_close(logits_of(hf_model, ids, 211), logits_of(model, ids, 211),
                               rtol=0, atol=1e-5)
    prompt = ids[:1, :5]
    generated = hf_model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, greedy(model, prompt, 6))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["head_dim"] == 16
    assert saved["num_key_value_heads"] == 2 and saved["tie_word_embeddings"] is False
    assert saved["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    # no tokenizer known: no special ids claimed
    assert saved["bos_token_id"] is None and saved["eos_token_id"] is None


def test_to_hf_writes_given_special_ids(tmp_path: Path) -> None:
    to_hf(GPTModel(GPTConfig(**OURS)), tmp_path, bos_token_id=1, eos_token_id=2)
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((tmp_path / name).read_text())
        assert (saved["bos_token_id"], saved["eos_token_id"]) == (1, 2), name


def test_ours_to_hf_and_back_is_bit_exact(tmp_path: Path) -> None:
    model = GPTModel(GPTConfig(**OURS | dict(hidden_dropout=0.1)))
    to_hf(model, tmp_path)
    reloaded = from_hf(tmp_path, seed=11)
    assert reloaded.config == dataclasses.replace(model.config, hidden_dropout=0.0)
    reloaded_params = dict(reloaded.named_parameters())
    for name, param in model.named_parameters():  # padded rows too: same seed, same values
        assert torch.equal(reloaded_params[name], param), name


@pytest.mark.parametrize("fields", [SHAPE_B, BIASED_A], ids=["tied", "untied-biases"])
def test_hf_to_ours_and_back_gives_identical_tensors(tmp_path: Path, fields: dict) -> None:
    random_llama(**fields).save_pretrained(tmp_path / "hf")
    to_hf(from_hf(tmp_path / "hf"), tmp_path / "again")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(again) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(again[name], tensor), name


# ---- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
     "rope_type 'linear'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True, mlp_bias=False),
     "attention_bias=True but mlp_bias=False; GPTModel has one add_bias_linear"),
])
def test_unrepresentable_llama_configs_are_rejected(fields: dict, message: str) -> None:
    hf_model = LlamaForCausalLM(LlamaConfig(**SHAPE_A | fields))
    with pytest.raises(ValueError, match=re.escape(message)):
        from_hf(hf_model)


def test_scaled_rope_directory_is_rejected_before_reading_weights(tmp_path: Path) -> None:
    LlamaConfig(**SHAPE_A | dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="rope_type 'llama3' .* only 'default' rope"):
        from_hf(tmp_path)  # no weights in the directory: the config alone decides


@pytest.mark.parametrize("changes, message", [
    (dict(normalization="LayerNorm"), "can represent rope with LayerNorm (GPT-2 needs"),
    (dict(swiglu=False, rotary_percent=0.5),
     "can represent rope with a GELU MLP, rotary_percent 0.5"),
    (dict(position_embedding_type="learned_absolute"),
     "can represent learned positions with RMSNorm, SwiGLU, grouped-query attention (2 "
     "key/value heads), an untied output layer, linears without biases"),
    (dict(position_embedding_type="none"), "can represent position_embedding_type 'none'"),
])
def test_unrepresentable_mix_is_refused_on_export(tmp_path: Path, changes: dict,
                                                 message: str) -> None:
    model = GPTModel(GPTConfig(**OURS | changes))
    with pytest.raises(ValueError, match=re.escape(message)):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- checkpoints: import for continued pretraining, export -----------------------------------


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict:
    """SHAPE_B saved by HF, imported by `python -m megatron_lite.import_hf`."""
    root = tmp_path_factory.mktemp("import")
    random_llama(**SHAPE_B).save_pretrained(root / "hf")
    result = run([sys.executable, "-m", "megatron_lite.import_hf", "--hf-dir",
                  str(root / "hf"), "--save", str(root / "ckpt"),
                  "--make-vocab-size-divisible-by", "16", "--seed", "3"])
    assert result.returncode == 0, result.stderr
    return {"hf": root / "hf", "ckpt": root / "ckpt", "stdout": result.stdout}


def test_import_writes_iteration_0_and_prints_the_model_flags(imported: dict) -> None:
    import zeropp

    ckpt = imported["ckpt"]
    assert (ckpt / "latest").read_text() == "iter_0000000"
    client = zeropp.checkpoint_client_state(str(ckpt))
    assert {key: client[key] for key in ("iteration", "consumed_samples", "applied_updates",
                                         "skipped_iterations")} == dict.fromkeys(
        ("iteration", "consumed_samples", "applied_updates", "skipped_iterations"), 0)
    assert client["lr_scheduler"] is None
    assert GPTConfig(**client["model_config"]) == from_hf(imported["hf"], seed=3,
                                                          make_vocab_size_divisible_by=16).config
    assert " ".join(printed_model_flags(imported["stdout"])) == (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--ffn-hidden-size 100 --max-position-embeddings 64 --make-vocab-size-divisible-by 16 "
        "--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu "
        "--group-query-attention --num-query-groups 2 --kv-channels 24 --disable-bias-linear "
        "--layernorm-epsilon 1e-05 --hidden-dropout 0 --attention-dropout 0")
    assert f"--load {imported['ckpt']} --seq-length" in imported["stdout"]


def resume_rank(rank: int, world: int, ckpt: str, model_config: dict, ids: torch.Tensor,
                load_optimizer_states: bool):
    """What pretrain_zeropp_gpt.py does with --load: a meta model, the engine built from the
    DeepSpeed config, load_checkpoint; then the logits of `ids` and the full weights."""
    import zeropp
    from zeropp.config import EngineConfig

    with torch.device("meta"):
        model = GPTModel(GPTConfig(**model_config))
    config = EngineConfig.from_json(json.loads(
        (Path(ENTRY_POINT).parent / "configs" / "ds_zero3_config.json").read_text()))
    engine = zeropp.engine_from_config(
        model, config, param_init_fn=model.initial_value,
        optimizer_params={"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})
    _, client = engine.load_checkpoint(ckpt, load_optimizer_states=load_optimizer_states)
    engine.eval()
    with torch.no_grad():
        logits = engine(ids)
    result = (client["iteration"], engine.optimizer.step_count, logits, engine.full_state_dict())
    engine.close()
    return result


@pytest.mark.parametrize("load_optimizer_states", [False, True],
                         ids=["no-load-optim", "load-optim"])
def test_imported_checkpoint_resumes_at_two_ranks_with_the_hf_weights(
        imported: dict, load_optimizer_states: bool) -> None:
    hf_model = LlamaForCausalLM.from_pretrained(imported["hf"]).eval()
    expected = from_hf(hf_model, make_vocab_size_divisible_by=16, seed=3)
    ids = token_ids(157, (2, 20))
    ranks = run_ranks(resume_rank, 2, str(imported["ckpt"]),
                      dataclasses.asdict(expected.config), ids, load_optimizer_states)
    for iteration, adam_steps, logits, state in ranks:
        assert iteration == 0 and adam_steps == 0
        for name, param in expected.named_parameters():  # padded rows included
            assert torch.equal(state[name], param), name
        torch.testing.assert_close(logits[..., :157], logits_of(hf_model, ids, 157),
                                   rtol=0, atol=1e-5)


def test_export_cli_writes_a_llama_that_equals_the_imported_one(imported: dict,
                                                                tmp_path: Path) -> None:
    from megatron_lite.export import main

    out = tmp_path / "hf"
    assert main(["--load", str(imported["ckpt"]), "--out", str(out)]) == 0
    hf_model, info = LlamaForCausalLM.from_pretrained(out, local_files_only=True,
                                                      output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    # HF -> import -> sharded fp32 checkpoint -> export -> HF: the very same tensors
    original = load_file(imported["hf"] / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    ids = token_ids(157)
    reference = LlamaForCausalLM.from_pretrained(imported["hf"]).eval()
    assert torch.equal(logits_of(hf_model.eval(), ids, 157), logits_of(reference, ids, 157))


def test_import_errors_are_one_line_and_leave_nothing(imported: dict, tmp_path: Path,
                                                      capsys) -> None:
    from megatron_lite.import_hf import main

    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    cases = [
        (["--hf-dir", str(tmp_path / "bert"), "--save", str(tmp_path / "a")],
         "error: model_type 'bert' is not supported: expected 'gpt2' or 'llama'"),
        (["--hf-dir", str(tmp_path / "missing"), "--save", str(tmp_path / "b")],
         "no config.json"),
        (["--hf-dir", str(imported["hf"]), "--save", str(imported["ckpt"])],
         "already holds a checkpoint (latest)"),
    ]
    for argv, message in cases:
        assert main(argv) == 1
        captured = capsys.readouterr()
        [line] = captured.err.strip().splitlines()
        assert line.startswith("error: ") and message in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert (imported["ckpt"] / "latest").read_text() == "iter_0000000"


def printed_model_flags(stdout: str) -> list[str]:
    [line] = [line for line in stdout.splitlines() if line.startswith("model flags: ")]
    return line.removeprefix("model flags: ").split()


def train_one_iteration_from(ckpt: Path, flags: list[str], trained: Path,
                             *extra: str) -> dict[str, torch.Tensor]:
    """pretrain_zeropp_gpt.py on 2 ranks, resumed from `ckpt` with the printed model flags,
    for one iteration; returns the weights it saved. That iteration's lr is 0 (warmup starts
    at 0), so they must be exactly the checkpoint's."""
    import zeropp

    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node", "2", ENTRY_POINT, *TINY_RUN, *flags, *extra,
                  "--mock-data", "--train-iters", "1", "--lr-warmup-iters", "1",
                  "--eval-iters", "1", "--load", str(ckpt),
                  "--save", str(trained)], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    assert f"resumed from {ckpt}/iter_0000000 at iteration 0" in result.stdout
    # weights only: the run's optimizer settings, not the import's placeholders
    assert "the optimizer starts fresh with this run's settings" in result.stdout
    return zeropp.consolidate_checkpoint(str(trained))


def test_imported_gpt2_resumes_in_the_training_program(tmp_path: Path, capsys) -> None:
    """A GPT-2 of GPT-2's vocabulary (the default tokenizer's), imported in this process,
    trained from with the flags the import printed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_lite.import_hf import main

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32,
                               bos_token_id=None, eos_token_id=None)).save_pretrained(
        tmp_path / "hf")
    assert main(["--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    flags = printed_model_flags(capsys.readouterr().out)
    trained = train_one_iteration_from(tmp_path / "ckpt", flags, tmp_path / "trained")
    for name, param in from_hf(tmp_path / "hf").named_parameters():
        assert torch.equal(trained[name], param), name


def test_imported_llama_resumes_in_the_training_program(imported: dict, tmp_path: Path) -> None:
    """The Llama imported by the fixture, trained from with the flags the import printed
    and a NullTokenizer of its vocabulary."""
    trained = train_one_iteration_from(
        imported["ckpt"], printed_model_flags(imported["stdout"]), tmp_path / "trained",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "157")
    expected = from_hf(imported["hf"], make_vocab_size_divisible_by=16, seed=3)
    for name, param in expected.named_parameters():  # padded rows included
        assert torch.equal(trained[name], param), name
