"""The GPU check (scripts/gpu_check.sh): its CPU-testable logic on fake data, its kernel
sections' plumbing on CPU, the step-time model's --dry-run-kernel-rates, and its CUDA
sections (marked gpu, skipped without CUDA)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts.gpu_check import engine as gpu_check_engine
from scripts.gpu_check import kernels as gpu_check_kernels
from scripts.gpu_check import run as gpu_check
from scripts.gpu_check.report import (
    REPORT_NAME,
    SECTIONS,
    GpuEvent,
    Outcome,
    ReportError,
    SectionResult,
    analyse_streams,
    build_report,
    bytes_per_second,
    combined_rate,
    device_peak_bandwidth,
    gpu_events_from_chrome_trace,
    host_blocked_seconds,
    intersection_seconds,
    median_seconds,
    merge_intervals,
    peak_from_clock,
    peak_from_name,
    render_table,
    run_section,
    validate_report,
    write_report,
)

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
QUANTIZE_OP = "zeropp.quantize_blockwise.default"
DEQUANTIZE_MANY_OP = "zeropp.dequantize_blockwise_many.default"
TRACE_KERNEL_OPS = {f"zeropp.{name}.default" for name in (
    "quantize_blockwise", "dequantize_blockwise", "dequantize_blockwise_into",
    "dequantize_blockwise_many", "dequantize_reduce", "dequantize_reduce_quantize")}


# ---- arguments and the no-CUDA exit --------------------------------------------------------


@pytest.mark.parametrize(("text", "keys"), [("all", list("abcdefg")), ("abcde", list("abcde")),
                                            ("c,a", ["a", "c"]), ("E", ["e"])])
def test_sections_are_parsed_into_run_order(text, keys):
    assert gpu_check.parse_sections(text) == keys


@pytest.mark.parametrize(("argv", "message"), [
    (["--sections", "xyz"], "--sections 'xyz': choose from a, b, c, d, e, f, g"),
    (["--sections", ""], "--sections '': choose from"),
    (["--budget-s", "0"], "--budget-s 0 must be positive"),
    (["--budget-s", "-5"], "--budget-s -5 must be positive"),
])
def test_bad_arguments_give_one_line_and_status_2(argv, message, capsys):
    assert gpu_check.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_out_must_not_be_a_file(tmp_path, capsys):
    path = tmp_path / "report.json"
    path.write_text("{}")
    assert gpu_check.main(["--out", str(path)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_unknown_flag_is_an_argparse_error():
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--fast"])
    assert exit_info.value.code == 2


@pytest.mark.skipif(HAS_CUDA, reason="checks the message of a machine without CUDA")
def test_without_cuda_the_script_says_so_in_one_line(tmp_path):
    """Through the shell wrapper and the module: status 3, one line, no report."""
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--quick",
                             "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == gpu_check.NO_CUDA_EXIT == 3
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("no CUDA device: ")
    assert "torch.cuda.is_available() is False" in result.stderr
    assert not (tmp_path / REPORT_NAME).exists()


@pytest.mark.skipif(HAS_CUDA, reason="checks the message of a machine without CUDA")
def test_without_cuda_main_returns_3(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path), "--sections", "ab"]) == 3
    assert capsys.readouterr().err.startswith("no CUDA device: ")


# ---- sections and the report ---------------------------------------------------------------


def test_figures_become_strict_json():
    result = run_section("c", lambda: Outcome("fail", "diverged", {
        "losses": [1.0, float("nan"), float("inf")], "backends": {"b", "a"},
        "out": Path("x/y"), "dtype": torch.bfloat16, "shape": (2, 3)}))
    assert result.figures == {"losses": [1.0, "nan", "inf"], "backends": ["a", "b"],
                              "out": "x/y", "dtype": "torch.bfloat16", "shape": [2, 3]}
    report = fake_report([result], sections="c")
    json.dumps(report, allow_nan=False)


def test_run_section_turns_an_exception_into_a_failed_section():
    def broken() -> Outcome:
        raise RuntimeError("CUDA error: an illegal memory access\nwas encountered")

    result = run_section("a", broken)
    assert result.status == "fail" and result.seconds >= 0
    assert result.error == "RuntimeError: CUDA error: an illegal memory access | was encountered"
    assert "Traceback" in result.traceback and "\n" not in result.summary
    passed = run_section("b", lambda: Outcome("pass", "fine", {"x": 1}))
    assert (passed.status, passed.summary, passed.figures) == ("pass", "fine", {"x": 1})
    with pytest.raises(ValueError, match="unknown section"):
        run_section("z", broken)
    with pytest.raises(ValueError, match="status must be one of"):
        Outcome("ok", "")


RATES = {QUANTIZE_OP: 2.5e12, DEQUANTIZE_MANY_OP: 2.9e12}


def fake_results(status_of_c: str = "pass") -> list[SectionResult]:
    return [
        SectionResult("a", "pass", 41.0, "144 cases bit-exact", {"cases": 144}),
        SectionResult("b", "pass", 12.5, "all 6 kernels >= 70% of peak",
                      {"kernel_rates": dict(RATES)}),
        SectionResult("c", status_of_c, 20.0, "largest relative loss difference 1e-6"),
        SectionResult("d", "pass", 30.0, "3 streams", {"lanes": {}}),
        SectionResult("e", "skip", 0.0, "not started"),
    ]


def fake_device() -> dict:
    return {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0],
            "peak_memory_bandwidth": {"bytes_per_second": 3.35e12, "source": "device properties",
                                      "detail": "2 x 2619 MHz x 5120 bit / 8"}}


def fake_report(results=None, complete=True, sections="abcde") -> dict:
    return build_report(sections=fake_results() if results is None else results,
                        device=fake_device(), environment={"torch": "2.x"},
                        options={"quick": False, "sections": list(sections), "budget_s": 570},
                        total_seconds=110.0, complete=complete)


def test_report_is_written_valid_and_read_back(tmp_path):
    report = fake_report()
    path = write_report(report, tmp_path)
    assert path == tmp_path / REPORT_NAME
    read = json.loads(path.read_text())
    validate_report(read)
    assert [s["key"] for s in read["sections"]] == list("abcde")
    assert [s["name"] for s in read["sections"]] == [SECTIONS[k][0] for k in "abcde"]
    assert read["kernel_rates"] == RATES
    assert read["passed"] is False  # e was skipped
    assert not list(tmp_path.glob("*.partial"))


def test_passed_needs_every_selected_section_run_and_passed():
    passing = [r for r in fake_results() if r.key != "e"]
    assert fake_report(passing, sections="abcd")["passed"] is True
    assert fake_report(passing, sections="abcde")["passed"] is False  # e never ran
    assert fake_report(passing, sections="abcd", complete=False)["passed"] is False
    failing = [r for r in fake_results("fail") if r.key != "e"]
    assert fake_report(failing, sections="abcd")["passed"] is False


def test_table_lists_every_section_and_the_kernel_rates():
    table = render_table(fake_report())
    lines = table.splitlines()
    assert lines[0] == ("GPU check on NVIDIA H100 80GB HBM3, peak memory bandwidth 3.35 TB/s "
                        "(device properties)")
    for key in "abcde":
        title = SECTIONS[key][1]
        assert any(line.split()[:1] == [key] and title in line for line in lines)
    assert any(QUANTIZE_OP in line and "2.50 TB/s" in line and "(75% of peak)" in line
               for line in lines)
    assert lines[-1] == "  NOT PASSED in 110 s"


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda r: r.update(schema="other"), "schema must be"),
    (lambda r: r.pop("kernel_rates"), "'kernel_rates' must be a dict"),
    (lambda r: r["sections"][0].update(status="ok"), "sections[0].status 'ok'"),
    (lambda r: r["sections"][1].update(key="a", name="kernels_bit_exact"), "appears twice"),
    (lambda r: r["sections"].reverse(), "must be in the order"),
    (lambda r: r["sections"][2].update(name="x"), "sections[2].name must be"),
    (lambda r: r["kernel_rates"].update({QUANTIZE_OP: -1.0}), "must be a positive number"),
    (lambda r: r["device"]["peak_memory_bandwidth"].update(bytes_per_second=0),
     "peak_memory_bandwidth.bytes_per_second"),
])
def test_malformed_reports_are_refused_in_one_line(mutate, message, tmp_path):
    report = fake_report()
    mutate(report)
    with pytest.raises(ReportError, match=None) as error:
        write_report(report, tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / REPORT_NAME).exists()


# ---- arithmetic ------------------------------------------------------------------------------


def test_bandwidth_arithmetic():
    assert bytes_per_second(3_000, 1e-6) == pytest.approx(3e9)
    assert median_seconds([3e-3, 1e-3, 2e-3]) == 2e-3
    # 1 GB at 1 GB/s and 1 GB at 3 GB/s: 2 GB in 4/3 s, not the mean of the rates
    assert combined_rate([(10**9, 1.0), (10**9, 1 / 3)]) == pytest.approx(1.5e9)
    for bad in ([], [0.0], [float("nan")]):
        with pytest.raises(ValueError):
            median_seconds(bad)
    with pytest.raises(ValueError):
        bytes_per_second(0, 1.0)


def test_peak_from_the_memory_clock_and_bus():
    # H100 SXM5: cudaDeviceProp reports 2,619 MHz and a 5,120-bit bus -> 3.35 TB/s
    assert peak_from_clock(2_619_000, 5120) == pytest.approx(3.352e12, rel=1e-3)
    assert peak_from_clock(0, 5120) is None and peak_from_clock(2_619_000, None) is None
    peak = device_peak_bandwidth("NVIDIA H100 80GB HBM3", 2_619_000, 5120)
    assert peak.source == "device properties" and "2619 MHz" in peak.detail
    listed = device_peak_bandwidth("NVIDIA H100 80GB HBM3", 0, 0)  # CUDA 13: no memory clock
    assert listed == (3350e9, "datasheet table", "H100 SXM5: 3.35 TB/s HBM3")
    assert device_peak_bandwidth("NVIDIA GeForce RTX 4090", None, None) is None


@pytest.mark.parametrize(("name", "rate"), [
    ("Tesla V100-SXM2-32GB", 900e9), ("Tesla V100-PCIE-16GB", 900e9),
    ("Tesla V100S-PCIE-32GB", 1134e9), ("NVIDIA A100-SXM4-80GB", 2039e9),
    ("NVIDIA A100 80GB PCIe", 1935e9), ("NVIDIA A100-SXM4-40GB", 1555e9),
    ("NVIDIA A100-PCIE-40GB", 1555e9), ("NVIDIA H100 80GB HBM3", 3350e9),
    ("NVIDIA H100 PCIe", 2000e9), ("NVIDIA H100 NVL", 3900e9), ("NVIDIA H200", 4800e9),
    ("NVIDIA H200 NVL", 4800e9), ("NVIDIA GH200 480GB", None), ("NVIDIA L4", None),
])
def test_peak_table_by_device_name(name, rate):
    found = peak_from_name(name)
    assert (found[0] if found else None) == rate


def test_gpu_events_are_read_from_a_chrome_trace():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5, "args": {}},
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 10.0, "dur": 4.0,
         "args": {"stream": 7, "device": 0}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": "12", "dur": 1,
         "args": {"stream": 13}},
        {"ph": "X", "cat": "Kernel", "name": "old-style category", "ts": 20, "dur": 2,
         "args": {"stream": 17}},
        {"ph": "X", "cat": "kernel", "name": "no stream", "ts": 1, "dur": 1, "args": {}},
        {"ph": "f", "cat": "ac2g", "ts": 10, "args": {"stream": 7}},
    ]}
    events = gpu_events_from_chrome_trace(trace)
    assert [(e.stream, e.name) for e in events] == [
        (7, "sm90_gemm"), (13, "Memcpy DtoD"), (17, "old-style category")]
    assert events[0].start == pytest.approx(10e-6) and events[0].end == pytest.approx(14e-6)
    assert gpu_events_from_chrome_trace(trace["traceEvents"]) == events


def test_interval_union_and_intersection():
    merged = merge_intervals([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7)])
    assert merged == [(0, 4), (5, 6)]
    assert intersection_seconds(merged, merge_intervals([(1, 5.5), (5.75, 10)])) == 3.75


MARKER = "at::cuda::(anonymous namespace)::spin_kernel(long)"


def marked_events() -> list[GpuEvent]:
    """Markers on gather (13), reduce (17), compute (7); then compute busy [10, 20) and
    [30, 40), gather [15, 25) (5 of 10 overlapped), reduce [32, 36) (all overlapped), and
    NCCL's own stream 21 [41, 42)."""
    return [GpuEvent(13, 0, 1, MARKER), GpuEvent(17, 2, 3, MARKER), GpuEvent(7, 4, 5, MARKER),
            GpuEvent(7, 10, 20, "gemm"), GpuEvent(7, 30, 40, "gemm"),
            GpuEvent(13, 15, 25, "quantize"), GpuEvent(17, 32, 34, "requantize"),
            GpuEvent(17, 33, 36, "dequantize_reduce"), GpuEvent(21, 41, 42, "nccl")]


