"""Asynchronous checkpoint saves and the disk-speed writer: the same files as a synchronous
save, bit-exact resume, nothing published before every rank's file is durable, a full disk
reported once on every rank with the previous checkpoint intact, reused staging memory, and
a save in flight published by close()."""

from __future__ import annotations

import errno
import io
import json
import zlib
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

STEPS = 6


def _engine():
    from zeropp.deepspeed_api.initialize import build_engine
    from zeropp.sharded_model import ShardingOptions

    return build_engine(toy_model(hidden=43), lr=3e-3, weight_decay=0.1,
                        sharding=ShardingOptions(stage=3, persistence_threshold=0))


def _train(engine, rank, world, steps, after_step=None):
    data = toy_batches(STEPS, 1, 8)
    per_rank = 8 // world
    losses = []
    for step in steps:
        tokens = data[step, 0, rank * per_rank:(rank + 1) * per_rank]
        loss = toy_loss(engine(tokens), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def save_both_ways_then_resume(rank, world, root):
    """Train 3 steps, save synchronously and asynchronously at step 3 (training goes on
    while the second one is written), then resume each and train to the end."""
    root = Path(root)
    engine = _engine()
    published_early = []

    def after(step):
        if step == 2:
            engine.save_checkpoint(root / "sync", tag="t", client_state={"step": 3})
            engine.save_checkpoint(root / "async", tag="t", client_state={"step": 3},
                                   async_save=True)
            published_early.append((root / "async" / "latest").exists())
        if step == 3:  # an iteration boundary: publish once every rank's writer is done
            while engine.finish_checkpoint(wait=False) is None:
                assert engine.checkpoint_in_flight
            published_early.append(engine.checkpoint_in_flight)

    full = _train(engine, rank, world, range(STEPS), after)
    engine.close()
    resumed = {}
    for kind in ("sync", "async"):
        engine = _engine()
        _, client = engine.load_checkpoint(root / kind)
        resumed[kind] = _train(engine, rank, world, range(client["step"], STEPS))
        engine.close()
    return full[3:], resumed, published_early


def test_async_save_writes_the_sync_files_and_resumes_bit_exactly(tmp_path):
    results = run_ranks(save_both_ways_then_resume, 2, str(tmp_path))
    for full, resumed, published_early in results:
        assert published_early == [False, False]  # not before the writers; then published
        assert resumed["sync"] == full and resumed["async"] == full
    sync_meta = json.loads((tmp_path / "sync" / "t" / "meta.json").read_text())
    async_meta = json.loads((tmp_path / "async" / "t" / "meta.json").read_text())
    assert (tmp_path / "async" / "latest").read_text() == "t"
    # Training went on while the async file was written: its bytes are still the state at
    # the save (the same file as the synchronous save's, byte for byte).
    assert async_meta["checksums"] == sync_meta["checksums"]
    for rank in range(2):
        name = f"zero_rank{rank:05d}.pt"
        assert (tmp_path / "async" / "t" / name).read_bytes() == \
            (tmp_path / "sync" / "t" / name).read_bytes()


def disk_fills_during_async_write(rank, world, root, failing_rank):
    """A good synchronous save, then an asynchronous one whose writer finds the disk full on
    one rank: the error comes at the next boundary, on every rank, as a storage error."""
    from zeropp import CheckpointError, CheckpointStorageError
    from zeropp.checkpoints import checkpoint_io

    engine = _engine()
    _train(engine, rank, world, range(2))
    engine.save_checkpoint(root, tag="good")
    real_write = checkpoint_io.write_chunk

    def full_disk(fd, view, offset):
        if rank == failing_rank:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, view, offset)

    checkpoint_io.write_chunk = full_disk
    try:
        engine.save_checkpoint(root, tag="bad", async_save=True)
        _train(engine, rank, world, range(2, 3))
        outcome = "published"
        while True:
            try:
                if engine.finish_checkpoint(wait=False) is not None:
                    break
            except CheckpointStorageError as error:
                outcome = f"storage: {error}"
                break
            except CheckpointError as error:
                outcome = f"other: {error}"
                break
    finally:
        checkpoint_io.write_chunk = real_write
    in_flight = engine.checkpoint_in_flight
    from zeropp.checkpoints.checkpoint_integrity import newest_verified

    latest = (Path(root) / "latest").read_text()
    resumable = newest_verified(Path(root))
    # The run is sound: it trains on and saves again.
    _train(engine, rank, world, range(3, 4))
    engine.save_checkpoint(root, tag="after")
    engine.close()
    return outcome, in_flight, latest, resumable


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_full_disk_during_an_async_write_is_one_storage_error_on_every_rank(tmp_path,
                                                                             failing_rank):
    from zeropp.checkpoints.checkpoint_integrity import newest_verified

    results = run_ranks(disk_fills_during_async_write, 2, str(tmp_path), failing_rank)
    for rank, (outcome, in_flight, latest, resumable) in enumerate(results):
        assert outcome.startswith("storage: cannot write checkpoint shard"), outcome
        expected = "No space left on device" if rank == failing_rank else "(on another rank)"
        assert expected in outcome, outcome
        assert not in_flight
        # Right after the failure: the previous checkpoint is latest, and it verifies.
        assert latest == "good" and resumable == "good"
    assert not (tmp_path / "bad").exists()  # never published; its .tmp is left for a look
    assert (tmp_path / "latest").read_text() == "after"  # the run saved again afterwards
    assert newest_verified(tmp_path) == "after"


