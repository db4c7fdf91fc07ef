"""Kernel rates measured on a GPU, as the step-time model reads them.

The GPU check (``scripts/gpu_check.sh``) writes bytes/s per quantization kernel and the host's
issue time per launch into its report; ``load_kernel_rates`` reads them back, refusing a file it
cannot use in one line, and ``zeropp.planning.step_time.with_kernel_rates`` puts them into a
cluster description.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

KERNEL_RATES_SCHEMA = "zeropp-gpu-check"  # what scripts/gpu_check/report.py writes
KERNEL_RATES_VERSION = 1


class KernelRatesError(ValueError):
    """A kernel-rates file that cannot be used (one line, naming the file)."""


@dataclass(frozen=True)
class MeasuredKernelRates:
    """Bytes/s per trace op name, measured on one GPU by the GPU check
    (``scripts/gpu_check.sh``, its ``gpu_check.json``)."""

    rates: dict[str, float]
    device: str  # the GPU they were measured on
    peak_memory_bandwidth: float | None  # that GPU's peak, bytes/s, when the report has it
    path: str
    # The host's issue time per GPU launch the check measured (section e), when it did.
    host_seconds_per_op: float | None = None


def _positive_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def load_kernel_rates(path: str | Path) -> MeasuredKernelRates:
    """Read the ``kernel_rates`` of a GPU check report (a minimal ``{"kernel_rates": {op:
    bytes/s}}`` file works too); raises KernelRatesError with one line saying what is wrong."""
    path = Path(path)
    where = f"kernel rates file {path}"
    if not path.is_file():
        raise KernelRatesError(f"{where} does not exist (scripts/gpu_check.sh writes one)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise KernelRatesError(f"{where} is not JSON: {error.msg} at line {error.lineno}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise KernelRatesError(f"{where} cannot be read: {error}") from None
    if not isinstance(data, dict):
        raise KernelRatesError(f"{where} must hold a JSON object, got {type(data).__name__}")
    schema, version = data.get("schema"), data.get("version")
    if schema is not None and schema != KERNEL_RATES_SCHEMA:
        raise KernelRatesError(f"{where} is a {schema!r} file, not a GPU check report")
    if schema is not None and version != KERNEL_RATES_VERSION:
        raise KernelRatesError(f"{where} has report version {version!r}; this reader knows "
                               f"version {KERNEL_RATES_VERSION}")
    rates = data.get("kernel_rates")
    if not isinstance(rates, dict):
        raise KernelRatesError(f"{where} has no 'kernel_rates' object")
    if not rates:
        raise KernelRatesError(f"{where} has no kernel rates: the check's bandwidth section "
                               "(b) did not measure any")
    for op, rate in rates.items():
        if not _positive_number(rate):
            raise KernelRatesError(f"{where}: kernel_rates[{op!r}] must be a positive number "
                                   f"of bytes/s, got {rate!r}")
    host_cost = data.get("host_seconds_per_op")
    if host_cost is not None and not _positive_number(host_cost):
        raise KernelRatesError(f"{where}: host_seconds_per_op must be a positive number of "
                               f"seconds, got {host_cost!r}")
    device = data.get("device") if isinstance(data.get("device"), dict) else {}
    peak = (device.get("peak_memory_bandwidth") or {})
    peak_rate = peak.get("bytes_per_second") if isinstance(peak, dict) else None
    return MeasuredKernelRates(
        rates={str(op): float(rate) for op, rate in rates.items()},
        device=str(device.get("name") or "an unnamed device"),
        peak_memory_bandwidth=float(peak_rate) if _positive_number(peak_rate) else None,
        path=str(path), host_seconds_per_op=None if host_cost is None else float(host_cost))
