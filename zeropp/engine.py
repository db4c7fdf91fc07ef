"""The training engine users hold: DeepSpeed's ``forward / backward(loss) / step()`` contract.

``backward`` scales the loss (fp16), runs backward through the sharded model and flushes the
gradient reductions; ``step`` is called after every micro-batch and updates the weights only
at the gradient-accumulation boundary, exactly as ``deepspeed.DeepSpeedEngine.step``.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from zeropp.loss_scaler import LossScaler
from zeropp.optimizer import PartitionedOptimizer, clip_coefficient
from zeropp.sharded_model import ShardedModel


class ZeroEngine:
    def __init__(
        self,
        sharded: ShardedModel,
        optimizer: PartitionedOptimizer,
        loss_scaler: LossScaler,
        gradient_accumulation_steps: int = 1,
        gradient_clipping: float = 0.0,
        lr_scheduler=None,
        config=None,
    ) -> None:
        self.sharded = sharded
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self._accumulation_steps = gradient_accumulation_steps
        # set_gradient_accumulation_boundary: the caller decides where the boundary falls.
        self._forced_boundary: bool | None = None
        self._step_applied = False
        self.gradient_clipping = gradient_clipping
        self.lr_scheduler = lr_scheduler
        self.config = config
        # False for an engine built without an optimizer ([Note: an engine without an
        # optimizer] in zeropp/deepspeed_api/initialize.py): step() refuses to update.
        self.trains = True
        # DeepSpeed's ignore_unused_parameters=false (stages 1-2): the names of the trainable
        # parameters whose gradient arrived since the last step, None when not checked.
        self._params_with_gradient: set[str] | None = None
        zero = config.zero_optimization if config is not None else None
        if zero is not None and not zero.ignore_unused_parameters and zero.stage in (1, 2):
            self._params_with_gradient = set()
            for name, param in self.module.named_parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(
                        lambda _, name=name: self._params_with_gradient.add(name))
        self.micro_steps = 0
        self.global_steps = 0
        # A step's outcome (its gradient norm, whether it was skipped) is a host value where
        # the host decides the skip, a device tensor where the device does
        # ([Note: step outcome on the device]); the properties below read either.
        self._skipped_on_host = 0
        self._skipped_on_device: torch.Tensor | None = None
        self._last_grad_norm: float | torch.Tensor | None = None
        self._last_overflow: bool | torch.Tensor = False
        # This rank's random streams from the last load_checkpoint (restored by whoever wants
        # them: zeropp.checkpoints.restore_rng_state), None before a load or across worlds.
        self.loaded_rng_state: dict | None = None
        # (directory, tag) that checkpoint_to_load has just verified: load_checkpoint does
        # not read its files a second time.
        self._verified_checkpoint: tuple[Path, str] | None = None
        # The asynchronous save in flight (zeropp.checkpoints.checkpoint_async.PendingSave), and
        # the host buffers every save stages the shards in (kept: reused by the next save).
        self._pending_checkpoint = None
        self._checkpoint_staging = None
        # Set once an IterationGraph has captured this engine's iteration: a replay reads
        # the state where the capture found it, so a load may no longer replace it.
        self.iteration_captured = False
        # DeepSpeed's own printouts and monitors (steps_per_print, wall_clock_breakdown, ...).
        from zeropp.reports import EngineReports, ThroughputTimer

        self.reports = None
        if config is not None:
            self.reports = EngineReports(config, sharded.topology.rank, sharded.device)
        self.tput_timer = ThroughputTimer.for_engine(config, sharded.topology.rank,
                                                     sharded.device)
        # [Note: compiled blocks] (zeropp/acceleration/compiled_blocks.py): the config's
        # compile block.
        self.compiled_blocks = None
        if config is not None and config.compile.enabled:
            self.compile(config.compile.backend, config.compile.kwargs)

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None) -> None:
        """DeepSpeed's ``engine.compile``: each block's forward compiled, hooks left eager."""
        from zeropp.acceleration.compiled_blocks import compile_blocks

        if self.compiled_blocks is None:
            self.compiled_blocks = compile_blocks(self.sharded, backend, compile_kwargs)

    @property
    def is_compiled(self) -> bool:
        return self.compiled_blocks is not None

    # ---- model ---------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.sharded.module

    @property
    def topology(self):
        return self.sharded.topology

    @property
    def device(self) -> torch.device:
        """Where the working weights, gradients and activations live (DeepSpeed's name)."""
        return self.sharded.device

    @property
    def comm_stats(self):
        return self.sharded.stats

    def __call__(self, *args, **kwargs):
        self.tput_timer.start()  # DeepSpeed's span: this forward to the next step()
        with self._timed("fwd"):
            return self.sharded(*args, **kwargs)

    forward = __call__

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        if self.reports is not None:
            self.reports.start(phase)
        try:
            yield
        finally:
            if self.reports is not None:
                self.reports.stop(phase)

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    # ---- the wrapped module's face ---------------------------------------------------------
    # DeepSpeed's engine is an nn.Module around the model and forwards what it lacks to it;
    # scripts read `engine.model`, walk `engine.named_modules()`, call `engine.to(device)`.
    # This engine is not a Module (its weights are shards, which torch's Module machinery
    # would move, cast or register as its own); it answers those calls from the model.
    def __getattr__(self, name: str):
        """What the engine lacks, from the wrapped model (``engine.model`` of a Hugging Face
        causal LM, say), as DeepSpeed's engine forwards it."""
        if name.startswith("__") or "sharded" not in self.__dict__:  # not while building
            raise AttributeError(f"'ZeroEngine' object has no attribute {name!r}")
        module = self.sharded.module
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"'ZeroEngine' object has no attribute {name!r}, nor has "
                                 f"its model ({type(module).__name__})") from None

    def modules(self):
        return self.module.modules()

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        return self.module.named_modules(memo, prefix, remove_duplicate)

    def children(self):
        return self.module.children()

    def named_children(self):
        return self.module.named_children()

    def buffers(self, recurse: bool = True):
        return self.module.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def to(self, *args, **kwargs) -> ZeroEngine:
        """``engine.to(device)`` as scripts call it after ``initialize``: the engine already
        lives on its device in its working dtype, so a move there returns the engine;
        another device or dtype is an error (the shards, masters and streams stay where
        the engine put them)."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and not _same_device(torch.device(device), self.device):
            raise ValueError(f"engine.to({device}): the engine's weights live sharded on "
                             f"{self.device}; choose the device before initialize (LOCAL_RANK "
                             "picks the GPU)")
        if dtype is not None and dtype != self.sharded.dtype:
            raise ValueError(f"engine.to({dtype}): the engine computes in {self.sharded.dtype}; "
                             "set fp16 / bf16 in the config instead")
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    # ---- training ------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss (not divided by accumulation steps)."""
        feedback = self.sharded.error_feedback
        if feedback is not None:  # errors are stored unscaled ([Note: error feedback])
            feedback.gradient_scale = self.loss_scaler.scale / self.sharded.comm.predivide_factor
        boundary = self._forced_boundary if self._forced_boundary is not None else (
            (self.micro_steps + 1) % self._accumulation_steps == 0)
        with self._timed("bwd"):
            # The reductions' pre-divide (UnitComm.predivide_factor) rides on the loss:
            # gradients are linear in it, so they arrive divided with no kernel per unit.
            factor = self._loss_scale() / self.sharded.comm.predivide_factor
            self.sharded.run_backward(loss.float() * factor, boundary)
        self.micro_steps += 1

    def iteration_runner(self, fn, log=None, extra_blockers=()):
        """How a training loop should call ``fn``, one whole iteration (forward, backward and
        step of each micro-batch, on inputs already on the device, no host read): as an
        ``IterationGraph`` that captures it once where the config's ``cuda_graph`` block asks
        for it ([Note: iteration graphs] in zeropp/acceleration/cuda_graph.py), else None: call
        ``fn``.
        ``extra_blockers``: what the caller knows stops a capture (its model's randomness)."""
        options = None if self.config is None else self.config.cuda_graph
        if options is None or not options.enabled:
            return None
        from zeropp.acceleration.cuda_graph import CudaGraphOptions, IterationGraph

        graph = IterationGraph(self, fn, CudaGraphOptions(True, options.warmup_iterations),
                               log=log, extra_blockers=extra_blockers)
        return None if graph.blockers else graph  # it has said why

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._forced_boundary is not None:
            return self._forced_boundary
        return self.micro_steps > 0 and self.micro_steps % self._accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's override: the next backward/step treat the boundary as ``is_boundary``
        until it is set again (``None`` returns to counting micro-batches)."""
        self._forced_boundary = is_boundary

    def step(self) -> bool:
        """Update at the accumulation boundary; returns True when an update was applied."""
        with self._timed("step"):
            applied = self._step()
        if self.compiled_blocks is not None and self.is_gradient_accumulation_boundary():
            self.compiled_blocks.after_step()  # says the first iteration's compile time once
        self.tput_timer.stop(global_step=self.is_gradient_accumulation_boundary())
        if self.reports is not None:
            self.reports.after_micro_step(self, self.is_gradient_accumulation_boundary())
        return applied

    def _step(self) -> bool:
        self._step_applied = False
        if not self.is_gradient_accumulation_boundary():
            return False
        if not self.trains:
            raise RuntimeError("step(): the engine was built without an optimizer (no "
                               "optimizer block, none passed to initialize): it evaluates only")
        if self._params_with_gradient is not None:
            self._check_every_parameter_had_gradient()
        # What the reductions did not divide by already (ShardingOptions.gradient_predivide_factor).
        divisor = (
            self.sharded.dp_size * self._accumulation_steps * self._loss_scale()
            / self.sharded.comm.predivide_factor
        )
        self.global_steps += 1
        if self.defers_step_outcome:
            norm, skipped = self._average_clip_and_update_on_device(divisor)
            self.loss_scaler.update(skipped)
            self._last_grad_norm, self._last_overflow = norm, skipped
            # Added in place: a captured iteration ([Note: iteration graphs]) adds to the
            # same tensor at every replay.
            if self._skipped_on_device is None:
                self._skipped_on_device = torch.zeros((), dtype=torch.int64, device=skipped.device)
            self._skipped_on_device.add_(skipped)
            # The host does not know whether the device skipped, so a schedule owned by the
            # engine advances on every step (bf16 and fp32 only: DeepSpeed's bf16 path, which
            # never skips, does the same; fp16 with such a schedule decides on the host).
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self._step_applied = ~skipped
            return True
        norm, overflow = self._average_clip_and_update(divisor)
        self.loss_scaler.update(overflow)
        if self.sharded.error_feedback is not None:
            self.sharded.error_feedback.after_step(skipped=overflow)
        self._last_grad_norm, self._last_overflow = norm, overflow
        if overflow:
            self._skipped_on_host += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._step_applied = not overflow
        return not overflow

    def _check_every_parameter_had_gradient(self) -> None:
        """DeepSpeed's ignore_unused_parameters=false: a step after which some trainable
        parameter got no gradient raises, on every rank (one all-reduce of a count)."""
        unused = [name for name, param in self.module.named_parameters()
                  if param.requires_grad and name not in self._params_with_gradient]
        self._params_with_gradient.clear()
        count = torch.tensor([len(unused)], device=self.device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        if int(count) > 0:
            shown = ", ".join(unused[:3]) or "(on another rank)"
            raise UnusedParametersError(
                f"parameters got no gradient since the last step: {shown}; set "
                "zero_optimization.ignore_unused_parameters true to reduce them as zeros")

    # [Note: step outcome on the device]
    # With an optimizer that can skip its own update on a device flag (torch's fused
    # Adam/AdamW read ``found_inf``, as GradScaler uses them), the whole step stays on the
    # device: the gradient norm is a tensor, the clip factor min(1, max_norm / (norm + 1e-6))
    # is computed from it there, and a non-finite norm sets the flag that makes the fused
    # update leave weights, moments and step counts as they were. fp16's dynamic loss scaler
    # then keeps its scale and hysteresis on the device too (``DynamicLossScaler.scale_on``)
    # and updates them from the flag with DeepSpeed's rules. The host never waits for the GPU
    # in such a step; the norm, the skipped flag, the count of skipped steps and the loss
    # scale are read when someone asks (the training loop's log interval, a checkpoint).
    # Because the host does not know whether a step was skipped, an lr schedule must follow
    # the device's count of applied steps to stay exact (the training loop's does:
    # ``AnnealingLR.step_on_device``); a schedule the engine steps itself cannot, so with one
    # the fp16 verdict stays on the host. So does an offloaded step ([Note: offload]), which
    # runs on the host. qgZ's error feedback also decides on the host (its
    # residuals change with the verdict), and so does any other optimizer. On the meta device
    # (the simulated GPU cluster) nothing is computed, so the deferred path runs whatever the
    # optimizer, to count what a GPU run with the fused optimizer issues.
    @property
    def defers_step_outcome(self) -> bool:
        """Whether a step's skip decision stays on the device ([Note: step outcome on the
        device]): then ``step()`` returns True without knowing, and ``was_step_applied()``,
        ``last_step_overflowed``, ``get_global_grad_norm()``, ``skipped_steps`` and
        ``loss_scale`` read the device when called."""
        return ((not self.loss_scaler.dynamic or self.lr_scheduler is None)
                and self.sharded.error_feedback is None
                and not self.optimizer.offloaded  # the host steps on a norm it has read
                and (self.optimizer.skips_on_device or self.sharded.device.type == "meta"))

    def _loss_scale(self) -> float | torch.Tensor:
        """The scale the loss is multiplied by: a device tensor where the dynamic scaler's
        state lives on the device ([Note: step outcome on the device]), else the float."""
        if self.loss_scaler.dynamic and self.defers_step_outcome:
            return self.loss_scaler.scale_on(self.device)
        return self.loss_scaler.scale

    @property
    def skipped_steps(self) -> int:
        on_device = 0 if self._skipped_on_device is None else int(self._skipped_on_device)
        return self._skipped_on_host + on_device

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_on_host, self._skipped_on_device = int(value), None

    @property
    def last_grad_norm(self) -> float | None:
        norm = self._last_grad_norm
        return None if norm is None else float(norm)

    @property
    def last_step_overflowed(self) -> bool:
        return bool(self._last_overflow)

    # ---- DeepSpeed's engine API (DeepSpeedEngine's meanings) -------------------------------
    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights (False off the boundary and on a
        skipped step; read from the device where the device decided)."""
        return bool(self._step_applied)

    def step_applied_flag(self) -> bool | torch.Tensor:
        """``was_step_applied()`` without a host read: a 0-dim bool tensor on the device where
        the device decided ([Note: step outcome on the device]), else the bool."""
        return self._step_applied

    def gradient_accumulation_steps(self) -> int:
        return self._accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch_key("train_micro_batch_size_per_gpu")

    def train_batch_size(self) -> int:
        return self._batch_key("train_batch_size")

    def _batch_key(self, key: str) -> int:
        value = getattr(self.config, key, None) if self.config is not None else None
        if value is None:
            raise ValueError(f"{key} is unknown: the engine was built without batch sizes "
                             "(set train_batch_size or train_micro_batch_size_per_gpu)")
        return value

    @property
    def global_samples(self) -> int:
        """Samples of all ranks consumed by the optimizer steps taken so far."""
        return self.global_steps * self.train_batch_size()

    def zero_optimization_stage(self) -> int:
        return self.sharded.residency.stage

    def fp16_enabled(self) -> bool:
        return self.sharded.dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.sharded.dtype == torch.bfloat16

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def dp_world_size(self) -> int:
        return self.sharded.dp_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.topology.local_rank))

    @property
    def training(self) -> bool:
        return self.module.training

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        return self.module.named_parameters(prefix, recurse)

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step (every rank calls it)."""
        self.sharded.zero_grad()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model, gathered (collective): ``full_state_dict``. DeepSpeed's ZeRO-3
        engine returns empty partitioned placeholders here; the gathered weights are what a
        caller of ``state_dict`` can use."""
        return self.full_state_dict()

    def _average_clip_and_update(self, divisor: float) -> tuple[float, bool]:
        """Average (divide by ``divisor`` once), clip and step; skip on a non-finite norm."""
        inv = 1.0 / divisor
        norm = self.optimizer.grad_norm_squared(inv) ** 0.5
        overflow = not math.isfinite(norm)
        if overflow:
            self.optimizer.skip_step()
        else:
            self.optimizer.step(grad_multiplier=inv * clip_coefficient(norm, self.gradient_clipping))
        self.sharded.refresh_after_update("step")
        return norm, overflow

    def _average_clip_and_update_on_device(self, divisor: float) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
        """``_average_clip_and_update`` with no host read: (norm, skipped) as device tensors."""
        inv = 1.0 / divisor
        norm = self.optimizer.grad_norm_squared_tensor(inv).sqrt()
        skipped = ~torch.isfinite(norm)
        multiplier: torch.Tensor | float = inv
        if self.gradient_clipping > 0:
            multiplier = (self.gradient_clipping / (norm + 1e-6)).clamp_(max=1.0) * inv
        self.optimizer.step_on_device(multiplier, skipped)
        self.sharded.refresh_after_update("step")
        return norm, skipped

    def close(self) -> None:
        """Finish what is in flight, stop the engine's communication threads, close monitors.

        Collective while an asynchronous save is in flight (every rank calls it): the save is
        waited for and published as ``finish_checkpoint`` publishes it (checksums,
        ``meta.json``, rename, then ``latest``); a failed writer raises here, on every rank,
        after the rest is closed."""
        try:
            self.finish_checkpoint(wait=True)
        finally:
            self._pending_checkpoint = None  # a failed publish is not retried
            self.sharded.close()
            if self.reports is not None:
                self.reports.close()

    def get_global_grad_norm(self) -> float | None:
        return self.last_grad_norm

    def step_outcome(self) -> dict[str, float | torch.Tensor | None]:
        """The last step's gradient norm and the loss scale as the engine holds them, read
        nothing: device tensors where the device decided ([Note: step outcome on the
        device]), else numbers. For a caller that reads several values in one transfer."""
        return {"grad_norm": self._last_grad_norm, "loss_scale": self.loss_scaler.held_scale}

    def comm_bytes(self, reset: bool = True) -> dict[str, dict[str, int]]:
        """Bytes sent by this rank since the last reset, by phase and locality."""
        snapshot = self.comm_stats.snapshot()
        if reset:
            self.comm_stats.reset()
        return snapshot

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[nn.Module]:
        with self.sharded.gathered_parameters() as module:
            yield module

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.sharded.full_state_dict()

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``save_16bit_model``: the whole model in its working dtype, one file.

        Collective (every rank calls it); rank 0 writes ``save_dir/save_filename``. Under
        stage 3 the weights are gathered only when ``stage3_gather_16bit_weights_on_model_save``
        is true; otherwise nothing is written and False is returned, as in DeepSpeed.
        """
        path = os.path.join(save_dir, save_filename)
        gather = (self.config is not None
                  and self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)
        if not self.sharded.residency.weights_replicated and not gather:
            if self.topology.rank == 0:
                print(f"warning: did not save the model {path} because "
                      "stage3_gather_16bit_weights_on_model_save is false", flush=True)
            return False
        state = self.full_state_dict()
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {name: value for name, value in state.items() if name not in frozen}
        if self.topology.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, path)
        return True

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: release the gathered stage-3 weights no one needs (DeepSpeed's
        checkpoint helpers call it before a save). Collectives in flight (prefetches) finish
        first, then every gathered unit is released but those still needed: persistent units
        (the next forward reads them), units a ``GatheredParameters`` context holds, and the
        root after a training forward (its backward reads the gathered weights autograd
        saved; DeepSpeed gathers again there, this engine's backward does not). Replicated
        units (stages 0-2) have nothing to release."""
        self.sharded.settle()
        for unit in self.sharded.units:
            if unit is not self.sharded.root:
                unit.release(keep_secondary=False)  # persistent or held units: kept

    # ---- checkpoints (zeropp/checkpoints/checkpoint.py, [Note: checkpoint layout]) ---------------
    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: dict | None = None,
                        async_save: bool = False, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False):
        """Atomic sharded save; every rank calls it. Returns the checkpoint directory.

        ``async_save``: return once the shards are staged in host memory; a background
        thread writes them, and ``finish_checkpoint`` publishes the checkpoint
        ([Note: asynchronous checkpoint saves]). Until then ``latest`` names the previous one.
        ``save_latest=False`` (DeepSpeed's): ``latest`` is left as it was, so a load without
        a tag does not take this checkpoint. ``exclude_frozen_parameters`` (DeepSpeed's): the
        frozen parameters are marked excluded and a load keeps the loading model's own values
        of them, as DeepSpeed's load takes them from the model; their bytes stay in the files
        (a shard is a flat run mixing parameters, [Note: checkpoint layout]).
        """
        from zeropp.checkpoints import checkpoint

        tag = f"global_step{self.global_steps}" if tag is None or tag == "" else str(tag)
        excluded = ()
        if exclude_frozen_parameters:
            excluded = tuple(name for name, param in self.module.named_parameters()
                             if not param.requires_grad)
        return checkpoint.save(self, save_dir, tag, client_state, async_save=async_save,
                               save_latest=save_latest, excluded=excluded)

    def finish_checkpoint(self, wait: bool = True) -> str | None:
        """Publish the asynchronous save in flight; collective. ``wait=False`` (at an
        iteration boundary) publishes only if every rank's writer is done. Returns the
        published directory, or None. A failed writer raises here on every rank
        (``CheckpointStorageError`` where storage failed)."""
        from zeropp.checkpoints import checkpoint

        path = checkpoint.finish_pending(self, wait=wait)
        return None if path is None else str(path)

    @property
    def checkpoint_in_flight(self) -> bool:
        """Whether an asynchronous save still waits for ``finish_checkpoint``."""
        return self._pending_checkpoint is not None

    def checkpoint_to_load(self, load_dir, fallback: bool = True, log=None) -> str:
        """The tag a load of ``load_dir`` without one takes: ``latest``'s if every file
        verifies, else (``fallback``) the newest checkpoint that does, said in one line
        through ``log`` (rank 0 prints by default). Collective."""
        from zeropp.checkpoints import checkpoint, checkpoint_integrity

        root = Path(load_dir)
        latest = checkpoint.read_latest(root, must_exist=False)
        if log is None:
            log = print if self.topology.rank == 0 else (lambda message: None)
        tag = checkpoint_integrity.choose(root, latest, self.sharded.device, fallback, log)
        self._verified_checkpoint = (root.resolve(), tag)
        return tag

    def load_checkpoint(self, load_dir, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, load_fallback: bool = True):
        """Load a checkpoint saved at any world size; returns ``(path, client_state)``.

        DeepSpeed's signature: ``load_module_only`` takes the weights alone,
        ``load_lr_scheduler_states=False`` keeps this run's schedule. Every file is verified
        against its checksum first; without ``tag``, a latest checkpoint that fails falls
        back to the newest one that verifies (``load_fallback=False``: raise instead). No
        tag and no ``latest`` file: a warning and ``(None, None)``, as DeepSpeed answers.
        """
        from zeropp.checkpoints import checkpoint, checkpoint_integrity

        if self.iteration_captured:
            raise RuntimeError("load_checkpoint: this engine's iteration is captured as a CUDA "
                               "graph, whose replays read the state a load would replace: load "
                               "before the capture (at the start of training)")

        if not load_module_strict:
            raise ValueError("load_checkpoint(load_module_strict=False) is not supported: "
                             "every parameter of the model must be in the checkpoint")
        self.finish_checkpoint()  # a save in flight may be the one to load
        root = Path(load_dir)
        if tag is None and not (root / "latest").is_file():
            # DeepSpeed's answer to a directory no save has completed in (a first run that
            # loads unconditionally): a warning and nothing loaded.
            if self.topology.rank == 0:
                warnings.warn(f"load_checkpoint: {root} has no 'latest' file; nothing loaded "
                              "(pass a tag to load a checkpoint saved with save_latest=False)",
                              stacklevel=2)
            return None, None
        if tag is None:
            tag = self.checkpoint_to_load(root, load_fallback)
        elif self._verified_checkpoint != (root.resolve(), tag):
            problem = checkpoint_integrity.verify(root / tag, self.sharded.device)
            if problem is not None:
                raise checkpoint.CheckpointError(f"checkpoint {root / tag}: {problem}")
        self._verified_checkpoint = None
        state = checkpoint.load(self, load_dir, tag, load_optimizer_states,
                                load_lr_scheduler_states, load_module_only)
        return str(load_dir) + "/" + tag, state

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds now, by model state, read off the tensors themselves."""

        def nbytes(tensors) -> int:
            # Shards are views of flat buffers ([Note: flat shards]): each storage once.
            storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                        for t in tensors if t is not None}
            return sum(storages.values())

        units = self.sharded.units
        moments = self.optimizer.moment_tensors()
        return {
            # A replicated unit's shard is a view of its whole weights, counted there.
            "working_shards": nbytes(u.shard for u in units if not u.replicated),
            "gathered_parameters": nbytes(u.full for u in units),
            "hpz_secondary_shards": nbytes(u.secondary_shard for u in units),
            # Whole gradients held for a later reduction (stage 1's accumulation window).
            "gradient_buffers": nbytes(u.gradient_buffer for u in units),
            "gradient_shards": nbytes(u.grad_shard for u in units),
            "fp32_master_shards": nbytes([self.optimizer.master_flat]),
            "optimizer_moments": nbytes(moments),
        }


class UnusedParametersError(RuntimeError, AssertionError):
    """A step found trainable parameters without gradient under
    ``ignore_unused_parameters: false``; an AssertionError too, as DeepSpeed raises there."""


def _same_device(asked: torch.device, actual: torch.device) -> bool:
    """``cuda`` names the current CUDA device, as torch's ``.to`` reads it."""
    if asked.type != actual.type:
        return False
    return asked.index is None or actual.index is None or asked.index == actual.index

