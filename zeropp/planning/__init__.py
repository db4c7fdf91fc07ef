"""Planning: a configuration's memory, bytes and step time, from the engine's rules, not a run.

- ``planner``: per-rank memory and communication of one iteration, unit by unit
  (``plan_system``, ``plan_zero3_and_zeropp``).
- ``step_time``: seconds per iteration of a traced iteration (``zeropp.simulation``) replayed on
  a described cluster, the host's issue time included (``predict``, ``CLUSTERS``).

The training path never imports this package.
"""

from zeropp.planning.kernel_rates import KernelRatesError, MeasuredKernelRates, load_kernel_rates
from zeropp.planning.planner import (
    MemoryPlan,
    SystemPlan,
    UnitPlan,
    plan_system,
    plan_zero3_and_zeropp,
)
from zeropp.planning.step_time import (
    CLUSTERS,
    ClusterSpec,
    StepPrediction,
    lab_cluster,
    predict,
    with_kernel_rates,
)

__all__ = [
    "CLUSTERS",
    "ClusterSpec",
    "KernelRatesError",
    "MeasuredKernelRates",
    "MemoryPlan",
    "StepPrediction",
    "SystemPlan",
    "UnitPlan",
    "lab_cluster",
    "load_kernel_rates",
    "plan_system",
    "plan_zero3_and_zeropp",
    "predict",
    "with_kernel_rates",
]
