"""What the host-work benches share (``host_ops`` counts ops, ``host_python`` times Python):
the tutorial's command line, the model as the program builds it, one batch, the DeepSpeed
JSON of each system, and torch.optim's CUDA choice of implementation on any device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# The ZeRO++ tutorial's 18B.
TUTORIAL_FLAGS = ("--num-layers 40 --hidden-size 6144 --num-attention-heads 32 --seq-length 512 "
                  "--micro-batch-size 1 --global-batch-size 64 --fp16 "
                  "--checkpoint-activations").split()
ZEROPP_CONFIG = ROOT / "configs" / "ds_zeropp_config.json"


def program_argv(overrides: list[str]) -> list[str]:
    """The tutorial's flags with ``overrides`` (Megatron flags) in place of the same ones."""
    replaced = {arg.split("=", 1)[0] for arg in overrides if arg.startswith("--")}
    argv, dropping = [], False
    for arg in TUTORIAL_FLAGS:
        if arg.startswith("--"):
            dropping = arg in replaced
        if not dropping:
            argv.append(arg)  # a flag kept, or the value of one
    argv += overrides
    if not any(arg.split("=", 1)[0] in ("--deepspeed_config", "--deepspeed-config")
               for arg in argv):
        argv += ["--deepspeed_config", str(ZEROPP_CONFIG)]
    return argv


@contextlib.contextmanager
def optimizers_as_on_cuda() -> Iterator[None]:
    """torch.optim's default implementation for CUDA tensors (foreach) on any device.

    Left to itself, torch picks its per-tensor loop for meta and CPU tensors: about a dozen
    ops per tensor where foreach issues a dozen per parameter group. Every row runs on meta or
    CPU tensors standing in for CUDA ones, so each takes the CUDA choice.
    """
    from torch.optim import optimizer

    original = optimizer._get_foreach_kernels_supported_devices
    optimizer._get_foreach_kernels_supported_devices = \
        lambda: [*original(), "meta", "cpu"]
    try:
        yield
    finally:
        optimizer._get_foreach_kernels_supported_devices = original


# ---- the model as the program builds it ---------------------------------------------------
def build_model(argv: list[str], device: str, nodes: int, gpus_per_node: int):
    """(parsed args, GPTModel on ``device``) as ``pretrain_gpt.build_training`` builds them
    for this command line on ``nodes x gpus_per_node`` ranks (the DeepSpeed JSON reconciled,
    the same vocabulary)."""
    from data.tokenizers import build_tokenizer
    from megatron_lite.arguments import gpt_config_from_args, parse_args, validate_args
    from megatron_lite.ds_config import read_ds_config
    from megatron_lite.model import GPTModel
    from megatron_lite.simulate import training_argv

    args = parse_args(training_argv(argv, gpus_per_node, iterations=3, ds_config=None))
    read_ds_config(args)
    validate_args(args, nodes * gpus_per_node)
    tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                                merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                                vocab_size=args.vocab_size)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = GPTModel(gpt_config_from_args(args, tokenizer.vocab_size))
    return args, model


def one_batch(args, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, labels, loss_mask) of one micro-batch, made before the counted window."""
    shape = (args.micro_batch_size, args.seq_length)
    tokens = torch.zeros(shape, dtype=torch.long, device=device)
    return tokens, tokens.clone(), torch.ones(shape, device=device)


def math_attention(device: str):
    """SDPA's math path on the CPU: the one meta tensors take (module docstring)."""
    if device == "meta":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def engine_ds_config(argv: list[str], system: str) -> dict:
    """The DeepSpeed JSON of ``argv`` for ``system``: as given (zeropp), the dry run's ZeRO-3
    baseline of it (zero3), or with 2-bit weight deltas (deltas2)."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.dry_run import baseline_ds_config
    from megatron_lite.ds_config import read_ds_config

    ds_config = read_ds_config(parse_args(argv))
    if system == "zero3":
        return baseline_ds_config(ds_config)
    config = ds_config.explicit_dict()  # the file's keys only: added ones go in by hand
    if system == "deltas2":
        config.setdefault("zero_optimization", {}).update(
            zero_quantized_weight_deltas=True, zero_quantized_weight_deltas_bits=2)
    return config


def fsdp2_training(argv: list[str], nodes: int, gpus_per_node: int):
    """(args, model, optimizer): the model as ``build_model`` builds it on the CPU, under
    FSDP2 with one group per block and then the root (fp16 compute over fp32 shards), and
    AdamW. A process group of ``nodes x gpus_per_node`` ranks must exist."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    args, model = build_model(argv, "cpu", nodes, gpus_per_node)
    model.train()
    mesh = init_device_mesh("cpu", (nodes * gpus_per_node,))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return args, model, torch.optim.AdamW(model.parameters(), lr=args.lr)
