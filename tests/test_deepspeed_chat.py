"""Acceptance: DeepSpeed-Chat's step-1 fine-tuning script with one import changed.

DeepSpeedExamples' ``applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py``
and the ``dschat`` files it imports (tests/material/deepspeed_chat, unmodified on disk; see
SOURCES.md there) run on 2 gloo ranks on CPU, under DeepSpeed 0.19.8 itself and with
``import deepspeed`` replaced by ``import zeropp as deepspeed`` in main.py. One dschat line
is ported for both systems alike (transformers 5 moved an import): ``DSCHAT_PORT`` in
run_chat.py. ``save_zero_three_model`` runs unchanged: on the CPU the ``v.data.cpu()`` it
keeps is the gathered tensor itself, which must outlive the gather. The script is a new
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

Tolerances, from measurement (2 runs of each system, one with OPT's linear biases, one
without). Both systems start from the same bf16 weights (zeropp adopts DeepSpeed's
partitions exactly) and see the same batches: the first micro-step's loss and the evaluation
before training agree to the last bit, and so do the losses until the first step with a
non-zero lr (the warm-up's first lr is 0). After that, bf16 rounding (of the working weights,
re-rounded from fp32 masters by different kernels, and of the reduced gradients) lets them
drift apart slowly:

- training losses: largest gap 7.4e-4 (6e-4 in the other run) at losses near 5;
  ``LOSS_TOL`` 2e-3;
- evaluation loss after the epoch: gap 1.4e-5 (3e-4) while it falls from 5.70 to 4.66;
  ``EVAL_TOL`` 1e-3;
- saved weights: per element at most 5.3e-3 apart below 0.25 in size and one bf16 ulp
  (7.8e-3) on the layer norms' weights near 1, so ``WEIGHT_TOL`` 1.6e-2 (two ulps at 1); and
  since training moves each weight by at most the sum of the lrs (0.012), the mean gap must
  stay under ``MEAN_GAP_RATIO`` (0.25) of the mean distance DeepSpeed's weights moved from the
  initial ones: at most 0.054 measured.

The model has no linear biases (``enable_bias=False``): the key projection's bias gets no
gradient (softmax ignores a constant added to all scores), and Adam moved it by normalized
rounding noise, 0.009 apart in the two systems, as far as it moved at all.

Not training would fail every comparison: the evaluation loss must fall by more than 0.5 in
each system (it falls by 1.04), and the saved weights must have moved as DeepSpeed's did.
"""

from __future__ import annotations

import concurrent.futures
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
EVAL_TOL = 1e-3
WEIGHT_TOL = 1.6e-2
MEAN_GAP_RATIO = 0.25
TIMEOUT_S = 600  # a fresh machine compiles DeepSpeed's CPU FusedAdam on the first launch


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Both systems' runs on the same material, started together: 4 processes on the 2
    cores overlap one system's waits (a rank at a barrier while rank 0 builds the data)
    with the other's work."""
    material = runner.prepare(tmp_path_factory.mktemp("chat"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {system: pool.submit(runner.launch, system, material,
                                       material / f"run_{system}", TIMEOUT_S)
                   for system in ("deepspeed", "zeropp")}
        out = {system: future.result() for system, future in futures.items()}
    out["material"] = material
    return out


@pytest.fixture(scope="module")
def deepspeed_run(runs) -> list[dict]:
    return runs["deepspeed"]


@pytest.fixture(scope="module")
def zeropp_run(runs) -> list[dict]:
    return runs["zeropp"]


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


def test_the_saved_model_loads_and_matches_deepspeeds(runs):
    """``pytorch_model.bin`` from ``--output_dir`` (save_zero_three_model's gathered weights)
    loads into OPTForCausalLM whole, trained, and close to the file DeepSpeed wrote."""
    from safetensors.torch import load_file
    from transformers import OPTForCausalLM

    material = runs["material"]
    initial = {k.removeprefix("model."): v.float() for k, v in
               load_file(material / "model" / "model.safetensors").items()}
    files = {}
    for system in ("deepspeed", "zeropp"):
        output = material / f"run_{system}" / "output"
        saved = torch.load(output / "pytorch_model.bin", map_location="cpu", weights_only=True)
        loaded = OPTForCausalLM.from_pretrained(output).state_dict()
        for name, value in saved.items():
            assert value.numel() > 0 and value.shape == loaded[name].shape, (system, name)
            assert torch.equal(loaded[name].float(), value.float()), (system, name)
        files[system] = {k: v.float() for k, v in saved.items()}
    ds, zp = files["deepspeed"], files["zeropp"]
    assert sorted(zp) == sorted(ds) and len(ds) == len(initial)  # lm_head: tied, not saved
    for name, theirs in ds.items():
        ours, start = zp[name], initial[name.removeprefix("model.")]
        gap = float((ours - theirs).abs().max())
        assert gap <= WEIGHT_TOL, f"{name}: {gap:.3g} from DeepSpeed's"
        # Both trained the tensor the same way: far more movement than disagreement.
        moved = float((theirs - start).abs().mean())
        assert float((ours - theirs).abs().mean()) < MEAN_GAP_RATIO * moved, name