def test_overlap_is_measured_per_lane_after_the_markers():
    analysis = analyse_streams(marked_events())
    assert analysis["labels"] == "marker kernels" and analysis["compute_stream"] == 7
    assert analysis["compute_busy_s"] == 20 and analysis["streams_with_events"] == 4
    gather, reduce = analysis["lanes"]["gather"], analysis["lanes"]["reduce"]
    assert (gather["stream"], gather["busy_s"], gather["overlapped_s"]) == (13, 10, 5)
    assert gather["overlapped_fraction"] == 0.5
    assert (reduce["busy_s"], reduce["overlapped_s"], reduce["events"]) == (4, 4, 2)
    verdict = gpu_check_engine.overlap_verdict(analysis)
    assert verdict.status == "pass" and "gather 5000.00 of 10000.00 ms" in verdict.summary
    # as the H100 showed it: compute busy 20.6 of the iteration's 54.2 ms
    starved = gpu_check_engine.overlap_verdict({**analysis, "compute_busy_s": 0.0206,
                                                "span_s": 0.0542})
    assert starved.summary.endswith("; compute busy 20.6 of 54.2 ms (the GPU waits for the "
                                    "host: little compute to overlap)")


def test_the_completion_stream_is_labelled_and_must_work():
    """Section d marks the gather lane's completion stream too (qwZ's dequantize runs there):
    its overlap is reported, and a run where it did nothing fails."""
    lanes = gpu_check_engine.STREAM_LANES
    events = [GpuEvent(13, 0, 1, MARKER), GpuEvent(17, 2, 3, MARKER), GpuEvent(19, 3, 4, MARKER),
              GpuEvent(7, 4, 5, MARKER), GpuEvent(7, 10, 20, "gemm"),
              GpuEvent(13, 10, 12, "nccl all_gather"), GpuEvent(19, 12, 14, "dequantize"),
              GpuEvent(17, 15, 16, "requantize")]
    analysis = analyse_streams(events, side_lanes=lanes)
    assert analysis["lanes"]["gather completion"]["stream"] == 19
    verdict = gpu_check_engine.overlap_verdict(analysis)
    assert verdict.status == "pass" and "gather completion 2000.00 of 2000.00 ms" in verdict.summary
    idle = [e for e in events if e.stream != 19 or e.name == MARKER]
    assert "no GPU work on the gather completion" in gpu_check_engine.overlap_verdict(
        analyse_streams(idle, side_lanes=lanes)).summary


