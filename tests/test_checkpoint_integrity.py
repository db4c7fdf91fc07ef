"""Checkpoints that went bad on disk ([Note: checkpoint checksums]): a flipped block, a
truncated file, a missing rank file, an unfinished save; the fallback to the newest good one,
the refusal of it, and checkpoints from before checksums."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_pretrain_cli import read_metrics, run
from tests.test_resilience import data_prefix, train_args  # noqa: F401 (module fixture)


@pytest.fixture(scope="module")
def saved_runs(data_prefix, tmp_path_factory):  # noqa: F811
    """An 8-iteration run stopped at 6 after saving at 2, 4 and 6, and the losses of the
    same 8 iterations uninterrupted."""
    base = tmp_path_factory.mktemp("integrity")
    ckpt, metrics = base / "ckpt", base / "full.jsonl"
    result = run(train_args(data_prefix, base, 8, "--save", str(ckpt), "--save-interval", "2",
                            "--exit-interval", "6"))
    assert result.returncode == 0, result.stderr
    assert (ckpt / "latest").read_text() == "iter_0000006"
    result = run(train_args(data_prefix, base, 8, "--metrics-file", str(metrics)))
    assert result.returncode == 0, result.stderr
    losses = {r["iteration"]: r["lm_loss"] for r in read_metrics(metrics)[0]}
    return base, ckpt, losses


def resume(data_prefix, tmp_path, ckpt, *extra):  # noqa: F811
    metrics = tmp_path / "resumed.jsonl"
    result = run(train_args(data_prefix, tmp_path, 8, "--load", str(ckpt), "--metrics-file",
                            str(metrics), *extra))
    return result, metrics


def damaged_copy(saved_runs, tmp_path):
    _base, ckpt, losses = saved_runs
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    return copy, losses


def test_checksums_are_recorded_for_every_file(saved_runs):
    _base, ckpt, _ = saved_runs
    meta = json.loads((ckpt / "iter_0000006" / "meta.json").read_text())
    size = (ckpt / "iter_0000006" / "zero_rank00000.pt").stat().st_size
    assert len(meta["checksums"]) == 1 and meta["checksums"][0][1] == size


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing_meta"])
def test_a_damaged_latest_checkpoint_falls_back(data_prefix, saved_runs, tmp_path, damage):  # noqa: F811
    """The run resumes from iteration 4 and continues exactly as an uninterrupted run would;
    the damaged checkpoint stays as it was."""
    ckpt, losses = damaged_copy(saved_runs, tmp_path)
    shard = ckpt / "iter_0000006" / "zero_rank00000.pt"
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-1000])
    else:
        (ckpt / "iter_0000006" / "meta.json").unlink()
    damaged = shard.read_bytes() if shard.exists() else None
    result, metrics = resume(data_prefix, tmp_path, ckpt)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if "newest one that verifies" in line]
    assert len(notes) == 1 and "iter_0000006" in notes[0] and "iter_0000004" in notes[0]
    got = {r["iteration"]: r["lm_loss"] for r in read_metrics(metrics)[0]}
    assert sorted(got) == [5, 6, 7, 8] and all(got[i] == losses[i] for i in got)
    assert (shard.read_bytes() if shard.exists() else None) == damaged  # nothing overwritten


def test_no_fallback_stops_with_one_line(data_prefix, saved_runs, tmp_path):  # noqa: F811
    ckpt, _ = damaged_copy(saved_runs, tmp_path)
    shard = ckpt / "iter_0000006" / "zero_rank00000.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    result, _ = resume(data_prefix, tmp_path, ckpt, "--no-load-fallback")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "iter_0000006" in last and "zero_rank00000.pt" in last and "truncated" in last


def test_a_checkpoint_from_before_checksums_still_loads(data_prefix, saved_runs, tmp_path):  # noqa: F811
    ckpt, losses = damaged_copy(saved_runs, tmp_path)
    for tag in ("iter_0000002", "iter_0000004", "iter_0000006"):
        meta_path = ckpt / tag / "meta.json"
        meta = json.loads(meta_path.read_text())
        del meta["checksums"]
        meta_path.write_text(json.dumps(meta))
    result, metrics = resume(data_prefix, tmp_path, ckpt)
    assert result.returncode == 0, result.stderr
    assert "predates checksums: loaded unverified" in result.stdout
    got = {r["iteration"]: r["lm_loss"] for r in read_metrics(metrics)[0]}
    assert sorted(got) == [7, 8] and all(got[i] == losses[i] for i in got)


def missing_rank_file(rank, world, root):
    import torch.distributed as dist

    from tests.test_gradient_reduction import build, qgz_config, train_steps

    engine = build(qgz_config())
    train_steps(engine, rank, world, 2)
    engine.save_checkpoint(root, tag="step2")
    train_steps(engine, rank, world, 1, first_step=2)
    engine.save_checkpoint(root, tag="step3")
    expected = engine.full_state_dict()
    engine.close()
    dist.barrier()
    if rank == 0:
        (Path(root) / "step3" / "zero_rank00003.pt").unlink()  # one rank's file lost
    dist.barrier()
    resumed = build(qgz_config())
    messages = []
    path, _ = resumed.load_checkpoint(root, tag=None) if rank else (None, None)
    if rank == 0:
        tag = resumed.checkpoint_to_load(root, log=messages.append)
        path, _ = resumed.load_checkpoint(root, tag=tag)
    state = resumed.full_state_dict()
    resumed.close()
    return path, messages, any(not torch.equal(state[k], expected[k]) for k in state)


def test_a_missing_rank_file_falls_back_on_every_rank(tmp_path):
    """4 ranks; rank 3's file of the newest checkpoint is gone: every rank takes step2."""
    results = run_ranks(missing_rank_file, 4, str(tmp_path))
    for path, _messages, differs in results:
        assert path.endswith("step2") and differs  # step2's weights, not step3's
    messages = results[0][1]
    assert len(messages) == 1 and "zero_rank00003.pt is missing" in messages[0]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                    reason="mounting a small tmpfs (a disk that fills up) needs root")
