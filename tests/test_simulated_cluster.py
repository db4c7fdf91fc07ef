"""The real program on the simulated GPU cluster: NCCL's rules, memory, host syncs.

Each test runs ``megatron_lite.pretrain_gpt.main`` as ranks of a cluster of GPUs that do not
exist (meta tensors, the simulated process group), so the GPU path (the CUDA execution
model) is what is checked, not the CPU one.
"""

from __future__ import annotations

import json

import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.dry_run import build_report, run_dry_run
from megatron_lite.model import GPTConfig
from megatron_lite.simulate import simulate_cluster, simulate_rank

# GPT-3 XL's width (2048, 16 heads, 1024 tokens), fp16 with activation checkpointing: the
# tutorial's recipe, small. 8 of its 24 layers (0.5B parameters): what these tests check (NCCL's
# rules, the order of collectives, the plan and DeepSpeed's formulas against the measured
# peak) holds layer by layer, and a third of the layers takes a third of the simulation time.
XL_LAYERS = 8
GPT_XL = (f"--num-layers {XL_LAYERS} --hidden-size 2048 --num-attention-heads 16 --seq-length 1024 "
            "--max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 16 "
            "--lr 1e-4 --fp16 --checkpoint-activations").split()
SMALL = ("--num-layers {layers} --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
         "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 32 --lr 1e-4 "
         "--fp16 --checkpoint-activations").split()
# The step's outcome stays on the device ([Note: step outcome on the device]): the one host
# read of device values per iteration is the log line's (every iteration here), which reads
# the loss, the skipped count, the gradient norm, the loss scale and the streak of
# non-finite losses --exit-on-nan watches in one transfer.
LOG_SYNCS = {"read_back": 1}


def ds_config(tmp_path, **zero) -> str:
    with open("configs/ds_zeropp_config.json") as f:
        config = json.load(f)
    config["zero_optimization"].update(zero)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def functions(syncs: dict[str, int]) -> dict[str, int]:
    return {site.rsplit(" in ", 1)[1]: count for site, count in syncs.items()}


@pytest.mark.parametrize("system", ["zero3", "zeropp"])
def test_gpt3_xl_width_on_2x8_follows_nccl_rules_and_the_plan(tmp_path, system):
    zero = dict(zero_quantized_weights=False, zero_hpz_partition_size=1,
                zero_quantized_gradients=False) if system == "zero3" else \
        dict(zero_hpz_partition_size=8)
    argv = GPT_XL + ["--deepspeed_config", ds_config(tmp_path, **zero)]
    cluster = simulate_cluster(argv, nodes=2, gpus_per_node=8)

    for rank in (cluster.first, cluster.last):
        assert rank.violations == []  # no tensor off the device, nothing off the thread
        assert functions(rank.host_syncs_per_iteration) == LOG_SYNCS
        assert sum(rank.collectives.values()) > 100
    assert (cluster.first.rank, cluster.last.rank) == (0, 15)
    assert cluster.order_mismatches == []  # training, save and resume: same order
    world = tuple(range(16))
    # 9 units (8 whole 50M-parameter blocks and the root) over 4 iterations and a resume
    assert len(cluster.first.order[world]) == len(cluster.last.order[world]) > 60

    # Every communicator is warmed up at initialize, with one all-reduce, before any other
    # use ([Note: eager communicators]); the exact reductions run on a world communicator of
    # their own (the reduce world), apart from the gathers'.
    assert all(records[0].op == "all_reduce" for records in cluster.first.order.values())
    # (one per engine: the run, then its resume in the same process)
    reduce_worlds = [key for key in cluster.first.order if key[:len(world)] == world != key]
    assert len(reduce_worlds) == 2
    reduce_ops = {record.op for key in reduce_worlds for record in cluster.first.order[key][1:]}
    assert reduce_ops == ({"reduce_scatter_single"} if system == "zero3" else set())
    assert "reduce_scatter_single" not in {r.op for r in cluster.first.order[world]}
    # ZeRO++ gathers for backward inside the node (hpZ) and reduces by all-to-all (qgZ)
    node_ops = {record.op for key, records in cluster.first.order.items()
                if key != world and key not in reduce_worlds for record in records[1:]}
    expected = {"all_gather_single", "all_to_all_single"} if system == "zeropp" else set()
    assert node_ops == expected
    peak = cluster.first.peak_by_category
    assert peak["model states"] > 0 and peak["gathered weights"] > 0
    # [Note: allocation lanes]: the exact collectives write into buffers the compute stream
    # allocated; qwZ's and qgZ's payloads come from the gather and reduce streams' pools,
    # which CUDA's caching allocator holds beside the compute stream's.
    lanes = cluster.first.lane_peaks
    if system == "zero3":
        assert set(lanes) == {"compute"}
        assert cluster.first.reserved_peak_bytes == cluster.first.peak_bytes
    else:
        assert lanes["gather"] > 0 and lanes["reduce"] > 0
        assert cluster.first.reserved_peak_bytes > cluster.first.peak_bytes
    report = build_report(parse_args(argv + ["--dry-run", "--dry-run-nodes", "2",
                                              "--dry-run-gpus-per-node", "8"]))
    plan = report.plans[1 if system == "zeropp" else 0]
    planned = report.total_bytes(plan)
    assert abs(planned / cluster.peak_bytes - 1) < 0.10
    # the side streams' pools: none for ZeRO-3, planned and measured alike
    assert (plan.memory.stream_buffers == 0) == (system == "zero3")
    reserved = max(cluster.first.reserved_peak_bytes, cluster.last.reserved_peak_bytes)
    assert abs(report.reserved_bytes(plan) / reserved - 1) < 0.10


