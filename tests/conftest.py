"""Fixtures shared by test files."""

from __future__ import annotations

import threading
import time

import pytest

from memsched.optim.early_update import EarlyUpdates
from memsched.optim.hybrid_adamw import HybridAdamW
from tests._devices import TARGETS, Target, make_target


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


@pytest.fixture(params=TARGETS)
def target(request) -> Target:
    """The device a device-path test body runs on: ``sim`` (the stand-in) everywhere, ``cuda`` where a GPU
    exists (marked ``cuda``). See ``tests/_devices.py``."""
    return make_target(request.param)


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


def _cuda_session(config) -> bool:
    """``-m cuda`` (not ``not cuda``) on a machine with CUDA: the CUDA tests alone, without the stand-in."""
    import torch

    expr = config.option.markexpr or ""
    return torch.cuda.is_available() and "cuda" in expr and "not cuda" not in expr


def pytest_configure(config):
    """The stand-in device (``device="sim:SIZE"``) is loaded before any test runs a backward: torch's autograd
    sizes its device threads at the process's first backward. Not in a CUDA session (``-m cuda``): a process
    that loaded the stand-in cannot run a backward on CUDA ([Note: one accelerator per process] in
    ``memsched/devices/sim_backend.py``)."""
    import gc

    from memsched.devices import sim_backend

    if getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller: it runs no test, its workers load what they need (issue 43)
    if not _cuda_session(config):
        sim_backend.load()
    # Every attach on the stand-in collects garbage first (an earlier model's tensors on the device count):
    # the objects of the imported libraries are frozen out of those collections, which keeps each cheap.
    for name in ("transformers", "accelerate", "memsched.scheduler", "torch._dynamo"):
        try:
            __import__(name)
        except ImportError:
            pass
    gc.freeze()


@pytest.fixture(autouse=True)
def nothing_left_on_the_stand_in():
    """A test that failed (or an expected failure) leaves its frames, and with them its model on the stand-in,
    in ``sys.last_traceback`` (kept for post-mortem debugging): drop them, so that the next test has the
    stand-in's whole capacity."""
    import gc
    import sys

    held = [name for name in ("last_type", "last_value", "last_traceback", "last_exc") if hasattr(sys, name)]
    for name in held:
        delattr(sys, name)
    if held:
        gc.collect()


def pytest_runtest_setup(item):
    """A CUDA test in a process that loaded the stand-in cannot run its backward (torch takes the stand-in as
    the process's accelerator): skip it with the command that runs it."""
    if item.get_closest_marker("cuda") is None:
        return
    from memsched.devices import sim_backend

    if sim_backend.is_loaded():
        pytest.skip("this process loaded the stand-in device, which torch then takes as its accelerator in "
                    "CUDA's place (pytorch/pytorch#161129): run the CUDA tests as `python -m pytest -m cuda`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (several processes, a compile) run first, in their order: the workers share them
    while the quick ones are left to fill in, instead of one worker finishing a slow test alone at the end
    (CI's 2 cores, issue 43)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
