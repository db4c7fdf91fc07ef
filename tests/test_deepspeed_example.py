"""Acceptance: a DeepSpeed user changes one import.

DeepSpeedExamples' CIFAR-10 training script (tests/material/deepspeed_examples, unmodified on
disk; see SOURCES.md there) runs on 2 gloo ranks, fp32, ZeRO stage 3, under DeepSpeed itself
and with ``import deepspeed`` replaced by ``import zeropp as deepspeed``. Each system runs two
phases in fresh processes: A trains one epoch and saves a checkpoint; B runs the script again
and loads A's checkpoint right after ``initialize``, so it continues from A's weights, Adam
moments and WarmupLR position. zeropp's per-rank losses must equal DeepSpeed's within 1e-5 in
both phases, with the same number of steps and the same lr.

Four launches of 2 ranks in all (DeepSpeed A and B, zeropp A and B). DeepSpeed's CPU FusedAdam
(the script's "Adam" optimizer) is a JIT-compiled op: scripts/setup.sh builds it once per
machine into ~/.cache/torch_extensions; where it has not, the first DeepSpeed run compiles it
(about 107 CPU-seconds) and later runs load it.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

RUNNER_PATH = Path(__file__).parent / "material" / "deepspeed_examples" / "run_example.py"
_spec = importlib.util.spec_from_file_location("cifar_run_example", RUNNER_PATH)
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

LOSS_TOL = 1e-5
STEPS_PER_PHASE = 8  # 128 stand-in images / (2 ranks x micro-batch 8): one epoch
TIMEOUT_S = 600  # a fresh machine compiles FusedAdam on the first DeepSpeed launch


def run_phases(system: str, root: Path) -> dict[str, list[dict]]:
    """Phase A (train, save) then phase B (load right after initialize, train) of ``system``."""
    ckpt = root / f"ckpt_{system}"
    a = runner.launch(system, save=str(ckpt), workdir=str(root / f"{system}_A"), timeout=TIMEOUT_S)
    b = runner.launch(system, load=str(ckpt), workdir=str(root / f"{system}_B"), timeout=TIMEOUT_S)
    return {"A": a, "B": b}


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory) -> dict[str, list[dict]]:
    return run_phases("deepspeed", tmp_path_factory.mktemp("cifar_deepspeed"))


def table(**systems: dict[str, list[dict]]) -> str:
    """Every recorded loss and lr, per system, phase and rank: printed when an assertion fails."""
    lines = []
    for name, runs in systems.items():
        for phase, records in runs.items():
            for record in records:
                lines.append(f"{name} phase {phase} rank {record['rank']}: "
                             f"losses {record['losses']}")
                lines.append(f"{' ' * len(name)} phase {phase} rank {record['rank']}: "
                             f"lrs {record['lrs']} final_lr {record.get('final_lr')} "
                             f"lr_after_load {record.get('lr_after_load')}")
    return "\n".join(lines)


def lrs_close(a, b) -> bool:
    return len(a) == len(b) and all(
        math.isclose(float(x), float(y), rel_tol=1e-9, abs_tol=1e-15)
        for x, y in zip(a, b, strict=True))


def check_resumed(runs: dict[str, list[dict]], shown: str) -> None:
    """Phase B really continued from phase A's checkpoint (one system on its own)."""
    for a, b in zip(runs["A"], runs["B"], strict=True):
        rank = a["rank"]
        assert b.get("loaded_path") is not None, (
            f"rank {rank}: load_checkpoint found nothing\n{shown}")
        assert lrs_close(b["lr_after_load"], a["final_lr"]), (
            f"rank {rank}: the lr after load_checkpoint is not where phase A's ended\n{shown}")
        assert b["global_steps_after_load"] == a["global_steps"], shown
        # Same data order in both phases (one epoch, sampler epoch 0): B differs only because it
        # starts from A's trained state.
        assert len(b["losses"]) == len(a["losses"]), f"rank {rank}: step counts differ\n{shown}"
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)) > 1e-4, (
            f"rank {rank}: phase B's losses equal phase A's: the checkpoint was not used\n{shown}")


def test_deepspeed_reference_trains_saves_and_resumes(deepspeed_runs):
    """The reference itself: 8 steps a phase on each rank, B resumes from A's checkpoint."""
    shown = table(deepspeed=deepspeed_runs)
    for phase, records in deepspeed_runs.items():
        assert [r["rank"] for r in records] == [0, 1]
        for record in records:
            # fp32 ZeRO-3 with the config's "Adam" (DeepSpeed's FusedAdam, AdamW mode).
            assert (record["zero_stage"], record["fp16"], record["bf16"]) == (3, False, False)
            assert record["optimizer"] == "DeepSpeedZeroOptimizer_Stage3", record["optimizer"]
            assert record["inner_optimizer"] == "FusedAdam", record["inner_optimizer"]
            assert len(record["losses"]) == STEPS_PER_PHASE, f"phase {phase}\n{shown}"
            assert all(math.isfinite(x) for x in record["losses"]), shown
        assert records[0]["losses"] != records[1]["losses"], (
            f"phase {phase}: both ranks saw the same batches\n{shown}")
    assert deepspeed_runs["B"][0]["global_steps"] == 2 * STEPS_PER_PHASE, shown
    check_resumed(deepspeed_runs, shown)


def test_zeropp_runs_the_unchanged_script_and_matches_deepspeed(deepspeed_runs, tmp_path):
    zeropp_runs = run_phases("zeropp", tmp_path)
    shown = table(deepspeed=deepspeed_runs, zeropp=zeropp_runs)
    for phase in ("A", "B"):
        for ds, zp in zip(deepspeed_runs[phase], zeropp_runs[phase], strict=True):
            where = f"phase {phase} rank {ds['rank']}"
            assert zp["rank"] == ds["rank"]
            assert len(zp["losses"]) == len(ds["losses"]), f"{where}: step count differs\n{shown}"
            worst = max(abs(x - y) for x, y in zip(zp["losses"], ds["losses"], strict=True))
            assert worst <= LOSS_TOL, (
                f"{where}: losses differ from DeepSpeed's by up to {worst:.3g}\n{shown}")
            assert lrs_close(zp["lrs"], ds["lrs"]), f"{where}: per-step lr differs\n{shown}"
            assert lrs_close(zp["final_lr"], ds["final_lr"]), f"{where}: final lr differs\n{shown}"
            assert zp["global_steps"] == ds["global_steps"], f"{where}\n{shown}"
            assert (zp["zero_stage"], zp["fp16"], zp["bf16"]) == (3, False, False), where
    for ds, zp in zip(deepspeed_runs["B"], zeropp_runs["B"], strict=True):
        assert lrs_close(zp["lr_after_load"], ds["lr_after_load"]), (
            f"rank {ds['rank']}: lr after load_checkpoint differs\n{shown}")
    check_resumed(zeropp_runs, shown)
