"""The planner against a real 4-rank run, and ``--dry-run`` on the tutorial's 18B cluster."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.dry_run import build_report, layer_activation_bytes, run_dry_run
from megatron_lite.model import GPTConfig, GPTModel
from tests.distributed import run_ranks
from zeropp.config import ZeroConfig
from zeropp.planning.planner import (
    ClusterShape,
    kept_for_backward,
    peak_gathered_numel,
    plan_system,
    plan_units,
    plan_zero3_and_zeropp,
    unit_parameter_counts,
)
from zeropp.topology import TopologyError

TOY = dict(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=100,
           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
MICRO_BATCHES = 2
# (ranks per node, zero_optimization block, activation checkpointing): every code path of
# the planner at least once (persistent units, bucketed reductions, prefetch, hpZ, qgZ on
# one node, across nodes and with one rank per node; every block kept from forward to
# backward by the default reuse distance, none, and the last two of three).
CASES = [
    (2, {"stage": 3, "stage3_param_persistence_threshold": 20_000}, False),
    (2, {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
         "zero_quantized_gradients": True, "stage3_param_persistence_threshold": 0,
         "reduce_bucket_size": 20_000, "stage3_prefetch_bucket_size": 60_000,
         "stage3_max_live_parameters": 240_000,
         "stage3_max_reuse_distance": 0}, True),
    (4, {"stage": 3, "zero_quantized_gradients": True, "zero_hpz_partition_size": 4,
         "stage3_param_persistence_threshold": 20_000, "reduce_bucket_size": 20_000,
         "stage3_prefetch_bucket_size": 120_000, "stage3_max_live_parameters": 480_000,
         "stage3_max_reuse_distance": 0}, False),
    (1, {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
         "zero_quantized_gradients_bits": 8, "stage3_param_persistence_threshold": 0,
         "stage3_max_reuse_distance": 150_000}, True),
]
TUTORIAL_18B = (
    "--num-layers 40 --hidden-size 6144 --num-attention-heads 32 --seq-length 512 "
    "--batch-size 1 --fp16 --checkpoint-activations "
    "--deepspeed_config configs/ds_zeropp_config.json "
    "--dry-run --dry-run-nodes 4 --dry-run-gpus-per-node 16 --no-dry-run-simulate"
)
GPT2_VOCAB = 50257


def measure_case(rank, per_node, zero_block, checkpoint):
    """Bytes of the last step, memory after a forward, and the gathered-parameter peak seen
    at each block's forward, for one engine configuration."""
    from megatron_lite.model.gpt import lm_loss
    from zeropp.deepspeed_api.initialize import build_engine, make_loss_scaler, options_from_config

    sharding, quantization = options_from_config(ZeroConfig.from_mapping(zero_block))
    with torch.device("meta"):
        model = GPTModel(GPTConfig(**TOY, checkpoint_activations=checkpoint))
    engine = build_engine(
        model, lr=1e-3, dtype=torch.float16, gradient_accumulation_steps=MICRO_BATCHES,
        loss_scaler=make_loss_scaler(True), ranks_per_node=per_node, sharding=sharding,
        quantization=quantization)
    forward_peaks = []

    def record_gathered(module, inputs):
        if engine.sharded.phase.value == "forward":  # not the recompute in backward
            forward_peaks.append(engine.memory_breakdown()["gathered_parameters"])

    for layer in model.layers:  # registered after the engine's hooks: sees its gathers
        layer.register_forward_pre_hook(record_gathered)
    generator = torch.Generator().manual_seed(rank)
    after_forward = bytes_last_step = None
    for _ in range(2):
        for _ in range(MICRO_BATCHES):
            tokens = torch.randint(0, TOY["vocab_size"], (2, 17), generator=generator)
            logits = engine(tokens[:, :-1])
            after_forward = engine.memory_breakdown()
            engine.backward(lm_loss(logits, tokens[:, 1:], torch.ones(2, 16)))
            engine.step()
        bytes_last_step = engine.comm_bytes(reset=True)
    return bytes_last_step, after_forward, max(forward_peaks)


def measure_cases(rank, world):
    """Every case on every rank, in one set of processes (spawning costs more than a case)."""
    return [measure_case(rank, *case) for case in CASES]


@pytest.fixture(scope="module")
def measured():
    return run_ranks(measure_cases, 4)