def test_overlap_verdicts_that_fail():
    no_reduce = [e for e in marked_events() if e.stream != 17 or e.name == MARKER]
    assert "no GPU work on the reduce" in gpu_check_engine.overlap_verdict(
        analyse_streams(no_reduce)).summary
    serial = [e._replace(start=e.start + 100, end=e.end + 100) if e.name == "quantize" else e
              for e in marked_events()]
    assert "gather never overlapped" in gpu_check_engine.overlap_verdict(
        analyse_streams(serial)).summary
    one_stream = [GpuEvent(7, 0, 1, "gemm")]
    assert "1 stream(s) only" in gpu_check_engine.overlap_verdict(
        analyse_streams(one_stream)).summary


def test_without_markers_the_busiest_stream_is_compute():
    events = [e for e in marked_events() if e.name != MARKER]
    analysis = analyse_streams(events)
    assert analysis["labels"].startswith("busiest stream") and analysis["compute_stream"] == 7
    assert set(analysis["lanes"]) == {"stream 13", "stream 17", "stream 21"}
    assert gpu_check_engine.overlap_verdict(analysis).status == "fail"  # NCCL's never overlaps


def test_host_against_gpu_verdict():
    busy = gpu_check_engine.host_gpu_verdict([0.10, 0.12, 0.11], [0.10, 0.11, 0.10],
                                             [0.09, 0.1, 0.1], gpu_busy=0.099)
    assert busy.status == "pass" and busy.figures["gpu_busy_fraction"] == pytest.approx(0.9)
    starved = gpu_check_engine.host_gpu_verdict([0.2], [0.2], [0.19], gpu_busy=0.05)
    assert starved.status == "fail" and starved.summary.startswith("host-bound: ")


