"""The Megatron command line: tutorial compatibility, validation, derived values, DeepSpeed JSON."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from megatron_lite import arguments
from megatron_lite.arguments import (
    ArgumentError,
    parse_args,
    parse_data_blend,
    parse_split,
    validate_args,
)
from megatron_lite.ds_config import read_ds_config
from zeropp.config import ConfigError

# The DeepSpeed ZeRO++ tutorial's launch line, verbatim apart from the config path.
TUTORIAL_ARGV = (
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 40 "
    "--hidden-size 6144 --seq-length 512 --num-attention-heads 32 --batch-size 1 --zero-stage 3 "
    "--deepspeed_config {ds} --deepspeed-activation-checkpointing --fp16 --checkpoint-activations"
)
SMALL_MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"


@pytest.fixture
def ds_path(tmp_path: Path) -> Path:
    path = tmp_path / "ds.json"
    path.write_text("{}")
    return path


def small(extra: str = "", train: str = "--train-iters 100 --lr 1e-4") -> list[str]:
    return f"{SMALL_MODEL} --micro-batch-size 2 {train} {extra}".split()


def validated(argv: list[str], world_size: int = 1):
    return validate_args(parse_args(argv), world_size)


# -------------------- parsing --------------------------------------------------------------------


def test_tutorial_command_line_parses_unchanged(ds_path: Path) -> None:
    args = parse_args(TUTORIAL_ARGV.format(ds=ds_path).split())
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (40, 6144, 32)
    assert (args.seq_length, args.micro_batch_size, args.zero_stage) == (512, 1, 3)
    assert args.fp16 and not args.bf16
    assert args.checkpoint_activations and args.deepspeed_activation_checkpointing
    assert args.deepspeed_config == str(ds_path)
    assert args.explicit_args == {
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers",
        "hidden_size", "seq_length", "num_attention_heads", "micro_batch_size", "zero_stage",
        "deepspeed_config", "deepspeed_activation_checkpointing", "fp16",
        "checkpoint_activations",
    }


def test_tutorial_command_line_validates_as_a_dry_run(ds_path: Path) -> None:
    args = validated(TUTORIAL_ARGV.format(ds=ds_path).split() + ["--dry-run"], world_size=16)
    assert args.global_batch_size == 16 and args.gradient_accumulation_steps == 1
    assert args.params_dtype is torch.float16


def test_defaults_match_megatron_and_deepspeed() -> None:
    args = parse_args(small())
    assert args.split == "969,30,1"
    assert args.make_vocab_size_divisible_by == 128
    assert (args.hidden_dropout, args.attention_dropout, args.init_method_std) == (0.1, 0.1, 0.02)
    assert args.checkpoint_num_layers == 1
    assert args.initial_loss_scale == 2.0**16 and args.loss_scale is None
    assert (args.min_loss_scale, args.loss_scale_window, args.hysteresis) == (1.0, 1000, 2)
    assert args.lr_decay_style == "linear"


@pytest.mark.parametrize(
    ("extra", "dest", "value"),
    [
        ("--local_rank=3", "local_rank", 3),
        ("--local-rank 5", "local_rank", 5),
        ("--deepspeed-config x.json", "deepspeed_config", "x.json"),
        ("--deepspeed_config=y.json", "deepspeed_config", "y.json"),
        ("--batch-size 7", "micro_batch_size", 7),
        ("--data-path 0.3 A 0.7 B", "data_path", ["0.3", "A", "0.7", "B"]),
        ("--lr-decay-style cosine", "lr_decay_style", "cosine"),
    ],
)
def test_aliases_and_launcher_forms(extra: str, dest: str, value: object) -> None:
    args = parse_args(small(extra))
    assert getattr(args, dest) == value
    assert dest in args.explicit_args


def test_explicit_args_excludes_defaults_even_when_equal() -> None:
    args = parse_args(small("--clip-grad 1.0"))
    assert "clip_grad" in args.explicit_args
    assert "weight_decay" not in args.explicit_args and "fp16" not in args.explicit_args


def test_unknown_flag_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(small("--no-such-flag 1"))
    assert exit_info.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


def test_help_is_grouped_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    titles = ["model:", "training:", "learning rate:", "data:", "mixed precision:",
              "checkpointing:", "distributed/ZeRO:", "logging:"]
    positions = [text.index("\n" + title) for title in titles]
    assert positions == sorted(positions)
    distributed = text[text.index("\ndistributed/ZeRO:"):text.index("\nlogging:")]
    assert "--zero-stage" in distributed and "--local_rank" in distributed


# -------------------- validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "world_size", "message"),
    [
        ("--tensor-model-parallel-size 2", 2,
         "this engine is data-parallel ZeRO only; --tensor-model-parallel-size must be 1"),
        ("--pipeline-model-parallel-size 4", 4, "--pipeline-model-parallel-size must be 1"),
        ("--num-attention-heads 5", 1, "--hidden-size 64 is not divisible by "
         "--num-attention-heads 5"),
        ("--fp16 --bf16", 1, "--fp16 and --bf16 are mutually exclusive"),
        ("--global-batch-size 12", 4, "--global-batch-size 12 is not divisible by "
         "--micro-batch-size 2 x data-parallel size 4 (= 8)"),
        ("--max-position-embeddings 16", 1, "--seq-length 32 exceeds --max-position-embeddings 16"),
        ("--lr-warmup-iters 5 --lr-warmup-fraction 0.1", 1, "mutually exclusive"),
        ("--hidden-size 0", 1, "--hidden-size 0 must be positive"),
        ("--micro-batch-size -1", 1, "--micro-batch-size -1 must be positive"),
        ("--num-workers -1", 1, "--num-workers -1 must not be negative"),
        ("--hidden-dropout 1.5", 1, "--hidden-dropout 1.5 must lie in [0, 1)"),
        ("--zero-stage 4", 1, "--zero-stage 4 is not a ZeRO stage: use 0 (plain data parallel), "
         "1, 2 or 3 (ZeRO-3"),
        ("--ranks-per-node 3", 4, "--ranks-per-node 3 does not divide the world size 4"),
        ("--min-lr 1e-3", 1, "--min-lr 0.001 exceeds --lr 0.0001"),
        ("--lr-warmup-iters 200", 1, "--lr-warmup-iters 200 exceeds derived lr decay iters 100"),
        ("--save-interval 10", 1, "--save-interval 10 needs --save DIR"),
        ("--data-path 0.5 A 0.5", 1, "--data-path takes one prefix or weight-prefix pairs"),
        ("--data-path x A 0.5 B", 1, "--data-path weight 'x' is not a number"),
        ("--split 1,2,3,4", 1, "--split '1,2,3,4' has more than three parts"),
        ("--deepspeed_config /nonexistent/ds.json", 1,
         "--deepspeed_config /nonexistent/ds.json: no such file"),
    ],
)
def test_validation_errors_name_the_problem(extra: str, world_size: int, message: str) -> None:
    with pytest.raises(ArgumentError) as error:
        validated(small(extra), world_size)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_argument_error_is_a_value_error() -> None:
    assert issubclass(ArgumentError, ValueError)


@pytest.mark.parametrize(
    ("train", "message"),
    [("--lr 1e-4", "--train-iters is required for training"),
     ("--train-iters 10", "--lr is required for training")],
)
def test_training_requires_iterations_and_lr(train: str, message: str) -> None:
    with pytest.raises(ArgumentError, match=message):
        validated(small(train=train))


def test_dry_run_needs_neither_iterations_nor_lr() -> None:
    args = validated(small("--dry-run", train=""))
    assert args.train_iters is None and args.lr_decay_iters is None and args.lr_warmup_iters == 0


def test_model_shape_flags_are_required() -> None:
    with pytest.raises(ArgumentError, match="--num-attention-heads is required"):
        validated("--num-layers 2 --hidden-size 64 --seq-length 8 --micro-batch-size 1".split())


def test_micro_batch_size_is_required_somewhere() -> None:
    with pytest.raises(ArgumentError, match="--micro-batch-size is required"):
        validated(f"{SMALL_MODEL} --train-iters 1 --lr 1e-4".split())


# -------------------- derived values -------------------------------------------------------------


def test_derived_values() -> None:
    args = validated(small("--global-batch-size 48 --bf16 --lr-warmup-fraction 0.25"), 4)
    assert args.data_parallel_size == 4
    assert args.global_batch_size == 48
    assert args.gradient_accumulation_steps == 48 // (2 * 4)
    assert args.params_dtype is torch.bfloat16
    assert args.lr_decay_iters == 100
    assert args.lr_warmup_iters == 25
    assert args.max_position_embeddings == 32
    assert args.ffn_hidden_size == 4 * 64


def test_defaults_derive_global_batch_and_fp32() -> None:
    args = validated(small(), world_size=3)
    assert (args.global_batch_size, args.gradient_accumulation_steps) == (6, 1)
    assert args.params_dtype is torch.float32
    assert args.lr_warmup_iters == 0


def test_warmup_fraction_is_of_decay_iters_not_train_iters() -> None:
    args = validated(small("--lr-decay-iters 40 --lr-warmup-fraction 0.5"))
    assert args.lr_warmup_iters == 20


def test_local_rank_falls_back_to_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "6")
    assert validated(small()).local_rank == 6
    assert validated(small("--local_rank=2")).local_rank == 2


def test_validate_is_idempotent() -> None:
    args = validated(small("--lr-warmup-fraction 0.1"), 2)
    first = dict(vars(args))
    validate_args(args, 2)
    assert vars(args) == first


def test_revalidation_for_a_new_world_size_rederives_batch() -> None:
    args = validated(small(), 2)
    assert args.global_batch_size == 4
    validate_args(args, 8)
    assert (args.global_batch_size, args.data_parallel_size) == (16, 8)


def test_data_blend_and_split_parsing() -> None:
    assert parse_data_blend(None) is None
    assert parse_data_blend(["corpus_text_document"]) == [(1.0, "corpus_text_document")]
    blend = parse_data_blend(["3", "A", "1", "B"])
    assert blend == [(0.75, "A"), (0.25, "B")]
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("8/2") == pytest.approx((0.8, 0.2, 0.0))
    args = validated(small("--data-path 0.2 A 0.6 B"))
    assert args.data_blend == [pytest.approx((0.25, "A")), pytest.approx((0.75, "B"))]


# -------------------- DeepSpeed JSON -------------------------------------------------------------


def with_ds(tmp_path: Path, ds: dict, extra: str = "", world_size: int | None = 2,
            train: str = "--train-iters 100 --lr 1e-4"):
    """parse -> read the JSON (parsed once, reconciled) -> validate, as the entry point does."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    args = parse_args(f"{SMALL_MODEL} {train} --deepspeed_config {path} {extra}".split())
    read_ds_config(args)
    if world_size is not None:
        validate_args(args, world_size)
    return args


