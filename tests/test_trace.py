"""The iteration trace of a simulated rank (zeropp.simulation.tracing, megatron_lite.simulate).

Small GPTs (2 layers x hidden 256) as rank 0 of 2 nodes x 2 GPUs; ``stage3_max_live_parameters``
and ``stage3_max_reuse_distance`` 0 and no persistence threshold, so the backward gathers
(hpZ's, under ZeRO++) happen at this size.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from megatron_lite.simulate import simulate_rank
from zeropp.comm.accounting import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    reduce_scatter_bytes,
)
from zeropp.simulation.trace import (
    ComputeOp,
    HostSync,
    IterationTrace,
    Launch,
    Wait,
    launches_kernel,
)

NODES, GPUS = 2, 2
SMALL = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
         "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8 --lr 1e-4 "
         "--fp16").split()
ZERO3 = dict(zero_quantized_weights=False, zero_hpz_partition_size=1,
             zero_quantized_gradients=False)
ZEROPP = dict(zero_hpz_partition_size=GPUS)


def _ds_config(tmp_path, name: str, **zero) -> str:
    with open("configs/ds_zeropp_config.json") as f:
        config = json.load(f)
    config["zero_optimization"].update(stage3_max_live_parameters=0, stage3_max_reuse_distance=0,
                                       stage3_param_persistence_threshold=0, **zero)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (argv, RankMeasurement)} for ZeRO-3 with and without activation checkpointing
    and ZeRO++ (qwZ, hpZ, qgZ) with it."""
    tmp = tmp_path_factory.mktemp("trace")
    cases = {
        "zero3": SMALL + ["--deepspeed_config", _ds_config(tmp, "zero3", **ZERO3)],
        "zero3-ckpt": SMALL + ["--checkpoint-activations",
                               "--deepspeed_config", _ds_config(tmp, "zero3", **ZERO3)],
        "zeropp-ckpt": SMALL + ["--checkpoint-activations",
                                "--deepspeed_config", _ds_config(tmp, "zeropp", **ZEROPP)],
    }
    return {name: (argv, simulate_rank(argv, 0, NODES, GPUS, None, trace=True))
            for name, argv in cases.items()}


def _flops(trace: IterationTrace, *phases: str) -> float:
    return sum(op.flops for op in trace.compute_ops() if op.phase in phases)


LAYERS, HIDDEN, SEQ = 2, 256, 128


def _lm_head_flops_per_pass(trace: IterationTrace) -> float:
    """2*V*h per token: the LM head's GEMM in one forward pass. V (the padded vocabulary) is
    read back from Megatron's formula for these GPT-2 shapes (ffn = 4h, not checkpointed):
    3 * (L * (24h^2 + 4sh) + 1.5Vh) per token."""
    per_pass = trace.model_flops_per_iteration / trace.tokens_per_iteration / 3
    vocab = (per_pass - LAYERS * (24 * HIDDEN**2 + 4 * SEQ * HIDDEN)) / (1.5 * HIDDEN)
    assert vocab == int(vocab) and vocab % 128 == 0
    return 2.0 * vocab * HIDDEN


def test_header(runs):
    trace = runs["zero3"][1].trace
    assert (trace.rank, trace.world_size, trace.ranks_per_node) == (0, NODES * GPUS, GPUS)
    assert trace.tokens_per_iteration == 8 * 128 // (NODES * GPUS)  # global batch x seq / DP
    assert trace.dtype_bytes == 2  # fp16
    assert {type(e) for e in trace.events} == {ComputeOp, Launch, Wait, HostSync}
    # The host reads once: the log line's values (logged every iteration here); the step's
    # norm, clip and overflow skip stay on the device ([Note: step outcome on the device]).
    assert sum(isinstance(e, HostSync) for e in trace.events) == 1


def test_flops_match_megatrons_formula(runs):
    """With activation checkpointing Megatron's formula is exact for this model (4 passes:
    the LM head's 6Vh is counted exactly, attention over the full s x s square as torch's
    counter counts the score and context GEMMs): within 1%. Without it the formula keeps
    1.5Vh per pass (4.5Vh for 6Vh), a documented undercount: the trace must exceed it by
    exactly 1.5Vh per token. The loss, softmax, norms and element-wise ops count 0 FLOPs
    in torch's counter (no formula), so they add nothing."""
    for name in ("zero3-ckpt", "zeropp-ckpt"):
        trace = runs[name][1].trace
        assert _flops(trace, "forward", "backward") == pytest.approx(
            trace.model_flops_per_iteration, rel=0.01)
        assert _flops(trace, "optimizer") == 0  # Adam's element-wise ops have no formula
    trace = runs["zero3"][1].trace
    undercount = 0.75 * _lm_head_flops_per_pass(trace) * trace.tokens_per_iteration
    assert _flops(trace, "forward", "backward") == pytest.approx(
        trace.model_flops_per_iteration + undercount, rel=0.01)
    # backward = twice forward
    assert _flops(trace, "backward") == pytest.approx(2 * _flops(trace, "forward"), rel=0.01)