def test_writer_output_is_torch_save_byte_for_byte(tmp_path):
    from zeropp.checkpoints.checkpoint_io import CHUNK_BYTES, file_checksum, save_to_file

    # Larger than two chunks, with a tail that is not a multiple of the alignment.
    state = {"big": torch.arange(CHUNK_BYTES // 2 + 12345, dtype=torch.float64),
             "small": [torch.ones(3), "text", 7]}
    expected = io.BytesIO()
    torch.save(state, expected)
    crc, nbytes = save_to_file(state, tmp_path / "f.pt")
    data = (tmp_path / "f.pt").read_bytes()
    assert data == expected.getvalue()
    assert (crc, nbytes) == (zlib.crc32(data), len(data))
    assert file_checksum(tmp_path / "f.pt") == (crc, nbytes)
    loaded = torch.load(tmp_path / "f.pt", weights_only=True, mmap=True)
    assert torch.equal(loaded["big"], state["big"])


def test_writer_falls_back_to_the_page_cache_where_direct_io_is_refused(tmp_path, monkeypatch):
    from zeropp.checkpoints import checkpoint_io

    real_write = checkpoint_io.write_chunk
    refused = []

    def refuse_direct(fd, view, offset):
        import fcntl
        import os

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, view, offset)

    monkeypatch.setattr(checkpoint_io, "write_chunk", refuse_direct)
    state = {"x": torch.randn(3 * checkpoint_io.CHUNK_BYTES // 8)}
    crc, nbytes = checkpoint_io.save_to_file(state, tmp_path / "f.pt")
    expected = io.BytesIO()
    torch.save(state, expected)
    assert refused == [0]  # refused once, then through the page cache from the same offset
    assert (tmp_path / "f.pt").read_bytes() == expected.getvalue()
    assert crc == zlib.crc32(expected.getvalue())


def repeated_async_saves(rank, world, root):
    """Staging buffers are made once: ten saves leave the same buffers in place."""
    engine = _engine()
    _train(engine, rank, world, range(1))
    seen = set()
    for index in range(10):
        engine.save_checkpoint(root, tag=f"s{index}", async_save=True)
        staging = engine._checkpoint_staging
        seen.add(tuple(t.data_ptr() for b in staging._buffers for t in b.values()))
    engine.finish_checkpoint()
    engine.close()
    return len(seen), staging.nbytes


def writer_priorities(rank, world, root):
    """The CPU priority (nice) of the threads that write a synchronous and an asynchronous
    save's chunks, and of the training thread after both."""
    import os
    import threading

    from zeropp.checkpoints import checkpoint_io

    def nice():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen = {"sync": set(), "async": set()}
    kind = ["sync"]
    real_write = checkpoint_io.write_chunk

    def recording_write(fd, view, offset):
        seen[kind[0]].add(nice())
        return real_write(fd, view, offset)

    checkpoint_io.write_chunk = recording_write
    try:
        engine = _engine()
        _train(engine, rank, world, range(1))
        engine.save_checkpoint(root, tag="sync")
        kind[0] = "async"
        engine.save_checkpoint(root, tag="async", async_save=True)
        _train(engine, rank, world, range(1, 2))
        engine.finish_checkpoint()
        engine.close()
    finally:
        checkpoint_io.write_chunk = real_write
    return nice(), seen


def test_the_async_writer_runs_at_the_lowest_priority_and_training_does_not(tmp_path):
    """[Note: the writer yields to training]: only the background writer is lowered."""
    for training, seen in run_ranks(writer_priorities, 2, str(tmp_path)):
        assert seen["sync"] == {training}
        assert seen["async"] == {19} and training < 19


def test_staging_buffers_are_reused_across_saves(tmp_path):
    for distinct, nbytes in run_ranks(repeated_async_saves, 2, str(tmp_path)):
        assert distinct == 1 and nbytes > 0
    assert (tmp_path / "latest").read_text() == "s9"


def close_with_a_save_in_flight(rank, world, root):
    """An asynchronous save, then close() at once, on every rank (the end of a program that
    does not call finish_checkpoint), then a fresh engine loads what close() published."""
    engine = _engine()
    _train(engine, rank, world, range(1))
    engine.save_checkpoint(root, tag="first")
    _train(engine, rank, world, range(1, 2))
    engine.save_checkpoint(root, tag="second", async_save=True, client_state={"step": 2})
    expected = engine.full_state_dict()
    engine.close()
    in_flight = engine.checkpoint_in_flight
    resumed = _engine()
    path, client = resumed.load_checkpoint(root)
    state = resumed.full_state_dict()
    resumed.close()
    return in_flight, path, client, all(torch.equal(state[k], expected[k]) for k in state)


def test_close_publishes_the_save_in_flight(tmp_path):
    from zeropp.checkpoints.checkpoint_integrity import newest_verified

    for in_flight, path, client, equal in run_ranks(close_with_a_save_in_flight, 2,
                                                    str(tmp_path)):
        assert not in_flight
        assert path.endswith("/second") and client == {"step": 2} and equal
    assert (tmp_path / "latest").read_text() == "second"
    assert not (tmp_path / "second.tmp").exists()
    meta = json.loads((tmp_path / "second" / "meta.json").read_text())
    assert len(meta["checksums"]) == 2  # both ranks' files, as the training loop publishes
    assert newest_verified(tmp_path) == "second"


# ---- the program: --async-save ------------------------------------------------------------
from tests.test_pretrain_cli import data_prefix, read_metrics, run  # noqa: E402
from tests.test_resilience import train_args  # noqa: E402

__all__ = ["data_prefix"]  # the module-scoped fixture, shared with the CLI tests


def test_async_save_at_the_last_iteration_is_waited_for_and_resumes_bit_exactly(
        data_prefix, tmp_path):  # noqa: F811
    from zeropp.checkpoints.checkpoint_integrity import newest_verified

    full, resumed, ckpt = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    assert run(train_args(data_prefix, tmp_path, 6, "--metrics-file", str(full))).returncode == 0
    # The save at iteration 3 is followed at once by the end of the run (--exit-interval).
    first = run(train_args(data_prefix, tmp_path, 6, "--save", str(ckpt), "--save-interval",
                           "3", "--exit-interval", "3", "--async-save"))
    assert first.returncode == 0, first.stderr
    assert "in the background" in first.stdout
    assert (ckpt / "latest").read_text() == "iter_0000003"
    assert newest_verified(ckpt) == "iter_0000003"
    assert not list(ckpt.glob("*.tmp"))
    second = run(train_args(data_prefix, tmp_path, 6, "--metrics-file", str(resumed),
                            "--load", str(ckpt), "--async-save", "--save", str(ckpt),
                            "--save-interval", "2"))
    assert second.returncode == 0, second.stderr
    expected = {r["iteration"]: r["lm_loss"] for r in read_metrics(full)[0]}
    got = {r["iteration"]: r["lm_loss"] for r in read_metrics(resumed)[0]}
    assert sorted(got) == [4, 5, 6]
    assert all(got[i] == expected[i] for i in got), (got, expected)
    assert (ckpt / "latest").read_text() == "iter_0000006"


def test_async_save_failure_stops_or_continues(data_prefix, tmp_path):  # noqa: F811
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("x")
    stop = run(train_args(data_prefix, tmp_path, 4, "--save", str(blocker / "ckpt"),
                          "--save-interval", "2", "--async-save"))
    assert stop.returncode == 1
    assert "checkpoint save at iteration 2 failed" in stop.stderr


# Runs the program; on its first launch only, rank 1's background writer stalls part-way into
# its file of iteration 4 and leaves its pid for the test to SIGKILL.
STALL_ONCE = """
import os, runpy, sys, time
from pathlib import Path
from zeropp.checkpoints import checkpoint_io

stall_note, entry_point = Path(sys.argv[1]), sys.argv[2]
real_write = checkpoint_io.write_chunk

def write_chunk(fd, view, offset):
    path = os.readlink(f"/proc/self/fd/{fd}")
    if "iter_0000004" in path and os.environ.get("RANK") == "1" and not stall_note.exists():
        real_write(fd, view[:4096], offset)
        stall_note.write_text(str(os.getpid()))
        time.sleep(600)
    return real_write(fd, view, offset)

checkpoint_io.write_chunk = write_chunk
sys.argv = [entry_point, *sys.argv[3:]]
runpy.run_path(entry_point, run_name="__main__")
"""


def test_a_rank_killed_mid_write_leaves_latest_and_the_relaunch_resumes_exactly(
        data_prefix, tmp_path, tmp_path_factory):  # noqa: F811
    import os
    import signal
    import subprocess
    import time

    from tests.test_pretrain_cli import ENTRY_POINT, ROOT
    from tests.test_supervise import ENV, SUPERVISE, TORCHRUN, reference_losses
    from zeropp.checkpoints.checkpoint_integrity import newest_verified

    metrics, ckpt = tmp_path / "run.jsonl", tmp_path / "ckpt"
    args = train_args(data_prefix, tmp_path, 8)[2:]
    # The uninterrupted 2-rank run of these arguments, as tests/test_supervise.py runs it
    expected = reference_losses(data_prefix, tmp_path, 2, tmp_path_factory)
    wrapper, stall_note = tmp_path / "stall_once.py", tmp_path / "stalled"
    wrapper.write_text(STALL_ONCE)
    command = [*SUPERVISE, "--restarts", "1", "--backoff", "0", "--", *TORCHRUN, str(wrapper),
               str(stall_note), ENTRY_POINT, *args, "--metrics-file", str(metrics),
               "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
               "--async-save", "--distributed-timeout-minutes", "1"]
    supervisor = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (stall_note.exists() and stall_note.read_text()):
        assert supervisor.poll() is None and time.monotonic() < deadline, "no stall"
        time.sleep(0.05)
    partial = ckpt / "iter_0000004.tmp" / "zero_rank00001.pt"
    assert partial.is_file() and not (ckpt / "iter_0000004").exists()
    assert (ckpt / "latest").read_text() == "iter_0000002"
    assert newest_verified(ckpt) == "iter_0000002"
    os.kill(int(stall_note.read_text()), signal.SIGKILL)
    _, err = supervisor.communicate(timeout=300)
    assert supervisor.returncode == 0, err[-3000:]
    restarts = [line for line in err.splitlines() if line.startswith("supervise:")]
    assert len(restarts) == 1 and "iteration 2" in restarts[0], restarts
    last = {}
    for record in read_metrics(metrics)[0]:  # the relaunch repeats iterations 3 onwards
        last[record["iteration"]] = record["lm_loss"]
    assert sorted(last) == list(range(1, 9))
    assert all(last[i] == expected[i] for i in last), (last, expected)
    assert (ckpt / "latest").read_text() == "iter_0000008"
