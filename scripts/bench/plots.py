"""The lab's two figures: throughput per system and link rate, and loss curves.

Both read the JSON records that ``run_lab.py`` and ``convergence.py`` write and return the
path of the PNG they saved; matplotlib runs headless (Agg).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Slowest link first, as the paper orders its bandwidth plots.
RATE_ORDER = ("100mbit", "1gbit", "10gbit", "unlimited", "local")
# Fixed colours so a system looks the same in every figure of the write-up.
SYSTEM_COLOURS = {
    "zero3": "#7f7f7f", "qwz": "#aec7e8", "hpz": "#98df8a", "qgz": "#ffbb78",
    "zeropp": "#1f77b4", "zeropp_deltas": "#17becf", "zeropp_deltas2": "#2ca02c",
    "zeropp_deltas_grad2": "#bcbd22",
    "fsdp2": "#d62728",
    "fsdp2_hybrid": "#ff9896",
    "ds_zero3": "#8c564b", "ds_zero3_hpz": "#c49c94", "ds_zeropp": "#9467bd",
}


def rate_sort_key(rate: str) -> tuple[int, str]:
    return (RATE_ORDER.index(rate) if rate in RATE_ORDER else len(RATE_ORDER), rate)


def _systems_in_order(runs: list[dict]) -> list[str]:
    """Every system of any run, in the fixed order of SYSTEM_COLOURS (unknown ones last)."""
    seen: list[str] = []
    for run in runs:
        seen += [s for s in run["systems"] if s not in seen]
    known = [s for s in SYSTEM_COLOURS if s in seen]
    return known + [s for s in seen if s not in SYSTEM_COLOURS]


def _bar_heights(runs: list[dict], system: str, baseline: str | None) -> list[float]:
    """Tokens/s per run (or the ratio to ``baseline``'s); 0 where it has no value."""
    heights = []
    for run in runs:
        record, base = run["systems"].get(system, {}), run["systems"].get(baseline or "", {})
        if record.get("status") != "ok":
            heights.append(0.0)
        elif baseline is None:
            heights.append(record["tokens_per_sec"])
        elif base.get("status") == "ok":
            heights.append(record["tokens_per_sec"] / base["tokens_per_sec"])
        else:
            heights.append(0.0)
    return heights


def throughput_bars(runs: list[dict], path: Path, baseline: str = "zero3") -> Path:
    """Grouped bars, one group per link rate and one bar per system: tokens/s (left, log
    scale) and speed-up over ``baseline`` at the same rate (right). A failed run has no bar
    and an "x" on the axis."""
    runs = sorted(runs, key=lambda run: rate_sort_key(run["rate"]))
    systems = _systems_in_order(runs)
    width = 0.8 / max(len(systems), 1)
    figure, (absolute, relative) = plt.subplots(
        1, 2, figsize=(max(9.0, 2.0 + 3.0 * len(runs)), 4.8), layout="constrained")
    for axes, reference in ((absolute, None), (relative, baseline)):
        for index, system in enumerate(systems):
            heights = _bar_heights(runs, system, reference)
            positions = [group + (index - (len(systems) - 1) / 2) * width
                         for group in range(len(runs))]
            axes.bar(positions, heights, width, label=system, color=SYSTEM_COLOURS.get(system))
            if reference is not None:  # a log axis has no 0 to mark failures at
                failed = [x for x, run in zip(positions, runs, strict=True)
                          if run["systems"].get(system, {}).get("status") == "error"]
                axes.plot(failed, [0] * len(failed), "x", color="black")
        axes.set_xticks(range(len(runs)), [run["rate"] for run in runs])
        axes.set_xlabel("inter-node link rate")
        axes.grid(axis="y", alpha=0.3)
    absolute.set_yscale("log")
    absolute.set_ylabel("tokens / s (whole job)")
    relative.set_ylabel(f"speed-up over {baseline} at the same rate")
    relative.axhline(1.0, color="black", linewidth=0.8)
    nodes, per_node = runs[0].get("nodes"), runs[0].get("ranks_per_node")
    figure.suptitle(f"Training throughput, {nodes} nodes x {per_node} ranks (gloo, CPU); "
                    "x: the system failed to run")
    handles, labels = relative.get_legend_handles_labels()
    figure.legend(handles[:len(systems)], labels[:len(systems)], loc="outside lower center",
                  ncol=min(len(systems), 5), fontsize=8, frameon=False)
    return _save(figure, path)


def loss_curves(convergence: dict, path: Path) -> Path:
    """Training loss per iteration (lines) and validation loss (markers), per variant."""
    figure, axes = plt.subplots(figsize=(7.0, 4.2))
    for index, (name, variant) in enumerate(convergence["variants"].items()):
        colour = f"C{index}"
        train = variant.get("train_curve", [])
        if train:
            iterations, losses = zip(*train, strict=True)
            axes.plot(iterations, losses, color=colour, linewidth=1.2, label=f"{name} (train)")
        valid = variant.get("valid_curve", [])
        if valid:
            iterations, losses = zip(*valid, strict=True)
            axes.plot(iterations, losses, color=colour, marker="o", linestyle="--",
                      linewidth=0.8, label=f"{name} (validation)")
    axes.set_xlabel("iteration")
    axes.set_ylabel("LM loss")
    setup = convergence.get("setup", {})
    axes.set_title(f"Loss on the sample corpus, {setup.get('ranks', '?')} ranks "
                   f"({setup.get('ranks_per_node', '?')} per node)")
    axes.legend(fontsize=8, frameon=False)
    axes.grid(alpha=0.3)
    return _save(figure, path)


def predicted_vs_reference(paper: list[dict], lab: list[dict], path: Path) -> Path:
    """Two panels, predicted against reference on log axes with the error bands of the
    targets: the paper's TFLOPs per GPU (and the tutorial's seconds, as TFLOPs) beside the
    lab's measured seconds per iteration.

    ``paper``: predict_paper's cells; ``lab``: predict_lab's rows (system, cells)."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.6))
    markers = {"ZeRO-3": "o", "ZeRO++": "s"}
    for cell in paper:
        if "published_tflops" in cell:
            reference, predicted = cell["published_tflops"], cell["predicted_tflops"]
            colour = "C0" if cell["gbps"] == 100 else "C1"
        else:  # the tutorial: seconds, shown as the TFLOPs they mean
            reference = cell["predicted_tflops"] * cell["predicted_seconds"] / \
                cell["published_seconds"]
            predicted, colour = cell["predicted_tflops"], "C2"
        left.scatter(reference, predicted, marker=markers[cell["system"]], color=colour,
                     s=28, zorder=3)
    for label, colour in (("384 V100, 100 Gbps", "C0"), ("384 V100, 400 Gbps", "C1"),
                          ("tutorial, 64 V100", "C2")):
        left.scatter([], [], color=colour, marker="o", label=label)
    for system, marker in markers.items():
        left.scatter([], [], color="grey", marker=marker, label=system)
    _identity_with_band(left, 5, 70, 0.20)
    left.set_xlabel("published TFLOPs per GPU")
    left.set_ylabel("predicted TFLOPs per GPU")
    left.set_title("The ZeRO++ paper (band: 20%)")
    left.legend(fontsize=7, frameon=False, loc="upper left")
    for row in lab:
        for cell in row["cells"]:
            right.scatter(cell["measured"], cell["predicted"],
                          color=SYSTEM_COLOURS.get(row["system"], "black"),
                          marker={"unlimited": "o", "1gbit": "^", "100mbit": "s"}[cell["rate"]],
                          s=28, zorder=3, edgecolors="black", linewidths=0.4)
    for system in dict.fromkeys(row["system"] for row in lab):
        right.scatter([], [], color=SYSTEM_COLOURS.get(system, "black"), label=system)
    for rate, marker in (("unlimited", "o"), ("1gbit", "^"), ("100mbit", "s")):
        right.scatter([], [], color="white", edgecolors="black", marker=marker, label=rate)
    _identity_with_band(right, 1, 30, 0.25)
    right.set_xlabel("measured seconds per iteration")
    right.set_ylabel("predicted seconds per iteration")
    right.set_title("The CPU lab, 2 x 2 ranks (band: 25%)")
    right.legend(fontsize=7, frameon=False, loc="upper left", ncol=2)
    return _save(figure, path)


def _identity_with_band(axes, low: float, high: float, band: float) -> None:
    line = [low, high]
    axes.plot(line, line, color="black", linewidth=0.8)
    axes.fill_between(line, [v * (1 - band) for v in line], [v * (1 + band) for v in line],
                      color="grey", alpha=0.15, linewidth=0)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlim(low, high)
    axes.set_ylim(low, high)
    for axis in (axes.xaxis, axes.yaxis):  # plain numbers, not powers of ten
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes.set_xticks([t for t in (1, 2, 5, 10, 20, 30, 50) if low <= t <= high])
    axes.set_yticks([t for t in (1, 2, 5, 10, 20, 30, 50) if low <= t <= high])
    axes.grid(alpha=0.3, which="both")


def _save(figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not figure.get_layout_engine():
        figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
