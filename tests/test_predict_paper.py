"""The paper-comparison script's calibration: the two V100 constants are recovered by its fit."""

import pytest

from scripts.bench import predict_paper
from zeropp.simulation.trace import Collective, ComputeOp, IterationTrace, Launch, Wait
from zeropp.step_time import CLUSTERS, predict

WORLD = 64  # 4 DGX-2 nodes


def trace(events) -> IterationTrace:
    return IterationTrace(rank=0, world_size=WORLD, ranks_per_node=16, tokens_per_iteration=512,
                          model_flops_per_iteration=1e15, dtype_bytes=2, events=list(events))


def test_every_published_figure_is_a_setup():
    rows = predict_paper.setups()
    paper = [r for r in rows if r["name"] == "paper"]
    assert len(paper) == 16 and {r["nodes"] for r in paper} == {24}
    assert {(r["gbps"], r["tokens"]) for r in paper} == {(400, 1024), (400, 2048), (100, 1024),
                                                         (100, 2048)}
    (tutorial,) = [r for r in rows if r["name"] == "tutorial"]
    assert tutorial["published_seconds"] == {"ZeRO-3": 9.956, "ZeRO++": 3.681}
    argv = predict_paper.program_argv("18b", 24, 2048)
    assert argv[argv.index("--micro-batch-size") + 1] == "4"  # 2K tokens = 4 x 512
    assert argv[argv.index("--global-batch-size") + 1] == str(4 * 24 * 16)


def test_fit_recovers_the_constants_that_made_the_figures():
    # "ZeRO-3": communication only (depends on network_efficiency), "ZeRO++": compute only
    # (depends on gemm_fraction); the published figures are their predictions at 0.5 / 0.7.
    gather = Collective("all_gather", tuple(range(WORLD)), 10**9, WORLD * 10**9)
    traces = {("18b", 4, 512, "ZeRO-3"): trace([Launch(1, "gather", (gather,), "forward"),
                                                Wait(1)]),
              ("18b", 4, 512, "ZeRO++"): trace([ComputeOp("aten.mm.default", 1e14, 0,
                                                           "forward")])}
    cluster = predict_paper.calibrated(CLUSTERS["dgx2_100g"], 0.5, 0.7)
    seconds = {s: predict(traces[("18b", 4, 512, s)], cluster).seconds
               for s in predict_paper.SYSTEMS}
    rows = [{"name": "tutorial", "model": "18b", "nodes": 4, "tokens": 512, "gbps": 100,
             "published_seconds": seconds}]
    gemm, net, rms = predict_paper.fit(rows, traces)
    assert (gemm, net) == pytest.approx((0.5, 0.7), abs=1e-9)
    assert rms == pytest.approx(0.0, abs=1e-9)
    cells = predict_paper.cell_errors(rows, traces, 0.45, 0.8)
    # 0.8 / 0.7 of the bandwidth: 0.7 / 0.8 of the time (but for the ring's latency)
    assert cells[0]["error"] == pytest.approx(0.7 / 0.8 - 1, rel=1e-4)
    # (but for the host's 5 us issuing the GEMM)
    assert cells[1]["error"] == pytest.approx(0.5 / 0.45 - 1, rel=1e-4)
    table = predict_paper.render(cells, 0.45, 0.8)
    assert "| ZeRO-3 |" in table and f"{cells[0]['error']:+.0%}" in table