def test_checkpointing_counts_the_forward_twice(runs):
    plain = runs["zero3"][1].trace
    ckpt = runs["zero3-ckpt"][1].trace
    tokens = plain.tokens_per_iteration
    assert _flops(ckpt, "forward") == _flops(plain, "forward")
    # The recompute (of the transformer layers, not of the LM head) runs inside backward.
    lm_head = _lm_head_flops_per_pass(plain) * tokens
    recomputed = _flops(plain, "forward") - lm_head
    assert _flops(ckpt, "backward") == pytest.approx(_flops(plain, "backward") + recomputed,
                                                     rel=1e-6)
    # The layers' part: 4 passes instead of 3.
    layers_ckpt = _flops(ckpt, "forward", "backward") - 3 * lm_head
    layers_plain = _flops(plain, "forward", "backward") - 3 * lm_head
    assert layers_ckpt / layers_plain == pytest.approx(4 / 3, rel=0.01)


_SENT = {"all_gather": all_gather_bytes, "reduce_scatter": reduce_scatter_bytes,
         "all_to_all": all_to_all_bytes, "all_reduce": all_reduce_bytes}


def _spans_nodes(group) -> bool:
    return len({rank // GPUS for rank in group}) > 1


def _accounted(trace: IterationTrace) -> dict[str, dict[str, int]]:
    """The trace's collectives under the engine's accounting convention and phases. The last
    compute-lane launch is the logged loss's all-reduce, which the engine does not account
    (the trainer issues it)."""
    launches = trace.launches()
    logging = [e for e in launches if e.lane == "compute"][-1]
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for launch in launches:
        if launch is logging:
            continue
        phase = {"gather": f"{launch.phase}_all_gather", "reduce": "gradient_reduce",
                 "compute": "optimizer"}[launch.lane]
        for c in launch.collectives:
            where = "inter_node" if _spans_nodes(c.group) else "intra_node"
            out[phase][where] += _SENT[c.name](c.input_bytes, len(c.group))
    return {phase: {k: v for k, v in d.items() if v} for phase, d in out.items()}


@pytest.mark.parametrize("name", ["zero3-ckpt", "zeropp-ckpt"])
def test_collective_bytes_equal_the_engines_accounting(runs, name):
    measured = runs[name][1]
    assert _accounted(measured.trace) == measured.trace_comm_bytes
    assert set(measured.trace_comm_bytes) >= {"forward_all_gather", "backward_all_gather",
                                               "gradient_reduce", "optimizer"}


def _kernels(ops) -> list[str]:
    return [op.name for op in ops if launches_kernel(op)]


def test_zeropp_collectives(runs):
    trace = runs["zeropp-ckpt"][1].trace
    gathers = trace.launches("gather")
    forward = [e for e in gathers if e.phase == "forward"]
    backward = [e for e in gathers if e.phase == "backward"]
    assert forward and backward
    for launch in forward:  # qwZ: an int8 payload (with its scales) over the world,
        (c,) = launch.collectives  # quantized on the gather lane, dequantized on its
        assert c.group == tuple(range(NODES * GPUS)) and c.output_bytes == 4 * c.input_bytes
        assert launch.compute_ops and all(op.phase == "forward" for op in launch.compute_ops)
        assert "zeropp.quantize_blockwise.default" in {op.name for op in launch.compute_ops}
        # completion stream, where the next gather does not wait for it (after hpZ's copy
        # of its secondary shard out of the payloads, where one is kept)
        assert _kernels(launch.completion_ops) in (
            ["zeropp.dequantize_blockwise_many.default"],
            ["aten.clone.default", "zeropp.dequantize_blockwise_many.default"])
    for launch in backward:  # hpZ: the int8 secondary shards, inside the node only,
        # dequantized the same way
        assert _kernels(launch.completion_ops) == ["zeropp.dequantize_blockwise_many.default"]
        assert all(not _spans_nodes(c.group) and len(c.group) == GPUS
                   for c in launch.collectives)
    reductions = trace.launches("reduce")
    for launch in reductions:  # qgZ: two all-to-alls in one sequence launch
        intra, inter = launch.collectives
        assert (intra.name, inter.name) == ("all_to_all", "all_to_all")
        assert not _spans_nodes(intra.group) and _spans_nodes(inter.group)
        # the inter-node hop is left in flight: the lane goes on to the next reduction
        assert launch.in_flight == 1
        names = {op.name for op in launch.compute_ops}  # swizzle, quantize, requantize
        assert {"zeropp.quantize_blockwise.default",
                "zeropp.dequantize_reduce_quantize.default"} <= names
        assert "zeropp.dequantize_reduce.default" not in names
    assert not any(launch.in_flight for launch in gathers)
    # The last hop is received at the reduction's wait, on the compute stream: one sum
    # right after each Wait for a reduction, and no other quantization kernel there.
    reduce_ids = {launch.id for launch in reductions}
    after_waits = [(event, trace.events[i + 1]) for i, event in enumerate(trace.events)
                   if isinstance(event, Wait) and event.launch_id in reduce_ids]
    assert len(after_waits) == len(reductions)
    assert all(op.name == "zeropp.dequantize_reduce.default" for _, op in after_waits)
    assert [op.name for op in trace.compute_ops() if op.name.startswith("zeropp")] == \
        ["zeropp.dequantize_reduce.default"] * len(reductions)


@pytest.mark.parametrize("name", ["zero3", "zero3-ckpt", "zeropp-ckpt"])
def test_every_side_launch_is_waited_once(runs, name):
    trace = runs[name][1].trace
    seen: set[int] = set()
    waits: Counter[int] = Counter()
    lanes = {}
    for event in trace.events:
        if isinstance(event, Launch):
            assert event.id not in seen
            seen.add(event.id)
            lanes[event.id] = event.lane
            assert event.collectives
        elif isinstance(event, Wait):
            assert event.launch_id in seen  # waits for an earlier launch
            waits[event.launch_id] += 1
    assert {i for i, lane in lanes.items() if lane != "compute"} == set(waits)
    assert set(waits.values()) == {1}
    compute = trace.launches("compute")
    assert [c.name for e in compute for c in e.collectives] == ["all_reduce", "all_reduce"]
    assert all(not e.compute_ops for e in compute)


def test_views_cost_no_bytes(runs):
    ops = runs["zero3"][1].trace.compute_ops()
    by_name = defaultdict(set)
    for op in ops:
        by_name[op.name].add(op.bytes)
    for view in ("aten.view.default", "aten.t.default", "aten.expand.default",
                 "aten.slice.Tensor", "aten.detach.default", "aten.transpose.int"):
        assert by_name.get(view, {0}) == {0}, view
    assert min(by_name["aten.mm.default"]) > 0


def test_json_round_trip(runs, tmp_path):
    trace = runs["zeropp-ckpt"][1].trace
    assert IterationTrace.from_json(trace.to_json()) == trace
    path = tmp_path / "trace.json"
    trace.to_json(str(path))
    assert IterationTrace.load(str(path)) == trace
    assert {e["type"] for e in json.loads(path.read_text())["events"]} == {
        "compute", "launch", "wait", "sync"}


def test_quantization_kernels_are_one_op_with_the_triton_kernels_traffic():
    # On meta the kernels compute nothing, but each is one dispatcher op whose bytes are what
    # the GPU kernel reads plus what it writes: values in, payload out, and back.
    import torch

    from zeropp import kernels
    from zeropp.simulation.tracing import TraceRecorder

    numel, block = 1000, 256  # not a whole number of blocks: 4 scales
    x = torch.empty(numel, dtype=torch.float16, device="meta")
    payload_bytes = kernels.quantized_nbytes(numel, 8, block)
    assert payload_bytes == 4 * block + 4 * 4  # codes padded to whole blocks, fp32 scales
    with TraceRecorder() as recorder:
        payload = kernels.quantize_blockwise(x, 8, block)
        values = kernels.dequantize_blockwise(payload, numel, 8, block, torch.float16)
        out = torch.empty(numel, dtype=torch.float32, device="meta")
        kernels.dequantize_blockwise(payload, numel, 8, block, torch.float32, out=out)
        many = kernels.dequantize_blockwise_many(payload.expand(3, -1), numel, 8, block,
                                                 torch.float16)
    assert payload.shape == (payload_bytes,) and values.shape == (numel,)
    assert many.shape == (3, numel)
    ops = [(op.name, op.bytes, op.flops) for op in recorder.events if op.bytes]
    assert ops == [
        ("zeropp.quantize_blockwise.default", 2 * numel + payload_bytes, 0),
        ("zeropp.dequantize_blockwise.default", payload_bytes + 2 * numel, 0),
        ("zeropp.dequantize_blockwise_into.default", payload_bytes + 4 * numel, 0),
        ("zeropp.dequantize_blockwise_many.default", 3 * payload_bytes + 3 * 2 * numel, 0),
    ]
