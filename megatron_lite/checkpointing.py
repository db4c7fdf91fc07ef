"""Saving and resuming a training run: the application's side of a checkpoint.

The engine writes its shards (``engine.save_checkpoint``: weights, optimizer state, loss
scaler, RNG states, atomically, with a ``latest`` file); this module adds what the loop
needs to continue exactly where it stopped: iteration, consumed samples, applied updates,
skipped iterations, the lr schedule, the model shape and the arguments of the run. Tags are
Megatron's ``iter_0000100``.

It also owns the run's stop conditions that involve every rank: SIGTERM from a scheduler
(``--exit-signal-handler``), a time budget (``--exit-duration-in-mins``) and a loss that
stays non-finite (``--exit-on-nan``). They are agreed with one small all-reduce per
iteration (MAX of the flags, as Megatron does), so all ranks stop at the same boundary.
A hung rank is the watchdog's ([Note: hang watchdog] in megatron_lite/watchdog.py): the run
control holds it, runs it while training (``watching``) and gives checkpoint saves and loads
their own budget.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_lite.watchdog import Watchdog, WatchdogConfig
from zeropp.checkpoints.checkpoint import CheckpointError, CheckpointStorageError, client_state


class SaveFailed(RuntimeError):
    """A checkpoint save failed and ``--save-error stop`` asks the run to end."""


def checkpoint_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def plain_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments as JSON-like values (checkpoints are loaded with weights_only=True)."""
    plain = {}
    for key, value in vars(args).items():
        if isinstance(value, bool | int | float | str) or value is None:
            plain[key] = value
        elif isinstance(value, list | tuple) and all(
            isinstance(v, bool | int | float | str) for v in value
        ):
            plain[key] = list(value)
    return plain


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving, resuming and stopping, as the command line resolved them (``from_args``)."""

    save: str | None = None  # directory to save to
    load: str | None = None  # directory to resume from
    save_interval: int | None = None  # iterations between saves
    save_error: str = "stop"  # "stop" or "continue" past a storage failure
    async_save: bool = False  # write checkpoints in the background while training goes on
    no_load_optim: bool = False  # resume the weights only
    no_load_fallback: bool = False  # a latest checkpoint that fails verification stops the run
    no_load_rng: bool = False  # keep this run's random streams on resume
    exit_signal_handler: bool = False  # save and stop on SIGTERM
    exit_on_nan: int = 0  # stop after this many consecutive non-finite losses; 0 = never
    exit_duration_in_mins: float | None = None  # save and stop once training ran this long

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CheckpointConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


class RunControl:
    """Checkpoint cadence, resume, and the collective stop decisions of the training loop.

    ``run_arguments`` (the command line as plain values) is stored in every checkpoint, as
    Megatron stores its arguments, so a checkpoint tells how it was made.
    """

    def __init__(self, config: CheckpointConfig, engine, lr_scheduler, model_config,
                 run_arguments: dict[str, Any] | None = None) -> None:
        self.config = config
        self.run_arguments = run_arguments or {}
        self.engine = engine
        self.lr_scheduler = lr_scheduler
        self.model_config = model_config
        self.last_saved_iteration: int | None = None
        self._saving_iteration: int | None = None  # an asynchronous save not yet published
        self.nonfinite_streak = 0
        self._device_streak: torch.Tensor | None = None  # where the device decides skips
        self._signal_received = False
        # The clock of --exit-duration-in-mins starts here, once the model and engine are set
        # up and before the checkpoint is loaded.
        self.started = time.monotonic()
        self.out_of_time: str | None = None  # why the run stopped with no time to evaluate
        if config.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        # The arguments of the program carry the watchdog's flags; a run control built by
        # hand without them runs none.
        watchdog_config = WatchdogConfig.from_arguments(self.run_arguments)
        self.watchdog = Watchdog(watchdog_config) if watchdog_config is not None else None

    @contextlib.contextmanager
    def watching(self):
        """The watchdog runs while training does ([Note: hang watchdog])."""
        if self.watchdog is None:
            yield
            return
        self.watchdog.start()
        try:
            yield
        finally:
            self.watchdog.stop()

    def _budgeted(self, name: str):
        """A checkpoint save or load: the watchdog's longer budget while it runs."""
        return self.watchdog.section(name) if self.watchdog is not None \
            else contextlib.nullcontext()

    def _on_sigterm(self, signum, frame) -> None:
        # Only a flag: saving happens at the next iteration boundary, on every rank at once.
        self._signal_received = True

    # ---- resume --------------------------------------------------------------------------
    def resume(self, trainer) -> None:
        """Load ``--load`` into the engine and the trainer's counters (no-op without it)."""
        if not self.config.load:
            return
        if self._first_run_of_a_restartable_job():
            trainer.log(f"no checkpoint in {self.config.load} yet: starting from scratch "
                           f"(--load {self.config.load} is also --save)")
            return
        # Before the load, on every rank alike: a model of another architecture would fail in
        # it on some tensor's shape, on some ranks only, while the others wait in a gather.
        # The client state is memory-mapped, so this reads no weights.
        # Every file of the checkpoint is verified first; a latest one that fails falls back
        # to the newest that verifies ([Note: checkpoint checksums]), unless refused.
        with self._budgeted("load"):
            self._resume(trainer)

    def _resume(self, trainer) -> None:
        tag = self.engine.checkpoint_to_load(
            self.config.load, fallback=not self.config.no_load_fallback, log=trainer.log)
        try:
            saved = client_state(self.config.load, tag)
        except (CheckpointError, OSError, RuntimeError, KeyError):
            saved = None  # no readable checkpoint there: the load below says why
        if saved is not None:
            self._check_architecture(self.config.load, saved)
        # A checkpoint made by megatron_lite.import_hf holds Hugging Face weights and only
        # placeholder optimizer state: the run's own optimizer flags and schedule apply.
        imported = bool(saved and saved.get("imported_from_hf"))
        weights_only = self.config.no_load_optim or imported
        path, client = self.engine.load_checkpoint(
            self.config.load, tag=tag, load_optimizer_states=not weights_only
        )
        trainer.load_state_dict(client)
        if not self.config.no_load_rng:  # as Megatron: the run's random streams continue
            from zeropp.checkpoints.checkpoint import restore_rng_state

            restore_rng_state(getattr(self.engine, "loaded_rng_state", None))
        if not weights_only and client.get("lr_scheduler"):
            self.lr_scheduler.load_state_dict(client["lr_scheduler"], strict=False)
        if imported:
            trainer.log(f"{path} was imported from {saved['imported_from_hf']}: its weights "
                        "are loaded, the optimizer starts fresh with this run's settings")
        self.last_saved_iteration = trainer.iteration
        trainer.log(f"resumed from {path} at iteration {trainer.iteration} "
                       f"({trainer.consumed_samples} consumed samples)")

    def _check_architecture(self, path: str, client: dict[str, Any]) -> None:
        """One line naming every architecture field (``GPTConfig.architecture_differences``)
        where the checkpoint's model is not this run's."""
        saved_model = client.get("model_config") or {}
        # Fields the checkpoint predates read as their defaults; one without any model
        # config (this program always writes it) is not compared.
        differences = self.model_config.architecture_differences(saved_model) \
            if saved_model else []
        if differences:
            raise ValueError(f"checkpoint {path} was written for another model: "
                             f"{'; '.join(differences)}")

    def _first_run_of_a_restartable_job(self) -> bool:
        """``--save X --load X`` (Megatron's habit for jobs that may be restarted) with nothing
        saved in X yet. A ``--load`` elsewhere that holds no checkpoint stays an error: that
        is a wrong path, not a first run; so is a ``latest`` naming a missing checkpoint."""
        load = Path(self.config.load)
        if not self.config.save or load.resolve() != Path(self.config.save).resolve():
            return False
        if not load.exists():
            return True
        return load.is_dir() and not (load / "latest").exists() and not any(
            child.is_dir() for child in load.iterdir())

    # ---- save ----------------------------------------------------------------------------
    def save(self, trainer) -> None:
        """Save now (or, with ``--async-save``, start saving); on failure stop or continue
        as ``--save-error`` says."""
        self.finish_save(trainer)
        client = {
            **trainer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "model_config": dataclasses.asdict(self.model_config),
            "args": self.run_arguments,
        }
        asynchronous = self.config.async_save
        try:
            # Without --async-save, called as DeepSpeed's engine takes it (no such keyword).
            with self._budgeted("save"):
                path = self.engine.save_checkpoint(
                    self.config.save, tag=checkpoint_tag(trainer.iteration),
                    client_state=client, **({"async_save": True} if asynchronous else {}))
        except CheckpointError as error:  # raised on every rank alike
            self._failed(trainer, trainer.iteration, error)
            return
        if asynchronous:
            self._saving_iteration = trainer.iteration
            trainer.log(f"saving checkpoint {path} at iteration {trainer.iteration} in the "
                        "background")
            return
        self.last_saved_iteration = trainer.iteration
        trainer.log(f"saved checkpoint {path} at iteration {trainer.iteration}")

    def finish_save(self, trainer, wait: bool = True) -> None:
        """Publish the asynchronous save in flight, if any; ``wait=False`` (each iteration
        boundary) only when every rank's writer is done ([Note: asynchronous checkpoint
        saves]). A failed writer is handled here as a failed synchronous save is."""
        iteration = self._saving_iteration
        if iteration is None:
            return
        try:
            with self._budgeted("save") if wait else contextlib.nullcontext():
                path = self.engine.finish_checkpoint(wait=wait)
        except CheckpointError as error:  # raised on every rank alike
            self._saving_iteration = None
            self._failed(trainer, iteration, error)
            return
        if path is None:
            return
        self._saving_iteration = None
        self.last_saved_iteration = iteration
        trainer.log(f"saved checkpoint {path} at iteration {iteration} (written in the "
                    f"background; now at iteration {trainer.iteration})")

    def _failed(self, trainer, iteration: int, error: CheckpointError) -> None:
        # Only storage may fail and leave the run sound; any other error (NCCL, CUDA, a
        # bug) ends the run whatever --save-error says.
        if self.config.save_error == "stop" or not isinstance(error, CheckpointStorageError):
            raise SaveFailed(f"checkpoint save at iteration {iteration} failed: "
                             f"{error}") from error
        trainer.log(f"warning: checkpoint save at iteration {iteration} failed "
                    f"({error}); the previous checkpoint stays valid; continuing")

    def maybe_save(self, trainer) -> None:
        self.finish_save(trainer, wait=False)
        interval = self.config.save_interval
        if self.config.save and interval and trainer.iteration % interval == 0:
            self.save(trainer)

    def save_at_end(self, trainer) -> None:
        """The last save, and the end of one in flight: the run ends with it published."""
        self.finish_save(trainer)
        if self.config.save and self.last_saved_iteration != trainer.iteration:
            self.save(trainer)
            self.finish_save(trainer)

    # ---- stop conditions -----------------------------------------------------------------
    @property
    def device_streak(self) -> torch.Tensor | None:
        """The streak of skipped iterations with a non-finite loss, kept on the device where
        the device decides skips (None otherwise): the training loop reads it at the log."""
        return self._device_streak

    def check_nonfinite_streak(self, trainer, streak: int) -> None:
        """A streak of skipped iterations with a non-finite loss (the device-kept one read
        back at the log, or the host's) against ``--exit-on-nan``; the same on every rank,
        as skips are agreed."""
        limit = self.config.exit_on_nan
        if limit and streak >= limit:
            raise FloatingPointError(
                f"the loss was not finite for {streak} consecutive iterations "
                f"(up to iteration {trainer.iteration}); stopping (--exit-on-nan {limit})"
            )

    def _agreement_due(self, trainer) -> bool:
        """Whether the stop flags cross ranks after this iteration.

        The agreement is an all-reduce whose answer the host reads: a sync that drains the
        device's queue. So it is made only where the host reads anyway (a log iteration, a
        save, the last iteration, ``--exit-interval``); a SIGTERM or a spent time budget is
        acted on there, at most ``--log-interval`` iterations later, on every rank at once.
        """
        config, iteration = trainer.config, trainer.iteration
        every = [config.log_interval, self.config.save_interval if self.config.save else None,
                 config.exit_interval]
        return iteration >= config.train_iters or any(
            interval and iteration % interval == 0 for interval in every)

    def should_stop(self, trainer, loss: torch.Tensor, applied: bool | torch.Tensor) -> bool:
        """Agree across ranks on SIGTERM, on the time budget and on a loss that stays
        non-finite.

        Reading the loss is a host sync, so it is read only when the update was skipped:
        a non-finite loss gives a non-finite gradient norm, which every rank's engine
        agrees to skip. The flags cross ranks only when there is something to agree on, and
        then only at iterations where the host reads anyway (``_agreement_due``).
        Where the device decided the skip (``applied`` a device flag), the streak of
        non-finite losses is kept on the device and read at the log interval
        (`check_nonfinite_streak`).
        """
        if isinstance(applied, torch.Tensor):
            if self.config.exit_on_nan:
                bad = ~applied & ~torch.isfinite(loss.detach().float())
                streak = self._device_streak if self._device_streak is not None else \
                    torch.zeros((), dtype=torch.int64, device=loss.device)
                self._device_streak = torch.where(bad, streak + 1, torch.zeros_like(streak))
            applied = True  # for the host's checks below: nothing read here
        check_loss = bool(self.config.exit_on_nan) and not applied
        limit_minutes = self.config.exit_duration_in_mins
        if not (self.config.exit_signal_handler or check_loss or limit_minutes):
            self.nonfinite_streak = 0
            return False
        if not check_loss and not self._agreement_due(trainer):
            return False
        nonfinite = (~torch.isfinite(loss.detach().float())).float() if check_loss \
            else torch.zeros((), device=loss.device)
        minutes = (time.monotonic() - self.started) / 60.0
        # Each rank reads its own clock; MAX makes the first rank past the budget decide.
        late = bool(limit_minutes) and minutes > limit_minutes
        flags = torch.stack([torch.tensor(float(self._signal_received), device=loss.device),
                             nonfinite.to(loss.device),
                             torch.tensor(float(late), device=loss.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, nonfinite, late = flags.tolist()
        self.nonfinite_streak = self.nonfinite_streak + 1 if nonfinite else 0
        self.check_nonfinite_streak(trainer, self.nonfinite_streak)
        if signalled:
            trainer.log(f"SIGTERM received: saving at iteration {trainer.iteration} and "
                           "exiting")
            if self.config.save:
                self.save(trainer)
            else:
                print("warning: no --save directory; exiting without a checkpoint",
                      file=sys.stderr, flush=True)
            return True
        if late:
            self.out_of_time = f"stopped by --exit-duration-in-mins {limit_minutes:g}"
            where = "saving and exiting" if self.config.save else "exiting (no --save)"
            trainer.log(f"{minutes:.2f} minutes of training passed --exit-duration-in-mins "
                        f"{limit_minutes:g}: {where} after iteration {trainer.iteration}")
            return True  # the loop's save_at_end writes the checkpoint
        return False
