"""Sharded checkpoints: atomic saves, loads at any world size, consolidation.

[Note: checkpoint layout]
    DIR/latest                       the tag of the newest complete checkpoint
    DIR/TAG/zero_rank00000.pt ...    one file per rank: its fp32 master shards, Adam moments,
                                     working dtype, loss scaler, RNG states, client state
    DIR/TAG/meta.json                world size, topology, unit layouts, engine config,
                                     tied parameters' further names

Every file is checksummed as it is written and verified before a load; ``--load`` falls
back to the newest checkpoint that verifies ([Note: checkpoint checksums] in
``zeropp/checkpoints/checkpoint_integrity.py``). A save writes everything under ``DIR/TAG.tmp``; after every rank has written (a barrier),
rank 0 renames the directory to ``DIR/TAG`` and only then replaces ``latest`` (temp file +
rename). A crash at any point leaves ``latest`` naming the previous complete checkpoint.

Each shard records, per unit, the parameter slots of its flat buffer and the range of it the
rank owned. A load rebuilds every element of its own new shard by parameter name from the old
shards (memory-mapped, read only where needed; a unit whose saved shard is exactly the new one,
as in a resume at the same world size, is copied straight from it into the optimizer), so a
checkpoint written by N ranks loads on M
ranks, with another ranks-per-node or hpZ size, without a conversion step. Parameters are found
by name in whichever unit holds them, so other units load too (``zeropp.convert`` writes a
DeepSpeed checkpoint as one unit, through ``write_from_one_process``). Files hold only
tensors and plain containers and are read with ``weights_only=True``: loading never runs
pickled code.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from zeropp.acceleration.cuda_graph import set_group_lr
from zeropp.checkpoints.checkpoint_files import CheckpointError, CheckpointStorageError, shard_file
from zeropp.checkpoints.checkpoint_integrity import gather_checksums
from zeropp.checkpoints.checkpoint_io import save_to_file
from zeropp.flat_layout import FlatLayout

# A param group's keys that say how torch's optimizer runs its step, not what it computes.
_STEP_IMPLEMENTATION_KEYS = frozenset({"capturable", "fused", "foreach", "differentiable"})

SHARD_FORMAT = "zeropp-shard-v1"


def _is_storage_failure(error: BaseException) -> bool:
    # torch.save reports a failed write from its zip writer as a RuntimeError
    # ("PytorchStreamWriter failed writing file ...", "[enforce fail at inline_container.cc]").
    if isinstance(error, OSError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "PytorchStreamWriter" in text or "inline_container" in text)


def read_latest(load_dir: str | os.PathLike, must_exist: bool = True) -> str:
    """The tag ``DIR/latest`` names; ``must_exist=False`` returns it even when that
    directory is gone (a fallback then looks further)."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    latest = root / "latest"
    if not latest.is_file():
        raise CheckpointError(
            f"{root} has no 'latest' file: not a checkpoint directory, or no save completed"
        )
    tag = latest.read_text().strip()
    if must_exist and not (root / tag).is_dir():
        raise CheckpointError(f"{latest} names {tag!r}, but {root / tag} does not exist")
    return tag


def unit_record(name: str, layout: FlatLayout, shard_start: int, shard_end: int,
                master: torch.Tensor, state: dict[str, torch.Tensor]) -> dict:
    """One unit's entry in a rank's file: its parameter slots and this rank's range of it."""
    return {
        "name": name,
        "slots": [[s.name, list(s.shape), s.offset] for s in layout.slots],
        "padded_numel": layout.padded_numel,
        "shard_start": shard_start,
        "shard_end": shard_end,
        "master": master.detach().cpu(),
        # The optimizer's element-wise state (Adam: exp_avg, exp_avg_sq), shard-shaped.
        **{key: value.detach().cpu() for key, value in state.items()},
    }


