"""The stand-in accelerator: CPU tensors, GPU-like capacity accounting and out-of-memory errors.

``device="sim:8GiB"`` lets the whole pipeline (tracing -> plan -> chunk moves -> hybrid step) run, and be
tested, on a machine without a GPU. Tensors live on the CPU, but while the stand-in is active (from
:func:`memsched.attach` until ``sched.close()`` or the end of ``with memsched.attach(...) as sched``)
every CPU storage allocated is counted against the capacity, like memory on a GPU: the resident model data
(chunk compute and gradient buffers; frozen parameters and buffers, registered at attach), the device-placed
optimizer-state chunks, and the live non-model data of forward, backward and the step. Host-placed chunk
buffers are allocated inside :meth:`SimDevice.paused` and so are not counted. An allocation that would exceed
the capacity raises :class:`SimOutOfMemoryError` (a ``torch.OutOfMemoryError``), naming the request, the bytes
in use and the capacity.

The counting is :class:`tracer.accounting.StorageAccountant` (a ``TorchDispatchMode`` storage accountant) with
an ``on_allocate`` callback. Everything allocated on the CPU while it is active counts, the user's input
batches included: they would live on the device too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

from policies.units import format_bytes

# torch.OutOfMemoryError exists from torch 2.5; torch 2.4 has the same class as torch.cuda.OutOfMemoryError.
_OOM_BASE: type[Exception] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
OUT_OF_MEMORY = _OOM_BASE  # what a CUDA or stand-in allocation raises when the device is full


CPU = "cpu"  # the stand-in's tensors are CPU tensors


class SimOutOfMemoryError(_OOM_BASE):  # type: ignore[misc,valid-type]
    """The stand-in device cannot hold an allocation. Attributes (bytes): ``requested``, ``in_use`` (before
    the request), ``capacity``."""

    def __init__(self, requested: int, in_use: int, capacity: int, what: str = "an allocation") -> None:
        self.requested, self.in_use, self.capacity = int(requested), int(in_use), int(capacity)
        super().__init__(
            f"stand-in device out of memory: {what} of {format_bytes(requested)} ({requested} bytes) "
            "requested, "
            f"{format_bytes(in_use)} ({in_use} bytes) in use, capacity {format_bytes(capacity)} "
            f"({capacity} bytes); free {format_bytes(max(0, capacity - in_use))}"
        )


class SimDevice:
    """Capacity accounting of the stand-in device.

    Args:
        capacity_bytes: the device's size, bytes.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"stand-in capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.peak_bytes = 0
        # Model data that comes and goes within a step (parameters fetched for their reads, see
        # memsched.runtime.param_fetch): counted, and also left out of ``peak_fixed_bytes``.
        self.moving_bytes = 0
        self.peak_fixed_bytes = 0
        # the scheduler's context for an out-of-memory error (f(error) -> text or None)
        self.explain: Callable[[SimOutOfMemoryError], str | None] | None = None
        self._acc = None
        self._pause_depth = 0

    # ---- lifetime -----------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._acc is not None

    def start(self, resident: Iterable[torch.Tensor] = ()) -> None:
        """Start counting on this thread; ``resident`` tensors made before (frozen parameters, buffers) are
        registered as live (their storages counted once).

        Raises:
            SimOutOfMemoryError: the resident tensors alone exceed the capacity.
        """
        if self._acc is not None:
            return
        from tracer.accounting import StorageAccountant
        from tracer.categories import Category

        acc = StorageAccountant(on_allocate=self._on_allocate)
        for t in resident:
            acc.classify(t, Category.BUFFER)
        used = acc.total_bytes(CPU)
        if used > self.capacity_bytes:
            acc.close()
            raise SimOutOfMemoryError(used, 0, self.capacity_bytes,
                                      "the model's frozen parameters and buffers")
        acc.__enter__()
        self._acc = acc

    def stop(self) -> None:
        """Stop counting (idempotent)."""
        acc, self._acc = self._acc, None
        if acc is not None:
            acc.__exit__(None, None, None)
            acc.close()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Allocations inside are host memory and not counted (re-entrant). The dispatch modes of this thread
        are lifted for the block (``torch.utils._python_dispatch._disable_current_modes``), so a tracer does
        not see them either: they are not on the device."""
        if self._acc is None or self._pause_depth:
            self._pause_depth += 1
            try:
                yield
            finally:
                self._pause_depth -= 1
            return
        self._pause_depth += 1
        try:
            with _disable_current_modes():
                yield
        finally:
            self._pause_depth -= 1

    # ---- accounting ---------------------------------------------------------------------------------------
    def reset_peak(self) -> int:
        """Restart the peak counters from the bytes live now; returns them (bytes)."""
        self.peak_bytes = self.live_bytes()
        self.peak_fixed_bytes = self.peak_bytes - self.moving_bytes
        return self.peak_bytes

    def move(self, nbytes: int) -> None:
        """``nbytes`` more (or, negative, fewer) of the live bytes are model data that comes and goes within a
        step: :attr:`peak_fixed_bytes` leaves them out. Called before a fetched buffer is allocated and after
        it is dropped, so the figure never counts one."""
        self.moving_bytes += nbytes

    def live_bytes(self) -> int:
        """Bytes counted on the stand-in right now (live storages), bytes."""
        return int(self._acc.total_bytes(CPU)) if self._acc is not None else 0

    def _on_allocate(self, device: str, nbytes: int, live_total: int) -> None:
        if device != CPU:
            return
        used = int(live_total)
        if used > self.capacity_bytes:
            raise self._explained(SimOutOfMemoryError(nbytes, used - nbytes, self.capacity_bytes))
        self.peak_bytes = max(self.peak_bytes, used)
        self.peak_fixed_bytes = max(self.peak_fixed_bytes, used - self.moving_bytes)

    def _explained(self, e: SimOutOfMemoryError) -> SimOutOfMemoryError:
        """``e`` with the scheduler's explanation appended to its message, when it has one (:attr:`explain`:
        e.g. every chunk is already on the host)."""
        note = self.explain(e) if self.explain is not None else None
        if note:
            e.args = (f"{e.args[0]}\n{note}", *e.args[1:])
        return e

    def require(self, nbytes: int, what: str = "an allocation") -> None:
        """Check that ``nbytes`` more fit now (before a step that will allocate them).

        Raises:
            SimOutOfMemoryError: they do not.
        """
        if not self.active or nbytes <= 0:
            return
        used = self.live_bytes()
        if used + nbytes > self.capacity_bytes:
            raise self._explained(SimOutOfMemoryError(nbytes, used, self.capacity_bytes, what))
