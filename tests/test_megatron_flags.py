"""Megatron-LM's and Megatron-DeepSpeed's flags for the Llama-style GPT and their launch
scripts: every flag's effect (the GPTConfig field, the derived value, or the one-line
refusal), the tokenizers, the resume check, the time budget, the backend choice, an
end-to-end run of a tiny Llama on 2 gloo ranks, and the real launch scripts in
tests/material/megatron_scripts (SOURCES.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics
from types import SimpleNamespace

import pytest
import torch

from data.tokenizers import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
)
from megatron_lite.arguments import (
    ArgumentError,
    gpt_config_from_args,
    parse_args,
    validate_args,
)
from megatron_lite.checkpointing import CheckpointConfig, RunControl
from megatron_lite.ds_config import (
    engine_config,
    optimizer_params,
    read_ds_config,
    reconcile_with_ds_config,
)
from megatron_lite.model import GPTModel
from megatron_lite.model import config as model_config
from megatron_lite.training import LoopConfig
from tests.distributed import run_ranks
from tests.test_pretrain_cli import ENTRY_POINT, ROOT, run
from zeropp.config import EngineConfig
from zeropp.deepspeed_api.lr_schedules import AnnealingLR

SHAPE = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
TRAIN = "--micro-batch-size 2 --train-iters 10 --lr 1e-3"
SCRIPTS = ROOT / "tests" / "material" / "megatron_scripts"


def validated(extra: str = "", train: str = TRAIN, world_size: int = 1):
    return validate_args(parse_args(f"{SHAPE} {train} {extra}".split()), world_size)


def config_of(extra: str = "", train: str = TRAIN, vocab_size: int = 1000):
    return gpt_config_from_args(validated(extra, train), vocab_size)


def refusal(extra: str, train: str = TRAIN, world_size: int = 1) -> str:
    with pytest.raises(ArgumentError) as caught:
        validated(extra, train, world_size)
    message = str(caught.value)
    assert "\n" not in message
    return message


# -------------------- architecture flags -> GPTConfig ---------------------------------------------


def test_defaults_stay_gpt2():
    config = config_of()
    assert (config.position_embedding_type, config.normalization) == ("learned_absolute",
                                                                        "LayerNorm")
    assert not config.swiglu and config.num_query_groups is None and config.add_bias_linear
    assert not config.untie_embeddings_and_output_weights and config.ffn_hidden_size == 256
    assert (config.rotary_base, config.rotary_percent, config.kv_channels) == (10000, 1.0, None)


@pytest.mark.parametrize("flags, expected", [
    ("--position-embedding-type rope", "rope"),
    ("--position-embedding-type none", "none"),
    ("--use-rotary-position-embeddings", "rope"),
    ("--no-position-embedding", "none"),
    ("--use-rotary-position-embeddings --no-position-embedding", "rope"),
    ("--position-embedding-type rope --no-position-embedding", "rope"),
    ("--position-embedding-type rope --use-rotary-position-embeddings", "rope"),
])
def test_position_embedding_spellings(flags, expected):
    assert config_of(flags).position_embedding_type == expected


@pytest.mark.parametrize("flags, named", [
    ("--position-embedding-type learned_absolute --use-rotary-position-embeddings",
     "--position-embedding-type learned_absolute contradicts --use-rotary-position-embeddings"),
    ("--position-embedding-type none --use-rotary-position-embeddings",
     "--position-embedding-type none contradicts"),
    ("--position-embedding-type learned_absolute --no-position-embedding",
     "contradicts --no-position-embedding"),
    ("--rotary-base 500000", "--rotary-base 500000 applies to rotary positions only"),
    ("--rotary-percent 0.5", "--rotary-percent 0.5 applies to rotary positions only"),
    ("--position-embedding-type rope --rotary-percent 0.1", "rotary positions need an even"),
])
def test_position_refusals(flags, named):
    assert named in refusal(flags)


def test_rotary_base_and_percent():
    config = config_of("--position-embedding-type rope --rotary-base 500000 --rotary-percent 0.5")
    assert (config.rotary_base, config.rotary_percent, config.rotary_dim) == (500000, 0.5, 8)
    assert config_of("--use-rotary-position-embeddings --rotary-base 1e6").rotary_base == 1e6
    # Megatron-DeepSpeed's name for the base
    assert config_of("--use-rotary-position-embeddings "
                     "--rotary-position-embeddings-theta 20000").rotary_base == 20000


@pytest.mark.parametrize("spelled, canonical", [("rmsnorm", "RMSNorm"), ("RMSNorm", "RMSNorm"),
                                                ("layernorm", "LayerNorm"),
                                                ("LayerNorm", "LayerNorm")])
def test_normalization_any_case(spelled, canonical):
    args = validated(f"--normalization {spelled}")
    assert args.normalization == canonical == gpt_config_from_args(args, 10).normalization


def test_normalization_refusal():
    assert refusal("--normalization batchnorm") == \
        "--normalization batchnorm: use LayerNorm or RMSNorm (any case)"


def test_swiglu_and_ffn_default_follow_megatron():
    assert config_of("--swiglu").swiglu
    # Megatron-LM's rule: int(4h * 2/3 / 64) * 64 = int(2.67) * 64 for h = 64
    assert validated("--swiglu").ffn_hidden_size == 128 == \
        model_config.default_ffn_hidden_size(64, True)
    wide = validate_args(parse_args(
        "--num-layers 2 --hidden-size 4096 --num-attention-heads 32 --seq-length 32 "
        f"{TRAIN} --swiglu".split()), 1)
    assert wide.ffn_hidden_size == 10880  # Llama 2 7B uses 11008, given explicitly
    assert config_of("--swiglu --ffn-hidden-size 96").ffn_hidden_size == 96


@pytest.mark.parametrize("flags, groups", [
    ("--group-query-attention --num-query-groups 2", 2),
    ("--group-query-attention", 1),  # Megatron-LM's default group count
    ("--num-key-value-heads 2", 2),
    ("--num-key-value-heads 4", None),  # as many key/value heads as heads: MHA
    ("--group-query-attention --num-query-groups 4", None),
    ("--group-query-attention --num-key-value-heads 2", 2),
    ("--group-query-attention --num-query-groups 2 --num-key-value-heads 2", 2),
])
def test_query_groups(flags, groups):
    config = config_of(flags)
    assert config.num_query_groups == groups
    assert config.num_key_value_heads == (groups or 4)


@pytest.mark.parametrize("flags, message", [
    ("--num-query-groups 2", "--num-query-groups 2 needs --group-query-attention (without it "
                             "Megatron-LM ignores the groups)"),
    ("--group-query-attention --num-query-groups 3",
     "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    ("--num-key-value-heads 3", "--num-attention-heads 4 is not divisible by "
                                "--num-key-value-heads 3"),
    ("--group-query-attention --num-query-groups 2 --num-key-value-heads 1",
     "--num-query-groups 2 contradicts --num-key-value-heads 1; keep one"),
    ("--num-key-value-heads 0", "--num-key-value-heads 0 must be positive"),
])
def test_query_group_refusals(flags, message):
    assert refusal(flags) == message


def test_untied_head_biases_and_kv_channels():
    config = config_of("--untie-embeddings-and-output-weights --disable-bias-linear")
    assert config.untie_embeddings_and_output_weights and not config.add_bias_linear
    assert config_of("--disable-bias-linear --add-bias-linear").add_bias_linear
    # --kv-channels: hidden 62 is not divisible by 4 heads, which is fine with it
    args = validate_args(parse_args("--num-layers 2 --hidden-size 62 --num-attention-heads 4 "
                                    f"--seq-length 32 {TRAIN} --kv-channels 16".split()), 1)
    config = gpt_config_from_args(args, 10)
    assert (config.kv_channels, config.head_dim, config.qkv_size) == (16, 16, 192)
    assert "or give --kv-channels" in refusal("--hidden-size 62")
    assert config_of("--kv-channels 16").kv_channels is None  # 64 / 4: the default, stored so


def test_apply_layernorm_1p_changes_nothing():
    assert config_of("--apply-layernorm-1p") == config_of()


@pytest.mark.parametrize("flag", [
    "--use-flash-attn", "--use-flash-attn-v1", "--use-flash-attn-v2", "--use-flash-attn-triton",
    "--attention-backend fused", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
    "--no-gradient-accumulation-fusion", "--no-query-key-layer-scaling",
    "--apply-query-key-layer-scaling", "--no-async-tensor-model-parallel-allreduce",
    "--cross-entropy-loss-fusion", "--use-mcore-models", "--DDP-impl torch",
    "--DDP-impl local", "--sequence-parallel", "--empty-unused-memory-level 1",
    "--calculate-per-token-loss", "--log-throughput", "--profile --profile-step-start 4",
    "--ckpt-format torch_dist", "--tiktoken-pattern v2", "--no-mmap-bin-files",
    "--no-create-attention-mask-in-dataloader", "--data-impl mmap", "--data-impl infer",
    "--overlap-grad-reduce --overlap-param-gather", "--use-distributed-optimizer",
])
def test_accepted_without_effect_on_the_model(flag):
    assert config_of(flag) == config_of()
    help_text = _help_of(flag.split()[0])
    assert "no effect" in help_text or "Accepted" in help_text


def _help_of(option: str) -> str:
    from megatron_lite.arguments import build_parser

    [action] = [a for a in build_parser()._actions if option in a.option_strings]
    return " ".join(action.help.split())


def test_flash_attention_help_names_sdpa():
    assert "scaled_dot_product_attention" in _help_of("--use-flash-attn")
    assert "replaces DDP" in _help_of("--DDP-impl")


# -------------------- recomputation ---------------------------------------------------------------


@pytest.mark.parametrize("flags, full, method, layers, selective", [
    ("", False, "uniform", 1, False),
    ("--checkpoint-activations", True, "uniform", 1, False),
    ("--checkpoint-activations --checkpoint-num-layers 2", True, "uniform", 2, False),
    ("--recompute-granularity full", True, "uniform", 1, False),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 2",
     True, "block", 2, False),
    ("--recompute-granularity full --recompute-method uniform --checkpoint-activations",
     True, "uniform", 1, False),
    ("--recompute-granularity selective", False, "uniform", 1, True),
    ("--recompute-activations", False, "uniform", 1, True),
])
def test_recomputation(flags, full, method, layers, selective):
    args = validated(flags)
    config = gpt_config_from_args(args, 10)
    assert (config.checkpoint_activations, config.recompute_method, config.checkpoint_num_layers,
            config.recompute_attention) == (full, method, layers, selective)
    assert args.checkpoint_activations == full  # the loop counts recomputed FLOPs from it
    validate_args(args, 1)  # idempotent
    assert gpt_config_from_args(args, 10) == config


@pytest.mark.parametrize("flags, message", [
    ("--recompute-method block", "--recompute-method block needs --recompute-granularity full"),
    ("--recompute-num-layers 2", "--recompute-num-layers 2 needs --recompute-granularity full"),
    ("--recompute-granularity selective --recompute-method uniform",
     "--recompute-method uniform needs --recompute-granularity full"),
    ("--checkpoint-activations --recompute-granularity selective",
     "--checkpoint-activations (full recomputation) contradicts --recompute-granularity "
     "selective"),
    ("--checkpoint-activations --recompute-activations",
     "--checkpoint-activations (full recomputation) contradicts --recompute-activations"),
    ("--recompute-activations --recompute-granularity full",
     "--recompute-activations (selective) contradicts --recompute-granularity full"),
    ("--recompute-granularity full --recompute-num-layers 3 --checkpoint-num-layers 2",
     "--checkpoint-num-layers 2 contradicts --recompute-num-layers 3"),
    ("--recompute-granularity full --recompute-num-layers 3", "exceeds --num-layers 2"),
])
def test_recomputation_refusals(flags, message):
    assert message in refusal(flags)


# -------------------- training, schedule, data, distributed ---------------------------------------


def test_train_samples_become_iterations():
    train = "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-samples 100"
    args = validated("--lr-decay-samples 60 --lr-warmup-samples 20", train=train)
    assert (args.train_iters, args.lr_decay_iters, args.lr_warmup_iters) == (12, 7, 2)
    validate_args(args, 1)  # idempotent
    assert (args.train_iters, args.lr_decay_iters, args.lr_warmup_iters) == (12, 7, 2)
    args = validated("--lr-warmup-fraction 0.25", train=train)  # decay defaults to all samples
    assert (args.train_iters, args.lr_decay_iters, args.lr_warmup_iters) == (12, 12, 3)
    # the global batch from the DeepSpeed JSON sizes the iterations too
    args = parse_args(f"{SHAPE} --micro-batch-size 2 --lr 1e-3 --train-samples 100".split())
    reconcile_with_ds_config(args, EngineConfig.from_json({"train_batch_size": 20}))
    assert validate_args(args, 2).train_iters == 5


@pytest.mark.parametrize("flags, message", [
    ("--train-samples 100 --train-iters 10",
     "--train-samples 100 and --train-iters 10 are mutually exclusive; give one"),
    ("--train-iters 10 --lr-decay-samples 50",
     "--lr-decay-samples 50 is for sample-based training: give --train-samples, or use "
     "--lr-decay-iters with --train-iters"),
    ("--train-iters 10 --lr-warmup-samples 50", "--lr-warmup-samples 50 is for sample-based"),
    ("--train-samples 100 --lr-decay-iters 5", "--lr-decay-iters 5 with --train-samples: use "
                                               "--lr-decay-samples"),
    ("--train-samples 100 --lr-warmup-samples 8 --lr-warmup-iters 1",
     "--lr-warmup-samples 8 and --lr-warmup-iters 1 are mutually exclusive"),
    ("--train-samples 100 --lr-warmup-samples 8 --lr-warmup-fraction 0.1",
     "--lr-warmup-samples 8 and --lr-warmup-fraction 0.1 are mutually exclusive"),
    ("--train-samples 3", "--train-samples 3 is less than one derived global batch size 4"),
])
def test_sample_flag_refusals(flags, message):
    assert message in refusal(flags, train="--micro-batch-size 2 --lr 1e-3", world_size=2)


def test_batch_size_ramps_are_refused():
    assert "--rampup-batch-size 16 16 5859375: the global batch is fixed" in \
        refusal("--rampup-batch-size 16 16 5859375")
    assert "--step-batch-size-schedule 0:16 2.4B:320: the global batch is fixed" in \
        refusal("--step-batch-size-schedule 0:16 2.4B:320")


def test_decoupled_lr_group_follows_its_own_bounds():
    args = validated("--decoupled-lr 0.01 --decoupled-min-lr 0.001 --min-lr 1e-4 "
                     "--lr-decay-style linear --lr-warmup-iters 2")
    from pretrain_zeropp_gpt import parameter_groups

    with torch.device("meta"):
        model = GPTModel(gpt_config_from_args(args, 100))
    groups = parameter_groups(args, model)
    # 4 matrices a layer and the position table; 2 norms x 2 and 4 biases a layer and the
    # final norm's 2; the word embedding table, which the tied LM head shares
    assert [len(g["params"]) for g in groups] == [9, 18, 1]
    assert groups[2]["params"][0] is model.embedding.word_embeddings.weight
    assert (groups[2]["max_lr"], groups[2]["min_lr"], groups[2]["weight_decay"]) == (
        0.01, 0.001, args.weight_decay)
    assert parameter_groups(validated(), model) is None  # the engine's two Megatron groups
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.0}, {"lr": 0.0, "max_lr": 0.01,
                                                           "min_lr": 0.001}])
    schedule = AnnealingLR(optimizer, max_lr=1e-3, min_lr=1e-4, warmup_iters=2, decay_iters=10,
                           decay_style="linear")
    assert schedule.step(1) == pytest.approx(5e-4)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-4, 5e-3])
    schedule.step(10)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-4, 1e-3])
    assert "--decoupled-min-lr 0.001 needs --decoupled-lr" in refusal("--decoupled-min-lr 0.001")
    assert "--min-lr 0.001 exceeds --decoupled-lr 0.0001" in \
        refusal("--min-lr 0.001 --decoupled-lr 1e-4")


def test_optimizer_choice_and_the_deepspeed_block():
    assert validated().optimizer == "adam"
    adam = engine_config(validated(), EngineConfig())
    assert adam.optimizer.type == "AdamW"  # Megatron's adam: decoupled weight decay
    args = validated("--optimizer sgd --sgd-momentum 0.8 --weight-decay 0.05")
    sgd = engine_config(args, EngineConfig())
    assert sgd.optimizer.type == "SGD"
    assert optimizer_params(args, "SGD") == {"lr": 1e-3, "weight_decay": 0.05, "momentum": 0.8}
    assert optimizer_params(args, "AdamW") == {"lr": 1e-3, "weight_decay": 0.05,
                                               "betas": (0.9, 0.999), "eps": 1e-8}
    # the JSON block decides when --optimizer is not given, and must agree when it is
    sgd_block = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.5}}}
    no_lr = "--micro-batch-size 2 --train-iters 10"
    args = parse_args(f"{SHAPE} {no_lr}".split())
    reconcile_with_ds_config(args, EngineConfig.from_json(sgd_block))
    assert (args.optimizer, args.sgd_momentum, args.lr) == ("sgd", 0.5, 0.1)
    for flags, block, shown in (
            ("--optimizer adam", sgd_block, '"SGD"'),
            ("--optimizer sgd", {"optimizer": {"type": "AdamW"}}, '"AdamW"'),
            ("--optimizer adam", {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}},
             '"Adam" with adam_w_mode false')):
        args = parse_args(f"{SHAPE} {no_lr} {flags}".split())
        with pytest.raises(ArgumentError) as caught:
            reconcile_with_ds_config(args, EngineConfig.from_json(block))
        assert str(caught.value) == f"{flags} disagrees with optimizer.type {shown} in the " \
                                    "DeepSpeed config"
    args = parse_args(f"{SHAPE} {TRAIN} --optimizer adam".split())
    # DeepSpeed's Adam is AdamW
    reconcile_with_ds_config(args, EngineConfig.from_json({"optimizer": {"type": "Adam"}}))


def test_distributed_optimizer_overlap_and_bf16_reduction():
    assert "--use-distributed-optimizer partitions optimizer states, which ZeRO stage 1 and " \
           "above do; --zero-stage 0 replicates them: use stage 1 or higher" == \
        refusal("--use-distributed-optimizer --zero-stage 0")
    validated("--use-distributed-optimizer --zero-stage 1")
    args = validated("--grad-reduce-in-bf16")
    assert engine_config(args, EngineConfig()).communication_data_type == "bf16"
    assert engine_config(validated(), EngineConfig()).communication_data_type is None
    for flags, block, message in (
            ("--overlap-grad-reduce", {"zero_optimization": {"overlap_comm": False}},
             "--overlap-grad-reduce disagrees with zero_optimization.overlap_comm false"),
            ("--grad-reduce-in-bf16", {"communication_data_type": "fp32"},
             '--grad-reduce-in-bf16 disagrees with communication_data_type "fp32"')):
        with pytest.raises(ArgumentError, match=message):
            reconcile_with_ds_config(parse_args(f"{SHAPE} {TRAIN} {flags}".split()),
                                     EngineConfig.from_json(block))


@pytest.mark.parametrize("flags, message", [
    ("--data-impl lazy", "--data-impl lazy: only Megatron's mmap indexed dataset is read here"),
    ("--data-impl cached", "--data-impl cached: only Megatron's mmap indexed dataset"),
    ("--fp8-format hybrid", "--fp8-format hybrid: there is no FP8 path here"),
    ("--fp8-amax-history-len 1024", "--fp8-amax-history-len 1024: there is no FP8 path here"),
    ("--fp8-amax-compute-algo max", "--fp8-amax-compute-algo max: there is no FP8 path here"),
    ("--fp8-param-gather", "--fp8-param-gather: there is no FP8 path here"),
    ("--context-parallel-size 2", "--context-parallel-size must be 1, got 2"),
    ("--tokenizer-type NullTokenizer", "--tokenizer-type NullTokenizer needs --vocab-size"),
    ("--exit-duration-in-mins 0", "--exit-duration-in-mins 0.0 must be positive"),
])
def test_refusals(flags, message):
    assert message in refusal(flags)


def test_exit_duration_data_cache_path_and_split_quotes():
    args = validated("--exit-duration-in-mins 235 --data-cache-path /x --split '99,1,0'")
    assert args.exit_duration_in_mins == 235.0
    assert CheckpointConfig.from_args(args).exit_duration_in_mins == 235.0
    assert args.data_cache_dir == "/x"
    assert args.split_fractions == pytest.approx((0.99, 0.01, 0.0))


def test_backend_choice(monkeypatch):
    import torch.distributed as dist

    from pretrain_zeropp_gpt import choose_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_backend(None) == (None, None)  # the engine's own choice
    assert choose_backend("gloo") == ("gloo", None)
    assert choose_backend("nccl") == ("gloo", "--distributed-backend nccl needs CUDA, which "
                                              "this machine lacks")
    monkeypatch.setattr(dist, "is_backend_available", lambda name: name != "ccl")
    assert choose_backend("ccl")[0] == "gloo" and "oneccl" in choose_backend("ccl")[1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert choose_backend("nccl") == ("nccl", None)
    assert choose_backend("gloo")[0] == "gloo" and "trains on the CPU" in choose_backend("gloo")[1]


# -------------------- tokenizers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    from data.train_tokenizer import train_sentencepiece

    directory = tmp_path_factory.mktemp("spm")
    with (directory / "docs.jsonl").open("w", encoding="utf-8") as out:
        for name in sorted(topics)[:30]:
            out.write(json.dumps({"text": topics[name][:3000]}) + "\n")
    model, _ = train_sentencepiece(directory / "docs.jsonl", directory / "spm", vocab_size=400,
                                   num_threads=1)
    return model


def test_sentencepiece_tokenizers_of_megatron(spm_model):
    plain = SentencePieceTokenizer(spm_model)
    text = "Return the value of x."
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(spm_model))
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=str(spm_model))
    assert isinstance(gpt, GPTSentencePieceTokenizer) and isinstance(llama, Llama2Tokenizer)
    assert gpt.tokenize(text) == plain.tokenize(text)  # no BOS
    assert llama.tokenize(text) == [1, *plain.tokenize(text)]  # BOS (<s>, id 1) first
    assert llama.tokenize_batch([text, "x"]) == [llama.tokenize(text), llama.tokenize("x")]
    assert gpt.eod == llama.eod == 2 and gpt.vocab_size == llama.vocab_size == 400
    assert llama.detokenize(llama.tokenize(text)) == text


def test_null_tokenizer():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=128256)
    assert isinstance(tokenizer, NullTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (128256, 128255)  # Megatron-LM's rule
    assert tokenizer.tokenize("5 17\n 3") == [5, 17, 3]
    assert tokenizer.detokenize([5, 17, 3]) == "5 17 3"
    with pytest.raises(ValueError, match="outside the NullTokenizer vocabulary"):
        tokenizer.tokenize("128256")
    with pytest.raises(ValueError, match="needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    assert "Llama2Tokenizer" in _help_of("--tokenizer-type")


# -------------------- resume check and time budget (units) ----------------------------------------


class _Trainer:
    iteration = 1
    config = LoopConfig(train_iters=10, global_batch_size=1, gradient_accumulation_steps=1,
                        seq_length=8, log_interval=1, eval_iters=1)
    printed: list[str] = []

    def log(self, text):
        self.printed.append(text)


def test_stop_flags_cross_ranks_only_where_the_host_reads(monkeypatch):
    """The stop flags (SIGTERM, the time budget) are agreed at a log, save or last
    iteration: elsewhere nothing is reduced or read back, so the device's queue is never
    drained for them."""
    agreed_at = []
    trainer = _Trainer()
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda self: agreed_at.append(trainer.iteration) or [0.0] * 3)
    control = RunControl(CheckpointConfig(save="ckpt", save_interval=6,
                                          exit_duration_in_mins=60), None, None, None)
    trainer.config = dataclasses.replace(_Trainer.config, log_interval=4)
    for iteration in range(1, 11):
        trainer.iteration = iteration
        assert not control.should_stop(trainer, torch.tensor(1.0), applied=True)
    assert agreed_at == [4, 6, 8, 10]  # logs at 4 and 8, a save at 6, the last at 10


def test_time_budget_stops_and_says_why():
    control = RunControl(CheckpointConfig(exit_duration_in_mins=1e-9), engine=None,
                         lr_scheduler=None, model_config=None)
    assert control.should_stop(_Trainer(), torch.tensor(1.0), applied=True)
    assert control.out_of_time == "stopped by --exit-duration-in-mins 1e-09"
    assert "passed --exit-duration-in-mins 1e-09: exiting (no --save) after iteration 1" in \
        _Trainer.printed[-1]
    patient = RunControl(CheckpointConfig(exit_duration_in_mins=60), None, None, None)
    assert not patient.should_stop(_Trainer(), torch.tensor(1.0), applied=True)


# -------------------- entry point ------------------------------------------------------------------

LLAMA = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "3e-3", "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100",
    "--num-workers", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "100", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
    "--swiglu", "--group-query-attention", "--num-query-groups", "2",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--zero-stage", "3",
]


def _main(argv: list[str]) -> tuple[int, str, str]:
    from pretrain_zeropp_gpt import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def llama_runs(rank: int, world_size: int, directory: str) -> dict:
    from megatron_lite.checkpointing import checkpoint_tag
    from pretrain_zeropp_gpt import build_training
    from zeropp.checkpoints.checkpoint import client_state

    results = {"llama": _main([*LLAMA, "--train-iters", "3", "--save", f"{directory}/llama"])}
    results["saved_config"] = client_state(f"{directory}/llama")["model_config"]
    without_swiglu = [a for a in LLAMA if a != "--swiglu"]
    results["resume"] = _main([*without_swiglu, "--train-iters", "4", "--load",
                               f"{directory}/llama"])
    results["timed"] = _main([*LLAMA, "--train-iters", "5", "--exit-duration-in-mins", "1e-5",
                              "--save", f"{directory}/timed"])
    results["timed_tag"] = Path(directory, "timed", "latest").read_text()
    assert results["timed_tag"] == checkpoint_tag(1)
    training = build_training(parse_args([*LLAMA, "--train-iters", "2", "--optimizer", "sgd",
                                          "--sgd-momentum", "0.8", "--decoupled-lr", "0.01"]))
    inner = training.engine.optimizer.inner
    results["optimizer"] = (type(inner).__name__, [
        (g["momentum"], g["weight_decay"], g.get("max_lr")) for g in inner.param_groups])
    training.close()
    return results


def test_llama_model_on_two_ranks(tmp_path):
    ranks = run_ranks(llama_runs, 2, str(tmp_path), timeout=120)
    last = ranks[-1]  # the logging rank
    code, out, err = last["llama"]
    assert code == 0, err
    assert "> architecture: positions rope (base 10000, 100% of channels), RMSNorm, SwiGLU MLP " \
           "64, 2 key/value heads of 8 channels, untied output layer, no linear biases" in \
           ranks[0]["llama"][1]
    losses = [float(line.split("lm loss: ")[1].split()[0]) for line in out.splitlines()
              if "lm loss: " in line and line.startswith(" iteration")]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)
    saved = last["saved_config"]
    assert (saved["position_embedding_type"], saved["normalization"], saved["swiglu"],
            saved["num_query_groups"], saved["untie_embeddings_and_output_weights"],
            saved["add_bias_linear"]) == ("rope", "RMSNorm", True, 2, True, False)
    # the checkpoint names what differs instead of a tensor shape, on every rank
    for rank in ranks:
        code, _, err = rank["resume"]
        assert code == 1
        [line] = err.splitlines()
        assert line.startswith(f"error: checkpoint {tmp_path}/llama was written for another "
                               "model: ") and "swiglu=True (this run: False)" in line
    code, out, err = last["timed"]
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith(" iteration")][-1].startswith(
        " iteration        1/       5")
    assert "passed --exit-duration-in-mins 1e-05: saving and exiting after iteration 1" in out
    assert "no validation loss: stopped by --exit-duration-in-mins 1e-05" in out
    assert ranks[0]["timed_tag"] == "iter_0000001"
    name, groups = last["optimizer"]
    assert name == "SGD"
    assert groups == [(0.8, 0.01, None), (0.8, 0.0, None), (0.8, 0.01, 0.01)]


def test_nccl_on_a_cpu_machine_runs_on_gloo_and_says_so():
    result = run([sys.executable, ENTRY_POINT, *LLAMA, "--train-samples", "8",
                  "--distributed-backend", "nccl"], timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| train iters 2\n" in result.stdout  # --train-samples 8 // global batch 4
    if torch.cuda.is_available():
        assert "> distributed backend" not in result.stdout
    else:
        assert "> distributed backend: gloo (--distributed-backend nccl needs CUDA, which this " \
               "machine lacks)" in result.stdout.splitlines()


# -------------------- the launch scripts of Megatron-LM and Megatron-DeepSpeed --------------------


def script_arguments(name: str, work: Path, substitutions: dict[str, str],
                     script_args: tuple[str, ...] = ()) -> list[str]:
    """The arguments the script passes to pretrain_gpt.py, expanded by bash itself: the
    script runs in ``work`` with ``torchrun`` replaced by a recorder of its argv. Only the
    text in ``substitutions`` changes (each occurs exactly once)."""
    text = (SCRIPTS / name).read_text()
    for old, new in substitutions.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    work.mkdir(parents=True, exist_ok=True)
    (work / "pretrain_gpt.py").write_text("")  # Megatron-LM's script checks that it exists
    (work / "tmp").mkdir(exist_ok=True)  # Megatron-DeepSpeed's writes ./tmp/deepspeed.json
    (work / "run.sh").write_text(text)
    bin_dir = work / "bin"
    bin_dir.mkdir(exist_ok=True)
    recorder = bin_dir / "torchrun"
    recorder.write_text('#!/bin/bash\nprintf \'%s\\0\' "$@" > "$ARGV_FILE"\n')
    recorder.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "ARGV_FILE": str(work / "argv")}
    for variable in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):  # the scripts' defaults
        env.pop(variable, None)
    subprocess.run(["bash", "run.sh", *script_args], cwd=work, env=env, check=True,
                   capture_output=True, timeout=30)
    argv = (work / "argv").read_bytes().decode().split("\0")[:-1]
    return argv[argv.index("pretrain_gpt.py") + 1:]


def validated_script(argv: list[str], work: Path, world_size: int, monkeypatch):
    """What pretrain_zeropp_gpt.py does with the arguments before building anything."""
    from pretrain_zeropp_gpt import check_supported

    monkeypatch.chdir(work)  # the scripts' relative paths
    args = parse_args(argv)
    ds_config = read_ds_config(args)
    validate_args(args, world_size)
    check_supported(args, ds_config)
    engine_config(args, ds_config)
    return args


# Megatron-LM's Llama 3 8B: 8 GPUs. DTYPE is the script's own switch: "fp8" adds FP8 flags.
LLAMA3 = "train_llama3_8b_h100_fp8.sh"


def test_megatron_lm_llama3_script_refuses_only_fp8(tmp_path, monkeypatch):
    argv = script_arguments(LLAMA3, tmp_path, {})  # verbatim: DTYPE="fp8"
    assert argv[argv.index("--fp8-format") + 1] == "hybrid"
    with pytest.raises(ArgumentError, match=r"^--fp8-format hybrid: there is no FP8 path here"):
        validated_script(argv, tmp_path, 8, monkeypatch)


@pytest.mark.parametrize("branch", ["mock", "data"])
def test_megatron_lm_llama3_script_in_bf16(tmp_path, monkeypatch, branch):
    # Substitution: DTYPE "fp8" -> "bf16", the script's switch that leaves FP8 out. The
    # "data" branch gets the script's positional paths (checkpoints, tensorboard, tokenizer,
    # data); the "mock" branch is the script's default (MOCK tokenizer and data).
    paths = ("ckpt", "tb", "tokenizer_dir", "data/llama_text_document") if branch == "data" \
        else ()
    argv = script_arguments(LLAMA3, tmp_path, {'DTYPE="fp8"': 'DTYPE="bf16"'}, paths)
    args = validated_script(argv, tmp_path, 8, monkeypatch)
    assert args.mock_data == (branch == "mock")
    vocab_size = build_tokenizer("NullTokenizer", vocab_size=args.vocab_size).vocab_size \
        if branch == "mock" else 128256  # Llama 3's tokenizer (not read: its path is a stand-in)
    config = gpt_config_from_args(args, vocab_size)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads,
            config.ffn_hidden_size, config.max_position_embeddings) == (32, 4096, 32, 14336, 8192)
    assert (config.position_embedding_type, config.rotary_base, config.rotary_percent) == (
        "rope", 1000000, 1.0)
    assert (config.normalization, config.swiglu, config.num_query_groups, config.head_dim) == (
        "RMSNorm", True, 8, 128)
    assert config.untie_embeddings_and_output_weights and not config.add_bias_linear
    assert (config.init_method_std, config.hidden_dropout, config.attention_dropout) == (
        0.0134, 0.0, 0.0)
    assert 8.0e9 < config.num_parameters() < 8.1e9  # Llama 3 8B: 8.03B
    assert (args.global_batch_size, args.gradient_accumulation_steps) == (128, 16)
    assert (args.train_iters, args.lr_decay_iters, args.lr_warmup_iters) == (
        1953125000 // 128, 1949218748 // 128, 3906252 // 128)
    assert (args.decoupled_lr, args.decoupled_min_lr) == (5e-4, 4.5e-5)
    assert args.exit_duration_in_mins == 235 and args.bf16 and args.grad_reduce_in_bf16
    assert args.use_distributed_optimizer and args.zero_stage == 3
    assert args.split_fractions == pytest.approx((0.99, 0.01, 0.0))


def test_megatron_lm_gpt3_175b_script(tmp_path, monkeypatch):
    # Substitutions: --tensor-model-parallel-size 8 and --pipeline-model-parallel-size 16 -> 1
    # (refused by design); the positional arguments are the script's five paths.
    parallel = {"--tensor-model-parallel-size 8": "--tensor-model-parallel-size 1",
                "--pipeline-model-parallel-size 16": "--pipeline-model-parallel-size 1"}
    paths = ("ckpt", "tb", "gpt2-vocab.json", "gpt2-merges.txt", "data/gpt_text_document")
    argv = script_arguments("train_gpt3_175b_distributed.sh", tmp_path / "as-is", parallel, paths)
    with pytest.raises(ArgumentError, match=r"^--step-batch-size-schedule 0:16 2.4B:320 4.8B:624 "
                                            r"7.2B:928 9.6B:1232 12B:1536: the global batch is "
                                            "fixed for the whole run"):
        validated_script(argv, tmp_path / "as-is", 8, monkeypatch)
    # Without the schedule (which Megatron-LM itself refuses next to --global-batch-size, as
    # this script gives both), everything else is accepted.
    schedule = '    --step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"\n'
    argv = script_arguments("train_gpt3_175b_distributed.sh", tmp_path / "fixed",
                            {**parallel, schedule: ""}, paths)
    args = validated_script(argv, tmp_path / "fixed", 8, monkeypatch)
    config = gpt_config_from_args(args, 50257)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads,
            config.ffn_hidden_size) == (96, 12288, 96, 4 * 12288)
    assert (config.position_embedding_type, config.normalization, config.swiglu) == (
        "learned_absolute", "LayerNorm", False)
    assert not config.untie_embeddings_and_output_weights and config.add_bias_linear
    assert 174e9 < config.num_parameters() < 176e9
    assert (args.global_batch_size, args.gradient_accumulation_steps) == (1536, 192)
    assert (args.lr_decay_iters, args.lr_warmup_iters) == (430000, 430) and args.fp16


@pytest.mark.parametrize("activation_checkpoint", ["false", "true"])
def test_megatron_deepspeed_llama2_script(tmp_path, monkeypatch, activation_checkpoint):
    # Substitutions: TP=2 and PP=2 -> 1 (refused by design); "true" is the script's own
    # switch for activation checkpointing (commented in the script).
    substitutions = {"\nTP=2\n": "\nTP=1\n", "\nPP=2\n": "\nPP=1\n"}
    if activation_checkpoint == "true":
        substitutions['\nactivation_checkpoint="false"'] = '\nactivation_checkpoint="true"'
    argv = script_arguments("pretrain_llama2_distributed.sh", tmp_path, substitutions)
    args = validated_script(argv, tmp_path, 8, monkeypatch)
    config = gpt_config_from_args(args, 32000)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads,
            config.ffn_hidden_size, config.max_position_embeddings) == (24, 2048, 16, 5504, 2048)
    assert (config.position_embedding_type, config.normalization, config.swiglu,
            config.num_query_groups) == ("rope", "RMSNorm", True, 4)
    assert config.untie_embeddings_and_output_weights and not config.add_bias_linear
    assert (config.hidden_dropout, config.attention_dropout) == (0.0, 0.0)
    assert config.checkpoint_activations == (activation_checkpoint == "true")
    assert config.recompute_method == "uniform" and not config.recompute_attention
    assert (args.tokenizer_type, args.data_impl, args.distributed_backend, args.optimizer) == (
        "GPTSentencePieceTokenizer", "mmap", "nccl", "adam")
    assert args.zero_stage == 0 and args.bf16 and not args.apply_query_key_layer_scaling
    assert (args.global_batch_size, args.gradient_accumulation_steps) == (32, 1)
    assert args.data_blend == [(1.0, "./tmp/data/bookcorpus_train_1m_text_sentence")]