def rank_file_state(*, rank: int, world_size: int, units: list[dict], optimizer_type: str,
                    state_keys: list[str], optimizer_scalars: dict[str, float],
                    param_groups: list[dict], loss_scaler: dict, counters: dict[str, int],
                    lr_scheduler: dict | None, client_state: dict | None,
                    error_feedback: dict | None = None, weight_bases: dict | None = None,
                    rng: dict | None = None) -> dict:
    """Everything one rank's file holds ([Note: checkpoint layout]); ``units`` from
    ``unit_record``. ``rng`` None: no random streams to offer (a converted checkpoint)."""
    return {
        "format": SHARD_FORMAT,
        "rank": rank,
        "world_size": world_size,
        "units": units,
        "optimizer_type": optimizer_type,
        "state_keys": list(state_keys),
        # The optimizer's step (kept under its first name too).
        "adam_step": optimizer_scalars.get("step", 0.0),
        "optimizer_scalars": dict(optimizer_scalars),
        # An lr the device's schedule set is a 0-dim tensor ([Note: step outcome on the
        # device]): saved as the number it holds, as a host-set lr is.
        "param_groups": [{k: v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v
                          for k, v in g.items() if k != "params"} for g in param_groups],
        "loss_scaler": loss_scaler,
        "engine": dict(counters),
        "lr_scheduler": lr_scheduler,
        # qgZ's carried quantization errors: this rank's, in this topology's buckets.
        "error_feedback": error_feedback,
        # The weight-delta gather's bases: this rank's, in this topology's shards.
        "weight_bases": weight_bases,
        "rng": rng,
        "client_state": client_state or {},
    }


def meta_record(*, tag: str, world_size: int, topology: dict, dtype: str,
                units: list[list], config: dict | None, checksums: list,
                shared_params: dict[str, str]) -> dict:
    """``meta.json``: ``units`` as [name, numel, padded_numel]; ``shared_params`` maps each
    further name of a tied parameter to the name its values are stored under."""
    return {
        "format": SHARD_FORMAT,
        "tag": tag,
        "world_size": world_size,
        "topology": topology,
        "dtype": dtype,
        "units": units,
        "config": config,
        # Per rank file: [crc32, bytes] as written.
        "checksums": checksums,
        "shared_params": shared_params,
    }


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """Each further name of a tied parameter -> the first, under which it is stored."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _host_copy(value):
    """``value`` with every tensor in it copied to the host: what the shard file records
    must not change when training goes on while it is written."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _host_copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copy(item) for item in value)
    return value


def save(engine, save_dir: str | os.PathLike, tag: str, client_state: dict | None = None,
         async_save: bool = False, save_latest: bool = True,
         excluded: tuple[str, ...] = ()) -> Path:
    """Write this rank's shard of ``engine``; collective (every rank calls it).

    ``async_save``: return once the shards are being copied to host memory; a background
    thread writes the file, and ``finish_pending`` publishes the checkpoint
    ([Note: asynchronous checkpoint saves]). A save still in flight is finished first.
    ``save_latest=False`` publishes the checkpoint without pointing ``latest`` at it.
    ``excluded``: parameters a load does not restore (it keeps the model's values).
    """
    from zeropp.checkpoints.checkpoint_async import PendingSave, staging_for

    if save_dir is None or not os.fspath(save_dir):  # "" would be the working directory
        raise ValueError(f"save_checkpoint: save_dir must name a directory, got {save_dir!r}")
    finish_pending(engine, wait=True)
    root = Path(save_dir)
    rank = engine.topology.rank
    validation = engine.config.checkpoint.tag_validation if engine.config is not None else "Warn"
    tag = _agreed_tag(tag, engine.sharded.device, validation)
    tmp_dir, final_dir = root / f"{tag}.tmp", root / tag
    device = engine.sharded.device
    error: Exception | None = None
    try:
        if rank == 0:
            if tmp_dir.exists():
                shutil.rmtree(tmp_dir)
            tmp_dir.mkdir(parents=True)
    except Exception as exc:  # agreed below, so no rank waits for one that failed
        error = exc
    _agree_or_raise(error, device, f"cannot create checkpoint directory {tmp_dir}")

    staging = staging_for(engine)
    state = _shard_state(engine, staging, client_state)
    state["excluded_parameters"] = list(excluded)
    pending = PendingSave(engine, staging, state, shard_file(tmp_dir, rank), tmp_dir,
                          final_dir, tag, save_latest=save_latest)
    if async_save:
        pending.start()
        engine._pending_checkpoint = pending
        return final_dir
    pending.run_here()
    return _commit(engine, pending)


