"""Entry points: ``init_distributed`` and ``initialize`` (the ``deepspeed.initialize`` twin)."""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

from zeropp.comm import CommGroup
from zeropp.comm.options import QuantizationOptions
from zeropp.comm.registry import collectives_for
from zeropp.comm.streams import execution_for
from zeropp.engine import ZeroEngine
from zeropp.loss_scaler import DynamicLossScaler, LossScaler
from zeropp.offload import HostMemory, OffloadOptions
from zeropp.optimizer import (
    ELEMENTWISE_OPTIMIZERS,
    OptimizerRecipe,
    PartitionedOptimizer,
    megatron_groups,
)
from zeropp.residency import Residency
from zeropp.sharded_model import ShardedModel, ShardingOptions
from zeropp.topology import Topology, build_topology
from zeropp.unit_modules import unit_cap


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> None:
    """Join the process group the launcher described (torchrun, deepspeed, or none).

    With no launcher (plain ``python``), a world of one rank on localhost. The backend is NCCL
    when CUDA is available, else gloo. ``timeout_s`` bounds every collective, so a dead rank
    ends the job instead of hanging it.
    """
    if dist.is_initialized():
        # The script made the group itself: its device may never have been set (every rank
        # of a node would then run on cuda:0). DeepSpeed takes the GPU from LOCAL_RANK.
        if dist.get_backend() != SIMULATED_BACKEND:
            bind_local_device(user_group=True)
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = bind_local_device() if backend == "nccl" else None
    # NCCL with device_id creates its communicator now (and those of the groups split from
    # it), not at the first collective ([Note: eager communicators] in zeropp.topology).
    bound = {"device_id": device} if device is not None else {}
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("WORLD_SIZE", "1") == "1" and "MASTER_PORT" not in os.environ:
        # One rank and no launcher: an in-process store, no port to pick (picking a free
        # port and binding it later races with every other program on the machine).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, **bound)
        return
    if "MASTER_PORT" not in os.environ:
        raise RuntimeError("MASTER_PORT is not set: start multi-rank jobs with a launcher")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, timeout=timeout, **bound)


def bind_local_device(user_group: bool = False) -> torch.device | None:
    """Make this process's GPU current: ``LOCAL_RANK``'s (the launcher's), as DeepSpeed does,
    else the current one; None without CUDA.

    ``user_group``: the process group exists already (the script created it). Its device is
    taken from LOCAL_RANK unless the script chose another GPU on purpose (a current device
    other than cuda:0, or a group bound to a device): then the two disagree and guessing
    would put two ranks on one GPU, so it is a one-line error.
    """
    if not torch.cuda.is_available():
        return None
    local = os.environ.get("LOCAL_RANK")
    count = torch.cuda.device_count()
    index = int(local) if local is not None else torch.cuda.current_device()
    if not 0 <= index < count:
        raise RuntimeError(f"LOCAL_RANK={local} but this process sees {count} GPU(s) "
                           "(check CUDA_VISIBLE_DEVICES and the launcher's --nproc-per-node)")
    device = torch.device("cuda", index)
    if user_group:
        chosen = _bound_device()
        current = torch.cuda.current_device()
        if chosen is None and current != 0:
            chosen = torch.device("cuda", current)
        if chosen is not None and chosen != device:
            raise RuntimeError(
                f"the process group runs on {chosen} but LOCAL_RANK={local} names {device}: set "
                f"the device from LOCAL_RANK before init_process_group, or unset LOCAL_RANK")
    torch.cuda.set_device(device)
    return device


def _bound_device() -> torch.device | None:
    """The device the default process group was created for (``device_id``), if any."""
    try:
        group = dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError, AttributeError):
        return None
    bound = getattr(group, "bound_device_id", None)
    return torch.device(bound) if bound is not None else None

SIMULATED_BACKEND = "zeropp_sim"  # zeropp.simulation's process group: the meta device


def default_device() -> torch.device:
    backend = dist.get_backend() if dist.is_initialized() else None
    if backend == SIMULATED_BACKEND:
        return torch.device("meta")
    if torch.cuda.is_available() and backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hpz_group(topology: Topology, residency: Residency) -> CommGroup | None:
    if residency.secondary_group_size == 1:
        return None
    return CommGroup(topology.hpz_group, residency.secondary_group_size, topology.hpz_rank, False)


