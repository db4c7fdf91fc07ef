"""What the engine prints and writes on its own, as DeepSpeed's engine does.

- ``steps_per_print``: every that many optimizer steps, rank 0 prints
  ``[Rank 0] step=N, skipped=S, lr=[...], mom=[(b1, b2)]``.
- ``wall_clock_breakdown``: rank 0 prints ``time (ms) | fwd_microstep: .. | bwd_microstep: ..
  | step_microstep: ..`` after every micro-step and ``time (ms) | fwd: .. | bwd: .. | step: ..``
  (summed over the accumulation) at every optimizer step. On CUDA the times come from events,
  read when printed (that read waits for them: the price of asking for timings).
- ``tput_timer`` (``ThroughputTimer``): samples per second over the optimizer steps, printed by
  rank 0 every ``steps_per_print`` steps.
- ``dump_state``: rank 0 prints the engine's resolved configuration once, key by key.
- ``tensorboard`` / ``csv_monitor`` / ``wandb`` blocks: rank 0 writes DeepSpeed's events at
  every optimizer step, ``Train/Samples/lr`` and, with fp16, ``Train/Samples/loss_scale``,
  plus ``Train/Samples/elapsed_time_ms_{forward,backward,step}`` with wall_clock_breakdown,
  each at x = samples trained so far. TensorBoard and CSV files go to
  ``output_path/job_name``; a CSV file per scalar named after it, ``/`` and spaces as ``_``,
  with the header ``step,<last part of the name>``.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from zeropp.config import ConfigError, EngineConfig

MICRO_TIMERS = ("fwd_microstep", "bwd_microstep", "step_microstep")
STEP_TIMERS = ("fwd", "bwd", "step")


class _Stopwatch:
    """Accumulated milliseconds; CUDA events on a GPU, the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[Any] = []
        self.host_ms = 0.0
        self._start: Any = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((self._start, end))
        else:
            self.host_ms += (time.perf_counter() - self._start) * 1000.0
        self._start = None

    def elapsed_ms(self, reset: bool = True) -> float:
        total = self.host_ms
        for start, end in self.spans:
            end.synchronize()
            total += start.elapsed_time(end)
        if reset:
            self.host_ms, self.spans = 0.0, []
        return total


class _CsvWriter:
    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.started: set[str] = set()

    def write(self, events) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, filename + ".csv"), "a+", newline="") as handle:
                writer = csv.writer(handle)
                if filename not in self.started:
                    self.started.add(filename)
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


