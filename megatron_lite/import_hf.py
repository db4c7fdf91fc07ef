"""Import a Hugging Face GPT-2 or Llama checkpoint to continue pretraining it.

    python -m megatron_lite.import_hf --hf-dir HF_DIR --save CKPT_DIR \\
        [--make-vocab-size-divisible-by 128] [--seed 1234]

Writes ``CKPT_DIR/iter_0000000`` and ``CKPT_DIR/latest``: a checkpoint in the application's
own sharded format, made by the engine ``pretrain_zeropp_gpt.py`` trains with (one gloo rank
here; the format loads at any world size), so that

    torchrun --nproc_per_node N pretrain_zeropp_gpt.py MODEL_FLAGS --load CKPT_DIR \\
        ...data, batch and lr flags...

starts training from the Hugging Face weights. MODEL_FLAGS, printed at the end, describe
the imported architecture; the run checks them against the checkpoint's ``model_config``.
What the checkpoint holds:

- weights: the HF weights as the fp32 master weights; the padded vocabulary rows (HF has
  none) get our own initialization, a function of ``--seed``;
- progress: iteration 0, 0 consumed samples, 0 updates: the run reads its data from the
  first sample and its lr schedule starts at its beginning, warmup included (no schedule
  state is stored: the run's own --lr flags decide it);
- optimizer: fresh. Adam has taken no step and no moments are stored. The engine still
  records its param-group hyperparameters and loss scale in every checkpoint; here they are
  placeholders (the command line's defaults and a loss scale of 1), and the client state
  says ``imported_from_hf``: the training program then loads the weights only, as with
  ``--no-load-optim``, and takes the optimizer from its own flags (--weight-decay,
  --adam-beta1/2, --adam-eps, and --fp16's dynamic loss scale, whose state a placeholder
  cannot stand in for).

The tokenizer is not part of the checkpoint: the run's tokenizer must have exactly the HF
config's vocab_size tokens (e.g. ``--tokenizer-type HFTokenizer --tokenizer-model HF_DIR``
when HF_DIR holds the model's tokenizer).

Memory: one process holds the whole model several times over (the HF model, its fp32 copy,
the engine's masters): run it on a machine with a few times the fp32 model size.

Errors print one ``error: ...`` line and exit with status 1. Nothing is published as
``latest`` unless the whole checkpoint was written (the engine's saves are atomic), a
``--save`` directory that already holds a checkpoint is refused, and one created here is
removed again on failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

import zeropp
from megatron_lite.checkpointing import checkpoint_tag
from megatron_lite.hf import from_hf, hf_architecture
from megatron_lite.model import GPTConfig, GPTModel
from megatron_lite.training import Trainer
from zeropp.config import EngineConfig

# The command line's optimizer defaults as the placeholder param groups: a resume that loads
# optimizer states anyway (through zeropp directly; the training program does not for an
# imported checkpoint) then changes nothing for a default run.
OPTIMIZER_DEFAULTS = {"lr": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_lite.import_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True,
                        help="local Hugging Face GPT-2 or Llama checkpoint directory")
    parser.add_argument("--save", required=True, help="checkpoint directory to create")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="pad the vocabulary to a multiple of this (default: 128); the "
                             "training run must pass the same value")
    parser.add_argument("--seed", type=int, default=1234,
                        help="initialization seed of the padded vocabulary rows (default: 1234)")
    args = parser.parse_args(argv)
    save = Path(args.save)
    created = not save.exists()
    owns_process_group = False
    try:
        refuse_existing_checkpoint(save)
        model = from_hf(args.hf_dir, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                        seed=args.seed)
        # One rank of gloo unless a launcher says otherwise; the CPU holds the masters.
        owns_process_group = not dist.is_initialized()
        zeropp.init_distributed(backend="gloo")
        path = save_imported(model, save, run_arguments={
            **vars(args), "hf_dir": str(Path(args.hf_dir).resolve())})
        prints = dist.get_rank() == 0  # under a launcher, every rank took part in the save
    except (ValueError, TypeError, OSError, zeropp.CheckpointError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        print(f"error: {message}", file=sys.stderr, flush=True)
        if created:
            shutil.rmtree(save, ignore_errors=True)
        return 1
    finally:
        if owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
    if prints:
        print(resume_instructions(model.config, args.hf_dir, path), flush=True)
    return 0


def refuse_existing_checkpoint(save: Path) -> None:
    """An import never replaces a run's checkpoint: ``latest`` would then name the import."""
    if save.exists() and not save.is_dir():
        raise ValueError(f"--save {save} exists and is not a directory")
    for name in ("latest", checkpoint_tag(0)):
        if (save / name).exists():
            raise ValueError(f"--save {save} already holds a checkpoint ({name}); import into "
                             f"a new directory")


