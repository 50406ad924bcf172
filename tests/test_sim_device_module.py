"""What training code calls on the stand-in's device module (``torch.sim``) and on ``torch.accelerator``: the
memory counters, their peaks, ``empty_cache`` and ``synchronize`` ([Note: the stand-in's allocator and
torch.accelerator] in ``memsched/devices/sim_backend.cpp``). Every figure is bytes, read as a difference from
what other tests left on the device."""

from __future__ import annotations

import pytest
import torch

from memsched.devices import sim_backend
from memsched.devices.simdevice import OUT_OF_MEMORY


@pytest.fixture(autouse=True)
def _the_stand_in():
    if not sim_backend.is_loaded():
        pytest.skip("the stand-in is not loaded in this process (a CUDA session)")


def _accelerator_is_the_stand_in() -> bool:
    acc = getattr(torch, "accelerator", None)
    current = acc.current_accelerator() if acc is not None and hasattr(acc, "current_accelerator") else None
    return current is not None and current.type == "sim"


def test_the_device_modules_memory_functions():
    mod = torch.sim
    base = mod.memory_allocated()
    stats_before = mod.memory_stats()
    x = torch.empty(1000, device="sim")  # 4000 bytes, a 4096-byte block
    assert mod.memory_allocated() == base + 4096
    assert mod.memory_reserved() == mod.memory_allocated()  # nothing is cached
    mod.reset_peak_memory_stats()
    assert mod.max_memory_allocated() == mod.max_memory_reserved() == base + 4096
    y = torch.empty(2000, device="sim")  # 8192 bytes
    del y
    assert mod.max_memory_allocated() == base + 4096 + 8192 and mod.memory_allocated() == base + 4096
    mod.reset_peak_memory_stats()
    assert mod.max_memory_allocated() == base + 4096
    stats = mod.memory_stats()
    assert stats["allocated_bytes.all.current"] == base + 4096
    assert stats["requested_bytes.all.current"] - stats_before["requested_bytes.all.current"] == 4000
    assert stats["allocation.all.current"] - stats_before["allocation.all.current"] == 1
    assert stats["allocated_bytes.all.freed"] - stats_before["allocated_bytes.all.freed"] >= 8192
    mod.reset_accumulated_memory_stats()
    assert mod.memory_stats()["allocated_bytes.all.freed"] == 0
    assert mod.empty_cache() is None and mod.memory_allocated() == base + 4096  # nothing cached to release
    assert mod.synchronize() is None
    free, total = mod.mem_get_info()
    assert total == sim_backend.capacity() and free == max(0, total - mod.memory_allocated())
    del x
    assert mod.memory_allocated() == base


@pytest.mark.skipif(not hasattr(getattr(torch, "accelerator", None), "memory_allocated"),
                    reason="torch.accelerator has no memory functions before torch 2.9")
def test_torch_accelerator_memory_functions_read_the_stand_ins_allocator():
    if not _accelerator_is_the_stand_in():
        pytest.skip("torch names another accelerator in this process")
    acc = torch.accelerator
    base = acc.memory_allocated()
    assert base == sim_backend.memory_allocated()
    x = torch.empty(1000, device="sim")
    assert acc.memory_allocated() == base + 4096 == torch.sim.memory_allocated()
    assert acc.memory_reserved() == acc.memory_allocated()
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == base + 4096
    y = torch.empty(2000, device="sim")
    del y
    assert acc.max_memory_allocated() == base + 4096 + 8192
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == base + 4096 == acc.max_memory_reserved()
    assert acc.memory_stats()["requested_bytes.all.current"] == torch.sim.memory_stats()[
        "requested_bytes.all.current"]
    assert acc.empty_cache() is None and acc.memory_allocated() == base + 4096
    assert acc.synchronize() is None
    if hasattr(acc, "get_memory_info"):
        free, total = acc.get_memory_info()
        assert total == sim_backend.capacity() and free == max(0, total - acc.memory_allocated())
    del x
    assert acc.memory_allocated() == base


def test_out_of_memory_errors_are_counted():
    before = torch.sim.memory_stats()["num_ooms"]
    held = sim_backend.capacity()
    sim_backend.set_capacity(sim_backend.memory_allocated() + 4096)
    try:
        with pytest.raises(OUT_OF_MEMORY):
            torch.empty(10_000, device="sim")
    finally:
        sim_backend.set_capacity(held)
    assert torch.sim.memory_stats()["num_ooms"] == before + 1