def test_host_waits_inside_the_iteration_are_not_issue_time():
    """As an H100 traced it: launches, the step's gradient-norm read (a stream synchronize
    while the GPU catches up), more launches, then the check's own synchronize."""
    def call(name, ts, dur, cat="cuda_runtime"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        call("cudaLaunchKernel", 0, 10), call("cuLaunchKernelEx", 20, 12, "cuda_driver"),
        call("cudaStreamSynchronize", 40, 10_000), call("cudaMemcpyAsync", 10_050, 20),
        call("cudaLaunchKernel", 10_100, 10), call("cudaDeviceSynchronize", 10_200, 18_000),
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 5, "dur": 9_000, "args": {"stream": 7}}]}
    blocked = host_blocked_seconds(trace)
    assert blocked == pytest.approx(0.010)
    verdict = gpu_check_engine.host_gpu_verdict([0.03], [0.03], [0.0104], gpu_busy=0.029,
                                                launches=4, host_blocked=blocked)
    assert verdict.figures["host_blocked_s"] == pytest.approx(0.010)
    assert verdict.figures["host_seconds_per_op"] == pytest.approx(0.0004 / 4)
    assert host_blocked_seconds({"traceEvents": []}) == 0.0


def test_loss_comparison():
    cpu = {"zero3": [5.0, 4.0], "zeropp": [5.0, 4.0]}
    close = {"zero3": [5.0 * (1 + 5e-5), 4.0], "zeropp": [5.0, 4.0 * (1 - 1e-3)]}
    verdicts = gpu_check_engine.compare_losses(close, cpu)
    assert all(v["within"] for v in verdicts.values())
    assert verdicts["zeropp"]["max_relative_difference"] == pytest.approx(1e-3)
    far = gpu_check_engine.compare_losses({**close, "zero3": [5.01, 4.0]}, cpu)
    assert not far["zero3"]["within"] and far["zeropp"]["within"]
    broken = gpu_check_engine.compare_losses({"zero3": [math.nan, 4.0], "zeropp": [5.0]}, cpu)
    assert not broken["zero3"]["within"] and broken["zero3"]["max_relative_difference"] is None
    assert not broken["zeropp"]["within"]  # a missing step is not a pass


