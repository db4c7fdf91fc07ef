"""The Megatron-style pretraining loop, written against a DeepSpeed-shaped engine.

One iteration trains on one global batch: ``gradient_accumulation_steps`` micro-batches per
rank, each ``engine(tokens)`` -> ``lm_loss`` -> ``engine.backward(loss)`` -> ``engine.step()``.
The engine updates the weights at the accumulation boundary only, and reports whether the
update was applied or skipped (an fp16 overflow). Around that:

- the learning-rate schedule follows Megatron: ``step(0)`` before training, then
  ``step(n)`` after the n-th applied update, so a skipped iteration does not advance it;
- every ``--log-interval`` iterations the last rank prints one Megatron log line and hands
  the same numbers (plus communication bytes per iteration) to the ``MetricsWriter``;
- every ``--eval-interval`` iterations, and once at the end, the validation loss is measured.

Determinism across world sizes: the data loader gives rank r the r-th slice of every global
batch, so with the same seed and global batch every world size trains on the same samples,
and the logged loss (averaged over micro-batches and ranks) is the same number. Dropout
draws different masks at different world sizes; runs compared this way disable it.

This module never imports the engine package: it is handed an object with the engine's
interface (``TrainingEngine``) and uses ``torch.distributed`` only to average losses.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import resource
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from data.samplers import get_batch
from megatron_lite.checkpointing import RunControl
from megatron_lite.metrics import (
    MAX_LOSS_FOR_PERPLEXITY,
    MetricsWriter,
    Timers,
    cuda_timing_event,
    training_log_line,
)
from megatron_lite.model import GPTConfig, flops_per_token, lm_loss

if TYPE_CHECKING:  # for annotations only: the loop runs whatever schedule it is handed
    from zeropp.deepspeed_api.lr_schedules import AnnealingLR

# (logits, labels, loss_mask) -> scalar mean loss of one micro-batch.
LossFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# consumed_samples -> this rank's micro-batches of token ids, each of shape [b, s + 1].
LoaderFactory = Callable[[int], Iterable[torch.Tensor]]

_STEP_TIMERS = ["batch-generator", "forward", "backward", "optimizer"]
# With --cuda-graph forward, backward and step are one launch, timed as one.
_GRAPHED_STEP_TIMERS = ["batch-generator", "forward-backward-step"]


class TrainingEngine(Protocol):
    """What the loop needs from the engine (``zeropp.ZeroEngine`` has it)."""

    optimizer: Any
    topology: Any

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> bool: ...
    def train(self, mode: bool = True) -> Any: ...
    def eval(self) -> Any: ...
    @property
    def loss_scale(self) -> float: ...
    @property
    def last_step_overflowed(self) -> bool: ...
    def get_global_grad_norm(self) -> float | None: ...
    def step_outcome(self) -> dict[str, float | torch.Tensor | None]: ...
    def comm_bytes(self, reset: bool = True) -> dict[str, dict[str, int]]: ...


@dataclass
class TrainingSummary:
    """How a call to ``pretrain`` ended."""

    iterations: int
    consumed_samples: int
    skipped_iterations: int
    final_valid_loss: float | None
    stop_reason: str | None = None  # set when the run stopped with no time left to evaluate


@dataclass
class IntervalTotals:
    """What accumulates between two log lines."""

    iterations: int = 0
    skipped: int = 0
    # Summed on the device: reading a loss every iteration would force a sync per iteration.
    loss_sum: torch.Tensor | None = None
    skipped_loss_sum: torch.Tensor | None = None
    # Iterations the device skipped ([Note: step outcome on the device]), until `resolve`.
    skipped_on_device: torch.Tensor | None = None
    comm_bytes: dict[str, dict[str, int]] = field(default_factory=dict)

    def add_iteration(self, loss: torch.Tensor, applied: bool | torch.Tensor) -> None:
        self.iterations += 1
        if isinstance(applied, torch.Tensor):  # decided on the device: sum both ways there
            self._add_on_device(loss, applied)
            return
        if not applied:
            # Left out of the average of applied iterations, as in Megatron; logged only when
            # every iteration of the interval was skipped (an fp16 overflow is in the scaled
            # gradients: the unscaled loss itself is usually finite and worth seeing).
            self.skipped += 1
            self.skipped_loss_sum = loss if self.skipped_loss_sum is None \
                else self.skipped_loss_sum + loss
            return
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss

    def _add_on_device(self, loss: torch.Tensor, applied: torch.Tensor) -> None:
        zero = torch.zeros_like(loss)
        kept, dropped = torch.where(applied, loss, zero), torch.where(applied, zero, loss)
        skipped = (~applied).to(torch.int64)
        self.loss_sum = kept if self.loss_sum is None else self.loss_sum + kept
        self.skipped_loss_sum = (dropped if self.skipped_loss_sum is None
                                 else self.skipped_loss_sum + dropped)
        self.skipped_on_device = (skipped if self.skipped_on_device is None
                                  else self.skipped_on_device + skipped)

    def resolve(self, read: float | None = None) -> int:
        """Take the device's count of skipped iterations into ``skipped`` (at the log
        interval or a save); ``read``: that count already read back with other values
        (``read_back``), else it is read here. Returns the count (0 where the host decided
        every skip)."""
        if self.skipped_on_device is None:
            return 0
        read = int(self.skipped_on_device if read is None else read)
        self.skipped += read
        self.skipped_on_device = None
        if self.skipped == 0:
            self.skipped_loss_sum = None
        elif self.skipped == self.iterations:
            self.loss_sum = None
        return read

    def local_mean_loss(self) -> torch.Tensor | None:
        """This rank's logged loss: the mean over applied iterations, or over the skipped
        ones when every iteration was skipped (still on the device, also where the device
        counted the skips and nothing is read yet)."""
        if self.skipped_on_device is not None:
            skipped = self.skipped_on_device + self.skipped
            applied = self.iterations - skipped
            return torch.where(applied > 0, self.loss_sum / applied.clamp(min=1),
                               self.skipped_loss_sum / skipped.clamp(min=1))
        if self.loss_sum is not None:
            return self.loss_sum / (self.iterations - self.skipped)
        if self.skipped_loss_sum is not None:
            return self.skipped_loss_sum / self.skipped
        return None

    def add_comm_bytes(self, snapshot: dict[str, dict[str, int]]) -> None:
        for phase, by_locality in snapshot.items():
            totals = self.comm_bytes.setdefault(phase, {})
            for locality, nbytes in by_locality.items():
                totals[locality] = totals.get(locality, 0) + int(nbytes)


@contextlib.contextmanager
def manual_garbage_collection(enabled: bool) -> Iterator[None]:
    """[Note: manual garbage collection] Megatron's ``--manual-gc``: Python's collector stops
    running on its own for the training loop, and collects only where the loop says
    (``--manual-gc-interval`` iterations, around evaluations unless ``--no-manual-gc-eval``).
    On its own it runs whenever enough objects were allocated since the last pass: inside
    whatever the host is issuing (a unit's gather, a reduction), at different moments on
    different ranks, and every rank then waits for the slowest at the next collective.
    (On one CPU rank, ``scripts.bench.host_ops --python-time``'s probe, its share of the
    engine's Python time was within the run-to-run noise.) One collection at the start; the
    collector's state is restored at the end."""
    if not enabled:
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def perplexity(loss: float) -> float:
    """exp(loss), clamped as Megatron does so a diverged loss prints a number, not inf."""
    return math.exp(min(loss, MAX_LOSS_FOR_PERPLEXITY))


def max_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory on CUDA, else this process's peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kibibytes, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def mean_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """The average of a scalar tensor over all ranks (the value itself without a group),
    left on the device."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / dist.get_world_size()
    return value.detach()


def read_back(values: dict[str, float | torch.Tensor | None]) -> dict[str, float | None]:
    """``values`` as host numbers, every device scalar among them read in one transfer: one
    wait for the GPU per log line, however many values it shows."""
    held = {name: value for name, value in values.items() if isinstance(value, torch.Tensor)}
    read: dict[str, float | None] = {name: None if value is None else float(value)
                                     for name, value in values.items() if name not in held}
    if held:
        stacked = torch.stack([value.detach().reshape(()).to(torch.float64)
                               for value in held.values()])
        read.update(zip(held, stacked.tolist(), strict=True))
    return read


@dataclass(frozen=True)
class LoopConfig:
    """What the training loop reads: resolved and validated values of the command line
    (``megatron_lite.arguments.validate_args``), taken by ``from_args``."""

    train_iters: int
    global_batch_size: int  # samples per iteration, all ranks
    gradient_accumulation_steps: int  # micro-batches per iteration on each rank
    seq_length: int
    log_interval: int
    eval_iters: int  # global batches per evaluation
    eval_interval: int | None = None  # iterations between evaluations; None: only at the end
    exit_interval: int | None = None  # stop after a multiple of this many iterations
    checkpoint_activations: bool = False  # counted in the FLOPs per token
    fp16: bool = False  # the log line shows the loss scale
    # Megatron's --manual-gc: [Note: manual garbage collection]
    manual_gc: bool = False
    manual_gc_interval: int = 0  # iterations between collections; 0: none while training
    manual_gc_eval: bool = True  # collect before and after each evaluation

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoopConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


class Trainer:
    """Runs the training iterations and evaluations of one ``pretrain`` call.

    ``config`` holds the batch sizes, iteration counts and intervals (``LoopConfig``). ``train_loader_factory`` and ``valid_loader_factory`` build this
    rank's loaders from a consumed-sample count; validation always restarts at sample 0, so
    every evaluation scores the same ``--eval-iters`` global batches and the numbers compare.
    """

    def __init__(
        self,
        config: LoopConfig,
        engine: TrainingEngine,
        lr_scheduler: AnnealingLR,
        model_config: GPTConfig,
        train_loader_factory: LoaderFactory,
        valid_loader_factory: LoaderFactory | None,
        metrics_writer: MetricsWriter,
        device: torch.device,
        loss_fn: LossFunction = lm_loss,
        run_control: RunControl | None = None,
    ) -> None:
        self.config = config
        self.run_control = run_control
        # [Note: hang watchdog]: marks at step boundaries, the straggler report at the log.
        self.watchdog = run_control.watchdog if run_control is not None else None
        self.engine = engine
        self.lr_scheduler = lr_scheduler
        self.train_loader_factory = train_loader_factory
        self.valid_loader_factory = valid_loader_factory
        self.metrics_writer = metrics_writer
        self.device = device
        self.loss_fn = loss_fn
        self.vocab_size = model_config.vocab_size
        self.flops_per_token = flops_per_token(model_config, config.seq_length,
                                               config.checkpoint_activations)
        self.world_size = engine.topology.world_size
        # Megatron prints from the last rank: with pipelining it is the one that has the loss.
        self.is_logging_rank = engine.topology.rank == self.world_size - 1
        self.timers = Timers(cuda_timing_event if device.type == "cuda" else None)
        self.iteration = 0
        self.consumed_samples = 0
        self.applied_updates = 0
        self.skipped_iterations = 0
        # Where the device decides whether a step applies ([Note: step outcome on the device]
        # in zeropp/engine.py): applied updates counted there since the last read-back, from
        # which the schedule takes its position; ``applied_updates`` counts every iteration
        # as applied until ``_read_back_device_counts`` subtracts the skips.
        self._applied_on_device: torch.Tensor | None = None
        self.last_evaluation: tuple[int, float] | None = None
        self._interval = IntervalTotals()
        # The iteration captured as one CUDA graph where the engine's config asks for it and
        # it can be (the engine's ``iteration_runner`` says why not otherwise); None: eager.
        self._graphed_iteration = None
        runner = getattr(engine, "iteration_runner", None)
        if runner is not None:
            model_blockers = []
            if model_config.uses_dropout and (model_config.checkpoint_activations
                                              or model_config.recompute_attention):
                model_blockers.append("dropout under activation recomputation replays the "
                                      "random state, which a capture cannot read (set "
                                      "--hidden-dropout 0 --attention-dropout 0)")
            self._graphed_iteration = runner(self._device_iteration, log=self.log,
                                             extra_blockers=model_blockers)

    # ---- training ------------------------------------------------------------------------

    def train(self) -> None:
        """Iterate until ``--train-iters`` (or the ``--exit-interval`` stop)."""
        config = self.config
        if self.run_control is not None:
            self.run_control.resume(self)
        batches = iter(self.train_loader_factory(self.consumed_samples))
        self.lr_scheduler.step(self.applied_updates)
        self.engine.train()
        self.engine.comm_bytes(reset=True)  # materializing the model is not training traffic
        self.timers("interval-time").start()
        with manual_garbage_collection(config.manual_gc):
            self._train_iterations(batches)
        if self._interval.iterations:
            self._log_interval()
        self.timers("interval-time").stop()
        if self.run_control is not None:
            self.run_control.save_at_end(self)

    def _train_iterations(self, batches: Iterator) -> None:
        config = self.config
        while self.iteration < config.train_iters:
            if self.watchdog is not None:
                self.watchdog.step_started(self.iteration + 1)
            loss, applied = self.train_step(batches)
            if self.watchdog is not None:
                self.watchdog.step_finished(self.iteration)
            self._interval.add_iteration(loss, applied)
            if self.iteration % config.log_interval == 0:
                self._log_interval()
            if config.eval_interval and self.iteration % config.eval_interval == 0:
                # As in Megatron, evaluation time is not training time.
                self.timers("interval-time").stop()
                self.evaluate_validation()
                self.timers("interval-time").start()
            if self.run_control is not None:
                self.run_control.maybe_save(self)
                if self.run_control.should_stop(self, loss, applied):
                    break
            if config.exit_interval and self.iteration % config.exit_interval == 0:
                self.log(f"exiting after iteration {self.iteration} (--exit-interval "
                            f"{config.exit_interval})")
                break
            if (config.manual_gc and config.manual_gc_interval
                    and self.iteration % config.manual_gc_interval == 0):
                gc.collect()

    def train_step(self, batches: Iterator[torch.Tensor]) -> tuple[torch.Tensor,
                                                                   bool | torch.Tensor]:
        """One global batch; returns this rank's mean micro-batch loss and whether the
        engine applied the update (a device flag where the device decided)."""
        if self._graphed_iteration is not None:
            return self._graphed_train_step(batches)
        micro_losses = []
        for _ in range(self.config.gradient_accumulation_steps):
            self.timers("batch-generator").start()
            tokens, labels, loss_mask = self._next_micro_batch(batches, "training")
            self.timers("batch-generator").stop()
            self.timers("forward").start()
            loss = self.loss_fn(self.engine(tokens), labels, loss_mask)
            self.timers("forward").stop()
            self.timers("backward").start()
            self.engine.backward(loss)
            self.timers("backward").stop()
            self.timers("optimizer").start()
            self.engine.step()
            self.timers("optimizer").stop()
            micro_losses.append(loss.detach())
        return self._count_iteration(torch.stack(micro_losses).mean())

    def _device_iteration(self, *texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One global batch from its micro-batches' token ids already on the device, with no
        host read and no timer: what ``--cuda-graph`` captures. Returns (mean micro-batch
        loss, the device's applied flag)."""
        micro_losses = []
        for text in texts:
            tokens, labels, loss_mask, _ = get_batch(text)
            loss = self.loss_fn(self.engine(tokens), labels, loss_mask)
            self.engine.backward(loss)
            self.engine.step()
            micro_losses.append(loss.detach())
        return torch.stack(micro_losses).mean(), self.engine.step_applied_flag()

    def _graphed_train_step(self, batches: Iterator[torch.Tensor]) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
        # Only the batch generator is timed: forward, backward and step are one launch.
        self.timers("batch-generator").start()
        texts = [self._next_micro_text(batches, "training")
                 for _ in range(self.config.gradient_accumulation_steps)]
        self.timers("batch-generator").stop()
        self.timers("forward-backward-step").start()
        loss, _ = self._graphed_iteration(*texts)
        self.timers("forward-backward-step").stop()
        return self._count_iteration(loss)

    def _count_iteration(self, loss: torch.Tensor) -> tuple[torch.Tensor, bool | torch.Tensor]:
        """The loop's records after an iteration's micro-batches: returns (loss, applied)."""
        self.iteration += 1
        self.consumed_samples += self.config.global_batch_size
        if getattr(self.engine, "defers_step_outcome", False):
            # The device decided whether to skip ([Note: step outcome on the device]): the
            # flag stays there, the interval counts skips at the log, and the schedule moves
            # with the device's count of applied updates, as it moves with the host's below.
            applied = self.engine.step_applied_flag()
            if self._applied_on_device is None:
                self._applied_on_device = torch.tensor(self.applied_updates, device=applied.device)
            self._applied_on_device = self._applied_on_device + applied
            self.applied_updates += 1
            self.lr_scheduler.step_on_device(self._applied_on_device)
            return loss, applied
        applied = not self.engine.last_step_overflowed
        if applied:
            self.applied_updates += 1
            self.lr_scheduler.step(self.applied_updates)
        else:
            self.skipped_iterations += 1
        return loss, applied

    def _next_micro_batch(self, batches: Iterator[torch.Tensor],
                          split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, labels, loss_mask, _ = get_batch(self._next_micro_text(batches, split))
        return tokens, labels, loss_mask

    def _next_micro_text(self, batches: Iterator[torch.Tensor], split: str) -> torch.Tensor:
        """The next micro-batch's token ids [b, s + 1], checked, on the device."""
        try:
            text = next(batches)
        except StopIteration:
            raise RuntimeError(
                f"the {split} data ran out at iteration {self.iteration}: its dataset must "
                f"hold iterations x --global-batch-size {self.config.global_batch_size} samples"
            ) from None
        largest = int(text.max())
        if largest >= self.vocab_size:  # would index past the embedding table
            raise ValueError(
                f"the {split} data holds token id {largest}, but the tokenizer's vocabulary "
                f"has {self.vocab_size} ids: the data was tokenized with another tokenizer"
            )
        return text.to(self.device, non_blocking=True)

    # ---- evaluation ----------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, loader_factory: LoaderFactory) -> float:
        """Mean loss over ``--eval-iters`` global batches (the same ones on every call)."""
        steps = self.config.eval_iters * self.config.gradient_accumulation_steps
        if steps == 0:
            raise ValueError("--eval-iters is 0: there is nothing to evaluate on")
        batches = iter(loader_factory(0))
        total = torch.zeros((), device=self.device)
        self.engine.eval()
        try:
            for _ in range(steps):
                tokens, labels, loss_mask = self._next_micro_batch(batches, "evaluation")
                total += self.loss_fn(self.engine(tokens), labels, loss_mask).float()
                if self.watchdog is not None:  # progress where no collective may show it
                    self.watchdog.progress()
        finally:
            self.engine.train()
        return float(mean_across_ranks(total / steps))

    def evaluate_validation(self) -> float | None:
        """Validation loss at the current iteration, printed and logged; None without data."""
        if self.valid_loader_factory is None or self.config.eval_iters == 0:
            return None
        if self.last_evaluation is not None and self.last_evaluation[0] == self.iteration:
            return self.last_evaluation[1]
        # Evaluation gathers weights too; keep its traffic out of the per-iteration figures.
        self._interval.add_comm_bytes(self.engine.comm_bytes(reset=True))
        collect = self.config.manual_gc and self.config.manual_gc_eval
        if collect:
            gc.collect()
        loss = self.evaluate(self.valid_loader_factory)
        if collect:
            gc.collect()
        self.engine.comm_bytes(reset=True)
        self.last_evaluation = (self.iteration, loss)
        self.print_evaluation(f"validation loss at iteration {self.iteration}", loss)
        self.metrics_writer.log_eval(self.iteration, loss)
        return loss

    def print_evaluation(self, title: str, loss: float) -> None:
        """Megatron's boxed evaluation line, printed by the logging rank."""
        line = f" {title} | lm loss value: {loss:.6E} | lm loss PPL: {perplexity(loss):.6E} |"
        rule = "-" * len(line)
        self.log(f"{rule}\n{line}\n{rule}")

    # ---- logging -------------------------------------------------------------------------

    def _log_interval(self) -> None:
        interval = self._interval
        self._interval = IntervalTotals()
        interval.add_comm_bytes(self.engine.comm_bytes(reset=True))
        iterations = interval.iterations
        # Overflows are agreed across ranks, so every rank makes the same choice here and
        # the all-reduce is entered by all of them or by none.
        local_mean = interval.local_mean_loss()
        # What the line shows, read back at once: the loss, and where the device decided the
        # steps ([Note: step outcome on the device]) the skips, gradient norm, loss scale
        # and non-finite streak.
        read = read_back({
            "loss": None if local_mean is None else mean_across_ranks(local_mean),
            "skipped": interval.skipped_on_device,
            "streak": None if self.run_control is None else self.run_control.device_streak,
            **self.engine.step_outcome(),
        })
        # Skips the device decided are counted here; the host's, in train_step.
        self._read_back_device_counts(interval, read["skipped"])
        if self.run_control is not None and read["streak"] is not None:
            self.run_control.check_nonfinite_streak(self, int(read["streak"]))
        mean_loss = math.nan if read["loss"] is None else read["loss"]
        seconds = self.timers("interval-time").elapsed(reset=True)
        step_times = self.timers.log_string(
            _STEP_TIMERS if self._graphed_iteration is None else _GRAPHED_STEP_TIMERS,
            normalizer=iterations)
        metrics = self._interval_metrics(interval, mean_loss, seconds, read)
        stragglers = self.watchdog.stragglers(self.device) if self.watchdog is not None else None
        metrics.update(stragglers or {})
        if self.is_logging_rank:
            print(self._log_line(metrics), flush=True)
            print(step_times, flush=True)
        self.metrics_writer.log_train(self.iteration, metrics)

    def _interval_metrics(self, interval: IntervalTotals, mean_loss: float, seconds: float,
                          read: dict[str, float | None]) -> dict[str, Any]:
        config = self.config
        iterations = interval.iterations
        samples_per_sec = config.global_batch_size * iterations / max(seconds, 1e-9)
        tokens_per_sec_per_gpu = samples_per_sec * config.seq_length / self.world_size
        comm_per_iteration = {
            phase: {locality: round(nbytes / iterations) for locality, nbytes in by_loc.items()}
            for phase, by_loc in interval.comm_bytes.items()
        }
        inter_node = sum(by_loc.get("inter_node", 0) for by_loc in comm_per_iteration.values())
        return {
            "lm_loss": mean_loss,
            "grad_norm": read["grad_norm"],
            "loss_scale": read["loss_scale"],
            "lr": self._last_update_lr,
            "elapsed_ms_per_iteration": seconds * 1000.0 / iterations,
            "tokens_per_sec": tokens_per_sec_per_gpu,
            "tflops_per_gpu": tokens_per_sec_per_gpu * self.flops_per_token / 1e12,
            "skipped_iterations": interval.skipped,
            "max_memory_bytes": max_memory_bytes(self.device),
            "samples_per_sec": samples_per_sec,
            "consumed_samples": self.consumed_samples,
            "consumed_tokens": self.consumed_samples * config.seq_length,
            "global_batch_size": config.global_batch_size,
            "comm_bytes": comm_per_iteration,
            "comm_inter_node_mb_per_iteration": inter_node / 1e6,
        }

    @property
    def _last_update_lr(self) -> float:
        # The lr of the last update, i.e. the schedule before that update advanced it.
        return self.lr_scheduler.get_lr(max(self.applied_updates - 1, 0))

    def _log_line(self, metrics: dict[str, Any]) -> str:
        config = self.config
        return training_log_line(
            iteration=self.iteration,
            train_iters=config.train_iters,
            consumed_samples=metrics["consumed_samples"],
            consumed_tokens=metrics["consumed_tokens"],
            elapsed_ms=metrics["elapsed_ms_per_iteration"],
            lr=metrics["lr"],
            global_batch_size=config.global_batch_size,
            lm_loss=metrics["lm_loss"],
            loss_scale=metrics["loss_scale"] if config.fp16 else None,
            grad_norm=metrics["grad_norm"],
            skipped_iterations=metrics["skipped_iterations"],
            samples_per_sec=metrics["samples_per_sec"],
            tokens_per_sec_per_gpu=metrics["tokens_per_sec"],
            tflops_per_gpu=metrics["tflops_per_gpu"],
            extra={"comm inter-node MB/iter": round(
                metrics["comm_inter_node_mb_per_iteration"], 3), **slowest_rank(metrics)},
        )

    def log(self, text: str) -> None:
        """Print on the logging rank (Megatron's last rank)."""
        if self.is_logging_rank:
            print(text, flush=True)

    # ---- progress, for checkpoints -------------------------------------------------------
    PROGRESS_KEYS = ("iteration", "consumed_samples", "applied_updates", "skipped_iterations")

    def state_dict(self) -> dict[str, int]:
        """Where the run stands: what a checkpoint must restore for the data and the lr
        schedule to continue exactly where they stopped."""
        self._read_back_device_counts(self._interval)
        return {key: getattr(self, key) for key in self.PROGRESS_KEYS}

    def _read_back_device_counts(self, interval: IntervalTotals,
                                 read: float | None = None) -> None:
        """Make the host's counts exact where the device decided the skips (at a log line or
        a checkpoint: the only reads such a run makes): the skipped iterations come off the
        applied updates, and the schedule's position and lrs are the host's again. ``read``:
        the interval's device count, if already read back."""
        skipped = interval.resolve(read)
        self.skipped_iterations += skipped
        if self._applied_on_device is not None:
            self.applied_updates -= skipped
            self._applied_on_device = None
            self.lr_scheduler.step(self.applied_updates)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in self.PROGRESS_KEYS:
            setattr(self, key, int(state[key]))


def slowest_rank(metrics: dict[str, Any]) -> dict[str, str]:
    """The straggler report's field of the log line (``Watchdog.stragglers``), if any."""
    if "straggler_rank" not in metrics:
        return {}
    slowest, median = metrics["straggler_ms_per_iteration"], metrics["median_rank_ms_per_iteration"]
    return {"slowest rank": f"{metrics['straggler_rank']} ({slowest:.1f} ms/iter, "
                            f"{slowest / max(median, 1e-9):.2f}x median)"}


def pretrain(
    config: LoopConfig,
    engine: TrainingEngine,
    lr_scheduler: AnnealingLR,
    model_config: GPTConfig,
    train_loader_factory: LoaderFactory,
    valid_loader_factory: LoaderFactory | None,
    metrics_writer: MetricsWriter,
    device: torch.device,
    loss_fn: LossFunction = lm_loss,
    run_control: RunControl | None = None,
) -> TrainingSummary:
    """Train, then measure the validation loss (reused when the last iteration just did).

    An ``--exit-interval`` stop still gets the final evaluation: the stop is planned, and
    the number tells where the run stands. An ``--exit-duration-in-mins`` stop does not, as
    in Megatron: the time is up.
    """
    trainer = Trainer(config, engine, lr_scheduler, model_config, train_loader_factory,
                      valid_loader_factory, metrics_writer, device, loss_fn, run_control)
    watching = run_control.watching() if run_control is not None else contextlib.nullcontext()
    with watching:
        trainer.train()
        out_of_time = run_control.out_of_time if run_control is not None else None
        return TrainingSummary(
            iterations=trainer.iteration,
            consumed_samples=trainer.consumed_samples,
            skipped_iterations=trainer.skipped_iterations,
            final_valid_loss=None if out_of_time else trainer.evaluate_validation(),
            stop_reason=out_of_time,
        )