class _TensorBoardWriter:
    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("tensorboard.enabled is true but the tensorboard package is not "
                              "installed (pip install tensorboard)") from None
        os.makedirs(log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, events) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandbWriter:
    def __init__(self, project: str, group: str | None, team: str | None) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("wandb.enabled is true but the wandb package is not installed "
                              "(pip install wandb)") from None
        self.run = wandb.init(project=project, group=group, entity=team)

    def write(self, events) -> None:
        for name, value, step in events:
            self.run.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``: samples per second over the optimizer steps.

    Scripts call ``engine.tput_timer.update_epoch_count()`` at the end of an epoch
    (DeepSpeed-Chat does) and read ``avg_samples_per_sec()``. The meanings are DeepSpeed's:
    a span runs from a forward to the next ``step()``; the first ``start_step`` optimizer
    steps are not timed (warm-up); ``batch_size`` is the global batch (train_batch_size), so
    the rate is the whole job's; ``epoch_count`` counts the calls to ``update_epoch_count``,
    which also restarts ``micro_step_count``. Every ``steps_per_output`` optimizer steps rank
    0 prints the running and current rates, as DeepSpeed's engine logs them.

    The config's ``timers.throughput`` block: ``enabled`` false leaves the timer idle (its
    rate stays -inf); ``synchronize``, given where ``synchronized`` is true on CUDA, runs at a
    timed span's start and end, as DeepSpeed synchronizes the accelerator there.
    """

    def __init__(self, batch_size: int | None, steps_per_output: int | None, rank: int,
                 start_step: int = 2, enabled: bool = True,
                 synchronize: Callable[[], None] | None = None) -> None:
        self.enabled = enabled
        self.synchronize = synchronize
        self.batch_size = 1 if batch_size is None else batch_size
        self.steps_per_output = steps_per_output
        self.rank = rank
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.started = False
        # DeepSpeed's fields: whether start() was ever called, and the last span's end.
        self.initialized = False
        self.start_time = 0.0
        self.end_time = 0.0

    @classmethod
    def for_engine(cls, config: EngineConfig | None, rank: int,
                   device: torch.device) -> ThroughputTimer:
        """The engine's timer: the config's global batch, print interval and ``timers``
        block (an engine built without a config: DeepSpeed's defaults, never synchronized)."""
        if config is None:
            return cls(None, None, rank)
        timer = config.timers.throughput
        synchronize = torch.cuda.synchronize if timer.synchronized and device.type == "cuda" \
            else None
        return cls(config.train_batch_size, config.steps_per_print, rank,
                   enabled=timer.enabled, synchronize=synchronize)

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.synchronize is not None:
                self.synchronize()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the span: one more micro-step (and optimizer step where ``global_step``);
        ``report_speed=False`` skips the periodic print (DeepSpeed's signature)."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return  # still warming up
        if self.synchronize is not None:
            self.synchronize()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        if (report_speed and self.rank == 0 and self.steps_per_output
                and self.global_step_count % self.steps_per_output == 0):
            current = self.batch_size / max(self.step_elapsed_time, 1e-8)
            print(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                  f"global_step={self.global_step_count}, RunningAvgSamplesPerSec="
                  f"{self.avg_samples_per_sec()}, CurrSamplesPerSec={current}", flush=True)
        self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")  # DeepSpeed's answer before any step was timed
        return self.batch_size / (self.total_elapsed_time / timed_steps)


class EngineReports:
    """Built by the engine from its config; rank 0 prints and writes, other ranks time only."""

    def __init__(self, config: EngineConfig, rank: int, device: torch.device) -> None:
        self.config = config
        self.rank = rank
        self.writers: list[Any] = []
        self.timing = config.wall_clock_breakdown
        self.watches = {name: _Stopwatch(device) for name in (*MICRO_TIMERS, *STEP_TIMERS)}
        if rank != 0:
            return
        for block, writer in ((config.tensorboard, _TensorBoardWriter),
                              (config.csv_monitor, _CsvWriter)):
            if block.enabled:
                self.writers.append(writer(os.path.join(block.output_path, block.job_name)))
        if config.wandb.enabled:
            self.writers.append(_WandbWriter(config.wandb.project, config.wandb.group,
                                             config.wandb.team))
        if config.dump_state:
            print("DeepSpeedEngine configuration:", flush=True)
            for key, value in sorted(_flat(dataclasses.asdict(config)).items()):
                print(f"  {key} {'.' * max(1, 29 - len(key))} {value}", flush=True)

    # ---- timing --------------------------------------------------------------------------
    def start(self, phase: str) -> None:
        """``phase`` is "fwd", "bwd" or "step"."""
        if self.timing:
            self.watches[phase].start()
            self.watches[f"{phase}_microstep"].start()

    def stop(self, phase: str) -> None:
        if self.timing:
            self.watches[phase].stop()
            self.watches[f"{phase}_microstep"].stop()

    def _times(self, names) -> dict[str, float]:
        return {name: self.watches[name].elapsed_ms() for name in names}

    # ---- per step ------------------------------------------------------------------------
    def after_micro_step(self, engine, boundary: bool) -> None:
        """After ``engine.step()``: every micro-step, and the optimizer step at a boundary.
        Nothing while a CUDA graph captures the iteration ([Note: iteration graphs] in
        zeropp/acceleration/cuda_graph.py): these lines read the host's clock and the device's
        values, which a replay would neither update nor allow."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        if self.timing:
            micro = self._times(MICRO_TIMERS)
            if self.rank == 0:
                print(_timer_line(micro), flush=True)
        if not boundary:
            return
        totals = self._times(STEP_TIMERS) if self.timing else {}
        if self.rank != 0:
            return
        step = engine.global_steps
        groups = engine.optimizer.param_groups
        if step % self.config.steps_per_print == 0:
            # As DeepSpeed prints them: numbers, also where the lr is a device tensor.
            lr = [float(group["lr"]) for group in groups]
            mom = [tuple(group["betas"]) for group in groups]
            print(f"[Rank 0] step={step}, skipped={engine.skipped_steps}, lr={lr}, mom={mom}",
                  flush=True)
        if totals:
            print(_timer_line(totals), flush=True)
        if self.writers:
            samples = step * (self.config.train_batch_size or 0)
            events = [("Train/Samples/lr", groups[0]["lr"], samples)]
            if self.config.fp16.enabled:
                events.append(("Train/Samples/loss_scale", engine.loss_scale, samples))
            for name, label in (("fwd", "forward"), ("bwd", "backward"), ("step", "step")):
                if name in totals:
                    events.append((f"Train/Samples/elapsed_time_ms_{label}", totals[name], samples))
            for writer in self.writers:
                writer.write(events)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


def _timer_line(times: dict[str, float]) -> str:
    return "time (ms)" + "".join(f" | {name}: {ms:.2f}" for name, ms in times.items())


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "params":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
