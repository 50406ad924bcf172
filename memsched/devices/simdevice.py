"""The stand-in accelerator's capacity, as memsched's scheduler sees it.

``device="sim:8GiB"`` trains on ``torch.device("sim")``, the PrivateUse1 backend of
:mod:`memsched.devices.sim_backend`: device tensors whose memory is host memory, counted and capped by the
backend's allocator like a GPU's (allocations rounded up to 512 B, as CUDA's caching allocator rounds them).
From :func:`memsched.attach` until ``sched.close()`` the allocator's capacity is the stand-in's size; an
allocation beyond it raises ``torch.OutOfMemoryError`` from the allocator, as CUDA's does. Everything on the
device counts, whoever made it (a reference model on ``sim`` too), and nothing on the host does: host
memory (pinned buffers, datasets, an EMA on the CPU) is ordinary CPU memory.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memsched.devices import sim_backend
from policies.units import format_bytes

# torch.OutOfMemoryError exists from torch 2.5; torch 2.4 has the same class as torch.cuda.OutOfMemoryError.
_OOM_BASE: type[Exception] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
OUT_OF_MEMORY = _OOM_BASE  # what a CUDA or stand-in allocation raises when the device is full
_UNLIMITED = (1 << 63) - 1
_ACTIVE: list[SimDevice] = []  # stand-ins in use, the latest last: its capacity is the allocator's


class SimOutOfMemoryError(_OOM_BASE):  # type: ignore[misc,valid-type]
    """The stand-in device cannot hold what a step will allocate (raised by :meth:`SimDevice.require`; the
    allocator itself raises torch's ``OutOfMemoryError``). Attributes (bytes): ``requested``, ``in_use``
    (before the request), ``capacity``."""

    def __init__(self, requested: int, in_use: int, capacity: int, what: str = "an allocation") -> None:
        self.requested, self.in_use, self.capacity = int(requested), int(in_use), int(capacity)
        super().__init__(
            f"stand-in device out of memory: {what} of {format_bytes(requested)} ({requested} bytes) "
            "requested, "
            f"{format_bytes(in_use)} ({in_use} bytes) in use, capacity {format_bytes(capacity)} "
            f"({capacity} bytes); free {format_bytes(max(0, capacity - in_use))}"
        )


class SimDevice:
    """The stand-in's capacity while a scheduler uses it.

    Args:
        capacity_bytes: the device's size, bytes.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"stand-in capacity must be a positive number of bytes, got {capacity_bytes!r}")
        sim_backend.load()
        self.capacity_bytes = capacity_bytes
        # the scheduler's context for an out-of-memory error (f(error) -> text or None)
        self.explain: Callable[[BaseException], str | None] | None = None
        self._active = False

    # ---- lifetime -----------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._active

    def start(self, resident: Iterable[torch.Tensor] = ()) -> None:
        """Cap the device at the capacity. ``resident`` is accepted for the callers' sake: tensors on the
        device are counted by the allocator already.

        Raises:
            SimOutOfMemoryError: what is on the device already exceeds the capacity.
        """
        if self._active:
            return
        used = self.live_bytes()
        if used > 0:  # what an earlier model left on the device may be garbage not yet collected
            gc.collect()
            used = self.live_bytes()
        for _ in range(25):  # [Note: the device thread at exit] in sim_backend: a backward that just
            if used <= self.capacity_bytes:  # returned may still hold its graph there for a moment
                break
            time.sleep(0.002)
            used = self.live_bytes()
        if used > self.capacity_bytes:
            gc.collect()
            used = self.live_bytes()
        if used > self.capacity_bytes:
            raise SimOutOfMemoryError(used, 0, self.capacity_bytes,
                                      "what is on the stand-in already (the model's parameters and buffers)")
        sim_backend.set_capacity(self.capacity_bytes)
        sim_backend.reset_peak_memory_stats()
        self._active = True
        _ACTIVE.append(self)

    def stop(self) -> None:
        """Lift the cap (idempotent); another stand-in still in use (two schedulers) keeps its own."""
        if self._active:
            self._active = False
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            sim_backend.set_capacity(_ACTIVE[-1].capacity_bytes if _ACTIVE else _UNLIMITED)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work inside is not the training's (re-entrant): device allocations made on this thread are not
        counted against the capacity or in the peaks, and this thread's dispatch modes (the warmup tracer)
        are lifted, so they do not see it either. Host work needs neither (host tensors are CPU tensors), but
        memsched's checkpoint staging, or a reference model kept beside the scheduler's data, is left out."""
        with sim_backend.uncounted(), _disable_current_modes():
            yield

    # ---- accounting ---------------------------------------------------------------------------------------
    @property
    def peak_bytes(self) -> int:
        """Peak bytes on the device since the last :meth:`reset_peak`."""
        return sim_backend.max_memory_allocated()

    @property
    def peak_fixed_bytes(self) -> int:
        """Peak of the bytes on the device less :attr:`moving_bytes`, since the last :meth:`reset_peak`."""
        return sim_backend.max_fixed_bytes()

    @property
    def moving_bytes(self) -> int:
        """Live model data that comes and goes within a step (parameters fetched for their reads), bytes."""
        return sim_backend.moving_bytes()

    def reset_peak(self) -> int:
        """Restart the peak counters from the bytes live now; returns them (bytes)."""
        sim_backend.reset_peak_memory_stats()
        return self.live_bytes()

    def move(self, nbytes: int) -> None:
        """``nbytes`` more (or, negative, fewer) of the live bytes are model data that comes and goes within a
        step: :attr:`peak_fixed_bytes` leaves them out. Called before a fetched buffer is allocated and after
        it is dropped, so the figure never counts one."""
        sim_backend.move(nbytes)

    def live_bytes(self) -> int:
        """Bytes allocated on the stand-in right now, bytes."""
        return sim_backend.memory_allocated()

    def _explained(self, e: SimOutOfMemoryError) -> SimOutOfMemoryError:
        note = self.explain(e) if self.explain is not None else None
        if note:
            e.args = (f"{e.args[0]}\n{note}", *e.args[1:])
        return e

    def require(self, nbytes: int, what: str = "an allocation") -> None:
        """Check that ``nbytes`` more fit now (before a step that will allocate them).

        Raises:
            SimOutOfMemoryError: they do not.
        """
        if not self._active or nbytes <= 0:
            return
        used = self.live_bytes()
        if used + nbytes > self.capacity_bytes:
            raise self._explained(SimOutOfMemoryError(nbytes, used, self.capacity_bytes, what))