def save_imported(model: GPTModel, save_dir: Path, run_arguments: dict | None = None) -> Path:
    """Shard `model` (full fp32 weights) with the application's engine in the process group
    that exists and save it as the checkpoint of iteration 0; collective. Returns its path.

    The client state is what ``RunControl`` writes and reads: the trainer's progress
    counters (all 0), ``model_config`` (``dataclasses.asdict``, checked on resume), the
    arguments that made it, and no lr schedule state (the run's schedule starts afresh).
    ``imported_from_hf`` marks the optimizer state in it as placeholders.
    """
    config = EngineConfig()
    config = dataclasses.replace(
        config, zero_optimization=dataclasses.replace(config.zero_optimization, stage=3))
    # A materialized model: the engine takes each parameter's value as it is (the HF
    # weights), no initialization runs.
    engine = zeropp.engine_from_config(model, config, optimizer_params=dict(OPTIMIZER_DEFAULTS))
    try:
        client_state = {
            **{key: 0 for key in Trainer.PROGRESS_KEYS},
            "lr_scheduler": None,
            "model_config": dataclasses.asdict(model.config),
            "args": dict(run_arguments or {}),
            "imported_from_hf": (run_arguments or {}).get("hf_dir"),
        }
        return engine.save_checkpoint(str(save_dir), tag=checkpoint_tag(0),
                                      client_state=client_state)
    finally:
        engine.close()


def model_flags(config: GPTConfig) -> list[str]:
    """The ``pretrain_zeropp_gpt.py`` flags (Megatron-LM's names) that build
    ``GPTModel(config)`` for a tokenizer of ``config.vocab_size`` tokens, plus the dropouts
    and norm epsilon the model was made with (not architecture, but a run without them
    would train another network than the one imported)."""
    flags = [
        "--num-layers", _number(config.num_layers),
        "--hidden-size", _number(config.hidden_size),
        "--num-attention-heads", _number(config.num_attention_heads),
        "--ffn-hidden-size", _number(config.ffn_hidden_size),
        "--max-position-embeddings", _number(config.max_position_embeddings),
        "--make-vocab-size-divisible-by", _number(config.make_vocab_size_divisible_by),
    ]
    if config.position_embedding_type != "learned_absolute":
        flags += ["--position-embedding-type", config.position_embedding_type]
    if config.position_embedding_type == "rope":
        flags += ["--rotary-base", _number(config.rotary_base)]
        if config.rotary_percent != 1.0:
            flags += ["--rotary-percent", _number(config.rotary_percent)]
    if config.normalization != "LayerNorm":
        flags += ["--normalization", config.normalization]
    if config.swiglu:
        flags.append("--swiglu")
    if config.num_query_groups is not None:
        flags += ["--group-query-attention", "--num-query-groups",
                  _number(config.num_query_groups)]
    if config.kv_channels is not None:
        flags += ["--kv-channels", _number(config.kv_channels)]
    if config.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if not config.add_bias_linear:
        flags.append("--disable-bias-linear")
    flags += [
        "--layernorm-epsilon", _number(config.layernorm_epsilon),
        "--hidden-dropout", _number(config.hidden_dropout),
        "--attention-dropout", _number(config.attention_dropout),
    ]
    return flags


def resume_instructions(config: GPTConfig, hf_dir: str, path: Path) -> str:
    """What the user runs next: the model flags on one line of their own (``model flags:``),
    then the resume command and the tokenizer it needs."""
    flags = " ".join(model_flags(config))
    load = path.parent
    has_tokenizer = any((Path(hf_dir) / name).is_file() for name in TOKENIZER_FILES)
    tokenizer = (f"--tokenizer-type HFTokenizer --tokenizer-model {hf_dir} (its vocabulary "
                 f"must have exactly {config.vocab_size} tokens)" if has_tokenizer
                 else f"none in {hf_dir}; the run's must have exactly {config.vocab_size} "
                      f"tokens")
    return "\n".join([
        f"imported {hf_dir} ({hf_architecture(config)}, {config.num_parameters():,} parameters, "
        f"vocabulary {config.vocab_size} padded to {config.padded_vocab_size}) as {path}",
        f"model flags: {flags}",
        f"resume: pretrain_zeropp_gpt.py {flags} --load {load} "
        f"--seq-length S (at most {config.max_position_embeddings}) ...data, batch and lr flags",
        f"tokenizer: {tokenizer}",
    ])


def _number(value: float | int | None) -> str:
    """A flag value that parses back to exactly `value` (500000.0 -> "500000", 1e-05)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
