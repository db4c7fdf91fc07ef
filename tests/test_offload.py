"""ZeRO-Offload ([Note: offload] in zeropp/offload.py): the optimizer (and the weight shards)
in host memory train exactly as without offload.

On CPU/gloo host and device are one memory and the offloaded step does the same arithmetic
in the same order, so every combination below is held bit-exact against the same run without
offload, on 2 nodes x 2 and 1 node x 4 ranks: stages 1-3, qwZ, hpZ, qgZ with and without
error feedback, weight deltas, fp16 with overflow skips and bf16, gradient accumulation and
clipping. DeepSpeed #6926 (hpZ with CPU offload: loss stuck at 11.93, gradient norm 0) has
its own test against plain ZeRO-3 without offload. Checkpoints are the same files: a run
saved with offload resumes without it and the other way round, bit-exact.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

STEPS = 4
HIDDEN = 43
SCALE_POWER = 18
BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2,
          "zero_quantized_gradients": True}


def _config(zero: dict | None = None, **top) -> dict:
    config = copy.deepcopy(BASE)
    config["zero_optimization"].update(zero or {})
    config.update(top)
    return config


def _with_offload(config: dict, params: bool) -> dict:
    config = copy.deepcopy(config)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if params:
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return config


def _train(rank, world, config, per_node, steps=STEPS, dtype=torch.float32, engine_out=None):
    import zeropp

    model = toy_model(hidden=HIDDEN)
    engine, *_ = zeropp.initialize(model=model, config=config, ranks_per_node=per_node)
    micro = config.get("gradient_accumulation_steps", 1)
    per_rank = config["train_micro_batch_size_per_gpu"]
    data = toy_batches(steps, micro, per_rank * world)
    losses, norms = [], []
    for step in range(steps):
        for m in range(micro):
            tokens = data[step, m, rank * per_rank:(rank + 1) * per_rank]
            loss = toy_loss(engine(tokens), tokens)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    masters = engine.optimizer.master_flat.clone()
    moments = [m.clone() for m in engine.optimizer.moment_tensors()]
    if engine_out is not None:
        engine_out.append(engine)
    else:
        engine.close()
    return losses, norms, masters, moments, engine.skipped_steps


def offload_versus_device(rank, world, config, per_node, params):
    """The same run without offload, with the optimizer offloaded (and the weights)."""
    from zeropp.offload import HostMemory

    exact = _train(rank, world, config, per_node)
    kept: list = []
    offloaded = _train(rank, world, _with_offload(config, params), per_node, engine_out=kept)
    engine = kept.pop()
    placement = {
        "optimizer_offloaded": engine.optimizer.offloaded,
        "shards_in_host_memory": all(u.shard_in_host_memory for u in engine.sharded.units),
        "host_device": str(HostMemory(engine.device).device),
    }
    engine.close()
    return exact, offloaded, placement


def _same(exact, offloaded):
    losses, norms, masters, moments, skipped = exact
    o_losses, o_norms, o_masters, o_moments, o_skipped = offloaded
    assert o_losses == losses
    torch.testing.assert_close(torch.tensor(o_norms), torch.tensor(norms), rtol=0, atol=0,
                               equal_nan=True)  # a skipped step's norm is inf or nan
    assert torch.equal(o_masters, masters)
    assert len(o_moments) == len(moments) > 0
    assert all(torch.equal(a, b) for a, b in zip(o_moments, moments, strict=True))
    assert o_skipped == skipped


CASES = {
    "stage1": (_config({"stage": 1}), False),
    "stage2": (_config({"stage": 2}), False),
    "stage3": (_config(), False),
    "stage3_params": (_config(), True),
    "zeropp": (_config(ZEROPP), False),
    "zeropp_params": (_config(ZEROPP), True),
    "zeropp_error_feedback": (_config({**ZEROPP, "zero_quantized_gradients_error_feedback": True}),
                              True),
    "weight_deltas": (_config({"zero_hpz_partition_size": 2, "zero_quantized_weight_deltas": True}),
                      True),
    "accumulation": (_config(ZEROPP, gradient_accumulation_steps=3), True),
    # stage 1 holds whole gradients through the window and reduces at its last micro-batch
    "stage1_accumulation": (_config({"stage": 1}, gradient_accumulation_steps=3), False),
}


@pytest.mark.parametrize("shape", [(2, 2), (1, 4)], ids=["2x2", "1x4"])
@pytest.mark.parametrize("case", list(CASES))
def test_offload_trains_as_without(case, shape):
    nodes, per_node = shape
    config, params = CASES[case]
    if per_node == 4 and config["zero_optimization"].get("zero_hpz_partition_size") == 2:
        config = copy.deepcopy(config)
        config["zero_optimization"]["zero_hpz_partition_size"] = 4
    for exact, offloaded, placement in run_ranks(
            offload_versus_device, nodes * per_node, config, per_node, params):
        _same(exact, offloaded)
        assert placement == {"optimizer_offloaded": True, "shards_in_host_memory": params,
                             "host_device": "cpu"}
        assert all(loss == loss for loss in exact[0])  # trained: finite losses


def test_fp16_overflow_and_bf16_offloaded():
    """fp16 with a loss scale that overflows (steps skipped, scale halved on the host step)
    and bf16, on a tiny model (half-precision matmuls are slow on CPU)."""
    fp16 = _config(ZEROPP, fp16={"enabled": True, "initial_scale_power": SCALE_POWER,
                                 "loss_scale_window": 2, "hysteresis": 1})
    bf16 = _config(ZEROPP, bf16={"enabled": True})
    for config in (fp16, bf16):
        for exact, offloaded, _ in run_ranks(offload_versus_device, 4, config, 2, True):
            _same(exact, offloaded)
        if config is fp16:  # some steps skipped, some applied
            assert 1 <= exact[4] < STEPS, exact[4]


def hpz_offload_against_zero3(rank, world):
    """DeepSpeed #6926's setup (hpZ over the node with the optimizer on the CPU) against plain
    ZeRO-3 on the device."""
    plain = _train(rank, world, _config(), 2, steps=6)
    hpz = _with_offload(_config({"zero_hpz_partition_size": 2}), params=False)
    return plain, _train(rank, world, hpz, 2, steps=6)


def test_hpz_with_cpu_offload_trains_as_zero3():
    """The loss falls and follows ZeRO-3's to rounding (hpZ's topology sums the gradients in
    another order), with a gradient norm that is not zero: DeepSpeed's failure was a loss
    stuck at its first value."""
    for plain, hpz in run_ranks(hpz_offload_against_zero3, 4):
        assert hpz[0] == pytest.approx(plain[0], rel=1e-5)
        assert hpz[1] == pytest.approx(plain[1], rel=1e-4)
        # each rank sees new batches, so the loss is not monotone; ZeRO-3's trajectory above
        # is the reference that training happens
        assert all(norm > 0.1 for norm in hpz[1])



def staging_of_exact_gathers(rank, world):
    """Where each offloaded shard's device copy was made, and what read it: (copies made on
    the gather lane, copies made on the current stream, exact gathers on the current stream
    that read a lane's copy)."""
    import zeropp.unit

    # Live lane copies by address. A freed copy's memory is handed out again (to a copy made
    # on the current stream, say), so an address alone would name the wrong tensor.
    lane_copies: dict[int, weakref.ref] = {}
    counts = {"lane": 0, "current": 0}
    misread: list[str] = []
    stage, gather = zeropp.unit.to_device, zeropp.unit.all_gather

    def to_device(host, device, execution):
        staged = stage(host, device, execution)
        counts["lane" if execution is not None else "current"] += 1
        if execution is not None:
            lane_copies[staged.data_ptr()] = weakref.ref(staged)
        else:
            lane_copies.pop(staged.data_ptr(), None)
        return staged

    def exact_gather(output, shard, *args, **kwargs):
        # On CUDA the lane's copy is on the gather stream, which the current stream never
        # waited for: NCCL would send the buffer before the copy lands.
        copy = lane_copies.get(shard.data_ptr())
        if copy is not None and copy() is not None:
            misread.append(f"{tuple(shard.shape)}")
        return gather(output, shard, *args, **kwargs)

    zeropp.unit.to_device, zeropp.unit.all_gather = to_device, exact_gather
    try:
        config = _with_offload(_config({"stage3_param_persistence_threshold": 2000}), True)
        engines: list = []
        _train(rank, world, config, 2, steps=2, engine_out=engines)
        before = counts["current"]
        with engines[0].gathered_parameters():  # every released unit gathered exactly
            pass
        counts["regathered"] = counts["current"] - before
        engines[0].close()
    finally:
        zeropp.unit.to_device, zeropp.unit.all_gather = stage, gather
    return counts, misread


