"""Timers, the Megatron log line, and the metrics file / W&B / TensorBoard writers."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.metrics import TRAIN_METRIC_KEYS, MetricsWriter, Timers, training_log_line


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def train_metrics(**overrides: Any) -> dict[str, Any]:
    metrics = {
        "lm_loss": 7.5, "grad_norm": 1.25, "loss_scale": 65536.0, "lr": 1e-4,
        "elapsed_ms_per_iteration": 123.4, "tokens_per_sec": 4150.0, "tflops_per_gpu": 12.5,
        "skipped_iterations": 0, "max_memory_bytes": 2**30, "samples_per_sec": 259.3,
    }
    metrics.update(overrides)
    return metrics


# -------------------- timers ---------------------------------------------------------------------


def test_timer_accumulates_and_resets() -> None:
    clock = FakeClock()
    timers = Timers(clock=clock)
    timers("forward").start()
    clock.now += 0.25
    timers("forward").stop()
    timers("forward").start()
    clock.now += 0.5
    timers("forward").stop()
    assert timers("forward").elapsed(reset=False) == pytest.approx(0.75)
    assert timers("forward").elapsed() == pytest.approx(0.75)
    assert timers("forward").elapsed() == 0.0


def test_reading_a_running_timer_keeps_it_running() -> None:
    clock = FakeClock()
    timers = Timers(clock=clock)
    timers("step").start()
    clock.now += 1.0
    assert timers("step").elapsed() == pytest.approx(1.0)
    assert timers("step").running
    clock.now += 2.0
    timers("step").stop()
    assert timers("step").elapsed() == pytest.approx(2.0)


class FakeEvent:
    """A device event on a fake clock: records the time, counts waits."""

    waits = 0

    def __init__(self, clock) -> None:
        self.clock = clock
        self.at = None

    def record(self) -> None:
        self.at = self.clock.now

    def synchronize(self) -> None:
        FakeEvent.waits += 1

    def elapsed_time(self, other) -> float:
        return (other.at - self.at) * 1000.0


def test_event_timers_wait_only_when_read() -> None:
    clock = FakeClock()
    FakeEvent.waits = 0
    timers = Timers(event_factory=lambda: FakeEvent(clock), clock=clock)
    for _ in range(3):
        timers("backward").start()
        clock.now += 0.5
        timers("backward").stop()
    assert FakeEvent.waits == 0  # no device sync at start or stop
    assert timers("backward").elapsed() == pytest.approx(1.5)
    assert FakeEvent.waits == 3
    assert timers("backward").elapsed() == 0.0


def test_timer_misuse_is_reported() -> None:
    timers = Timers(clock=FakeClock())
    with pytest.raises(RuntimeError, match="'optimizer' was stopped without being started"):
        timers("optimizer").stop()
    timers("optimizer").start()
    with pytest.raises(RuntimeError, match="'optimizer' is already running"):
        timers("optimizer").start()
    with pytest.raises(KeyError, match="no timer named 'missing'"):
        timers.elapsed_ms(["missing"])


def test_timing_line_normalises_per_iteration() -> None:
    clock = FakeClock()
    timers = Timers(clock=clock)
    for name, seconds in (("forward", 0.4), ("backward", 0.8)):
        timers(name).start()
        clock.now += seconds
        timers(name).stop()
    assert timers.log_string(["forward", "backward"], normalizer=4) == \
        "time (ms) | forward: 100.00 | backward: 200.00"


def test_wall_clock_default_measures_real_time() -> None:
    timers = Timers()
    timers("sleep").start()
    torch.ones(256, 256) @ torch.ones(256, 256)
    timers("sleep").stop()
    assert timers("sleep").elapsed() > 0.0


# -------------------- log line -------------------------------------------------------------------


def log_line(**overrides: Any) -> str:
    values = dict(
        iteration=10, train_iters=100, consumed_samples=320, consumed_tokens=163840,
        elapsed_ms=123.44, lr=1e-4, global_batch_size=32, lm_loss=7.1234564,
        loss_scale=65536.0, grad_norm=1.2341, skipped_iterations=0, samples_per_sec=259.2,
        tokens_per_sec_per_gpu=16588.8, tflops_per_gpu=12.345,
    )
    values.update(overrides)
    return training_log_line(**values)


def test_log_line_matches_megatron_format() -> None:
    assert log_line() == (
        " iteration       10/     100 |"
        " consumed samples:          320 |"
        " consumed tokens:       163840 |"
        " elapsed time per iteration (ms): 123.4 |"
        " learning rate: 1.000E-04 |"
        " global batch size:    32 |"
        " lm loss: 7.123456E+00 |"
        " loss scale: 65536.0 |"
        " grad norm: 1.234 |"
        " number of skipped iterations:   0 |"
        " samples per second: 259.200 |"
        " tokens per second per GPU: 16588.8 |"
        " TFLOPs per GPU: 12.35 |"
    )


def test_log_line_field_order_and_extras() -> None:
    line = log_line(extra={"comm GB inter-node": 0.123456789, "hpZ": "on", "steps": 3})
    labels = [field.split(":")[0].strip() for field in line.split("|") if field.strip()]
    assert labels == [
        "iteration       10/     100", "consumed samples", "consumed tokens",
        "elapsed time per iteration (ms)", "learning rate", "global batch size", "lm loss",
        "loss scale", "grad norm", "number of skipped iterations", "samples per second",
        "tokens per second per GPU", "TFLOPs per GPU", "comm GB inter-node", "hpZ", "steps",
    ]
    assert line.endswith(" comm GB inter-node: 0.123457 | hpZ: on | steps: 3 |")


def test_log_line_omits_missing_scale_and_norm() -> None:
    line = log_line(loss_scale=None, grad_norm=None, lm_loss=float("nan"))
    assert "loss scale" not in line and "grad norm" not in line
    assert " lm loss: NAN |" in line


# -------------------- metrics file ---------------------------------------------------------------


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_file_writes_one_json_object_per_call(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "metrics.jsonl"
    comm = {"forward_gather": {"intra_node": 1024, "inter_node": 512},
            "gradient_reduce": {"intra_node": 2048, "inter_node": 0}}
    writer = MetricsWriter(enabled=True, metrics_file=str(path))
    writer.log_train(10, train_metrics(comm_bytes=comm))
    assert len(read_lines(path)) == 1  # flushed before close
    writer.log_eval(10, 2.0)
    writer.log_train(20, train_metrics(lm_loss=float("nan"), grad_norm=torch.tensor(2.5),
                                       max_memory_bytes=None))
    writer.close()
    first, evaluation, second = read_lines(path)
    assert set(first) >= {"iteration", *TRAIN_METRIC_KEYS}
    assert first["iteration"] == 10 and first["lm_loss"] == 7.5
    assert first["comm_bytes"] == comm
    assert evaluation == {"iteration": 10, "val_loss": 2.0, "val_ppl": pytest.approx(math.e**2)}
    assert second["lm_loss"] is None and second["grad_norm"] == 2.5
    assert second["max_memory_bytes"] is None


def test_metrics_file_appends_across_runs(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for iteration in (1, 2):
        with MetricsWriter(enabled=True, metrics_file=str(path)) as writer:
            writer.log_eval(iteration, 3.0)
    assert [line["iteration"] for line in read_lines(path)] == [1, 2]


def test_a_torn_last_record_is_cut_before_appending(tmp_path: Path, capsys) -> None:
    """A run killed mid-append leaves half a line; the resumed run's records start on a line
    of their own, and every complete record before it stays."""
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(enabled=True, metrics_file=str(path)) as writer:
        writer.log_eval(1, 3.0)
        writer.log_eval(2, 3.0)
    whole = path.read_bytes()
    path.write_bytes(whole + whole.splitlines(keepends=True)[0][:20])  # a torn third record
    with MetricsWriter(enabled=True, metrics_file=str(path)) as writer:
        writer.log_eval(3, 3.0)
    assert [line["iteration"] for line in read_lines(path)] == [1, 2, 3]
    assert "dropped an unterminated last record (20 bytes)" in capsys.readouterr().out
    path.write_bytes(b'{"iteration": 1, "val')  # nothing but a torn record
    with MetricsWriter(enabled=True, metrics_file=str(path)) as writer:
        writer.log_eval(4, 3.0)
    assert [line["iteration"] for line in read_lines(path)] == [4]


def test_perplexity_is_clamped_for_diverged_loss(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(enabled=True, metrics_file=str(path)) as writer:
        writer.log_eval(5, 50.0)
    assert read_lines(path)[0]["val_ppl"] == pytest.approx(math.exp(20.0))


def test_missing_train_keys_are_named(tmp_path: Path) -> None:
    writer = MetricsWriter(enabled=True, metrics_file=str(tmp_path / "m.jsonl"))
    metrics = train_metrics()
    del metrics["tflops_per_gpu"], metrics["lr"]
    with pytest.raises(ValueError, match="log_train metrics lack lr, tflops_per_gpu"):
        writer.log_train(1, metrics)
    with pytest.raises(TypeError, match="metric 'metrics.lm_loss' has a value of type object"):
        writer.log_train(1, train_metrics(lm_loss=object()))
    writer.close()


def test_disabled_writer_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(enabled=False, metrics_file=str(path), wandb_project="p",
                           tensorboard_dir=str(tmp_path / "tb"))
    writer.log_train(1, train_metrics())
    writer.log_eval(1, 1.0)
    writer.close()
    assert list(tmp_path.iterdir()) == []


# -------------------- W&B ------------------------------------------------------------------------


class FakeRun:
    def __init__(self, run_dir: Path) -> None:
        self.dir = str(run_dir / "files")
        self.offline = True
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.finished = False

    def log(self, data: dict[str, Any], step: int) -> None:
        self.logged.append((step, data))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> types.SimpleNamespace:
    module = types.ModuleType("wandb")
    record = types.SimpleNamespace(init_kwargs=None, run=FakeRun(tmp_path / "offline-run-x"))

    def init(**kwargs: Any) -> FakeRun:
        record.init_kwargs = kwargs
        return record.run

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    for variable in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(variable, raising=False)
    empty_netrc = tmp_path / "netrc"
    empty_netrc.write_text("")
    monkeypatch.setenv("NETRC", str(empty_netrc))
    return record


def test_wandb_keys_and_flattening(fake_wandb: types.SimpleNamespace,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    writer = MetricsWriter(enabled=True, wandb_project="zeropp", wandb_exp_name="run1",
                           run_config={"hidden_size": 64, "params_dtype": torch.float16})
    comm = {"backward_gather": {"intra_node": 10, "inter_node": 0}}
    writer.log_train(10, train_metrics(comm_bytes=comm, phase="warmup"))
    writer.log_eval(10, 1.0)
    writer.close()
    assert fake_wandb.init_kwargs["mode"] == "offline"
    assert fake_wandb.init_kwargs["project"] == "zeropp"
    assert fake_wandb.init_kwargs["name"] == "run1"
    assert fake_wandb.init_kwargs["config"] == {"hidden_size": 64, "params_dtype": "torch.float16"}
    (train_step, train), (eval_step, evaluation) = fake_wandb.run.logged
    assert train_step == eval_step == 10
    assert train == {
        "loss/lm_loss": 7.5, "grad_norm": 1.25, "loss_scale": 65536.0, "lr": 1e-4,
        "elapsed_ms_per_iteration": 123.4, "throughput/tokens_per_sec": 4150.0,
        "throughput/tflops": 12.5, "skipped_iterations": 0,
        "memory/max_allocated_bytes": 2**30, "throughput/samples_per_sec": 259.3,
        "comm_bytes/backward_gather/intra_node": 10, "comm_bytes/backward_gather/inter_node": 0,
    }
    assert evaluation == {"loss/val_loss": 1.0, "loss/val_ppl": pytest.approx(math.e)}
    assert fake_wandb.run.finished
    assert f"W&B offline run in {fake_wandb.run.dir[:-len('/files')]}" in capsys.readouterr().out


def test_wandb_goes_online_with_an_api_key(fake_wandb: types.SimpleNamespace,
                                           monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password secret\n")
    MetricsWriter(enabled=True, wandb_project="p").close()
    assert fake_wandb.init_kwargs["mode"] == "online"
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    MetricsWriter(enabled=True, wandb_project="p").close()
    assert fake_wandb.init_kwargs["mode"] == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    MetricsWriter(enabled=True, wandb_project="p").close()
    assert fake_wandb.init_kwargs["mode"] is None  # defer to the user's $WANDB_MODE


def test_wandb_init_failure_warns_and_continues(fake_wandb: types.SimpleNamespace,
                                                monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    def failing_init(**kwargs: Any) -> None:
        raise RuntimeError("no route to host")

    monkeypatch.setattr(sys.modules["wandb"], "init", failing_init)
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(enabled=True, metrics_file=str(path), wandb_project="p") as writer:
        writer.log_train(1, train_metrics())
    output = capsys.readouterr().out
    assert output.count("WARNING:") == 1 and "no route to host" in output
    assert len(read_lines(path)) == 1


def test_wandb_absent_warns_once_and_continues(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(enabled=True, metrics_file=str(path), wandb_project="p") as writer:
        writer.log_train(1, train_metrics())
        writer.log_eval(1, 1.0)
    output = capsys.readouterr().out
    assert output.count("WARNING:") == 1 and "wandb is not installed" in output
    assert len(read_lines(path)) == 2


def test_real_wandb_offline_run_creates_its_directory(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    args = parse_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
                      f"--wandb-project zeropp-test --wandb-save-dir {tmp_path}".split())
    writer = MetricsWriter.from_args(args, enabled=True)
    writer.log_train(1, train_metrics())
    writer.log_eval(1, 2.0)
    writer.close()
    run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    assert list(run_dirs[0].glob("run-*.wandb"))
    assert f"W&B offline run in {run_dirs[0]}" in capsys.readouterr().out


# -------------------- TensorBoard ----------------------------------------------------------------


def test_tensorboard_scalars(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    scalars: list[tuple[str, float, int]] = []
    events: list[str] = []

    class FakeSummaryWriter:
        def __init__(self, log_dir: str) -> None:
            events.append(f"open {log_dir}")

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            scalars.append((tag, value, step))

        def flush(self) -> None:
            events.append("flush")

        def close(self) -> None:
            events.append("close")

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    with MetricsWriter(enabled=True, tensorboard_dir=str(tmp_path / "tb")) as writer:
        writer.log_train(3, train_metrics(comm_bytes={"reduce": {"inter_node": 7}}))
        writer.log_eval(4, 0.0)
    assert ("loss/lm_loss", 7.5, 3) in scalars
    assert ("throughput/tflops", 12.5, 3) in scalars
    assert ("comm_bytes/reduce/inter_node", 7, 3) in scalars
    assert ("loss/val_ppl", 1.0, 4) in scalars
    assert events == [f"open {tmp_path / 'tb'}", "flush", "flush", "close"]


def test_tensorboard_absent_warns_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with MetricsWriter(enabled=True, tensorboard_dir=str(tmp_path / "tb")) as writer:
        writer.log_train(1, train_metrics())
    output = capsys.readouterr().out
    assert output.count("WARNING:") == 1 and "tensorboard is not installed" in output