def test_the_18b_block_shape_comes_from_its_args_file():
    shape = gpu_check_engine.read_model_args(gpu_check_engine.MODEL_ARGS_18B)
    assert (shape["hidden-size"], shape["num-attention-heads"], shape["seq-length"]) == (
        6144, 32, 512)


# ---- the kernel sections' plumbing on CPU ----------------------------------------------------


SMALL_MATRIX = dict(dtypes=("fp32", "bf16"), bits=(4, 8), block_sizes=(64,),
                    word_sum_block_sizes=(24,), numels=(300,))


def test_bit_exact_section_compares_with_the_reference():
    outcome = gpu_check_kernels.check_bit_exact("cpu", require_backend=None, **SMALL_MATRIX)
    # per dtype and width: quantize, dequantize, its out= form, dequantize_many (4 x 2 x 2);
    # per width: dequantize_reduce and two requantizations (3 x 2); the same three for int4
    # at the word-sum block (3)
    assert outcome.status == "pass" and outcome.figures["cases"] == 25
    assert "int4 reductions at blocks 24" in outcome.summary
    assert outcome.figures["backends"] == ["zeropp.kernels.reference"]
    wrong = gpu_check_kernels.check_bit_exact("cpu", **SMALL_MATRIX)
    assert wrong.status == "fail" and "not zeropp.kernels.triton_kernels" in wrong.summary
    late = gpu_check_kernels.check_bit_exact("cpu", require_backend=None, budget_s=0,
                                             **SMALL_MATRIX)
    assert late.status == "fail" and late.summary.startswith("time budget ran out")


def test_bit_exact_section_finds_a_wrong_byte(monkeypatch):
    from zeropp import kernels

    original = kernels.quantize_blockwise

    def off_by_one(x, bits, block_size):
        payload = original(x, bits, block_size).clone()
        payload[5] ^= 1
        return payload

    monkeypatch.setattr(kernels, "quantize_blockwise", off_by_one)
    outcome = gpu_check_kernels.check_bit_exact("cpu", require_backend=None, **SMALL_MATRIX)
    assert outcome.status == "fail"
    assert outcome.summary.startswith("4 of 25 cases differ, first: quantize fp32 int4 block 64")
    assert "code byte 5" in outcome.summary


def test_a_kernel_that_raises_fails_its_cases_only(monkeypatch):
    from zeropp import kernels

    def no_launch(*args, **kwargs):
        raise RuntimeError("triton.compiler.errors.CompilationError: at 12:4")

    monkeypatch.setattr(kernels, "dequantize_reduce", no_launch)
    outcome = gpu_check_kernels.check_bit_exact("cpu", require_backend=None, **SMALL_MATRIX)
    assert outcome.figures["cases"] == 25 and outcome.figures["passed"] == 22
    assert outcome.summary == ("3 of 25 cases differ, first: dequantize_reduce int4 block 64 "
                               "numel 300 k=3: RuntimeError: triton.compiler.errors."
                               "CompilationError: at 12:4")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's masked lanes