# A Llama-style 0.93B (TinyLlama's width and groups, 16 layers): rotary positions, RMSNorm,
# SwiGLU, 16 query heads over 4 key/value groups, untied output layer, no biases; bf16.
LLAMA_1B = ("--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --group-query-attention "
            "--num-query-groups 4 --ffn-hidden-size 5632 --seq-length 2048 "
            "--max-position-embeddings 2048 --position-embedding-type rope --normalization RMSNorm "
            "--swiglu --untie-embeddings-and-output-weights --disable-bias-linear "
            "--micro-batch-size 1 --global-batch-size 16 --lr 1e-4 --bf16 "
            "--recompute-granularity full --recompute-method uniform").split()


def test_llama_style_on_2x8_follows_nccl_rules_and_the_plan(tmp_path):
    argv = LLAMA_1B + ["--deepspeed_config", ds_config(tmp_path, zero_hpz_partition_size=8)]
    cluster = simulate_cluster(argv, nodes=2, gpus_per_node=8)
    for rank in (cluster.first, cluster.last):
        assert rank.violations == []
        assert functions(rank.host_syncs_per_iteration) == LOG_SYNCS
    assert cluster.order_mismatches == []
    world = tuple(range(16))
    # Past each communicator's warm-up all-reduce ([Note: eager communicators]).
    node_ops = {record.op for key, records in cluster.first.order.items() if key != world
                for record in records[1:]}
    assert node_ops == {"all_gather_single", "all_to_all_single"}
    report = build_report(parse_args(argv + ["--dry-run", "--dry-run-nodes", "2",
                                              "--dry-run-gpus-per-node", "8"]))
    assert report.num_parameters == 927_533_056
    assert abs(report.total_bytes(report.plans[1]) / cluster.peak_bytes - 1) < 0.10


def test_units_below_the_block_follow_nccl_rules(tmp_path):
    """786K-element blocks split into their Linears (a 75K cap: a quarter of the 300K live
    budget), recomputed units released beyond that budget, hpZ's secondary int8 or 16-bit: NCCL's rules, the same
    order on the first and last rank through training, save and resume, host reads only at
    the log; the int8 secondary takes half the 16-bit one's bytes (and a 4-byte scale per
    256)."""
    secondary_peaks = []
    for int8 in (True, False):
        argv = [a.format(layers=4) for a in SMALL] + ["--deepspeed_config", ds_config(
            tmp_path, zero_hpz_partition_size=4, stage3_prefetch_bucket_size=200_000,
            stage3_max_live_parameters=300_000, stage3_param_persistence_threshold=1000,
            zero_hpz_quantized_secondary=int8)]
        cluster = simulate_cluster(argv, nodes=2, gpus_per_node=4)
        for rank in (cluster.first, cluster.last):
            assert rank.violations == []
            assert functions(rank.host_syncs_per_iteration) == LOG_SYNCS
        assert cluster.order_mismatches == []
        secondary_peaks.append(cluster.first.category_peaks["hpZ secondary shards"])
    report = build_report(parse_args(argv + ["--dry-run", "--dry-run-nodes", "2",
                                              "--dry-run-gpus-per-node", "4"]))
    assert len(report.plans[1].units) == 1 + 4 * 5  # root; per block its norms and 4 Linears
    assert secondary_peaks[0] / secondary_peaks[1] == pytest.approx((1 + 4 / 256) / 2, rel=0.02)


