"""Real DeepSpeed configs from other projects: each is honoured, or refused for a stated reason.

The corpus (``tests/material/ds_configs``, sources in its ``SOURCES.md``) holds configs from
Hugging Face accelerate and transformers, axolotl, DeepSpeedExamples, DeepSpeed-Chat and
Megatron-DeepSpeed. For every file: Hugging Face's ``"auto"`` placeholders are resolved with
``resolve_auto`` (as the Trainer would, for 2 ranks), the result is parsed, and then either

* it is accepted, and one spawn of 2 gloo ranks builds a tiny model with ``zeropp.initialize``
  from it and trains 2 optimizer steps in its dtype (all accepted configs in that one spawn), or
* it is refused, and ``REFUSED`` below says which key the message must name and which
  results-changing feature it is. A refusal missing from that table fails the test, and so
  does an entry whose config is accepted.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model
from zeropp.config import ConfigError, EngineConfig, resolve_auto

CORPUS = Path(__file__).resolve().parent / "material" / "ds_configs"
FILES = sorted(str(path.relative_to(CORPUS)) for path in CORPUS.rglob("*.json"))
WORLD = 2
VOCAB = 64
MAX_STEPS = 40  # enough for fp16's scale to fall from 2**32 to one the toy model's gradients fit

# What a Hugging Face run would pass for the "auto" placeholders (TrainingArguments-like).
HF_ARGUMENTS = dict(world_size=WORLD, micro_batch_size=2, gradient_accumulation_steps=2,
                    hidden_size=64, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                    total_num_steps=10, warmup_steps=2)
# fp16/bf16 "auto" follow --fp16/--bf16: pick one per file so both half dtypes get trained.
PRECISION_FLAGS = {"axolotl/zero1.json": {"bf16": True}, "axolotl/zero3.json": {"fp16": True}}
# Configs whose batch keys were written for another data-parallel size (see SOURCES.md).
WRITTEN_FOR_WORLD = {"megatron-deepspeed/azure_run_175b.json": 8,
                     "megatron-deepspeed/universal_checkpointing_ds_config.json": 1}
# A fragment: the docs show the zero_optimization block to put into a full config.
FRAGMENTS = {"accelerate/docs_zeropp_example.json"}

# file -> (key path the message names, the results-changing feature it names)
REFUSED = {
    "deepspeed-chat/step3_actor_opt-1.3b_hybrid_engine.json": ("hybrid_engine", "the RLHF hybrid engine"),
    "deepspeed-examples/tensor_parallel_hf_integration.json": ("tensor_parallel", "tensor parallelism"),
    "deepspeed-examples/bingbertsquad_onebitadam_bsz96.json":
        ("optimizer.type", "1-bit Adam needs its own compressed communication"),
    # sparse_attention is reported first: table keys are checked before the optimizer block
    "deepspeed-examples/bing_bert_lamb_bsz64k_seq128.json": ("sparse_attention", "sparse attention"),
    "deepspeed-examples/bing_bert_progressive_layer_drop.json":
        ("progressive_layer_drop", "progressive layer dropping"),
    "deepspeed-examples/compression_gpt2_W8A8_Qgroup64_fp16.json":
        ("compression_training", "quantization-aware training and pruning"),
    "deepspeed-examples/imagenet_ds_fp16_z1_config.json": ("fp16.auto_cast", "input autocasting"),
    "megatron-deepspeed/curriculum_learning_zero1_baseline.json":
        ("optimizer.params.max_grad_norm", "use gradient_clipping"),
}


def resolved_config(name: str) -> dict[str, Any]:
    return resolve_auto(CORPUS / name, **HF_ARGUMENTS, **PRECISION_FLAGS.get(name, {}))


def parse(name: str) -> EngineConfig:
    world = None if name in FRAGMENTS else WRITTEN_FOR_WORLD.get(name, WORLD)
    return EngineConfig.from_json(resolved_config(name), world_size=world)


def outcome(name: str) -> str | None:
    """None when the config is accepted, else the one-line refusal."""
    try:
        parse(name)
    except ConfigError as error:
        return str(error)
    return None


ACCEPTED = [name for name in FILES if name not in REFUSED]
# Configs that compile the blocks: trained in a test of their own against the same config
# with compile off (inductor's first compile takes most of a minute on two cores).
COMPILED = [name for name in ACCEPTED if parse(name).compile.enabled]


def test_corpus_is_documented_and_broad():
    sources = (CORPUS / "SOURCES.md").read_text()
    for name in FILES:
        assert f"`{name}`" in sources, name
    assert 25 <= len(FILES) <= 40
    assert not set(REFUSED) - set(FILES), "REFUSED names a file the corpus lacks"
    configs = {name: parse(name) for name in ACCEPTED}
    assert {c.zero_optimization.stage for c in configs.values()} == {0, 1, 2, 3}
    assert {c.compute_dtype for c in configs.values()} == {"float32", "float16", "bfloat16"}
    assert any(c.zero_optimization.zero_quantized_weights for c in configs.values())
    # the HF/axolotl configs are "auto"-heavy: resolution is what makes them parse
    assert sum('"auto"' in (CORPUS / name).read_text() for name in ACCEPTED) >= 6


@pytest.mark.parametrize("name", FILES)
def test_config_is_accepted_or_refused_for_its_stated_reason(name):
    message = outcome(name)
    if name not in REFUSED:
        assert message is None, f"unexpected refusal of {name}: {message}"
        return
    key, feature = REFUSED[name]
    assert message is not None, f"{name} is accepted now: remove it from REFUSED"
    assert "\n" not in message
    assert message.startswith((f"{key} is not supported", f"{key}=")), message
    assert "is not supported by this engine" in message and feature in message, message


def test_accepted_configs_keep_what_they_say():
    """Spot checks that parsing kept the values (and the resolved placeholders) as written."""
    stage3 = parse("accelerate/zero_stage3_config.json")
    zero = stage3.zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,
            zero.stage3_param_persistence_threshold) == (64 * 64, int(0.9 * 64 * 64), 640)
    assert not zero.stage3_gather_16bit_weights_on_model_save  # "auto": Accelerate's false
    assert stage3.optimizer.params["lr"] == 1e-3 and stage3.optimizer.params["weight_decay"] == 0.01
    assert stage3.scheduler.params["total_num_steps"] == 10
    assert stage3.scheduler.params["warmup_num_steps"] == 2
    assert (stage3.train_batch_size, stage3.gradient_accumulation_steps) == (2 * 1 * WORLD, 1)
    # AdamW with torch_adam and adam_w_mode true: DeepSpeed builds torch.optim.AdamW
    assert parse("accelerate/zero_stage1_config.json").optimizer.type == "AdamW"
    assert parse("deepspeed-examples/pipeline_parallelism_ds_config.json").optimizer.type == "AdamW"
    chat = parse("deepspeed-chat/step1_llama2_7b.json")
    assert chat.zero_optimization.stage3_param_persistence_threshold == 10_000
    assert chat.compute_dtype == "float16" and chat.gradient_accumulation_steps == 4  # 32 / (4*2)
    azure = parse("megatron-deepspeed/azure_run_175b.json")  # offload "none" plus its tuning keys
    assert azure.zero_optimization.reduce_bucket_size == 90_000_000 and azure.wall_clock_breakdown
    moe = parse("megatron-deepspeed/moe_gpt_125M_MoE64.json")
    assert moe.prescale_gradients and moe.predivide_factor is None
    assert parse("megatron-deepspeed/universal_checkpointing_ds_config.json").compute_dtype == "bfloat16"
    assert parse("axolotl/zero1.json").compute_dtype == "bfloat16"
    assert parse("axolotl/zero3.json").fp16.initial_scale_power == 32
    # CPU offload, as Hugging Face's, axolotl's, Megatron-DeepSpeed's and DeepSpeed-Chat's
    # scripts set it: trained below like every accepted config
    for name in ("accelerate/zero_stage2_offload_config.json", "axolotl/zero2.json",
                 "transformers/ds_config_zero2.json", "megatron-deepspeed/offload_pp_gpt_350M.json"):
        zero = parse(name).zero_optimization
        assert zero.offloads_optimizer and not zero.offloads_params, name
    chat_offload = parse("deepspeed-chat/step2_reward_llama2_7b_offload.json").zero_optimization
    assert chat_offload.offloads_optimizer and chat_offload.offloads_params
    assert chat_offload.stage == 3
    gan = parse("deepspeed-examples/gan_deepspeed_config.json")
    assert gan.optimizer.params["betas"] == [0.5, 0.999] and gan.train_micro_batch_size_per_gpu == 32


# Where DeepSpeed 0.19's own parser refuses a config this engine accepts: file -> a fragment of
# DeepSpeed's message. Each is a case where accepting changes nothing.
DEEPSPEED_DIFFERS = {
    # the docs' fragment has no batch keys; this engine parses it without resolving the batch
    "accelerate/docs_zeropp_example.json": "train_micro_batch_size_per_gpu needs to be provided",
    # DeepSpeed 0.19 removed the legacy block and refuses it even with "enabled": false
    "megatron-deepspeed/moe_gpt_125M_MoE64.json": "Legacy top-level 'curriculum_learning'",
    # DeepSpeed 0.19's compile block holds DeepCompile's keys only; "disable" and "backend"
    # are the block of 0.13-0.16 (compile the model with torch.compile), which this engine
    # reads: compiled blocks ([Note: compiled blocks])
    "axolotl/zero1_torch_compile.json": "Extra inputs are not permitted",
}


def test_deepspeed_accepts_what_this_engine_accepts(monkeypatch):
    deepspeed_config = pytest.importorskip("deepspeed.runtime.config")
    monkeypatch.setattr(deepspeed_config.dist, "get_rank", lambda *args, **kwargs: 0)
    for name in ACCEPTED:
        world = WRITTEN_FOR_WORLD.get(name, WORLD)
        monkeypatch.setattr(deepspeed_config.dist, "get_world_size",
                            lambda *args, world=world, **kwargs: world)
        try:
            deepspeed_config.DeepSpeedConfig(resolved_config(name))
        except Exception as error:  # noqa: BLE001 - DeepSpeed raises several kinds
            assert DEEPSPEED_DIFFERS.get(name, "<accepted>") in str(error), (name, error)
        else:
            assert name not in DEEPSPEED_DIFFERS, f"DeepSpeed accepts {name} now"


# --- training: every accepted config, 2 optimizer steps on 2 gloo ranks ---------------------


def training_config(name: str, output_dir: str) -> dict[str, Any]:
    """The resolved config with only what depends on the launch changed: a small batch for 2
    ranks (the written one may need 64 accumulation steps here), hpZ sized to this 2-rank
    node, and monitor files under ``output_dir``."""
    config = copy.deepcopy(resolved_config(name))
    accumulation = parse(name).gradient_accumulation_steps if name not in FRAGMENTS else 1
    config.pop("train_batch_size", None)
    config["train_micro_batch_size_per_gpu"] = 2
    config["gradient_accumulation_steps"] = min(accumulation, 2)
    zero = config.get("zero_optimization", {})
    if zero.get("zero_hpz_partition_size", 1) > WORLD:
        zero["zero_hpz_partition_size"] = WORLD
    for block in ("tensorboard", "csv_monitor"):
        if config.get(block, {}).get("enabled"):
            config[block]["output_path"] = str(Path(output_dir) / block)
    return config


def train_all(rank: int, world: int, jobs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    import torch

    import zeropp

    results = {}
    for name, config in jobs:
        model = toy_model(vocab=VOCAB, width=16, hidden=32, layers=2)
        # Without an optimizer block the application brings its own (the HF Trainer, Megatron),
        # as deepspeed.initialize(optimizer=...) does; here: its hyperparameters.
        client = None if "optimizer" in config else {"lr": HF_ARGUMENTS["lr"]}
        engine, _, _, _ = zeropp.initialize(model=model, config=config, optimizer_params=client,
                                            ranks_per_node=world)  # one node of 2 ranks
        before = engine.full_state_dict()  # in the engine's dtype, as the weights after
        micro, steps = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        data = toy_batches(MAX_STEPS, steps, micro * world, vocab=VOCAB)
        losses = []
        # Three optimizer steps applied: DeepSpeed's warmup schedules run the first two at their
        # floor (warmup_min_lr, often 0), so the third is the first that must move weights.
        # fp16 starts at a loss scale of 2**initial_scale_power
        # (2**32 in axolotl's files): as in DeepSpeed, the first steps overflow and are skipped
        # while the scale comes down, so fp16 runs take a few more steps to apply three.
        while engine.global_steps - engine.skipped_steps < 3 and engine.global_steps < MAX_STEPS:
            for index in range(steps):
                tokens = data[engine.global_steps, index, rank * micro:(rank + 1) * micro]
                loss = toy_loss(engine(tokens), tokens)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach().item())
        weights = engine.full_state_dict()
        results[name] = {
            "precision": (engine.fp16_enabled(), engine.bfloat16_enabled()),
            "stage": engine.zero_optimization_stage(),
            "offloaded": (engine.optimizer.offloaded,
                          all(unit.shard_in_host_memory for unit in engine.sharded.units)),
            "steps": (engine.global_steps, engine.skipped_steps),
            "losses_finite": all(math.isfinite(value) for value in losses),
            "weights_finite": all(bool(torch.isfinite(value.float()).all()) for value in weights.values()),
            "changed": any(not torch.equal(weights[key], before[key]) for key in before),
            "compiled": engine.is_compiled,
            "losses": losses,
        }
        engine.close()
    return results


def test_accepted_configs_train(tmp_path):
    names = [name for name in ACCEPTED if name not in COMPILED]
    jobs = [(name, training_config(name, str(tmp_path))) for name in names]
    results = run_ranks(train_all, WORLD, jobs, timeout=240)
    for name in names:
        assert results[0][name]["steps"] == results[1][name]["steps"], name
        config, out = parse(name), results[0][name]
        assert out["precision"] == (config.fp16.enabled, config.bf16.enabled), name
        assert out["stage"] == config.zero_optimization.stage, name
        zero = config.zero_optimization
        assert out["offloaded"] == (zero.offloads_optimizer, zero.offloads_params), name
        steps, skipped = out["steps"]
        assert steps - skipped == 3 and out["changed"], (name, out)
        assert out["losses_finite"] and out["weights_finite"], (name, out)
        if not config.fp16.enabled:
            assert skipped == 0, (name, out)  # only fp16 overflows
        assert not out["compiled"], name
    assert (tmp_path / "tensorboard").is_dir()  # DeepSpeed-Chat's step 1 enables TensorBoard


def test_compile_configs_train_compiled(tmp_path):
    """axolotl's torch-compile config (``"compile": {"disable": false, "backend":
    "inductor"}``, DeepSpeed 0.13's spelling) compiles the blocks, trains, and gives the
    losses of the same config with compile off, to rounding."""
    assert COMPILED == ["axolotl/zero1_torch_compile.json"]
    jobs = []
    for name in COMPILED:
        config = training_config(name, str(tmp_path))
        eager = copy.deepcopy(config)
        eager["compile"] = {"disable": True}
        jobs += [(name, config), (f"{name} (eager)", eager)]
    results = run_ranks(train_all, WORLD, jobs, timeout=400)
    for name in COMPILED:
        compiled, eager = results[0][name], results[0][f"{name} (eager)"]
        assert compiled["compiled"] and not eager["compiled"]
        assert compiled["steps"] == eager["steps"] and compiled["changed"], compiled
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)
