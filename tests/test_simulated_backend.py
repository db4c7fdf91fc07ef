"""The simulated NCCL backend: collectives on meta tensors, the rules it enforces, the orders
it records. Each test opens and closes its own simulation in this process."""

import gc
import inspect
import sys
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

from zeropp.simulation.backend import compare_orders, simulated_process_group

# all_gather_into_tensor / reduce_scatter_tensor are deprecated aliases in torch 2.13.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def meta(*shape):
    return torch.empty(*shape, device="meta")


def test_collectives_on_meta_tensors():
    excepthook = sys.excepthook
    with simulated_process_group(rank=3, world_size=8) as sim:
        shard, full = meta(4), meta(32)
        dist.all_gather_into_tensor(full, shard)
        dist.reduce_scatter_tensor(shard, full)
        dist.all_to_all_single(full, full)
        dist.all_reduce(shard, op=dist.ReduceOp.MAX)
        dist.broadcast(shard, src=0)
        dist.barrier()
        dist.all_gather([meta(4) for _ in range(8)], shard)
        assert dist.get_backend() == "zeropp_sim"
    assert not dist.is_initialized() and sys.excepthook is excepthook
    assert sim.violations == []
    assert sim.counts_by_op() == {
        "all_gather_single": 1, "reduce_scatter_single": 1, "all_to_all_single": 1,
        "all_reduce": 1, "broadcast": 1, "barrier": 1, "all_gather": 1}
    world = tuple(range(8))
    ops = sim.order_signature()[world]
    assert [r.op for r in ops][:3] == ["all_gather_single", "reduce_scatter_single",
                                       "all_to_all_single"]
    assert ops[0].shapes == ((4,), (32,)) and ops[0].dtypes == ("float32", "float32")
    assert ops[3].detail == "MAX" and ops[4].detail == "root=0"
    assert sim.bytes[("reduce_scatter_single", world)] == 32 * 4
    assert sim.max_in_flight == 0  # blocking calls hold nothing


def test_cpu_tensor_is_a_violation_at_the_call_site():
    with simulated_process_group(rank=0, world_size=8) as sim:
        line = inspect.currentframe().f_lineno + 1
        dist.all_reduce(torch.zeros(2))
    (violation,) = sim.violations
    assert violation.rule == "device"
    assert violation.message == "all_reduce on group [0..7]: tensor on cpu, expected meta"
    assert violation.site == (
        f"{__file__}:{line} in test_cpu_tensor_is_a_violation_at_the_call_site")


def test_the_engines_direct_issue_is_not_the_call_site():
    """The engine calls the group's methods from three functions of its own ([Note: issued
    to the process group]); a violation names what called them."""
    from zeropp.comm.collectives import all_gather_into_tensor

    with simulated_process_group(rank=0, world_size=8) as sim:
        line = inspect.currentframe().f_lineno + 1
        all_gather_into_tensor(torch.empty(16), torch.zeros(2))
    (violation,) = sim.violations
    assert violation.rule == "device"
    assert violation.site == f"{__file__}:{line} in test_the_engines_direct_issue_is_not_the_call_site"


def test_a_communicator_first_used_after_training_started_is_a_violation():
    """[Note: eager communicators] NCCL would create it there, from a side stream perhaps."""
    with simulated_process_group(rank=0, world_size=4) as sim:
        warm, lazy = dist.new_group([0, 1]), dist.new_group([0, 2])
        dist.all_reduce(meta(1), group=warm)
        sim.communicators_ready()
        dist.all_reduce(meta(1), group=warm)
        dist.all_reduce(meta(1), group=lazy)
        later = dist.new_group([0, 3])  # made after: its own warm-up is still allowed
        dist.all_reduce(meta(1), group=later)
    (violation,) = sim.violations
    assert violation.rule == "lazy communicator"
    assert "group [0,2]" in violation.message or "[0, 2]" in violation.message, violation


def test_an_exception_in_the_program_closes_the_simulation():
    with pytest.raises(KeyError), simulated_process_group(rank=0, world_size=2):
        raise KeyError("program failed")
    assert not dist.is_initialized()


def test_strict_raises_at_once():
    with simulated_process_group(rank=0, world_size=8, strict=True) as sim:
        with pytest.raises(RuntimeError, match="tensor on cpu, expected meta"):
            dist.all_reduce(torch.zeros(2))
        dist.all_reduce(meta(2))
    assert sim.violations == []


