"""The pretraining loop on a real (tiny) tokenized corpus, one rank, in this process.

The reference for the loop's arithmetic is a plain PyTorch loop written out here (unsharded
GPTModel, torch AdamW, clip_grad_norm_, Megatron's warmup+cosine by hand): the loop and the
engine together must reproduce it. The other tests compare the loop with itself under
changes that must not change the numbers (accumulation split, activation recompute), or
check behaviour: the loss falls, an fp16 overflow is skipped and recovered from.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from pydoc_data.topics import topics

import pytest
import torch
import torch.distributed as dist

from data.gpt_dataset import build_train_valid_test_datasets
from data.preprocess import preprocess
from data.samplers import get_batch
from data.tokenizers import build_tokenizer
from megatron_lite.arguments import parse_args
from megatron_lite.metrics import TRAIN_METRIC_KEYS, MetricsWriter
from megatron_lite.model import GPTConfig, GPTModel, lm_loss
from megatron_lite.training import TrainingSummary
from pretrain_zeropp_gpt import build_training
from tests.distributed import free_port

SEQ_LENGTH = 16
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--seq-length", str(SEQ_LENGTH), "--hidden-dropout", "0",
              "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def process_group():
    """A one-rank gloo group for the engine; the environment is restored afterwards."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())),
                            ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            env.setenv(name, value)
        env.delenv("LOCAL_WORLD_SIZE", raising=False)
        dist.init_process_group("gloo", rank=0, world_size=1)
        yield
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """~100 KB of English (Python's own reference documentation), GPT-2 tokenized."""
    directory = tmp_path_factory.mktemp("corpus")
    jsonl = directory / "docs.jsonl"
    with jsonl.open("w", encoding="utf-8") as out:
        for name in sorted(topics)[:60]:
            out.write(json.dumps({"text": topics[name][:3000]}) + "\n")
    prefixes = preprocess(str(jsonl), str(directory / "pydoc"), build_tokenizer("GPT2BPETokenizer"))
    return prefixes["text"]


def train(corpus: str, tmp_path: Path, *flags: str, loss_fn=lm_loss, ds_extra=None):
    """Run the entry point's own ``build_training`` in this process; returns (summary, train
    records, eval records). ``ds_extra`` becomes the --deepspeed_config file."""
    metrics_file = tmp_path / "metrics.jsonl"
    metrics_file.unlink(missing_ok=True)
    ds_flags = []
    if ds_extra:
        ds_file = tmp_path / "ds_config.json"
        ds_file.write_text(json.dumps(ds_extra))
        ds_flags = ["--deepspeed_config", str(ds_file)]
    args = parse_args([*TINY_MODEL, "--data-path", corpus, "--split", "90,10,0",
                       "--num-workers", "0", "--log-interval", "1", "--eval-iters", "2",
                       "--data-cache-dir", str(tmp_path / "index-cache"), *ds_flags, *flags])
    training = build_training(args)
    try:
        with MetricsWriter(enabled=True, metrics_file=str(metrics_file)) as writer:
            summary = training.run(writer, loss_fn=loss_fn)
    finally:
        training.close()
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    train_records = [r for r in records if "lm_loss" in r]
    eval_records = [r for r in records if "val_loss" in r]
    return summary, train_records, eval_records


def losses(records: list[dict]) -> list[float]:
    return [record["lm_loss"] for record in records]


SCHEDULE = ["--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2",
            "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "0.5"]


# ---- the plain PyTorch reference -------------------------------------------------------------


def reference_lr(update: int, iters: int, max_lr=3e-3, min_lr=3e-4, warmup=2) -> float:
    """Megatron's schedule for the ``update``-th update (1-based): lr after update - 1 iters."""
    done = update - 1
    if done <= warmup:
        return max_lr * done / warmup
    ratio = (done - warmup) / (iters - warmup)
    return min_lr + (max_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * ratio))


