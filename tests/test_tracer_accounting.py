"""StorageAccountant on its own: exact live bytes, peaks between reads, reclassification, callbacks."""

from __future__ import annotations

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tracer import Category, StorageAccountant
from tracer.accounting import device_name

F32 = 4
OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError  # torch.OutOfMemoryError: 2.5+


def _nm(acc: StorageAccountant, dev: str = "cpu") -> int:
    b = acc.live_bytes(dev)
    return b["activation"] + b["temporary"] + b["other"]


def test_counts_new_storages_once_and_frees_them():
    acc = StorageAccountant(category="activation")
    with acc:
        a = torch.ones(100)  # 400 B
        v = a.view(10, 10)  # a view: no new storage
        a.add_(1)  # in place: no new storage
        b = a * 2  # 400 B
        v2 = b[:50]
        assert acc.live_bytes("cpu")["activation"] == 800
        del a, v  # storage of a dies
        assert acc.live_bytes("cpu")["activation"] == 400
        del v2
        assert acc.live_bytes("cpu")["activation"] == 400  # b still holds it
        del b
    assert acc.live_bytes("cpu")["activation"] == 0
    acc.close()


def test_peak_between_reads_is_exact_not_sampled():
    acc = StorageAccountant()
    with acc:
        a = torch.empty(1000)  # 4000
        b = torch.empty(500)  # 6000 <- peak of the first interval
        del a  # 2000
        assert acc.take_peaks("cpu") == (6000, 6000)
        c = torch.empty(250)  # 3000 <- peak of the second interval
        del b, c  # 0
        assert acc.take_peaks("cpu") == (3000, 3000)
        assert acc.take_peaks("cpu") == (0, 0)  # a new interval starts at the current value
        assert acc.take_peaks("cuda:3") == (0, 0)  # never seen
    acc.close()


def test_reclassification_is_retroactive_within_an_interval_and_moves_bytes_afterwards():
    acc = StorageAccountant(category=Category.TEMPORARY)
    with acc:
        g = torch.empty(1000)  # 4000 temporary ... classified as gradient before the next read
        acc.classify(g, Category.GRADIENT)
        assert acc.take_peaks("cpu") == (4000, 0)  # never counted as non-model
        t = torch.empty(100)  # 400 temporary, read as such
        assert acc.take_peaks("cpu") == (4400, 400)
        assert acc.classify(t, "optimizer_state") == 400  # moves now: non-model drops to 0
        assert acc.live_bytes("cpu")["optimizer_state"] == 400
        assert acc.take_peaks("cpu") == (4400, 400)  # the interval started at 400 non-model
        assert acc.take_peaks("cpu") == (4400, 0)
        assert acc.classify(t, "optimizer_state") == 0  # no change
        assert acc.category_of(t) is Category.OPTIMIZER_STATE
        assert acc.category_of(torch.empty(3).view(3)) is Category.TEMPORARY
    acc.close()


def test_classify_registers_storages_made_before_the_mode_once_even_through_views():
    w = torch.empty(64, 32)  # 8192 B, made outside
    acc = StorageAccountant()
    assert acc.classify(w, Category.PARAMETER) == 8192
    assert acc.classify(w.t(), Category.PARAMETER) == 0  # tied / view: same storage
    assert acc.live_bytes("cpu")["parameter"] == 8192
    with acc:
        y = w.t()  # view op: nothing new
        del y
    assert acc.total_bytes("cpu") == 8192
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        acc.classify([1, 2], Category.PARAMETER)
    with pytest.raises(ValueError, match="unknown category 'weights'.*parameter, buffer"):
        acc.classify(w, "weights")
    acc.close()


def test_category_is_validated():
    with pytest.raises(ValueError, match="unknown category 'fwd'"):
        StorageAccountant(category="fwd")
    acc = StorageAccountant()
    with pytest.raises(ValueError, match="expected one of parameter"):
        acc.category = "act"
    acc.category = "activation"
    assert acc.category is Category.ACTIVATION
    with pytest.raises(TypeError, match="on_allocate must be callable"):
        StorageAccountant(on_allocate=5)


