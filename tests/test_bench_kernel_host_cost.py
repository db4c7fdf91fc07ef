"""The kernels' host-cost bench (scripts/bench/kernel_host_cost.py), run as a user would.

It patches the launcher's globals to stub the compiled kernel's C launch, so it runs in a
process of its own, never in the test process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


def test_every_public_call_is_timed_through_the_launchers_direct_path(tmp_path):
    out = tmp_path / "cost.json"
    run = subprocess.run([sys.executable, "-m", "scripts.bench.kernel_host_cost", "--calls",
                          "20", "--repeats", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())["results"]
    assert len(results) == 6 and any("qgZ's hop 1" in name for name in results)
    for name, figures in results.items():
        assert 0 < figures["us_per_call"] < 10_000, name
        shares = figures["self_time_share"]
        assert sum(shares.values()) == pytest.approx(1.0)
        # the call went through the backend and the launcher, not the CPU reference
        assert shares.get("launcher.py", 0) > 0 and shares.get("reference.py", 0) < 0.5
    assert "before the C launch" in run.stdout


def test_bad_arguments_are_one_line_errors():
    run = subprocess.run([sys.executable, "-m", "scripts.bench.kernel_host_cost", "--calls",
                          "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--calls and --repeats must be at least 1" in run.stderr
