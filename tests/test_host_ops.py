"""Host work per iteration: OpCounter (zeropp/simulation/measure.py), simulate_rank's
``count_ops`` and the bench that tabulates them (scripts/bench/host_ops.py).

Tiny GPTs (2 or 3 layers, hidden 64) as rank 0 of the bench's 4 x 16 simulated GPUs, with
``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` 0 and no persistence
threshold, so every unit is gathered and released at this size as the 18B's blocks are.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.dry_run import build_report
from megatron_lite.simulate import simulate_rank
from scripts.bench import host_ops
from zeropp.simulation import OpCounter
from zeropp.simulation.measure import dispatched_ops

NODES, GPUS = host_ops.NODES, host_ops.GPUS_PER_NODE


def tiny_argv(tmp_path, layers: int = 2) -> list[str]:
    config = json.loads(host_ops.ZEROPP_CONFIG.read_text())
    config["zero_optimization"].update(stage3_max_live_parameters=0, stage3_max_reuse_distance=0,
                                       stage3_param_persistence_threshold=0)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return host_ops.program_argv(["--num-layers", str(layers), "--hidden-size", "64",
                                  "--num-attention-heads", "4", "--seq-length", "64",
                                  "--deepspeed_config", str(path)])


def units_of(argv: list[str]) -> int:
    report = build_report(parse_args(argv + ["--dry-run", "--dry-run-nodes", str(NODES),
                                              "--dry-run-gpus-per-node", str(GPUS)]))
    return len(report.plans[0].units)


# ---- the counter ---------------------------------------------------------------------------
def test_counter_counts_each_op_once_as_dispatched():
    a, b = torch.ones(3), torch.ones(3)
    with OpCounter() as ops:
        (a + b).sum()
    assert ops.by_name() == {"aten.add.Tensor": 1, "aten.sum.default": 1}
    assert ops.total == 2
    # As dispatched: F.layer_norm arrives below autograd as the one op that runs it.
    x = torch.empty(4, 8, device="meta")
    with OpCounter() as ops:
        torch.nn.functional.layer_norm(x, (8,))
    assert ops.by_name() == {"aten.native_layer_norm.default": 1}


def test_counter_counts_only_while_enabled_and_leaves_markers_out_of_ops():
    a = torch.ones(3)
    with OpCounter() as ops:
        ops.enabled = False
        a.mul(2)
        ops.enabled = True
        with torch.autograd.profiler.record_function("a range"):
            a.mul(3)
    names = ops.by_name()
    assert names["aten.mul.Tensor"] == 1
    assert any(name.startswith("profiler.") for name in names)  # dispatched, not a kernel
    assert dispatched_ops(names) == 1


# ---- simulate_rank(count_ops=True) ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny program's argv, its unit count, and rank 0's measurement with counting on and
    off (ZeRO-3 baseline)."""
    argv = tiny_argv(tmp_path_factory.mktemp("host_ops"))
    zero3 = host_ops.engine_ds_config(argv, "zero3")
    counted = simulate_rank(argv, 0, NODES, GPUS, None, ds_config=zero3, count_ops=True)
    plain = simulate_rank(argv, 0, NODES, GPUS, None, ds_config=zero3)
    return argv, units_of(argv), counted, plain


def test_counting_changes_nothing_else(tiny):
    _, _, counted, plain = tiny
    assert plain.op_counts == {} and plain.ops_per_iteration == 0
    assert counted.host_syncs_per_iteration == plain.host_syncs_per_iteration
    assert counted.order == plain.order
    assert counted.peak_bytes == plain.peak_bytes
    assert counted.violations == plain.violations == []


def test_zero3_collectives_per_unit_and_pass(tiny):
    """One micro-batch: every unit gathered for the forward and each block again for its
    recomputation (the backward reuses that), every unit's gradients reduce-scattered once;
    two all-reduces (the gradient norm and the logged loss)."""
    argv, units, counted, _ = tiny
    blocks = 2
    assert units == 1 + blocks
    assert counted.collectives_per_iteration == {
        "all_gather_single": units + blocks, "all_reduce": 2, "reduce_scatter_single": units}