def test_on_allocate_sees_every_allocation_and_can_fail_the_op_leaving_state_unchanged():
    calls = []
    capacity = 10_000

    def on_allocate(device: str, nbytes: int, total_after: int) -> None:
        calls.append((device, nbytes, total_after))
        if total_after > capacity:
            raise OOM(f"{device}: {total_after} > {capacity}")

    acc = StorageAccountant(category="activation", on_allocate=on_allocate)
    with acc:
        a = torch.empty(1000)  # 4000
        b = a + 1  # 8000
        before = acc.live_bytes("cpu")
        with pytest.raises(OOM, match="cpu: 12000 > 10000"):
            a * 2  # would be 12000
        assert acc.live_bytes("cpu") == before  # the failed allocation is not counted
        del b
        c = a * 3  # 8000 again: fits after b was freed
    assert calls == [("cpu", 4000, 4000), ("cpu", 4000, 8000), ("cpu", 4000, 12000), ("cpu", 4000, 8000)]
    assert acc.total_bytes("cpu") == 8000
    del a, c
    acc.close()


def test_resize_and_out_variants_are_counted():
    acc = StorageAccountant(category="other")
    with acc:
        t = torch.empty(0)
        t.resize_(100)  # grows from nothing: 400
        assert acc.total_bytes("cpu") == 400
        t.resize_(300)  # a tracked storage grows: +800
        assert acc.total_bytes("cpu") == 1200
        out = torch.empty(0)
        torch.add(torch.ones(10), 1, out=out)  # ones: 40 (freed at once), out resized to 40
        assert acc.total_bytes("cpu") == 1240
        assert acc.take_peaks("cpu")[0] == 1280  # the ones tensor and out were live together
        x = torch.tensor([1.0, 2.0, 3.0])  # torch.tensor goes through lift_fresh, an aliasing op
        assert acc.total_bytes("cpu") == 1252
        del t, out, x
    assert acc.total_bytes("cpu") == 0
    acc.close()


def test_allocations_during_backward_are_temporary_while_category_is_other():
    w = torch.randn(32, requires_grad=True)
    acc = StorageAccountant(category="other")
    with acc:
        y = (w * 2).sum()  # forward outside any phase: other
        assert acc.category_of(y) is Category.OTHER
        y.backward()
        assert acc.category_of(w.grad) is Category.TEMPORARY  # made inside the autograd engine
    acc.close()


def test_devices_are_kept_apart():
    acc = StorageAccountant(category="activation")
    with acc:
        a = torch.empty(10)
        m = torch.empty(100, device="meta")
        assert acc.devices() == ["cpu", "meta"]
        assert acc.live_bytes("meta")["activation"] == 512  # 400 B, in 512 B blocks off the CPU (as on CUDA)
        assert acc.live_bytes(torch.device("cpu"))["activation"] == 40
        del a, m
    acc.close()


def test_fake_cuda_tensors_are_counted_without_a_gpu():
    acc = StorageAccountant(category="activation")
    with FakeTensorMode():
        with acc:
            a = torch.empty(256, 1024, device="cuda")  # 1 MiB, fake
            b = torch.empty(256, 1024, device="cuda", dtype=torch.float16)
            assert acc.live_bytes("cuda")["activation"] == 2**20 + 2**19
            assert acc.devices() == ["cuda:0"]
            del a
            assert acc.take_peaks("cuda:0") == (2**20 + 2**19,) * 2
            del b
    assert acc.total_bytes("cuda:0") == 0
    acc.close()


def test_close_stops_tracking_and_keeps_the_last_values():
    acc = StorageAccountant(category="activation")
    with acc:
        a = torch.empty(100)
    acc.close()
    del a
    gc.collect()
    assert acc.total_bytes("cpu") == 400  # the free after close is not seen


def test_long_runs_without_reads_stay_exact():
    acc = StorageAccountant(category="temporary")
    with acc:
        keep = torch.empty(10)
        for _ in range(3000):  # 6000+ events: the log is folded on the way
            t = torch.empty(25)
            del t
        assert acc.take_peaks("cpu") == (140, 140)
        del keep
    assert acc.total_bytes("cpu") == 0
    acc.close()


def test_device_name():
    assert device_name("cpu") == "cpu"
    assert device_name(torch.device("cuda", 1)) == "cuda:1"
    assert device_name("sim") == "sim"  # unknown to torch: kept as is
    if not torch.cuda.is_available():
        assert device_name("cuda") == "cuda:0"
    with pytest.raises(TypeError, match="device must be a str or torch.device, got int"):
        device_name(0)
