"""The stand-in device: device strings, capacity accounting, out-of-memory errors with numbers."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import memsched
import policies
from memsched.chunks import PARAM_ALIGN
from memsched.devices import sim_backend
from memsched.devices.simdevice import OUT_OF_MEMORY, SimDevice, SimOutOfMemoryError
from memsched.devices.spec import parse_device
from policies.types import DEVICE, HOST
from tests._numerics import SIM, same


def blocks(nbytes: int) -> int:
    """``nbytes`` as the stand-in's allocator counts them: rounded up to 512 B blocks, as CUDA's."""
    return -(-nbytes // 512) * 512


def storage_bytes(*tensors: torch.Tensor) -> int:
    """What the allocator counts for these tensors' storages (views of one buffer count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(blocks(n) for n in storages.values())


@pytest.mark.parametrize("text, cap", [("sim:8GiB", 8 * 2**30), ("sim:512MB", 512 * 10**6),
                                       ("SIM:1.5 KiB", 1536), ("sim:4096", 4096), ("sim:3kb", 3000)])
def test_sim_sizes(text, cap):
    d = parse_device(text)
    assert d.kind == "sim" and d.capacity_bytes == cap and d.torch_device == torch.device("sim", 0)
    assert d.name == "sim:0" and d.is_sim


@pytest.mark.parametrize("text", ["sim:0B", "sim:-1GiB", "sim:lots", "gpu", "cuda:x", "", 3])
def test_bad_device_strings(text):
    with pytest.raises(ValueError, match="allowed|capacity must be > 0|bad device|device must be one of"):
        parse_device(text)


def test_cpu_device():
    d = parse_device("cpu")
    assert d.kind == "cpu" and d.capacity_bytes > 0


def test_allocation_beyond_capacity_raises_with_numbers():
    sim = SimDevice(1 << 20)
    sim.start()
    try:
        base = sim.live_bytes()  # nothing of this test's yet
        a = torch.empty(200_000, dtype=torch.float32, device=SIM)  # 800000 bytes (800256 in blocks): fits
        assert sim.live_bytes() == base + 800_256 and sim.peak_bytes == base + 800_256
        with pytest.raises(OUT_OF_MEMORY) as e:  # the allocator's error, as CUDA's
            torch.empty(100_000, dtype=torch.float32, device=SIM)  # 400000 more: does not
        assert isinstance(e.value, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))
        msg = str(e.value)
        assert "sim out of memory" in msg and "(400000 bytes)" in msg and "(1048576 bytes)" in msg
        assert f"({base + 800_256} bytes) allocated" in msg
        assert sim.live_bytes() == base + 800_256  # the refused allocation left nothing
        host = torch.empty(1_000_000, dtype=torch.float32)  # host memory: never counted
        assert sim.live_bytes() == base + 800_256
        with sim.paused():  # device memory that is not the training's: not counted, not in the peak
            b = torch.empty(1_000_000, dtype=torch.float32, device=SIM)
        assert sim.live_bytes() == base + 800_256 and sim.peak_bytes == base + 800_256
        del b
        assert sim.live_bytes() == base + 800_256  # freeing it gives back nothing that was counted
        del a
        c = torch.empty(100_000, dtype=torch.float32, device=SIM)  # freed bytes are available again
        assert sim.live_bytes() == base + blocks(400_000)
        assert sim.reset_peak() == base + blocks(400_000) == sim.peak_bytes
        with pytest.raises(SimOutOfMemoryError, match="optimizer step temporaries") as e:
            sim.require(2 << 20, "optimizer step temporaries")
        err = e.value
        assert isinstance(err, OUT_OF_MEMORY)
        assert (err.requested, err.in_use, err.capacity) == (2 << 20, base + blocks(400_000), 1 << 20)
        assert "2097152 bytes" in str(err) and "1048576 bytes" in str(err)
        with pytest.raises(AttributeError):  # the peaks are the allocator's: read-only
            sim.peak_bytes = 0
    finally:
        sim.stop()
    d = torch.empty(10_000_000, device=SIM)  # no cap any more
    del c, d, host


def test_resident_tensors_that_do_not_fit():
    keep = torch.zeros(1000, device=SIM)  # 4000 bytes on the device before the cap
    sim = SimDevice(1000)
    with pytest.raises(SimOutOfMemoryError, match="parameters and buffers") as e:
        sim.start([keep])
    assert e.value.requested >= blocks(keep.nbytes) and e.value.capacity == 1000
    assert not sim.active
    big = torch.empty(1_000_000, device=SIM)  # the device was not capped
    del big, keep


