"""megatron_lite.supervise: a job killed mid-run comes back from its latest verified checkpoint
and ends as an uninterrupted run would; usage errors are not restarted; bad commands are
refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.test_pretrain_cli import ROOT, read_metrics
from tests.test_resilience import data_prefix, train_args  # noqa: F401 (module fixture)

SUPERVISE = [sys.executable, "-m", "megatron_lite.supervise"]
# As tests.test_pretrain_cli.run: one thread, so losses compare bit for bit between runs.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

# Launches the command it is given and, on its first attempt only, SIGKILLs a training
# process as soon as the metrics file shows iteration 5 (after the save at 4): the launched
# program itself, or under torchrun its last rank (a rank lost mid-run).
KILL_ONCE = textwrap.dedent('''
    import os, signal, subprocess, sys, time
    from pathlib import Path
    marker, metrics, command = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    child = subprocess.Popen(command)
    if marker.exists():
        sys.exit(child.wait())
    marker.write_text("killed once")
    while child.poll() is None:
        if metrics.exists() and '"iteration": 5,' in metrics.read_text():
            ranks = subprocess.run(["pgrep", "-f", "-P", str(child.pid), "pretrain_zeropp_gpt"],
                                   capture_output=True, text=True).stdout.split()
            os.kill(int(ranks[-1]) if ranks else child.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    sys.exit(child.wait() or 137)
''')
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "torchrun-2-ranks"])
def test_a_killed_job_is_relaunched_and_ends_as_if_uninterrupted(data_prefix, tmp_path, ranks):  # noqa: F811
    full, metrics, ckpt = tmp_path / "full.jsonl", tmp_path / "run.jsonl", tmp_path / "ckpt"
    launcher = TORCHRUN if ranks == 2 else [sys.executable]

    def training(*extra):
        return [*launcher, *train_args(data_prefix, tmp_path, 8, *extra)[1:]]

    reference = subprocess.run(training("--metrics-file", str(full)), cwd=ROOT, env=ENV,
                               capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-2000:]
    wrapper = tmp_path / "kill_once.py"
    wrapper.write_text(KILL_ONCE)
    supervised = training("--metrics-file", str(metrics), "--save", str(ckpt), "--load",
                          str(ckpt), "--save-interval", "2", "--distributed-timeout-minutes", "1")
    command = [*SUPERVISE, "--restarts", "2", "--backoff", "0", "--",
               sys.executable, str(wrapper), str(tmp_path / "marker"), str(metrics), *supervised]
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    restarts = [line for line in result.stderr.splitlines() if line.startswith("supervise:")]
    assert len(restarts) == 1, restarts
    assert "restart 1 of 2" in restarts[0] and "iteration 4" in restarts[0]
    expected = {r["iteration"]: r["lm_loss"] for r in read_metrics(full)[0]}
    records = read_metrics(metrics)[0]
    last = {}
    for record in records:  # the relaunch repeats iteration 5 onwards: keep the last of each
        last[record["iteration"]] = record["lm_loss"]
    assert sorted(last) == list(range(1, 9))
    assert all(last[i] == expected[i] for i in last), [(i, last[i], expected[i]) for i in last if last[i] != expected[i]]


def test_usage_errors_are_not_restarted(data_prefix, tmp_path):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    training = train_args(data_prefix, tmp_path, 2, "--save", str(ckpt), "--load", str(ckpt),
                          "--micro-batch-size", "-3")
    result = subprocess.run([*SUPERVISE, "--restarts", "3", "--backoff", "0", "--", *training],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("supervise:")]
    assert lines == ["supervise: exit status 2, a usage error: not restarting"]


def test_commands_without_a_shared_checkpoint_dir_are_refused(tmp_path):
    for extra in ([], ["--save", "a"], ["--save", "a", "--load", "b"]):
        result = subprocess.run([*SUPERVISE, "--restarts", "1", "--", "python", "x.py", *extra],
                                cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert "--save DIR --load DIR with the same DIR" in result.stderr.splitlines()[-1]


def test_ctrl_c_stops_the_job_and_the_supervisor(tmp_path):
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)", "--save", str(tmp_path),
               "--load", str(tmp_path)]
    # As from a terminal: SIGINT at its default even if this suite runs in the background.
    process = subprocess.Popen([*SUPERVISE, "--restarts", "5", "--", *sleeper], cwd=ROOT,
                               env=ENV, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(3)
    children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True,
                              text=True).stdout.split()
    assert children, "the job did not start"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert "interrupted; the job was stopped" in err
    for pid in children:  # the job went with it
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
