"""Compiled blocks: ``torch.compile`` applied to each unit's computation, as torchtitan
compiles each transformer block.

[Note: compiled blocks]
The engine gathers, releases and reduces from module hooks (``zeropp.unit_hooks.UnitHooks``:
a forward pre-hook gathers, a forward hook releases, hooks on the block's inputs and outputs
drive backward). ``nn.Module.__call__`` runs those hooks and then ``self.forward``; compiling
the module call (``module.compile()``) would trace the hooks and their collectives into the
graph, or break the graph at each one. So what is compiled is the *bound forward* alone,
installed as the instance attribute ``module.forward``: the hooks stay eager around it, and
the compiled region holds only the block's arithmetic (norms, attention, MLP, residuals),
which inductor fuses.

Which modules: every unit's module that holds no other unit's module (a leaf of the unit
tree). A block that is one unit is compiled whole; a block split below itself (attention,
the MLP and the norms as units of their own, [Note: units]) has those compiled, and the
block's own forward (the residual adds) stays eager, since it calls modules whose hooks
gather. The root (the model) holds every block and is never compiled.

Why this does not recompile every iteration: a parameter is one ``nn.Parameter`` object for
the engine's whole life; gathering rebinds its ``.data`` to a view of the unit's flat buffer
and releasing to an empty tensor ([Note: parameter storage] in zeropp/unit.py). Inside the
compiled forward the unit is always gathered (its pre-hook has just waited for the gather),
so dynamo's guards (shape, stride, dtype, device, requires_grad of each parameter, read
through the module as graph inputs since torch inlines built-in modules) see the same
metadata on every call; the data pointer, which changes with each gather, is not guarded.
Blocks of one class share a code object, so the 24 blocks of a GPT share one graph
(``tests/test_compiled_blocks.py`` counts graphs and recompiles). A forward under
``no_grad`` (evaluation, the first pass of reentrant checkpointing) is a second graph.

Activation checkpointing works both ways: full recomputation wraps module calls (the
application's chunks), so the recompute runs the hooks and the compiled forward again;
selective recomputation (``checkpoint`` inside the block) is traced by dynamo as its
activation-checkpoint operator.

CUDA graphs are refused (``mode="reduce-overhead"``, inductor's ``triton.cudagraphs``): a
graph replays fixed addresses, and the gathered weights live at new ones after each gather.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from zeropp.config import ConfigError
from zeropp.config.sections import COMPILE_KWARGS

# dynamo's timers of a first compile: the forward frame (dynamo, AOT autograd, inductor) and
# the backward graph, which AOT autograd compiles lazily at the first backward.
_FORWARD_TIMER = "_compile.compile_inner"
_BACKWARD_TIMER = "backward._backward_impl"


class CompileRefused(ConfigError):
    """A compile setting this engine cannot honour (one line)."""


def check_compile_settings(backend: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """torch.compile's ``backend`` and keyword arguments, checked: one-line errors."""
    unknown = sorted(set(kwargs) - set(COMPILE_KWARGS))
    if unknown:
        raise CompileRefused(f"compile.kwargs: {', '.join(unknown)} not a torch.compile argument "
                             f"(known: {', '.join(COMPILE_KWARGS)})")
    options = dict(kwargs.get("options") or {})
    mode = kwargs.get("mode")
    if mode is not None and (not isinstance(mode, str) or not mode):
        raise CompileRefused(f"compile.kwargs.mode: expected a mode's name, got {mode!r}")
    options_of_mode = {}
    if mode is not None:
        # (not at import: inductor is heavy, and compiling is opt-in)
        from torch._inductor import list_mode_options

        try:  # what the mode switches on: max-autotune turns on inductor's CUDA graphs too
            options_of_mode = list_mode_options(mode)
        except RuntimeError as error:
            raise CompileRefused(f"compile.kwargs.mode: {error}") from None
    if backend == "cudagraphs":  # dynamo's backend that only records CUDA graphs
        raise CompileRefused("compile.backend=cudagraphs: CUDA graphs are not supported over "
                             "blocks: gathered weights move to new addresses at every gather, "
                             "and a graph replays the old ones (--cuda-graph captures the "
                             "whole iteration)")
    if options_of_mode.get("triton.cudagraphs") or options.get("triton.cudagraphs"):
        source = f"mode {mode}" if options_of_mode.get("triton.cudagraphs") else "options"
        raise CompileRefused(f"compile: CUDA graphs ({source} turns on triton.cudagraphs) are "
                             "not supported over blocks: gathered weights move to new "
                             "addresses at every gather, and a graph replays the old ones "
                             "(max-autotune-no-cudagraphs tunes without them; --cuda-graph "
                             "captures the whole iteration)")
    if mode is not None and options:
        raise CompileRefused("compile.kwargs: torch.compile takes mode or options, not both")
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise CompileRefused(f"compile.backend={backend!r} is not a torch.compile backend "
                             f"(known: {', '.join(torch._dynamo.list_backends())})")
    return dict(kwargs)


