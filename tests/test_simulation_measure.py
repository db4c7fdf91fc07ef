"""MemoryTracker and HostSyncCounter on meta tensors (zeropp/simulation/measure.py)."""

import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from zeropp.simulation import measure
from zeropp.simulation.measure import HostSyncCounter, MemoryTracker, Rule, default_category

REPO = Path(__file__).resolve().parents[1]
HERE = "tests/test_simulation_measure.py"
META = torch.device("meta")


def _line() -> int:
    """Line number of the caller (used on the same line as the measured call)."""
    return sys._getframe(1).f_lineno


def _fake_zeropp_function(path: str, name: str):
    """A function whose frame claims to be ``name`` in ``path``: it allocates a tensor (or
    grows a storage when given one), so the category rules see that frame."""
    src = (f"def {name}(nbytes, storage=None):\n"
           f"    if storage is not None:\n"
           f"        storage.resize_(nbytes)\n"
           f"        return storage\n"
           f"    return torch.empty(nbytes, dtype=torch.uint8, device='meta')\n")
    scope = {"torch": torch}
    exec(compile(src, f"/somewhere/{path}", "exec"), scope)
    return scope[name]


# ---- MemoryTracker ----------------------------------------------------------------------
def test_counts_bytes_views_once_and_frees():
    with MemoryTracker() as mem:
        t = torch.empty(1000, device=META, dtype=torch.float16)
        assert mem.current_bytes == 2000
        v = t.view(10, 100)
        s = t[:10]
        t.add_(1)  # in-place result: same storage
        assert mem.current_bytes == 2000
        del t
        assert mem.current_bytes == 2000  # views keep the storage alive
        del v, s
        assert mem.current_bytes == 0
        assert mem.peak_bytes == 2000
        assert mem.peak_by_category == {"activations": 2000}
        assert mem.current_by_category == {}


def test_each_allocation_lane_holds_its_own_peak_as_cudas_caching_allocator_does():
    """A block freed on one stream is not reused by another ([Note: allocation lanes]): the
    compute stream's 4 KB and a side stream's 2 KB, never live together, reserve 6 KB."""
    from zeropp.comm.streams import InlineExecution, allocating_on

    with MemoryTracker() as mem:
        t = torch.empty(1000, device=META, dtype=torch.float32)
        del t
        with allocating_on("gather"):
            u = torch.empty(500, device=META, dtype=torch.float32)
        del u
        held = []
        # a collective's steps run by an execution without streams land on its lane
        InlineExecution().launch("reduce", lambda async_op: held.append(
            torch.empty(250, device=META, dtype=torch.float32)))
        del held[:]
        assert mem.current_bytes == 0 and mem.peak_bytes == 4000
        assert mem.lane_peaks == {"compute": 4000, "gather": 2000, "reduce": 1000}
        assert mem.reserved_peak_bytes == 7000
        mem.reset_peak()
        assert mem.reserved_peak_bytes == 0


def test_does_not_keep_storages_alive():
    with MemoryTracker() as mem:
        t = torch.zeros(64, device=META)
        ref = weakref.ref(t.untyped_storage())
        assert mem.current_bytes == 256
        del t
        assert ref() is None
        assert mem.current_bytes == 0
    # a storage that dies after the tracker exits is still subtracted
    with MemoryTracker() as mem:
        t = torch.zeros(64, device=META)
    del t
    assert mem.current_bytes == 0


def test_other_devices_are_ignored():
    with MemoryTracker() as mem:
        cpu = torch.ones(1000)
        cpu2 = cpu * 2
    assert mem.peak_bytes == 0 and cpu2.shape == (1000,)


def test_follows_storage_resize_and_restores_patch():
    original = torch.UntypedStorage.resize_
    with MemoryTracker() as mem:
        assert torch.UntypedStorage.resize_ is not original
        t = torch.empty(1000, device=META)
        st = t.untyped_storage()
        st.resize_(0)
        assert (mem.current_bytes, mem.peak_bytes) == (0, 4000)
        st.resize_(4000)
        assert mem.current_bytes == 4000
        st.resize_(6000)
        assert (mem.current_bytes, mem.peak_bytes) == (6000, 6000)
        t.resize_(2000)  # aten.resize_ (dispatched) grows the same storage
        assert mem.current_bytes == 8000
    assert torch.UntypedStorage.resize_ is original
    assert "resize_" not in torch.UntypedStorage.__dict__