def reference_run(corpus: str, tmp_path: Path, iters: int, global_batch: int, eval_iters: int):
    """Unsharded model, whole global batch at once, torch AdamW: losses and final val loss."""
    datasets = build_train_valid_test_datasets(
        [corpus], "90,10,0", SEQ_LENGTH, 1234, (iters * global_batch, eval_iters * global_batch, 0),
        cache_dir=str(tmp_path / "reference-cache"))
    train_set, valid_set, _ = datasets
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               vocab_size=50257, max_position_embeddings=SEQ_LENGTH,
                               hidden_dropout=0.0, attention_dropout=0.0, seed=1234))
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                   {"params": vectors, "weight_decay": 0.0}], foreach=False)

    def batch(dataset, index):
        samples = [dataset[i]["text"] for i in range(index * global_batch,
                                                      (index + 1) * global_batch)]
        return get_batch(torch.stack([torch.as_tensor(s) for s in samples]).long())

    train_losses = []
    for iteration in range(iters):
        tokens, labels, loss_mask, _ = batch(train_set, iteration)
        loss = lm_loss(model(tokens), labels, loss_mask)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for group in optimizer.param_groups:
            group["lr"] = reference_lr(iteration + 1, iters)
        optimizer.step()
        train_losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        val_losses = [lm_loss(model(t), lab, mask).item()
                      for t, lab, mask, _ in (batch(valid_set, i) for i in range(eval_iters))]
    return train_losses, sum(val_losses) / len(val_losses)


# ---- tests -------------------------------------------------------------------------------------


def test_loop_matches_plain_pytorch_reference(process_group, corpus, tmp_path):
    iters = 6
    summary, records, evals = train(corpus, tmp_path, *SCHEDULE, "--train-iters", str(iters),
                                    "--micro-batch-size", "2", "--global-batch-size", "4",
                                    "--eval-interval", "100")
    ref_losses, ref_val_loss = reference_run(corpus, tmp_path, iters, global_batch=4,
                                             eval_iters=2)
    assert losses(records) == pytest.approx(ref_losses, rel=1e-5)
    assert summary.final_valid_loss == pytest.approx(ref_val_loss, rel=1e-5)
    assert [r["lr"] for r in records] == pytest.approx(
        [reference_lr(i, iters) for i in range(1, iters + 1)], rel=1e-9, abs=1e-12)
    assert evals == [{"iteration": iters, "val_loss": pytest.approx(ref_val_loss, rel=1e-5),
                      "val_ppl": pytest.approx(math.exp(ref_val_loss), rel=1e-4)}]
    assert summary == TrainingSummary(iterations=iters, consumed_samples=iters * 4,
                                      skipped_iterations=0,
                                      final_valid_loss=summary.final_valid_loss)


def test_gradient_accumulation_equals_one_large_batch(process_group, corpus, tmp_path):
    common = [*SCHEDULE, "--train-iters", "4", "--global-batch-size", "4", "--eval-interval", "2"]
    _, accumulated, accumulated_evals = train(corpus, tmp_path, *common, "--micro-batch-size", "2")
    _, large, large_evals = train(corpus, tmp_path, *common, "--micro-batch-size", "4")
    assert losses(accumulated) == pytest.approx(losses(large), rel=1e-6, abs=1e-6)
    assert [r["val_loss"] for r in accumulated_evals] == pytest.approx(
        [r["val_loss"] for r in large_evals], rel=1e-6, abs=1e-6)
    assert [r["grad_norm"] for r in accumulated] == pytest.approx(
        [r["grad_norm"] for r in large], rel=1e-5)


