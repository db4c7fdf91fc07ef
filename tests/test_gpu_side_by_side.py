"""scripts/gpu_check/side_by_side.py's --cpu-smoke: every system of the GPU comparison
(this engine eager and compiled, FSDP2 eager and compiled, DeepSpeed ZeRO-3) trains the same
tiny GPT on the CPU in its own subprocess, and they agree on the loss, so the script runs
as it is when a GPU session calls it."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.gpu_check import side_by_side as bench


def test_cpu_smoke_runs_every_system_and_the_losses_agree(tmp_path, capsys):
    out = tmp_path / "side_by_side.json"
    before = signal.getsignal(signal.SIGTERM)
    assert bench.main(["--cpu-smoke", "--out", str(out)]) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # main gives the caller's handler back
    report = json.loads(out.read_text())
    systems = report["systems"]
    assert list(systems) == list(bench.SYSTEMS)
    expected_ok = list(bench.SYSTEMS)
    if importlib.util.find_spec("deepspeed") is None:  # reported, not fatal
        expected_ok.remove("deepspeed_zero3")
        assert "ModuleNotFoundError" in systems["deepspeed_zero3"]["status"]
    for name in expected_ok:
        result = systems[name]
        assert result["status"] == "ok", (name, result.get("status"), result.get("traceback"))
        assert len(result["losses"]) == bench.CPU_SMOKE["loss_steps"]
        assert result["tokens_per_second"] > 0 and result["first_step_seconds"] > 0
    reference = systems["zeropp_eager"]["losses"]
    assert reference[-1] < reference[0]  # the alternated batches are learned
    for name in expected_ok:  # bf16 compute, the same initial values and data everywhere
        assert systems[name]["losses"] == pytest.approx(reference, rel=2e-3), name
    assert report["device"] == "cpu" and report["peak_bf16_tflops"] is None
    assert report["final_loss_max_relative_spread"] < 2e-3
    for name in ("zeropp_compiled", "fsdp2_compiled"):
        assert systems[name]["compile_seconds"] > 0, name
    for name in expected_ok:  # nothing compiles while the steps are timed
        assert systems[name]["graphs_compiled_in_timed_steps"] == 0, name
    # the table comes last, one row per system
    table = capsys.readouterr().out.strip().splitlines()[-len(bench.SYSTEMS) - 2:]
    assert table[1].split()[:2] == ["system", "status"]
    assert [row.split()[0] for row in table[2:]] == list(bench.SYSTEMS)


def test_peak_table_names_its_source():
    assert bench.peak_for("NVIDIA H100 80GB HBM3") == (989.0, "table: H100 dense bf16 989 TFLOP/s")
    assert bench.peak_for("NVIDIA H100 PCIe")[0] == 756.0
    assert bench.peak_for("NVIDIA H200")[0] == 989.0
    assert bench.peak_for("NVIDIA A100-SXM4-80GB")[0] == 312.0
    peak, why = bench.peak_for("Some Future GPU")
    assert peak is None and "not in the peak table" in why


def test_default_run_fits_its_budget():
    """The default run's shape is GPT-3 XL's and its steps are the ones the docstring argues."""
    shape = bench.RunShape()
    config = shape.gpt_config()
    assert (config.num_layers, config.hidden_size, config.num_attention_heads,
            shape.seq_length) == (24, 2048, 16, 2048)
    assert (shape.warmup_steps, shape.timed_steps, shape.total_steps) == (3, 10, 20)


def test_a_spent_budget_skips_every_system_and_says_so(tmp_path):
    out = tmp_path / "side_by_side.json"
    assert bench.main(["--cpu-smoke", "--budget", "0", "--out", str(out)]) == 0
    systems = json.loads(out.read_text())["systems"]
    assert [r["status"] for r in systems.values()] == ["skipped: 0 s of the budget left"] * len(
        bench.SYSTEMS)


def _processes_marked(mark: str) -> list[int]:
    """Live processes whose environment holds ``MARK=mark`` (a run's workers inherit it)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"SIDE_BY_SIDE_TEST_MARK={mark}".encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:  # ended meanwhile, or not ours to read
            pass
    return found


def test_sigterm_stops_the_worker_and_keeps_the_report(tmp_path):
    """The device call's time limit ends the run with SIGTERM: the running system's worker
    (a session of its own, which the signal does not reach) is stopped, and the JSON says
    which systems finished, which was stopped and which never started."""
    out = tmp_path / "side_by_side.json"
    root = Path(bench.__file__).resolve().parents[2]
    mark = str(tmp_path)
    run = subprocess.Popen([sys.executable, "-m", "scripts.gpu_check.side_by_side",
                            "--cpu-smoke", "--systems", "zeropp_eager,fsdp2_eager",
                            "--out", str(out)], cwd=root, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "SIDE_BY_SIDE_TEST_MARK": mark})
    started = time.monotonic()
    for line in run.stdout:
        if "[side-by-side] zeropp_eager ..." in line:
            break
    # As soon as the worker exists (it takes seconds to import torch, let alone train).
    deadline = time.monotonic() + 30
    while not [pid for pid in _processes_marked(mark) if pid != run.pid]:
        assert time.monotonic() < deadline, "no worker started"
        time.sleep(0.05)
    run.send_signal(signal.SIGTERM)
    run.communicate(timeout=60)
    assert run.returncode == 128 + signal.SIGTERM and time.monotonic() - started < 120
    systems = json.loads(out.read_text())["systems"]
    assert systems["zeropp_eager"]["status"] == "stopped: SIGTERM reached the run"
    assert systems["fsdp2_eager"]["status"] == "stopped: SIGTERM reached the run"
    # The run reaps its worker before it ends; /proc may still list it for a moment while
    # the kernel tears a large process down on a loaded machine.
    deadline = time.monotonic() + 15
    while [pid for pid in _processes_marked(mark) if pid != run.pid]:
        assert time.monotonic() < deadline, "the worker outlived the run"
        time.sleep(0.2)
