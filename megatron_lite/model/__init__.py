"""The Megatron GPT-2 model: configuration, module tree, initialization and LM loss."""

from megatron_lite.model.config import GPTConfig, describe_count, flops_per_token
from megatron_lite.model.gpt import (
    MLP,
    Embedding,
    GPTModel,
    SelfAttention,
    TransformerLayer,
    lm_loss,
)

__all__ = [
    "MLP",
    "Embedding",
    "GPTConfig",
    "GPTModel",
    "SelfAttention",
    "TransformerLayer",
    "describe_count",
    "flops_per_token",
    "lm_loss",
]
