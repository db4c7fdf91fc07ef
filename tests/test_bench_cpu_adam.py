"""The CPU AdamW bench (scripts/bench/cpu_adam.py), run in-process on a tiny shard.

DeepSpeed's op is left out (--skip-deepspeed): its first use compiles C++, minutes on this
machine; its failure path is exercised with a stand-in that raises.
"""

from __future__ import annotations

import json

import pytest
import torch

from scripts.bench import cpu_adam

TORCH_ROWS = ["torch AdamW fused=True", "torch AdamW foreach=True",
              "torch AdamW foreach=False (per-tensor loop)"]


def test_every_torch_implementation_is_measured_and_agrees_with_foreach(capsys, tmp_path):
    threads = torch.get_num_threads()
    out = tmp_path / "rows.json"
    rows = cpu_adam.main(["--numel", "10000", "--tensors", "3", "--steps", "1", "--threads",
                          "1", "--skip-deepspeed", "--json", str(out)])
    assert [row["implementation"] for row in rows] == TORCH_ROWS
    assert all(row["seconds_per_step"] > 0 and row["params_per_second"] > 0 for row in rows)
    assert max(row["vs_fastest"] for row in rows) == 1.0
    assert all(row["agrees_with_foreach"] for row in rows)
    diffs = {row["implementation"]: row["max_abs_diff_vs_foreach"] for row in rows}
    assert diffs[TORCH_ROWS[1]] == 0 and diffs[TORCH_ROWS[2]] == 0  # the same arithmetic
    assert 0 <= diffs[TORCH_ROWS[0]] < 1e-5  # the same update, rounded by another kernel
    printed = capsys.readouterr().out
    assert "| torch AdamW fused=True |" in printed and ": pass;" in printed
    assert json.loads(out.read_text())["rows"] == rows
    assert torch.get_num_threads() == threads  # the bench's setting does not outlive it


def test_an_implementation_that_cannot_be_built_is_a_one_line_row(monkeypatch, capsys):
    build = cpu_adam._build

    def failing(kind, params):
        if kind == cpu_adam.DEEPSPEED:
            raise RuntimeError("Error building extension 'cpu_adam'\nlong compiler log")
        return build(kind, params)

    monkeypatch.setattr(cpu_adam, "_build", failing)
    rows = cpu_adam.main(["--numel", "1000", "--steps", "1", "--threads", "1"])
    assert rows[-1] == {"implementation": cpu_adam.DEEPSPEED,
                        "error": "RuntimeError: Error building extension 'cpu_adam'"}
    assert all(row["agrees_with_foreach"] for row in rows[:-1])
    assert "not run: RuntimeError: Error building extension 'cpu_adam' |" in \
        capsys.readouterr().out


def test_bad_settings_are_refused():
    with pytest.raises(SystemExit):
        cpu_adam.main(["--numel", "2", "--tensors", "3"])
