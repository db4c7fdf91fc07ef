"""Launch scripts and cluster configs: syntax, the command each run produces, the files it reads."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from megatron_lite.arguments import parse_args, validate_args
from megatron_lite.ds_config import read_ds_config
from megatron_lite.model import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch"
MODELS = ("18b", "49b", "91b", "138b")
NODE_COUNTS = (1, 2, 4, 8, 16, 24)
SYSTEMS = {"zero3": "ds_zero3_config.json", "zeropp": "ds_zeropp_config.json",
           "zeropp_offload": "ds_zeropp_offload.json"}
TOKENS = {"1K": 2, "2K": 4}  # micro batch at seq 512
GPT2_VOCAB = 50257
SCRIPTS = sorted(LAUNCH.glob("*.sh")) + [ROOT / "scripts" / "run_cpu_cluster.sh"]


def run_script(script: Path, *args: str, check: bool = True, **env: str):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          env=full_env, check=check, timeout=120)


def args_file_flags(path: Path) -> list[str]:
    """Flags of an .args file, read independently of the scripts' own reader."""
    flags = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            flags += line.split()
    return flags


def flag_value(argv: list[str], flag: str) -> str:
    """The last value given for ``flag`` (argparse's rule)."""
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag][-1]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_valid_bash(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert os.access(script, os.X_OK), f"{script} is not executable"


def test_hostfiles_parse_with_deepspeeds_own_parser():
    from deepspeed.launcher.runner import _parse_hostfile

    for nodes in NODE_COUNTS:
        path = ROOT / "configs" / "hostfiles" / f"dgx2_{nodes}nodes"
        pool = _parse_hostfile(path.read_text().splitlines())
        assert list(pool) == [f"node{i:03d}" for i in range(1, nodes + 1)]
        assert set(pool.values()) == {16}


@pytest.mark.parametrize("model", MODELS)
def test_model_files_give_the_documented_parameter_counts(model):
    path = ROOT / "configs" / "models" / f"gpt_{model}.args"
    args = parse_args(args_file_flags(path) + ["--micro-batch-size", "1", "--dry-run"])
    validate_args(args, 1)
    config = GPTConfig(args.num_layers, args.hidden_size, args.num_attention_heads, GPT2_VOCAB,
                       max_position_embeddings=args.max_position_embeddings)
    documented = re.search(r"([\d,]+) parameters", path.read_text()).group(1)
    assert config.num_parameters() == int(documented.replace(",", ""))
    # the name is the size, to the nearest billion
    assert round(config.num_parameters() / 1e9) == int(model.removesuffix("b"))
    assert args.seq_length == 512


def launch_command(model: str, nodes: int, system: str, tokens: str, *extra: str, **env: str):
    out = run_script(LAUNCH / "paper_run.sh", model, str(nodes), system, tokens, *extra,
                     PRINT_ONLY="1", **env).stdout
    return shlex.split(out)


def test_every_paper_run_produces_the_expected_command_line():
    entry = str(ROOT / "pretrain_zeropp_gpt.py")
    common = args_file_flags(ROOT / "configs" / "models" / "paper_training.args")
    for model, nodes, system, tokens in itertools.product(MODELS, NODE_COUNTS, SYSTEMS, TOKENS):
        argv = launch_command(model, nodes, system, tokens)
        where = (model, nodes, system, tokens)
        assert Path(argv[0]).name == "deepspeed", where
        launcher, program = argv[1:argv.index(entry)], argv[argv.index(entry) + 1:]
        hostfile = str(ROOT / "configs" / "hostfiles" / f"dgx2_{nodes}nodes")
        assert launcher == ["--hostfile", hostfile, "--num_nodes", str(nodes),
                            "--num_gpus", "16"], where
        model_flags = args_file_flags(ROOT / "configs" / "models" / f"gpt_{model}.args")
        assert program[:len(model_flags) + len(common)] == model_flags + common, where
        assert flag_value(program, "--micro-batch-size") == str(TOKENS[tokens]), where
        ds_config = str(ROOT / "configs" / SYSTEMS[system])
        assert flag_value(program, "--deepspeed_config") == ds_config, where
        # ... and the entry point accepts it for this cluster, DeepSpeed config included
        args = parse_args(program)
        read_ds_config(args)
        validate_args(args, nodes * 16)
        assert args.micro_batch_size * args.seq_length == 1024 * int(tokens[0])
        assert args.global_batch_size == args.micro_batch_size * nodes * 16
        assert args.fp16 and args.checkpoint_activations and args.zero_stage == 3


def test_wrappers_extra_flags_and_dry_run_mode():
    base = launch_command("18b", 4, "zeropp", "1K")
    wrapper = shlex.split(run_script(LAUNCH / "gpt_18b.sh", "4", "zeropp", "1K",
                                     PRINT_ONLY="1").stdout)
    assert wrapper == base
    # flags after the four arguments come last, so they override the config files
    extended = launch_command("18b", 4, "zeropp", "1K", "--train-iters", "7")
    assert extended == base + ["--train-iters", "7"]
    assert flag_value(extended, "--train-iters") == "7"
    # DRY_RUN: one local process with the planned cluster, no launcher
    dry = launch_command("138b", 24, "zero3", "2K", DRY_RUN="1")
    assert Path(dry[1]).name == "pretrain_zeropp_gpt.py" and "deepspeed" not in Path(dry[0]).name
    assert dry[-5:] == ["--dry-run", "--dry-run-nodes", "24", "--dry-run-gpus-per-node", "16"]
    assert "--hostfile" not in dry


@pytest.mark.parametrize(("argv", "message"), [
    (["7b", "4", "zeropp", "1K"], "unknown MODEL '7b'"),
    (["18b", "3", "zeropp", "1K"], "no hostfile"),
    (["18b", "4", "zero2", "1K"], "unknown SYSTEM 'zero2'"),
    (["18b", "4", "zeropp", "1000"], "not a multiple of the seq length 512"),
    (["18b", "4", "zeropp", "lots"], "TOKENS_PER_GPU must be a token count"),
    (["18b", "4"], "usage:"),
])
def test_paper_run_rejects_bad_arguments(argv, message):
    result = run_script(LAUNCH / "paper_run.sh", *argv, check=False, PRINT_ONLY="1")
    assert result.returncode == 2
    assert message in result.stderr and result.stdout == ""


def test_paper_run_dry_run_plans_the_18b_on_four_nodes():
    result = run_script(LAUNCH / "gpt_18b.sh", "4", "zeropp", "1K", "--no-dry-run-simulate",
                        DRY_RUN="1")
    assert "number of parameters: 18,434,813,952 (18.43B)" in result.stdout


def test_cpu_cluster_script_command_and_dry_run():
    entry = str(ROOT / "pretrain_zeropp_gpt.py")
    argv = shlex.split(run_script(ROOT / "scripts" / "run_cpu_cluster.sh", PRINT_ONLY="1").stdout)
    assert argv[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]
    program = argv[argv.index(entry) + 1:]
    assert flag_value(program, "--ranks-per-node") == "2"
    ds_config = str(ROOT / "configs" / "ds_zeropp_cpu2x2.json")
    assert flag_value(program, "--deepspeed_config") == ds_config
    assert flag_value(program, "--data-path") == str(ROOT / "cache" / "data" /
                                                     "pile_sample_text_document")
    args = parse_args(program)
    read_ds_config(args)
    validate_args(args, 4)
    assert not args.fp16 and args.gradient_accumulation_steps == 1

    result = run_script(ROOT / "scripts" / "run_cpu_cluster.sh", DRY_RUN="1")
    assert "number of parameters: 7,248,640 (7.2M)" in result.stdout


def test_cpu_cluster_script_explains_how_to_build_missing_data(tmp_path):
    result = run_script(ROOT / "scripts" / "run_cpu_cluster.sh", check=False,
                        DATA_PATH=str(tmp_path / "missing"))
    assert result.returncode == 1
    assert "scripts/quickstart.sh" in result.stderr and "data.preprocess" in result.stderr


# ---- Llama-style models ------------------------------------------------------------------

LLAMA_MODELS = {  # file: (parameters with GPT-2's vocabulary, with the model's own, its vocab)
    "llama2_7b": (6_888_361_984, 6_738_415_616, 32000),
    "llama3_8b": (7_391_678_464, 8_030_261_248, 128256),
    "llama2_70b": (69_276_540_928, 68_976_648_192, 32000),
    "llama_cpu_small": (13_567_104, None, None),
}


@pytest.mark.parametrize("model", LLAMA_MODELS)
def test_llama_model_files_give_the_documented_shape_and_counts(model):
    from megatron_lite.arguments import gpt_config_from_args

    path = ROOT / "configs" / "models" / f"{model}.args"
    args = parse_args(args_file_flags(path) + ["--micro-batch-size", "1", "--dry-run"])
    validate_args(args, 1)
    with_gpt2_vocab, with_own_vocab, own_vocab = LLAMA_MODELS[model]
    config = gpt_config_from_args(args, GPT2_VOCAB)
    assert (config.position_embedding_type, config.normalization) == ("rope", "RMSNorm")
    assert config.swiglu and config.untie_embeddings_and_output_weights
    assert not config.add_bias_linear
    text = path.read_text()
    counts = [int(n.replace(",", "")) for n in re.findall(r"\d{1,3}(?:,\d{3})+", text)]
    assert config.num_parameters() == with_gpt2_vocab and with_gpt2_vocab in counts
    if own_vocab is not None:
        # Hugging Face's published sizes: Llama 2 7B 6.74B, Llama 3 8B 8.03B, Llama 2 70B 68.98B
        assert gpt_config_from_args(args, own_vocab).num_parameters() == with_own_vocab
        assert with_own_vocab in counts


@pytest.mark.parametrize("model,nodes,system,tokens", [
    ("llama2_7b", 2, "zero3", "4K"), ("llama3_8b", 4, "zeropp", "8K"),
    ("llama2_70b", 16, "zeropp", "4K")])
def test_llama_wrappers_produce_an_accepted_command_line(model, nodes, system, tokens):
    entry = str(ROOT / "pretrain_zeropp_gpt.py")
    argv = shlex.split(run_script(LAUNCH / f"{model}.sh", str(nodes), system, tokens,
                                  PRINT_ONLY="1").stdout)
    program = argv[argv.index(entry) + 1:]
    model_flags = args_file_flags(ROOT / "configs" / "models" / f"{model}.args")
    common = args_file_flags(ROOT / "configs" / "models" / "llama_training.args")
    assert program[:len(model_flags) + len(common)] == model_flags + common
    args = parse_args(program)
    read_ds_config(args)
    validate_args(args, nodes * 16)
    assert args.micro_batch_size * args.seq_length == 1024 * int(tokens[0])
    assert args.bf16 and args.recompute_attention and not args.checkpoint_activations
    assert flag_value(program, "--metrics-file").endswith(
        f"{model}_{nodes}x16_{system}_{1024 * int(tokens[0])}tokens.jsonl")


def test_llama_dry_run_plans_the_cluster():
    out = run_script(LAUNCH / "llama3_8b.sh", "4", "zeropp", "8K", "--no-dry-run-simulate",
                     DRY_RUN="1").stdout
    assert "number of parameters: 7,391,678,464 (7.39B)" in out  # GPT-2's vocabulary
    assert "4 node(s) x 16 GPUs = 64 GPUs" in out
    assert "micro batch 1 x seq 8192" in out and "bfloat16 compute" in out
    assert "ZeRO++: qwZ int8, hpZ 16 (int8 secondary), qgZ int4" in out
