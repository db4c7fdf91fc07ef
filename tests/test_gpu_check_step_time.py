"""The step-time model with the GPU check's measured kernel rates: the report's
`kernel_rates` read by `zeropp.planning.kernel_rates.load_kernel_rates`, slower rates lengthening the
quantization ops, and the dry run's --dry-run-kernel-rates."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_lite.arguments import parse_args as parse_training_args
from megatron_lite.dry_run import (
    kernel_rate_lines,
    measured_kernel_rates,
    predicted_clusters,
    predicted_lines,
    run_dry_run,
)
from scripts.gpu_check.report import SectionResult, build_report, write_report
from zeropp.planning.kernel_rates import KernelRatesError, load_kernel_rates
from zeropp.planning.step_time import (
    CLUSTERS,
    DEFAULT_HOST_SECONDS_PER_OP,
    predict,
    with_kernel_rates,
)
from zeropp.simulation.trace import Collective, ComputeOp, IterationTrace, Launch, Wait

QUANTIZE_OP = "zeropp.quantize_blockwise.default"
DEQUANTIZE_MANY_OP = "zeropp.dequantize_blockwise_many.default"
RATES = {QUANTIZE_OP: 2.5e12, DEQUANTIZE_MANY_OP: 2.9e12}
H100 = {"name": "NVIDIA H100 80GB HBM3",
        "peak_memory_bandwidth": {"bytes_per_second": 3.35e12, "source": "device properties",
                                  "detail": "2 x 2619 MHz x 5120 bit / 8"}}


HOST_SECONDS_PER_OP = 7.5e-6  # section e: host issue time over the GPU launches


def sample_report_file(tmp_path: Path, rates: dict[str, float],
                       host_seconds_per_op: float = HOST_SECONDS_PER_OP) -> Path:
    """A report as the GPU check writes it (its own writer), sections a, b and e."""
    report = build_report(
        sections=[SectionResult("a", "pass", 40.0, "bit-exact"),
                  SectionResult("b", "fail", 12.0, "1 of 6 kernels below 70% of peak",
                                {"kernel_rates": rates}),
                  SectionResult("e", "pass", 30.0, "GPU busy 91%",
                                {"host_seconds_per_op": host_seconds_per_op})],
        device=json.loads(json.dumps(H100)), environment={}, total_seconds=85.0,
        options={"quick": True, "sections": ["a", "b", "e"], "budget_s": 570})
    return write_report(report, tmp_path / f"run{len(list(tmp_path.iterdir()))}")


def test_kernel_rates_are_read_from_the_report(tmp_path):
    measured = load_kernel_rates(sample_report_file(tmp_path, RATES))
    assert measured.rates == RATES
    assert measured.device == "NVIDIA H100 80GB HBM3"
    assert measured.peak_memory_bandwidth == 3.35e12
    minimal = tmp_path / "minimal.json"
    minimal.write_text(json.dumps({"kernel_rates": {QUANTIZE_OP: 1e12}}))
    assert load_kernel_rates(minimal).rates == {QUANTIZE_OP: 1e12}
    cluster = with_kernel_rates(CLUSTERS["dgx_h100"], measured)
    assert cluster.kernel_bandwidth == RATES and CLUSTERS["dgx_h100"].kernel_bandwidth == {}
    # Section e's host cost per launch replaces the cited default; without it, it stays.
    assert measured.host_seconds_per_op == cluster.host_seconds_per_op == HOST_SECONDS_PER_OP
    assert load_kernel_rates(minimal).host_seconds_per_op is None
    assert with_kernel_rates(CLUSTERS["dgx_h100"], load_kernel_rates(minimal)) \
        .host_seconds_per_op == DEFAULT_HOST_SECONDS_PER_OP


@pytest.mark.parametrize(("content", "message"), [
    (None, "does not exist (scripts/gpu_check.sh writes one)"),
    ("{not json", "is not JSON: Expecting property name"),
    ("[1, 2]", "must hold a JSON object, got list"),
    ('{"schema": "other", "kernel_rates": {}}', "is a 'other' file, not a GPU check report"),
    ('{"schema": "zeropp-gpu-check", "version": 9, "kernel_rates": {}}', "report version 9"),
    ('{"device": {}}', "has no 'kernel_rates' object"),
    ('{"kernel_rates": {}}', "has no kernel rates: the check's bandwidth section (b)"),
    ('{"kernel_rates": {"zeropp.quantize_blockwise.default": -3}}',
     "kernel_rates['zeropp.quantize_blockwise.default'] must be a positive number"),
    ('{"kernel_rates": {"zeropp.quantize_blockwise.default": true}}', "positive number"),
    ('{"kernel_rates": {"zeropp.quantize_blockwise.default": 1}, "host_seconds_per_op": 0}',
     "host_seconds_per_op must be a positive number of seconds, got 0"),
])
def test_bad_kernel_rate_files_give_one_line(tmp_path, content, message):
    path = tmp_path / "gpu_check.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(KernelRatesError) as error:
        load_kernel_rates(path)
    assert message in str(error.value) and str(path) in str(error.value)
    assert "\n" not in str(error.value)


def quantizing_trace(cluster) -> IterationTrace:
    """A forward whose gather lane quantizes and dequantizes 2 GB while 0.1 ms of GEMM runs,
    then waits for it."""
    gemm = ComputeOp("aten.mm.default", 1e-4 * cluster.peak_flops * cluster.gemm_fraction, 0,
                     "forward")
    lane_ops = (ComputeOp(QUANTIZE_OP, 0, 10**9, "forward"),
                ComputeOp(DEQUANTIZE_MANY_OP, 0, 10**9, "forward"))
    gather = Collective("all_gather", tuple(range(8)), 10**6, 8 * 10**6)
    events = [Launch(0, "gather", (gather,), "forward", compute_ops=lane_ops), gemm, Wait(0)]
    return IterationTrace(rank=0, world_size=8, ranks_per_node=cluster.ranks_per_node,
                          tokens_per_iteration=1024, model_flops_per_iteration=1e12,
                          dtype_bytes=2, events=events)


def test_slower_kernel_rates_lengthen_the_quantization_ops(tmp_path):
    base = CLUSTERS["dgx_h100"]
    trace = quantizing_trace(base)
    fast = load_kernel_rates(sample_report_file(tmp_path, {QUANTIZE_OP: 4e12,
                                                           DEQUANTIZE_MANY_OP: 4e12}))
    slow = load_kernel_rates(sample_report_file(tmp_path, {QUANTIZE_OP: 0.5e12,
                                                           DEQUANTIZE_MANY_OP: 0.5e12}))
    roofline, quick, slowed = (predict(trace, cluster) for cluster in (
        base, with_kernel_rates(base, fast), with_kernel_rates(base, slow)))
    assert quick.lane_compute_seconds["gather"] == pytest.approx(2e9 / 4e12)
    assert slowed.lane_compute_seconds["gather"] == pytest.approx(2e9 / 0.5e12)
    assert (quick.lane_compute_seconds["gather"] < roofline.lane_compute_seconds["gather"]
            < slowed.lane_compute_seconds["gather"])
    # the lane outlasts the 0.1 ms GEMM in every case, so the step follows the kernels
    assert quick.seconds < roofline.seconds < slowed.seconds
    assert slowed.exposed_comm_seconds[("forward", "gather")] > quick.exposed_comm_seconds[
        ("forward", "gather")]


TUTORIAL_18B = (
    "--num-layers 40 --hidden-size 6144 --num-attention-heads 32 --seq-length 512 "
    "--batch-size 1 --fp16 --checkpoint-activations "
    "--deepspeed_config configs/ds_zeropp_config.json "
    "--dry-run --dry-run-nodes 4 --dry-run-gpus-per-node 16").split()


def test_dry_run_refuses_a_bad_kernel_rates_file_before_simulating(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "gpu_check.json"
    argv = TUTORIAL_18B + ["--dry-run-kernel-rates", str(missing)]
    assert run_dry_run(parse_training_args(argv), argv) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: kernel rates file")
    assert captured.out == ""  # failed before the plan, let alone the simulation
    argv = TUTORIAL_18B + ["--dry-run-kernel-rates", str(missing), "--no-dry-run-simulate"]
    assert run_dry_run(parse_training_args(argv), argv) == 2
    assert "drop --no-dry-run-simulate" in capsys.readouterr().err


def test_dry_run_predicts_with_the_measured_rates(tmp_path):
    path = sample_report_file(tmp_path, {QUANTIZE_OP: 0.5e12, DEQUANTIZE_MANY_OP: 0.5e12})
    args = parse_training_args(TUTORIAL_18B + ["--dry-run-kernel-rates", str(path)])
    measured = measured_kernel_rates(args)
    clusters = predicted_clusters(args, 8, measured)
    assert [c.name for c in clusters] == ["dgx_a100", "dgx_h100"]
    assert all(c.kernel_bandwidth[QUANTIZE_OP] == 0.5e12 for c in clusters)
    report = SimpleNamespace(plans=[SimpleNamespace(name="ZeRO-3"), SimpleNamespace(name="ZeRO++")],
                             cluster=SimpleNamespace(ranks_per_node=8))
    measurement = SimpleNamespace(trace=quantizing_trace(CLUSTERS["dgx_h100"]))
    lines = predicted_lines(report, [measurement, measurement], clusters, measured)
    with_rates = {line.split()[0]: float(line.split()[1]) for line in lines
                  if line.strip().startswith("dgx")}
    without = {line.split()[0]: float(line.split()[1]) for line in predicted_lines(
        report, [measurement, measurement], predicted_clusters(args, 8)) if
               line.strip().startswith("dgx")}
    assert with_rates["dgx_h100"] > without["dgx_h100"]
    # The host's line per system and cluster, at the host cost the report measured.
    [host] = [line for line in lines if line.strip().startswith("ZeRO++:")]
    assert f"at {measured.host_seconds_per_op * 1e6:.1f} us each" in host and "host sync" in host
    assert any("measured on NVIDIA H100 80GB HBM3 (peak 3.35 TB/s)" in line for line in lines)
    notes = [line for line in kernel_rate_lines(measured, clusters) if "note:" in line]
    assert len(notes) == 1 and "dgx_a100" in notes[0]  # 2.0 TB/s against the H100's 3.35


SMALL_ON_H100 = (
    "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 32 --lr 1e-4 "
    "--fp16 --checkpoint-activations --deepspeed_config configs/ds_zeropp_config.json "
    "--dry-run --dry-run-nodes 2 --dry-run-cluster dgx_h100").split()


def predicted_row(out: str) -> list[float]:
    [row] = [line.split()[1:] for line in out.splitlines() if line.strip().startswith("dgx_h100")]
    return [float(cell) for cell in row]


def test_dry_run_end_to_end_with_slow_measured_rates(tmp_path, capsys):
    """The simulated rank's real trace: ZeRO++'s quantization kernels at a thousandth of the
    H100's HBM rate make its step longer; ZeRO-3 runs no such kernel and does not change. (At
    a tenth this small model's kernels still hide behind the host's issue time: with no host
    read inside the step since [Note: step outcome on the device], nothing exposes them.)"""
    # the tutorial's JSON has hpZ 16, the H100 nodes 8 GPUs: hpZ over the whole node instead
    config = json.loads(Path("configs/ds_zeropp_config.json").read_text())
    config["zero_optimization"]["zero_hpz_partition_size"] = 8
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps(config))
    argv = [str(ds_config) if a == "configs/ds_zeropp_config.json" else a for a in SMALL_ON_H100]
    assert run_dry_run(parse_training_args(argv), argv) == 0
    zero3_s, _, zeropp_s, _ = predicted_row(capsys.readouterr().out)
    slow = {op: 3.35e9 for op in (QUANTIZE_OP, DEQUANTIZE_MANY_OP,
                                    "zeropp.dequantize_reduce.default",
                                    "zeropp.dequantize_reduce_quantize.default")}
    # The host cost as the default: only the kernel rates differ from the first run.
    report = sample_report_file(tmp_path, slow, host_seconds_per_op=DEFAULT_HOST_SECONDS_PER_OP)
    with_rates = argv + ["--dry-run-kernel-rates", str(report)]
    assert run_dry_run(parse_training_args(with_rates), with_rates) == 0
    out = capsys.readouterr().out
    slow_zero3_s, _, slow_zeropp_s, _ = predicted_row(out)
    assert slow_zero3_s == zero3_s and slow_zeropp_s > zeropp_s
    assert "quantization kernels at the rates measured on NVIDIA H100 80GB HBM3" in out
