"""pretrain_zeropp_gpt.py as users run it: a subprocess under python or torchrun.

Covers a full tiny run (log lines, final validation loss, metrics file), the 18B model's
dry run, a command-line error, and the claim that matters most for comparing runs: with the
same seed and global batch, 2 ranks (one micro-batch each, simulated as 2 nodes) give the
losses of 1 rank (two accumulated micro-batches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics

import pytest

from data.preprocess import preprocess
from data.tokenizers import build_tokenizer
from megatron_lite.metrics import TRAIN_METRIC_KEYS
from megatron_lite.model import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINT = str(ROOT / "pretrain_zeropp_gpt.py")
TINY_RUN = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--batch-size", "2", "--global-batch-size", "4",
    "--train-iters", "5", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "2",
    "--split", "90,10,0", "--num-workers", "0",
    "--zero-stage", "3", "--deepspeed", "--deepspeed_config",
    str(ROOT / "configs" / "ds_zero3_config.json"),
]


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("cli-corpus")
    jsonl = directory / "docs.jsonl"
    with jsonl.open("w", encoding="utf-8") as out:
        for name in sorted(topics)[:40]:
            out.write(json.dumps({"text": topics[name][:2000]}) + "\n")
    return preprocess(str(jsonl), str(directory / "pydoc"),
                      build_tokenizer("GPT2BPETokenizer"))["text"]


def run(command: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return ([r for r in records if "lm_loss" in r], [r for r in records if "val_loss" in r])


def assert_same_training(one: Path, two: Path) -> tuple[list[dict], list[dict]]:
    """Two runs' metrics files hold the same losses, validation losses and gradient norms
    (1e-5); returns their training records."""
    train_one, eval_one = read_metrics(one)
    train_two, eval_two = read_metrics(two)
    assert [r["lm_loss"] for r in train_two] == pytest.approx(
        [r["lm_loss"] for r in train_one], rel=1e-5)
    assert [r["val_loss"] for r in eval_two] == pytest.approx(
        [r["val_loss"] for r in eval_one], rel=1e-5)
    assert [r["grad_norm"] for r in train_two] == pytest.approx(
        [r["grad_norm"] for r in train_one], rel=1e-5)
    return train_one, train_two


def test_single_process_run_logs_and_reports(data_prefix, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    result = run([sys.executable, ENTRY_POINT, *TINY_RUN, "--data-path", data_prefix,
                  "--checkpoint-activations", "--deepspeed-activation-checkpointing",
                  "--metrics-file", str(metrics),
                  "--data-cache-dir", str(tmp_path / "cache")])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "> topology: 1 ranks = 1 node(s) x 1" in out
    assert "| global batch 4 | gradient accumulation 2 |" in out
    log_lines = [line for line in out.splitlines() if line.startswith(" iteration")]
    assert len(log_lines) == 5 and "iteration        5/       5 |" in log_lines[-1]
    train_records, eval_records = read_metrics(metrics)
    assert [r["iteration"] for r in train_records] == [1, 2, 3, 4, 5]
    assert all(set(TRAIN_METRIC_KEYS) <= set(r) for r in train_records)
    assert [r["iteration"] for r in eval_records] == [3, 5]
    final = eval_records[-1]["val_loss"]
    assert f"final validation loss: {final:.4f} | ppl: {eval_records[-1]['val_ppl']:.1f}" in out


def test_two_ranks_match_one_rank(data_prefix, tmp_path):
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    common = [*TINY_RUN, "--data-path", data_prefix, "--data-cache-dir", str(tmp_path / "c")]
    single = run([sys.executable, ENTRY_POINT, *common, "--metrics-file", str(one)])
    assert single.returncode == 0, single.stderr
    # --ranks-per-node 1: the two processes count as two nodes, so traffic is inter-node.
    double = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node", "2", ENTRY_POINT, *common, "--ranks-per-node", "1",
                  "--metrics-file", str(two)], timeout=180)
    assert double.returncode == 0, double.stderr
    assert "> topology: 2 ranks = 2 node(s) x 1" in double.stdout
    assert "| global batch 4 | gradient accumulation 1 |" in double.stdout
    train_one, train_two = assert_same_training(one, two)
    # One rank sends nothing; two ranks on two nodes gather weights and reduce gradients
    # across the node boundary every iteration, the same amount each iteration.
    assert all(r["comm_inter_node_mb_per_iteration"] == 0 for r in train_one)
    per_iteration = [r["comm_bytes"] for r in train_two]
    assert per_iteration[0]["forward_all_gather"]["inter_node"] > 0
    assert per_iteration[0]["gradient_reduce"]["inter_node"] > 0
    assert all(snapshot == per_iteration[0] for snapshot in per_iteration)
    inter_node_bytes = sum(phase["inter_node"] for phase in per_iteration[0].values())
    assert train_two[0]["comm_inter_node_mb_per_iteration"] == pytest.approx(
        inter_node_bytes / 1e6)
    assert f"comm inter-node MB/iter: {round(inter_node_bytes / 1e6, 3):.6g} |" in double.stdout


def test_dry_run_counts_the_18b_model_quickly():
    result = run([sys.executable, ENTRY_POINT, "--num-layers", "40", "--hidden-size", "6144",
                  "--num-attention-heads", "32", "--seq-length", "512", "--batch-size", "1",
                  "--zero-stage", "3", "--fp16", "--checkpoint-activations", "--dry-run",
                  "--no-dry-run-simulate"],
                 timeout=60)
    assert result.returncode == 0, result.stderr
    expected = GPTConfig(num_layers=40, hidden_size=6144, num_attention_heads=32,
                         vocab_size=50257, max_position_embeddings=512).num_parameters()
    assert 18e9 < expected < 19e9
    assert f"number of parameters: {expected:,} ({expected / 1e9:.2f}B)" in result.stdout


def test_command_line_error_exits_2_with_one_line(data_prefix):
    result = run([sys.executable, ENTRY_POINT, *TINY_RUN, "--data-path", data_prefix,
                  "--fp16", "--bf16"], timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and "--fp16" in line and "--bf16" in line


def _stage_test_args(data_prefix, tmp_path) -> list[str]:
    return [*TINY_RUN[:TINY_RUN.index("--zero-stage")], "--data-path", data_prefix,
            "--data-cache-dir", str(tmp_path / "c"), "--global-batch-size", "8"]


@pytest.fixture(scope="module")
def one_unsharded_rank(data_prefix, tmp_path_factory) -> Path:
    """The metrics of one unsharded rank (stage 0) with the stage tests' batch: the same run
    for every stage, so it runs once."""
    tmp_path = tmp_path_factory.mktemp("one-unsharded-rank")
    one = tmp_path / "one.jsonl"
    single = run([sys.executable, ENTRY_POINT, *_stage_test_args(data_prefix, tmp_path),
                  "--zero-stage", "0", "--metrics-file", str(one)])
    assert single.returncode == 0, single.stderr
    return one


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_run_the_tutorial_config_changed_only_in_stage(data_prefix, tmp_path,
                                                                       one_unsharded_rank,
                                                                       stage):
    """DeepSpeed's ZeRO++ tutorial JSON with another ``stage``, on 2 ranks (two micro-batches
    accumulated on each): the losses of one unsharded rank, the ZeRO++ keys named as inert."""
    tutorial = json.loads((ROOT / "configs" / "ds_zeropp_config.json").read_text())
    tutorial["zero_optimization"]["stage"] = stage
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(tutorial))
    common = _stage_test_args(data_prefix, tmp_path)
    one, two = one_unsharded_rank, tmp_path / "two.jsonl"
    double = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node", "2", ENTRY_POINT, *common, "--zero-stage", str(stage),
                  "--deepspeed", "--deepspeed_config", str(config), "--ranks-per-node", "1",
                  "--metrics-file", str(two)], timeout=180)
    assert double.returncode == 0, double.stderr
    assert (f"zero_optimization.zero_hpz_partition_size, zero_optimization."
            f"zero_quantized_gradients have no effect at ZeRO stage {stage}") in double.stdout
    assert "| gradient accumulation 2 |" in double.stdout
    _, train_two = assert_same_training(one, two)
    # Gradients cross the node boundary, the same amount every iteration.
    gradient_bytes = {r["comm_bytes"]["gradient_reduce"]["inter_node"] for r in train_two}
    assert len(gradient_bytes) == 1 and gradient_bytes.pop() > 0