def test_storage_from_before_the_tracker_counts_from_its_resize():
    t = torch.empty(1000, device=META)
    with MemoryTracker() as mem:
        v = t.view(-1)  # a view of an untracked storage is not a new allocation
        t.mul_(2)
        assert mem.current_bytes == 0
        t.untyped_storage().resize_(0)
        assert mem.current_bytes == 0
        t.untyped_storage().resize_(800)
        assert mem.current_bytes == 800
        del t, v
        assert mem.current_bytes == 0


def test_track_existing_counts_model_states_once():
    model = torch.nn.Linear(10, 10, device=META)  # 100 + 10 floats
    extra = torch.empty(25, device=META)
    with MemoryTracker() as mem:
        mem.track_existing([model, {"buf": extra}, extra.untyped_storage()])
        assert mem.current_bytes == 440 + 100
        assert mem.current_by_category == {"model states": 540}
        mem.track_existing(model.parameters())  # already tracked
        model.weight.data.mul_(0.5)
        assert mem.current_bytes == 540
    mem.track_existing(torch.ones(5))  # CPU: not ours
    assert mem.current_bytes == 540


def test_peak_by_category_and_reset_peak():
    mem = MemoryTracker(categorize=lambda: category)
    with mem:
        category = "activations"
        a = torch.empty(1000, dtype=torch.uint8, device=META)
        category = "gathered weights"
        b = torch.empty(3000, dtype=torch.uint8, device=META)
        del b
        category = "activations"
        c = torch.empty(500, dtype=torch.uint8, device=META)
        assert mem.peak_bytes == 4000
        assert mem.peak_by_category == {"activations": 1000, "gathered weights": 3000}
        assert mem.current_by_category == {"activations": 1500}
        mem.reset_peak()
        assert mem.peak_bytes == 1500
        assert mem.peak_by_category == {"activations": 1500}
        del a, c


def test_default_rules_attribute_by_frame():
    cases = [
        ("zeropp/kernels/meta.py", "quantize", "quantization buffers"),
        ("zeropp/comm/quantized.py", "all_gather_q", "quantization buffers"),
        ("zeropp/unit.py", "_alloc_full", "gathered weights"),
        ("zeropp/unit.py", "release", "hpZ secondary shards"),
        ("zeropp/unit.py", "start_reduce", "gradients in flight"),
        ("zeropp/comm/collectives.py", "reduce_scatter", "gradients in flight"),
        ("zeropp/optimizer.py", "step", "model states"),
        ("zeropp/unit.py", "__init__", "model states"),
        ("zeropp/sharded_model.py", "_build_units", "model states"),
        ("zeropp/sharded_model.py", "forward", "activations"),
        ("zeropp/unit.py", "wait_gather", "activations"),
    ]
    with MemoryTracker() as mem:
        keep = [_fake_zeropp_function(path, name)(100) for path, name, _ in cases]
        expected: dict[str, int] = {}
        for _, _, category in cases:
            expected[category] = expected.get(category, 0) + 100
        assert mem.current_by_category == expected
        del keep


def test_regrowth_from_zero_is_attributed_to_the_grower(monkeypatch):
    # the innermost matching frame wins: helper -> "gathered weights" via a test-only rule
    monkeypatch.setattr(measure, "CATEGORY_RULES", measure.CATEGORY_RULES
                        + [Rule(HERE, frozenset({"_grow_here"}), "gathered weights")])

    def _grow_here(st, n):
        st.resize_(n)

    with MemoryTracker() as mem:
        full = torch.empty(256, dtype=torch.uint8, device=META)  # from the test: activations
        st = full.untyped_storage()
        st.resize_(0)
        _grow_here(st, 256)
        assert mem.current_by_category == {"gathered weights": 256}
        st.resize_(0)
        _fake_zeropp_function("zeropp/unit.py", "release")(128, st)
        assert mem.current_by_category == {"hpZ secondary shards": 128}
        st.resize_(512)  # growing a live storage keeps its category
        assert mem.current_by_category == {"hpZ secondary shards": 512}
        assert default_category() == "activations"


