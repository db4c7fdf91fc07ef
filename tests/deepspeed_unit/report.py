"""Compare DeepSpeed's record with zeropp's: the markdown tables of docs/deepspeed_unit_tests.md.

    python -m tests.deepspeed_unit.report deepspeed.json zeropp.json > table.md

Of the tests that pass with DeepSpeed, each one's outcome here; every one that does not pass
with its exception line, and, where this engine differs from DeepSpeed on purpose, the reason
(``scope.DIFFERENCES``). Then the out-of-scope table, grouped by reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from tests.deepspeed_unit import scope


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _grouped(groups: dict[str, list[str]]) -> list[str]:
    """One row per reason: its tests (parametrizations folded into their function)."""
    rows = []
    for reason, ids in sorted(groups.items(), key=lambda item: item[1][0]):
        functions = sorted({i.split("[")[0] for i in ids})
        shown = "<br>".join(f"`{_cell(f)}`" for f in functions)
        rows.append(f"| {shown} | {len(ids)} | {_cell(reason)} |")
    return rows


def render(theirs: dict, ours: dict) -> str:
    # The scope as it is now: a test DeepSpeed's record ran that the scope has since put out
    # (its reason found by a later run against zeropp) counts as out of scope, not as run.
    moved = {k: reason for k in theirs["outcomes"] if (reason := scope.out_of_scope(k))}
    theirs = {**theirs, "outcomes": {k: v for k, v in theirs["outcomes"].items()
                                     if k not in moved},
              "out_of_scope": {**theirs["out_of_scope"], **moved}}
    passed_there = sorted(k for k, v in theirs["outcomes"].items() if v["outcome"] == "passed")
    here = ours["outcomes"]
    counts = Counter(here.get(k, {"outcome": "not run"})["outcome"] for k in passed_there)
    there = Counter(v["outcome"] for v in theirs["outcomes"].values())
    lines = [
        f"In scope: {len(theirs['outcomes'])} tests; with DeepSpeed 0.19.8 "
        + ", ".join(f"{n} {o}" for o, n in sorted(there.items())) + ".",
        "",
        f"Of the {len(passed_there)} that pass with DeepSpeed, against zeropp: "
        + ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
        + f" ({100 * counts['passed'] / max(len(passed_there), 1):.0f}% pass).",
        "",
        "| tests that pass with DeepSpeed and not here | count | why |",
        "|---|---|---|",
    ]
    why_here: dict[str, list[str]] = defaultdict(list)
    for nodeid in passed_there:
        entry = here.get(nodeid, {"outcome": "not run"})
        if entry["outcome"] != "passed":
            why = scope.difference(nodeid) or f"{entry['outcome']}: {entry.get('reason', '')}"
            why_here[why].append(nodeid)
    lines += _grouped(why_here)
    passing = sorted({k.split("[")[0] for k in passed_there
                      if here.get(k, {}).get("outcome") == "passed"})
    lines += ["", f"Passing here ({counts['passed']} tests, by function): "
              + ", ".join(f"`{_cell(f.split('/')[-1])}`" for f in passing) + "."]
    why_there: dict[str, list[str]] = defaultdict(list)
    for nodeid, entry in sorted(theirs["outcomes"].items()):
        if entry["outcome"] != "passed":
            why_there[f"{entry['outcome']}: {entry.get('reason', '')[:160]}"].append(nodeid)
    lines += ["", "Tests that do not pass with DeepSpeed 0.19.8 on this CPU (not run here):", "",
              "| tests | count | DeepSpeed's outcome |", "|---|---|---|"]
    lines += _grouped(why_there)
    by_reason: dict[str, list[str]] = defaultdict(list)
    for nodeid, reason in theirs["out_of_scope"].items():
        by_reason[reason].append(nodeid)
    lines += ["", f"Out of scope: {len(theirs['out_of_scope'])} tests, not run.", "",
              "| tests | count | needs |", "|---|---|---|"]
    for reason, ids in sorted(by_reason.items(), key=lambda item: item[1][0]):
        files = sorted({i.split("::")[0] for i in ids})
        shown = ", ".join(f"`{f}`" for f in files[:3]) + (" ..." if len(files) > 3 else "")
        lines.append(f"| {shown} | {len(ids)} | {_cell(reason)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("deepspeed_record", type=Path, help="the record of DeepSpeed's run")
    parser.add_argument("zeropp_record", type=Path, help="the record of zeropp's run")
    args = parser.parse_args(argv)
    theirs, ours = (json.loads(p.read_text()) for p in (args.deepspeed_record,
                                                         args.zeropp_record))
    sys.stdout.write(render(theirs, ours))


if __name__ == "__main__":
    main()