def build_engine(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    dtype: torch.dtype = torch.float32,
    gradient_accumulation_steps: int = 1,
    gradient_clipping: float = 0.0,
    loss_scaler: LossScaler | None = None,
    sharding: ShardingOptions | None = None,
    quantization: QuantizationOptions | None = None,
    ranks_per_node: int | None = None,
    device: torch.device | None = None,
    param_init_fn=None,
    unit_modules: list[nn.Module] | None = None,
    lr_scheduler=None,
    config=None,
    optimizer: OptimizerRecipe | None = None,
    offload: OffloadOptions | None = None,
) -> ZeroEngine:
    """Shard ``model`` (on the meta device or materialized) and wrap it in a ``ZeroEngine``.

    The optimizer is ``optimizer`` (a recipe: torch class, defaults, parameter groups), else
    AdamW(lr, betas, eps) with Megatron's groups: ``weight_decay`` on matrices, none on biases
    and norms. ``lr_scheduler`` is a schedule object or a callable taking the optimizer.
    ``offload`` puts model states in host memory ([Note: offload]).
    """
    init_distributed()
    sharding = sharding or ShardingOptions()
    offload = offload or OffloadOptions()
    quantization = quantization or QuantizationOptions()
    topology = build_topology(ranks_per_node, quantization.hpz_size,
                              weight_deltas=quantization.weight_deltas)
    device = device or default_device()
    topology.warm_up(device)  # [Note: eager communicators]
    if param_init_fn is None and hasattr(model, "initial_value"):
        param_init_fn = model.initial_value
    residency = Residency.for_stage(sharding.stage, quantization.hpz_size)
    recipe = optimizer or OptimizerRecipe(
        torch.optim.AdamW, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
        megatron_groups(model, weight_decay))
    group_by_name = recipe.group_by_name(model)  # before sharding replaces any parameter
    # From here on groups are known by name: holding the parameter objects would keep their
    # whole-model storage alive once sharding releases it.
    recipe = dataclasses.replace(recipe, groups=[
        {key: value for key, value in group.items() if key != "params"} for group in recipe.groups])
    execution = execution_for(device, sharding.overlap_comm)
    host = HostMemory(device, offload.pin_memory)
    sharded = ShardedModel(
        model, topology, sharding, dtype, device,
        collectives_for(sharding.stage, quantization, topology, execution),
        _hpz_group(topology, residency), execution, residency,
        param_init_fn=param_init_fn, unit_modules=unit_modules,
        grad_dtype=gradient_shard_dtype(dtype, gradient_accumulation_steps),
        host_shards=host if offload.params else None,
        host_gradients=host if offload.optimizer else None,
    )
    partitioned = PartitionedOptimizer(sharded.units, sharded.initial_masters, recipe,
                                       group_by_name, grad_shards_flat=sharded.grad_shards_flat,
                                       shards_flat=sharded.shards_flat,
                                       host=host if offload.optimizer else None)
    sharded.initial_masters = []  # the optimizer owns the fp32 masters from here on
    # Weights written through zero.GatheredParameters(modifier_rank=...) reach the masters.
    sharded.shard_write_listeners.append(
        lambda index: partitioned.load_shard(index, sharded.units[index].shard))
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(partitioned)  # DeepSpeed's callable: optimizer -> schedule
    elif lr_scheduler is not None:
        from zeropp.deepspeed_api.lr_schedules import bind_client_schedule

        lr_scheduler = bind_client_schedule(lr_scheduler, partitioned)
    return ZeroEngine(
        sharded,
        partitioned,
        loss_scaler or LossScaler(1.0),
        gradient_accumulation_steps=gradient_accumulation_steps,
        gradient_clipping=gradient_clipping,
        lr_scheduler=lr_scheduler,
        config=config,
    )


def gradient_shard_dtype(dtype: torch.dtype, gradient_accumulation_steps: int) -> torch.dtype:
    """Gradient shards in the working dtype, as DeepSpeed keeps its 16-bit gradient
    partitions, unless micro-batches accumulate into them: then fp32, so the sum of many
    small gradients is not rounded at every addition. The reductions deliver 16-bit values
    (qgZ an fp32 sum, rounded once) either way."""
    return dtype if gradient_accumulation_steps == 1 else torch.float32


