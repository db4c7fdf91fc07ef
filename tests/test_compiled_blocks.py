"""Compiled blocks ([Note: compiled blocks] in zeropp/acceleration/compiled_blocks.py) against the
eager engine they replace: the same losses on 2 x 2 gloo ranks with qwZ + hpZ + qgZ, one graph
for all blocks and no recompiles; the config's ``compile`` block and its refusals.

Inductor's C++ backend compiles slowly on two cores, so each test makes as few distinct
graphs as it can: one model shape per test, all blocks of one class.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from megatron_lite.model import GPTConfig, GPTModel, lm_loss
from tests.distributed import run_ranks
from tests.test_llama_training import LLAMA_STYLE, SEQ, VOCAB
from tests.test_pretrain_cli import (  # noqa: F401 (data_prefix: a module fixture)
    ENTRY_POINT,
    TINY_RUN,
    data_prefix,
    read_metrics,
    run,
)
from zeropp.config import ConfigError, EngineConfig

ZEROPP = {"quantized_weights": True, "hpz_size": 2, "quantized_gradients": True}


def train_eager_then_compiled(rank, world, config_fields, steps, micro, batch, dtype_name):
    """The same run twice on these ranks, eager then with compiled blocks: both loss curves,
    and what dynamo did for the compiled one."""
    from torch._dynamo.utils import counters

    from zeropp.deepspeed_api.initialize import QuantizationOptions, build_engine, make_loss_scaler
    from zeropp.sharded_model import ShardingOptions

    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(3)
    data = torch.randint(0, VOCAB, (steps, micro, batch, SEQ + 1), generator=generator)
    per_rank = batch // world
    curves, dynamo = [], {}
    for compiled in (False, True):
        with torch.device("meta"):
            model = GPTModel(GPTConfig(**config_fields))
        engine = build_engine(
            model, lr=1e-3, eps=1e-6, weight_decay=0.1, gradient_accumulation_steps=micro,
            gradient_clipping=0.5, dtype=dtype, loss_scaler=make_loss_scaler(dtype == torch.float16),
            ranks_per_node=2, quantization=QuantizationOptions(**ZEROPP),
            sharding=ShardingOptions(persistence_threshold=0, prefetch_bucket_numel=3000))
        if compiled:
            graphs_before = counters["stats"]["unique_graphs"]
            recompiles_before = sum(counters["recompiles"].values())
            engine.compile()  # DeepSpeed's engine.compile(): inductor
        losses = []
        for step in range(steps):
            total = torch.zeros(())
            for m in range(micro):
                tokens = data[step, m, rank * per_rank:(rank + 1) * per_rank]
                labels = tokens[:, 1:]
                loss = lm_loss(engine(tokens[:, :-1]), labels, torch.ones_like(labels))
                engine.backward(loss)
                engine.step()
                total += loss.detach().float() / micro
            torch.distributed.all_reduce(total)
            losses.append(total.item() / world)
        curves.append(losses)
        if compiled:
            dynamo = {"graphs": counters["stats"]["unique_graphs"] - graphs_before,
                      "recompiles": sum(counters["recompiles"].values()) - recompiles_before,
                      "modules": len(engine.compiled_blocks.modules),
                      "compile_seconds": engine.compiled_blocks.first_compile_seconds}
        engine.close()
    return curves, dynamo


def test_compiled_blocks_match_eager_on_2x2_zeropp():
    """qwZ + hpZ + qgZ on 2 nodes of 2 ranks, the Llama-style model with full activation
    checkpointing and selective recomputation inside it, 2 micro-batches per step: 10 steps
    compiled give the eager losses to 1e-4, with one forward graph shared by the 3 blocks
    and no recompiles (the parameters' storage changes at every gather, their metadata
    never does)."""
    config = GPTConfig(**LLAMA_STYLE, checkpoint_activations=True, recompute_attention=True)
    results = run_ranks(train_eager_then_compiled, 4, dataclasses.asdict(config), 10, 2, 8,
                        "float32", timeout=600)
    for (eager, compiled), dynamo in results:
        worst = max(abs(c - e) / abs(e) for c, e in zip(compiled, eager, strict=True))
        assert worst <= 1e-4, (worst, eager, compiled)
        assert eager[-1] < eager[0]  # it trains
        assert dynamo["modules"] == 3 and dynamo["recompiles"] == 0, dynamo
        assert dynamo["graphs"] == 1, dynamo  # one frame for all blocks (its backward rides on it)
        assert dynamo["compile_seconds"] > 0, dynamo


def test_compile_block_reads_deepspeeds_keys():
    assert not EngineConfig().compile.enabled
    on = EngineConfig.from_mapping({"compile": {"enabled": True, "backend": "aot_eager",
                                                "kwargs": {"fullgraph": True}}}).compile
    assert (on.enabled, on.backend, on.kwargs) == (True, "aot_eager", {"fullgraph": True})
    # DeepSpeed 0.13's spelling (axolotl's file): disable false compiles
    assert EngineConfig.from_mapping({"compile": {"disable": False}}).compile.enabled
    assert not EngineConfig.from_mapping({"compile": {"disable": True}}).compile.enabled
    # DeepCompile's tuning keys change nothing while DeepCompile is off
    assert not EngineConfig.from_mapping(
        {"compile": {"deepcompile": False, "free_activation": True}}).compile.enabled


@pytest.mark.parametrize("block,named", [
    ({"deepcompile": True}, "compile.deepcompile=true is not supported by this engine (DeepCompile"),
    ({"offload_opt_states": True}, "compile.offload_opt_states=true is not supported"),
    ({"kwargs": {"fullgrah": True}}, "compile.kwargs.fullgrah: unknown key (did you mean 'fullgraph'?)"),
    ({"enabled": True, "disable": True}, "compile.enabled is true and compile.disable is true"),
    ({"enable": True}, "compile.enable: unknown key (did you mean 'enabled'?)"),
])
def test_compile_block_refuses_in_one_line(block, named):
    with pytest.raises(ConfigError) as error:
        EngineConfig.from_mapping({"compile": block})
    assert str(error.value).startswith(named) and "\n" not in str(error.value)


def test_cuda_graphs_and_unknown_backends_are_refused():
    from zeropp.acceleration.compiled_blocks import CompileRefused, check_compile_settings

    for kwargs in ({"mode": "reduce-overhead"}, {"mode": "max-autotune"},
                   {"options": {"triton.cudagraphs": True}}):
        # max-autotune switches inductor's CUDA graphs on too (list_mode_options)
        with pytest.raises(CompileRefused, match="CUDA graphs"):
            check_compile_settings("inductor", kwargs)
    with pytest.raises(CompileRefused, match="compile.kwargs.mode: Unrecognized mode"):
        check_compile_settings("inductor", {"mode": "fastest"})
    with pytest.raises(CompileRefused, match="expected a mode's name"):
        check_compile_settings("inductor", {"mode": ""})
    with pytest.raises(CompileRefused, match="compile.backend=cudagraphs: CUDA graphs"):
        check_compile_settings("cudagraphs", {})
    for mode in ("default", "max-autotune-no-cudagraphs"):
        assert check_compile_settings("inductor", {"mode": mode}) == {"mode": mode}
    with pytest.raises(CompileRefused, match="not a torch.compile backend"):
        check_compile_settings("no-such-backend", {})
    assert check_compile_settings("inductor", {"fullgraph": True}) == {"fullgraph": True}


def compiled_resume(rank, world, config_fields, dtype_name, root):
    """Compiled blocks in ``dtype`` on one node of 2 ranks with ZeRO++: 4 steps straight,
    then 2 steps, a checkpoint, a new engine that loads it and 2 more steps."""
    from zeropp.deepspeed_api.initialize import QuantizationOptions, build_engine, make_loss_scaler
    from zeropp.sharded_model import ShardingOptions

    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(5)
    data = torch.randint(0, VOCAB, (4, 4, SEQ + 1), generator=generator)

    def engine():
        with torch.device("meta"):
            model = GPTModel(GPTConfig(**config_fields))
        built = build_engine(
            model, lr=1e-3, eps=1e-6, gradient_clipping=0.5, dtype=dtype,
            loss_scaler=make_loss_scaler(dtype == torch.float16), ranks_per_node=2,
            quantization=QuantizationOptions(**ZEROPP),
            sharding=ShardingOptions(persistence_threshold=0))
        built.compile()
        return built

    def train(built, steps):
        losses = []
        for step in steps:
            tokens = data[step, rank * 2:(rank + 1) * 2]
            labels = tokens[:, 1:]
            loss = lm_loss(built(tokens[:, :-1]), labels, torch.ones_like(labels))
            built.backward(loss)
            built.step()
            losses.append(loss.item())
        return losses

    straight = engine()
    straight_losses = train(straight, range(4))
    straight.close()
    first = engine()
    resumed_losses = train(first, range(2))
    first.save_checkpoint(root)
    first.close()
    second = engine()
    second.load_checkpoint(root)
    resumed_losses += train(second, range(2, 4))
    compiled = second.is_compiled
    second.close()
    return straight_losses, resumed_losses, compiled


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compiled_blocks_resume_from_a_checkpoint(dtype, tmp_path):
    """A checkpoint saved and loaded by compiled engines continues the run exactly, in bf16
    and fp16 (its loss scale in the checkpoint), qwZ + hpZ + qgZ on one node of 2 ranks;
    no recompile for the loaded engine (its parameters keep their metadata)."""
    config = GPTConfig(**LLAMA_STYLE)
    for straight, resumed, compiled in run_ranks(compiled_resume, 2, dataclasses.asdict(config),
                                                 dtype, str(tmp_path), timeout=600):
        assert compiled
        assert resumed == straight


def test_compile_flag_trains_as_the_eager_command_line(data_prefix, tmp_path):  # noqa: F811
    """``pretrain_zeropp_gpt.py --compile`` (ZeRO-3, activation checkpointing, 2 micro-batches,
    evaluation): the eager run's losses, and the compile time said once."""
    metrics = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        metrics[name] = tmp_path / f"{name}.jsonl"
        result = run([sys.executable, ENTRY_POINT, *TINY_RUN, "--data-path", data_prefix,
                      "--checkpoint-activations", "--metrics-file", str(metrics[name]),
                      "--data-cache-dir", str(tmp_path / "cache"), *extra], timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]
        said = [line for line in result.stdout.splitlines() if line.startswith("compiled blocks:")]
        assert len(said) == (name == "compiled"), said
    eager, _ = read_metrics(metrics["eager"])
    compiled, _ = read_metrics(metrics["compiled"])
    assert [r["lm_loss"] for r in compiled] == pytest.approx([r["lm_loss"] for r in eager],
                                                             rel=1e-4)


