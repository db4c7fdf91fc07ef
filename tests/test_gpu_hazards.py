"""What a first NCCL run would meet and gloo hides, checked without a GPU: the device each
rank takes, communicators created before training, reductions on their own communicator,
and high-priority side streams. CUDA and torch.distributed are faked where a GPU is needed."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks

# The module (the package's ``zeropp.initialize`` is the function of that name).
init_module = importlib.import_module("zeropp.deepspeed_api.initialize")


class FakeCuda:
    """torch.cuda as seen by a rank of an 8-GPU node, recording set_device."""

    def __init__(self, monkeypatch, current: int = 0, count: int = 8) -> None:
        self.current, self.set_to = current, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)

    def set_device(self, device) -> None:
        self.set_to.append(torch.device(device))
        self.current = torch.device(device).index


def user_group(monkeypatch, backend: str = "nccl", bound: torch.device | None = None) -> None:
    """The script called init_process_group itself (without a device, unless ``bound``)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *args: backend)
    monkeypatch.setattr(init_module, "_bound_device", lambda: bound)


def test_a_group_the_script_created_gets_local_ranks_gpu(monkeypatch):
    """Every rank of a node used to land on cuda:0 when the script had initialized the
    process group: init_distributed returned early without choosing a device."""
    cuda = FakeCuda(monkeypatch)
    user_group(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "3")
    init_module.init_distributed()
    assert cuda.set_to == [torch.device("cuda", 3)]


@pytest.mark.parametrize("bound", [None, torch.device("cuda", 5)])
def test_a_group_on_another_gpu_than_local_rank_is_a_one_line_error(monkeypatch, bound):
    cuda = FakeCuda(monkeypatch, current=5 if bound is None else 0)
    user_group(monkeypatch, bound=bound)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(RuntimeError) as error:
        init_module.init_distributed()
    message = str(error.value)
    assert "cuda:5" in message and "LOCAL_RANK=3" in message and "\n" not in message
    assert cuda.set_to == []


def test_the_engine_creates_the_nccl_group_for_local_ranks_gpu(monkeypatch):
    """device_id makes NCCL create the communicator at init_process_group (and the groups
    split from it), instead of at the first collective in iteration 1."""
    cuda = FakeCuda(monkeypatch)
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    init_module.init_distributed()
    [(args, kwargs)] = calls
    assert args == ("nccl",) and kwargs["device_id"] == torch.device("cuda", 1)
    assert cuda.set_to == [torch.device("cuda", 1)]


def test_local_rank_beyond_the_visible_gpus_is_a_one_line_error(monkeypatch):
    FakeCuda(monkeypatch, count=2)
    user_group(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=4 but this process sees 2 GPU"):
        init_module.init_distributed()


def test_side_streams_are_created_at_high_priority(monkeypatch):
    """Compute kernels must not starve the gathers and reductions (FSDP2's choice)."""
    from zeropp.comm.streams import CudaExecution

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kwargs: made.append(kwargs) or object())
    monkeypatch.setattr(torch.cuda, "Event", object)
    execution = CudaExecution(torch.device("cuda", 2))
    assert set(execution.streams) == {"gather", "reduce"}
    execution.completion_stream("gather")  # made at first use, once
    execution.completion_stream("gather")
    assert made == [{"device": torch.device("cuda", 2), "priority": -1}] * 3


class FakeStreams:
    """torch.cuda's streams and events as a log: which stream is current on which device,
    what is recorded where, and which stream waits for which record. A wait is logged as
    ("wait", waiting stream, event id, stream the event was recorded on)."""

    def __init__(self, monkeypatch, device_index: int = 0) -> None:
        self.log: list[tuple] = []
        self.events: list = []
        fake = self

        class Stream:
            def __init__(self, device=None, priority=0, name=None, index=None):
                self.name = name or f"side{len(fake.streams)}"
                self.device_index = fake.device if index is None else index
                fake.streams.append(self)

            def wait_stream(self, other):
                fake.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event):
                fake.log.append(("wait", self.name, event.id, event.recorded_on))

        class Event:
            def __init__(self):
                self.id, self.recorded_on = len(fake.events), None
                fake.events.append(self)

            def record(self, stream):
                self.recorded_on = stream.name
                fake.log.append(("record", self.id, stream.name))

        @contextlib.contextmanager
        def stream(s):  # torch's context: the stream's device current while it runs
            previous = dict(self.current_on), self.device
            self.device, self.current_on[s.device_index] = s.device_index, s
            try:
                yield
            finally:
                self.current_on, self.device = previous

        @contextlib.contextmanager
        def device(index):
            previous, self.device = self.device, index
            try:
                yield
            finally:
                self.device = previous

        def set_stream(s):  # as torch's: the stream's device becomes the current one
            self.device, self.current_on[s.device_index] = s.device_index, s

        self.streams: list = []
        self.device = device_index
        # each device's current stream: its compute stream until something switches it
        self.current_on = {index: Stream(name="compute" if index == device_index
                                         else f"compute{index}", index=index)
                           for index in range(8)}
        self.streams.clear()
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)

    def current_stream(self, device=None):
        if device is None:
            return self.current
        return self.current_on[device if isinstance(device, int) else device.index]

    @property
    def current(self):
        return self.current_on[self.device]


