"""Fixtures shared by test files."""

from __future__ import annotations

import threading
import time

import pytest

from memsched.optim.early_update import EarlyUpdates
from memsched.optim.hybrid_adamw import HybridAdamW


@pytest.fixture
def slow_early_worker(monkeypatch):
    """Updates on the worker start 20 ms late (during backward: 10 ms), so that reads that do not wait and
    commits of unfinished updates show as wrong numbers."""
    main = threading.get_ident()
    calls = {"early": 0, "step": 0}
    original_host, original_early = HybridAdamW._update_host, EarlyUpdates._run

    def slowed_host(self, *args, **kwargs):
        if threading.get_ident() != main:
            calls["step"] += 1
            time.sleep(0.02)
        return original_host(self, *args, **kwargs)

    def slowed_early(self, *args, **kwargs):
        calls["early"] += 1
        time.sleep(0.01)
        return original_early(self, *args, **kwargs)

    monkeypatch.setattr(HybridAdamW, "_update_host", slowed_host)
    monkeypatch.setattr(EarlyUpdates, "_run", slowed_early)
    return calls


@pytest.fixture(autouse=True)
def no_saved_tensor_hooks_outlive_a_test():
    """Nothing memsched installs outlives its scheduler: after every test this thread's stack of saved-tensor
    hooks is as it was before it (a left-over pack hook would see every tensor any later code saves)."""
    import torch

    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    yield
    left = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if left != top:
        while torch._C._autograd._top_saved_tensors_default_hooks(False) != top:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        pytest.fail(f"saved-tensor hooks left on the stack: {left}")