def test_host_placed_chunks_are_not_counted():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    gc.collect()
    before = sim_backend.memory_allocated()  # what earlier tests still hold on the device
    with memsched.attach(m, policy="cpu", device="sim:64MiB", chunk_numel=4160) as sched:
        # no gradient buffer before a backward makes one
        assert all(c.grad is None for c in sched.store.chunks)
        assert all(c.data.device.type == "sim" for c in sched.store.chunks)
        assert all(c.master is None or c.master.device.type == "cpu" for c in sched.store.chunks)
        resident = sum(blocks(c.data.nbytes) for c in sched.store.chunks)
        # host state (master, moments, host grads) not counted
        assert sched.sim.live_bytes() == before + resident
        c = sched.store.chunks[0]
        assert c.exp_avg.device.type == "cpu"
        c.move_to(DEVICE, sched.store.alloc)
        assert c.exp_avg.device.type == "sim"
        state = storage_bytes(c.exp_avg, c.exp_avg_sq, c.steps)  # moments and step counts: one buffer
        assert state >= blocks(c.exp_avg.nbytes + c.exp_avg_sq.nbytes + c.steps.nbytes)
        assert sched.sim.live_bytes() == before + resident + state
        c.move_to(HOST, sched.store.alloc)
        assert c.exp_avg.device.type == "cpu"
        assert sched.sim.live_bytes() == before + resident


def test_cuda_policy_on_a_too_small_stand_in_gives_the_numbers():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    # Resident chunk buffers 65 KiB, optimizer state 65 KiB: the state cannot all be on a 100 KiB device.
    with memsched.attach(m, policy="cuda", device="sim:100KiB", chunk_numel=4160) as sched:
        sched.backward(m(torch.randn(4, 64).to(SIM)).sum())
        with pytest.raises(policies.PlacementError) as e:
            sched.optimizer.step()
        msg = str(e.value)
        assert "100.0 KiB" in msg and "short by" in msg and "stays on the host" in msg
        assert sched.plan is None and all(c.placement == HOST for c in sched.store.chunks)
        # Training goes on with the state on the host.
        with sched.sim.paused():  # a copy for the test, not device memory
            before = m[0].weight.detach().clone()
        sched.optimizer.zero_grad()
        sched.backward(m(torch.randn(4, 64).to(SIM)).sum())
        sched.optimizer.step()
        assert not same(before, m[0].weight)


def test_forward_beyond_capacity_raises_out_of_memory():
    torch.manual_seed(0)
    m = nn.Linear(64, 64)
    with memsched.attach(m, policy="cpu", device="sim:100KiB") as sched:
        x = torch.ones(200, 64, device=SIM)  # 50 KiB of inputs on the device, beside the chunk: fit
        assert sched.sim.live_bytes() < 100 * 1024 < sched.sim.live_bytes() + x.nbytes  # the output does not
        with pytest.raises(OUT_OF_MEMORY, match=r"sim out of memory: tried to allocate .*\(51200 bytes\)"):
            sched.model(x)


def test_frozen_parameters_count_as_resident():
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    m[1].requires_grad_(False)
    frozen = sum(p.numel() for p in m[1].parameters())
    gc.collect()
    before = sim_backend.memory_allocated()  # what earlier tests still hold on the device
    with memsched.attach(m, policy="cpu", device="sim:1MiB") as sched:
        # no gradient buffer before backward; the frozen layer in chunks of its own (issue 31), on the device
        # with policy cpu (no optimizer state to place)
        resident = sum(blocks(c.data.nbytes) for c in sched.store.chunks)
        held = [c for c in sched.store.chunks if c.frozen]
        assert sum(n for c in held for _off, n in c.ranges) == frozen
        assert all(c.numel % PARAM_ALIGN == 0 for c in held)  # [Note: parameter alignment in chunks]
        assert all(p.device.type == "sim" for p in m[1].parameters())
        assert sched.sim.live_bytes() == before + resident


def test_step_that_does_not_fit_raises_before_changing_anything():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with memsched.attach(m, policy="cuda", device="sim:4MiB", dtype=torch.bfloat16) as sched:
        x = torch.randn(4, 64, dtype=torch.bfloat16).to(SIM)
        sched.backward(m(x).float().sum())
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        assert all(c.placement == DEVICE for c in sched.store.chunks)
        sched.backward(m(x).float().sum())
        # Mixed precision updates a device chunk from an fp32 copy of its gradients: leave no room for it.
        sched.sim.capacity_bytes = sched.sim.live_bytes() + 1024
        sim_backend.set_capacity(sched.sim.capacity_bytes)  # the allocator's cap too (restored at close)
        with sched.sim.paused():
            before = [t.clone() for c in sched.store.chunks for t in (c.data, c.master, c.exp_avg, c.steps)]
        with pytest.raises(SimOutOfMemoryError, match="optimizer step temporaries"):
            sched.optimizer.step()
        after = [t for c in sched.store.chunks for t in (c.data, c.master, c.exp_avg, c.steps)]
        assert all(same(a, b) for a, b in zip(before, after, strict=True))
        assert sched.transfers.steps == 1


def test_cuda_capacity_leaves_out_the_context_and_other_processes():
    from memsched.devices.spec import usable_bytes

    gib = 2**30
    # 80 GiB card: 1 GiB CUDA context + 9 GiB another process; this process's allocator holds 2 GiB
    assert usable_bytes(80 * gib, free=68 * gib, reserved=2 * gib) == 70 * gib
    # a per-process fraction caps it
    assert usable_bytes(80 * gib, free=68 * gib, reserved=2 * gib, fraction=0.5) == 40 * gib
    assert usable_bytes(80 * gib, free=10 * gib, reserved=0, fraction=0.5) == 10 * gib