def split_blocks(rank, world, config_fields):
    """Blocks split into attention and MLP units: which forwards are compiled, and two steps
    compiled (dynamo's aot_eager: no inductor build) against eager."""
    from zeropp.acceleration.compiled_blocks import compiled_modules
    from zeropp.deepspeed_api.initialize import build_engine
    from zeropp.sharded_model import ShardingOptions

    data = torch.randint(0, VOCAB, (2, 2, SEQ + 1), generator=torch.Generator().manual_seed(9))
    curves, chosen = [], None
    for backend in (None, "aot_eager"):
        with torch.device("meta"):
            model = GPTModel(GPTConfig(**config_fields))
        engine = build_engine(model, lr=1e-3, sharding=ShardingOptions(
            persistence_threshold=0, max_unit_numel=10_000))
        if backend is not None:
            names = {id(m): n for n, m in model.named_modules()}
            chosen = sorted(names[id(m)] for m in compiled_modules(engine.sharded))
            engine.compile(backend)
        losses = []
        for tokens in data:
            labels = tokens[:, 1:]
            loss = lm_loss(engine(tokens[:, :-1]), labels, torch.ones_like(labels))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        curves.append(losses)
        engine.close()
    return curves, chosen


def test_blocks_split_into_units_compile_their_leaves():
    """A block larger than the unit cap is split (attention, MLP and norms units of their own):
    those are compiled, the block's own forward (residual adds) runs eager around their
    hooks."""
    config = GPTConfig(**LLAMA_STYLE)
    [((eager, compiled), chosen)] = run_ranks(split_blocks, 1, dataclasses.asdict(config))
    # every leaf unit: the attention and MLP of each block, and its norms, which the cap
    # leaves as units of their own; never a block, whose forward calls gathering modules
    parts = ("attention", "input_layernorm", "mlp", "post_attention_layernorm")
    assert sorted(f"layers.{i}.{part}" for i in range(3) for part in parts) == chosen, chosen
    assert not any(name.count(".") < 2 and name.startswith("layers") for name in chosen), chosen
    assert compiled == pytest.approx(eager, rel=1e-5)
