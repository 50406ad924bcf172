"""Pinned host memory at its size (memsched.devices.pinned): page-rounded, never a power of two; on CUDA
registered with cudaHostRegister for exactly as long as a tensor views it (CUDA's runtime faked here)."""

from __future__ import annotations

import gc

import pytest
import torch

from memsched.devices import sim_backend
from memsched.devices.pinned import PAGE_BYTES, pin_empty, pinned_bytes, registered_bytes


class FakeCudart:
    def __init__(self, fail: bool = False) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.fail = fail

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        self.calls.append(("register", ptr))
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        assert ptr % PAGE_BYTES == 0 and size % PAGE_BYTES == 0 and flags == 0
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        assert ptr in self.registered
        del self.registered[ptr]
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    return cudart


def test_pinned_bytes_round_to_the_page_not_to_a_power_of_two():
    assert pinned_bytes(0) == 0 and pinned_bytes(1) == PAGE_BYTES and pinned_bytes(PAGE_BYTES) == PAGE_BYTES
    big = 4 * 2**30 + 1  # a 4 GiB + 1 B chunk: torch's pinned allocator would take 8 GiB
    assert pinned_bytes(big) == 4 * 2**30 + PAGE_BYTES
    assert pinned_bytes(big, pinned=False) == big


def test_cuda_buffers_are_registered_at_their_size_until_the_last_view_is_freed(fake_cuda):
    cuda = torch.device("cuda", 0)
    live0, _ = registered_bytes()
    t = pin_empty(10_000, cuda)
    assert registered_bytes()[0] - live0 == 3 * PAGE_BYTES
    assert t.dtype == torch.uint8 and t.numel() == 10_000 and t.device.type == "cpu"
    (ptr, size), = fake_cuda.registered.items()
    assert ptr == t.data_ptr() and size == pinned_bytes(10_000) == 3 * PAGE_BYTES
    floats = t[:8000].view(torch.float32)  # a chunk's dtype view, made from a slice
    floats.fill_(1.5)
    del t
    gc.collect()
    assert fake_cuda.registered  # a view is alive: still registered
    assert float(floats.sum()) == 1.5 * 2000
    del floats
    gc.collect()
    assert not fake_cuda.registered and fake_cuda.calls == [("register", ptr), ("unregister", ptr)]
    assert registered_bytes()[0] == live0


def test_a_failed_registration_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(fail=True))
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 8192 bytes of host memory failed"):
        pin_empty(PAGE_BYTES + 1, torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"-1 bytes"):
        pin_empty(-1, torch.device("cuda", 0))


def test_the_stand_in_counts_pinned_memory_in_pages_and_cpu_buffers_are_not_pinned():
    sim = torch.device("sim", 0)
    before = sim_backend.pinned_bytes()
    t = pin_empty(PAGE_BYTES + 1, sim)
    assert t.is_pinned() and t[PAGE_BYTES:].is_pinned()
    assert sim_backend.pinned_bytes() - before == 2 * PAGE_BYTES
    del t
    assert sim_backend.pinned_bytes() == before
    assert not pin_empty(100, torch.device("cpu")).is_pinned()
