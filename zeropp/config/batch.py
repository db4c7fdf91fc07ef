"""Batch-size arithmetic and Hugging Face's ``"auto"`` placeholders: ``resolve_auto`` fills
them with the values HF's Trainer would put there (batch sizes from the world size, bucket
sizes from the hidden size, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from os import PathLike
from typing import Any

from zeropp.config.checks import (
    _REQUIRED,
    Check,
    _boolean,
    _non_negative_float,
    _positive_float,
    _positive_int,
)
from zeropp.config.json_reading import ConfigError, read_json_config
from zeropp.config.optimizer import _betas
from zeropp.config.sections import _join


def _exact_quotient(total: int, divisor: int, divisor_text: str) -> int:
    if total % divisor != 0:
        raise ConfigError(f"train_batch_size {total} is not divisible by {divisor_text} = {divisor}")
    return total // divisor


# --- Hugging Face "auto" placeholders -------------------------------------------------------

def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _find_autos(node: Any, path: str = "") -> list[str]:
    if _is_auto(node):
        return [path]
    if isinstance(node, Mapping):
        return [found for key, value in node.items() for found in _find_autos(value, _join(path, key))]
    return []


def _parent(config: dict[str, Any], path: str) -> tuple[dict[str, Any] | None, str]:
    *sections, key = path.split(".")
    node: Any = config
    for section in sections:
        node = node.get(section) if isinstance(node, Mapping) else None
    return (node if isinstance(node, dict) else None), key


_HIDDEN_SIZE_KEYS = {  # zero_optimization keys HF derives from the model's hidden size h
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
    "param_persistence_threshold": lambda h: 10 * h,
}
_SAVE_16BIT_KEYS = ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                    "stage3_gather_fp16_weights_on_model_save")


def resolve_auto(raw: str | PathLike[str] | Mapping[str, Any], *, world_size: int,
                 micro_batch_size: int | None = None, gradient_accumulation_steps: int | None = None,
                 hidden_size: int | None = None, lr: float | None = None,
                 betas: tuple[float, float] | list[float] | None = None, eps: float | None = None,
                 weight_decay: float | None = None, gradient_clipping: float | None = None,
                 fp16: bool | None = None, bf16: bool | None = None,
                 total_num_steps: int | None = None, warmup_steps: float | None = None,
                 save_16bit_model: bool | None = None) -> dict[str, Any]:
    """A copy of the DeepSpeed config with Hugging Face's ``"auto"`` placeholders filled in.

    Contract (the values Hugging Face's Trainer/Accelerate would put there, from the
    TrainingArguments named in brackets):

    * ``train_micro_batch_size_per_gpu`` <- ``micro_batch_size`` [per_device_train_batch_size];
      ``gradient_accumulation_steps`` <- ``gradient_accumulation_steps``, else 1 (HF's default);
      ``train_batch_size`` <- micro * accumulation * ``world_size``, taking each factor from
      the config where it is a number, else from the keyword (accumulation absent: 1).
    * ``zero_optimization``: ``reduce_bucket_size`` <- h*h, ``stage3_prefetch_bucket_size`` <-
      int(0.9*h*h), ``stage3_param_persistence_threshold`` <- 10*h with h = ``hidden_size``
      (the model's ``config.hidden_size``; for a GPT, its width). HF fills the stage-3 pair at
      stage 3 only; here they are filled at any stage, where they have no effect.
      ``stage3_gather_16bit_weights_on_model_save`` <- ``save_16bit_model``, else false
      (Accelerate's ``zero3_save_16bit_model`` default).
    * ``gradient_clipping`` <- ``gradient_clipping`` [max_grad_norm], else 1.0 (the default of
      both the Trainer and Accelerate).
    * ``optimizer.params``: ``lr``, ``betas``, ``eps``, ``weight_decay`` <- the keywords
      [learning_rate, adam_beta1/2, adam_epsilon, weight_decay]; no fallback.
    * ``scheduler.params``: ``warmup_min_lr`` <- 0; ``warmup_max_lr`` <- ``lr``;
      ``total_num_steps`` <- ``total_num_steps`` [num_training_steps]; ``warmup_num_steps`` <-
      max(1, ``warmup_steps``) where a ``warmup_steps`` below 1 is a fraction of
      ``total_num_steps`` (HF's rule); none given: 1 (no warmup, as HF without --warmup_steps).
    * ``fp16.enabled`` / ``bf16.enabled`` (or ``bfloat16.enabled``) <- ``fp16`` / ``bf16``,
      else false (HF without --fp16 / --bf16).

    Keywords only fill placeholders: a concrete value in the config is kept and never compared
    with a keyword (unlike the Trainer, which refuses mismatches), so callers may pass what they
    know. An ``"auto"`` whose keyword is missing and has no fallback raises ``ConfigError``
    naming the key and the keyword to pass; so does an ``"auto"`` where Hugging Face fills
    nothing. Other keys are not validated: ``EngineConfig.from_json`` does that. A config
    without ``"auto"`` comes back equal. ``raw`` is a path or a mapping and is not modified.
    """
    config = read_json_config(raw)
    world = _positive_int("world_size", world_size)

    def keyword(name: str, value: Any, check: Check, fallback: Any = _REQUIRED) -> Callable[[str], Any]:
        """A filler: the keyword's value, checked; else the fallback; else an error naming both."""
        def make(path: str) -> Any:
            if value is None and fallback is _REQUIRED:
                raise ConfigError(f'{path}: "auto" needs a value: pass {name}=... to '
                                  "zeropp.config.resolve_auto (or write the value)")
            return check(name, fallback if value is None else value)
        return make

    def fill(path: str, make: Callable[[str], Any]) -> None:
        node, key = _parent(config, path)
        if node is not None and _is_auto(node.get(key)):
            node[key] = make(path)

    def written(key: str) -> Any:  # a top-level batch key the config gives as a number
        value = config.get(key)
        return None if value is None or _is_auto(value) else value

    micro = keyword("micro_batch_size", micro_batch_size, _positive_int)
    steps = keyword("gradient_accumulation_steps", gradient_accumulation_steps, _positive_int, 1)
    fill("gradient_accumulation_steps", steps)  # first: train_batch_size uses it
    fill("train_micro_batch_size_per_gpu", micro)
    fill("train_batch_size", lambda path: world
         * int(written("train_micro_batch_size_per_gpu") or micro(path))
         * int(written("gradient_accumulation_steps") or steps(path)))
    fill("gradient_clipping", keyword("gradient_clipping", gradient_clipping, _non_negative_float, 1.0))
    fill("fp16.enabled", keyword("fp16", fp16, _boolean, False))
    for section in ("bf16", "bfloat16"):  # HF looks under "bf16" only; DeepSpeed reads both
        fill(f"{section}.enabled", keyword("bf16", bf16, _boolean, False))
    hidden = keyword("hidden_size", hidden_size, _positive_int)
    for key, rule in _HIDDEN_SIZE_KEYS.items():
        fill(f"zero_optimization.{key}", lambda path, rule=rule: rule(hidden(path)))
    for key in _SAVE_16BIT_KEYS:
        fill(f"zero_optimization.{key}", keyword("save_16bit_model", save_16bit_model, _boolean, False))
    for name, value, check in (("lr", lr, _positive_float), ("betas", betas, _betas),
                               ("eps", eps, _positive_float),
                               ("weight_decay", weight_decay, _non_negative_float)):
        fill(f"optimizer.params.{name}", keyword(name, value, check))
    fill("scheduler.params.warmup_min_lr", lambda path: 0)  # no TrainingArguments field: HF writes 0
    fill("scheduler.params.warmup_max_lr", keyword("lr", lr, _positive_float))
    total_steps = keyword("total_num_steps", total_num_steps, _positive_int)
    fill("scheduler.params.total_num_steps", total_steps)

    def warmup(path: str) -> int:
        count = keyword("warmup_steps", warmup_steps, _non_negative_float, 0)(path)
        if 0 < count < 1:  # HF reads a warmup_steps below 1 as a fraction of the run
            count = math.ceil(count * total_steps(path))
        return max(1, int(count))  # HF keeps it positive: DeepSpeed refuses 0

    fill("scheduler.params.warmup_num_steps", warmup)
    left = _find_autos(config)
    if left:
        raise ConfigError(f'{left[0]}: "auto" is not a placeholder Hugging Face fills; write a value')
    return config