def test_engine_issues_more_than_the_model_alone_and_reports_its_syncs(tiny):
    argv, _, counted, _ = tiny
    model = host_ops.count_model_alone(argv)
    assert model.collectives == {} and model.host_syncs == {}
    assert counted.ops_per_iteration > model.ops > 0
    # The engine runs the same model: its matmuls and norms, forward, recomputed and
    # backward, are the model's, no more and no fewer.
    for name in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default",
                 "aten.native_layer_norm.default", "aten.native_layer_norm_backward.default"):
        assert counted.op_counts[name] == model.op_counts[name] > 0, name
    syncs = sum(counted.host_syncs_per_iteration.values())
    assert syncs >= 1
    # HostSyncCounter answers a read of a meta value without passing it on: the counter sees
    # those reads only because it sits above it on the mode stack.
    assert counted.op_counts["aten._local_scalar_dense.default"] >= syncs


def test_counting_and_tracing_the_same_iteration_compose(tiny):
    """Both modes enter at iteration 2 and leave at iteration 3, in reverse order; the
    counter, entered last, sees each op before the recorder does."""
    argv, _, counted, _ = tiny
    traced = simulate_rank(argv, 0, NODES, GPUS, None,
                           ds_config=host_ops.engine_ds_config(argv, "zero3"),
                           count_ops=True, trace=True)
    assert traced.trace is not None
    assert traced.op_counts == counted.op_counts


def test_zeropp_reduces_in_two_hops_per_unit(tmp_path):
    argv = tiny_argv(tmp_path, layers=3)
    units = units_of(argv)
    result = host_ops.count_engine(argv, "zeropp")
    assert result.collectives == {"all_gather_single": units + 3, "all_reduce": 2,
                                  "all_to_all_single": 2 * units}  # qgZ: intra-, then inter-node
    assert any(name.startswith("zeropp.") for name in result.op_counts)  # its kernels count


# ---- the bench -----------------------------------------------------------------------------
def test_fsdp2_gathers_each_block_twice_and_reduces_once(tmp_path):
    argv = tiny_argv(tmp_path)
    result = host_ops.count_fsdp2(argv)
    blocks = 2
    assert host_ops.by_kind(result.collectives) == {
        "all-gathers": 2 * blocks + 1,  # the root stays gathered from forward to backward
        "reduce-scatters": blocks + 1}
    assert result.host_syncs == {}  # the optimizer's step counters live on the host
    assert result.ops > dispatched_ops(host_ops.count_model_alone(argv).op_counts)
    assert "hidden 64, 4 heads" in result.shape


def test_model_alone_issues_the_same_ops_at_any_hidden_size(tmp_path):
    argv = tiny_argv(tmp_path) + ["--hidden-size", "128", "--num-attention-heads", "8"]
    assert "op for op" in host_ops.check_shape_independence(argv, [])


def test_command_line_writes_the_table_and_the_counts(tmp_path, capsys):
    argv = tiny_argv(tmp_path)
    out = tmp_path / "counts.json"
    assert host_ops.main(["--systems", "zero3,model", "--json", str(out), "--top", "3",
                          "--", *argv[argv.index("--num-layers"):]]) == 0
    table = capsys.readouterr().out
    counts = json.loads(out.read_text())["systems"]
    model, zero3 = counts["model"], counts["zero3"]
    ratio = zero3["ops"] / model["ops"]
    syncs = sum(zero3["host_syncs"].values())
    assert f"| the model alone, unsharded | {model['ops']:,} | 0 | 0 |" in table
    assert (f"| this engine, ZeRO-3 | {zero3['ops']:,} ({ratio:.2f}x) | "
            f"{sum(zero3['collectives'].values())} (5 all-gathers, 3 reduce-scatters, "
            f"2 all-reduces) | {syncs} |") in table
    assert table.index("the model alone, unsharded |") < table.index("this engine, ZeRO-3 |")
    assert "the 3 most frequent ops" in table


