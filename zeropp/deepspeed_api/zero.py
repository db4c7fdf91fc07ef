"""``deepspeed.zero``'s user API on this engine: ``GatheredParameters`` and ``Init``.

    with zeropp.zero.Init():                       # nothing allocated: meta tensors
        model = MyModel()
    engine, *_ = zeropp.initialize(model, config=ds_config)   # each rank materializes its shard

    with zeropp.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.zero_()           # on exit: every rank's shard and fp32 master

The meanings are DeepSpeed 0.19's (``deepspeed/runtime/zero/partition_parameters.py``);
where this engine differs, the docstrings say how.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

from zeropp.deepspeed_params.param_face import answer_deepspeed_calls
from zeropp.sharded_model import ShardedModel, find_unit
from zeropp.unit import ShardedUnit, ShardState

__all__ = ["GatheredParameters", "Init", "gather_for_deepspeed", "partition_for_deepspeed"]


class GatheredParameters:
    """Whole, exact values of ZeRO-sharded parameters inside the block (collective).

    ``params`` is one parameter or an iterable of them (a generator such as
    ``model.parameters()`` is fine), taken from a model an engine wraps. Every rank must
    enter the context with the same parameters: the units holding them are gathered (a unit
    is one block's parameters, so its other parameters are whole too) and stay whole until
    the context exits, even if the model runs a forward inside it. Parameters no engine
    manages (a plain module's) pass through untouched, as DeepSpeed does with non-ZeRO
    parameters; with none managed the context does nothing.

    On exit, with ``modifier_rank=None`` whatever was changed is discarded: the weights are
    the shards' again. With ``modifier_rank=r`` rank r's values of the gathered units are
    broadcast and become every rank's shard; the units' other copies are refreshed as after
    an optimizer step, and ``ShardedModel.shard_write_listeners`` (the optimizer's fp32
    masters) are told about every shard that changed. Unlike DeepSpeed, stages 0-2 take
    part too (their weights are whole already, but the change must reach the masters and
    the other ranks). Adam's moments and step count are kept. In bf16/fp16 training a
    changed unit's masters restart from its working values, so its unchanged parameters
    lose the masters' extra precision.

    Contexts may nest only on disjoint units (DeepSpeed refuses overlapping parameters
    too). ``fwd_module`` (external parameters used by another module's forward) is not
    supported: a parameter must be used by its own module, or tied at the root module.
    ``enabled=False`` does nothing.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self._units: list[tuple[ShardedModel, int]] = []
        if not enabled:
            return
        if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
            params = [params]
        found = {}
        for param in params:
            hit = find_unit(param) if isinstance(param, torch.Tensor) else None
            if hit is not None:
                found[(hit[0].serial, hit[1])] = hit
        # The same order on every rank: engines by construction, units by index.
        self._units = [found[key] for key in sorted(found)]
        if not self._units:
            self.enabled = False
            return
        if fwd_module is not None:
            raise ValueError("GatheredParameters(fwd_module=...) is not supported: external "
                             "parameters would need gathering in another module's backward")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if modifier_rank is not None and not 0 <= modifier_rank < world:
            raise ValueError(f"modifier_rank={modifier_rank} is not a rank of the "
                             f"data-parallel world of {world}")
        # Per unit: what restores it on exit (see __enter__).
        self._gathered_here: list[bool] = []
        self._saved: list[torch.Tensor | None] = []

    def __enter__(self) -> None:
        if not self.enabled:
            return
        held = [unit.name for unit in self._unit_objects() if unit.holds]
        if held:  # the same on every rank, so every rank raises before any collective
            raise RuntimeError("nested GatheredParameters contexts cannot overlap: units "
                               f"{held} are already held by an outer context")
        for sharded in dict.fromkeys(s for s, _ in self._units):
            sharded.settle()
        for sharded, index in self._units:
            unit = sharded.units[index]
            was_gathered = unit.state is ShardState.GATHERED
            saved = None
            if unit.replicated:
                # Its shard lies inside ``full``: a change overwrites it, so keep a copy
                # (this rank's 1/N, the whole unit at stage 0) to discard or detect changes.
                saved = unit.shard.clone()
            elif was_gathered and self.modifier_rank is None:
                # Gathered already (small persistent unit, a forward in progress): restored
                # as it was on exit, possibly qwZ's dequantized values.
                saved = unit.full.clone()
            # Gathered exactly already: no collective, but the unit learns that its whole
            # weights are lent to the user ([Note: storage lent to the user]).
            unit.gather_exact(sharded.stats, refresh=was_gathered and not unit.gathers_exactly)
            unit.holds += 1
            self._gathered_here.append(not was_gathered)
            self._saved.append(saved)

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        try:
            for sharded in dict.fromkeys(s for s, _ in self._units):
                sharded.settle()  # a forward inside the context may have prefetched
            if self.modifier_rank is None:
                self._discard()
            else:
                self._write_back(self.modifier_rank)
        finally:
            for unit in self._unit_objects():
                unit.holds -= 1
            for gathered_here, (sharded, index) in zip(self._gathered_here, self._units,
                                                       strict=True):
                if gathered_here:
                    sharded.units[index].release(keep_secondary=False)
            self._gathered_here, self._saved = [], []

    def _unit_objects(self) -> list[ShardedUnit]:
        return [sharded.units[index] for sharded, index in self._units]

    def _discard(self) -> None:
        for unit, saved, (sharded, _) in zip(self._unit_objects(), self._saved, self._units,
                                             strict=True):
            if unit.replicated:
                unit.shard.copy_(saved)
                # Other ranks' ranges of the whole weights come back from their shards.
                unit.gather_exact(sharded.stats, refresh=True)
            elif saved is not None:
                unit.full.copy_(saved)
            # Gathered here: released on exit, the shard never changed.

    def _write_back(self, src: int) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        for unit, saved, (sharded, index) in zip(self._unit_objects(), self._saved,
                                                 self._units, strict=True):
            if world > 1:
                # Over the whole data-parallel world, whatever the stage: replicated units
                # (stages 0-2) live on every rank too. Bytes, so any dtype goes.
                if sharded.topology.rank == src:
                    sharded.stats.record("optimizer", sharded.topology.spans_nodes,
                                         unit.full.numel() * unit.full.element_size()
                                         * (world - 1))
                dist.broadcast(unit.full.view(torch.uint8), src=src)
            # Any shard may have changed, and whether one did is a per-rank fact: every rank
            # forgets every written unit's weight-delta base alike ([Note: weight deltas]).
            unit.comm.gather.forget(unit.name)
            mine = unit.full[unit.shard_start : unit.shard_end]
            if unit.replicated:  # ``mine`` is the shard itself
                changed = not torch.equal(mine, saved)
            else:
                changed = not torch.equal(mine, unit.shard)
                if changed:
                    unit.shard.copy_(mine)
            if changed:
                sharded.shard_written(index)
            # The whole weights now equal the shards on every rank. A persistent stage-3
            # unit is gathered anew as after a step (qwZ's values when qwZ is on); the
            # others keep the exact values or are released on exit.
            unit.drop_secondary()
            if unit.persistent and not unit.replicated:
                unit.holds -= 1  # let refresh_after_update re-gather it the step's way
                try:
                    unit.refresh_after_update()
                finally:
                    unit.holds += 1


# [Note: storage lent to the user]
# Inside a gather made for the user (``GatheredParameters``, DeepSpeed's own one through
# ``gather_for_deepspeed``, ``ShardedModel.gathered_parameters``: all through
# ``ShardedUnit.gather_exact``) a parameter's ``.data`` is a view of its unit's flat buffer
# ``full``, and the user may keep it, or a view of it, or on a CPU job ``.cpu()`` of it (the
# same tensor): DeepSpeed-Chat's ``save_zero_three_model`` keeps ``v.data.cpu()`` and saves it
# after the context exits. DeepSpeed releases a parameter by rebinding ``param.data`` to an
# empty tensor, so such a reference keeps the gathered values alive. The engine's own release
# resizes the storage to 0 bytes instead ([Note: parameter storage] in zeropp/unit.py), which
# would leave the user's tensor with no memory under it (torch.save then writes an empty
# storage: "Trying to resize storage that is not resizable" on load). So a unit lent to the
# user is released once by rebinding: ``full`` and its views become new tensors on a new,
# empty storage, and the old storage lives as long as a user's tensor does (the whole unit's
# buffer, as every parameter of a unit is a view of it). The next gather, and every release
# after it, is the engine's own and resizes as before: forward and backward keep freeing
# their gathers at once, while autograd still holds views of them.
#
# [Note: DeepSpeed's GatheredParameters on this engine's parameters]
# A script that keeps ``import deepspeed`` in its own helpers (DeepSpeed-Chat's dschat package
# does, for ``save_zero_three_model``) gathers this engine's parameters with DeepSpeed's own
# ``deepspeed.zero.GatheredParameters``. That context does no gathering itself: on entry it
# calls ``params[0].all_gather(param_list=params)`` and on exit
# ``params[0].partition(param_list=params, has_been_updated=...)``, methods DeepSpeed's
# ``zero.Init`` puts on each parameter. The stage-3 parameters here answer those two calls
# (``zeropp.deepspeed_params.param_face``, to which this module hands the two functions below) by
# opening and closing this module's ``GatheredParameters`` on the same list, held in
# ``_HELD_FOR_DEEPSPEED`` between the two. With ``modifier_rank=r``
# DeepSpeed broadcasts rank r's whole values itself before ``partition(has_been_updated=True)``,
# so every rank holds r's values then, and writing back any rank's (0's) is writing r's.
_HELD_FOR_DEEPSPEED: dict[frozenset[int], GatheredParameters] = {}


def gather_for_deepspeed(params: list[torch.Tensor]) -> None:
    """``param.all_gather(param_list=params)`` as DeepSpeed's GatheredParameters calls it."""
    key = frozenset(id(p) for p in params)
    if key in _HELD_FOR_DEEPSPEED:
        raise RuntimeError("these parameters are already gathered by an open "
                           "deepspeed.zero.GatheredParameters context")
    context = GatheredParameters(params)
    context.__enter__()
    _HELD_FOR_DEEPSPEED[key] = context


def partition_for_deepspeed(params: list[torch.Tensor], has_been_updated: bool) -> None:
    """``param.partition(param_list=params, has_been_updated=...)``: the matching exit. A
    list this engine did not gather for DeepSpeed is released already: nothing to do."""
    context = _HELD_FOR_DEEPSPEED.pop(frozenset(id(p) for p in params), None)
    if context is None:
        return
    if has_been_updated and context.enabled:
        context.modifier_rank = 0  # every rank holds the modifier's values (see the note)
    context.__exit__(None, None, None)


answer_deepspeed_calls(gather_for_deepspeed, partition_for_deepspeed)


# Arguments whose DeepSpeed meaning needs something this engine does not do.
_REFUSED = {
    "remote_device": "parameter offload (remote_device='cpu'/'nvme') is not supported",
    "pin_memory": "pinned memory applies to parameter offload, which is not supported",
    "mpu": "model parallelism (mpu) is not supported: every rank holds the whole model",
    "zero_param_parallel_group": "a secondary parameter group is set by the config's "
                                 "zero_hpz_partition_size",
    "zero_quantized_weights": "qwZ is set by the config's zero_quantized_weights",
    "zero_quantized_nontrainable_weights": "quantized frozen weights are not supported",
    "sequence_data_parallel_group": "sequence parallelism is not supported",
    "param_swapper": "parameter swapping (NVMe offload) is not supported",
}

# The variables DeepSpeed's init_distributed reads from a launcher (torchrun, deepspeed).
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")

_CONFIG_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                  "bfloat16": torch.bfloat16}


class Init:
    """Build a model without materializing it: a context under which modules are created on
    the meta device, so construction allocates nothing on any rank.

    The engine (``zeropp.initialize`` / ``build_engine``) then materializes only each rank's
    shard, unit by unit. Initial values come from ``param_init_fn`` or the model's
    ``initial_value(name)`` when given, else from each module's own ``reset_parameters()``
    run on a copy of one unit at a time (``zeropp.initial_values.reset_parameters_values``):
    the same distributions as eager construction, but drawn from fixed per-module seeds
    rather than the global random stream, so the values differ from an eager build's (and
    are the same on every rank and every run). Parameters whose modules have no
    ``reset_parameters()`` need ``initial_value``/``param_init_fn``; buffers must be given
    real values (a buffer still on the meta device is refused when the engine is built).
    Tensors created with an explicit device inside the context are real, as they would be.

    ``dtype`` (or, without it, the config's fp16/bf16 switch, as in DeepSpeed) is the
    default floating dtype inside the context, so parameters are created, and initialized,
    in it. The config (``config_dict_or_path`` or ``config``) may be an ``EngineConfig``
    parsed already: pass the same one to ``zeropp.initialize`` and the JSON is read and
    parsed once for both. ``module`` (an already built model) needs nothing: the engine
    shards it. The partitioning group is always the whole world. Arguments asking for what
    this engine lacks (offload, model or sequence parallelism) raise ``ValueError`` naming
    them. In a launched job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK set) it
    joins the process group if none exists, as DeepSpeed's does. ``enabled=False``
    constructs normally.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None, tensor_overrides=None):
        self.enabled = enabled
        self._stack: contextlib.ExitStack | None = None
        if not enabled:
            return
        given = {"remote_device": remote_device not in (None, "none"), "pin_memory": pin_memory,
                 "mpu": mpu is not None,
                 "zero_param_parallel_group": zero_param_parallel_group is not None,
                 "zero_quantized_weights": zero_quantized_weights,
                 "zero_quantized_nontrainable_weights": zero_quantized_nontrainable_weights,
                 "sequence_data_parallel_group": sequence_data_parallel_group is not None,
                 "param_swapper": param_swapper is not None}
        for name, is_set in given.items():
            if is_set:
                raise ValueError(f"zero.Init({name}=...): {_REFUSED[name]}")
        if data_parallel_group is not None and dist.is_initialized() and (
                dist.get_world_size(data_parallel_group) != dist.get_world_size()):
            raise ValueError("zero.Init(data_parallel_group=...): the engine shards over the "
                             "whole world, not a subgroup")
        if tensor_overrides is not None:
            raise ValueError("zero.Init(tensor_overrides=...) is not supported: use dtype")
        config_dict_or_path = config_dict_or_path if config_dict_or_path is not None else config
        if dtype is None and config_dict_or_path is not None:
            from zeropp.config import EngineConfig

            # A path or dict is parsed for its refusals too (offload and other unsupported
            # keys); an EngineConfig the caller parsed already (and will pass to initialize)
            # is not parsed again.
            parsed = (config_dict_or_path if isinstance(config_dict_or_path, EngineConfig)
                      else EngineConfig.from_json(config_dict_or_path))
            dtype = _CONFIG_DTYPES[parsed.compute_dtype]
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"zero.Init(dtype={dtype}): a floating-point dtype is needed")
        self.dtype = dtype
        self.module = module
        # DeepSpeed's zero.Init joins the process group a launcher describes (a script may
        # call dist.get_rank() inside it); without a launcher DeepSpeed would look for MPI,
        # and this engine's initialize starts the one-rank group itself.
        if not dist.is_initialized() and all(name in os.environ for name in _LAUNCHER_ENV):
            from zeropp.deepspeed_api.initialize import init_distributed

            init_distributed()

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(torch.device("meta"))
        if self.dtype is not None:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            self._stack.callback(torch.set_default_dtype, previous)
        return self

    def __exit__(self, *exc) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
