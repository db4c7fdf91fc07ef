"""Saving and resuming off the happy path: which save failures a run may continue past,
``--save X --load X`` on a first run, and the logged loss of skipped iterations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_lite.checkpointing import CheckpointConfig, RunControl, SaveFailed
from megatron_lite.training import IntervalTotals
from tests.distributed import run_ranks
from tests.test_pretrain_cli import data_prefix, run
from tests.test_resilience import train_args
from tests.toy_models import toy_model

__all__ = ["data_prefix"]

FAILURES = {
    "disk": lambda: OSError(28, "No space left on device"),
    "torch-writer": lambda: RuntimeError(
        "PytorchStreamWriter failed writing file data/0: file write failed"),
    "nccl": lambda: RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error"),
}


def failing_save(rank, world, save_dir, failure, failing_rank):
    import zeropp
    from zeropp.deepspeed_api.initialize import build_engine

    engine = build_engine(toy_model(), lr=1e-3)
    engine.save_checkpoint(save_dir, tag="good")
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if rank == failing_rank:
            raise FAILURES[failure]()
        return real_save(obj, path, *args, **kwargs)

    torch.save = save
    try:
        engine.save_checkpoint(save_dir, tag="bad")
    except zeropp.CheckpointStorageError:
        outcome = "storage"
    except zeropp.CheckpointError:
        outcome = "checkpoint"
    except RuntimeError as error:
        outcome = f"raised: {error}"
    else:
        outcome = "saved"
    finally:
        torch.save = real_save
        engine.close()
    return outcome, Path(save_dir, "latest").read_text()


@pytest.mark.parametrize("failure", ["disk", "torch-writer"])
def test_storage_failures_are_storage_errors_on_every_rank(tmp_path, failure):
    results = run_ranks(failing_save, 2, str(tmp_path), failure, 1)
    assert results == [("storage", "good"), ("storage", "good")]


def test_other_save_failures_are_not_storage_errors(tmp_path):
    results = run_ranks(failing_save, 2, str(tmp_path), "nccl", 1)
    assert results[0] == ("checkpoint", "good")  # told that another rank failed
    assert results[1][0].startswith("raised: NCCL error")  # the original error, unwrapped
    assert results[1][1] == "good"


class _Engine:
    def __init__(self, error):
        self.error = error

    def save_checkpoint(self, *args, **kwargs):
        raise self.error


class _Trainer:
    printed: list[str] = []

    def state_dict(self):
        return {"iteration": 4, "consumed_samples": 8, "applied_updates": 4,
                "skipped_iterations": 0}

    @property
    def iteration(self):
        return self.state_dict()["iteration"]

    def log(self, text):
        self.printed.append(text)


class _Scheduler:
    def state_dict(self):
        return {}


@pytest.mark.parametrize("save_error", ["stop", "continue"])
def test_save_error_continue_covers_storage_failures_only(save_error):
    import zeropp

    args = CheckpointConfig(save="x", save_error=save_error)
    storage = RunControl(args, _Engine(zeropp.CheckpointStorageError("disk full")),
                         _Scheduler(), toy_config())
    other = RunControl(args, _Engine(zeropp.CheckpointError("cannot write (on another rank)")),
                       _Scheduler(), toy_config())
    if save_error == "continue":
        storage.save(_Trainer())
        assert "continuing" in _Trainer.printed[-1]
    else:
        with pytest.raises(SaveFailed):
            storage.save(_Trainer())
    with pytest.raises(SaveFailed):
        other.save(_Trainer())


def toy_config():
    from megatron_lite.model import GPTConfig

    return GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16,
                     max_position_embeddings=8)


def test_save_and_load_the_same_directory_starts_fresh_then_resumes(data_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run(train_args(data_prefix, tmp_path, 2, "--save", str(ckpt), "--load", str(ckpt)))
    assert first.returncode == 0, first.stderr
    assert f"no checkpoint in {ckpt} yet: starting from scratch" in first.stdout
    assert (ckpt / "latest").read_text() == "iter_0000002"
    second = run(train_args(data_prefix, tmp_path, 4, "--save", str(ckpt), "--load", str(ckpt)))
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout and "iteration 2" in second.stdout
    # --load elsewhere, with nothing there, is a wrong path: an error, as before
    wrong = run(train_args(data_prefix, tmp_path, 2, "--save", str(ckpt),
                           "--load", str(tmp_path / "missing")))
    assert wrong.returncode != 0
    assert "does not exist" in wrong.stderr


def test_an_interval_of_skipped_iterations_logs_their_unscaled_loss():
    interval = IntervalTotals()
    interval.add_iteration(torch.tensor(2.0), applied=False)
    interval.add_iteration(torch.tensor(4.0), applied=False)
    assert interval.local_mean_loss().item() == 3.0
    interval.add_iteration(torch.tensor(10.0), applied=True)  # applied ones take precedence
    assert interval.local_mean_loss().item() == 10.0
    assert IntervalTotals().local_mean_loss() is None