def test_exact_gathers_on_the_current_stream_read_copies_made_there():
    """An offloaded shard is brought to the device on the gather lane for the unit's own
    gather (issued there), but on the current stream for the exact gathers issued on it (the
    persistent units' joint gather after each step, a unit's exact re-gather)."""
    for counts, misread in run_ranks(staging_of_exact_gathers, 2):
        assert counts["lane"] > 0 and counts["current"] > 0 and counts["regathered"] > 0, counts
        assert misread == []


def save_and_resume(rank, world, tmp, save_offloaded, load_offloaded):
    import zeropp

    config = _config(ZEROPP)
    save_config = _with_offload(config, True) if save_offloaded else config
    load_config = _with_offload(config, True) if load_offloaded else config
    whole = _train(rank, world, config, 2, steps=4)

    engine, *_ = zeropp.initialize(model=toy_model(hidden=HIDDEN), config=save_config,
                                   ranks_per_node=2)
    data = toy_batches(4, 1, 2 * world)
    for step in range(2):
        tokens = data[step, 0, rank * 2:(rank + 1) * 2]
        engine.backward(toy_loss(engine(tokens), tokens))
        engine.step()
    engine.save_checkpoint(tmp, tag="half")
    engine.close()

    engine, *_ = zeropp.initialize(model=toy_model(seed=7, hidden=HIDDEN), config=load_config,
                                   ranks_per_node=2)
    engine.load_checkpoint(tmp, tag="half")
    losses = []
    for step in range(2, 4):
        tokens = data[step, 0, rank * 2:(rank + 1) * 2]
        loss = toy_loss(engine(tokens), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    masters = engine.optimizer.master_flat.clone()
    engine.close()
    return whole[0][2:], losses, whole[2], masters


@pytest.mark.parametrize("save_offloaded,load_offloaded", [(True, False), (False, True)],
                         ids=["offloaded-to-device", "device-to-offloaded"])
def test_checkpoints_cross_offload(tmp_path, save_offloaded, load_offloaded):
    for whole, resumed, masters, resumed_masters in run_ranks(
            save_and_resume, 4, str(tmp_path), save_offloaded, load_offloaded):
        assert resumed == whole
        assert torch.equal(resumed_masters, masters)


def test_offload_config_errors():
    from zeropp.config import ConfigError, EngineConfig

    def parse(zero):
        return EngineConfig.from_json({"train_micro_batch_size_per_gpu": 1,
                                       "zero_optimization": zero})

    with pytest.raises(ConfigError, match=r'offload_optimizer.device="nvme" is not supported.*'
                                          r'supported: "none", "cpu"'):
        parse({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}})
    with pytest.raises(ConfigError, match=r'offload_param.device="nvme"'):
        parse({"stage": 3, "offload_param": {"device": "nvme"}})
    # Below stage 3 DeepSpeed accepts offload_param and leaves it without effect, as here.
    ignored = parse({"stage": 2, "offload_param": {"device": "cpu"}}).zero_optimization
    assert ignored.ignored_offload_param and not ignored.offloads_params
    with pytest.raises(ConfigError, match="needs ZeRO stage 1, 2 or 3"):
        parse({"stage": 0, "offload_optimizer": {"device": "cpu"}})
    with pytest.raises(ConfigError, match="offload_optimizer.device"):
        parse({"stage": 3, "offload_optimizer": {"device": "gpu"}})
    zero = parse({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                   "buffer_count": 4, "ratio": 1.0},
                  "offload_param": None}).zero_optimization
    assert zero.offloads_optimizer and not zero.offloads_params
    from zeropp.offload import OffloadOptions

    assert OffloadOptions.from_zero_config(zero) == OffloadOptions(optimizer=True, pin_memory=True)


