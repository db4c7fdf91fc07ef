"""Checkpoints across the DeepSpeed border (``python -m zeropp.convert``), on checkpoints
DeepSpeed 0.19.8 itself writes here: CPU, gloo, 2 ranks, fp32.

DeepSpeed trains 20 steps at ZeRO-2 and at ZeRO-3 (a client torch AdamW with a decayed and
an undecayed group, the config's WarmupLR, gradient clipping at its default) and saves; then
it loads its own checkpoint into a fresh engine and trains 10 more steps. Each checkpoint is
converted and resumed here for the same 10 steps: the losses equal DeepSpeed's resumed run's
within 1e-5. The ZeRO-2 one is converted to 3 rank files and loaded on 2 ranks.

Client AdamW rather than the config's "AdamW" block: DeepSpeed builds FusedAdam for that, whose
CPU kernel takes about 45 s to load in each process; what is read from the checkpoint is the
same either way (fp32 partitions, torch-layout moments, the step).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

LOSS_TOL = 1e-5
SAVED_STEPS, RESUMED_STEPS = 20, 10
MICRO = 2
LR = 1e-2
CONFIG_SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                    "warmup_num_steps": 25,
                                                    "warmup_type": "linear"}}
REPO = Path(__file__).resolve().parent.parent


def config(stage: int) -> dict:
    # The same JSON on both sides; gradient_clipping is left to both defaults (1.0).
    return {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": stage},
            "scheduler": CONFIG_SCHEDULER}


def adamw(model) -> torch.optim.AdamW:
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim > 1]
    rest = [p for p in trained if p.ndim <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=LR, betas=(0.8, 0.95), eps=1e-6)


def rank_batches(rank: int, world: int) -> torch.Tensor:
    """(steps, MICRO, seq + 1): this rank's micro-batch of every step, saved and resumed."""
    data = toy_batches(SAVED_STEPS + RESUMED_STEPS, 1, MICRO * world)
    return data[:, 0, rank * MICRO:(rank + 1) * MICRO]


