"""The iteration graph ([Note: iteration graphs] in zeropp/acceleration/cuda_graph.py) without a
GPU.

A CUDA graph cannot run here, so its two effects are stood in for: a capture that runs the
iteration once (as the engine's Python runs once during a real capture) and a replay that
reruns the captured function on the static inputs, writing into the static outputs, with
every host-side record put back as it was (a real replay runs no Python). What the tests
check is the graph's bookkeeping: inputs copied into the static ones, outputs copied out,
step counts and byte counters advanced by the capture's amount, and the trained weights,
losses and records equal to eager training (2 ranks, gloo, the device-decided step of
torch's fused AdamW). And where capture cannot work, the engine says why in one line and
trains eagerly.
"""

from __future__ import annotations

import contextlib
import copy
import itertools

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model

LR = 3e-3


def _engine(overlap: bool = True):
    import zeropp

    model = toy_model(checkpoint=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.05,
              "zero_optimization": {"stage": 3, "overlap_comm": overlap}}
    engine, _, _, _ = zeropp.initialize(model, optimizer=optimizer, config=config)
    return engine


class RerunGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: ``replay`` reruns the captured iteration
    with the host's records restored afterwards. The first replay, right after the capture,
    does nothing: the stand-in capture already ran the iteration."""

    def __init__(self) -> None:
        self.owner = None  # the IterationGraph, set once it exists
        self._first = True

    def replay(self) -> None:
        if self._first:
            self._first = False
            return
        owner = self.owner
        engine = owner.engine
        records = (engine.micro_steps, engine.global_steps,
                   copy.deepcopy(engine.comm_stats.snapshot()))
        outputs = owner.fn(*owner._static_inputs)
        for static, fresh in zip(owner._static_outputs, outputs, strict=True):
            static.copy_(fresh)
        engine.micro_steps, engine.global_steps = records[0], records[1]
        engine.comm_stats.reset()
        for phase, sent in records[2].items():
            for where, nbytes in sent.items():
                engine.comm_stats.record(phase, where == "inter_node", nbytes)


def _iteration(engine):
    def run(*micro_batches):
        losses = []
        for tokens in micro_batches:
            loss = toy_loss(engine(tokens), tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        return torch.stack(losses).mean(), engine.step_applied_flag()
    return run


def graphed_against_eager(rank, world):
    from zeropp.acceleration.cuda_graph import CudaGraphOptions, IterationGraph

    data = toy_batches(6, 2, 3 * world)[:, :, rank * 3:(rank + 1) * 3]
    eager, graphed = _engine(), _engine()
    stand_in = RerunGraph()
    runner = IterationGraph(graphed, _iteration(graphed), CudaGraphOptions(True, 2),
                            graph_factory=lambda: stand_in,
                            capture=lambda graph: contextlib.nullcontext())
    stand_in.owner = runner
    eager_run = _iteration(eager)
    out = {"eager": [], "graphed": []}
    eager.comm_bytes(reset=True)
    graphed.comm_bytes(reset=True)
    for step in data:
        out["eager"].append(float(eager_run(*step)[0]))
        loss, applied = runner(*step)
        out["graphed"].append(float(loss))
        assert bool(applied)
    out["captured"], out["replays"] = runner.captured, runner.replays
    out["steps"] = (eager.global_steps, graphed.global_steps)
    out["micro_steps"] = (eager.micro_steps, graphed.micro_steps)
    out["bytes"] = (eager.comm_bytes(), graphed.comm_bytes())
    a, b = eager.full_state_dict(), graphed.full_state_dict()
    out["largest_difference"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    out["lr_is_tensor"] = isinstance(graphed.optimizer.inner.param_groups[0]["lr"], torch.Tensor)
    eager.close()
    graphed.close()
    return out


def test_a_replayed_iteration_trains_and_counts_as_an_eager_one():
    for out in run_ranks(graphed_against_eager, 2):
        assert out["captured"] and out["replays"] == 6 - 2  # 2 eager, then capture + 3 replays
        assert out["graphed"] == out["eager"]
        assert len(set(out["graphed"])) == len(out["graphed"])  # outputs copied, not aliased
        assert out["largest_difference"] == 0.0
        assert out["steps"] == (6, 6) and out["micro_steps"] == (12, 12)
        assert out["bytes"][0] == out["bytes"][1]
        assert out["lr_is_tensor"]


def blockers_on_cpu(rank, world):
    from zeropp.acceleration.cuda_graph import IterationGraph, capture_blockers

    engine = _engine()
    lines = []
    runner = IterationGraph(engine, _iteration(engine), log=lines.append)
    data = toy_batches(2, 2, 3)
    losses = [float(runner(*step)[0]) for step in data]
    engine.close()
    return {"blockers": capture_blockers(engine), "lines": lines, "losses": losses,
            "captured": runner.captured}


def test_on_the_cpu_the_engine_says_why_and_trains_eagerly():
    (out,) = run_ranks(blockers_on_cpu, 1)
    assert out["blockers"] == ["the engine runs on cpu, not CUDA"]
    assert out["lines"] == ["cuda_graph: running eagerly, the iteration cannot be captured: "
                            "the engine runs on cpu, not CUDA"]
    assert not out["captured"] and all(loss > 0 for loss in out["losses"])


def test_changed_input_shapes_after_the_capture_are_refused_in_one_line():
    from zeropp.acceleration.cuda_graph import _check_same_inputs

    with pytest.raises(ValueError, match=r"changed shape or dtype after the capture"):
        _check_same_inputs((torch.zeros(2, 5),), (torch.zeros(3, 5),))
    _check_same_inputs((torch.zeros(2, 5),), (torch.ones(2, 5),))


def test_the_cuda_graph_block_and_its_flags():
    from megatron_lite.arguments import ArgumentError, parse_args, validate_args
    from megatron_lite.ds_config import engine_config, reconcile_with_ds_config
    from zeropp.acceleration.cuda_graph import CudaGraphOptions
    from zeropp.config import ConfigError, EngineConfig

    assert EngineConfig.from_json({"cuda_graph": {"enabled": True}}).cuda_graph.enabled
    assert EngineConfig().cuda_graph.enabled is False
    with pytest.raises(ConfigError, match="cuda_graph.enabled"):
        EngineConfig.from_json({"cuda_graph": {"enabled": "yes"}})
    with pytest.raises(ConfigError, match="cuda_graph.warmup_iterations"):
        EngineConfig.from_json({"cuda_graph": {"warmup_iterations": 0}})
    with pytest.raises(ConfigError, match="cuda_graph.capture_scope"):
        EngineConfig.from_json({"cuda_graph": {"capture_scope": "full"}})
    with pytest.raises(ValueError, match="warmup_iterations must be at least 1"):
        CudaGraphOptions(True, 0)

    shape = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3"]
    args = validate_args(parse_args([*shape, "--cuda-graph", "--cuda-graph-warmup-steps", "5"]), 1)
    config = engine_config(args, EngineConfig())
    assert config.cuda_graph.enabled and config.cuda_graph.warmup_iterations == 5
    with pytest.raises(ArgumentError, match="cuda-graph-warmup-steps"):
        validate_args(parse_args([*shape, "--cuda-graph-warmup-steps", "0"]), 1)
    # The JSON's block switches it on for the Megatron command line too, and a flag that
    # disagrees with it is an error naming both.
    args = validate_args(parse_args(shape), 1)
    from_file = EngineConfig.from_json({"cuda_graph": {"enabled": True}})
    reconcile_with_ds_config(args, from_file)
    assert engine_config(args, from_file).cuda_graph.enabled


def test_the_device_schedule_writes_a_held_lr_tensor_in_place():
    """A captured step reads the lr tensor it was captured with: the schedule must write the
    next lr into that tensor, not bind a new one."""
    from zeropp.acceleration.cuda_graph import hold_lr
    from zeropp.deepspeed_api.lr_schedules import AnnealingLR

    held = torch.tensor(0.0, dtype=torch.float64)
    hold_lr(held)  # as the capture's preparation marks it
    groups = [{"lr": held}]

    class Optimizer:
        param_groups = groups

    schedule = AnnealingLR(Optimizer(), 3e-4, 3e-5, warmup_iters=3, decay_iters=11,
                           decay_style="cosine")
    for count in (1, 5, 12):
        schedule.step_on_device(torch.tensor(count))
        assert groups[0]["lr"] is held
        assert float(held) == schedule.get_lr(count)
    # The host's step (at a log line or a checkpoint, with the count read back) writes into
    # it too: a replaced tensor would leave the graph reading freed memory.
    for count in (6, 13):
        schedule.step(count)
        assert groups[0]["lr"] is held and float(held) == schedule.get_lr(count)


def test_every_schedule_and_a_checkpoint_load_keep_a_held_lr_tensor():
    """Every writer of a group's lr goes through set_group_lr: DeepSpeed's schedules (their
    own steps and set-up) and a checkpoint's load. A held tensor is written in place; one
    not held (a device schedule's own, outside a graph) becomes a float again, as torch's
    foreach optimizers need."""
    from zeropp.acceleration.cuda_graph import hold_lr, set_group_lr
    from zeropp.deepspeed_api.lr_schedules import OneCycle, WarmupLR, WarmupSchedule

    def optimizer(lr):
        built = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
        built.param_groups[0]["lr"] = lr
        return built

    schedules = (lambda o: WarmupLR(o, warmup_max_lr=1e-3, warmup_num_steps=4),
                 lambda o: OneCycle(o, cycle_min_lr=1e-4, cycle_max_lr=1e-3,
                                    cycle_first_step_size=3))
    schedules += (lambda o: WarmupSchedule(o, "WarmupCosineLR", {
        "warmup_num_steps": 2, "total_num_steps": 10, "warmup_min_ratio": 0.0,
        "cos_min_ratio": 0.1, "warmup_type": "linear"}),)
    for make in schedules:  # the same schedule over a held tensor and over a float
        held = torch.tensor(1e-3, dtype=torch.float64)
        hold_lr(held)
        with_tensor, with_float = optimizer(held), optimizer(1e-3)
        on_tensor, on_float = make(with_tensor), make(with_float)
        for _ in range(2):
            on_tensor.step()
            on_float.step()
        assert with_tensor.param_groups[0]["lr"] is held
        assert float(held) == pytest.approx(with_float.param_groups[0]["lr"], rel=1e-12)
        assert float(held) > 0  # (WarmupCosineLR once took its base lr by reference: 0)
    optimizer = with_tensor
    set_group_lr(optimizer.param_groups[0], 5e-4)
    assert optimizer.param_groups[0]["lr"] is held and float(held) == 5e-4
    group = {"lr": 1e-3}
    set_group_lr(group, 2e-3)  # a float stays a float
    assert group["lr"] == 2e-3
    group = {"lr": torch.tensor(1e-3)}  # a tensor no graph reads: replaced
    set_group_lr(group, 2e-3)
    assert group["lr"] == 2e-3 and not isinstance(group["lr"], torch.Tensor)


class _Capturing:
    """A stand-in capture context that says whether a capture is under way."""

    def __init__(self) -> None:
        self.active = False

    @contextlib.contextmanager
    def __call__(self, graph):
        self.active = True
        try:
            yield
        finally:
            self.active = False


def graph_with_a_save_in_flight(rank, world):
    from zeropp.acceleration.cuda_graph import CudaGraphOptions, IterationGraph

    engine = _engine()
    events = []
    capturing = _Capturing()
    stand_in = RerunGraph()
    original_replay = stand_in.replay

    def replay():
        events.append("replay")
        original_replay()

    stand_in.replay = replay
    runner = IterationGraph(engine, _iteration(engine), CudaGraphOptions(True, 1),
                            graph_factory=lambda: stand_in, capture=capturing)
    stand_in.owner = runner
    # What an asynchronous save in flight sets: the next update waits for its copies.
    engine.optimizer.before_update = lambda: events.append(
        "wait inside the capture" if capturing.active else "wait")
    data = toy_batches(4, 2, 3)
    for step in data[:3]:
        runner(*step)
    events_so_far = list(events)
    try:  # the state a replay reads may not be replaced by a load any more
        engine.load_checkpoint("/nonexistent")
        load_refused = None
    except RuntimeError as error:
        load_refused = str(error)
    engine.optimizer.inner.param_groups[0]["lr"] = torch.tensor(1e-3, dtype=torch.float64)
    try:
        runner(*data[3])
        refused = None
    except RuntimeError as error:
        refused = str(error)
    engine.close()
    return {"events": events_so_far, "refused": refused, "load_refused": load_refused}


def test_a_save_in_flight_is_waited_for_outside_the_capture_and_before_each_replay():
    """An asynchronous checkpoint's copies must land before the next update writes the
    masters: the eager step waits inside, a capture may not wait for outside work, and a
    replay runs no Python, so the graph waits before capturing and before every replay.
    And an lr tensor replaced after the capture is refused in one line, not replayed."""
    (out,) = run_ranks(graph_with_a_save_in_flight, 1)
    events = out["events"]
    assert "wait inside the capture" not in events
    # eager warm-up: the step's own wait; capture: the wait before it, and the stand-in's
    # first replay (the capture ran the iteration); the next call: a wait before the replay
    # (the stand-in replay then reruns the Python step, which waits again).
    assert events[:4] == ["wait", "wait", "replay", "wait"] and events[4] == "replay"
    assert out["refused"].startswith("cuda_graph: a param group's lr was replaced after the "
                                     "capture") and "\n" not in out["refused"]
    assert out["load_refused"].startswith("load_checkpoint: this engine's iteration is "
                                          "captured as a CUDA graph")


def load_keeps_this_runs_step_flags(rank, world, root):
    engine = _engine()
    run = _iteration(engine)
    data = toy_batches(1, 2, 3)
    run(*data[0])
    engine.save_checkpoint(root, tag="t")
    lr_saved = engine.optimizer.inner.param_groups[0]["lr"]
    engine.close()
    from zeropp.acceleration.cuda_graph import hold_lr

    engine = _engine()
    group = engine.optimizer.inner.param_groups[0]
    # As a CUDA graph's preparation sets them, in a run resuming one saved without a graph.
    group["capturable"], group["foreach"] = True, False
    held = group["lr"] = torch.tensor(0.5, dtype=torch.float64)
    hold_lr(held)
    engine.load_checkpoint(root, tag="t")
    out = {"capturable": group["capturable"], "foreach": group["foreach"],
           "lr": (float(group["lr"]), float(lr_saved)), "steps": engine.global_steps,
           "same_lr_tensor": group["lr"] is held}
    engine.close()
    return out


def test_a_checkpoint_load_keeps_how_this_run_steps(tmp_path):
    """A load restores the hyperparameters, not the saving run's way of stepping: a run
    resumed with --cuda-graph keeps capturable (else its capture fails), a GPU run resuming
    a CPU checkpoint keeps its fused step."""
    (out,) = run_ranks(load_keeps_this_runs_step_flags, 1, str(tmp_path))
    assert out["capturable"] is True and out["foreach"] is False
    assert out["lr"][0] == out["lr"][1] and out["steps"] == 1
    assert out["same_lr_tensor"]  # a held lr tensor is written in place, not replaced


def persistent_buffers_across_iterations(rank, world):
    from zeropp.unit import ShardedUnit

    engine = _engine()
    freed = []
    original = ShardedUnit._free_full

    def recording_free(unit):
        freed.append(unit.name)
        original(unit)

    ShardedUnit._free_full = recording_free
    try:
        data = toy_batches(3, 2, 3 * world)[:, :, rank * 3:(rank + 1) * 3]
        run = _iteration(engine)
        run(*data[0])
        persistent = engine.sharded.persistent_units.units
        before = [unit.full.data_ptr() for unit in persistent]
        freed.clear()
        run(*data[1])
        after = [unit.full.data_ptr() for unit in persistent]
    finally:
        ShardedUnit._free_full = original
    names = {unit.name for unit in persistent}
    engine.close()
    return {"persistent": sorted(names), "freed": sorted(set(freed) & names),
            "same_memory": before == after}


def test_persistent_units_keep_their_memory_from_one_iteration_to_the_next():
    """A replayed forward reads the persistent units' weights where the captured one did:
    the step's regather writes into the same memory instead of freeing and allocating."""
    for out in run_ranks(persistent_buffers_across_iterations, 2):
        assert out["persistent"], "the toy model has persistent units (its norms)"
        assert out["freed"] == [] and out["same_memory"]


def test_deepspeeds_host_side_options_block_the_capture_in_one_line_each():
    """Options that read or wait for the GPU inside a step (DeepSpeed's unused-parameter
    check, its synchronized throughput timer, its wall-clock breakdown) keep the iteration
    eager, each said, on an engine that could otherwise be captured."""
    from types import SimpleNamespace

    from zeropp.acceleration.cuda_graph import capture_blockers
    from zeropp.config import EngineConfig

    def engine(config: dict, unused_check: bool = False):
        return SimpleNamespace(
            device=torch.device("cuda", 0), optimizer=SimpleNamespace(offloaded=False),
            defers_step_outcome=True, loss_scaler=SimpleNamespace(dynamic=False),
            lr_scheduler=None, sharded=SimpleNamespace(weight_deltas=None),
            _params_with_gradient=set() if unused_check else None,
            config=EngineConfig.from_json(config))

    assert capture_blockers(engine({})) == []
    assert capture_blockers(engine({"timers": {"throughput": {"synchronized": True}}})) == [
        "timers.throughput.synchronized waits for the GPU at every step"]
    assert capture_blockers(engine({"timers": {"throughput": {"enabled": False,
                                                               "synchronized": True}}})) == []
    assert capture_blockers(engine({"wall_clock_breakdown": True})) == [
        "wall_clock_breakdown times every phase with CUDA events, which a replay does not "
        "record"]
    assert capture_blockers(engine({}, unused_check=True)) == [
        "zero_optimization.ignore_unused_parameters false counts the unused parameters on "
        "the host at every step"]


class _LoggedEvent:
    """Stands in for torch.cuda.Event: logs its records and synchronizes."""

    def __init__(self, log: list, number: int) -> None:
        self.log, self.number = log, number
        self.recorded_at = None

    def record(self) -> None:
        self.recorded_at = len([e for e in self.log if e[0] == "record"]) + 1
        self.log.append(("record", self.number))

    def synchronize(self) -> None:
        self.log.append(("wait for replay", self.recorded_at))


def graph_run_ahead(rank, world):
    from zeropp.acceleration.cuda_graph import MAX_REPLAYS_AHEAD, CudaGraphOptions, IterationGraph

    engine = _engine()
    log = []
    numbers = itertools.count()  # this run's events, numbered from 0
    stand_in = RerunGraph()
    runner = IterationGraph(engine, _iteration(engine), CudaGraphOptions(True, 1),
                            graph_factory=lambda: stand_in,
                            capture=lambda graph: contextlib.nullcontext(),
                            event_factory=lambda: _LoggedEvent(log, next(numbers)))
    stand_in.owner = runner
    for step in toy_batches(7, 2, 3):
        runner(*step)
        log.append(("replays", runner.replays))
    engine.close()
    return {"log": log, "ahead": MAX_REPLAYS_AHEAD}


def test_the_host_queues_at_most_two_replays_ahead_of_the_gpu():
    """A replay is one launch: without a bound the host would run far ahead, and the next
    read (a log line) would wait for every queued iteration at once. After replay r the host
    waits for replay r - 2 to finish on the device."""
    (out,) = run_ranks(graph_run_ahead, 1)
    log, ahead = out["log"], out["ahead"]
    waits = [entry[1] for entry in log if entry[0] == "wait for replay"]
    replays = [entry[1] for entry in log if entry[0] == "replays"]
    assert replays == [0, 1, 2, 3, 4, 5, 6]  # one warm-up, then capture and 5 replays
    assert waits == [r - ahead for r in range(ahead + 1, 7)]
    # three events, reused in turn
    assert sorted({entry[1] for entry in log if entry[0] == "record"}) == [0, 1, 2]
