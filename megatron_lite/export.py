"""Consolidate a sharded checkpoint into a Hugging Face directory and an fp32 state dict.

    python -m megatron_lite.export --load CKPT_DIR --out HF_DIR [--tag iter_0001000]
        [--fp32-state-dict model_fp32.safetensors] [--bos-token-id N] [--eos-token-id N]

Runs in one process with no process group: the shards are memory-mapped and read parameter
by parameter, whatever world size wrote them. The architecture is the one the checkpoint's
``model_config`` describes (checkpoints written before a switch existed read it as its
default, GPT-2's): GPT-2 (learned positions, LayerNorm, GELU) loads with
``GPT2LMHeadModel.from_pretrained``, Llama (rope, RMSNorm, SwiGLU, with or without grouped
queries, an untied head, biases) with ``LlamaForCausalLM.from_pretrained``; any other mix is
refused with the reason. The padded vocabulary rows are dropped.

The checkpoint does not know its tokenizer: give its bos/eos ids to have ``generate`` stop
at the end of a text; without them GPT-2 gets <|endoftext|> (50256) when the vocabulary is
GPT-2's size, Llama gets none.
"""

from __future__ import annotations

import argparse
import sys

import torch
from safetensors.torch import save_file

import zeropp
from megatron_lite.hf import to_hf
from megatron_lite.model import GPTConfig, GPTModel


def load_consolidated_model(load_dir: str, tag: str | None = None) -> GPTModel:
    """The checkpoint's weights (fp32) in an unsharded ``GPTModel``."""
    client = zeropp.checkpoint_client_state(load_dir, tag)
    if "model_config" not in client:
        raise ValueError(f"{load_dir}: the checkpoint records no model_config (not written by "
                         "pretrain_zeropp_gpt.py)")
    config = GPTConfig(**client["model_config"])
    with torch.device("meta"):
        model = GPTModel(config)
    model.to_empty(device="cpu")
    state = zeropp.consolidate_checkpoint(load_dir, tag)
    missing = sorted(set(dict(model.named_parameters())) - set(state))
    if missing:
        raise ValueError(f"checkpoint lacks parameters {missing}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if tuple(param.shape) != tuple(state[name].shape):
                raise ValueError(f"parameter {name}: checkpoint shape {list(state[name].shape)}"
                                 f" != model shape {list(param.shape)}")
            param.copy_(state[name])
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_lite.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (with 'latest')")
    parser.add_argument("--out", required=True,
                        help="Hugging Face directory to write (GPT-2 or Llama, as the "
                             "checkpoint's model_config says)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument("--fp32-state-dict", default=None,
                        help="also write the consolidated fp32 parameters (safetensors)")
    parser.add_argument("--bos-token-id", type=int, default=None,
                        help="the tokenizer's beginning-of-text id, for the HF config")
    parser.add_argument("--eos-token-id", type=int, default=None,
                        help="the tokenizer's end-of-text id, for the HF config")
    args = parser.parse_args(argv)
    try:
        model = load_consolidated_model(args.load, args.tag)
        to_hf(model, args.out, bos_token_id=args.bos_token_id,
              eos_token_id=args.eos_token_id)
        if args.fp32_state_dict:
            save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
                      args.fp32_state_dict)
    except (zeropp.CheckpointError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"exported {model.num_parameters():,} parameters to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