def test_phase_peaks():
    with MemoryTracker() as mem:
        base = torch.empty(100, dtype=torch.uint8, device=META)
        with mem.phase("step"):
            with mem.phase("forward"):
                tmp = torch.empty(1000, dtype=torch.uint8, device=META)
                del tmp
            with mem.phase("backward"):
                tmp = torch.empty(300, dtype=torch.uint8, device=META)
                del tmp
        with mem.phase("forward"):  # used again: keeps the larger peak
            tmp = torch.empty(50, dtype=torch.uint8, device=META)
        with mem.phase("idle"):
            pass
    assert mem.phase_peaks == {"step": 1100, "forward": 1100, "backward": 400, "idle": 150}
    del base, tmp


def test_linear_forward_backward_records_activations():
    lin = torch.nn.Linear(64, 32, device=META)
    x = torch.empty(8, 64, device=META, requires_grad=True)
    with MemoryTracker() as mem:
        mem.track_existing(lin)
        with mem.phase("forward"):
            y = lin(x)
            loss = y.sum()
        assert mem.current_by_category == {"model states": 8320, "activations": 8 * 32 * 4 + 4}
        with mem.phase("backward"):
            loss.backward()
        grads = lin.weight.grad.numel() + lin.bias.grad.numel() + x.grad.numel()
        assert lin.weight.grad.device == META
        assert mem.current_by_category["activations"] == 8 * 32 * 4 + 4 + grads * 4
        assert mem.phase_peaks["backward"] >= mem.current_bytes > mem.phase_peaks["forward"]


# ---- HostSyncCounter ---------------------------------------------------------------------
def test_host_syncs_are_counted_at_their_call_sites():
    s = torch.ones((), device=META)
    m = torch.ones(2, 3, device=META, dtype=torch.float16)
    with HostSyncCounter(root=REPO) as syncs:
        item, l1 = s.item(), _line()
        flag, l2 = bool(s > 0), _line()
        f, l3 = float(s), _line()
        i, l4 = int(s.long()), _line()
        rows, l5 = m.tolist(), _line()
        host, l6 = m.cpu(), _line()
        host2, l7 = m.to("cpu", torch.float32), _line()
        arr, l8 = m.numpy(), _line()
        dst = torch.ones(2, 3, dtype=torch.float16)
        _, l9 = dst.copy_(m), _line()
        close, l10 = torch.allclose(s, s), _line()
        same, l12 = torch.equal(m, m), _line()
        for _ in range(3):
            s.item(); l11 = _line()  # noqa: E702
    assert (item, flag, f, i, close, same) == (0.0, False, 0.0, 0, True, True)
    assert [type(v) for v in (item, flag, f, i, close)] == [float, bool, float, int, bool]
    assert rows == [[0.0] * 3] * 2
    assert host.device.type == "cpu" and host.dtype == torch.float16 and host.shape == (2, 3)
    assert host2.dtype == torch.float32 and not host2.any()
    assert isinstance(arr, np.ndarray) and arr.shape == (2, 3) and arr.dtype == np.float16
    assert not dst.any()
    fn = "test_host_syncs_are_counted_at_their_call_sites"
    expected = {f"{HERE}:{line} in {fn}": 1 for line in (l1, l2, l3, l4, l5, l6, l7, l8, l9, l10, l12)}
    expected[f"{HERE}:{l11} in {fn}"] = 3
    assert dict(syncs.counts) == expected
    assert syncs.total == 14
    syncs.reset()
    assert syncs.total == 0
    assert "numpy" not in torch.Tensor.__dict__  # the patch is gone
    with pytest.raises(TypeError):
        m.numpy()


def test_cpu_tensors_and_device_side_ops_are_not_counted():
    c = torch.ones(3)
    m = torch.ones(3, device=META)
    with HostSyncCounter(root=REPO) as syncs:
        assert c.sum().item() == 3.0
        assert c.tolist() == [1.0, 1.0, 1.0] and bool(c.all())
        assert c.numpy().tolist() == [1.0, 1.0, 1.0]
        m2 = m.to(torch.float16) + 1  # stays on the device
        m.copy_(c)  # host-to-device is not a host read
    assert syncs.total == 0 and m2.device == META


def test_counter_and_tracker_together():
    w = torch.empty(1000, device=META)
    with MemoryTracker() as mem, HostSyncCounter(root=REPO) as syncs:
        mem.track_existing(w)
        norm = (w * w).sum()
        if norm > 0:  # a host sync: bool() reads the device
            pass
        values = (w[:4] + 1).tolist()
    assert values == [0.0] * 4
    assert syncs.total == 2
    assert mem.peak_bytes == 4000 + 4000 + 4  # w, w * w, the sum
    assert mem.current_bytes == 4000 + 4
    del norm
