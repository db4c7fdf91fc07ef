"""scripts/bench/host_profile.py: the host's time in one iteration of the GPU check's 18B
block model, by Python function and by aten op (run here on the CPU with a narrow block)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_host_profile_names_where_the_host_time_goes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "scripts.bench.host_profile", "--out", str(tmp_path),
         "--layers", "1", "--micro-batch", "1", "--hidden-size", "64",
         "--num-attention-heads", "4"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    python = (tmp_path / "host_python.txt").read_text()
    assert "==== by tottime" in python and "==== by cumulative" in python
    # the iteration and the engine's own functions, with their call counts
    assert "train_iteration" in python and "run_backward" in python
    assert "sharded_model.py" in python
    ops = (tmp_path / "host_ops.txt").read_text()
    assert "Self CPU" in ops and "aten::" in ops