def make_loss_scaler(fp16_enabled: bool, fp16_config=None) -> LossScaler:
    """DeepSpeed's fp16 block -> a scaler (static when ``loss_scale`` > 0, else dynamic)."""
    if not fp16_enabled:
        return LossScaler(1.0)
    if fp16_config is not None and fp16_config.loss_scale > 0:
        return LossScaler(fp16_config.loss_scale)
    if fp16_config is None:
        return DynamicLossScaler()
    return DynamicLossScaler(
        initial_scale_power=fp16_config.initial_scale_power,
        window=fp16_config.loss_scale_window,
        hysteresis=fp16_config.hysteresis,
        min_scale=fp16_config.min_loss_scale,
        consecutive_hysteresis=fp16_config.consecutive_hysteresis,
    )


def max_unit_numel(zero) -> int | None:
    """The largest unit of sharding: a quarter of ``stage3_max_live_parameters``
    ([Note: units]); the prefetch window does not size units."""
    return unit_cap(zero.stage3_max_live_parameters)


def options_from_config(zero, engine_config=None) -> tuple[ShardingOptions, QuantizationOptions]:
    """``zero_optimization`` block (and the top-level gradient keys of ``engine_config``)
    -> the engine's two option objects (explicit alias table)."""
    top = engine_config
    sharding = ShardingOptions(
        gradient_predivide_factor=top.predivide_factor if top is not None else None,
        communication_dtype=_COMM_DTYPES[top.communication_data_type] if top is not None else None,
        stage=zero.stage,
        prefetch_bucket_numel=zero.stage3_prefetch_bucket_size,
        max_live_numel=zero.stage3_max_live_parameters,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        max_reuse_distance=zero.stage3_max_reuse_distance,
        overlap_comm=zero.overlap_comm,
        max_unit_numel=max_unit_numel(zero),
    )
    if zero.stage in (1, 2):  # ZeRO++ extends stage 3's gathers and reductions only
        return sharding, QuantizationOptions()
    quantization = QuantizationOptions(
        quantized_weights=zero.zero_quantized_weights,
        hpz_size=zero.zero_hpz_partition_size,
        quantized_gradients=zero.zero_quantized_gradients,
        weight_bits=zero.zero_quantized_weights_bits,
        gradient_bits=zero.zero_quantized_gradients_bits,
        gradient_inter_node_bits=zero.zero_quantized_gradients_inter_node_bits,
        block_size=zero.zero_quantization_block_size,
        quantized_secondary=zero.zero_hpz_quantized_secondary,
        error_feedback=zero.error_feedback,
        weight_deltas=zero.zero_quantized_weight_deltas,
        delta_bits=zero.zero_quantized_weight_deltas_bits,
        delta_block_size=zero.zero_quantized_weight_deltas_block_size,
    )
    return sharding, quantization


