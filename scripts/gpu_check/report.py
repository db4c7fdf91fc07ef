"""The GPU check's report and arithmetic: everything of it that runs without a GPU.

`scripts.gpu_check.run` runs five sections on a CUDA device (see its docstring); this module
holds what they share and what the tests exercise on fake data:

- a section's result (`Outcome` from the section, `SectionResult` once timed) and the runner
  that turns an exception into a failed section instead of ending the check;
- bandwidth arithmetic (bytes read plus written over the median time) and the device's peak
  memory bandwidth, from its memory clock and bus width or from a table of datasheet figures;
- the overlap of side-stream kernels with compute-stream kernels, from a chrome trace's GPU
  events;
- the report (`gpu_check.json`): its schema, writer, validation and the printed table.

The report's `kernel_rates` maps the step-time trace's op names ("zeropp.quantize_blockwise.
default", ...) to measured bytes/s; `zeropp.planning.kernel_rates.load_kernel_rates` reads it back.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import signal
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

# The report's schema is what the dry run reads measured kernel rates from.
from zeropp.planning.kernel_rates import KERNEL_RATES_SCHEMA as SCHEMA
from zeropp.planning.kernel_rates import KERNEL_RATES_VERSION as SCHEMA_VERSION

REPORT_NAME = "gpu_check.json"
TRACE_NAME = "gpu_check_trace.json"  # section d's chrome trace, in the out dir
STATUSES = ("pass", "fail", "skip")
BANDWIDTH_TARGET = 0.70  # each kernel should reach this fraction of the device's peak

# key -> (name in the report, title in the table); the order is the order they run in.
SECTIONS: dict[str, tuple[str, str]] = {
    "a": ("kernels_bit_exact", "kernels equal the torch reference"),
    "b": ("kernel_bandwidth", "kernel bandwidth vs peak"),
    "c": ("engine_nccl_vs_gloo", "engine on NCCL vs CPU/gloo"),
    "d": ("streams_overlap", "side streams overlap compute"),
    "e": ("host_vs_gpu_time", "host vs GPU time, 18B block"),
    "f": ("cuda_sanitizer", "no cross-stream race (sanitizer)"),
    "g": ("two_ranks_nccl", "two ranks on two GPUs over NCCL"),
}


class ReportError(ValueError):
    """A report that does not follow the schema (one line, names the bad field)."""


# ---- sections --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a section function returns: its verdict, one line saying why, and its figures
    (JSON-able numbers, strings, lists and dicts)."""

    status: str
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


