"""scripts.bench.cuda_host_calls: the CUDA path's Python calls per collective, counted on
the CPU over torch.cuda's own Python with its C entry points stood in for."""

from __future__ import annotations

import json

import pytest
import torch

from scripts.bench import cuda_host_calls

pytestmark = pytest.mark.skipif(torch.backends.cuda.is_built(),
                                reason="stand-ins for torch's C entry points: a CPU build")


def test_counts_the_cuda_path_and_restores_torch() -> None:
    before = (torch.cuda.is_available(), torch.backends.cuda.is_built(),
              torch.cuda.Stream.__bases__, torch.cuda.Event.__bases__,
              torch.cuda._exchange_device, getattr(torch._C, "_cuda_getCurrentStream", None))
    counts = cuda_host_calls.count_calls(collectives=5)
    # [Note: lane switch]: with torch.cuda.stream(...) and Stream.wait_stream these were
    # 215 and 141 calls (torch 2.13); a return to them fails here.
    assert 20 < counts["gather with a completion step"] < 100
    assert 20 < counts["sequence finished at wait()"] < 100
    after = (torch.cuda.is_available(), torch.backends.cuda.is_built(),
             torch.cuda.Stream.__bases__, torch.cuda.Event.__bases__,
             torch.cuda._exchange_device, getattr(torch._C, "_cuda_getCurrentStream", None))
    assert after == before


def test_the_command_line_writes_its_json(tmp_path, capsys) -> None:
    out = tmp_path / "calls.json"
    assert cuda_host_calls.main(["--collectives", "3", "--json", str(out)]) == 0
    assert "gather with a completion step" in capsys.readouterr().out
    assert set(json.loads(out.read_text())["calls"]) == {
        "gather with a completion step", "sequence finished at wait()"}