def test_disagreement_names_both_places_and_values(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError) as error:
        with_ds(tmp_path, {"train_micro_batch_size_per_gpu": 2}, "--micro-batch-size 4")
    assert str(error.value) == (
        f"--micro-batch-size 4 disagrees with train_micro_batch_size_per_gpu 2 in "
        f"{tmp_path / 'ds.json'}"
    )


@pytest.mark.parametrize(
    ("ds", "extra", "message"),
    [
        ({"train_batch_size": 64}, "--micro-batch-size 1 --global-batch-size 32",
         "--global-batch-size 32 disagrees with train_batch_size 64"),
        ({"fp16": {"enabled": False}}, "--micro-batch-size 1 --fp16",
         "--fp16 disagrees with fp16.enabled false"),
        ({"bf16": {"enabled": True}}, "--micro-batch-size 1 --fp16",
         "fp16 and bf16 are both enabled (--fp16 and bf16.enabled in"),
        ({"gradient_clipping": 0.5}, "--micro-batch-size 1 --clip-grad 1.0",
         "--clip-grad 1.0 disagrees with gradient_clipping 0.5"),
        ({"fp16": {"enabled": True, "initial_scale_power": 16}},
         "--micro-batch-size 1 --initial-loss-scale 4096",
         "--initial-loss-scale 4096.0 disagrees with fp16.initial_scale_power 16 (= 65536) in"),
        ({"fp16": {"enabled": True, "loss_scale": 0}}, "--micro-batch-size 1 --loss-scale 128",
         "--loss-scale 128.0 disagrees with fp16.loss_scale 0"),
        ({"fp16": {"hysteresis": 4}}, "--micro-batch-size 1 --hysteresis 2",
         "--hysteresis 2 disagrees with fp16.hysteresis 4"),
        ({"zero_optimization": {"stage": 0}}, "--micro-batch-size 1 --zero-stage 3",
         "--zero-stage 3 disagrees with zero_optimization.stage 0"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}},
         "--micro-batch-size 1 --adam-beta2 0.999",
         "--adam-beta2 0.999 disagrees with optimizer.params.betas[1] 0.95"),
        ({"fp16": {"enabled": True, "min_loss_scale": 2}}, "--min-loss-scale 4",
         "--min-loss-scale 4.0 disagrees with fp16.min_loss_scale 2 in"),
    ],
)
def test_reconcile_rejects_disagreement(tmp_path: Path, ds: dict, extra: str,
                                        message: str) -> None:
    with pytest.raises(ArgumentError) as error:
        with_ds(tmp_path, ds, extra, world_size=None)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("ds", "message"),
    [
        ({"train_micro_batch_size_per_gpu": "auto"},
         'train_micro_batch_size_per_gpu: "auto" is a Hugging Face Trainer placeholder'),
        ({"fp16": True}, "fp16: expected an object, got true"),
        ({"fp16": {"enabled": "yes"}}, 'fp16.enabled: expected true or false, got "yes"'),
        ({"gradient_accumulation_steps": 0},
         "gradient_accumulation_steps: expected a positive integer, got 0"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
         "optimizer.params.betas: expected two numbers in [0, 1), got [0.9]"),
        ({"zero_optimization": {"stage": 4}},
         "zero_optimization.stage: expected one of 0, 1, 2, 3, got 4"),
    ],
)
def test_wrong_json_types_are_the_parsers_one_line_naming_file_and_key(
        tmp_path: Path, ds: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        with_ds(tmp_path, ds, "--micro-batch-size 1", world_size=None)
    assert str(error.value).startswith(f"{tmp_path / 'ds.json'}: {message}")
    assert "\n" not in str(error.value)


def test_values_only_in_json_are_taken(tmp_path: Path) -> None:
    ds = {
        "train_micro_batch_size_per_gpu": 3,
        "train_batch_size": 24,
        "gradient_clipping": 0.5,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                 "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 2},
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                                  "eps": 1e-6, "weight_decay": 0.1}},
    }
    args = with_ds(tmp_path, ds, world_size=4, train="--train-iters 10")
    assert (args.micro_batch_size, args.global_batch_size) == (3, 24)
    assert args.gradient_accumulation_steps == 2
    assert args.clip_grad == 0.5 and args.fp16 and args.params_dtype is torch.float16
    assert args.loss_scale is None and args.initial_loss_scale == 4096.0
    assert (args.loss_scale_window, args.hysteresis, args.min_loss_scale) == (500, 3, 2)
    assert (args.lr, args.adam_beta1, args.adam_beta2) == (3e-4, 0.9, 0.95)
    assert (args.adam_eps, args.weight_decay) == (1e-6, 0.1)