_COMM_DTYPES = {None: None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def engine_from_config(
    model: nn.Module,
    cfg,
    *,
    optimizer_params: dict | None = None,
    model_parameters=None,
    optimizer=None,
    ranks_per_node: int | None = None,
    param_init_fn=None,
    lr_scheduler=None,
    device: torch.device | None = None,
    unit_modules: list[nn.Module] | None = None,
) -> ZeroEngine:
    """The engine a parsed ``EngineConfig`` describes: the one typed path from a DeepSpeed
    config to the engine, taken by ``initialize`` and by the application.

    The optimizer is ``optimizer`` (a torch optimizer or a callable building one from the
    parameter groups: its class, hyperparameters and groups are kept, and the same class runs
    over the shards), else the config's ``optimizer`` block (``optimizer_params`` overriding
    its params) over ``model_parameters`` (tensors or groups; None: Megatron's decay and
    no-decay groups). A JSON ``scheduler`` block becomes the lr schedule unless
    ``lr_scheduler`` is given. ``unit_modules`` names the units of sharding instead of the
    default ([Note: units]).
    """
    from zeropp.config import ConfigError

    zero = cfg.zero_optimization
    trains = True
    if optimizer is not None:
        if cfg.optimizer is not None:  # DeepSpeed refuses the pair too
            raise ConfigError("an optimizer was passed to initialize and the config has an "
                              "optimizer block: keep one")
        if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
            given = model_parameters if model_parameters is not None else model.parameters()
            optimizer = optimizer(OptimizerRecipe.groups_of(given))
        recipe = OptimizerRecipe.from_optimizer(optimizer)
        if recipe.translated_from is not None and (not dist.is_initialized()
                                                   or dist.get_rank() == 0):
            settings = ", ".join(f"{key}={recipe.defaults[key]}" for key in
                                 ("lr", "betas", "eps", "weight_decay") if key in recipe.defaults)
            print(f"note: {recipe.translated_from} is stepped as torch.optim."
                  f"{recipe.cls.__name__}({settings}) over each rank's shard, with its "
                  f"{len(recipe.groups)} param group(s)", flush=True)
    else:
        # No optimizer block: AdamW with the block's defaults (decay 0, not torch's 0.01).
        params = (dict(cfg.optimizer.params) if cfg.optimizer is not None
                  else {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
        params.update(optimizer_params or {})
        trains = "lr" in params
        if not trains and (cfg.optimizer is not None or optimizer_params):
            raise ConfigError("no learning rate: add an optimizer block or pass optimizer_params")
        if not trains:
            if cfg.scheduler is not None:
                raise ConfigError("a scheduler block needs an optimizer: add an optimizer "
                                  "block or pass one to initialize")
            # [Note: an engine without an optimizer] DeepSpeed builds one (evaluation,
            # inference): forward and backward run, step() refuses. The shards keep their
            # fp32 masters all the same (SGD at lr 0 holds no state): checkpoints and
            # GatheredParameters' writes go through them as in training.
            params = {"lr": 0.0}
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        kind = (cfg.optimizer.type if cfg.optimizer is not None else "AdamW" if trains
                else "SGD")
        groups = (OptimizerRecipe.groups_of(model_parameters) if model_parameters is not None
                  else megatron_groups(model, float(params.get("weight_decay", 0.0))))
        recipe = OptimizerRecipe(ELEMENTWISE_OPTIMIZERS[kind], params, groups)
    sharding, quantization = options_from_config(zero, cfg)
    init_distributed()
    if zero.inert_keys and dist.get_rank() == 0:
        print(f"note: {', '.join(zero.inert_keys)} have no effect at ZeRO stage {zero.stage} "
              "(ZeRO++ extends stage 3)", flush=True)
    if zero.ignored_offload_param and dist.get_rank() == 0:
        print(f"note: zero_optimization.offload_param has no effect at ZeRO stage {zero.stage} "
              "(only stage 3 partitions the weights it would offload)", flush=True)
    engine = build_engine(
        model,
        lr=float(recipe.defaults.get("lr", 1e-3)),
        dtype=_DTYPES[cfg.compute_dtype],
        gradient_accumulation_steps=cfg.gradient_accumulation_steps or 1,
        gradient_clipping=cfg.gradient_clipping,
        loss_scaler=make_loss_scaler(cfg.fp16.enabled, cfg.fp16),
        sharding=sharding,
        quantization=quantization,
        ranks_per_node=ranks_per_node,
        device=device,
        param_init_fn=param_init_fn,
        lr_scheduler=lr_scheduler,
        config=cfg,
        optimizer=recipe,
        unit_modules=unit_modules,
        offload=OffloadOptions.from_zero_config(zero),
    )
    engine.trains = trains
    if lr_scheduler is None and cfg.scheduler is not None:
        from zeropp.deepspeed_api.lr_schedules import schedule_from_config

        engine.lr_scheduler = schedule_from_config(engine.optimizer, cfg.scheduler.type,
                                                   cfg.scheduler.params)
    return engine


def add_config_arguments(parser):
    """DeepSpeed's command-line flags (``--deepspeed``, ``--deepspeed_config``) on ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the engine (kept for DeepSpeed scripts)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="deprecated spelling of --deepspeed_config")
    return parser


def _hidden_size(model: nn.Module) -> int | None:
    """The model's width, where a Hugging Face config or the model itself names it."""
    for owner in (getattr(model, "config", None), model):
        for name in ("hidden_size", "n_embd", "d_model"):
            value = getattr(owner, name, None)
            if isinstance(value, int):
                return value
    return None


def initialize(
    args=None,
    model: nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=None,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
    *,
    ranks_per_node: int | None = None,
    param_init_fn=None,
    optimizer_params: dict | None = None,
    device: torch.device | None = None,
    unit_modules: list[nn.Module] | None = None,
):
    """``deepspeed.initialize``'s twin, with its signature: returns ``(engine, optimizer,
    training_dataloader, lr_scheduler)``.

    - ``config`` / ``config_params``: the DeepSpeed JSON (path or dict, read and parsed
      once; or an ``EngineConfig`` parsed already); else ``args.deepspeed_config``. Hugging
      Face's ``"auto"`` values are resolved from the world size and the model's hidden size
      (``zeropp.config.resolve_auto``).
    - ``optimizer``: a torch optimizer or a callable taking the parameter groups; its class
      (element-wise ones: Adam, AdamW, SGD, Adagrad, ...), hyperparameters and groups are
      honoured over the shards. Else the config's optimizer block over ``model_parameters``
      (None: every parameter, one group, as DeepSpeed), whose groups keep their own lr and
      weight_decay. ``optimizer_params`` overrides the block's params.
    - ``training_data``: a torch Dataset; returned as a DataLoader giving each rank its share
      (DistributedSampler, ``train_micro_batch_size_per_gpu`` per batch), as DeepSpeed does.
    - ``lr_scheduler``: a schedule object or a callable taking the optimizer.
    - ``mpu`` (model parallelism) is refused: the engine is data-parallel only.
    - ``unit_modules`` (keyword, this engine's): the modules to gather and release as units,
      as FSDP2's wrap policy chooses them; by default each block, split below itself when
      it holds more than ``stage3_prefetch_bucket_size`` parameters ([Note: units]).
    ``distributed_port``, ``dist_init_required`` and ``mesh_param`` are accepted and unused:
    the launcher's environment says where the process group is.
    """
    from zeropp.config import ConfigError, EngineConfig, resolve_auto

    if isinstance(args, nn.Module) and model is None:  # initialize(model, ...) positionally
        args, model = None, args
    if model is None:
        raise ValueError("initialize: model is required")
    if mpu is not None:
        raise ValueError("initialize(mpu=...): model parallelism is not supported by this "
                         "engine (data parallel only)")
    if config is not None and config_params is not None:
        raise ConfigError("initialize: config and config_params both given; pass one")
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    init_distributed()
    if isinstance(config, EngineConfig):
        cfg = config  # parsed by the caller (for zero.Init too, say): not parsed again
    else:
        # The file read and Hugging Face's "auto" placeholders filled (a config without them
        # comes back equal), then parsed: once each.
        raw = resolve_auto(config if config is not None else {},
                           world_size=dist.get_world_size(), hidden_size=_hidden_size(model))
        cfg = EngineConfig.from_mapping(raw)
    if cfg.train_batch_size is not None or cfg.train_micro_batch_size_per_gpu is not None:
        cfg = cfg.with_batch_resolved(dist.get_world_size())
    engine = engine_from_config(
        model, cfg, optimizer_params=optimizer_params, model_parameters=(
            model_parameters if model_parameters is not None else model.parameters()),
        optimizer=optimizer, ranks_per_node=ranks_per_node, param_init_fn=param_init_fn,
        lr_scheduler=lr_scheduler, device=device, unit_modules=unit_modules)
    loader = None
    if training_data is not None:
        loader = training_dataloader(engine, training_data, collate_fn)
    # DeepSpeed returns no optimizer for an engine built without one.
    return engine, engine.optimizer if engine.trains else None, loader, engine.lr_scheduler


def training_dataloader(engine: ZeroEngine, dataset, collate_fn=None):
    """DeepSpeed's training loader: each rank reads its share through a DistributedSampler
    (shuffled, seed 0), ``train_micro_batch_size_per_gpu`` samples per batch."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=engine.dp_world_size,
                                 rank=engine.topology.rank)
    return DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(),
                      sampler=sampler, collate_fn=collate_fn)
