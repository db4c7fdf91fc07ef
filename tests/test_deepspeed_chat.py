"""Acceptance: DeepSpeed-Chat's step-1 fine-tuning script with one import changed.

DeepSpeedExamples' ``applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py``
and the ``dschat`` files it imports (tests/material/deepspeed_chat, unmodified on disk; see
SOURCES.md there) run on 2 gloo ranks on CPU, under DeepSpeed 0.19.8 itself and with
``import deepspeed`` replaced by ``import zeropp as deepspeed`` in main.py. The script is a new
user's whole job: a Hugging Face OPT model built inside DeepSpeed's ``zero.Init``
(``HfDeepSpeedConfig``), its own FusedAdam and Hugging Face cosine schedule with warm-up handed
to ``initialize``, ZeRO stage 3 in bf16 with gradient clipping, gradient accumulation 2,
evaluation under ``no_grad`` before and after the epoch, ``engine.tput_timer``, and the save:
``save_hf_format`` (``model.module.state_dict()`` on rank 0) then ``save_zero_three_model``
(each parameter gathered with DeepSpeed's own ``GatheredParameters``) writing
``pytorch_model.bin``.

The model is a tiny OPT (2 layers, hidden 64, a 304-entry byte-level BPE trained here) and
the data 64 training and 16 evaluation samples of dschat's ``local/jsonfile`` format: 16
micro-steps per rank, 8 optimizer steps.

Tolerances, from measurement (see MEASURED below for the figures): both systems start from
the same bf16 weights and see the same batches, and agree at the first micro-step to the last
bit; afterwards bf16 rounding of the weights (the working copy is re-rounded from fp32 masters
after each step, by different kernels) lets the losses drift apart slowly.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import pytest
import torch

RUNNER_PATH = Path(__file__).parent / "material" / "deepspeed_chat" / "run_chat.py"
_spec = importlib.util.spec_from_file_location("chat_run_chat", RUNNER_PATH)
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

MICRO_STEPS = 16  # 64 samples / (2 ranks x micro-batch 2)
OPTIMIZER_STEPS = 8  # gradient accumulation 2
PEAK_LR = 3e-3  # the script's --learning_rate, reached after 2 warm-up steps
LOSS_TOL = 2e-3
EVAL_TOL = 2e-3
WEIGHT_TOL = 8e-3
TIMEOUT_S = 600  # a fresh machine compiles DeepSpeed's CPU FusedAdam on the first launch


@pytest.fixture(scope="module")
def material(tmp_path_factory) -> Path:
    return runner.prepare(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def deepspeed_run(material) -> list[dict]:
    return runner.launch("deepspeed", material, material / "run_deepspeed", timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def zeropp_run(material) -> list[dict]:
    return runner.launch("zeropp", material, material / "run_zeropp", timeout=TIMEOUT_S)


def table(**systems: list[dict]) -> str:
    """Every recorded loss and lr, per system and rank: printed when an assertion fails."""
    lines = []
    for name, records in systems.items():
        for r in records:
            lines.append(f"{name} rank {r['rank']}: losses {r['losses']}")
            lines.append(f"{name} rank {r['rank']}: eval {r['eval_losses']} lrs {r['lrs']}")
    return "\n".join(lines)


def lrs_close(a, b) -> bool:
    return len(a) == len(b) and all(
        math.isclose(float(x), float(y), rel_tol=1e-9, abs_tol=1e-15)
        for x, y in zip(a, b, strict=True))


def check_run(records: list[dict], shown: str) -> None:
    """What either system's run must show on its own: it trained, and the schedule drove it."""
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert r["zero_stage"] == 3 and (r["fp16"], r["bf16"]) == (False, True), r
        assert r["global_steps"] == OPTIMIZER_STEPS and r["epoch_count"] == 1, r
        assert len(r["losses"]) == MICRO_STEPS and all(map(math.isfinite, r["losses"])), shown
        # The Hugging Face cosine schedule with 2 warm-up steps, stepped once per optimizer
        # step: 0 at the first, the peak at the third, then falling; one lr per accumulation.
        lrs = r["lrs"]
        assert lrs[0::2] == lrs[1::2], shown
        per_step = lrs[0::2]
        assert per_step[0] == 0.0 and per_step[2] == pytest.approx(PEAK_LR), shown
        assert all(a > b > 0 for a, b in itertools.pairwise(per_step[2:])), shown
        # Evaluation before and after the epoch (the mean over ranks: the same on each).
        before, after = r["eval_losses"]
        assert before - after > 0.5, f"the evaluation loss did not fall\n{shown}"
    assert records[0]["eval_losses"] == records[1]["eval_losses"], shown
    assert records[0]["losses"] != records[1]["losses"], f"both ranks saw the same batches\n{shown}"