def test_bit_exact_section_passes_on_the_triton_kernels_in_the_interpreter(monkeypatch):
    """The path section a takes on a GPU, with Triton's CPU interpreter (conftest sets
    TRITON_INTERPRET=1 without CUDA): the NaN, inf and zero blocks included."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels in the interpreter")
    from zeropp import kernels

    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "triton")
    outcome = gpu_check_kernels.check_bit_exact(
        "cpu", dtypes=("fp16",), bits=(4, 8), block_sizes=(2048,), numels=(5000,))
    assert outcome.status == "pass", outcome.summary
    assert outcome.figures["backends"] == ["zeropp.kernels.triton_kernels"]


def test_bandwidth_section_keys_rates_by_the_trace_op_names():
    outcome = gpu_check_kernels.measure_bandwidth("cpu", 256 * 1024, peak=1e15, repeats=1,
                                                  warmup=0)
    assert outcome.status == "fail" and "below 70% of peak" in outcome.summary
    figures = outcome.figures
    assert set(figures["kernel_rates"]) == TRACE_KERNEL_OPS
    assert all(row["matches_reference"] for row in figures["kernels"])
    quantize = [row for row in figures["kernels"] if row["ops"] == [QUANTIZE_OP]]
    assert len(quantize) == 2  # int8 and int4 combine into one rate
    assert figures["kernel_rates"][QUANTIZE_OP] == pytest.approx(
        sum(r["bytes"] for r in quantize) / sum(r["seconds"] for r in quantize))
    unknown = gpu_check_kernels.measure_bandwidth("cpu", 64 * 1024, peak=None, repeats=1,
                                                  warmup=0)
    assert unknown.summary.startswith("peak bandwidth unknown")


def test_bandwidth_bytes_are_the_bytes_the_trace_charges():
    """Each workload's bytes equal what the trace recorder records for the same call on the
    meta device (the simulated GPU cluster), so measured rates replace the roofline 1:1."""
    from zeropp import kernels
    from zeropp.simulation.trace import launches_kernel
    from zeropp.simulation.tracing import TraceRecorder

    tensor_bytes, rows, block = 256 * 1024, gpu_check_kernels.PAYLOADS_PER_CALL, 256
    workloads = {w.label: w for w in gpu_check_kernels.kernel_workloads(
        torch.device("cpu"), tensor_bytes, block, rows)}
    numel = tensor_bytes // 2 // (rows * block) * (rows * block)
    reduce_numel = tensor_bytes // 4 // block * block
    meta = torch.device("meta")
    q8 = torch.empty(rows, kernels.quantized_nbytes(numel // rows, 8, block), dtype=torch.uint8,
                     device=meta)
    q4 = torch.empty(rows, kernels.quantized_nbytes(reduce_numel, 4, block), dtype=torch.uint8,
                     device=meta)
    values = torch.empty(numel, dtype=torch.bfloat16, device=meta)
    calls = {
        "quantize bf16 -> int8 (qwZ)": lambda: kernels.quantize_blockwise(values, 8, block),
        f"dequantize_many {rows} x int8 -> bf16 (qwZ)": lambda: kernels.dequantize_blockwise_many(
            q8, numel // rows, 8, block, torch.bfloat16),
        f"dequantize_reduce {rows} x int4 -> fp32 (qgZ hop 2)": lambda: kernels.dequantize_reduce(
            q4, reduce_numel, 4, block),
        f"dequantize_reduce_quantize {rows} x int4 -> int4 (qgZ hop 1)":
            lambda: kernels.dequantize_reduce_quantize(q4, reduce_numel, 4, 4, block),
    }
    for label, call in calls.items():
        with TraceRecorder() as recorder:
            call()
        # One kernel (its output's allocation, where the call makes one, moves no bytes).
        [op] = [event for event in recorder.events if launches_kernel(event)]
        assert op.name in workloads[label].ops
        assert op.bytes == workloads[label].nbytes, label


# ---- the orchestration on CPU ----------------------------------------------------------------


def test_section_limits_leave_the_later_sections_their_shares():
    shares = gpu_check.SECTION_SHARES_S
    assert sum(shares.values()) == gpu_check.DEFAULT_BUDGET_S
    every = list("abcdefg")
    assert gpu_check.section_limit("a", every, 570, 570) == shares["a"]
    # a took 60 s of its 130: b may use what a left, the later sections keep theirs
    assert gpu_check.section_limit("b", every, 510, 570) == pytest.approx(
        510 - sum(shares[k] for k in "cdefg"))
    assert gpu_check.section_limit("c", list("ac"), 300, 570) == 300  # the last gets the rest
    assert gpu_check.section_limit("g", every, 42, 570) == 42
    # a smaller budget, or fewer sections: the shares scale to the budget
    assert gpu_check.section_limit("a", every, 57, 57) == pytest.approx(13)
    assert gpu_check.section_limit("a", list("ab"), 190, 190) == pytest.approx(130)


def check_args(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(out=tmp_path, quick=True, sections=list("abcde"), budget_s=570)


@pytest.mark.skipif(HAS_CUDA, reason="the child finds no CUDA only on a machine without it")
def test_a_section_whose_process_ends_without_a_result_fails(tmp_path):
    (tmp_path / gpu_check.SECTIONS_DIR).mkdir()
    result = gpu_check.run_section_in_child("a", check_args(tmp_path), limit_s=120)
    assert result.status == "fail"
    assert "exited with status 3 and no result: no CUDA device" in result.summary
    assert (tmp_path / gpu_check.SECTIONS_DIR / "a.log").exists()


def test_a_section_past_its_limit_is_killed(tmp_path):
    (tmp_path / gpu_check.SECTIONS_DIR).mkdir()
    result = gpu_check.run_section_in_child("b", check_args(tmp_path), limit_s=0.05)
    assert result.status == "fail" and result.summary.startswith("killed after 0 s")
    assert result.error == "timed out"


def test_run_check_writes_the_report_after_every_section(tmp_path, monkeypatch, capsys):
    seen_reports = []

    def fake_child(key, args, limit_s):
        if (tmp_path / REPORT_NAME).exists():
            seen_reports.append(json.loads((tmp_path / REPORT_NAME).read_text()))
        return next(r for r in fake_results() if r.key == key) if key != "e" else \
            SectionResult("e", "pass", 1.0, "GPU busy 90%")

    monkeypatch.setattr(gpu_check, "describe_device", lambda: (fake_device(), {"torch": "x"}))
    monkeypatch.setattr(gpu_check, "run_section_in_child", fake_child)
    before = signal.getsignal(signal.SIGTERM)
    assert gpu_check.run_check(check_args(tmp_path)) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # its SIGTERM handler is put back
    report = json.loads((tmp_path / REPORT_NAME).read_text())
    validate_report(report)
    assert report["complete"] and report["passed"] and report["kernel_rates"] == RATES
    assert [len(r["sections"]) for r in seen_reports] == [1, 2, 3, 4]
    assert not any(r["complete"] for r in seen_reports)
    out = capsys.readouterr().out
    assert "[c] pass in 20.0 s" in out and out.rstrip().endswith("PASSED in 0 s")
    # too little budget left for a section's share: it is skipped, and the check not passed
    monkeypatch.setattr(gpu_check, "run_section_in_child",
                        lambda key, args, limit_s: SectionResult(key, "pass", 1.0, "ok"))
    args = SimpleNamespace(out=tmp_path, quick=True, sections=list("ab"), budget_s=20)
    assert gpu_check.run_check(args) == 1
    report = json.loads((tmp_path / REPORT_NAME).read_text())
    assert [s["status"] for s in report["sections"]] == ["skip", "pass"]
    assert report["sections"][0]["summary"].startswith("not started: 14 s left")


def test_section_c_reference_worker_trains_on_cpu(tmp_path):
    out = tmp_path / "losses.json"
    result = subprocess.run(
        [sys.executable, "-m", "scripts.gpu_check.engine", "cpu-losses", "--steps", "2",
         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    losses = json.loads(out.read_text())
    assert set(losses) == {"zero3", "zeropp"}
    for system in losses.values():
        assert system["execution"] == "HostThreadExecution" and len(system["losses"]) == 2
        assert all(math.isfinite(v) and 5 < v < 8 for v in system["losses"])  # ln(512) = 6.2
    bad = subprocess.run([sys.executable, "-m", "scripts.gpu_check.engine", "cpu-losses",
                          "--steps", "0", "--out", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--steps must be at least 1" in bad.stderr


# ---- the CUDA sections, small ----------------------------------------------------------------


@pytest.fixture(scope="module")
def nccl_sections():
    """The sections set up one NCCL process group of one rank; destroy it afterwards."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.gpu
