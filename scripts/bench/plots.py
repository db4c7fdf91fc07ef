"""The lab's two figures: throughput per system and link rate, and loss curves.

Both read the JSON records that ``run_lab.py`` and ``convergence.py`` write and return the
path of the PNG they saved; matplotlib runs headless (Agg).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Slowest link first, as the paper orders its bandwidth plots.
RATE_ORDER = ("100mbit", "1gbit", "10gbit", "unlimited", "local")
# Fixed colours so a system looks the same in every figure of the write-up.
SYSTEM_COLOURS = {
    "zero3": "#7f7f7f", "qwz": "#aec7e8", "hpz": "#98df8a", "qgz": "#ffbb78",
    "zeropp": "#1f77b4", "fsdp2": "#d62728", "fsdp2_hybrid": "#ff9896",
    "ds_zero3": "#8c564b", "ds_zero3_hpz": "#c49c94", "ds_zeropp": "#9467bd",
}


def rate_sort_key(rate: str) -> tuple[int, str]:
    return (RATE_ORDER.index(rate) if rate in RATE_ORDER else len(RATE_ORDER), rate)


def throughput_bars(runs: list[dict], path: Path) -> Path:
    """Grouped bars: one group per link rate, one bar per system (tokens/s; failed = none)."""
    runs = sorted(runs, key=lambda run: rate_sort_key(run["rate"]))
    systems: list[str] = []
    for run in runs:
        systems += [s for s in run["systems"] if s not in systems]
    width = 0.8 / max(len(systems), 1)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.2 + 1.6 * len(runs)), 4.2))
    for index, system in enumerate(systems):
        heights = []
        for run in runs:
            record = run["systems"].get(system, {})
            heights.append(record.get("tokens_per_sec", 0.0) if record.get("status") == "ok"
                           else 0.0)
        positions = [group + (index - (len(systems) - 1) / 2) * width
                     for group in range(len(runs))]
        axes.bar(positions, heights, width, label=system,
                 color=SYSTEM_COLOURS.get(system))
    axes.set_xticks(range(len(runs)), [run["rate"] for run in runs])
    axes.set_xlabel("inter-node link rate (each node's up- and downlink)")
    axes.set_ylabel("tokens / s (whole job)")
    nodes, per_node = runs[0].get("nodes"), runs[0].get("ranks_per_node")
    axes.set_title(f"Training throughput, {nodes} nodes x {per_node} ranks (gloo, CPU)")
    axes.legend(fontsize=7, ncol=2, frameon=False)
    axes.grid(axis="y", alpha=0.3)
    return _save(figure, path)


def loss_curves(convergence: dict, path: Path) -> Path:
    """Training loss per iteration (lines) and validation loss (markers), per variant."""
    figure, axes = plt.subplots(figsize=(7.0, 4.2))
    for index, (name, variant) in enumerate(convergence["variants"].items()):
        colour = f"C{index}"
        train = variant.get("train_curve", [])
        if train:
            axes.plot(*zip(*train), color=colour, linewidth=1.2, label=f"{name} (train)")
        valid = variant.get("valid_curve", [])
        if valid:
            axes.plot(*zip(*valid), color=colour, marker="o", linestyle="--", linewidth=0.8,
                      label=f"{name} (validation)")
    axes.set_xlabel("iteration")
    axes.set_ylabel("LM loss")
    setup = convergence.get("setup", {})
    axes.set_title(f"Loss on the sample corpus, {setup.get('ranks', '?')} ranks "
                   f"({setup.get('ranks_per_node', '?')} per node)")
    axes.legend(fontsize=8, frameon=False)
    axes.grid(alpha=0.3)
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