@dataclass
class SectionResult:
    """One section as the report keeps it."""

    key: str
    status: str
    seconds: float
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # one line: the exception that ended the section
    traceback: str | None = None  # its traceback, for whoever reads the JSON afterwards

    @property
    def name(self) -> str:
        return SECTIONS[self.key][0]

    @property
    def title(self) -> str:
        return SECTIONS[self.key][1]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "title": self.title, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SectionResult:
        return cls(key=data["key"], status=data["status"], seconds=float(data["seconds"]),
                   summary=data["summary"], figures=dict(data.get("figures") or {}),
                   error=data.get("error"), traceback=data.get("traceback"))


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float as a string ("nan", "inf") and every other
    non-JSON value (a set, a path, a dtype) as a list or a string: a diverged loss must not
    make the report unwritable (it is written with allow_nan=False, as strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [json_safe(v) for v in items]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def one_line(error: BaseException) -> str:
    """`Type: message` on one line (multi-line messages are joined with ' | ')."""
    message = " | ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def run_section(key: str, section: Callable[[], Outcome]) -> SectionResult:
    """Run and time one section; an exception fails the section, it does not propagate
    (a failing section must not stop the others)."""
    if key not in SECTIONS:
        raise ValueError(f"unknown section {key!r}; sections are {', '.join(SECTIONS)}")
    start = time.perf_counter()
    try:
        outcome = section()
    except Exception as error:  # noqa: BLE001 (the report records it; the check goes on)
        return SectionResult(key, "fail", time.perf_counter() - start, one_line(error),
                             error=one_line(error), traceback=traceback.format_exc()[-6000:])
    return SectionResult(key, outcome.status, time.perf_counter() - start, outcome.summary,
                         json_safe(dict(outcome.figures)))


# ---- bandwidth -------------------------------------------------------------------------------


def median_seconds(seconds: Iterable[float]) -> float:
    values = [float(s) for s in seconds]
    if not values:
        raise ValueError("no timings to take the median of")
    if any(not math.isfinite(s) or s <= 0 for s in values):
        raise ValueError(f"timings must be positive and finite, got {values}")
    return statistics.median(values)


def bytes_per_second(nbytes: int, seconds: float) -> float:
    """Achieved bandwidth: bytes read plus written over the time taken."""
    if nbytes <= 0 or not seconds > 0:
        raise ValueError(f"need positive bytes and seconds, got {nbytes} B in {seconds} s")
    return nbytes / seconds


def combined_rate(measurements: Iterable[tuple[int, float]]) -> float:
    """One rate for several measured (bytes, seconds) of the same op: total bytes over total
    time, so each variant weighs by the bytes it moves (the step-time model charges an op's
    bytes at one rate, whichever variant it is)."""
    pairs = list(measurements)
    if not pairs:
        raise ValueError("no measurements to combine")
    return bytes_per_second(sum(b for b, _ in pairs), sum(s for _, s in pairs))


class PeakBandwidth(NamedTuple):
    bytes_per_second: float
    source: str  # "device properties" or "datasheet table"
    detail: str  # how it was computed, or which table row matched


def peak_from_clock(memory_clock_khz: int | None, bus_width_bits: int | None) -> float | None:
    """Theoretical DRAM bandwidth: two transfers per memory clock (DDR; HBM counts so too)
    over the whole bus. None when the driver does not report either figure (CUDA 13 drops
    the memory clock from cudaDeviceProp; torch then reports 0)."""
    if not memory_clock_khz or not bus_width_bits or memory_clock_khz <= 0 or bus_width_bits <= 0:
        return None
    return 2.0 * memory_clock_khz * 1e3 * bus_width_bits / 8


# Datasheet HBM bandwidth per GPU, matched on the tokens of torch's device name (every token
# of the row must appear; the first matching row wins, so specific rows come first). Names as
# drivers report them: "Tesla V100-SXM2-32GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB
# PCIe", "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200".
PEAK_TABLE: tuple[tuple[tuple[str, ...], float, str], ...] = (
    (("v100s",), 1134e9, "V100S PCIe: 1,134 GB/s HBM2"),
    (("v100",), 900e9, "V100 (SXM2 or PCIe): 900 GB/s HBM2"),
    (("a100", "80gb", "pcie"), 1935e9, "A100 80GB PCIe: 1,935 GB/s HBM2e"),
    (("a100", "80gb"), 2039e9, "A100 80GB SXM4: 2,039 GB/s HBM2e"),
    (("a100",), 1555e9, "A100 40GB (SXM4 or PCIe): 1,555 GB/s HBM2"),
    (("h100", "pcie"), 2000e9, "H100 PCIe: 2.0 TB/s HBM2e"),
    (("h100", "nvl"), 3900e9, "H100 NVL: 3.9 TB/s HBM3"),
    (("h100",), 3350e9, "H100 SXM5: 3.35 TB/s HBM3"),
    (("h200",), 4800e9, "H200 (SXM or NVL): 4.8 TB/s HBM3e"),
)


def _name_tokens(name: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", name.lower())) - {""}


def peak_from_name(name: str) -> tuple[float, str] | None:
    """(bytes/s, table row) of the first `PEAK_TABLE` row whose tokens all occur in `name`."""
    tokens = _name_tokens(name)
    for row_tokens, rate, label in PEAK_TABLE:
        if all(token in tokens for token in row_tokens):
            return rate, label
    return None


def device_peak_bandwidth(name: str, memory_clock_khz: int | None,
                          bus_width_bits: int | None) -> PeakBandwidth | None:
    """The device's peak memory bandwidth: from its properties when the driver reports the
    memory clock and bus width, else from the datasheet table; None for an unknown GPU
    without those properties."""
    computed = peak_from_clock(memory_clock_khz, bus_width_bits)
    if computed is not None:
        return PeakBandwidth(computed, "device properties",
                             f"2 x {memory_clock_khz / 1e3:g} MHz x {bus_width_bits} bit / 8")
    listed = peak_from_name(name)
    if listed is not None:
        return PeakBandwidth(listed[0], "datasheet table", listed[1])
    return None


def describe_device() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the device's properties and peak memory bandwidth, the software versions)."""
    import torch

    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    peak = device_peak_bandwidth(props.name, clock_khz, bus_bits)
    device = {
        "name": props.name, "capability": [props.major, props.minor],
        "total_memory_bytes": props.total_memory,
        "multi_processor_count": props.multi_processor_count,
        "memory_clock_khz": clock_khz, "memory_bus_width_bits": bus_bits,
        "peak_memory_bandwidth": peak._asdict() if peak else None,
        "device_count": torch.cuda.device_count(),
    }
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    environment = {"python": platform.python_version(), "torch": torch.__version__,
                   "cuda": torch.version.cuda, "triton": triton_version, "nccl": nccl_version()}
    return device, environment


def nccl_version() -> str | None:
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return None
    version = torch.cuda.nccl.version()  # a tuple in torch 2.x, an int before
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


# ---- streams ---------------------------------------------------------------------------------

GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


class GpuEvent(NamedTuple):
    """One kernel, copy or memset on a CUDA stream; times in seconds."""

    stream: int
    start: float
    end: float
    name: str = ""


def _complete_events(trace: dict[str, Any] | list, categories) -> list[dict[str, Any]]:
    """The complete events ("ph": "X") of a chrome trace in ``categories`` (lower case)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
            and str(e.get("cat", "")).lower() in categories]


def gpu_events_from_chrome_trace(trace: dict[str, Any] | list) -> list[GpuEvent]:
    """The GPU activity of a torch.profiler chrome trace (`export_chrome_trace`): complete
    events ("ph": "X") of categories kernel, gpu_memcpy and gpu_memset with a stream id;
    Kineto writes ts and dur in microseconds."""
    found = []
    for event in _complete_events(trace, GPU_EVENT_CATEGORIES):
        args = event.get("args") or {}
        if "stream" not in args:
            continue
        start = float(event["ts"]) * 1e-6
        found.append(GpuEvent(int(args["stream"]), start, start + float(event.get("dur", 0)) * 1e-6,
                              str(event.get("name", ""))))
    return found


HOST_API_CATEGORIES = ("cuda_runtime", "cuda_driver")


def _is_host_wait(name: str) -> bool:
    """A CUDA API call in which the host waits for the device: a stream, event or device
    synchronize, or a synchronous copy (``cudaMemcpy`` without Async)."""
    return "Synchronize" in name or name in ("cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2")


def host_blocked_seconds(trace: dict[str, Any] | list) -> float:
    """Seconds the host spent waiting for the GPU while it issued one profiled iteration:
    the synchronizing CUDA API calls (`_is_host_wait`) of a torch.profiler chrome trace that
    began before its last issuing call, so that the caller's own synchronize after the
    iteration does not count. Subtracted from the host's issue time, it leaves the host's own
    work: a host sync inside the iteration (the gradient norm's read) is waiting, which the
    step-time model charges as a sync, not as issue time per op."""
    calls = _complete_events(trace, HOST_API_CATEGORIES)
    issuing = [float(e["ts"]) for e in calls if not _is_host_wait(str(e.get("name", "")))]
    if not issuing:
        return 0.0
    last_issue = max(issuing)
    return sum(float(e.get("dur", 0)) for e in calls
               if _is_host_wait(str(e.get("name", ""))) and float(e["ts"]) < last_issue) * 1e-6


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered_seconds(merged: Sequence[tuple[float, float]]) -> float:
    return sum(end - start for start, end in merged)


def intersection_seconds(a: Sequence[tuple[float, float]],
                         b: Sequence[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists (two-pointer walk)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, high - low)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def busiest_stream(events: Iterable[GpuEvent]) -> int | None:
    """The stream with the most GPU time: the compute stream when nothing labels them."""
    busy: dict[int, list[tuple[float, float]]] = {}
    for event in events:
        busy.setdefault(event.stream, []).append((event.start, event.end))
    if not busy:
        return None
    return max(busy, key=lambda s: covered_seconds(merge_intervals(busy[s])))


def lane_streams_from_markers(events: Sequence[GpuEvent], marker: str,
                              lanes: Sequence[str]) -> tuple[dict[str, int], float] | None:
    """Stream of each lane, from marker kernels launched one per lane, in `lanes` order and
    one after the other, before the profiled work; and when the last marker ended (the
    profiled work starts after it). None when fewer markers than lanes were found."""
    markers = sorted((e for e in events if marker in e.name), key=lambda e: e.start)
    if len(markers) < len(lanes):
        return None
    markers = markers[:len(lanes)]
    return {lane: m.stream for lane, m in zip(lanes, markers, strict=True)}, max(
        m.end for m in markers)


def stream_overlap(events: Sequence[GpuEvent], compute_stream: int,
                   side_streams: dict[str, int]) -> dict[str, Any]:
    """How much each side stream's GPU work overlapped the compute stream's.

    Per lane: busy seconds (union of its events), seconds of that during which the compute
    stream was also busy, their ratio, and its event count; plus the compute stream's busy
    seconds, the number of streams with any event, and the span from first to last event."""
    by_stream: dict[int, list[tuple[float, float]]] = {}
    for event in events:
        by_stream.setdefault(event.stream, []).append((event.start, event.end))
    compute = merge_intervals(by_stream.get(compute_stream, []))
    lanes = {}
    for lane, stream in side_streams.items():
        side = merge_intervals(by_stream.get(stream, []))
        busy = covered_seconds(side)
        overlapped = intersection_seconds(side, compute)
        lanes[lane] = {"stream": stream, "events": len(by_stream.get(stream, [])),
                       "busy_s": busy, "overlapped_s": overlapped,
                       "overlapped_fraction": overlapped / busy if busy > 0 else 0.0}
    span = (max(e.end for e in events) - min(e.start for e in events)) if events else 0.0
    return {"compute_stream": compute_stream, "compute_busy_s": covered_seconds(compute),
            "streams_with_events": len(by_stream), "span_s": span, "lanes": lanes}


def analyse_streams(events: Sequence[GpuEvent], marker: str = "spin_kernel",
                    side_lanes: Sequence[str] = ("gather", "reduce")) -> dict[str, Any]:
    """Label the streams (marker kernels launched on the side lanes, then on the compute
    stream, before the profiled work; else the busiest stream is compute and the others are
    unlabelled side streams) and measure the overlap of the work after the markers."""
    labelled = lane_streams_from_markers(events, marker, [*side_lanes, "compute"])
    if labelled is not None:
        streams, after = labelled
        work = [e for e in events if e.start >= after and marker not in e.name]
        result = stream_overlap(work, streams["compute"],
                                {lane: streams[lane] for lane in side_lanes})
        result["labels"] = "marker kernels"
        return result
    compute = busiest_stream(events)
    if compute is None:
        return {"labels": "none: no GPU events", "streams_with_events": 0, "lanes": {},
                "compute_busy_s": 0.0, "compute_stream": None, "span_s": 0.0}
    others = sorted({e.stream for e in events} - {compute})
    result = stream_overlap(events, compute, {f"stream {s}": s for s in others})
    result["labels"] = "busiest stream taken as compute (no marker kernels found)"
    return result


# ---- the report ------------------------------------------------------------------------------


def build_report(*, sections: Sequence[SectionResult], device: dict[str, Any],
                 environment: dict[str, Any], options: dict[str, Any], total_seconds: float,
                 complete: bool = True) -> dict[str, Any]:
    """The report as plain data. `kernel_rates` comes from section b's figures when it
    measured any (also when a kernel missed the bandwidth target: the rates are what they
    are); `passed` is true when every section ran and passed."""
    kernel_rates: dict[str, float] = {}
    host_seconds_per_op = None
    for result in sections:
        if result.key == "b":
            kernel_rates = dict(result.figures.get("kernel_rates") or {})
        if result.key == "e":
            host_seconds_per_op = result.figures.get("host_seconds_per_op")
    selected = list(options.get("sections") or [])
    ran = {result.key for result in sections}
    return json_safe({
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "complete": complete,
        "passed": complete and set(selected) <= ran
        and all(result.status == "pass" for result in sections),
        "total_seconds": total_seconds,
        "options": dict(options),
        "environment": dict(environment),
        "device": dict(device),
        "sections": [result.to_dict() for result in sections],
        "kernel_rates": kernel_rates,
        # Section e's host issue time per GPU launch: the step-time model's host cost.
        **({"host_seconds_per_op": host_seconds_per_op}
           if _is_number(host_seconds_per_op) and host_seconds_per_op > 0 else {}),
    })


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ReportError(message)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_report(report: Any) -> None:
    """Raise ReportError (one line) unless `report` follows the schema."""
    _require(isinstance(report, dict), f"report must be a JSON object, got {type(report).__name__}")
    _require(report.get("schema") == SCHEMA,
             f"schema must be {SCHEMA!r}, got {report.get('schema')!r}")
    _require(report.get("version") == SCHEMA_VERSION,
             f"version must be {SCHEMA_VERSION}, got {report.get('version')!r}")
    for key, kind in (("created", str), ("complete", bool), ("passed", bool),
                      ("options", dict), ("environment", dict), ("device", dict),
                      ("sections", list), ("kernel_rates", dict)):
        _require(isinstance(report.get(key), kind),
                 f"{key!r} must be a {kind.__name__}, got {type(report.get(key)).__name__}")
    _require(_is_number(report.get("total_seconds")), "'total_seconds' must be a number")
    seen = []
    for index, section in enumerate(report["sections"]):
        where = f"sections[{index}]"
        _require(isinstance(section, dict), f"{where} must be an object")
        key = section.get("key")
        _require(key in SECTIONS, f"{where}.key {key!r} is not one of {', '.join(SECTIONS)}")
        _require(key not in seen, f"{where}: section {key!r} appears twice")
        seen.append(key)
        _require(section.get("name") == SECTIONS[key][0],
                 f"{where}.name must be {SECTIONS[key][0]!r} for key {key!r}")
        _require(section.get("status") in STATUSES,
                 f"{where}.status {section.get('status')!r} is not one of {STATUSES}")
        _require(_is_number(section.get("seconds")) and section["seconds"] >= 0,
                 f"{where}.seconds must be a non-negative number")
        _require(isinstance(section.get("summary"), str), f"{where}.summary must be a string")
        _require(isinstance(section.get("figures"), dict), f"{where}.figures must be an object")
    _require(seen == sorted(seen), f"sections must be in the order {', '.join(SECTIONS)}")
    for op, rate in report["kernel_rates"].items():
        _require(isinstance(op, str) and op, "kernel_rates keys must be op names")
        _require(_is_number(rate) and rate > 0, f"kernel_rates[{op!r}] must be a positive number")
    if "host_seconds_per_op" in report:
        _require(_is_number(report["host_seconds_per_op"]) and report["host_seconds_per_op"] > 0,
                 "'host_seconds_per_op' must be a positive number")
    peak = report["device"].get("peak_memory_bandwidth")
    if peak is not None:
        _require(isinstance(peak, dict) and _is_number(peak.get("bytes_per_second"))
                 and peak["bytes_per_second"] > 0,
                 "device.peak_memory_bandwidth.bytes_per_second must be a positive number")


def write_json_atomically(path: Path, value: Any, **dumps: Any) -> None:
    """``json.dumps(value, **dumps)`` into ``path`` through a temporary renamed over it: a
    reader never sees half a file, also when the writer is killed while writing."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, **dumps) + "\n")
    os.replace(partial, path)


@contextmanager
def sigterm_raises(error: Callable[[int], BaseException] = lambda signum: SystemExit(
        128 + signum)):
    """While inside, the first SIGTERM (a caller's time limit: GNU timeout signals the
    process and then its group) raises ``error(signum)`` where the program is, so its
    ``finally`` and ``except`` blocks stop children and write what finished; later ones are
    ignored. The caller's handler comes back on exit (these run inside tests' processes)."""
    def handler(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise error(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    """Validate and write `out_dir/gpu_check.json`, atomically (a reader never sees half a
    report, also when the check is killed while writing)."""
    validate_report(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REPORT_NAME
    write_json_atomically(path, report, indent=1, sort_keys=False, allow_nan=False)
    return path


def format_rate(value: float) -> str:
    """Bytes/s as TB/s or GB/s."""
    return f"{value / 1e12:.2f} TB/s" if value >= 1e12 else f"{value / 1e9:.1f} GB/s"


def render_table(report: dict[str, Any]) -> str:
    """The short table printed at the end: one row per section, then the kernel rates."""
    device = report.get("device", {})
    peak = device.get("peak_memory_bandwidth")
    peak_text = (f"{format_rate(peak['bytes_per_second'])} ({peak['source']})" if peak
                 else "unknown")
    lines = [f"GPU check on {device.get('name', 'an unknown device')}, peak memory bandwidth "
             f"{peak_text}"]
    lines.append(f"  {'':<2} {'section':<36} {'status':<6} {'time':>8}  summary")
    for section in report["sections"]:
        lines.append(f"  {section['key']:<2} {section['title']:<36} {section['status']:<6} "
                     f"{section['seconds']:>7.1f}s  {section['summary']}")
    rates = report.get("kernel_rates") or {}
    if rates:
        lines.append("  kernel rates (bytes read + written per second; for the step-time model's "
                     "--dry-run-kernel-rates):")
        for op, rate in rates.items():
            share = f"  ({rate / peak['bytes_per_second']:.0%} of peak)" if peak else ""
            lines.append(f"    {op:<44} {format_rate(rate):>12}{share}")
    if report.get("host_seconds_per_op"):
        lines.append(f"  host issue time per GPU launch: {report['host_seconds_per_op'] * 1e6:.1f} "
                     "us (the step-time model's host cost)")
    verdict = "PASSED" if report.get("passed") else "NOT PASSED"
    if not report.get("complete", True):
        verdict += " (incomplete)"
    lines.append(f"  {verdict} in {report['total_seconds']:.0f} s")
    return "\n".join(lines)