def test_memory_of_gradients_in_flight_does_not_grow_with_depth():
    def gradients_in_flight(layers: int) -> int:
        argv = [a.format(layers=layers) for a in SMALL] + [
            "--deepspeed_config", "configs/ds_zero3_config.json"]
        return simulate_rank(argv, 0, 1, 4, save_dir=None).category_peaks[
            "gradients in flight"]

    assert gradients_in_flight(8) == gradients_in_flight(2)


def test_a_collective_off_the_training_thread_is_caught(monkeypatch, tmp_path):
    """The check works: qgZ on a host worker thread (the CPU path) breaks NCCL's rule."""
    import importlib

    from zeropp.comm.streams import HostThreadExecution

    # (the package's ``initialize`` function shadows its module of the same name)
    monkeypatch.setattr(importlib.import_module("zeropp.deepspeed_api.initialize"), "execution_for",
                        lambda device, overlap: HostThreadExecution())
    argv = [a.format(layers=2) for a in SMALL] + [
        "--deepspeed_config", ds_config(tmp_path, zero_hpz_partition_size=2)]
    result = simulate_rank(argv, 0, 2, 2, save_dir=None)
    threads = [v for v in result.violations if v.rule == "thread"]
    assert threads and all("all_to_all" in str(v) for v in threads)


def test_dry_run_prints_measured_next_to_planned(capsys):
    argv = [a.format(layers=2) for a in SMALL] + [
        "--deepspeed_config", "configs/ds_zeropp_config.json", "--dry-run",
        "--dry-run-nodes", "2", "--dry-run-gpus-per-node", "16", "--global-batch-size", "64"]
    assert run_dry_run(parse_args(argv), argv) == 0
    out, err = capsys.readouterr()
    # The progress of each simulated system goes to stderr, a line per stage (stderr is not
    # a terminal here); stdout holds the tables only.
    progress = [line for line in err.splitlines() if line.startswith("simulating ")]
    expected = [f"simulating {system} as rank 0 of 32: {stage} ("
                for system in ("ZeRO-3", "ZeRO++")
                for stage in ("setting up", *(f"iteration {i} of 3" for i in (1, 2, 3)))]
    assert len(progress) == len(expected), err
    for line, start in zip(progress, expected, strict=True):
        assert line.startswith(start) and line.endswith(" s)"), line
    assert "simulating" not in out and "\r" not in out
    measured = next(line for line in out.splitlines() if "peak, measured" in line)
    zero3, zeropp = (float(v) for v in measured.split()[-2:])
    assert 0 < zero3 <= zeropp
    assert "rank 0 of 32 on the simulated GPU cluster" in out
    # the step-time prediction on every built-in 16-GPU node: ZeRO++ never slower, and the
    # gain shrinks as the link grows (100 -> 800 Gbit/s)
    predicted = {line.split()[0]: line.split()[1:] for line in out.splitlines()
                 if line.strip().startswith("dgx2_")}
    assert list(predicted) == ["dgx2_100g", "dgx2_200g", "dgx2_400g", "dgx2_800g"]
    gains = []
    for cells in predicted.values():
        zero3_s, zero3_tf, zeropp_s, zeropp_tf = cells
        assert float(zeropp_s) <= float(zero3_s) and float(zeropp_tf) >= float(zero3_tf) > 0
        gains.append(float(zeropp_tf) / float(zero3_tf))
    assert gains == sorted(gains, reverse=True) and gains[0] > gains[-1]