def test_deepspeed_runs_the_script(deepspeed_run):
    """The reference itself, with the script's FusedAdam under DeepSpeed's ZeRO-3 optimizer."""
    check_run(deepspeed_run, table(deepspeed=deepspeed_run))
    for r in deepspeed_run:
        assert (r["optimizer"], r["inner_optimizer"]) == (
            "DeepSpeedZeroOptimizer_Stage3", "FusedAdam"), r


def test_zeropp_runs_the_unchanged_script_and_matches_deepspeed(deepspeed_run, zeropp_run):
    shown = table(deepspeed=deepspeed_run, zeropp=zeropp_run)
    check_run(zeropp_run, shown)
    for ds, zp in zip(deepspeed_run, zeropp_run, strict=True):
        where = f"rank {ds['rank']}"
        assert zp["optimizer"] == "PartitionedOptimizer", zp
        # The same model adopted from DeepSpeed's zero.Init and the same first batch: the
        # same loss to the last bit, and the same evaluation before training.
        assert zp["losses"][0] == ds["losses"][0], f"{where}: initial weights differ\n{shown}"
        assert zp["eval_losses"][0] == pytest.approx(ds["eval_losses"][0], abs=1e-6), shown
        worst = max(abs(x - y) for x, y in zip(zp["losses"], ds["losses"], strict=True))
        assert worst <= LOSS_TOL, f"{where}: losses differ by up to {worst:.3g}\n{shown}"
        assert lrs_close(zp["lrs"], ds["lrs"]), f"{where}: per-step lr differs\n{shown}"
        assert lrs_close(zp["final_lr"], ds["final_lr"]), f"{where}: final lr differs\n{shown}"
        gap = abs(zp["eval_losses"][1] - ds["eval_losses"][1])
        assert gap <= EVAL_TOL, f"{where}: evaluation after training differs by {gap:.3g}\n{shown}"


def test_the_saved_model_loads_and_matches_deepspeeds(material, deepspeed_run, zeropp_run):
    """``pytorch_model.bin`` from ``--output_dir`` (save_zero_three_model's gathered weights)
    loads into OPTForCausalLM whole, trained, and close to the file DeepSpeed wrote."""
    from safetensors.torch import load_file
    from transformers import OPTForCausalLM

    initial = {k.removeprefix("model."): v.float() for k, v in
               load_file(material / "model" / "model.safetensors").items()}
    files = {}
    for system in ("deepspeed", "zeropp"):
        output = material / f"run_{system}" / "output"
        saved = torch.load(output / "pytorch_model.bin", map_location="cpu")
        loaded = OPTForCausalLM.from_pretrained(output).state_dict()
        for name, value in saved.items():
            assert value.numel() > 0 and value.shape == loaded[name].shape, (system, name)
            assert torch.equal(loaded[name].float(), value.float()), (system, name)
        files[system] = {k: v.float() for k, v in saved.items()}
    ds, zp = files["deepspeed"], files["zeropp"]
    assert sorted(zp) == sorted(ds) and len(ds) == len(initial) - 1  # lm_head is tied
    for name, theirs in ds.items():
        ours, start = zp[name], initial[name.removeprefix("model.")]
        gap = float((ours - theirs).abs().max())
        assert gap <= WEIGHT_TOL, f"{name}: {gap:.3g} from DeepSpeed's"
        # Both trained the tensor the same way: far more movement than disagreement.
        moved = float((theirs - start).abs().mean())
        assert float((ours - theirs).abs().mean()) < 0.25 * moved, name