def test_collective_events_are_reused_once_waited_for(monkeypatch):
    """A collective records an event on its side stream and the compute stream waits for it;
    once that wait is enqueued the event is free to record again (CUDA's stream waits take
    the record current at the call), so a lane creates only as many events as it has
    collectives in flight at once, not one per collective. The side stream's wait for
    compute before each collective reuses one event too."""
    from zeropp.comm.streams import CudaExecution

    cuda = FakeStreams(monkeypatch)
    log, made = cuda.log, cuda.events
    execution = CudaExecution(torch.device("cuda", 0))
    gather = execution.streams["gather"]
    mark = execution.compute_mark.id
    issued = []

    def launch(lane):
        return execution.launch(lane, lambda async_op: issued.append(lane))

    for _ in range(5):  # one at a time: one event, recorded and waited for five times
        launch("gather").wait()
    assert len(made) == 2 and issued == ["gather"] * 5
    assert log == [("record", mark, "compute"), ("wait", gather.name, mark, "compute"),
                   ("record", 1, gather.name), ("wait", "compute", 1, gather.name)] * 5
    log.clear()
    first, second = launch("gather"), launch("gather")  # two in flight: a second event
    reduce = launch("reduce")  # each lane has its own
    assert len(made) == 4
    for pending in (second, first, reduce):
        pending.wait()
        pending.wait()  # a second wait neither waits nor frees the event again
    assert [entry[:2] for entry in log].count(("wait", "compute")) == 3
    assert sorted(map(len, execution.free_events.values())) == [1, 2]
    for _ in range(3):
        launch("gather").wait()
    assert len(made) == 4  # the free ones are taken
    assert cuda.current.name == "compute" and cuda.device == 0


def test_completion_steps_run_where_nothing_waits_behind_them(monkeypatch):
    """[Note: completion steps]: a single gather's finish (qwZ's dequantize) runs on the
    lane's completion stream after the transfer's event, so the gather stream's next
    transfer does not queue behind it, and the compute stream waits for the completion; a
    sequence's finish (qgZ's last hop and sum) runs at wait(), on the compute stream, after
    the compute stream waits for the event, so the reduce stream is free for the next
    reduction while the slow hop is on the wire."""
    from zeropp.comm.streams import CudaExecution

    cuda = FakeStreams(monkeypatch)
    execution = CudaExecution(torch.device("cuda", 0))
    gather, reduce = execution.streams["gather"], execution.streams["reduce"]
    completion = execution.completion_stream("gather")
    assert execution.completion_streams == {"gather": completion}  # none for reduce yet
    mark = execution.compute_mark.id

    def step(name):
        return lambda *args: cuda.log.append((name, cuda.current.name))

    def one_launch(event):
        return [("record", mark, "compute"), ("wait", gather.name, mark, "compute"),
                ("issue", gather.name), ("record", event, gather.name),
                ("wait", completion.name, event, gather.name),
                ("finish", completion.name), ("record", event, completion.name)]

    first = execution.launch("gather", step("issue"), finish=step("finish"))
    second = execution.launch("gather", step("issue"), finish=step("finish"))
    # the second transfer is issued on the gather stream with nothing of the first's
    # completion before it there; each launch's event is re-recorded for its completion
    assert cuda.log == one_launch(1) + one_launch(2)
    assert cuda.current.name == "compute"
    cuda.log.clear()
    first.wait()
    second.wait()
    assert cuda.log == [("wait", "compute", 1, completion.name),
                        ("wait", "compute", 2, completion.name)]
    cuda.log.clear()
    first = execution.launch("reduce", step("send"), finish=step("receive"), sequence=True)
    second = execution.launch("reduce", step("send"), finish=step("receive"), sequence=True)
    # both sends issued before either receive: the lane does not wait for the first's
    assert [entry[0] for entry in cuda.log] == ["record", "wait", "send", "record"] * 2
    cuda.log.clear()
    first.wait()
    second.wait()
    ids = [event.id for event in execution.free_events["reduce"]]
    assert cuda.log == [("wait", "compute", ids[0], reduce.name), ("receive", "compute"),
                        ("wait", "compute", ids[1], reduce.name), ("receive", "compute")]
    # staging on a lane (an offloaded shard's copy) waits for compute, where a receive may
    # still read a block the lane freed
    cuda.log.clear()
    with execution.staging("reduce"):
        assert cuda.current is reduce
    assert cuda.log == [("record", mark, "compute"), ("wait", reduce.name, mark, "compute")]