# ---- the plan, the simulated GPU cluster and the step-time model ---------------------------

SMALL_GPT = ("--num-layers 3 --hidden-size 256 --num-attention-heads 4 --seq-length 64 "
             "--batch-size 2 --fp16 --checkpoint-activations --dry-run "
             "--dry-run-nodes 2 --dry-run-gpus-per-node 4 --deepspeed_config {config}")


def _offload_config(tmp_path, params: bool) -> str:
    """configs/ds_zeropp_offload.json with hpZ over the 4 GPUs of a node (the file's 16 is
    DGX-2's)."""
    import json
    from pathlib import Path

    config = json.loads((Path(__file__).resolve().parents[1] / "configs"
                         / "ds_zeropp_offload.json").read_text())
    config["zero_optimization"]["zero_hpz_partition_size"] = 4
    if not params:
        config["zero_optimization"].pop("offload_param")
    path = tmp_path / f"offload_{params}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("params", [False, True], ids=["optimizer", "optimizer+params"])
def test_plan_and_simulated_gpu_cluster_agree_on_device_host_and_pcie(tmp_path, params):
    """The dry run's plan against rank 0 run on the simulated GPU cluster (meta tensors):
    the device peak, the host memory and the bytes each PCIe direction carries; the offloaded
    states leave the device's peak; the trace marks the host step and the copies."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.dry_run import build_report, simulate_plans

    argv = SMALL_GPT.format(config=_offload_config(tmp_path, params)).split()
    report = build_report(parse_args(argv))
    zero3, zeropp = report.plans
    measurements = simulate_plans(argv, report)
    for plan, measured in zip(report.plans, measurements, strict=True):
        memory = plan.memory
        assert memory.offload_optimizer and memory.offload_params == params
        offloaded = (memory.gradient_shards + memory.fp32_master_shards
                     + memory.optimizer_moments + (memory.working_shards if params else 0))
        assert memory.host_model_states == offloaded
        assert memory.device_model_states == memory.model_states - offloaded
        # (and the norm's 4-byte sum)
        assert measured.host_peak_bytes == pytest.approx(memory.host_bytes, abs=64), plan.name
        # what stays on the device of the model states (the working shards, or nothing)
        on_device = measured.peak_by_category.get("model states", 0)
        assert on_device == pytest.approx(memory.device_model_states, abs=64), plan.name
        ops = [e for e in measured.trace.events if hasattr(e, "where")]
        ops += [op for e in measured.trace.events for op in getattr(e, "compute_ops", ())]
        crossed = {way: sum(op.bytes for op in ops if op.where == way)
                   for way in ("to_host", "to_device")}
        # (and the norm's sum, 4 bytes, to the device for its all-reduce)
        assert crossed == pytest.approx(plan.pcie, abs=64), plan.name
        assert sum(op.bytes for op in ops if op.where == "host") > 5 * memory.fp32_master_shards
        assert not any(op.where == "host" and op.phase != "optimizer" for op in ops)
    # the same run without offload holds the states on the device
    without = dataclasses.replace(zeropp.memory, offload_optimizer=False, offload_params=False)
    assert report.total_bytes(zeropp) == pytest.approx(
        report.total_bytes(dataclasses.replace(zeropp, memory=without))
        - zeropp.memory.host_model_states)


def test_pcie_plan_formulas():
    """Optimizer offload: gradients to the host once per micro-batch in the shard's dtype,
    16-bit weights back once per step; parameter offload: each world gather's shard to the
    device instead (hpZ's backward reads its secondary shard on the device)."""
    from zeropp.config import ZeroConfig
    from zeropp.planning.planner import ClusterShape, plan_system

    counts = [50_000, 40_000, 40_000, 8_000]  # root, two blocks, a small persistent unit

    def pcie(micro, **zero):
        block = {"stage": 3, "stage3_param_persistence_threshold": 10_000,
                 "stage3_max_reuse_distance": 0,
                 "offload_optimizer": {"device": "cpu"}, **zero}
        plan = plan_system("x", counts, ClusterShape(8, 4), ZeroConfig.from_mapping(block), 2,
                           micro)
        return plan.pcie, [u.shard_numel for u in plan.units]

    got, shards = pcie(1)
    assert got == {"to_host": 2 * sum(shards), "to_device": 2 * sum(shards)}
    got, shards = pcie(3)  # fp32 gradient shards with accumulation
    assert got == {"to_host": 3 * 4 * sum(shards), "to_device": 2 * sum(shards)}
    got, shards = pcie(2, offload_param={"device": "cpu"})
    root, blocks, persistent = shards[0], shards[1] + shards[2], shards[3]
    assert got["to_device"] == 2 * (2 * root + 2 * 2 * blocks + persistent)
    got, shards = pcie(2, offload_param={"device": "cpu"}, zero_hpz_partition_size=4)
    root, blocks, persistent = shards[0], shards[1] + shards[2], shards[3]  # hpZ's padding
    assert got["to_device"] == 2 * (2 * root + 2 * blocks + persistent)


def test_step_time_times_the_host_step_and_the_bus():
    from zeropp.planning.step_time import CLUSTERS, predict
    from zeropp.simulation.trace import ComputeOp, HostSync, IterationTrace

    cluster = CLUSTERS["dgx2_100g"]
    trace = IterationTrace(rank=0, world_size=16, ranks_per_node=16, tokens_per_iteration=1,
                           model_flops_per_iteration=1.0, dtype_bytes=2, events=[
                               ComputeOp("aten.mm.default", 1e12, 0, "backward"),
                               ComputeOp("aten.add_.Tensor", 0, 10**9, "backward", "to_host"),
                               HostSync(),
                               ComputeOp("aten._foreach_mul_.Scalar", 0, 10**10, "optimizer",
                                         "host"),
                               ComputeOp("aten.copy_.default", 0, 10**9, "optimizer",
                                         "to_device")])
    p = predict(trace, cluster)
    share = cluster.host_memory_bandwidth / 16 * cluster.memory_fraction
    assert cluster.host_memory_bandwidth == 12 * 2666e6 * 8  # two sockets of 6 DDR4-2666
    assert p.host_step_seconds == pytest.approx(1e10 / share)
    assert p.pcie_seconds == pytest.approx({"to_host": 1e9 / cluster.pcie_bandwidth,
                                            "to_device": 1e9 / cluster.pcie_bandwidth})
    gemm = 1e12 / (cluster.peak_flops * cluster.gemm_fraction)
    # in sequence: the GEMM, the gradients to the host, the host step, the weights back
    assert p.seconds == pytest.approx(gemm + 2e9 / cluster.pcie_bandwidth + 1e10 / share,
                                      rel=1e-3)
    # without host figures (a CPU rank) the same ops are kernels on the compute stream
    cpu_like = dataclasses.replace(cluster, host_memory_bandwidth=None, pcie_bandwidth=None)
    q = predict(trace, cpu_like)
    assert q.host_step_seconds == 0 and q.pcie_seconds == {}
    assert q.compute_busy_seconds > p.compute_busy_seconds


def test_a_gpu_jobs_offloaded_step_is_torchs_fused_cpu_adamw():
    """The CPU AdamW bench (scripts/bench/cpu_adam.py) measured torch's fused CPU AdamW 5.8x
    faster than foreach and on a par with DeepSpeed's CPU Adam; a CPU job keeps foreach, so
    its offloaded run stays exact."""
    from zeropp.optimizer import _multi_tensor_settings

    cpu = torch.device("cpu")
    assert _multi_tensor_settings(torch.optim.AdamW, {}, cpu, offloaded_from_gpu=True) == \
        {"fused": True}
    assert _multi_tensor_settings(torch.optim.AdamW, {}, cpu) == {"foreach": True}
    assert _multi_tensor_settings(torch.optim.SGD, {}, cpu, offloaded_from_gpu=True) == \
        {"foreach": True}  # no fused SGD: the multi-tensor update
    assert _multi_tensor_settings(torch.optim.AdamW, {"foreach": False}, cpu,
                                  offloaded_from_gpu=True) == {}  # the user's choice stands

