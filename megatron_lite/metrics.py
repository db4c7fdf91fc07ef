"""Timers, the Megatron-style training log line, and the metric writers.

``MetricsWriter`` is the one object the training loop talks to. Behind it, each optional sink
is enabled by its flag: ``--metrics-file`` (JSON lines, the record benchmarks and plots read),
``--wandb-project`` (Weights & Biases, offline when no API key is configured) and
``--tensorboard-dir``. Only the rank that owns logging builds writers (``enabled=False``
elsewhere), and a missing or failing W&B/TensorBoard costs one warning line, never the run.
"""

from __future__ import annotations

import argparse
import json
import math
import netrc
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlparse

# Keys every log_train() record carries, so that metrics files from different runs line up.
TRAIN_METRIC_KEYS = (
    "lm_loss",
    "grad_norm",
    "loss_scale",
    "lr",
    "elapsed_ms_per_iteration",
    "tokens_per_sec",
    "tflops_per_gpu",
    "skipped_iterations",
    "max_memory_bytes",
)
# Dashboard names for metric keys; any other key keeps its name. Used by W&B and TensorBoard.
DASHBOARD_NAMES = {
    "lm_loss": "loss/lm_loss",
    "val_loss": "loss/val_loss",
    "val_ppl": "loss/val_ppl",
    "tflops_per_gpu": "throughput/tflops",
    "tokens_per_sec": "throughput/tokens_per_sec",
    "samples_per_sec": "throughput/samples_per_sec",
    "max_memory_bytes": "memory/max_allocated_bytes",
}
# exp() of a diverged loss overflows and tells nothing; Megatron clamps the same way.
MAX_LOSS_FOR_PERPLEXITY = 20.0


def _warn(message: str) -> None:
    print(f"WARNING: {message}", flush=True)


# -------------------- Timers --------------------------------------------------------------------


class Timer:
    """One named timer that accumulates over start/stop pairs.

    On CPU it reads ``clock``. With ``event_factory`` (CUDA events on GPU) start and stop
    record events on the compute stream instead, and the intervals are read when the timer
    is read (at the log interval): one wait there instead of a device sync at every start
    and stop, which would stall the GPU and hide the overlap being measured.
    """

    def __init__(self, name: str, clock: Callable[[], float],
                 event_factory: Callable[[], Any] | None = None) -> None:
        self.name = name
        self._clock = clock
        self._event_factory = event_factory
        self._accumulated = 0.0
        self._started_at: float | None = None
        self._start_event: Any = None
        self._intervals: list[tuple[Any, Any]] = []  # recorded, not yet read

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"timer {self.name!r} is already running")
        if self._event_factory is not None:
            self._start_event = self._record()
        self._started_at = self._clock()

    def stop(self) -> None:
        if self._started_at is None:
            raise RuntimeError(f"timer {self.name!r} was stopped without being started")
        if self._event_factory is not None:
            self._intervals.append((self._start_event, self._record()))
        else:
            self._accumulated += self._clock() - self._started_at
        self._started_at = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated so far (a running timer is read without losing its interval)."""
        was_running = self.running
        if was_running:
            self.stop()
        for start, stop in self._intervals:
            stop.synchronize()
            self._accumulated += start.elapsed_time(stop) / 1000.0  # events count in ms
        self._intervals.clear()
        seconds = self._accumulated
        if reset:
            self._accumulated = 0.0
        if was_running:
            self.start()
        return seconds

    def _record(self) -> Any:
        event = self._event_factory()
        event.record()
        return event


def cuda_timing_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


class Timers:
    """Named timers created on first use: ``timers("forward").start()``.

    ``event_factory`` makes them time with device events (pass ``cuda_timing_event`` on
    GPU); ``clock`` is injectable so tests need not sleep.
    """

    def __init__(self, event_factory: Callable[[], Any] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._event_factory = event_factory
        self._clock = clock
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer(name, self._clock, self._event_factory)
        return self._timers[name]

    def elapsed_ms(self, names: list[str], normalizer: float = 1.0,
                   reset: bool = True) -> dict[str, float]:
        """Milliseconds per timer divided by ``normalizer`` (e.g. iterations since last log)."""
        if normalizer <= 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        unknown = [name for name in names if name not in self._timers]
        if unknown:
            raise KeyError(f"no timer named {', '.join(map(repr, unknown))}")
        return {name: self._timers[name].elapsed(reset) * 1000.0 / normalizer for name in names}

    def log_string(self, names: list[str], normalizer: float = 1.0, reset: bool = True) -> str:
        """Megatron's timing line: ``time (ms) | forward: 12.34 | backward: 56.78``."""
        times = self.elapsed_ms(names, normalizer, reset)
        return "time (ms)" + "".join(f" | {name}: {ms:.2f}" for name, ms in times.items())


# -------------------- Log line ------------------------------------------------------------------