def compiled_modules(sharded) -> list[nn.Module]:
    """The modules whose forward is compiled: each unit's module that holds no other unit's
    module, the root excepted ([Note: compiled blocks])."""
    unit_modules = [unit.module for unit in sharded.units]
    unit_ids = {id(module) for module in unit_modules}
    chosen = []
    for unit in sharded.units:
        if unit is sharded.root:
            continue
        inner = any(id(sub) in unit_ids for sub in unit.module.modules() if sub is not unit.module)
        if not inner:
            chosen.append(unit.module)
    return chosen


class CompiledBlocks:
    """The compiled forwards of one engine, and the report of their first compile."""

    def __init__(self, modules: list[nn.Module], backend: str, kwargs: dict[str, Any],
                 log: Callable[[str], None] | None) -> None:
        self.modules = modules
        self.backend = backend
        self.kwargs = kwargs
        self._log = log
        self._timers_before = compile_timers()
        self._graphs_before = _unique_graphs()
        self._started = time.perf_counter()
        # Set by the first report: seconds compiling in the first iteration, and graphs made.
        self.first_compile_seconds: float | None = None
        self.graphs: int | None = None
        for module in modules:
            # An instance attribute: nn.Module.__call__ runs the engine's hooks, then this.
            module.forward = torch.compile(module.forward, backend=backend, **kwargs)

    def after_step(self) -> None:
        """At the first optimizer step's end (forward and backward compiled by then): say
        once how long compiling took."""
        if self.first_compile_seconds is not None:
            return
        timers = compile_timers()
        spent = {name: timers[name] - self._timers_before.get(name, 0.0) for name in timers}
        forward, backward = spent.get(_FORWARD_TIMER), spent.get(_BACKWARD_TIMER)
        self.graphs = _unique_graphs() - self._graphs_before
        if forward is None:  # a torch that names its timers otherwise: the whole iteration
            self.first_compile_seconds = time.perf_counter() - self._started
            detail = "first iteration's wall time, compiling included"
        else:
            self.first_compile_seconds = forward + (backward or 0.0)
            detail = f"forward {forward:.1f} s, backward {backward or 0.0:.1f} s"
        if self._log is not None:
            self._log(f"compiled blocks: {len(self.modules)} modules, {self.graphs} graph(s), "
                      f"backend {self.backend}: {self.first_compile_seconds:.1f} s compiling in "
                      f"the first iteration ({detail})")

    def restore(self) -> None:
        """Put the eager forwards back (the class's ``forward`` shows through again)."""
        for module in self.modules:
            module.__dict__.pop("forward", None)


def compile_blocks(sharded, backend: str = "inductor", kwargs: Mapping[str, Any] | None = None,
                   log: Callable[[str], None] | None = None) -> CompiledBlocks:
    """Compile the forward of each leaf unit of ``sharded`` (a ``ShardedModel``) in place.

    ``log``: where the first iteration's compile time is said (None: rank 0 prints it).
    """
    checked = check_compile_settings(backend, kwargs or {})
    if log is None:
        log = (lambda line: print(line, flush=True)) if sharded.topology.rank == 0 else None
    if sharded.device.type == "meta":
        # The simulated GPU cluster: meta tensors have no kernels, so blocks run eager there
        # (what it counts, collectives and memory, is the engine's, outside the blocks).
        if log is not None:
            log("compiled blocks: none on the meta device (the simulated cluster runs eager)")
        return CompiledBlocks([], backend, checked, None)
    return CompiledBlocks(compiled_modules(sharded), backend, checked, log)


def compile_timers() -> dict[str, float]:
    """Seconds dynamo has spent compiling in this process so far, by timer (forward frames;
    backward graphs), for differences around a region."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: sum(compilation_time_metrics.get(name, ())) for name in
            (_FORWARD_TIMER, _BACKWARD_TIMER) if name in compilation_time_metrics}


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