def test_static_loss_scale_from_json(tmp_path: Path) -> None:
    args = with_ds(tmp_path, {"fp16": {"enabled": True, "loss_scale": 1024}},
                   "--micro-batch-size 1")
    assert args.loss_scale == 1024.0


def test_values_only_on_cli_are_kept(tmp_path: Path) -> None:
    args = with_ds(tmp_path, {"zero_optimization": {"stage": 3}}, "--micro-batch-size 2 --fp16")
    assert args.fp16 and args.micro_batch_size == 2 and args.global_batch_size == 4


def test_equal_values_in_both_places_are_fine(tmp_path: Path) -> None:
    ds = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 8,
          "fp16": {"enabled": True}}
    args = with_ds(tmp_path, ds, "--micro-batch-size 2 --global-batch-size 8 --fp16")
    assert args.gradient_accumulation_steps == 2


def test_accumulation_steps_from_json_set_the_global_batch(tmp_path: Path) -> None:
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    args = with_ds(tmp_path, ds, world_size=4)
    assert (args.global_batch_size, args.gradient_accumulation_steps) == (2 * 3 * 4, 3)


def test_micro_batch_follows_from_train_batch_and_accumulation(tmp_path: Path) -> None:
    ds = {"train_batch_size": 32, "gradient_accumulation_steps": 2}
    args = with_ds(tmp_path, ds, world_size=4)
    assert args.micro_batch_size == 4


