"""The entry point under failure: resume, SIGTERM, a killed rank, failed saves, bad input."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.test_pretrain_cli import ENTRY_POINT, ROOT, TINY_RUN, data_prefix, read_metrics, run

__all__ = ["data_prefix"]  # the module-scoped fixture, shared with the CLI tests

WITH_DROPOUT = [a if a != "0" or TINY_RUN[i - 1] not in ("--hidden-dropout", "--attention-dropout")
                else "0.1" for i, a in enumerate(TINY_RUN)]


def train_args(data_prefix, tmp_path, iters, *extra):
    args = list(WITH_DROPOUT)
    args[args.index("--train-iters") + 1] = str(iters)
    return [sys.executable, ENTRY_POINT, *args, "--data-path", data_prefix,
            "--data-cache-dir", str(tmp_path / "cache"), *extra]


# The Llama-style switches, with selective recomputation (its dropout mask is replayed).
LLAMA_STYLE = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--group-query-attention", "--num-query-groups", "2",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear",
               "--recompute-granularity", "selective"]


@pytest.mark.parametrize("architecture", [[], LLAMA_STYLE], ids=["gpt2", "llama"])
def test_resume_continues_bit_for_bit(data_prefix, tmp_path, architecture):
    full, first, resumed = (tmp_path / n for n in ("full.jsonl", "first.jsonl", "resumed.jsonl"))
    ckpt = tmp_path / "ckpt"
    assert run(train_args(data_prefix, tmp_path, 6, "--metrics-file", str(full),
                          *architecture)).returncode == 0
    result = run(train_args(data_prefix, tmp_path, 6, "--metrics-file", str(first),
                            "--save", str(ckpt), "--save-interval", "3", "--exit-interval", "3",
                            *architecture))
    assert result.returncode == 0, result.stderr
    assert (ckpt / "latest").read_text() == "iter_0000003"
    result = run(train_args(data_prefix, tmp_path, 6, "--metrics-file", str(resumed),
                            "--load", str(ckpt), *architecture))
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    expected = {r["iteration"]: r["lm_loss"] for r in read_metrics(full)[0]}
    got = {r["iteration"]: r["lm_loss"] for r in read_metrics(resumed)[0]}
    assert sorted(got) == [4, 5, 6]
    assert all(got[i] == expected[i] for i in got), (got, expected)  # exact, dropout included
    if architecture:
        return
    # --no-load-rng: the run keeps its own random streams (fresh dropout masks), as Megatron's
    fresh = tmp_path / "fresh_rng.jsonl"
    result = run(train_args(data_prefix, tmp_path, 6, "--metrics-file", str(fresh),
                            "--load", str(ckpt), "--no-load-rng"))
    assert result.returncode == 0, result.stderr
    other = {r["iteration"]: r["lm_loss"] for r in read_metrics(fresh)[0]}
    assert sorted(other) == [4, 5, 6] and other[4] != expected[4]


def test_sigterm_saves_and_exits_cleanly(data_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    command = train_args(data_prefix, tmp_path, 100000, "--exit-signal-handler",
                         "--save", str(ckpt), "--eval-interval", "100000")
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    for line in proc.stdout:
        if line.startswith(" iteration"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "SIGTERM received" in out
    tag = (ckpt / "latest").read_text()
    assert tag.startswith("iter_") and (ckpt / tag / "zero_rank00000.pt").is_file()


def test_killed_rank_ends_the_job(data_prefix, tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", *train_args(data_prefix, tmp_path, 100000,
                                                    "--eval-interval", "100000")[1:],
               "--distributed-timeout-minutes", "1"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    for line in proc.stdout:
        if line.startswith(" iteration"):
            break
    victims = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "pretrain_zeropp_gpt"],
                             capture_output=True, text=True).stdout.split()
    assert victims, "no rank processes found"
    started = time.monotonic()
    subprocess.run(["kill", "-9", victims[-1]])
    out, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert time.monotonic() - started < 120
    assert "SIGKILL" in err or "Signal 9" in err, err[-2000:]
    assert "rank" in err


def test_failed_save_stops_or_continues(data_prefix, tmp_path):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("x")
    stop = run(train_args(data_prefix, tmp_path, 4, "--save", str(blocker / "ckpt"),
                          "--save-interval", "2"))
    assert stop.returncode == 1
    assert "checkpoint save at iteration 2 failed" in stop.stderr
    go_on = run(train_args(data_prefix, tmp_path, 4, "--save", str(blocker / "ckpt"),
                           "--save-interval", "2", "--save-error", "continue"))
    assert go_on.returncode == 0, go_on.stderr
    assert "warning: checkpoint save at iteration 2 failed" in go_on.stdout
    assert "final validation loss" in go_on.stdout


def _one_error_line(result, *fragments):
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_bad_inputs_get_one_clear_line(data_prefix, tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{\n  "zero_optimization": {\n    "stage": 3,\n  }\n}\n')
    args = train_args(data_prefix, tmp_path, 2)
    at = args.index("--deepspeed_config") + 1
    _one_error_line(run(args[:at] + [str(bad_json)] + args[at + 1:]), "bad.json:4:")

    wrong_type = tmp_path / "wrong.json"
    wrong_type.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_comm": "yes"}}))
    _one_error_line(run(args[:at] + [str(wrong_type)] + args[at + 1:]), "overlap_comm")

    negative = tmp_path / "negative.json"
    negative.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": -5}}))
    _one_error_line(run(args[:at] + [str(negative)] + args[at + 1:]), "reduce_bucket_size")

    _one_error_line(run(train_args(str(tmp_path / "missing"), tmp_path, 2)), "missing")

    empty = tmp_path / "empty_ckpt"
    empty.mkdir()
    _one_error_line(run(train_args(data_prefix, tmp_path, 2, "--load", str(empty))), "latest")


def test_corrupt_index_and_foreign_tokens(data_prefix, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copy(data_prefix + ".idx", str(broken) + ".idx")
    data = np.fromfile(data_prefix + ".bin", dtype=np.uint16)
    data[: len(data) // 2].tofile(str(broken) + ".bin")  # a .bin that does not match its .idx
    _one_error_line(run(train_args(str(broken), tmp_path, 2)), ".bin")

    foreign = tmp_path / "foreign"
    shutil.copy(data_prefix + ".idx", str(foreign) + ".idx")
    data = np.fromfile(data_prefix + ".bin", dtype=np.uint16)
    data[:] = 60000  # ids beyond GPT-2's 50257: data from another tokenizer
    data.tofile(str(foreign) + ".bin")
    _one_error_line(run(train_args(str(foreign), tmp_path, 2)), "token id 60000")