@requires_cuda
def test_gpu_kernels_are_bit_exact():
    outcome = gpu_check_kernels.check_bit_exact("cuda", block_sizes=(64, 2048),
                                                numels=(gpu_check_kernels.AWKWARD_NUMEL,))
    assert outcome.status == "pass", outcome.summary


@pytest.mark.gpu
@requires_cuda
def test_gpu_kernel_bandwidth_is_measured():
    device, _ = gpu_check.describe_device()
    peak = device["peak_memory_bandwidth"]
    outcome = gpu_check_kernels.measure_bandwidth(
        "cuda", 4 * 2**20, peak["bytes_per_second"] if peak else None, repeats=3, warmup=1)
    assert all(row["matches_reference"] for row in outcome.figures["kernels"]), outcome.summary
    assert set(outcome.figures["kernel_rates"]) == TRACE_KERNEL_OPS
    assert outcome.figures["backend"] == gpu_check_kernels.TRITON_BACKEND


@pytest.mark.gpu
@requires_cuda
def test_gpu_engine_on_nccl_matches_gloo(nccl_sections, tmp_path):
    outcome = gpu_check_engine.check_engine_against_gloo(tmp_path, steps=2)
    assert outcome.status == "pass", outcome.summary


@pytest.mark.gpu
@requires_cuda
def test_gpu_streams_are_labelled_and_busy(nccl_sections, tmp_path):
    outcome = gpu_check_engine.check_stream_overlap(
        tmp_path, num_layers=2, hidden_size=512, num_attention_heads=8, seq=256, micro_batch=2)
    figures = outcome.figures
    assert (tmp_path / figures["trace"]).exists()
    assert figures["labels"] == "marker kernels" and figures["streams_with_events"] >= 3
    assert all(figures["lanes"][lane]["events"] > 0 for lane in gpu_check_engine.STREAM_LANES)


