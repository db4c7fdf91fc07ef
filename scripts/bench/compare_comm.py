"""Print the bytes each rank sent per iteration, by phase, for two or more training runs.

    python -m scripts.bench.compare_comm zero3=runs/a/metrics.jsonl zeropp=runs/b/metrics.jsonl

Reads the ``comm_bytes`` of the last logged training iteration of each ``--metrics-file``
and prints intra- and inter-node megabytes per phase, and each run's inter-node total as a
ratio to the first run's.
"""

from __future__ import annotations

import json
import sys

PHASES = ("forward_all_gather", "backward_all_gather", "gradient_reduce")


def last_comm_bytes(path: str) -> dict:
    found = None
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if "comm_bytes" in record:
                found = record["comm_bytes"]
    if found is None:
        raise SystemExit(f"error: {path} has no training record with comm_bytes")
    return found


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv):
        raise SystemExit("usage: python -m scripts.bench.compare_comm NAME=METRICS.jsonl "
                         "NAME=METRICS.jsonl [...]")
    runs = [(a.split("=", 1)[0], last_comm_bytes(a.split("=", 1)[1])) for a in argv]
    header = f"{'run':<10}" + "".join(f"{p + ' (MB)':>28}" for p in PHASES)
    print(header + f"{'inter-node total':>18}{'vs ' + runs[0][0]:>12}")
    base = None
    for name, comm in runs:
        inter = sum(comm[p]["inter_node"] for p in PHASES)
        base = base or inter
        cells = "".join(
            f"{comm[p]['inter_node'] / 1e6:>14.2f} inter {comm[p]['intra_node'] / 1e6:>6.2f} intra"
            for p in PHASES
        )
        ratio = "baseline" if name == runs[0][0] else (f"{base / inter:.2f}x less" if inter else "-")
        print(f"{name:<10}{cells}{inter / 1e6:>15.2f} MB{ratio:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