def _shard_state(engine, staging, client_state: dict | None) -> dict:
    """What this rank's shard file holds. The units' masters and moments are the staging
    buffers (filled by ``staging.fill``); everything else is copied now."""
    rank, world = engine.topology.rank, engine.topology.world_size
    optimizer = engine.optimizer
    feedback = engine.sharded.error_feedback
    deltas = engine.sharded.weight_deltas
    # The units' masters and moments are the staging buffers, already on the host.
    units = []
    for index, unit in enumerate(engine.sharded.units):
        buffers = staging.unit_buffers(index)
        units.append(unit_record(unit.name, unit.layout, unit.shard_start, unit.shard_end,
                                 buffers["master"],
                                 {key: buffers[key] for key in staging.state_keys}))
    state = rank_file_state(
        rank=rank, world_size=world, units=units,
        optimizer_type=type(optimizer.inner).__name__,
        state_keys=staging.state_keys,
        optimizer_scalars=optimizer.scalar_state(),
        param_groups=optimizer.param_groups,
        loss_scaler=engine.loss_scaler.state_dict(),
        counters={"global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                  "micro_steps": engine.micro_steps},
        lr_scheduler=engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        error_feedback=feedback.state_dict() if feedback is not None else None,
        weight_bases=deltas.state_dict() if deltas is not None else None,
        rng={"torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
        client_state=client_state,
    )
    # Everything but the staged units is copied now: it must not change while training goes
    # on and the file is written.
    return {**_host_copy({key: value for key, value in state.items() if key != "units"}),
            "units": units}


def finish_pending(engine, wait: bool = True) -> Path | None:
    """Publish the asynchronous save in flight, if any; collective.

    ``wait``: block until this rank's file is written. Otherwise the ranks first agree
    whether every writer is done (one small all-reduce) and return None if one is not.
    Returns the published checkpoint's directory, or None when nothing was published. A
    failure of any rank's writer raises here, on every rank (as ``save`` does).
    """
    pending = engine._pending_checkpoint
    if pending is None:
        return None
    if not wait and not pending.all_ranks_done():
        return None
    engine._pending_checkpoint = None
    pending.join()
    if engine.topology.world_size > 1 and not dist.is_initialized():
        # Without the group no rank learns the others' checksums: meta.json would be wrong.
        raise CheckpointError(f"cannot publish checkpoint {pending.final_dir}: the process "
                              "group is gone (finish the save before destroy_process_group)")
    return _commit(engine, pending)


def _commit(engine, pending) -> Path:
    """After every rank wrote its file (or failed): agree, record the checksums in
    ``meta.json``, rename ``TAG.tmp`` to ``TAG``, then replace ``latest``."""
    rank, world = engine.topology.rank, engine.topology.world_size
    device = engine.sharded.device
    tmp_dir, final_dir, tag, root = pending.tmp_dir, pending.final_dir, pending.tag, \
        pending.final_dir.parent
    _agree_or_raise(pending.error, device, f"cannot write checkpoint shard in {tmp_dir}")
    # [Note: checkpoint checksums]: computed while writing, recorded by rank 0.
    checksums = gather_checksums(pending.crc32, pending.nbytes, device)
    error: Exception | None = None
    try:
        if rank == 0:
            meta = meta_record(
                tag=tag, world_size=world, topology=engine.topology.as_dict(),
                dtype=str(engine.sharded.dtype),
                units=[[u.name, u.layout.numel, u.layout.padded_numel]
                       for u in engine.sharded.units],
                config=engine.config.to_dict() if engine.config is not None else None,
                checksums=checksums, shared_params=tied_names(engine.module))
            _atomic_write_text(tmp_dir / "meta.json", json.dumps(meta, indent=1))
    except Exception as exc:
        error = exc
    _agree_or_raise(error, device, f"cannot write checkpoint metadata in {tmp_dir}")

    try:
        if rank == 0:
            _publish(root, tag, pending.save_latest)
    except Exception as exc:
        error = exc
    _agree_or_raise(error, device, f"cannot publish checkpoint {final_dir}")
    return final_dir


def _publish(root: Path, tag: str, save_latest: bool = True) -> None:
    """Move the written ``TAG.tmp`` into place, then point ``latest`` at it (unless not
    ``save_latest``)."""
    tmp_dir, final_dir = root / f"{tag}.tmp", root / tag
    if final_dir.exists():  # re-saving a tag: keep the old one until the new is in place
        old = root / f"{tag}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
        os.replace(tmp_dir, final_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp_dir, final_dir)
    if save_latest:
        _atomic_write_text(root / "latest", tag)


def write_from_one_process(save_dir: str | os.PathLike, tag: str, rank_states,
                           meta_fields: dict) -> Path:
    """Write a whole checkpoint from one process, without a process group (a conversion):
    each of ``rank_states`` (produced one at a time) to its file, checksummed, then
    ``meta.json`` (``meta_record``'s fields but tag and checksums), published as ``save``
    publishes."""
    root = Path(save_dir)
    tmp_dir = root / f"{tag}.tmp"
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)
    checksums = []
    for rank, state in enumerate(rank_states):
        checksums.append(list(save_to_file(state, shard_file(tmp_dir, rank))))
    if len(checksums) != meta_fields["world_size"]:
        raise CheckpointError(f"wrote {len(checksums)} rank files for world size "
                              f"{meta_fields['world_size']}")
    meta = meta_record(tag=tag, checksums=checksums, **meta_fields)
    _atomic_write_text(tmp_dir / "meta.json", json.dumps(meta, indent=1))
    _publish(root, tag)
    return root / tag


class CheckpointTagError(CheckpointError, AssertionError):
    """The ranks passed different tags under ``checkpoint.tag_validation: "Fail"``; an
    AssertionError too, as DeepSpeed raises there."""


def _agreed_tag(tag: str, device: torch.device, validation: str = "Warn") -> str:
    """The tag every rank saves under: ``tag`` when all ranks passed the same one, else rank
    0's, with a warning ("Warn"), silently ("Ignore"), or ``CheckpointTagError`` on every
    rank ("Fail"). A checkpoint is one directory of every rank's shard; ranks passing
    different tags (a tag built from a rank-local value) would each write an incomplete one.
    DeepSpeed compares the ranks' tags the same way (its ``checkpoint.tag_validation``,
    "Warn" by default) and then lets each rank save under its own."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tag
    digest = zlib.crc32(tag.encode())
    spread = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    if int(spread[0]) == -int(spread[1]):
        return tag
    if validation == "Fail":
        raise CheckpointTagError(f"save_checkpoint: the ranks passed different tags (this "
                                 f"rank {tag!r}) and checkpoint.tag_validation is \"Fail\"")
    agreed = [tag]
    dist.broadcast_object_list(agreed, src=0, device=device)
    if dist.get_rank() == 0 and validation == "Warn":
        warnings.warn(f"save_checkpoint: the ranks passed different tags; every rank saves "
                      f"under rank 0's, {agreed[0]!r}", stacklevel=3)
    return agreed[0]


def _agree_or_raise(error: Exception | None, device: torch.device, message: str) -> None:
    """Every rank learns whether any rank failed, so all raise together (nobody hangs).

    A storage failure anywhere raises ``CheckpointStorageError`` on every rank. Any other
    failure is re-raised as it is where it happened (an NCCL or CUDA error, a bug: never
    something to train on past) and as a plain ``CheckpointError`` on the other ranks.
    The flag lives on the engine's device: NCCL groups take no CPU tensors.
    """
    kind = 0.0 if error is None else 1.0 if _is_storage_failure(error) else 2.0
    worst = torch.tensor([kind], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if kind == 2.0:
        raise error
    worst_kind = worst.item()
    if error is not None or worst_kind > 0:
        detail = f": {error}" if error is not None else " (on another rank)"
        if worst_kind == 2.0:
            raise CheckpointError(message + detail)
        raise CheckpointStorageError(message + detail)


class _OldShards:
    """Lazy, memory-mapped access to the shards of a saved checkpoint."""

    def __init__(self, tag_dir: Path) -> None:
        meta_path = tag_dir / "meta.json"
        if not meta_path.is_file():
            raise CheckpointError(f"{tag_dir} has no meta.json: incomplete checkpoint")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != SHARD_FORMAT:
            raise CheckpointError(f"{tag_dir}: unknown checkpoint format {self.meta.get('format')!r}")
        self.tag_dir = tag_dir
        self.world_size = int(self.meta["world_size"])
        self._files: dict[int, dict] = {}

    def rank_state(self, rank: int) -> dict:
        if rank not in self._files:
            path = shard_file(self.tag_dir, rank)
            if not path.is_file():
                raise CheckpointError(f"checkpoint shard {path} is missing")
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            # Every tensor loaded maps the whole file: what may outlive the load (RNG states,
            # client state, error feedback, bases) is copied out, so that the file's memory
            # is unmapped with the units' tensors when the load ends (a kept RNG state held
            # all of it in the process's memory for the rest of the run).
            self._files[rank] = {**_host_copy({k: v for k, v in state.items() if k != "units"}),
                                 "units": state["units"]}
        return self._files[rank]

    def same_shard(self, rank: int, unit, fields) -> dict[str, torch.Tensor] | None:
        """The saved fields of ``unit``'s shard on ``rank`` when the checkpoint holds exactly
        that shard (same slots, same range, fp32, padding zero as a rebuilt shard's is), to be
        copied as they are; else None."""
        if rank >= self.world_size:
            return None
        try:
            record = self.unit(rank, unit.name)
        except CheckpointError:  # saved under another grouping: rebuilt by parameter name
            return None
        layout = unit.layout
        if (record["shard_start"] != unit.shard_start
                or record["shard_end"] != unit.shard_end
                or record["padded_numel"] != layout.padded_numel
                or record["slots"] != [[s.name, list(s.shape), s.offset] for s in layout.slots]
                or any(field not in record for field in fields)):
            return None
        real = layout.filled_in_shard(unit.shard_start)
        values = {field: record[field] for field in fields}
        for value in values.values():
            if (value.dtype != torch.float32 or value.numel() != layout.shard_numel
                    or bool(value[real:].any())):
                return None
        return values

    def unit(self, rank: int, name: str) -> dict:
        for record in self.rank_state(rank)["units"]:
            if record["name"] == name:
                return record
        raise CheckpointError(f"checkpoint has no unit {name!r}: the model structure differs")

    def parameter_units(self) -> dict[str, str]:
        """Each saved parameter's name -> the name of the unit that holds it."""
        return {slot[0]: record["name"] for record in self.rank_state(0)["units"]
                for slot in record["slots"]}

    def read(self, unit_name: str, param: str, shape: tuple, lo: int, hi: int, field: str):
        """Elements [lo, hi) of parameter ``param`` (flattened) from the old shards."""
        first = self.unit(0, unit_name)
        slots = {s[0]: (tuple(s[1]), s[2]) for s in first["slots"]}
        if param not in slots:
            raise CheckpointError(f"checkpoint has no parameter {param!r}")
        old_shape, offset = slots[param]
        if old_shape != tuple(shape):
            raise CheckpointError(
                f"parameter {param!r}: checkpoint shape {list(old_shape)} != model shape "
                f"{list(shape)}"
            )
        shard_numel = first["shard_end"] - first["shard_start"]
        start, end = offset + lo, offset + hi
        pieces = []
        for rank in range(start // shard_numel, (end - 1) // shard_numel + 1):
            record = self.unit(rank, unit_name)
            a = max(start, record["shard_start"]) - record["shard_start"]
            b = min(end, record["shard_end"]) - record["shard_start"]
            pieces.append(record[field][a:b])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def load(engine, load_dir: str | os.PathLike, tag: str | None = None,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
         load_module_only: bool = False) -> dict:
    """Restore ``engine`` from a checkpoint written at any world size; returns client_state.

    ``load_module_only`` restores the weights alone: no optimizer state, loss scale, lr
    schedule or step counters (DeepSpeed's meaning, for fine-tuning from a checkpoint).
    """
    if load_module_only:
        load_optimizer_states = load_lr_scheduler_states = False
    root = Path(load_dir)
    tag = tag or read_latest(root)
    old = _OldShards(root / tag)
    # Parameters are found by name, whichever unit holds them: a checkpoint written with
    # other units (another unit policy, or converted from DeepSpeed) loads all the same.
    saved_units = old.parameter_units()
    ours = {slot.name for unit in engine.sharded.units for slot in unit.layout.slots}
    for what, names in (("lacks", ours - saved_units.keys()), ("has", saved_units.keys() - ours)):
        if names:
            shown = ", ".join(sorted(names)[:3]) + (" ..." if len(names) > 3 else "")
            whose = "the model's parameters" if what == "lacks" else "parameters the model lacks"
            raise CheckpointError(f"checkpoint {what} {whose}: {shown} ({len(names)} in all)")
    optimizer = engine.optimizer
    saved = old.rank_state(0)
    # Checkpoints written before other optimizers were partitioned hold Adam's two moments.
    saved_type = saved.get("optimizer_type", "AdamW")
    state_keys = tuple(saved.get("state_keys", ("exp_avg", "exp_avg_sq")))
    if load_optimizer_states and saved_type != type(optimizer.inner).__name__:
        raise CheckpointError(
            f"checkpoint holds {saved_type} state but the optimizer is "
            f"{type(optimizer.inner).__name__}: load with load_optimizer_states=False")
    fields = ("master", *state_keys) if load_optimizer_states else ("master",)
    # One buffer per field, reused unit after unit (the optimizer copies out of it): memory
    # the size of one unit's shard is touched for the first time, not the whole rank's.
    # Made only for a unit whose shard is rebuilt from pieces: one saved as it is now (a
    # resume at the same world size) is copied from the file's memory directly.
    largest = max(unit.layout.shard_numel for unit in engine.sharded.units)
    device = engine.sharded.units[0].grad_shard.device
    buffers: dict[str, torch.Tensor] = {}
    scalars = saved.get("optimizer_scalars", {"step": saved["adam_step"]})
    excluded = set(saved.get("excluded_parameters", ()))
    for index, unit in enumerate(engine.sharded.units):
        values = old.same_shard(engine.topology.rank, unit, fields)
        if values is None:
            if not buffers:
                buffers = {f: torch.empty(largest, dtype=torch.float32, device=device)
                           for f in fields}
            values = _rebuilt_shard(old, unit, fields, buffers, saved_units)
        if excluded.intersection(slot.name for slot in unit.layout.slots):
            values = {**values, "master": _kept_excluded(optimizer, index, unit,
                                                          values["master"], excluded)}
        state = {key: values[key] for key in state_keys} if load_optimizer_states else None
        optimizer.load_shard(index, values["master"], state, scalars)
        unit.zero_grad_shard()
    del buffers
    mine = old.rank_state(engine.topology.rank) if engine.topology.rank < old.world_size else None
    deltas = engine.sharded.weight_deltas
    if deltas is not None:
        saved_bases = mine.get("weight_bases") if mine is not None else None
        same_layout = old.meta["topology"] == engine.topology.as_dict()
        if saved_bases is not None and same_layout and not load_module_only:
            # In the working dtype, whatever the run that saved them trained in: a base is
            # what the gathers send deltas against, and the hpZ gather sends it as is.
            deltas.load_state_dict(saved_bases, engine.sharded.device, engine.sharded.dtype)
        else:  # bases belong to one topology's shards: the next gathers send them exactly
            deltas.load_state_dict({}, engine.sharded.device, engine.sharded.dtype)
    # Every derived copy of the weights (gathered buffers, hpZ secondary shards) is stale.
    engine.sharded.refresh_after_update("load")

    reference = mine or old.rank_state(0)
    if load_optimizer_states:
        for group, saved in zip(optimizer.param_groups, reference["param_groups"],
                                strict=False):
            # The hyperparameters; how this run's optimizer steps (fused, foreach, capturable
            # for a CUDA graph, ...) is this run's, whatever the saving run's was.
            group.update({key: value for key, value in saved.items()
                          if key != "lr" and key not in _STEP_IMPLEMENTATION_KEYS})
            if "lr" in saved:  # a held lr tensor is written in place (set_group_lr)
                set_group_lr(group, saved["lr"])
        engine.loss_scaler.load_state_dict(reference["loss_scaler"])
    if (load_lr_scheduler_states and engine.lr_scheduler is not None
            and reference["lr_scheduler"] is not None):
        engine.lr_scheduler.load_state_dict(reference["lr_scheduler"])
    if not load_module_only:
        for key, value in reference["engine"].items():
            setattr(engine, key, value)
    feedback = engine.sharded.error_feedback
    if feedback is not None:
        saved = mine.get("error_feedback") if mine is not None else None
        same_layout = old.meta["topology"] == engine.topology.as_dict()
        if saved is not None and same_layout and not load_module_only:
            feedback.load_state_dict(saved, engine.sharded.device)
        else:
            # Errors belong to one rank's buckets in one topology, and to the run whose
            # optimizer state they go with: a module-only load starts them afresh.
            feedback.reset()
    # Each rank's random streams as saved, for the program to restore if it wants them: as
    # DeepSpeed's load_checkpoint, this one leaves the global RNG alone (a script resumed
    # under DeepSpeed shuffles its data as it would have; Megatron's program restores its
    # RNG itself, `restore_rng_state`). Only in the same world: streams belong to ranks.
    engine.loaded_rng_state = (mine["rng"] if mine is not None
                               and old.world_size == engine.topology.world_size else None)
    return dict(reference["client_state"])


def _rebuilt_shard(old: _OldShards, unit, fields, buffers: dict[str, torch.Tensor],
                   saved_units: dict[str, str]) -> dict[str, torch.Tensor]:
    """``unit``'s new shard of each field, gathered parameter by parameter from the old
    shards into ``buffers`` (views of them are returned)."""
    shard_numel = unit.layout.shard_numel
    values = {f: buffers[f][:shard_numel] for f in fields}
    # The slots fill [0, numel) of the flat layout; the padding after them reads as 0.
    real = unit.layout.filled_in_shard(unit.shard_start)
    for field in fields:
        values[field][real:].zero_()
    for slot in unit.layout.slots:
        part = unit.layout.overlap(slot, unit.shard_start, unit.shard_end)
        if part is None:
            continue
        lo, hi = part
        dst = slot.offset + lo - unit.shard_start
        for field in fields:
            values[field][dst : dst + hi - lo] = old.read(
                saved_units[slot.name], slot.name, slot.shape, lo, hi, field
            ).to(unit.grad_shard.device)
    return values


def _kept_excluded(optimizer, index: int, unit, master: torch.Tensor,
                   excluded: set[str]) -> torch.Tensor:
    """``master`` with the elements of the parameters saved as excluded
    (``exclude_frozen_parameters``) taken from the engine's current fp32 weights instead."""
    current = optimizer.shard_master(index)
    master = master.to(current.device, copy=True)
    for slot in unit.layout.slots:
        part = unit.layout.overlap(slot, unit.shard_start, unit.shard_end)
        if slot.name in excluded and part is not None:
            start = slot.offset + part[0] - unit.shard_start
            end = start + part[1] - part[0]
            master[start:end] = current[start:end]
    return master


def restore_rng_state(state: dict | None) -> bool:
    """Set torch's CPU (and CUDA) random streams to a rank's saved ones
    (``engine.loaded_rng_state``); False when there are none (another world size)."""
    if state is None:
        return False
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"])
    return True


def consolidate(load_dir: str | os.PathLike, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 parameters by name from a sharded checkpoint (no process group needed)."""
    root = Path(load_dir)
    tag = tag or read_latest(root)
    old = _OldShards(root / tag)
    out = {}
    for name, _numel, _padded in old.meta["units"]:
        for param, shape, _offset in old.unit(0, name)["slots"]:
            count = math.prod(shape)
            out[param] = old.read(name, param, tuple(shape), 0, count, "master").view(shape).clone()
    # Every name of a tied parameter, as the model's state_dict has them (one tensor).
    for alias, stored in old.meta.get("shared_params", {}).items():
        out[alias] = out[stored]
    return out


def client_state(load_dir: str | os.PathLike, tag: str | None = None) -> dict:
    root = Path(load_dir)
    tag = tag or read_latest(root)
    return dict(_OldShards(root / tag).rank_state(0)["client_state"])
