"""Moving weights between a `GPTModel` and a Hugging Face state dict: the part the GPT-2 and
the Llama converters share.

Each converter describes its architecture as a list of `TensorMapping`s (which HF tensors
make up which of our parameters); this module does the rest the same way for both: build the
model on the meta device and initialize it (the padded vocabulary rows keep our own initial
values), copy every mapped tensor in with its shape checked, or cut every parameter back into
HF tensors (padded rows dropped) and write the directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, PreTrainedConfig

from megatron_lite.model import GPTConfig, GPTModel

# Our parameters whose rows are the (padded) vocabulary; HF stores only the real rows.
VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class TensorMapping:
    """One GPTModel parameter and the HF tensors it is made of, stacked along dim 0 in order
    (Llama's q|k|v and gate|up), each transposed first when `transpose` (GPT-2's Conv1D
    weights are (in, out)). `rows` splits the parameter back on export; None: one tensor."""

    ours: str
    theirs: tuple[str, ...]
    rows: tuple[int, ...] | None = None
    transpose: bool = False


def model_from_hf_state(config: GPTConfig, hf_state: Mapping[str, torch.Tensor],
                        mappings: Sequence[TensorMapping], architecture: str) -> GPTModel:
    """An fp32 CPU `GPTModel(config)` holding the mapped HF tensors; the padded vocabulary
    rows, which HF does not have, get our initialization (a function of config.seed)."""
    with torch.device("meta"):
        model = GPTModel(config)
    model.to_empty(device="cpu")
    model.init_weights()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for mapping in mappings:
            missing = [name for name in mapping.theirs if name not in hf_state]
            if missing:
                raise ValueError(f"the {architecture} checkpoint lacks {missing[0]}")
            pieces = [hf_state[name].detach().to(device="cpu", dtype=torch.float32)
                      for name in mapping.theirs]
            source = torch.cat([p.t() if mapping.transpose else p for p in pieces])
            target = params[mapping.ours]
            if mapping.ours in VOCAB_PARAMETERS:
                target = target[: config.vocab_size]  # (V, h) of (padded V, h)
            if source.shape != target.shape:
                raise ValueError(f"{' + '.join(mapping.theirs)} has shape "
                                 f"{tuple(source.shape)} but {mapping.ours} expects "
                                 f"{tuple(target.shape)}")
            target.copy_(source)
    return model


def hf_state_from_model(model: GPTModel,
                        mappings: Sequence[TensorMapping]) -> dict[str, torch.Tensor]:
    """The HF tensors of `model` (full parameters, in their own dtype, padded rows dropped)."""
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for mapping in mappings:
        param = params[mapping.ours]
        if param.is_meta:
            raise ValueError(f"{mapping.ours} is on the meta device; materialize the model "
                             f"before exporting it")
        tensor = param.detach().to("cpu")
        if mapping.ours in VOCAB_PARAMETERS:
            tensor = tensor[: model.config.vocab_size]
        rows = mapping.rows or (tensor.shape[0],)
        for name, piece in zip(mapping.theirs, tensor.split(rows), strict=True):
            tensors[name] = (piece.t() if mapping.transpose else piece).contiguous()
    return tensors


def write_hf_directory(out_dir: str | os.PathLike, hf_config: PreTrainedConfig,
                       tensors: dict[str, torch.Tensor], dtype: torch.dtype, *,
                       generation_config: bool = False) -> None:
    """config.json (+ generation_config.json) and model.safetensors in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.dtype = dtype
    hf_config.save_pretrained(out)
    if generation_config:
        # What generate() reads its special ids from (from_pretrained falls back to the
        # model config without it; written anyway, as HF's own save_pretrained does).
        GenerationConfig.from_model_config(hf_config).save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
