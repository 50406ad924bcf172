"""Out-of-memory errors on the stand-in carry memsched's numbers and explanation ([Note: the stand-in's
out-of-memory error] in ``memsched/devices/sim_backend.cpp``): in a forward, in a backward (on autograd's
device thread) and at attach, the allocator raises :class:`SimOutOfMemoryError`, still a
``torch.OutOfMemoryError``, with ``capacity``, ``requested`` and ``in_use`` (bytes) and a message that says
them; a CUDA out-of-memory error gets the same numbers (:func:`add_oom_numbers`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memsched
from memsched.devices import sim_backend, simdevice
from memsched.devices.simdevice import OUT_OF_MEMORY, SimOutOfMemoryError
from tests._numerics import SIM


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 1))


class Hungry(torch.autograd.Function):
    """Its backward allocates 4 MiB on the gradient's device."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        torch.empty(1 << 20, device=g.device)
        return g


def _check(e: BaseException, capacity: int) -> str:
    """The numbers an out-of-memory error on the stand-in carries, and its message; returns the message."""
    assert isinstance(e, OUT_OF_MEMORY) and isinstance(e, SimOutOfMemoryError)
    assert e.capacity == capacity
    assert e.in_use + sim_backend.counted_bytes(e.requested) > e.capacity  # why it did not fit
    msg = str(e)
    assert "tried to allocate" in msg and f"({e.requested} bytes)" in msg
    assert f"({e.in_use} bytes) allocated" in msg and "of a capacity of" in msg
    assert f"({capacity} bytes)" in msg
    assert " requested with " in msg and " in use, " in msg
    assert "\nmemsched: " in msg  # memsched's explanation or what to do
    return msg


def _warm(sched, model, x, steps: int = 2) -> None:
    for _ in range(steps):
        sched.backward(model(x).pow(2).mean())
        sched.optimizer.step()
        sched.optimizer.zero_grad()


def test_in_a_forward_after_warmup():
    model = mlp()
    cap = 300 << 10
    sched = memsched.attach(model, device=f"sim:{cap}B")
    with sched:
        _warm(sched, model, torch.randn(8, 64).to(SIM))
        with sched.sim.paused():
            big = torch.randn(2048, 64).to(SIM)
        with pytest.raises(OUT_OF_MEMORY) as e:
            model(big)
        msg = _check(e.value, cap)
        assert e.value.requested == 2048 * 128 * 4  # the first layer's output
        assert "do not fit the device even with every optimizer-state chunk on the host" in msg  # the plan's
        sched.optimizer.zero_grad()  # the retry loop's: the next step runs (small enough here)
        _warm(sched, model, torch.randn(8, 64).to(SIM), steps=1)


@pytest.mark.parametrize("how", ["loss.backward", "sched.backward"])
def test_in_a_backward(how):
    model = mlp()
    cap = 1 << 20
    sched = memsched.attach(model, device=f"sim:{cap}B")
    x = torch.randn(8, 64).to(SIM)
    with sched:
        _warm(sched, model, x)
        loss = Hungry.apply(model(x)).pow(2).mean()
        with pytest.raises(OUT_OF_MEMORY) as e:
            loss.backward() if how == "loss.backward" else sched.backward(loss)
        msg = _check(e.value, cap)
        assert e.value.requested == 4 << 20
        assert simdevice.RETRY_HINT in msg  # chunks are on the device: re-planning makes room
        sched.optimizer.zero_grad()
        _warm(sched, model, x, steps=1)  # and training goes on


def test_at_attach():
    with pytest.raises(OUT_OF_MEMORY) as e:
        memsched.attach(mlp(), device="sim:1KiB")
    msg = _check(e.value, 1024)
    assert simdevice.CAPACITY_HINT in msg
    assert sim_backend.capacity() > 1024  # the failed attach lifted its cap


def test_in_warmup_the_scheduler_explains_it():
    model = mlp()
    cap = 300 << 10
    sched = memsched.attach(model, device=f"sim:{cap}B")
    with sched:
        with sched.sim.paused():
            big = torch.randn(1024, 64).to(SIM)
        with pytest.raises(OUT_OF_MEMORY) as e:
            sched.backward(model(big).pow(2).mean())
        msg = _check(e.value, cap)
        assert "memsched: the warmup step ran out of memory" in msg
        assert msg.count("memsched: the warmup step") == 1  # explained once, not again where it was caught
        sched.optimizer.zero_grad()


def test_without_a_scheduler_the_message_says_what_caps_the_stand_in():
    held = sim_backend.capacity()
    sim_backend.set_capacity(sim_backend.memory_allocated() + 4096)
    try:
        with pytest.raises(OUT_OF_MEMORY) as e:
            torch.empty(2000, device=SIM)
    finally:
        sim_backend.set_capacity(held)
    assert e.value.requested == 8000 and simdevice.CAPACITY_HINT in str(e.value)


def test_a_cuda_out_of_memory_error_gets_the_same_numbers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5 << 20)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 80 << 30))
    e = OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 12.00 MiB. GPU 0 has a total capacity of 79 GiB")
    assert simdevice.add_oom_numbers(e, "cuda:0") is e
    assert (e.requested, e.in_use, e.capacity) == (12 << 20, 5 << 20, 80 << 30)
    msg = str(e)
    assert msg.startswith("CUDA out of memory.")
    assert f"({12 << 20} bytes) requested with 5.0 MiB ({5 << 20} bytes) allocated by tensors" in msg
    assert f"({80 << 30} bytes)" in msg
    simdevice.add_oom_numbers(e, "cuda:0")
    assert str(e) == msg  # once
    stand_in = SimOutOfMemoryError(100, 0, 10)
    assert simdevice.add_oom_numbers(stand_in, "cuda:0") is stand_in and str(stand_in).count("\n") == 0
    other = RuntimeError("CUDA out of memory")
    assert simdevice.add_oom_numbers(other) is other and not hasattr(other, "capacity")
