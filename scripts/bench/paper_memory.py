"""Which of the ZeRO++ paper's setups fit in a 32 GB V100, measured on the simulated GPU cluster.

    python -m scripts.bench.paper_memory --out docs/paper_memory.md

For every paper model (18B, 49B, 91B, 138B), 1K and 2K tokens per GPU, ZeRO-3 and ZeRO++
(qwZ + hpZ 16 + qgZ, the tutorial's config), on 1-24 DGX-2 nodes of 16 GPUs: the planner's
per-GPU peak (``--dry-run``'s total), and rank 0 of the cluster run for real on meta tensors
by ``megatron_lite.simulate`` (3 iterations of ``megatron_lite.pretrain_gpt.main`` with the
paper's flags). Memory per GPU falls as nodes are added, so each (model, tokens, system) is measured
where the planner puts the edge: the fewest nodes it says fit, and the node count below;
``--measure all`` measures every cell (hours for the 138B), ``--measure-nodes 24`` these node
counts as well (every cell the paper trained: ``--measure none --measure-nodes 24``). ``--budget-minutes`` stops
measuring when the time is spent (the remaining cells are planned only) and ``--reuse FILE``
keeps the measurements of an earlier run's JSON instead of repeating them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megatron_lite.arguments import parse_args
from megatron_lite.dry_run import GIB, baseline_ds_config, build_report
from megatron_lite.ds_config import read_ds_config
from megatron_lite.simulate import simulate_rank

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("18b", "49b", "91b", "138b")
NODES = (1, 2, 4, 8, 16, 24)
GPUS_PER_NODE = 16
SEQ_LENGTH = 512


def model_flags(model: str) -> list[str]:
    lines = (ROOT / "configs" / "models" / f"gpt_{model}.args").read_text().splitlines()
    return " ".join(line for line in lines if not line.lstrip().startswith("#")).split()


def program_argv(model: str, nodes: int, tokens: int) -> list[str]:
    micro = tokens // SEQ_LENGTH
    return model_flags(model) + [
        "--micro-batch-size", str(micro),
        "--global-batch-size", str(micro * nodes * GPUS_PER_NODE),
        "--fp16", "--checkpoint-activations", "--lr", "1e-4",
        "--deepspeed_config", str(ROOT / "configs" / "ds_zeropp_config.json"),
    ]


def planned(argv: list[str], nodes: int) -> tuple[int, int]:
    """(ZeRO-3, ZeRO++) planned bytes per GPU."""
    args = parse_args(argv + ["--dry-run", "--dry-run-nodes", str(nodes),
                              "--dry-run-gpus-per-node", str(GPUS_PER_NODE)])
    report = build_report(args)
    return tuple(report.total_bytes(plan) for plan in report.plans)


def measured(argv: list[str], nodes: int, system: str, label: str) -> tuple[int, float]:
    ds_config = None
    if system == "ZeRO-3":
        ds_config = baseline_ds_config(read_ds_config(parse_args(argv)))
    start = time.perf_counter()
    result = simulate_rank(argv, 0, nodes, GPUS_PER_NODE, save_dir=None, ds_config=ds_config,
                           label=label)
    if result.violations:
        raise RuntimeError(f"{system} on {nodes} nodes broke NCCL's rules: {result.violations}")
    return result.peak_bytes, time.perf_counter() - start


def cells_to_measure(plans: dict[int, float], limit: float, mode: str) -> list[int]:
    if mode == "all":
        return list(plans)
    fitting = [n for n in NODES if plans[n] <= limit]
    if not fitting:
        return [NODES[-1]]
    first = fitting[0]
    below = [n for n in NODES if n < first]
    return ([below[-1]] if below else []) + [first]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.paper_memory",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens", default="1024,2048", help="tokens per GPU per micro-batch")
    parser.add_argument("--gpu-memory-gb", type=float, default=32.0)
    parser.add_argument("--measure", choices=("edge", "all", "none"), default="edge")
    parser.add_argument("--measure-nodes", default="",
                        help="comma-separated node counts measured as well (24: the paper's)")
    parser.add_argument("--budget-minutes", type=float, default=None,
                        help="stop measuring after this long; later cells are planned only")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="JSON of an earlier run whose measurements to keep")
    parser.add_argument("--out", type=Path, required=True, help="markdown table (and .json)")
    options = parser.parse_args()
    limit = options.gpu_memory_gb * GIB
    deadline = None if options.budget_minutes is None else \
        time.monotonic() + 60 * options.budget_minutes
    earlier = {}
    if options.reuse is not None:
        for row in json.loads(options.reuse.read_text()):
            if "measured_bytes" in row:
                key = (row["model"], row["tokens_per_gpu"], row["system"], row["nodes"])
                earlier[key] = row
    rows = []
    for model in options.models.split(","):
        for tokens in (int(t) for t in options.tokens.split(",")):
            plans = {n: planned(program_argv(model, n, tokens), n) for n in NODES}
            for index, system in enumerate(("ZeRO-3", "ZeRO++")):
                by_nodes = {n: plans[n][index] for n in NODES}
                chosen = [] if options.measure == "none" else \
                    cells_to_measure(by_nodes, limit, options.measure)
                chosen += [int(n) for n in options.measure_nodes.split(",") if n]
                for nodes in NODES:
                    row = {"model": model, "tokens_per_gpu": tokens, "system": system,
                           "nodes": nodes, "planned_bytes": by_nodes[nodes]}
                    reused = earlier.get((model, tokens, system, nodes))
                    if reused is not None:
                        row.update(measured_bytes=reused["measured_bytes"],
                                   simulation_s=reused["simulation_s"])
                    elif nodes in chosen and (deadline is None or time.monotonic() < deadline):
                        peak, seconds = measured(
                            program_argv(model, nodes, tokens), nodes, system,
                            label=f"{model} at {tokens} tokens/GPU, {system} on {nodes} nodes")
                        row.update(measured_bytes=peak, simulation_s=round(seconds, 1))
                        print(f"{model} {tokens} {system} {nodes} nodes: planned "
                              f"{by_nodes[nodes] / GIB:.2f} GiB, measured {peak / GIB:.2f} GiB "
                              f"({seconds:.0f} s)", flush=True)
                    rows.append(row)
                # written as it goes: the 138B cells take minutes each
                options.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
                options.out.write_text(render(rows, limit, options.gpu_memory_gb,
                                              command_line()))
    print(f"wrote {options.out}")
    return 0


def command_line() -> str:
    """How this table was made, as a user would type it (paths relative to the repository)."""
    return "python -m scripts.bench.paper_memory " + " ".join(sys.argv[1:])


def render(rows: list[dict], limit: float, gpu_gb: float,
           command: str = "python -m scripts.bench.paper_memory --out docs/paper_memory.md") -> str:
    lines = [
        f"# The paper's setups on {gpu_gb:g} GiB GPUs (DGX-2 nodes of {GPUS_PER_NODE})",
        "",
        "Peak GiB per GPU: measured on the simulated GPU cluster (rank 0, meta tensors, the "
        "real program) where a number is given as `measured / planned`, else planned only. "
        f"**bold**: does not fit. Regenerate with `{command}`.",
        "",
        f"{sum('measured_bytes' in r for r in rows)} of {len(rows)} cells measured, "
        f"{sum(r.get('simulation_s', 0) for r in rows) / 60:.0f} minutes of simulation.",
        "",
        "| model | tokens/GPU | system | " + " | ".join(f"{n} nodes" for n in NODES) + " |",
        "|---|---|---|" + "---|" * len(NODES),
    ]
    keys = sorted({(r["model"], r["tokens_per_gpu"], r["system"]) for r in rows},
                  key=lambda k: (int(k[0][:-1]), k[1], k[2] != "ZeRO-3"))
    for key in keys:
        cells = []
        for nodes in NODES:
            row = next(r for r in rows if (r["model"], r["tokens_per_gpu"], r["system"]) == key
                       and r["nodes"] == nodes)
            peak = row.get("measured_bytes", row["planned_bytes"])
            text = (f"{row['measured_bytes'] / GIB:.1f} / {row['planned_bytes'] / GIB:.1f}"
                    if "measured_bytes" in row else f"{row['planned_bytes'] / GIB:.1f}")
            cells.append(f"**{text}**" if peak > limit else text)
        model, tokens, system = key
        lines.append(f"| {model.upper()} | {tokens // 1024}K | {system} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