def test_activation_checkpointing_gives_the_same_losses(process_group, corpus, tmp_path):
    common = [*SCHEDULE, "--train-iters", "4", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--eval-interval", "100"]
    _, plain, _ = train(corpus, tmp_path, *common)
    _, recomputed, _ = train(corpus, tmp_path, *common, "--checkpoint-activations")
    assert losses(recomputed) == pytest.approx(losses(plain), rel=1e-6, abs=1e-6)
    # Recompute costs a fourth pass, and the TFLOPs figure counts it (Megatron's formula).
    assert recomputed[-1]["tflops_per_gpu"] / recomputed[-1]["tokens_per_sec"] == \
        pytest.approx(4 / 3 * plain[-1]["tflops_per_gpu"] / plain[-1]["tokens_per_sec"])


def test_loss_falls_on_real_text(process_group, corpus, tmp_path):
    summary, records, evals = train(corpus, tmp_path, "--lr", "5e-3", "--train-iters", "30",
                                    "--micro-batch-size", "4", "--eval-interval", "15")
    first, last = losses(records)[:3], losses(records)[-3:]
    # A uniform guess over GPT-2's 50257 tokens costs ln(50257) = 10.8 nats; learning the
    # token frequencies of English alone takes it well below that.
    assert sum(first) / 3 > 10.0
    assert sum(last) / 3 < sum(first) / 3 - 2.0
    assert [r["iteration"] for r in evals] == [15, 30]
    assert evals[1]["val_loss"] < evals[0]["val_loss"] < 10.0
    assert summary.final_valid_loss == evals[1]["val_loss"]


def explode_on_training_call(call: int):
    """lm_loss, but the ``call``-th training micro-batch's loss is infinite (an overflow)."""
    calls = 0

    def loss_fn(logits, labels, loss_mask):
        nonlocal calls
        loss = lm_loss(logits, labels, loss_mask)
        if torch.is_grad_enabled():
            calls += 1
            if calls == call:
                loss = loss * math.inf
        return loss

    return loss_fn


def test_fp16_overflow_skips_the_step_lowers_the_scale_and_recovers(process_group, corpus,
                                                                      tmp_path):
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 1,
                     "loss_scale_window": 1000}}
    # Iteration 3's second micro-batch (call 6 with two micro-batches per iteration).
    summary, records, _ = train(
        corpus, tmp_path, "--fp16", "--lr", "1e-2", "--train-iters", "12",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-interval", "100",
        loss_fn=explode_on_training_call(6), ds_extra=fp16)
    skipped = [r["skipped_iterations"] for r in records]
    scales = [r["loss_scale"] for r in records]
    assert skipped == [0, 0, 1] + [0] * 9
    assert scales == [4096.0] * 2 + [2048.0] * 10
    assert records[2]["lm_loss"] is None  # nothing was applied in that interval
    assert summary.skipped_iterations == 1
    # The skipped step does not advance the schedule (linear decay to 0 over 12): update n
    # runs at lr(n - 1), and iteration 4 makes only the third update.
    assert records[3]["lr"] == pytest.approx(1e-2 * (1 - 2 / 12))
    assert records[-1]["lr"] == pytest.approx(1e-2 * (1 - 10 / 12))
    trained = [loss for loss in losses(records) if loss is not None]
    assert all(math.isfinite(loss) for loss in trained)
    assert sum(trained[-3:]) / 3 < sum(trained[:2]) / 2 - 0.75


def test_bf16_trains(process_group, corpus, tmp_path):
    summary, records, _ = train(corpus, tmp_path, "--bf16", "--lr", "1e-2", "--train-iters",
                                "12", "--micro-batch-size", "4", "--eval-interval", "100",
                                ds_extra={"bf16": {"enabled": True}})
    trained = losses(records)
    assert all(math.isfinite(loss) for loss in trained)
    assert sum(trained[-3:]) / 3 < sum(trained[:3]) / 3 - 0.75
    assert {r["loss_scale"] for r in records} == {1.0}
    assert summary.skipped_iterations == 0