def training_log_line(
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    consumed_tokens: int,
    elapsed_ms: float,
    lr: float,
    global_batch_size: int,
    lm_loss: float,
    loss_scale: float | None,
    grad_norm: float | None,
    skipped_iterations: int,
    samples_per_sec: float,
    tokens_per_sec_per_gpu: float,
    tflops_per_gpu: float,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """One Megatron-style progress line; fields in Megatron's order, each ending in ``|``.

    ``loss_scale`` and ``grad_norm`` may be None (no loss scaling; norm not computed): their
    fields are then left out, as Megatron does.
    """
    fields = [
        f" iteration {iteration:8d}/{train_iters:8d} |",
        f" consumed samples: {consumed_samples:12d} |",
        f" consumed tokens: {consumed_tokens:12d} |",
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |",
        f" learning rate: {lr:.3E} |",
        f" global batch size: {global_batch_size:5d} |",
        f" lm loss: {lm_loss:.6E} |",
    ]
    if loss_scale is not None:
        fields.append(f" loss scale: {loss_scale:.1f} |")
    if grad_norm is not None:
        fields.append(f" grad norm: {grad_norm:.3f} |")
    fields += [
        f" number of skipped iterations: {skipped_iterations:3d} |",
        f" samples per second: {samples_per_sec:.3f} |",
        f" tokens per second per GPU: {tokens_per_sec_per_gpu:.1f} |",
        f" TFLOPs per GPU: {tflops_per_gpu:.2f} |",
    ]
    for key, value in (extra or {}).items():
        fields.append(f" {key}: {_format_extra(value)} |")
    return "".join(fields)


def _format_extra(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


# -------------------- Sinks ---------------------------------------------------------------------


def _json_ready(value: Any, key: str) -> Any:
    """Plain JSON types; non-finite floats become null so every line is strict JSON."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(name): _json_ready(item, f"{key}.{name}") for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(item, key) for item in value]
    if callable(getattr(value, "item", None)):  # numpy and 0-d torch scalars
        try:
            return _json_ready(value.item(), key)
        except (ValueError, RuntimeError):
            pass
    raise TypeError(f"metric {key!r} has a value of type {type(value).__name__} that is not a "
                    "number, string, list or dict")


def dashboard_scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric metrics under their dashboard names; nested dicts flattened with '/'."""
    scalars: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}/{key}" if prefix else DASHBOARD_NAMES.get(key, key)
        if isinstance(value, Mapping):
            scalars.update(dashboard_scalars(value, name))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[name] = value
        elif callable(getattr(value, "item", None)):  # numpy and 0-d torch scalars
            scalars.update(dashboard_scalars({key: _item_or_none(value)}, prefix))
    return scalars


def _item_or_none(value: Any) -> Any:
    try:
        return value.item()
    except (ValueError, RuntimeError):
        return None


def _drop_torn_last_line(path: Path) -> None:
    """Cut an unterminated last line: a run killed while appending (a fatal signal stops a
    write at a page boundary) leaves half a record, and the resumed run's first record would
    otherwise be glued to it, spoiling both for every reader. The cut record's iteration runs
    again after the resume, so nothing logged is lost."""
    try:
        data = path.read_bytes()  # once per run, at its start
    except FileNotFoundError:
        return
    if not data or data.endswith(b"\n"):
        return
    size, keep = len(data), data.rfind(b"\n") + 1
    with open(path, "rb+") as file:
        file.truncate(keep)
    _warn(f"{path}: dropped an unterminated last record ({size - keep} bytes) left by a run "
          "that was stopped while writing it")


class _JsonLinesSink:
    """Appends one JSON object per call, flushed so a crash loses nothing already logged."""

    def __init__(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_last_line(Path(path))
        # Append: a resumed run continues the same file.
        self._file: TextIO = open(path, "a", encoding="utf-8")

    def write(self, iteration: int, metrics: Mapping[str, Any]) -> None:
        record = {"iteration": iteration, **_json_ready(dict(metrics), "metrics")}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class _WandbSink:
    """A W&B run; offline (synced later with ``wandb sync``) when no API key is configured."""

    def __init__(self, run: Any) -> None:
        self._run = run

    @classmethod
    def open(cls, project: str, exp_name: str | None, save_dir: str | None,
             config: dict[str, Any]) -> _WandbSink | None:
        try:
            import wandb
        except ImportError:
            _warn("--wandb-project is set but wandb is not installed; W&B logging is off")
            return None
        mode = _wandb_mode()
        if save_dir is not None:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
        try:
            run = wandb.init(project=project, name=exp_name, dir=save_dir, config=config,
                             mode=mode)
        except Exception as error:  # any W&B failure must not stop training
            _warn(f"wandb.init failed ({type(error).__name__}: {error}); W&B logging is off")
            return None
        if getattr(run, "offline", mode == "offline"):
            run_dir = Path(run.dir).parent
            print(f"W&B offline run in {run_dir} (upload later: wandb sync {run_dir})", flush=True)
        return cls(run)

    def write(self, iteration: int, metrics: Mapping[str, Any]) -> bool:
        try:
            self._run.log(dashboard_scalars(metrics), step=iteration)
        except Exception as error:  # a dashboard hiccup must not stop training
            _warn(f"wandb log failed ({type(error).__name__}: {error}); W&B logging is off")
            return False
        return True

    def close(self) -> None:
        try:
            self._run.finish()
        except Exception as error:  # the run's data is on disk; finishing is best effort
            _warn(f"wandb finish failed ({type(error).__name__}: {error})")


def _wandb_mode() -> str | None:
    """None defers to an explicit $WANDB_MODE; otherwise online only with an API key."""
    if os.environ.get("WANDB_MODE"):
        return None
    return "online" if _wandb_api_key_configured() else "offline"


def _wandb_api_key_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        credentials = netrc.netrc(os.environ.get("NETRC")).authenticators(host or "")
    except (OSError, netrc.NetrcParseError):
        return False
    return credentials is not None


class _TensorBoardSink:
    def __init__(self, writer: Any) -> None:
        self._writer = writer

    @classmethod
    def open(cls, log_dir: str) -> _TensorBoardSink | None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            _warn("--tensorboard-dir is set but tensorboard is not installed; "
                  "TensorBoard logging is off")
            return None
        return cls(SummaryWriter(log_dir=log_dir))

    def write(self, iteration: int, metrics: Mapping[str, Any]) -> None:
        for name, value in dashboard_scalars(metrics).items():
            self._writer.add_scalar(name, value, iteration)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# -------------------- Facade --------------------------------------------------------------------


class MetricsWriter:
    """Fans each training/eval record out to the metrics file, W&B and TensorBoard.

    ``log_train`` metrics must include ``TRAIN_METRIC_KEYS``: lm_loss, grad_norm, loss_scale,
    lr, elapsed_ms_per_iteration, tokens_per_sec (per GPU, as on the log line),
    tflops_per_gpu, skipped_iterations, max_memory_bytes (None where unknown). Any other key
    is kept, and nested dicts (``comm_bytes: {phase: {intra_node, inter_node}}``) go to the
    file as JSON and to the dashboards flattened with '/'.
    """

    def __init__(
        self,
        enabled: bool,
        metrics_file: str | None = None,
        wandb_project: str | None = None,
        wandb_exp_name: str | None = None,
        wandb_save_dir: str | None = None,
        tensorboard_dir: str | None = None,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self._file = _JsonLinesSink(metrics_file) if enabled and metrics_file else None
        self._wandb = None
        self._tensorboard = None
        if enabled and wandb_project:
            config = _json_ready_config(run_config or {})
            self._wandb = _WandbSink.open(wandb_project, wandb_exp_name, wandb_save_dir, config)
        if enabled and tensorboard_dir:
            self._tensorboard = _TensorBoardSink.open(tensorboard_dir)

    @classmethod
    def from_args(cls, args: argparse.Namespace, enabled: bool) -> MetricsWriter:
        """Writers chosen by --metrics-file, --wandb-* and --tensorboard-dir."""
        return cls(
            enabled=enabled,
            metrics_file=args.metrics_file,
            wandb_project=args.wandb_project,
            wandb_exp_name=args.wandb_exp_name,
            wandb_save_dir=args.wandb_save_dir,
            tensorboard_dir=args.tensorboard_dir,
            run_config=vars(args),
        )

    def log_train(self, iteration: int, metrics: Mapping[str, Any]) -> None:
        missing = [key for key in TRAIN_METRIC_KEYS if key not in metrics]
        if missing:
            raise ValueError(f"log_train metrics lack {', '.join(missing)}")
        self._write(iteration, metrics)

    def log_eval(self, iteration: int, val_loss: float) -> None:
        val_ppl = math.exp(min(val_loss, MAX_LOSS_FOR_PERPLEXITY))
        self._write(iteration, {"val_loss": val_loss, "val_ppl": val_ppl})

    def close(self) -> None:
        for sink in (self._file, self._wandb, self._tensorboard):
            if sink is not None:
                sink.close()
        self._file = self._wandb = self._tensorboard = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write(self, iteration: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        if self._file is not None:
            self._file.write(iteration, metrics)
        if self._wandb is not None and not self._wandb.write(iteration, metrics):
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.write(iteration, metrics)


def _json_ready_config(config: Mapping[str, Any]) -> dict[str, Any]:
    # The run config is for reading on the dashboard: values JSON cannot hold (torch dtypes,
    # sets) are shown as text rather than rejected.
    return {str(key): json.loads(json.dumps(value, default=str)) for key, value in config.items()}