def train(engine, batches) -> list[float]:
    losses = []
    for tokens in batches:
        loss = toy_loss(engine(tokens), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def deepspeed_rank(rank, world, root):
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo only
    batches = rank_batches(rank, world)
    out = {}
    for stage in (2, 3):
        save_dir = f"{root}/deepspeed_stage{stage}"
        model = toy_model()
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model),
                                          config=config(stage))
        saved = train(engine, batches[:SAVED_STEPS])
        engine.save_checkpoint(save_dir, client_state={"epoch": 7})
        model = toy_model(seed=5)  # other weights: the load must replace them
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model),
                                          config=config(stage))
        engine.load_checkpoint(save_dir)
        lr_after_load = engine.get_lr()
        out[stage] = {"saved": saved, "resumed": train(engine, batches[SAVED_STEPS:]),
                      "lr_after_load": lr_after_load}
    # Read for their weights only: ZeRO-1, and a frozen norm at ZeRO-2 and ZeRO-3.
    for stage, name, frozen in ((1, "stage1", False), (2, "frozen2", True),
                                (3, "frozen3", True)):
        model = toy_model()
        model.layers[0].norm.requires_grad_(not frozen)
        # Sub-groups of at most 2000 elements: several flat groups at ZeRO-3.
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model), config={
            **config(stage), "zero_optimization": {"stage": stage, "sub_group_size": 2000}})
        train(engine, batches[:3])  # the warm-up runs its first two at lr 0
        engine.save_checkpoint(f"{root}/deepspeed_{name}")
    # Checkpoints the converter refuses: plain SGD, and no ZeRO at all.
    for stage, name, build in ((2, "sgd", lambda m: torch.optim.SGD(m.parameters(), lr=LR,
                                                                     momentum=0.9)),
                               (0, "stage0", adamw)):
        model = toy_model()
        # DeepSpeed asks for this switch before it partitions a torch SGD.
        engine, *_ = deepspeed.initialize(model=model, optimizer=build(model),
                                          config={**config(stage),
                                                  "zero_allow_untested_optimizer": True})
        train(engine, batches[:1])
        engine.save_checkpoint(f"{root}/deepspeed_{name}")
    return out


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed_convert")
    per_rank = run_ranks(deepspeed_rank, 2, str(root),
                         env={"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    return root, per_rank


def zeropp_rank(rank, world, converted, ours_root):
    import zeropp

    batches = rank_batches(rank, world)
    out = {}
    for stage in (2, 3):
        model = toy_model(seed=5)
        engine, *_ = zeropp.initialize(model=model, optimizer=adamw(model), config=config(stage))
        _path, client_state = engine.load_checkpoint(converted[stage])
        lr_after_load = engine.get_lr()
        steps = engine.global_steps
        resumed = train(engine, batches[SAVED_STEPS:])
        engine.save_checkpoint(f"{ours_root}/stage{stage}")  # for --to-fp32
        out[stage] = {"resumed": resumed, "client_state": client_state, "steps": steps,
                      "lr_after_load": lr_after_load, "weights": engine.full_state_dict()}
        engine.close()
    return out


def convert(*args: str) -> subprocess.CompletedProcess:
    """The command line, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "zeropp.convert", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def resumed_here(deepspeed_runs):
    root, _ = deepspeed_runs
    converted = {3: str(root / "converted_stage3"), 2: str(root / "converted_stage2")}
    done = convert("--from-deepspeed", str(root / "deepspeed_stage3"), "--out", converted[3])
    assert done.returncode == 0, done.stderr
    from zeropp.checkpoints import convert as converter

    converter.from_deepspeed(root / "deepspeed_stage2", converted[2], world_size=3)
    return converted, run_ranks(zeropp_rank, 2, converted, str(root / "ours"))


def test_a_deepspeed_run_resumes_here_with_deepspeeds_losses(deepspeed_runs, resumed_here):
    _, theirs = deepspeed_runs
    _, ours = resumed_here
    for rank, (ds, zp) in enumerate(zip(theirs, ours, strict=True)):
        for stage in (2, 3):
            shown = (f"rank {rank} stage {stage}\n deepspeed resumed {ds[stage]['resumed']}\n"
                     f" zeropp resumed    {zp[stage]['resumed']}")
            worst = max(abs(a - b) for a, b in zip(ds[stage]["resumed"], zp[stage]["resumed"],
                                                    strict=True))
            assert len(zp[stage]["resumed"]) == RESUMED_STEPS
            assert worst <= LOSS_TOL, f"losses differ by up to {worst:.3g}\n{shown}"
            # The resume continued from step 20: not the start of training again.
            assert abs(ds[stage]["resumed"][0] - ds[stage]["saved"][0]) > 1e-2, shown
            assert zp[stage]["steps"] == SAVED_STEPS
            assert zp[stage]["client_state"] == {"epoch": 7}
            # WarmupLR at step 20 of 25 (not its floor): the schedule's position came across.
            torch.testing.assert_close(zp[stage]["lr_after_load"], ds[stage]["lr_after_load"])
            assert 0.0 < zp[stage]["lr_after_load"][0] < LR


def test_checkpoint_written_by_deepspeed_converts_to_its_own_fp32_weights(deepspeed_runs,
                                                                          resumed_here):
    """Every master of the converted checkpoint is what DeepSpeed's zero_to_fp32 reads, at
    ZeRO-1, 2 and 3, frozen parameters included."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from zeropp.checkpoints import checkpoint
    from zeropp.checkpoints import convert as converter

    root, _ = deepspeed_runs
    converted, _ = resumed_here
    converted = {f"stage{stage}": path for stage, path in converted.items()}
    for name in ("stage1", "frozen2", "frozen3"):
        converted[name] = converter.from_deepspeed(root / f"deepspeed_{name}", root / name).parent
    for name, path in converted.items():
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(root / f"deepspeed_{name}"))
        ours = checkpoint.consolidate(path)
        assert ours.keys() == theirs.keys() == toy_model().state_dict().keys(), name
        for key in theirs:
            assert torch.equal(ours[key], theirs[key]), (name, key)
    # The frozen norm kept its initial value; the trained one next to it did not.
    initial = toy_model().state_dict()
    ours = checkpoint.consolidate(converted["frozen3"])
    assert torch.equal(ours["layers.0.norm.weight"], initial["layers.0.norm.weight"])
    assert not torch.equal(ours["layers.1.norm.weight"], initial["layers.1.norm.weight"])


def test_to_fp32_writes_the_unsharded_weights_a_plain_model_loads(deepspeed_runs, resumed_here,
                                                                   tmp_path):
    root, _ = deepspeed_runs
    _, ours = resumed_here
    out = tmp_path / "pytorch_model.bin"
    done = convert("--to-fp32", str(root / "ours" / "stage3"), "--out", str(out))
    assert done.returncode == 0, done.stderr
    state = torch.load(out, weights_only=True)
    weights = ours[0][3]["weights"]  # the engine's own unsharded weights after its 10 steps
    assert state.keys() == weights.keys()
    for name, value in weights.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], value), name
    plain = toy_model(seed=5)
    plain.load_state_dict(state, strict=True)
    assert torch.equal(plain.embed.weight, weights["embed.weight"])