def test_flags_replace_the_tutorial_ones():
    argv = host_ops.program_argv(["--num-layers", "4", "--seq-length=128"])
    assert argv.count("--num-layers") == 1 and argv[argv.index("--num-layers") + 1] == "4"
    assert "--seq-length" not in argv and "--seq-length=128" in argv
    assert "--fp16" in argv and "--checkpoint-activations" in argv
    assert argv[argv.index("--deepspeed_config") + 1] == str(host_ops.ZEROPP_CONFIG)


def test_collective_kinds_of_both_backends():
    assert host_ops.by_kind({"c10d._allgather_base_.default": 3,
                             "c10d._reduce_scatter_base_.default": 2,
                             "all_gather_single": 1, "all_to_all_single": 4,
                             "all_reduce": 1}) == {
        "all-gathers": 4, "reduce-scatters": 2, "all-to-alls": 4, "all-reduces": 1}


def test_weight_deltas_config_adds_both_keys(tmp_path):
    argv = tiny_argv(tmp_path)
    zero = host_ops.engine_ds_config(argv, "deltas2")["zero_optimization"]
    assert zero["zero_quantized_weight_deltas"] is True
    assert zero["zero_quantized_weight_deltas_bits"] == 2
    assert zero["zero_hpz_partition_size"] == GPUS  # deltas need hpZ over the node
    baseline = host_ops.engine_ds_config(argv, "zero3")["zero_optimization"]
    assert baseline["zero_quantized_weights"] is False
    assert baseline["zero_hpz_partition_size"] == 1


# ---- the host's Python time (scripts/bench/host_python.py) ---------------------------------
def test_python_time_owners_follow_the_file():
    from scripts.bench import host_python

    assert host_python.owner_of("/x/zeropp/sharded_model.py") == "engine"
    assert host_python.owner_of("/x/zeropp/kernels/reference.py") == "reference kernels"
    assert host_python.owner_of("/x/torch/distributed/fsdp/_fully_shard/x.py") == \
        "torch.distributed"
    assert host_python.owner_of("/x/megatron_lite/model/gpt.py") == "model"
    assert host_python.owner_of("/x/torch/nn/modules/module.py") == "torch"
    assert host_python.owner_of("~") == "builtins"


def test_python_time_is_measured_for_fsdp2_and_the_engine_in_one_run():
    """Two layers, short sequences, one run: every figure is measured (not timing limits)."""
    from scripts.bench import host_python

    results = host_python.measure(runs=1, warmup=1, profiled=1,
                                  overrides=["--num-layers", "2", "--seq-length", "32"])
    assert [r.system for r in results] == ["fsdp2", "zero3", "zeropp"]
    for result in results:
        (run,) = result.runs
        assert run["engine"] > 0 and run["calls"] > 0 and run["model"] > 0
        # The engine figure includes torch.distributed's Python: all of FSDP2's, and what
        # this engine's collectives no longer go through ([Note: issued to the process group]).
        assert run["engine"] >= run["torch.distributed"] >= 0
    by_system = {r.system: r.runs[0] for r in results}
    assert by_system["fsdp2"]["torch.distributed"] == by_system["fsdp2"]["engine"] > 0
    # Only ZeRO++ quantizes: its CPU reference kernels are timed apart from the engine.
    assert by_system["zeropp"]["reference kernels"] > 0
    assert by_system["zero3"]["reference kernels"] == by_system["fsdp2"]["reference kernels"] == 0
    table = host_python.render(results)
    assert "| ZeRO++ |" in table and "x |" in table  # the ratio to FSDP2