def toy_plan(case_index: int):
    per_node, zero_block, _ = CASES[case_index]
    with torch.device("meta"):
        counts = unit_parameter_counts(GPTModel(GPTConfig(**TOY)))
    return plan_system("case", counts, ClusterShape(4, per_node),
                       ZeroConfig.from_mapping(zero_block), dtype_bytes=2,
                       micro_batches=MICRO_BATCHES)


@pytest.mark.parametrize("case_index", range(len(CASES)),
                         ids=["zero3-2x2", "zeropp-2x2", "qgz-hpz-1x4", "qwz-qgz8-4x1"])
def test_planned_bytes_equal_measured_bytes(measured, case_index):
    plan = toy_plan(case_index)
    for rank, rank_results in enumerate(measured):
        bytes_last_step = rank_results[case_index][0]
        for phase, by_locality in plan.comm.items():
            for locality, planned in by_locality.items():
                got = bytes_last_step[phase][locality]
                assert got == planned, (rank, phase, locality, got, planned)
    # the real run did send something in every training phase
    assert all(sum(plan.comm[phase].values()) > 0
               for phase in ("forward_all_gather", "gradient_reduce"))


@pytest.mark.parametrize("case_index", range(len(CASES)),
                         ids=["zero3-2x2", "zeropp-2x2", "qgz-hpz-1x4", "qwz-qgz8-4x1"])
def test_planned_memory_equals_measured_memory(measured, case_index):
    plan = toy_plan(case_index)
    memory = plan.memory
    for rank_results in measured:
        _, after_forward, forward_peak = rank_results[case_index]
        for key in ("working_shards", "gradient_shards", "fp32_master_shards",
                    "optimizer_moments", "hpz_secondary_shards"):
            assert after_forward[key] == getattr(memory, key), key
        # after forward the root, persistent units and blocks reused soon are still gathered
        kept = kept_for_backward(plan.units, plan.zero)
        always = sum(u.padded_numel for u in plan.units
                     if u.is_root or u.persistent or id(u) in kept)
        assert after_forward["gathered_parameters"] == always * 2
        assert forward_peak == peak_gathered_numel(plan.units, plan.zero, backward=False) * 2
        assert memory.gathered_parameters >= forward_peak


def test_reuse_distance_cases_keep_all_none_and_some_blocks():
    kept = [len(kept_for_backward(toy_plan(i).units, toy_plan(i).zero)) for i in range(4)]
    assert kept == [3, 0, 0, 2]


def test_hpz_and_prefetch_cases_are_not_trivial():
    # The cases above must exercise what they claim to: secondary shards and a prefetch.
    hpz_plan, prefetch_plan = toy_plan(1), toy_plan(2)
    assert hpz_plan.memory.hpz_secondary_shards > 0
    blocks = [u.padded_numel for u in prefetch_plan.units if not (u.is_root or u.persistent)]
    always = sum(u.padded_numel for u in prefetch_plan.units if u.is_root or u.persistent)
    assert peak_gathered_numel(prefetch_plan.units, prefetch_plan.zero, False) \
        >= always + 2 * blocks[0]
    assert any(u.persistent for u in prefetch_plan.units)


def test_planner_agrees_with_the_engine_tests_theory_at_4x16():
    from tests.test_zeropp_engine import _theory

    with torch.device("meta"):
        counts = unit_parameter_counts(GPTModel(GPTConfig(40, 6144, 32, GPT2_VOCAB, 512)))
    zero = ZeroConfig.from_mapping({"stage": 3, "zero_quantized_weights": True,
                                    "zero_hpz_partition_size": 16,
                                    "zero_quantized_gradients": True,
                                    "reduce_bucket_size": 10_000_000,
                                    # the theory re-gathers every block for backward
                                    "stage3_max_reuse_distance": 0})
    plans = plan_zero3_and_zeropp(counts, 64, 16, zero, dtype_bytes=2, micro_batches=2)
    quant = {"quantized_weights": True, "hpz_size": 16, "quantized_gradients": True}
    for plan, theory_quant in zip(plans, ({}, quant), strict=True):
        layouts = [(u.padded_numel, u.is_root) for u in plan.units]
        for phase, expected in _theory(layouts, 64, 16, theory_quant, 2).items():
            assert plan.comm[phase]["inter_node"] == pytest.approx(expected, rel=0.02), phase