def test_inconsistent_accumulation_steps(tmp_path: Path) -> None:
    ds = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 16,
          "gradient_accumulation_steps": 3}
    with pytest.raises(ArgumentError, match="gradient_accumulation_steps 3 in .* disagrees with "
                       r"train_batch_size 16 in .* = 4"):
        with_ds(tmp_path, ds, world_size=2)


@pytest.mark.parametrize(
    ("ds", "global_batch", "accumulation"),
    [({"gradient_accumulation_steps": 4}, 16, 4), ({"train_batch_size": 8}, 8, 2)],
)
def test_reconcile_after_validate_rederives(tmp_path: Path, ds: dict, global_batch: int,
                                            accumulation: int) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    args = validated(small(f"--deepspeed_config {path}"), world_size=2)
    assert (args.global_batch_size, args.gradient_accumulation_steps) == (4, 1)
    read_ds_config(args)
    assert (args.global_batch_size, args.gradient_accumulation_steps) == (global_batch,
                                                                          accumulation)


def test_failed_validation_then_reconcile_matches_reconcile_first(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "bf16": {"enabled": True}}
    path.write_text(json.dumps(ds))
    argv = f"{SMALL_MODEL} --train-iters 5 --lr 1e-3 --deepspeed_config {path}".split()
    before = parse_args(argv)
    read_ds_config(before)
    validate_args(before, 2)
    after = parse_args(argv)
    with pytest.raises(ArgumentError, match="--micro-batch-size is required"):
        validate_args(after, 2)  # the JSON has not been read yet
    read_ds_config(after)
    validate_args(after, 2)
    for name in ("micro_batch_size", "global_batch_size", "gradient_accumulation_steps",
                 "params_dtype"):
        assert getattr(after, name) == getattr(before, name)


def test_module_imports_neither_zeropp_nor_deepspeed() -> None:
    tree = ast.parse(Path(arguments.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"zeropp", "deepspeed"}


def test_decay_styles_are_the_schedules() -> None:
    from zeropp.deepspeed_api.lr_schedules import DECAY_STYLES

    assert arguments.DECAY_STYLES == DECAY_STYLES
