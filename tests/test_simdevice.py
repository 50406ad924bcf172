"""The stand-in device: device strings, capacity accounting, out-of-memory errors with numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memsched
import policies
from memsched.devices.simdevice import SimDevice, SimOutOfMemoryError
from memsched.devices.spec import parse_device
from policies.types import DEVICE, HOST


@pytest.mark.parametrize("text, cap", [("sim:8GiB", 8 * 2**30), ("sim:512MB", 512 * 10**6),
                                       ("SIM:1.5 KiB", 1536), ("sim:4096", 4096), ("sim:3kb", 3000)])
def test_sim_sizes(text, cap):
    d = parse_device(text)
    assert d.kind == "sim" and d.capacity_bytes == cap and d.torch_device == torch.device("cpu")


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
        a = torch.empty(200_000, dtype=torch.float32)  # 800000 bytes: fits
        assert sim.live_bytes() >= 800_000
        with pytest.raises(SimOutOfMemoryError) as e:
            torch.empty(100_000, dtype=torch.float32)  # 400000 more: does not
        err = e.value
        assert isinstance(err, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))
        assert (err.requested, err.capacity) == (400_000, 1 << 20)
        assert err.in_use >= 800_000
        assert "400000 bytes" in str(err) and "1048576 bytes" in str(err)
        with sim.paused():  # host memory: not counted
            b = torch.empty(1_000_000, dtype=torch.float32)
        del a
        c = torch.empty(100_000, dtype=torch.float32)  # freed bytes are available again
        assert sim.live_bytes() < 800_000
        with pytest.raises(SimOutOfMemoryError, match="optimizer step temporaries"):
            sim.require(2 << 20, "optimizer step temporaries")
    finally:
        sim.stop()
    torch.empty(10_000_000)  # not counted any more
    del b, c


def test_resident_tensors_that_do_not_fit():
    sim = SimDevice(1000)
    with pytest.raises(SimOutOfMemoryError, match="frozen parameters and buffers"):
        sim.start([torch.zeros(1000)])
    assert not sim.active


def test_host_placed_chunks_are_not_counted():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with memsched.attach(m, policy="cpu", device="sim:64MiB", chunk_numel=4160) as sched:
        # no gradient buffer before a backward makes one
        assert all(c.grad is None for c in sched.store.chunks)
        resident = sum(c.data.nbytes for c in sched.store.chunks)
        assert sched.sim.live_bytes() == resident  # host state (master, moments, host grads) not counted
        c = sched.store.chunks[0]
        c.move_to(DEVICE, sched.store.alloc)
        assert sched.sim.live_bytes() == resident + c.exp_avg.nbytes + c.exp_avg_sq.nbytes + c.steps.nbytes
        c.move_to(HOST, sched.store.alloc)
        assert sched.sim.live_bytes() == resident


def test_cuda_policy_on_a_too_small_stand_in_gives_the_numbers():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    # Resident chunk buffers 65 KiB, optimizer state 65 KiB: the state cannot all be on a 100 KiB device.
    with memsched.attach(m, policy="cuda", device="sim:100KiB", chunk_numel=4160) as sched:
        sched.backward(m(torch.randn(4, 64)).sum())
        with pytest.raises(policies.PlacementError) as e:
            sched.optimizer.step()
        msg = str(e.value)
        assert "100.0 KiB" in msg and "short by" in msg and "stays on the host" in msg
        assert sched.plan is None and all(c.placement == HOST for c in sched.store.chunks)
        # Training goes on with the state on the host.
        with sched.sim.paused():  # a copy for the test, not device memory
            before = m[0].weight.detach().clone()
        sched.optimizer.zero_grad()
        sched.backward(m(torch.randn(4, 64)).sum())
        sched.optimizer.step()
        assert not torch.equal(before, m[0].weight)


def test_forward_beyond_capacity_raises_out_of_memory():
    torch.manual_seed(0)
    m = nn.Linear(64, 64)
    with memsched.attach(m, policy="cpu", device="sim:100KiB") as sched:
        with pytest.raises(SimOutOfMemoryError, match="requested"):
            sched.model(torch.ones(1024, 64, device="cpu"))  # 256 KiB of activations


def test_frozen_parameters_count_as_resident():
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    m[1].requires_grad_(False)
    frozen = sum(p.nbytes for p in m[1].parameters())
    with memsched.attach(m, policy="cpu", device="sim:1MiB") as sched:
        resident = sum(c.data.nbytes for c in sched.store.chunks)  # no gradient buffer before backward
        assert sched.sim.live_bytes() == resident + frozen


def test_step_that_does_not_fit_raises_before_changing_anything():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with memsched.attach(m, policy="cuda", device="sim:4MiB", dtype=torch.bfloat16) as sched:
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        sched.backward(m(x).float().sum())
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        assert all(c.placement == DEVICE for c in sched.store.chunks)
        sched.backward(m(x).float().sum())
        # Mixed precision updates a device chunk from an fp32 copy of its gradients: leave no room for it.
        sched.sim.capacity_bytes = sched.sim.live_bytes() + 1024
        with sched.sim.paused():
            before = [t.clone() for c in sched.store.chunks for t in (c.data, c.master, c.exp_avg, c.steps)]
        with pytest.raises(SimOutOfMemoryError, match="optimizer step temporaries"):
            sched.optimizer.step()
        after = [t for c in sched.store.chunks for t in (c.data, c.master, c.exp_avg, c.steps)]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert sched.transfers.steps == 1


def test_cuda_capacity_leaves_out_the_context_and_other_processes():
    from memsched.devices.spec import usable_bytes

    gib = 2**30
    # 80 GiB card: 1 GiB CUDA context + 9 GiB another process; this process's allocator holds 2 GiB
    assert usable_bytes(80 * gib, free=68 * gib, reserved=2 * gib) == 70 * gib
    # a per-process fraction caps it
    assert usable_bytes(80 * gib, free=68 * gib, reserved=2 * gib, fraction=0.5) == 40 * gib
    assert usable_bytes(80 * gib, free=10 * gib, reserved=0, fraction=0.5) == 10 * gib