def test_dry_run_cluster_names_one_cluster_and_errors_are_one_line(capsys):
    argv = [a.format(layers=2) for a in SMALL] + [
        "--deepspeed_config", "configs/ds_zeropp_config.json", "--dry-run",
        "--dry-run-nodes", "2", "--dry-run-cluster", "dgx2_400g", "--global-batch-size", "64"]
    assert run_dry_run(parse_args(argv), argv) == 0
    out = capsys.readouterr().out
    assert "2 node(s) x 16 GPUs" in out  # GPUs per node taken from the named cluster
    assert [line.split()[0] for line in out.splitlines()
            if line.strip().startswith("dgx")] == ["dgx2_400g"]
    for extra, message in (
            (["--dry-run-cluster", "dgx9"], "--dry-run-cluster 'dgx9' is not a built-in"),
            (["--dry-run-cluster", "dgx_h100", "--dry-run-gpus-per-node", "16"],
             "give --dry-run-gpus-per-node 8"),
            (["--dry-run-cluster", "dgx2_100g", "--no-dry-run-simulate"],
             "drop --no-dry-run-simulate")):
        bad = argv[:-6] + ["--dry-run-nodes", "2", "--global-batch-size", "64"] + extra
        assert run_dry_run(parse_args(bad), bad) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_on_16_gpus_follow_nccl_rules_and_deepspeeds_formulas(tmp_path, stage):
    """The tutorial's JSON with only ``stage`` changed, GPT-3 XL's width in fp16 on 2 x 8 simulated GPUs
    (two micro-batches accumulated): NCCL's rules hold, no gather in forward or backward, and
    the model states plus held gradients at the peak follow DeepSpeed's formulas within 10%
    (d = 2 bytes, K = 12: stage 1 2d Psi + K Psi / N, stage 2 d Psi + (d + K) Psi / N)."""
    argv = GPT_XL + ["--global-batch-size", "32",
                       "--deepspeed_config", ds_config(tmp_path, stage=stage),
                       "--zero-stage", str(stage)]
    cluster = simulate_cluster(argv, nodes=2, gpus_per_node=8)
    for rank in (cluster.first, cluster.last):
        assert rank.violations == []
        assert functions(rank.host_syncs_per_iteration) == LOG_SYNCS
    assert cluster.order_mismatches == []
    psi = GPTConfig(num_layers=XL_LAYERS, hidden_size=2048, num_attention_heads=16, vocab_size=50257,
                    max_position_embeddings=1024).num_parameters()
    n, d, k = 16, 2, 12
    formula = 2 * d * psi + k * psi / n if stage == 1 else d * psi + (d + k) * psi / n
    peak = cluster.first.peak_by_category
    held = peak["model states"] + (peak.get("gradients in flight", 0) if stage == 1 else 0)
    assert abs(held / formula - 1) < 0.10, (held, formula)
    assert peak.get("gathered weights", 0) == 0  # the weights are whole: nothing is gathered


def test_weight_deltas_follow_nccl_rules_and_the_plan(tmp_path):
    """[Note: weight deltas] on 2 x 4 simulated GPUs through training, save and resume:
    NCCL's rules, the same order on the first and last rank, host reads only at the log; the
    planner's inter-node forward bytes and the bases' memory agree with what the rank did and held."""
    argv = [a.format(layers=2) for a in SMALL] + ["--deepspeed_config", ds_config(
        tmp_path, zero_hpz_partition_size=4, zero_quantized_weight_deltas=True,
        stage3_param_persistence_threshold=1000)]
    cluster = simulate_cluster(argv, nodes=2, gpus_per_node=4)
    for rank in (cluster.first, cluster.last):
        assert rank.violations == []
        assert functions(rank.host_syncs_per_iteration) == LOG_SYNCS
    assert cluster.order_mismatches == []
    report = build_report(parse_args(argv + ["--dry-run", "--dry-run-nodes", "2",
                                              "--dry-run-gpus-per-node", "4"]))
    bases = report.plans[1].memory.hpz_secondary_shards
    measured = cluster.first.category_peaks["hpZ secondary shards"]
    assert bases > 0 and measured == pytest.approx(bases, rel=0.05), (measured, bases)


def test_a_save_stages_on_the_host_lane_as_the_dry_run_plans(tmp_path):
    """A checkpoint save (async or not: both copy the shards into host staging buffers first,
    [Note: asynchronous checkpoint saves]) on the simulated GPU cluster: the staging counts as
    host memory, the size the dry run prints for --async-save (fp32 masters and Adam moments),
    and the device's peak is the same in both modes. Before, a synchronous save staged into
    real host memory the tracker did not see (0 host bytes here; 26 GB per rank for the 138B
    on 64 GPUs, more than a small machine has), and an asynchronous one failed copying out of
    meta tensors."""
    argv = [a.format(layers=2) for a in SMALL] + [
        "--deepspeed_config", "configs/ds_zero3_config.json"]
    measured = {}
    for mode in ([], ["--async-save"]):
        rank = simulate_rank(argv + mode, 0, 2, 4, save_dir=tmp_path / f"save{len(mode)}")
        assert rank.violations == []
        measured[bool(mode)] = (rank.host_peak_bytes, rank.peak_bytes)
    memory = build_report(parse_args(argv + ["--dry-run", "--dry-run-nodes", "2",
                                             "--dry-run-gpus-per-node", "4"])).plans[1].memory
    planned = memory.fp32_master_shards + memory.optimizer_moments
    assert measured[True] == measured[False]
    host, _ = measured[True]
    assert host == pytest.approx(planned, rel=0.01), (host, planned)
