"""The paper-comparison script's calibration: the two V100 constants are recovered by its fit."""

import pytest

from scripts.bench import predict_paper
from zeropp.planning.step_time import CLUSTERS, DEFAULT_HOST_SECONDS_PER_OP, predict
from zeropp.simulation.trace import Collective, ComputeOp, IterationTrace, Launch, Wait

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


def test_reductions_replay_as_deepspeed_issues_them():
    # [Note: DeepSpeed's granularity in the replay]: a 25M-element fp16 reduce-scatter is
    # three 1e7-element buckets, each a third of the bytes, and each pays the ring latency.
    numel = 25 * 10**6
    scatter = Collective("reduce_scatter", tuple(range(WORLD)), 2 * numel, 2 * numel // WORLD)
    engine = trace([Launch(1, "reduce", (scatter,), "backward"), Wait(1),
                    Launch(2, "gather", (scatter,), "forward"), Wait(2)])
    as_deepspeed = predict_paper.as_deepspeed_reduces(engine, 10**7, 2)
    reduce, gather = as_deepspeed.launches("reduce"), as_deepspeed.launches("gather")
    assert [c.input_bytes for c in reduce[0].collectives] == [2 * numel // 3] * 3
    assert gather[0].collectives == (scatter,)  # gathers are untouched
    cluster = CLUSTERS["dgx2_400g"]
    extra = predict(as_deepspeed, cluster).seconds - predict(engine, cluster).seconds
    ring_latency = (WORLD - 4) * cluster.intra_node_latency + 3 * cluster.inter_node_latency
    # (and the host's 5 us issuing each of the two added collectives)
    assert extra == pytest.approx(2 * (ring_latency + DEFAULT_HOST_SECONDS_PER_OP), rel=1e-6)
    # qgZ's two hops are repeated together, bucket by bucket; its first hop carries 4 bits.
    hops = (Collective("all_to_all", tuple(range(16)), numel // 2, numel // 2),
            Collective("all_to_all", (0, 16, 32, 48), numel // 32, numel // 32))
    qgz = predict_paper.as_deepspeed_reduces(trace([Launch(1, "reduce", hops, "backward")]),
                                             10**7, 0.5)
    assert [c.group[1] for c in qgz.launches()[0].collectives] == [1, 16] * 3


def test_the_bucket_and_wire_format_come_from_the_tutorial_json():
    assert predict_paper.reduce_bucket_and_wire_bytes("18b", 4, 512, "ZeRO-3") == (10**7, 2)
    assert predict_paper.reduce_bucket_and_wire_bytes("18b", 4, 512, "ZeRO++") == (10**7, 0.5)