class TiedLM(torch.nn.Module):
    """A head tied by registration (two state_dict names, one tensor), as Hugging Face ties."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(31, 6)
        self.head = torch.nn.Linear(6, 31, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def tied_rank(rank, world, save_dir):
    import zeropp

    torch.manual_seed(0)
    model = TiedLM()
    engine, *_ = zeropp.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2,
                                                        "zero_optimization": {"stage": 3},
                                                        "optimizer": {"type": "AdamW"}})
    tokens = torch.randint(0, 31, (2, 5), generator=torch.Generator().manual_seed(rank))
    train(engine, [tokens])
    engine.save_checkpoint(save_dir)
    return engine.full_state_dict()


def test_to_fp32_names_a_tied_parameter_as_state_dict_does(tmp_path):
    from zeropp.checkpoints import convert as converter

    weights = run_ranks(tied_rank, 2, str(tmp_path / "ckpt"))[0]
    out = converter.to_fp32(tmp_path / "ckpt", tmp_path / "fp32.bin")
    state = torch.load(out, weights_only=True)
    assert sorted(state) == ["embed.weight", "head.weight"] == sorted(weights)
    assert torch.equal(state["head.weight"], weights["head.weight"])
    TiedLM().load_state_dict(state, strict=True)


# ---- one-line errors ---------------------------------------------------------------------

def run_main(capsys, *args: str) -> str:
    from zeropp.checkpoints import convert as converter

    assert converter.main(list(args)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _rewrite_model_states(tag_dir: Path, **changes) -> None:
    for path in tag_dir.glob("*model_states.pt"):
        state = torch.load(path, weights_only=True)
        state.update(changes)
        torch.save(state, path)


def test_not_a_deepspeed_checkpoint(capsys, tmp_path, resumed_here):
    converted, _ = resumed_here
    err = run_main(capsys, "--from-deepspeed", converted[3], "--out", str(tmp_path / "o"))
    assert "is not a DeepSpeed checkpoint: no 'latest' file" not in err  # ours has 'latest'
    assert "is not a DeepSpeed checkpoint: neither mp_rank_00_model_states.pt" in err
    (tmp_path / "empty").mkdir()
    err = run_main(capsys, "--from-deepspeed", str(tmp_path / "empty"), "--out", "o")
    assert "is not a DeepSpeed checkpoint: no 'latest' file and no *_model_states.pt" in err


def test_a_missing_rank_file(capsys, tmp_path, deepspeed_runs):
    root, _ = deepspeed_runs
    for stage, missing in ((3, "zero_pp_rank_1_mp_rank_00_model_states.pt"),
                           (2, "zero_pp_rank_1_mp_rank_00_optim_states.pt")):
        copy = _copy(root / f"deepspeed_stage{stage}", tmp_path / f"s{stage}")
        (copy / f"global_step{SAVED_STEPS}" / missing).unlink()
        err = run_main(capsys, "--from-deepspeed", str(copy), "--out", str(tmp_path / "o"))
        assert f"rank file {missing} is missing (world size 2)" in err
        assert not (tmp_path / "o").exists()


def test_a_model_parallel_checkpoint(capsys, tmp_path, deepspeed_runs):
    root, _ = deepspeed_runs
    copy = _copy(root / "deepspeed_stage2", tmp_path / "mp")
    _rewrite_model_states(copy / f"global_step{SAVED_STEPS}", mp_world_size=2)
    err = run_main(capsys, "--from-deepspeed", str(copy), "--out", str(tmp_path / "o"))
    assert "a model-parallel checkpoint (mp_world_size=2) is not supported" in err


def test_an_optimizer_other_than_adam(capsys, tmp_path, deepspeed_runs):
    root, _ = deepspeed_runs
    err = run_main(capsys, "--from-deepspeed", str(root / "deepspeed_sgd"), "--out",
                   str(tmp_path / "o"))
    assert "optimizer state holds ['momentum_buffer'], not Adam's exp_avg and exp_avg_sq" in err
    copy = _copy(root / "deepspeed_stage3", tmp_path / "sgd_block")
    ds_config = {**config(3), "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    _rewrite_model_states(copy / f"global_step{SAVED_STEPS}", ds_config=ds_config)
    err = run_main(capsys, "--from-deepspeed", str(copy), "--out", str(tmp_path / "o"))
    assert "optimizer SGD: only Adam and AdamW checkpoints convert" in err


def test_a_stage_it_cannot_read(capsys, tmp_path, deepspeed_runs):
    root, _ = deepspeed_runs
    err = run_main(capsys, "--from-deepspeed", str(root / "deepspeed_stage0"), "--out",
                   str(tmp_path / "o"))
    assert "a checkpoint without ZeRO (stage 0" in err and "only ZeRO stages 1-3 are" in err


def test_out_must_not_be_the_deepspeed_checkpoint(capsys, deepspeed_runs):
    root, _ = deepspeed_runs
    source = str(root / "deepspeed_stage1")
    err = run_main(capsys, "--from-deepspeed", source, "--out", source)
    assert "is the DeepSpeed checkpoint itself: write the conversion elsewhere" in err
    assert (root / "deepspeed_stage1" / "global_step3" / "mp_rank_00_model_states.pt").is_file()


def test_fused_adams_mode_is_asked_for_where_the_checkpoint_does_not_say_it(tmp_path):
    """DeepSpeed's FusedAdam built by the script keeps adam_w_mode off the checkpoint: its
    groups carry bias_correction, not torch's decoupled_weight_decay."""
    from zeropp.checkpoints.convert import optimizer_type
    from zeropp.checkpoints.deepspeed_checkpoint import (
        DeepSpeedCheckpoint,
        DeepSpeedCheckpointError,
    )

    def fused_adam_checkpoint(weight_decay: float) -> DeepSpeedCheckpoint:
        state = {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4), "step": 3}
        group = {"params": [0], "lr": LR, "betas": (0.9, 0.999), "eps": 1e-8,
                 "weight_decay": weight_decay, "bias_correction": True, "amsgrad": False}
        optim = {"zero_stage": 2, "base_optimizer_state": {"state": {0: state},
                                                           "param_groups": [group]}}
        return DeepSpeedCheckpoint(tmp_path, 2, 1, {"ds_config": {}}, [optim])

    with pytest.raises(DeepSpeedCheckpointError, match="^the checkpoint does not say whether "
                       "its Adam decayed weights as AdamW or as Adam .*: pass --optimizer "
                       "AdamW or --optimizer Adam$"):
        optimizer_type(fused_adam_checkpoint(0.1))
    assert optimizer_type(fused_adam_checkpoint(0.1), "Adam") == "Adam"
    assert optimizer_type(fused_adam_checkpoint(0.0)) == "AdamW"  # the same step either way
