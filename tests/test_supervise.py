"""megatron_lite.supervise: a job with a rank killed or stopped (hung) mid-run comes back from
its latest verified checkpoint and ends as an uninterrupted run would; usage errors are not
restarted; bad commands are refused."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

from tests.test_pretrain_cli import ROOT, read_metrics
from tests.test_resilience import data_prefix, train_args  # noqa: F401 (module fixture)
from zeropp.comm.flight_recorder import divergence, read_dumps

SUPERVISE = [sys.executable, "-m", "megatron_lite.supervise"]
# As tests.test_pretrain_cli.run: one thread, so losses compare bit for bit between runs.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
_references: dict[str, dict[int, float]] = {}


def _training(launcher, prefix, tmp_path, *extra):
    return [*launcher, *train_args(prefix, tmp_path, 8, *extra)[1:]]


def reference_losses(prefix, tmp_path, ranks, tmp_path_factory):
    """The uninterrupted run's losses at ``ranks`` ranks, run once per test session.

    The tests that compare with it (here and in tests/test_async_checkpoint.py) run the same
    command on the same tokens, and a run is bit for bit the same every time, so the first
    test to need it runs it and leaves its losses where every xdist worker of the session finds
    them, keyed by the command (its paths left out) and the corpus' bytes."""
    command = _training(TORCHRUN if ranks == 2 else [sys.executable], prefix, tmp_path)
    digest = hashlib.sha256(repr([arg.replace(prefix, "DATA").replace(str(tmp_path), "TMP")
                                  for arg in command]).encode())
    for suffix in (".bin", ".idx"):
        digest.update(Path(prefix + suffix).read_bytes())
    key = digest.hexdigest()[:16]
    if key not in _references:
        # Under xdist every worker's base folder sits in the session's own.
        base = tmp_path_factory.getbasetemp()
        shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "references"
        shared.mkdir(exist_ok=True)
        saved = shared / f"{key}.json"
        with FileLock(str(saved) + ".lock"):
            if not saved.exists():
                full = tmp_path / "full.jsonl"
                result = subprocess.run([*command, "--metrics-file", str(full)], cwd=ROOT,
                                        env=ENV, capture_output=True, text=True, timeout=300)
                assert result.returncode == 0, result.stderr[-2000:]
                losses = {r["iteration"]: r["lm_loss"] for r in read_metrics(full)[0]}
                saved.write_text(json.dumps(list(losses.items())))  # floats round-trip exactly
            _references[key] = dict(json.loads(saved.read_text()))
    return _references[key]


# The fault is injected by the program itself ([Note: hang watchdog]'s ZEROPP_FAULT) right
# after iteration 5 is done, its save at 4 written and the one at 6 not begun, on the first
# run only: the relaunch resumes from iteration 4 whatever the machine's load.
@pytest.mark.parametrize("ranks,fault", [(1, "kill"), (2, "kill"), (2, "stop")],
                         ids=["one-process-killed", "torchrun-rank-killed",
                              "torchrun-rank-stopped"])
def test_a_failed_job_is_relaunched_and_ends_as_if_uninterrupted(data_prefix, tmp_path,  # noqa: F811
                                                                tmp_path_factory, ranks, fault):
    expected = reference_losses(data_prefix, tmp_path, ranks, tmp_path_factory)
    metrics, ckpt = tmp_path / "run.jsonl", tmp_path / "ckpt"
    victim = ranks - 1
    # The default --distributed-timeout-minutes (10): a stopped rank is the watchdog's to find.
    supervised = _training(TORCHRUN if ranks == 2 else [sys.executable], data_prefix, tmp_path,
                           "--metrics-file", str(metrics), "--save", str(ckpt), "--load",
                           str(ckpt), "--save-interval", "2", "--hang-timeout", "2",
                           "--heartbeat-interval", "0.5", "--hang-startup-iterations", "1")
    command = [*SUPERVISE, "--restarts", "2", "--backoff", "0", "--", *supervised]
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env={**ENV, "ZEROPP_FAULT": f"{victim}:5:{fault}"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count(f"fault injected: rank {victim} {fault} after iteration 5") == 1
    restarts = [line for line in result.stderr.splitlines() if line.startswith("supervise:")]
    assert len(restarts) == 1, restarts
    assert "restart 1 of 2" in restarts[0] and "from iteration 4" in restarts[0], restarts[0]
    if fault == "stop":  # named within seconds, not at the 10-minute collective timeout
        assert f"(hang: rank {victim} hung at iteration 6 (no heartbeat for" in restarts[0]
        assert time.monotonic() - started < 150
        dumps = read_dumps(ckpt)
        assert 0 in dumps and victim not in dumps  # a stopped rank writes nothing
        assert dumps[0]["verdict"].startswith(f"rank {victim} hung at iteration 6")
        lines = divergence(dumps, world_size=2)  # what python -m megatron_lite.watchdog says
        assert lines[0] == f"no dump from rank {victim} (hung or dead: it could not write)"
        assert "  entered, not finished, by rank 0" in lines, lines
    last = {}
    for record in read_metrics(metrics)[0]:  # the relaunch repeats iteration 5: keep the last
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