def test_planner_rejects_bad_input():
    zero = ZeroConfig(stage=3, zero_hpz_partition_size=16)
    with pytest.raises(TopologyError, match="must divide the ranks per node"):
        plan_system("x", [10, 10], ClusterShape(16, 8), zero, 2)
    with pytest.raises(TopologyError, match="does not divide the world size"):
        ClusterShape(12, 8)
    with pytest.raises(ValueError, match="unit_numels is empty"):
        plan_units([], ClusterShape(2, 2), zero)
    with pytest.raises(ValueError, match=r"unit_numels\[1\]"):
        plan_units([4, -1], ClusterShape(2, 2), zero)
    with pytest.raises(ValueError, match="dtype_bytes"):
        plan_system("x", [10], ClusterShape(2, 2), ZeroConfig(stage=3), 3)


# ---- the tutorial's 18B on 4 nodes x 16 V100-32GB ------------------------------------------


@pytest.fixture(scope="module")
def report_18b():
    return build_report(parse_args(TUTORIAL_18B.split()))


def test_18b_parameter_count_is_gptconfig_num_parameters(report_18b):
    expected = GPTConfig(40, 6144, 32, GPT2_VOCAB, max_position_embeddings=512).num_parameters()
    assert report_18b.num_parameters == expected == 18_434_813_952
    for plan in report_18b.plans:
        assert sum(u.numel for u in plan.units) == expected


def test_18b_fits_and_zeropp_cuts_inter_node_volume_by_more_than_4x(report_18b):
    zero3, zeropp = report_18b.plans
    assert report_18b.fits(zero3) and report_18b.fits(zeropp)
    assert zeropp.comm_total("inter_node") < zero3.comm_total("inter_node") / 4
    assert zeropp.comm["backward_all_gather"]["inter_node"] == 0
    # hpZ's int8 secondary costs 1 byte (and a 4-byte scale per 256) x (block parameters) / 16
    # per GPU, padding aside, but for the last block: its attention and two MLP Linears are
    # within stage3_max_reuse_distance (1e9) of their backward, so they stay gathered
    block_params = report_18b.num_parameters - zero3.units[0].numel
    kept = kept_for_backward(zeropp.units, zeropp.zero)
    assert kept == {id(u) for u in zeropp.units[-3:]}
    assert zeropp.memory.hpz_secondary_shards == pytest.approx(
        block_params * 39 / 40 / 16 * (1 + 4 / 256), rel=2e-3)
    assert zero3.memory.hpz_secondary_shards == 0
    assert report_18b.total_bytes(zeropp) > report_18b.total_bytes(zero3)


def test_18b_memory_breakdown_sums(report_18b):
    psi, gpus = report_18b.num_parameters, 64
    for plan in report_18b.plans:
        memory = plan.memory
        assert memory.model_states == (memory.working_shards + memory.gradient_shards
                                       + memory.fp32_master_shards + memory.optimizer_moments)
        # 2 (fp16 weights) + 2 (fp16 gradients: one micro-batch) + 4 (master) + 8 (Adam) bytes
        # per parameter
        assert memory.model_states == pytest.approx(16 * psi / gpus, rel=1e-3)
        # the larger phase: here the backward (gathered blocks, gradient buffers, recompute)
        activations = report_18b.activations
        backward = (memory.gathered_parameters + memory.gradient_buffers
                    + activations.kept_for_backward + activations.recomputed_chunk)
        assert report_18b.total_bytes(plan) == (memory.model_states + memory.hpz_secondary_shards
                                                + backward)
    activations = report_18b.activations
    s, h, layers = 512, 6144, 40
    assert activations.kept_for_backward == layers * 2 * s * h  # one input per layer
    assert activations.recomputed_chunk == 512 * (34 * 6144 + 5 * 32 * 512) == 148_897_792
    # the fp16 logits and the chunked loss's fp32 working set (all of them: under 2 chunks)
    assert activations.logits == s * 50304 * (2 + 4)