def test_a_full_disk_during_save_keeps_the_previous_checkpoint(data_prefix, saved_runs,  # noqa: F811
                                                               tmp_path):
    """The disk fills up while iteration 4's checkpoint is written: the save fails, the run
    goes on (--save-error continue), and --load still resumes from iteration 2's, verified."""
    _base, ckpt, losses = saved_runs
    size = sum(f.stat().st_size for f in (ckpt / "iter_0000002").iterdir())
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5)}", "tmpfs",
                              str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        save = disk / "ckpt"
        result = run(train_args(data_prefix, tmp_path, 4, "--save", str(save),
                                "--save-interval", "2", "--save-error", "continue"))
        assert result.returncode == 0, result.stderr
        assert "checkpoint save at iteration 4 failed" in result.stdout
        assert (save / "latest").read_text() == "iter_0000002"
        resumed, metrics = resume(data_prefix, tmp_path, save)
        assert resumed.returncode == 0, resumed.stderr
        assert "resumed from" in resumed.stdout and "verifies" not in resumed.stdout
        got = {r["iteration"]: r["lm_loss"] for r in read_metrics(metrics)[0]}
        assert sorted(got)[0] == 3
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# ---- what a load leaves in memory ---------------------------------------------------------
def load_and_look_at_the_mappings(rank, world, root):
    """Save, then load in a fresh engine (4 ranks, qgZ: error feedback is restored too): the
    restored state is the saved one, and no rank file is still mapped once the load is done."""
    import gc

    from tests.test_gradient_reduction import build, qgz_config, train_steps

    engine = build(qgz_config())
    train_steps(engine, rank, world, 2)
    engine.save_checkpoint(root, tag="t")
    expected = engine.full_state_dict()
    engine.close()
    resumed = build(qgz_config())
    resumed.load_checkpoint(root, tag="t")
    state = resumed.full_state_dict()
    kept_rng = resumed.loaded_rng_state is not None
    resumed.close()
    gc.collect()
    with open("/proc/self/maps") as maps:
        left = sum("zero_rank" in line for line in maps)
    return left, kept_rng, all(torch.equal(state[k], expected[k]) for k in state)


@pytest.mark.skipif(not os.path.isfile("/proc/self/maps"), reason="reads /proc/self/maps")
def test_a_load_leaves_no_rank_file_mapped(tmp_path):
    for left, kept_rng, same in run_ranks(load_and_look_at_the_mappings, 4, str(tmp_path)):
        # The RNG states it keeps are copies: the whole file stayed mapped through them.
        assert kept_rng and left == 0
        assert same