@pytest.mark.gpu
@requires_cuda
def test_gpu_host_and_gpu_time_are_measured(nccl_sections, tmp_path):
    outcome = gpu_check_engine.check_host_vs_gpu(tmp_path, num_layers=1, micro_batch=1,
                                                 timed_iterations=1, hidden_size=1024,
                                                 num_attention_heads=8)
    figures = outcome.figures
    assert figures["gpu_busy_s"] > 0 and figures["wall_s"] >= figures["gpu_busy_s"] * 0.5
    assert figures["model"]["seq"] == 512


@pytest.mark.gpu
@pytest.mark.slow
@requires_cuda
def test_gpu_check_quick_writes_a_valid_report(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--quick",
                             "--sections", "ab", "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=600)
    report = json.loads((tmp_path / REPORT_NAME).read_text())
    validate_report(report)
    assert [s["key"] for s in report["sections"]] == ["a", "b"]
    assert set(report["kernel_rates"]) == TRACE_KERNEL_OPS, result.stdout[-3000:]


# ---- sections f and g ------------------------------------------------------------------------


def test_the_sanitizer_section_runs_in_a_process_with_the_sanitizer_on():
    from scripts.gpu_check import nccl as gpu_check_nccl

    assert gpu_check_nccl.section_env("f") == {"TORCH_CUDA_SANITIZER": "1"}
    assert gpu_check_nccl.section_env("a") == {}
    if not HAS_CUDA:  # here the sanitizer is off: the section says how to run it
        outcome = gpu_check_nccl.check_under_sanitizer()
        assert outcome.status == "fail" and "TORCH_CUDA_SANITIZER=1" in outcome.summary


@pytest.mark.skipif(HAS_CUDA, reason="on a CPU machine the two-GPU section is skipped")
def test_the_two_gpu_section_is_skipped_with_its_reason_on_fewer_gpus(tmp_path):
    from scripts.gpu_check import nccl as gpu_check_nccl

    outcome = gpu_check_nccl.check_two_ranks(tmp_path)
    assert outcome.status == "skip"
    assert outcome.summary == "0 GPU(s) visible: the two-process NCCL section needs 2"


def test_two_ranks_pass_only_on_their_own_gpus_with_equal_losses():
    from scripts.gpu_check.nccl import rank_env, two_rank_verdict

    good = [{"device": "cuda:0", "losses": [5.1, 4.9]}, {"device": "cuda:1", "losses": [5.1, 4.9]}]
    assert two_rank_verdict(good).status == "pass"
    same_gpu = [dict(good[0]), dict(good[1], device="cuda:0")]
    assert "not one GPU each by LOCAL_RANK" in two_rank_verdict(same_gpu).summary
    apart = [dict(good[0]), dict(good[1], losses=[5.1, 4.8])]
    assert "losses differ" in two_rank_verdict(apart).summary
    nan = [dict(good[0], losses=[float("nan")]), dict(good[1], losses=[float("nan")])]
    assert "non-finite" in two_rank_verdict(nan).summary
    env = rank_env(1, 29400)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"],
            env["MASTER_PORT"]) == ("1", "1", "2", "1", "29400")