def test_a_launch_switches_streams_as_torchs_context_would(monkeypatch):
    """[Note: lane switch]: a launch sets the lane's stream and restores the compute stream,
    also when the issue fails (and keeps its lane's free events); from a thread whose current
    device is another GPU it makes the engine's device current while it issues, then
    restores both devices' streams and the current device, as ``torch.cuda.stream(...)``
    does, and the engine device's compute stream is the one that waits for it."""
    from zeropp.comm.streams import CudaExecution

    cuda = FakeStreams(monkeypatch, device_index=2)
    execution = CudaExecution(torch.device("cuda", 2))
    gather = execution.streams["gather"]
    seen = []

    def issue(async_op):
        seen.append((cuda.device, cuda.current.name))

    def finish():
        seen.append((cuda.device, cuda.current.name))

    execution.launch("gather", issue, finish=finish).wait()
    completion = execution.completion_stream("gather")
    assert seen == [(2, gather.name), (2, completion.name)]
    assert (cuda.device, cuda.current.name) == (2, "compute")

    def failing(async_op):
        raise RuntimeError("NCCL error")

    free = list(execution.free_events["gather"])
    with pytest.raises(RuntimeError, match="NCCL error"):
        execution.launch("gather", failing)
    assert (cuda.device, cuda.current.name) == (2, "compute")
    assert execution.free_events["gather"] == free

    seen.clear()
    cuda.device = 5  # the thread's current GPU is not the engine's
    cuda.log.clear()
    execution.launch("gather", issue, finish=finish).wait()
    assert seen == [(2, gather.name), (2, completion.name)]
    assert cuda.device == 5 and cuda.current.name == "compute5"
    assert cuda.current_on[2].name == "compute"
    # it joined the engine device's compute stream, not the other device's, and that is the
    # stream that waits for the collective
    assert cuda.log[:2] == [("record", execution.compute_mark.id, "compute"),
                            ("wait", gather.name, execution.compute_mark.id, "compute")]
    assert cuda.log[-1][:2] == ("wait", "compute")


def test_overlap_comm_false_completes_a_sequence_when_issued():
    """``overlap_comm: false`` runs every collective to completion, qgZ's last hop included;
    the simulated GPU cluster's model of CUDA leaves it to the wait, as CUDA does."""
    from zeropp.comm.streams import CUDA_MODEL, SYNCHRONOUS, execution_for

    orders = {}
    for execution in (SYNCHRONOUS, CUDA_MODEL):
        log: list[str] = []
        pending = execution.launch("reduce", lambda async_op, log=log: log.append("send"),
                                   finish=lambda log=log: log.append("receive"),
                                   sequence=True)
        log.append("launched")
        pending.wait()
        orders[execution] = log
    assert orders[SYNCHRONOUS] == ["send", "receive", "launched"]
    assert orders[CUDA_MODEL] == ["send", "launched", "receive"]
    assert execution_for(torch.device("meta"), True) is CUDA_MODEL
    assert execution_for(torch.device("meta"), False) is SYNCHRONOUS
    assert execution_for(torch.device("cpu"), False) is SYNCHRONOUS


def _groups_of_an_engine(rank: int, world: int) -> dict:
    """Which process groups the gathers and the reductions of two training steps used."""
    import zeropp
    import zeropp.comm.collectives as collectives
    from tests.toy_models import toy_batches, toy_loss, toy_model

    used: dict[str, set] = {"all_gather_into_tensor": set(), "reduce_scatter_tensor": set()}

    def recording(original, groups):
        def record(*args, **kwargs):
            groups.add(id(kwargs.get("group")))
            return original(*args, **kwargs)
        return record

    for name, groups in used.items():  # a spawned rank's own module: nothing to restore
        setattr(collectives, name, recording(getattr(collectives, name), groups))
    engine, *_ = zeropp.initialize(
        model=toy_model(layers=2),
        config={"train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    tokens = toy_batches(2, 1, 2 * world)[:, 0, rank * 2:(rank + 1) * 2]
    for step in range(2):
        engine.backward(toy_loss(engine(tokens[step]), tokens[step]))
        engine.step()
    engine.close()
    return {name: len(groups) for name, groups in used.items()} | {
        "shared": bool(used["all_gather_into_tensor"] & used["reduce_scatter_tensor"])}


def test_exact_gathers_and_reductions_use_separate_communicators():
    """On NCCL one communicator is one stream: the reduce-scatter of unit k would wait for
    the gather of unit k+1 behind it."""
    for result in run_ranks(_groups_of_an_engine, 2):
        assert result["all_gather_into_tensor"] >= 1 and result["reduce_scatter_tensor"] >= 1
        assert not result["shared"], result
