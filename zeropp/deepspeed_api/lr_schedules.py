"""Learning-rate schedules over an optimizer's param groups: Megatron's and DeepSpeed's.

Both families do the same thing: compute one lr for a position (completed iterations or
optimizer steps), write it into every param group, and save their position in a state dict
that the checkpoint carries. ``ParamGroupSchedule`` holds that shared part; the two
families differ only in the curve and in who advances them:

- ``AnnealingLR``: Megatron's AnnealingLR, which the training loop advances once per
  iteration (``--lr-warmup-iters``, ``--lr-decay-iters``, ``--lr-decay-style``).
- ``WarmupSchedule``: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, built from a
  ``scheduler`` block of the JSON config and advanced by the engine after every optimizer
  step it takes.

They live in the engine's package because the engine builds the DeepSpeed ones and must not
depend on the training program, while the training program may depend on the engine.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Protocol

import torch

from zeropp.acceleration.cuda_graph import set_group_lr

DECAY_STYLES = ("constant", "linear", "cosine")


class HasParamGroups(Protocol):
    """Anything shaped like a torch optimizer: a list of dicts with an "lr" entry."""

    param_groups: list[dict[str, Any]]


def _cosine(progress: float) -> float:
    """1 at progress 0 down to 0 at progress 1, along half a cosine period."""
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class ParamGroupSchedule(abc.ABC):
    """An lr per position, written into every param group, with a resumable state.

    Subclasses list what ``state_dict`` saves (``saved_fields``, in order) and which of those
    are settings rather than progress (``checked_fields``), and implement ``get_lr`` and
    ``_resume`` (move to the saved position and apply its lr).
    """

    saved_fields: tuple[str, ...] = ()
    checked_fields: tuple[str, ...] = ()

    def __init__(self, optimizer: HasParamGroups | None) -> None:
        # None: the schedule only computes lrs (for example to print the plan).
        self.optimizer = optimizer

    @abc.abstractmethod
    def get_lr(self, step: int) -> float:
        """The learning rate at position ``step`` of the schedule."""

    def _set_lr(self, lr: float) -> float:
        """Write ``lr`` into every param group (groups split weight decay, not the lr)."""
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                set_group_lr(group, lr)
        return lr

    def get_last_lr(self) -> list[float]:
        """torch's ``LRScheduler.get_last_lr``: the lr each param group holds now."""
        if self.optimizer is None:
            raise ValueError("this schedule drives no optimizer: call get_lr(step)")
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.saved_fields}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Resume at the saved position and apply its lr to the optimizer.

        With ``strict`` the saved settings must equal this schedule's (a silently different
        schedule after a resume is a classic loss-curve surprise); without it the current
        settings win, which is how a run's schedule is deliberately changed on resume.
        """
        missing = [name for name in self.saved_fields if name not in state]
        if missing:
            raise ValueError(f"lr scheduler state lacks {', '.join(missing)}")
        if strict:
            for name in self.checked_fields:
                if state[name] != getattr(self, name):
                    raise ValueError(
                        f"lr scheduler {name} is {getattr(self, name)!r} but the checkpoint "
                        f"has {state[name]!r}; pass matching flags or load with strict=False"
                    )
        self._resume(state)

    @abc.abstractmethod
    def _resume(self, state: dict[str, Any]) -> None:
        """Move to the saved position and apply its lr."""


class AnnealingLR(ParamGroupSchedule):
    """Megatron's AnnealingLR: warmup, then linear, cosine or no decay.

        lr(i) = max_lr * i / warmup_iters                      for i <= warmup_iters
              = min_lr + (max_lr - min_lr) * coeff(r)           for warmup_iters < i <= decay_iters
              = min_lr                                          for i > decay_iters
        r = (i - warmup_iters) / (decay_iters - warmup_iters)
        coeff(r) = 1 - r (linear)   or   (1 + cos(pi * r)) / 2 (cosine)

    The "constant" style holds max_lr after warmup and never decays. ``i`` counts completed
    iterations: as in Megatron, the loop calls ``step(0)`` before training and ``step(i)``
    after iteration ``i``, so the optimizer step of iteration ``i + 1`` uses ``lr(i)`` (the
    first warmup step runs at lr 0).

    A param group holding its own ``"max_lr"`` (and perhaps ``"min_lr"``) follows the same
    curve between its own bounds, as in Megatron's scheduler (its ``--decoupled-lr`` group
    of embedding and output weights); every other group gets ``lr(i)``.
    """

    checked_fields = ("max_lr", "min_lr", "warmup_iters", "decay_iters", "decay_style")
    saved_fields = (*checked_fields, "num_iters")

    def __init__(
        self,
        optimizer: HasParamGroups | None,
        max_lr: float,
        min_lr: float,
        warmup_iters: int,
        decay_iters: int,
        decay_style: str,
    ) -> None:
        _check_annealing(max_lr, min_lr, warmup_iters, decay_iters, decay_style)
        super().__init__(optimizer)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.warmup_iters = int(warmup_iters)
        self.decay_iters = int(decay_iters)
        self.decay_style = decay_style
        self.num_iters = 0
        # (max_lr, min_lr, device) -> the curve as a tensor, for step_on_device
        self._lr_tables: dict[tuple, torch.Tensor] = {}

    def get_lr(self, iteration: int, max_lr: float | None = None,
               min_lr: float | None = None) -> float:
        """The learning rate after ``iteration`` completed iterations (between ``max_lr`` and
        ``min_lr`` if given, else the schedule's); no side effects."""
        if iteration < 0:
            raise ValueError(f"iteration must not be negative, got {iteration}")
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return max_lr * iteration / self.warmup_iters
        if self.decay_style == "constant":
            return max_lr
        if iteration > self.decay_iters:
            return min_lr
        decay_ratio = (iteration - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        coefficient = 1.0 - decay_ratio if self.decay_style == "linear" else _cosine(decay_ratio)
        return min_lr + coefficient * (max_lr - min_lr)

    def step(self, iteration: int) -> float:
        """Set every param group's lr for ``iteration`` (``get_lr(iteration)``, or the curve
        between the group's own ``max_lr`` and ``min_lr``); returns ``get_lr(iteration)``."""
        self.num_iters = iteration
        lr = self._set_lr(self.get_lr(iteration))
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                if "max_lr" in group:
                    set_group_lr(group, self.get_lr(iteration, group["max_lr"],
                                                     group.get("min_lr")))
        return lr

    def step_on_device(self, iteration: torch.Tensor) -> None:
        """``step`` at an iteration count the host does not know: a 0-dim int64 tensor on
        the device (applied updates counted there, [Note: step outcome on the device] in
        zeropp/engine.py). Each param group's lr becomes a 0-dim tensor read from a table of
        the curve, which torch's fused Adam/AdamW take as they are; ``num_iters`` and the
        host's lrs are brought up to date by a later ``step`` with the count read back."""
        if self.optimizer is None:
            raise ValueError("this schedule drives no optimizer: call get_lr(step)")
        for group in self.optimizer.param_groups:
            table = self._lr_table(group.get("max_lr"), group.get("min_lr"), iteration.device)
            # index_select, not table[i]: indexing with a 0-dim tensor reads it on the host
            position = iteration.clamp(max=table.numel() - 1).reshape(1)
            lr = table.index_select(0, position).reshape(())
            held = group["lr"]
            if (isinstance(held, torch.Tensor) and held.device == lr.device
                    and held.dtype == lr.dtype and held.dim() == 0):
                held.copy_(lr)  # in place: a captured iteration reads this tensor
            else:
                group["lr"] = lr

    def _lr_table(self, max_lr: float | None, min_lr: float | None,
                  device: torch.device) -> torch.Tensor:
        # Past the warmup (constant style) or the decay the curve is flat, so a table up to
        # there, indexed with a clamp, covers every iteration. CPU's fused AdamW reads a
        # tensor lr in float64 (as it takes a float), CUDA's in float32 (as its kernel
        # rounds a float lr): the table's dtype is what each reads, so both match a float lr.
        key = (max_lr, min_lr, device)
        tables = self._lr_tables
        if key not in tables:
            end = self.warmup_iters if self.decay_style == "constant" else self.decay_iters
            dtype = torch.float32 if device.type == "cuda" else torch.float64
            tables[key] = torch.tensor([self.get_lr(i, max_lr, min_lr) for i in range(end + 2)],
                                       dtype=dtype, device=device)
        return tables[key]

    def _resume(self, state: dict[str, Any]) -> None:
        self.step(int(state["num_iters"]))


def _check_annealing(max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                     decay_style: str) -> None:
    if decay_style not in DECAY_STYLES:
        raise ValueError(f"decay_style must be one of {', '.join(DECAY_STYLES)}, "
                         f"got {decay_style!r}")
    if not 0.0 <= min_lr <= max_lr:
        raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr {min_lr} and max_lr {max_lr}")
    if warmup_iters < 0:
        raise ValueError(f"warmup_iters must not be negative, got {warmup_iters}")
    if decay_style != "constant" and decay_iters <= 0:
        raise ValueError(f"decay_iters must be positive for {decay_style} decay, got {decay_iters}")
    if decay_style != "constant" and warmup_iters > decay_iters:
        raise ValueError(f"warmup_iters {warmup_iters} must not exceed decay_iters {decay_iters} "
                         f"for {decay_style} decay")


class WarmupSchedule(ParamGroupSchedule):
    """DeepSpeed's warmup schedules, with the semantics of ``deepspeed.runtime.lr_schedules``.

    - WarmupLR: warm up from ``warmup_min_lr`` to ``warmup_max_lr`` (log or linear), then hold.
    - WarmupDecayLR: WarmupLR, then linear decay back to ``warmup_min_lr`` at
      ``total_num_steps``.
    - WarmupCosineLR: ratios of the optimizer's lr: warm up from ``warmup_min_ratio`` to 1,
      then cosine decay to ``cos_min_ratio`` at ``total_num_steps``.

    ``step()`` is called once per optimizer step (skipped steps excluded); the schedule's
    iteration starts at -1, as DeepSpeed's does. The optimizer's lr
    at construction is the base of the ratios and the default ``warmup_max_lr``; it is saved,
    since by then the param groups hold the schedule's own lr. The kind is saved too, but not
    checked on load: the config's scheduler block decides it.
    """

    saved_fields = ("last_step", "kind", "base_lr")

    def __init__(self, optimizer: HasParamGroups, kind: str, params: dict) -> None:
        super().__init__(optimizer)
        self.kind = kind
        self.params = dict(params)
        # A number, not the group's value: an lr tensor is written in place by the steps.
        self.base_lr = float(optimizer.param_groups[0]["lr"])
        # DeepSpeed's schedules start at iteration -1 (the warmup's floor) and the first step
        # moves them to iteration 0: the first two updates both run at the floor.
        self.last_step = -1
        self._set_lr(self.get_lr())

    def _warmup_gamma(self, step: int) -> float:
        warmup = self.params["warmup_num_steps"]
        if step >= warmup:
            return 1.0
        if self.params["warmup_type"] == "log":
            return math.log(step + 1) / math.log(warmup) if warmup > 1 else 1.0
        return step / warmup

    def get_lr(self, step: int | None = None) -> float:
        """The lr at optimizer step ``step`` (default: the current one); no side effects."""
        step = self.last_step if step is None else step
        p = self.params
        if step < 0:  # not started: DeepSpeed's floor (WarmupCosineLR's ratio is 0 there)
            return 0.0 if self.kind == "WarmupCosineLR" else p["warmup_min_lr"]
        gamma = self._warmup_gamma(step)
        if self.kind == "WarmupCosineLR":
            total, warmup = p["total_num_steps"], p["warmup_num_steps"]
            if step < warmup:
                ratio = p["warmup_min_ratio"] + (1 - p["warmup_min_ratio"]) * gamma
            else:
                progress = min(1.0, (step - warmup) / max(1, total - warmup))
                ratio = p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * _cosine(progress)
            return self.base_lr * ratio
        max_lr = p.get("warmup_max_lr") or self.base_lr
        lr = p["warmup_min_lr"] + (max_lr - p["warmup_min_lr"]) * gamma
        if self.kind == "WarmupDecayLR" and step >= p["warmup_num_steps"]:
            total, warmup = p["total_num_steps"], p["warmup_num_steps"]
            decay = max(0.0, (total - step) / max(1.0, total - warmup))
            lr = p["warmup_min_lr"] + (max_lr - p["warmup_min_lr"]) * decay
        return lr

    def step(self) -> None:
        self.last_step += 1
        self._set_lr(self.get_lr())

    def _resume(self, state: dict[str, Any]) -> None:
        self.last_step, self.base_lr = int(state["last_step"]), float(state["base_lr"])
        self._set_lr(self.get_lr())


# [Note: DeepSpeed's schedule classes]
# Scripts import DeepSpeed's schedules by name (``from deepspeed.runtime.lr_schedules import
# WarmupLR``), build them on the optimizer ``initialize`` returned, and test what
# ``initialize`` built from the config's scheduler block with ``isinstance``. The classes
# below have those names and DeepSpeed's constructors (keyword for keyword, so the config's
# params are their arguments); the three warmup ones are ``WarmupSchedule`` of their kind,
# and WarmupDecayLR is a WarmupLR as in DeepSpeed. ``schedule_from_config`` builds the one
# the config names.


class WarmupLR(WarmupSchedule):
    """DeepSpeed's ``WarmupLR``: warm up from ``warmup_min_lr`` to ``warmup_max_lr`` (None:
    the optimizer's lr), log or linear, over ``warmup_num_steps`` steps, then hold."""

    KIND = "WarmupLR"

    def __init__(self, optimizer: HasParamGroups, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        _start_warmup(self, optimizer, last_batch_iteration, warmup_min_lr=warmup_min_lr,
                      warmup_max_lr=warmup_max_lr, warmup_num_steps=warmup_num_steps,
                      warmup_type=warmup_type)


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's ``WarmupDecayLR``: WarmupLR, then linear decay back to ``warmup_min_lr``
    at ``total_num_steps``."""

    KIND = "WarmupDecayLR"

    def __init__(self, optimizer: HasParamGroups, total_num_steps: int,
                 warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        _start_warmup(self, optimizer, last_batch_iteration, total_num_steps=total_num_steps,
                      warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                      warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)


class WarmupCosineLR(WarmupSchedule):
    """DeepSpeed's ``WarmupCosineLR``: ratios of the optimizer's lr, warm up from
    ``warmup_min_ratio`` to 1, then cosine decay to ``cos_min_ratio`` at ``total_num_steps``."""

    KIND = "WarmupCosineLR"

    def __init__(self, optimizer: HasParamGroups, total_num_steps: int,
                 warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        _start_warmup(self, optimizer, last_batch_iteration, total_num_steps=total_num_steps,
                      warmup_min_ratio=warmup_min_ratio, warmup_num_steps=warmup_num_steps,
                      cos_min_ratio=cos_min_ratio, warmup_type=warmup_type)


def _start_warmup(schedule: WarmupSchedule, optimizer: HasParamGroups,
                  last_batch_iteration: int, **params) -> None:
    """A DeepSpeed-named warmup schedule's construction: checked, started at -1 or, where
    DeepSpeed's ``last_batch_iteration`` says so, resumed there."""
    _check_warmup(params["warmup_num_steps"], params["warmup_type"])
    WarmupSchedule.__init__(schedule, optimizer, type(schedule).KIND, params)
    if last_batch_iteration != -1:
        schedule._resume({"last_step": last_batch_iteration, "base_lr": schedule.base_lr})


def _check_warmup(warmup_num_steps: Any, warmup_type: Any) -> None:
    if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")


def _per_group(optimizer: HasParamGroups, value: Any, name: str) -> list:
    """One value for every param group, or a list of one per group (DeepSpeed's rule)."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name}: expected {groups} values (one per param group), "
                             f"got {len(value)}")
        return list(value)
    return [value] * groups


class OneCycle(ParamGroupSchedule):
    """DeepSpeed's ``OneCycle`` (the 1cycle policy), with its constructor and meanings.

    Each cycle of ``cycle_first_step_size + cycle_second_step_size`` steps climbs the lr
    from ``cycle_min_lr`` to ``cycle_max_lr`` and back (held flat on stairs when a stair
    count is set); Adam's beta1 moves the other way between ``cycle_max_mom`` and
    ``cycle_min_mom`` (``cycle_momentum``; beta2 is set to 0.99, as DeepSpeed sets it).
    After the first cycle, every ``decay_step_size`` steps divide the lr by
    ``1 + decay_lr_rate * k`` and multiply beta1 by ``1 + decay_mom_rate * k`` (no decay
    when ``decay_step_size`` or the rate is 0: the lr stays at ``cycle_min_lr``)."""

    saved_fields = ("last_batch_iteration",)

    def __init__(self, optimizer: HasParamGroups, cycle_min_lr, cycle_max_lr,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: float = 2000,
                 cycle_second_step_size: float | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: float = 0,
                 cycle_momentum: bool = True, cycle_min_mom=0.8, cycle_max_mom=0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0 or second < 0:
            raise ValueError("OneCycle: cycle_first_step_size must be positive and "
                             f"cycle_second_step_size not negative, got {first} and {second}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        # Momentum cycles only for optimizers with betas (DeepSpeed turns it off otherwise).
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:  # DeepSpeed starts at the cycle's floor
            for group, lr in zip(optimizer.param_groups, self.min_lrs, strict=True):
                set_group_lr(group, lr)
            if self.cycle_momentum:
                for group, mom in zip(optimizer.param_groups, self.min_moms, strict=True):
                    group["betas"] = (mom, 0.99)

    def _scale(self) -> float:
        """Where the current step sits in its cycle: 0 at the floor, 1 at the peak."""
        iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # held flat on each stair, counted from the integer position
            position = iteration % self.total_size
            if position <= self.first_step_size:
                stair = position * stairs / self.first_step_size
            else:
                stair = (self.total_size - position) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def _decays(self, rate: float) -> float | None:
        """The decay factor after the first cycle, or None where there is no decay."""
        if math.isclose(self.decay_step_size, 0) or math.isclose(rate, 0):
            return None
        steps_after = self.last_batch_iteration - self.total_size + 1
        return 1 + rate * steps_after / self.decay_step_size

    def get_lr(self, step: int | None = None) -> list[float]:
        """Each group's lr at the current step (``step`` is not taken: the schedule moves
        by ``step()``)."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs,
                                                                    strict=True)]
        factor = self._decays(self.decay_lr_rate)
        return list(self.min_lrs) if factor is None else [low / factor for low in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [(high - (high - low) * scale, 0.99)
                    for low, high in zip(self.min_moms, self.max_moms, strict=True)]
        factor = self._decays(self.decay_mom_rate)
        return [(high * (1.0 if factor is None else factor), 0.99) for high in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if batch_iteration is None
                                     else batch_iteration)
        momenta = self.get_mom()
        for index, (group, lr) in enumerate(zip(self.optimizer.param_groups, self.get_lr(),
                                                strict=True)):
            set_group_lr(group, lr)
            if momenta is not None:
                group["betas"] = momenta[index]

    def _resume(self, state: dict[str, Any]) -> None:
        self.step(int(state["last_batch_iteration"]))


SCHEDULES: dict[str, type[ParamGroupSchedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)}


def schedule_from_config(optimizer: HasParamGroups, kind: str, params: dict) -> ParamGroupSchedule:
    """The schedule a config's ``scheduler`` block names, its params as the arguments."""
    return SCHEDULES[kind](optimizer, **params)


def bind_client_schedule(schedule: Any, optimizer: HasParamGroups) -> Any:
    """Make a schedule the caller built on its own optimizer drive ``optimizer`` (the engine's).

    DeepSpeed steps the client's optimizer itself, so a schedule built on it drives training
    there. This engine steps its own optimizer over the shards, built from the client's class,
    hyperparameters and groups (the same groups in the same order): the schedule's
    ``optimizer`` is pointed at it, with the lr values the schedule has written so far, so
    ``engine.get_lr()`` follows the schedule. torch's schedulers (Hugging Face's
    ``get_scheduler`` returns them) and DeepSpeed's keep their optimizer there. A schedule that
    cannot reach the engine's optimizer is an error: it would train silently at the lr it has
    now (0 during a warm-up)."""
    target = getattr(schedule, "optimizer", None)
    if target is optimizer:
        return schedule
    name = type(schedule).__name__
    if target is None or not hasattr(target, "param_groups"):
        raise ValueError(f"lr_scheduler: {name} has no .optimizer the engine can point at its "
                         "own: pass a schedule built on the optimizer initialize returns, or a "
                         "callable taking that optimizer")
    if len(target.param_groups) != len(optimizer.param_groups):
        raise ValueError(f"lr_scheduler: {name} drives {len(target.param_groups)} param groups, "
                         f"the engine's optimizer has {len(optimizer.param_groups)}: build the "
                         "schedule on the optimizer passed to initialize")
    for theirs, ours in zip(target.param_groups, optimizer.param_groups, strict=True):
        for key, value in theirs.items():
            if key != "params" and (key not in ours or key in ("lr", "initial_lr")):
                ours[key] = value  # the schedule's lr so far, and its own keys (initial_lr)
    schedule.optimizer = optimizer
    return schedule
