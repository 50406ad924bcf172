"""Nothing memsched installs in the process outlives its scheduler: closed, dropped without close() (also
after an exception in the traced step), two stand-in schedulers closed out of order, many cycles."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import memsched
from tests._numerics import SIM


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def hooks(model: nn.Module) -> int:
    n = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
            + len(m._state_dict_pre_hooks) for m in model.modules())
    return n + sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


def process_state(model: nn.Module) -> tuple[int, int, int, int, int]:
    return (len(_get_current_dispatch_mode_stack()), torch._C._len_torch_function_stack(), hooks(model),
            len(_global_optimizer_post_hooks), len(_global_optimizer_pre_hooks))


def step(sched, model, x):
    sched.backward(model(x).pow(2).mean())
    sched.optimizer.step()
    sched.optimizer.zero_grad()


def test_a_scheduler_dropped_without_close_cleans_up():
    model, x = net(), torch.randn(8, 16, device=SIM)
    before = process_state(model)
    sched = memsched.attach(model, device="sim:1MiB", warmup_steps=2)
    step(sched, model, x)  # inside warmup: the tracer and the stand-in's accounting are both active
    assert process_state(model) != before
    del sched
    gc.collect()
    assert process_state(model) == before
    torch.zeros(1_000_000, device=SIM)  # 4 MB: the stand-in's capacity no longer applies to the process
    with memsched.attach(model, device="cpu"):  # and the model can be attached again
        pass


@pytest.mark.parametrize("close", [True, False])
def test_an_overlapped_scheduler_leaves_no_mode_after_its_last_step(slow_host_updates, close):
    """``overlap=True``: the guard of reads between steps is on after each step ([Note: reads between steps
    wait] in memsched.runtime.waits); close() or dropping the scheduler takes it off."""
    model, x = net(), torch.randn(8, 16, device=SIM)
    before = process_state(model)
    sched = memsched.attach(model, device="sim:8MiB", policy="cpu", overlap=True)
    for _ in range(3):
        step(sched, model, x)
    assert torch._C._len_torch_function_stack() == 1  # the last step's updates are still running
    if close:
        sched.close()
    del sched
    gc.collect()
    assert process_state(model) == before


@pytest.fixture
def slow_host_updates(monkeypatch):
    """Host-chunk updates on the worker thread start 50 ms late (so a step returns before they end)."""
    import threading
    import time

    from memsched.optim.hybrid_adamw import HybridAdamW

    original, main = HybridAdamW._update_host, threading.get_ident()

    def slowed(self, *args, **kwargs):
        if threading.get_ident() != main:
            time.sleep(0.05)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(HybridAdamW, "_update_host", slowed)


def test_an_exception_in_the_traced_step_then_drop_cleans_up():
    model = net()
    before = process_state(model)

    def train():
        sched = memsched.attach(model, device="cpu")
        sched.backward(model(torch.randn(8, 7)).sum())  # wrong input width: raises inside the traced forward

    with pytest.raises(RuntimeError):
        train()
    gc.collect()
    assert process_state(model) == before
    with memsched.attach(model, device="cpu"):
        pass


def test_two_stand_in_schedulers_closed_out_of_order():
    a, b = net(), net()
    x = torch.randn(8, 16, device=SIM)
    first = memsched.attach(a, device="sim:1MiB")
    second = memsched.attach(b, device="sim:64MiB")
    try:
        first.close()  # not the last one in: it must take only its own modes off the stack
        step(second, b, x)
        assert second.sim.active and second.plan is not None
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(20_000_000, device=SIM)  # 80 MB: the second stand-in still enforces its capacity
    finally:
        second.close()
    assert not _get_current_dispatch_mode_stack()


@pytest.mark.slow
def test_attach_close_cycles_leave_nothing_and_no_memory():
    model, x = net(), torch.randn(8, 16, device=SIM)
    before = process_state(model)

    def cycle(close: bool) -> None:
        sched = memsched.attach(model, device="sim:8MiB")
        step(sched, model, x)
        step(sched, model, x)
        if close:
            sched.close()

    for i in range(10):  # warm the allocator and torch's caches
        cycle(i % 2 == 0)
    gc.collect()
    rss = psutil.Process().memory_info().rss
    for i in range(40):  # a leak of 26 KB a cycle shows
        cycle(i % 2 == 0)
    gc.collect()
    growth = psutil.Process().memory_info().rss - rss
    assert process_state(model) == before
    assert growth < 1 << 20, growth


@pytest.mark.slow
def test_a_thousand_steps_leave_nothing_and_no_memory():
    model, x = net(), torch.randn(8, 16, device=SIM)
    before = process_state(model)
    with memsched.attach(model, device="sim:8MiB") as sched:
        for _ in range(50):
            step(sched, model, x)
        gc.collect()
        rss = psutil.Process().memory_info().rss
        during = process_state(model)
        for _ in range(1000):
            step(sched, model, x)
        gc.collect()
        growth = psutil.Process().memory_info().rss - rss
        assert process_state(model) == during  # no hook or mode piles up step after step
    assert process_state(model) == before
    assert growth < 1 << 20, growth