def test_collective_from_another_thread_is_a_violation():
    with simulated_process_group(rank=1, world_size=4) as sim:
        worker = threading.Thread(target=lambda: dist.all_reduce(meta(2)), name="prefetcher")
        worker.start()
        worker.join()
    (violation,) = sim.violations
    assert violation.rule == "thread"
    assert "issued from thread 'prefetcher', expected 'MainThread'" in violation.message


def test_async_work_holds_its_tensors_until_wait():
    with simulated_process_group(rank=0, world_size=4) as sim:
        output = meta(16)
        ref = weakref.ref(output)
        work = dist.all_gather_into_tensor(output, meta(4), async_op=True)
        second = dist.all_reduce(meta(2), async_op=True)
        del output
        gc.collect()
        assert ref() is not None  # the un-waited work keeps it alive, as NCCL does
        assert work.is_completed() and sim.in_flight == 2
        assert work.wait() is True
        gc.collect()
        assert ref() is None
        second.wait()
    assert sim.in_flight == 0 and sim.max_in_flight == 2
    assert sim.async_counts == {"all_gather_single": 1, "all_reduce": 1}


def _program(rank, extra_world_op=False):
    """One step of an SPMD program, as rank ``rank`` of 8 issues it."""
    with simulated_process_group(rank=rank, world_size=8) as sim:
        halves = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
        mine = halves[rank // 4]
        dist.all_gather_into_tensor(meta(16), meta(4), group=mine)
        dist.all_reduce(meta(8))
        if extra_world_op:
            dist.all_reduce(meta(3))
        dist.reduce_scatter_tensor(meta(4), meta(16), group=mine)
        dist.barrier()
    return sim


def test_orders_compare_equal_for_the_same_program():
    first, last = _program(0), _program(7)
    assert set(first.order_signature()) == {tuple(range(8)), (0, 1, 2, 3)}
    assert set(last.order_signature()) == {tuple(range(8)), (4, 5, 6, 7)}
    assert compare_orders(first, last) == []
    assert compare_orders(first, _program(3)) == []  # shares [0..3] as well


def test_an_extra_world_collective_is_a_mismatch():
    mismatches = compare_orders(_program(0), _program(7, extra_world_op=True))
    assert mismatches == [
        "communicator [0..7]: op #1: rank 0 issued barrier(), "
        "rank 7 issued all_reduce((3,) float32, SUM)"]


def test_a_missing_trailing_collective_is_a_mismatch():
    with simulated_process_group(rank=2, world_size=4) as short:
        dist.all_reduce(meta(8))
    with simulated_process_group(rank=0, world_size=4) as long:
        dist.all_reduce(meta(8))
        dist.broadcast(meta(8), src=0)
    (mismatch,) = compare_orders(short.order_signature(), long.order_signature())
    assert "a issued 1 ops, b 2; op #1 only on b: broadcast((8,) float32, root=0)" in mismatch


def test_subgroups_record_under_their_global_ranks():
    with simulated_process_group(rank=5, world_size=8) as sim:
        assert dist.new_group([0, 1, 2, 3]) == dist.GroupMember.NON_GROUP_MEMBER
        group = dist.new_group([4, 5, 6, 7])
        again = dist.new_group([4, 5, 6, 7])  # a second communicator over the same ranks
        assert dist.get_rank(group) == 1 and dist.get_world_size(group) == 4
        dist.all_reduce(meta(2), group=group)
        dist.broadcast(meta(2), src=6, group=again)  # src is global, recorded as group root
    signature = sim.order_signature()
    assert set(signature) == {tuple(range(8)), (4, 5, 6, 7), (4, 5, 6, 7, "#2")}
    assert [r.op for r in signature[(4, 5, 6, 7)]] == ["all_reduce"]
    assert signature[(4, 5, 6, 7, "#2")][0].detail == "root=2"
    assert signature[tuple(range(8))] == []


def test_object_collectives_work_and_are_not_device_violations():
    with simulated_process_group(rank=2, world_size=4) as sim:
        gathered = [None] * 4
        dist.all_gather_object(gathered, {"step": 7})
        received = ["placeholder"]
        dist.broadcast_object_list(received, src=0)
        sent = ["mine"]
        dist.broadcast_object_list(sent, src=2)
    assert gathered == [{"step": 7}] * 4  # every rank is assumed to hold this rank's object
    assert received == [None]  # another rank's object is unknown here
    assert sent == ["mine"]
    assert sim.violations == []
    ops = [r.op for r in sim.order_signature()[(0, 1, 2, 3)]]
    assert ops == ["all_gather(object)"] * 2 + ["broadcast(object)"] * 4