def test_metrics_records_and_log_line(process_group, corpus, tmp_path, capsys):
    summary, records, evals = train(corpus, tmp_path, "--lr", "1e-3", "--train-iters", "5",
                                    "--micro-batch-size", "2", "--log-interval", "2",
                                    "--eval-interval", "4", "--exit-interval", "4")
    out = capsys.readouterr().out
    # --log-interval 2 with --exit-interval 4: records at 2 and 4, then the stop.
    assert summary.iterations == 4
    assert [r["iteration"] for r in records] == [2, 4]
    for record in records:
        assert set(TRAIN_METRIC_KEYS) <= set(record)
        assert record["consumed_samples"] == record["iteration"] * 2
        assert record["consumed_tokens"] == record["iteration"] * 2 * SEQ_LENGTH
        assert record["max_memory_bytes"] > 0
        assert record["elapsed_ms_per_iteration"] > 0
        assert record["tokens_per_sec"] == pytest.approx(record["samples_per_sec"] * SEQ_LENGTH)
        phases = record["comm_bytes"]
        assert set(phases) >= {"forward_all_gather", "gradient_reduce"}
        for by_locality in phases.values():
            assert set(by_locality) == {"intra_node", "inter_node"}
            assert all(isinstance(n, int) for n in by_locality.values())
    assert [r["iteration"] for r in evals] == [4]
    lines = [line for line in out.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 2
    assert "iteration        4/       5 |" in lines[1]
    assert "comm inter-node MB/iter: 0 |" in lines[1]
    assert f"lm loss: {records[1]['lm_loss']:.6E} |" in lines[1]
    assert "validation loss at iteration 4 | lm loss value:" in out
    assert "exiting after iteration 4" in out


def test_offloaded_states_give_the_same_run(process_group, corpus, tmp_path):
    """The program with DeepSpeed's offload blocks ([Note: offload]): the same losses, norms
    and learning rates as with every state on the device (one memory on CPU: bit-exact)."""
    common = [*SCHEDULE, "--train-iters", "4", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--eval-interval", "100", "--zero-stage", "3"]
    _, plain, _ = train(corpus, tmp_path, *common, ds_extra={"zero_optimization": {"stage": 3}})
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                     "offload_param": {"device": "cpu"}}}
    _, offloaded, _ = train(corpus, tmp_path, *common, ds_extra=offload)
    assert losses(offloaded) == losses(plain)
    assert [r["grad_norm"] for r in offloaded] == [r["grad_norm"] for r in plain]
    assert [r["lr"] for r in offloaded] == [r["lr"] for r in plain]


def test_manual_gc_collects_where_the_loop_says_and_trains_the_same(process_group, corpus,
                                                                    tmp_path, monkeypatch):
    """Megatron's --manual-gc: no automatic collection inside iterations, a collection at
    the start, every --manual-gc-interval iterations and around each evaluation; the losses
    do not change, and the collector is on again afterwards."""
    import gc

    import megatron_lite.training as training_module

    events: list[str] = []
    collect = gc.collect

    def counting_collect(*args):
        events.append("collect")
        return collect(*args)

    step = training_module.Trainer.train_step

    def observed_step(self, batches):
        events.append("step, collector on" if gc.isenabled() else "step")
        return step(self, batches)

    common = ["--lr", "1e-3", "--train-iters", "4", "--micro-batch-size", "2",
              "--eval-interval", "2"]
    _, plain, plain_evals = train(corpus, tmp_path, *common)
    monkeypatch.setattr(training_module.gc, "collect", counting_collect)
    monkeypatch.setattr(training_module.Trainer, "train_step", observed_step)
    assert gc.isenabled()
    _, managed, managed_evals = train(corpus, tmp_path, *common, "--manual-gc",
                                      "--manual-gc-interval", "3")
    assert gc.isenabled()
    assert losses(managed) == losses(plain)
    assert [r["val_loss"] for r in managed_evals] == [r["val_loss"] for r in plain_evals]
    # start; 2 steps; around the evaluation at 2; step 3, then its collection; step 4 and the
    # evaluation at 4 (the final one, after the loop, runs with the collector on again)
    assert events[:10] == ["collect", "step", "step", "collect", "collect", "step", "collect",
                           "step", "collect", "collect"]
    events.clear()
    train(corpus, tmp_path, *common, "--manual-gc", "--no-manual-gc-eval")
    assert events == ["collect", "step", "step", "step", "step"]
    with pytest.raises(Exception, match="manual-gc-interval"):
        train(corpus, tmp_path, *common, "--manual-gc", "--manual-gc-interval", "-1")
