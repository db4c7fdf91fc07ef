"""The key tables: keys accepted with no effect (``ACCEPTED``, each with what happens to it),
DeepSpeed features refused unless left off (``UNSUPPORTED``, each with its reason and the
values that leave it off), other spellings (``ALIASES``), and the check of a key that is no
dataclass field.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

from zeropp.config.checks import (
    Check,
    _boolean,
    _devices,
    _integer,
    _non_negative_float,
    _non_negative_int,
    _object,
    _optional,
    _positive_int,
    _show,
    _string,
    _string_list,
    _unit_interval,
    _unknown_key,
)
from zeropp.config.json_reading import ConfigError


# The key tables. Paths are dotted from the top of the JSON.
class Accepted(NamedTuple):
    check: Check
    meaning: str  # what this engine does with the key


class Unsupported(NamedTuple):
    reason: str
    inert: tuple[Any, ...] = ()  # values that leave the feature off, hence accepted


DISABLED_BLOCK = object()  # inert marker: an object whose "enabled" is false


def _under(section: str, entries: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": entry for key, entry in entries.items()}


def _same_meaning(meaning: str, **checks: Check) -> dict[str, Accepted]:
    return {key: Accepted(check, meaning) for key, check in checks.items()}


_STAGE3_SHORT_NAMES = (
    "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "model_persistence_threshold",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")
ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    **_under("zero_optimization", {name: f"zero_optimization.stage3_{name}" for name in _STAGE3_SHORT_NAMES}),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}

_CLI_CHECKPOINTING = "no effect: --checkpoint-activations alone controls recomputation"
_PROFILER_OFF = "no effect: the flops profiler is not reproduced"
_BYTE_ACCOUNTING = "no effect: the engine's own byte accounting reports communication volume"
# Offload's tuning keys and the aio block concern NVMe offload (refused) or DeepSpeed's own
# buffering; CPU offload ([Note: offload] in zeropp/offload.py) reads only device and
# pin_memory.
_OFFLOAD_TUNING = ("no effect: tunes NVMe offload or DeepSpeed's offload buffers; CPU offload "
                   "here reads only device and pin_memory")
_DEEPCOMPILE_TUNING = "no effect: tunes DeepCompile, which is refused (compile.deepcompile)"
_DEEPCOMPILE_PASS = "a DeepCompile pass; compile.enabled compiles the blocks without DeepCompile"
_NVME_IO = 'no effect: NVMe I/O for offload, which is refused (devices: "none", "cpu")'

ACCEPTED: dict[str, Accepted] = {
    "zero_allow_untested_optimizer": Accepted(
        _boolean, "no effect: the engine always runs its own partitioned optimizer"),
    "memory_breakdown": Accepted(_boolean, "no effect: DeepSpeed's memory printout is not reproduced"),
    "zero_force_ds_cpu_optimizer": Accepted(
        _boolean, "no effect: the offloaded step runs torch's optimizer on the host, whatever "
        "the class"),
    **_under("comms_logger", _same_meaning(_BYTE_ACCOUNTING, enabled=_boolean, verbose=_boolean,
                                           prof_all=_boolean, prof_ops=_string_list, debug=_boolean)),
    "cuda_visible_devices": Accepted(
        _devices, "no effect: DeepSpeed's config does not read it either; the launcher picks devices"),
    "dataloader_drop_last": Accepted(
        _boolean, "no effect: concerns deepspeed_io's loader; the application's loader decides"),
    **_under("flops_profiler", _same_meaning(
        _PROFILER_OFF, enabled=_boolean, profile_step=_positive_int,
        module_depth=_integer(-1, "an integer >= -1"), top_modules=_positive_int,
        detailed=_boolean, output_file=_optional(_string),
        recompute_fwd_factor=_non_negative_float)),
    **_under("activation_checkpointing", {
        **_same_meaning(_CLI_CHECKPOINTING, number_checkpoints=_optional(_positive_int),
                        contiguous_memory_optimization=_boolean,
                        synchronize_checkpoint_boundary=_boolean, profile=_boolean),
        "partition_activations": Accepted(_boolean, "no effect: there are no tensor-parallel ranks"),
    }),
    **_under("aio", {
        **_same_meaning(_NVME_IO, block_size=_positive_int, queue_depth=_positive_int,
                        intra_op_parallelism=_positive_int, single_submit=_boolean,
                        overlap_events=_boolean, use_gds=_boolean),
        "thread_count": Accepted(_positive_int, "no effect: DeepSpeed 0.19 no longer reads it "
                                 "(renamed intra_op_parallelism); NVMe I/O is not used"),
    }),
    **_under("zero_optimization.offload_param", _same_meaning(
        _OFFLOAD_TUNING, nvme_path=_optional(_string), buffer_count=_non_negative_int,
        buffer_size=_non_negative_int, max_in_cpu=_non_negative_int)),
    **_under("zero_optimization.offload_optimizer", _same_meaning(
        _OFFLOAD_TUNING, nvme_path=_optional(_string), buffer_count=_non_negative_int,
        pipeline_read=_boolean, pipeline_write=_boolean, fast_init=_boolean,
        cpuadam_cores_perc=_unit_interval)),
    "zero_optimization.offload_optimizer.ratio": Accepted(
        _unit_interval, "no effect: the whole optimizer state is offloaded (DeepSpeed's "
        "ratio < 1 keeps part of it on the device)"),
    "zero_optimization.offload_optimizer.super_offload": Accepted(
        _boolean, "no effect: the offloaded step is this engine's (SuperOffload's GH200 "
        "scheduling is not reproduced)"),
    "optimizer.params.torch_adam": Accepted(
        _boolean, "no effect on the update: torch's kernel instead of DeepSpeed's (with torch's "
        "AdamW, a missing weight_decay is torch's 0.01)"),
    "optimizer.params.adam_w_mode": Accepted(
        _boolean, "type Adam: true = AdamW, false = Adam with L2 decay; type AdamW ignores it"),
    **_under("compile", _same_meaning(
        _DEEPCOMPILE_TUNING, free_activation=_boolean, free_activation_threshold=_non_negative_int,
        offload_activation_pin_memory=_boolean, double_buffer=_boolean,
        symmetric_memory=_boolean, debug_log=_boolean, dump_graphs=_boolean,
        sync_before_reduce=_boolean, sync_after_reduce=_boolean, sync_before_allgather=_boolean,
        sync_after_allgather=_boolean, keep_int_input_tensors=_boolean,
        keep_all_input_tensors=_boolean)),
    "bf16.immediate_grad_update": Accepted(_boolean, "no effect: a stage 0-2 bf16 optimizer detail"),
    **_under("zero_optimization", {
        "allgather_bucket_size": Accepted(_non_negative_int, "no effect: stage 3 gathers module groups"),
        "allgather_partitions": Accepted(_boolean, "no effect: shards are always all-gathered"),
        "use_multi_rank_bucket_allreduce": Accepted(_boolean, "no effect: a stage 1/2 option"),
        "sub_group_size": Accepted(_non_negative_int, "no effect: the optimizer steps a whole shard"),
        "round_robin_gradients": Accepted(_boolean, "no effect: a stage 1/2 offload option"),
        "parameter_alignment": Accepted(_boolean, "no effect: flat buffers have their own padding"),
        "memory_efficient_linear": Accepted(_boolean, "no effect: nn.Linear is never replaced"),
        "override_module_apply": Accepted(_boolean, "no effect: module.apply is never wrapped"),
        "log_trace_cache_warnings": Accepted(_boolean, "no effect: there is no trace cache"),
        "enable_sanity_checks": Accepted(_boolean, "no effect: DeepSpeed-internal debug checks"),
        "save_muon_momentum_buffer_in_memory": Accepted(_boolean, "no effect: concerns NVMe offload"),
        "stage3_module_granularity_threshold": Accepted(
            _non_negative_int, "no effect: the gather unit is always a whole module group"),
        "stage3_use_all_reduce_for_fetch_params": Accepted(
            _boolean, "no effect: parameters are always fetched by all-gather"),
        "stage3_allgather_sequential": Accepted(
            _boolean, "no effect: each module group is one flat buffer, gathered in one call"),
    }),
}

_DATA_PARALLEL_ONLY = "this engine is data-parallel only"
_OFF = (DISABLED_BLOCK,)

UNSUPPORTED: dict[str, Unsupported] = {
    "amp": Unsupported("NVIDIA Apex AMP; use the fp16 or bf16 block", _OFF),
    "torch_autocast": Unsupported("torch.autocast; use the fp16 or bf16 block", _OFF),
    "compression_training": Unsupported("quantization-aware training and pruning"),
    "quantize_training": Unsupported("MoQ quantization-aware training", _OFF),
    "weight_quantization": Unsupported("inference weight quantization; qwZ quantizes on the wire"),
    "sparse_attention": Unsupported("sparse attention; the GPT model uses dense attention"),
    "pipeline": Unsupported(f"pipeline parallelism; {_DATA_PARALLEL_ONLY}"),
    "tensor_parallel": Unsupported(f"tensor parallelism; {_DATA_PARALLEL_ONLY}"),
    "sequence_parallel_size": Unsupported(f"sequence parallelism; {_DATA_PARALLEL_ONLY}", (1,)),
    "elasticity": Unsupported("elastic batch sizing; set the batch keys directly", _OFF),
    "data_efficiency": Unsupported("data sampling and routing; the GPT dataset orders data", _OFF),
    "curriculum_learning": Unsupported("curriculum learning", _OFF),
    "progressive_layer_drop": Unsupported("progressive layer dropping", _OFF),
    "eigenvalue": Unsupported("Hessian eigenvalue estimation", _OFF),
    "autotuning": Unsupported("the DeepSpeed autotuner", _OFF),
    "hybrid_engine": Unsupported("the RLHF hybrid engine", _OFF),
    **_under("compile", {
        "deepcompile": Unsupported(
            "DeepCompile, which moves ZeRO-3's gathers into the compiled graph; compile.enabled "
            "compiles the blocks with the gathers outside", (False,)),
        **{key: Unsupported(_DEEPCOMPILE_PASS, (False,))
           for key in ("offload_activation", "offload_opt_states", "offload_parameters",
                       "autoep_non_moe")},
        "passes": Unsupported(_DEEPCOMPILE_PASS, (None,)),
    }),
    "comet": Unsupported("the Comet monitor; use the W&B or TensorBoard writers", _OFF),
    "gradient_allreduce_op": Unsupported("gradients are always averaged", ("mean",)),
    "fp16.auto_cast": Unsupported("input autocasting; the model casts its own activations", (False,)),
    "fp16.fp16_master_weights_and_grads": Unsupported("master weights stay fp32", (False,)),
    "bf16.bf16_master_weights_and_grads": Unsupported("master weights stay fp32", (False,)),
    "bf16.bf16_optimizer_states": Unsupported("optimizer states stay fp32", (False,)),
    "bf16.check_overflow": Unsupported("skipping bf16 steps on inf/nan gradients", (False,)),
    "activation_checkpointing.cpu_checkpointing": Unsupported(
        "checkpointed activations stay in device memory", (False,)),
    "data_types.grad_accum_dtype": Unsupported(
        "gradients accumulate across micro-batches in fp32; 16-bit accumulation would round "
        "them", (None, "fp32")),
    "data_types.param_dtype": Unsupported("weights take the fp16/bf16 block's dtype", (None,)),
    "data_types.buffer_dtype": Unsupported("buffers keep the dtype the model gives them", (None,)),
    "optimizer.params.bias_correction": Unsupported(
        "the Adam update always corrects the moment bias", (True,)),
    "optimizer.params.max_grad_norm": Unsupported("DeepSpeed rejects it too: use gradient_clipping"),
    "checkpoint.load_universal": Unsupported("universal checkpoints", (False,)),
    "checkpoint.use_node_local_storage": Unsupported("node-local checkpoint storage", (False,)),
    **_under("zero_optimization", {
        "zenflow": Unsupported("ZenFlow's asynchronous offloaded updates", (None,)),
        "mics_shard_size": Unsupported("MiCS; zero_hpz_partition_size gives node-local gathers", (-1,)),
        "mics_hierarchical_params_gather": Unsupported("MiCS sharding", (False,)),
        "reduce_scatter": Unsupported(
            "stages 1-3 always reduce-scatter gradients and stage 0 all-reduces them", (True,)),
        "contiguous_gradients": Unsupported(
            "gradients always move into one flat buffer per module group", (True,)),
        "zero_quantized_nontrainable_weights": Unsupported(
            "weights stored quantized; qwZ quantizes only what crosses the wire", (False,)),
        "stage3_model_persistence_threshold": Unsupported(
            "a cap on persistent parameters; the per-group threshold alone decides", (sys.maxsize,)),
        "legacy_stage1": Unsupported("the legacy stage 1 optimizer", (False,)),
        "load_from_fp32_weights": Unsupported("checkpoints always restore fp32 master weights", (True,)),
        "compute_grad_norm": Unsupported("the global gradient norm is always computed", (True,)),
        "pipeline_loading_checkpoint": Unsupported("pipeline checkpoint loading", (False,)),
        "leaf_module": Unsupported("leaf modules; the gather unit is already a module group", (None, {})),
    }),
}


def _is_inert(value: Any, inert: Any) -> bool:
    if inert is DISABLED_BLOCK:
        return isinstance(value, Mapping) and value.get("enabled") is False
    if isinstance(inert, bool) or isinstance(value, bool):
        return value is inert  # keeps False from matching 0 and True from matching 1
    return value == inert  # 1 == 1.0 as in JSON; dicts compare by content


def _require_inert(path: str, value: Any) -> None:
    entry = UNSUPPORTED.get(path)
    if entry is None or any(_is_inert(value, inert) for inert in entry.inert):
        return
    shown = "" if isinstance(value, (Mapping, list)) else f"={_show(value)}"
    allowed = " or ".join('an object with "enabled": false' if inert is DISABLED_BLOCK
                          else _show(inert) for inert in entry.inert)
    suffix = f"; accepted only as {allowed}" if allowed else ""
    raise ConfigError(f"{path}{shown} is not supported by this engine ({entry.reason}){suffix}")


def _children(section: str) -> set[str]:
    """Names the tables know directly under ``section`` ("" is the top level)."""
    prefix = f"{section}." if section else ""
    return {key[len(prefix):].split(".", 1)[0]
            for key in (*ALIASES, *ACCEPTED, *UNSUPPORTED) if key.startswith(prefix)}


# Blocks DeepSpeed reads as optional: null means the block is absent.
_NULL_MEANS_ABSENT = {"aio", "zero_optimization.offload_param", "zero_optimization.offload_optimizer"}


def _check_table_key(path: str, value: Any, siblings: set[str]) -> None:
    """Validate a key that is no dataclass field: a table entry, an accepted block, or a typo."""
    if value is None and path in _NULL_MEANS_ABSENT:
        return
    if path in UNSUPPORTED:
        _require_inert(path, value)
    elif path in ACCEPTED:
        ACCEPTED[path].check(path, value)
    elif _children(path):
        for key, item in _object(path, value).items():
            if "." in key:  # a dotted key would otherwise alias a nested table path
                _unknown_key(f"{path}.{key}", set())
            _check_table_key(f"{path}.{key}", item, _children(path))
    else:
        _unknown_key(path, siblings)
