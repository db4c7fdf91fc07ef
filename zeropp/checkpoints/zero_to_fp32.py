"""``deepspeed.utils.zero_to_fp32``'s functions on this engine's checkpoints.

    from zeropp.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    convert_zero_checkpoint_to_fp32_state_dict("checkpoints", "fp32_model")  # pytorch_model.bin

The same names, arguments and files as DeepSpeed 0.19's: a state dict of full fp32 parameters
by name (every name of a tied parameter, sharing one tensor, as ``state_dict()`` has them),
read from the fp32 masters of a checkpoint ``save_checkpoint`` wrote
(``zeropp.checkpoint.consolidate``), at whatever world size it was written. The output
directory gets ``pytorch_model.bin`` (``model.safetensors`` with ``safe_serialization``), or
shards of at most ``max_shard_size`` with their index, named as Hugging Face names them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from zeropp.checkpoints.checkpoint import consolidate

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None,
                                             exclude_frozen_parameters=False, lazy_mode=False):
    """Full fp32 parameters by name from ``checkpoint_dir`` (``tag``: its ``latest`` when
    None). ``lazy_mode`` (DeepSpeed's memory saver) returns the same tensors: the shards are
    memory-mapped already. Frozen parameters are in this engine's checkpoints only where
    they have fp32 masters; ``exclude_frozen_parameters`` leaves nothing else out."""
    del lazy_mode, exclude_frozen_parameters
    return consolidate(checkpoint_dir, tag)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None,
                                               exclude_frozen_parameters=False):
    """Write the checkpoint's full fp32 parameters into ``output_dir`` (see the module
    docstring for the files)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag,
                                                     exclude_frozen_parameters)
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    limit = _bytes(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    seen: set[int] = set()
    for name, tensor in state.items():
        nbytes = 0 if id(tensor) in seen else tensor.numel() * tensor.element_size()
        seen.add(id(tensor))
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    stem, suffix = (("model", "safetensors") if safe_serialization else ("pytorch_model", "bin"))
    if len(shards) == 1:
        _write(shards[0], output / f"{stem}.{suffix}", safe_serialization)
        return
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        filename = f"{stem}-{index:05d}-of-{len(shards):05d}.{suffix}"
        _write(shard, output / filename, safe_serialization)
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    index_name = f"{stem}.{suffix}.index.json"
    partial = output / f".{index_name}.{os.getpid()}.partial"
    partial.write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    os.replace(partial, output / index_name)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load the checkpoint's fp32 parameters into ``model`` (moved to the CPU), as DeepSpeed's
    function does; returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def _write(state: dict[str, torch.Tensor], path: Path, safe_serialization: bool) -> None:
    """Written under a temporary name, then renamed: every rank of a job may convert the same
    checkpoint into the same directory at once, and a reader must never see a file half
    written by one while another rewrites it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    _write_file(state, partial, safe_serialization)
    os.replace(partial, path)


def _write_file(state: dict[str, torch.Tensor], path: Path, safe_serialization: bool) -> None:
    if safe_serialization:
        from safetensors.torch import save_file

        # safetensors stores no shared tensors: each tied name gets its own copy.
        seen: set[int] = set()
        plain = {}
        for name, tensor in state.items():
            plain[name] = tensor.clone() if id(tensor) in seen else tensor.contiguous()
            seen.add(id(tensor))
        save_file(plain, os.fspath(path), metadata={"format": "pt"})
    else:
        torch.save(state, path)


def _bytes(size) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size={size!r}: expected a number of bytes or e.g. '5GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])
