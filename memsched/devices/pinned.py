"""Pinned host memory at its exact size: what memsched's host chunks are made of.

PyTorch's pinned allocator (``CachingHostAllocator``, behind ``torch.empty(..., pin_memory=True)`` and
``Tensor.pin_memory()``) rounds every allocation up to a power of two, with ``cudaHostAlloc`` and with
``pinned_use_cuda_host_register`` alike: a 4.1 GiB chunk takes 8 GiB, and a plan of 39.5 GiB of optimizer
state took 68 GiB on the H100 host of 2026-11-26 (``bench/results/plan_*.json``; vLLM #56410 and SGLang #36562
report the same loss). memsched pins its host buffers itself, at their size rounded up to the page:

* **CUDA**: anonymous ``mmap`` memory (page-aligned, exact pages, pageable), registered with the driver by
  ``cudaHostRegister`` (``torch.cuda.cudart()``), so that copies from and to it are asynchronous DMA as from
  ``cudaHostAlloc`` memory, and ``is_pinned()`` holds. It is unregistered when the last tensor viewing it is
  freed (see :func:`pin_empty`). Chosen over one pinned arena carved into chunks (one
  ``cudaHostAlloc`` would round the whole arena to a power of two, and ``cudaHostAlloc`` cannot give back
  part of an arena when the plan moves chunks to the device) and over torch's allocator settings (its
  rounding was seen with ``pinned_use_cuda_host_register`` too, and torch 2.4 must work as well).
  DeepSpeed's ``pin_memory`` of whole flat buffers pays the rounding.
* **The stand-in** (``sim``): its host allocator (:mod:`memsched.devices.sim_backend`) pins at the same page
  granularity and counts the bytes against ``sim:SIZE,host=SIZE``, so CI tests the same accounting.
* **The CPU device**: nothing is pinned (no device to copy to).

:func:`pinned_bytes` is the host memory one buffer takes, the figure the plans use.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import torch

from memsched.devices import sim_backend

__all__ = ["PAGE_BYTES", "can_pin", "pin_empty", "pinned_bytes", "registered_bytes"]

#: The granularity of pinned host memory: one page (``cudaHostRegister`` pins whole pages), bytes.
PAGE_BYTES = mmap.PAGESIZE


def pinned_bytes(nbytes: int, *, pinned: bool = True) -> int:
    """Host memory a buffer of ``nbytes`` bytes takes: rounded up to :data:`PAGE_BYTES` when pinned, exact
    otherwise; bytes (0 for ``nbytes <= 0``)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES if pinned else nbytes


_registered = {"live": 0, "peak": 0}
_lock = threading.Lock()


def registered_bytes() -> tuple[int, int]:
    """``(live, peak)`` bytes of host memory memsched has registered with CUDA in this process (pages; the
    stand-in's pinned memory is :func:`memsched.devices.sim_backend.pinned_bytes`)."""
    with _lock:
        return _registered["live"], _registered["peak"]


def _count(nbytes: int) -> None:
    with _lock:
        _registered["live"] += nbytes
        _registered["peak"] = max(_registered["peak"], _registered["live"])


def can_pin(device: torch.device) -> bool:
    """Whether host buffers for ``device`` are pinned: CUDA (with a CUDA runtime) and the stand-in."""
    return (device.type == "cuda" and torch.cuda.is_available()) or device.type == "sim"


def pin_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat ``torch.uint8`` CPU tensor of ``nbytes`` bytes (uninitialised on the stand-in, zeros on CUDA)
    of pinned host memory for copies to and from ``device``; pageable memory where :func:`can_pin` is False.

    [Note: the registration's lifetime]
    On CUDA the tensor views a ``memoryview`` of an anonymous ``mmap``; ``torch.frombuffer`` keeps that
    memoryview alive until the last tensor sharing the storage is freed (slices and dtype views included).
    A finalizer of the memoryview then unregisters the pages, and only after that drops the mapping (the
    finalizer holds it): the pages are never unmapped while registered, nor unregistered while memsched's
    chunks still read them, and nobody has to remember to free them.

    Raises:
        ValueError: ``nbytes`` < 0.
        RuntimeError: ``cudaHostRegister`` failed (the CUDA error named).
        torch.OutOfMemoryError: the stand-in host is full (``sim:SIZE,host=SIZE``).
    """
    if nbytes < 0:
        raise ValueError(f"a pinned buffer of {nbytes} bytes: the size must be >= 0")
    if not can_pin(device):
        return torch.empty(nbytes, dtype=torch.uint8)
    if device.type != "cuda":  # the stand-in's own pinned memory, also where CUDA is available
        return sim_backend.pinned_empty(nbytes)
    size = pinned_bytes(max(nbytes, 1))
    mapping = mmap.mmap(-1, size)  # anonymous: page-aligned, exact pages
    view = memoryview(mapping)
    whole = torch.frombuffer(view, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(whole.data_ptr(), size, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes of host memory failed: {err!r} (the host may "
                           "limit page-locked memory: set host_memory= lower, or keep more on the device)")
    _count(size)
    weakref.finalize(view, _unregister, cudart, whole.data_ptr(), size, mapping)
    return whole[:nbytes]


def _unregister(cudart, ptr: int, size: int, _mapping: mmap.mmap) -> None:
    # _mapping: held until the pages are unregistered (see [Note: the registration's lifetime])
    cudart.cudaHostUnregister(ptr)
    _count(-size)