def test_activation_formula_without_recompute_is_megatrons():
    config = GPTConfig(2, 1024, 16, 1000)
    s, b, h, a = 256, 4, 1024, 16
    assert layer_activation_bytes(config, s, b) == s * b * h * (34 + 5 * a * s // h)


def test_dry_run_prints_the_18b_plan(capsys):
    status = run_dry_run(parse_args(TUTORIAL_18B.split()))
    out = capsys.readouterr().out
    assert status == 0
    assert "number of parameters: 18,434,813,952 (18.43B)" in out
    assert "4 node(s) x 16 GPUs = 64 GPUs of 32 GiB" in out
    assert "ZeRO++: qwZ int8, hpZ 16 (int8 secondary), qgZ int4" in out
    verdict = next(line for line in out.splitlines() if line.strip().startswith("vs GPU memory"))
    assert verdict.split()[-2:] == ["fits", "fits"]
    ratio_line = next(line for line in out.splitlines() if "ZeRO-3 / ZeRO++" in line)
    assert float(ratio_line.rsplit(" ", 1)[1].rstrip("x")) > 4
    # An asynchronous save stages each rank's fp32 masters and two Adam moments on the host:
    # 12 bytes per parameter over 64 ranks (plus shard padding).
    staging = next(line for line in out.splitlines() if "--async-save stages" in line)
    assert "host (pinned) memory per rank" in staging
    gib = float(staging.split("stages ")[1].split()[0])
    assert gib == pytest.approx(18_434_813_952 * 12 / 64 / 2**30, abs=0.02)


WITHOUT_DS_CONFIG = TUTORIAL_18B.replace("--deepspeed_config configs/ds_zeropp_config.json", "")


@pytest.mark.parametrize(("argv", "message"), [
    (f"{TUTORIAL_18B} --dry-run-gpus-per-node 8",
     "zero_hpz_partition_size=16 must divide the ranks per node (8)"),
    (f"{TUTORIAL_18B} --dry-run-nodes 0", "--dry-run-nodes 0 must be positive"),
    (f"{WITHOUT_DS_CONFIG} --zero-stage 0", "--zero-stage 0 with 64 GPUs"),
    (TUTORIAL_18B.replace("ds_zeropp_config", "no_such_config"), "no_such_config.json"),
], ids=["hpz-vs-node", "no-nodes", "stage0", "missing-config"])
def test_dry_run_errors_are_one_line(capsys, argv, message):
    status = run_dry_run(parse_args(argv.split()))
    err = capsys.readouterr().err
    assert status in (1, 2)
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_dry_run_without_ds_config_plans_plain_zero3():
    report = build_report(parse_args(WITHOUT_DS_CONFIG.split()))
    zero3, configured = report.plans
    assert dataclasses.replace(configured.zero, stage=3) == zero3.zero
    assert configured.comm == zero3.comm
    assert report.inter_node_ratio == pytest.approx(1.0)


def test_prefetch_allows_the_next_unit_whatever_the_live_cap():
    from zeropp.prefetch import PlannedUnit, units_to_prefetch

    # 18B's shape: root 312M + current block 453M live, cap 1e9: the next block still comes
    upcoming = [PlannedUnit(453_000_000, False), PlannedUnit(453_000_000, False)]
    assert units_to_prefetch(upcoming, 765_000_000, 50_000_000, 1_000_000_000) == [0]
    # beyond the next unit the cap holds; a bucket of 0 still disables prefetch
    assert units_to_prefetch(upcoming, 0, 2_000_000_000, 1_000_000_000) == [0, 1]
    assert units_to_prefetch(upcoming, 200_000_000, 2_000_000_000, 1_000_000_000) == [0]
    assert units_to_prefetch(upcoming, 0, 0, 1_000_000_000) == []


def test_dry_run_shows_error_feedback_memory(capsys, tmp_path):
    """LoCo's int4 errors cover the rank's chunk of the first hop's landing, 1/16 of the
    model on 16-GPU nodes: half a byte per element (plus a scale per block), 0.55 GiB at
    18B, within the 1 GiB the paper's scale allows; listed on its own line for ZeRO++ only."""
    config = json.loads(Path("configs/ds_zeropp_config.json").read_text())
    config["zero_optimization"]["zeropp_loco_param"] = {"err_beta": 0.8, "reset_T": 1024}
    path = tmp_path / "loco.json"
    path.write_text(json.dumps(config))
    argv = TUTORIAL_18B.replace("configs/ds_zeropp_config.json", str(path))
    assert run_dry_run(parse_args(argv.split())) == 0
    line = next(line for line in capsys.readouterr().out.splitlines()
                if "qgZ error feedback" in line)
    zero3_gib, zeropp_gib = (float(v) for v in line.split()[-2:])
    assert zero3_gib == 0
    assert zeropp_gib == pytest.approx(18.43e9 / 16 * (0.5 + 4 / 256) / 2**30, rel=0.02)
    assert zeropp_gib <= 1.0
