"""The stand-in accelerator's capacity, as memsched's scheduler sees it.

``device="sim:8GiB"`` trains on ``torch.device("sim")``, the PrivateUse1 backend of
:mod:`memsched.devices.sim_backend`: device tensors whose memory is host memory, counted and capped by the
backend's allocator like a GPU's (allocations rounded up to 512 B, as CUDA's caching allocator rounds them).
From :func:`memsched.attach` until ``sched.close()`` the allocator's capacity is the stand-in's size; an
allocation beyond it raises :class:`SimOutOfMemoryError`, a ``torch.OutOfMemoryError`` (as CUDA's
allocator raises one) that carries the bytes requested, in use and the capacity, and memsched's explanation.
Everything on the device counts, whoever made it (a reference model on ``sim`` too), and nothing on the host
does: host memory (pinned buffers, datasets, an EMA on the CPU) is ordinary CPU memory.
"""

from __future__ import annotations

import contextlib
import gc
import re
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


_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# the stand-in's allocator: "tried to allocate 8.0 MiB (8388608 bytes) on ... with 35.3 MiB (36975104 bytes)
# allocated of a capacity ..."; CUDA's: "Tried to allocate 20.00 MiB. ... Of the allocated memory 7.50 GiB is
# allocated by PyTorch, ..."
_SIM_OOM = re.compile(r"tried to allocate [^(]*\((\d+) bytes\).*? with [^(]*\((\d+) bytes\) allocated", re.S)
_CUDA_REQUESTED = re.compile(r"Tried to allocate ([\d.]+) (bytes|KiB|MiB|GiB|TiB)")
_CUDA_IN_USE = re.compile(r"Of the allocated memory ([\d.]+) (bytes|KiB|MiB|GiB|TiB) is allocated by PyTorch")


def oom_bytes(exc: BaseException | None) -> tuple[int | None, int | None]:
    """(bytes requested, bytes in use before the request) of an out-of-memory error: the attributes of
    memsched's own error, else read from the allocator's message (the stand-in's exact byte counts, CUDA's
    rounded sizes); ``None`` for what it does not say."""
    requested, in_use = getattr(exc, "requested", None), getattr(exc, "in_use", None)
    if requested is not None and in_use is not None:
        return requested, in_use
    text = str(exc.args[0]) if exc is not None and exc.args else ""
    if m := _SIM_OOM.search(text):
        return int(m.group(1)), int(m.group(2))
    req, use = _CUDA_REQUESTED.search(text), _CUDA_IN_USE.search(text)
    return (int(float(req.group(1)) * _UNITS[req.group(2)]) if req else requested,
            int(float(use.group(1)) * _UNITS[use.group(2)]) if use else in_use)


class SimOutOfMemoryError(_OOM_BASE):  # type: ignore[misc,valid-type]
    """The stand-in device cannot hold an allocation: raised by its allocator wherever one does not fit (a
    forward, a backward, an optimizer step, attach), and by :meth:`SimDevice.require` and
    :meth:`SimDevice.start`. A ``torch.OutOfMemoryError``, so retry loops catch it. Attributes (bytes):
    ``requested``, ``in_use`` (allocated before the request), ``capacity``; ``what`` names the request."""

    def __init__(self, requested: int, in_use: int, capacity: int, what: str = "an allocation") -> None:
        self.requested, self.in_use, self.capacity = int(requested), int(in_use), int(capacity)
        self.what = what
        free = max(0, self.capacity - self.in_use)
        fb = format_bytes
        purpose = "" if what == "an allocation" else f" for {what}"
        # the first sentence is the allocator's own (oom_bytes reads it)
        req, use, cap = self.requested, self.in_use, self.capacity
        super().__init__(
            f"sim out of memory: tried to allocate {fb(req)} ({req} bytes){purpose} on the stand-in device "
            f"sim:0 with {fb(use)} ({use} bytes) allocated of a capacity of {fb(cap)} ({cap} bytes): "
            f"{fb(req)} requested with {fb(use)} in use, {fb(free)} free")


#: What the message adds where no scheduler explains the error yet (at attach, or a SimDevice of one's own).
CAPACITY_HINT = ("memsched: from memsched.attach on, the stand-in holds at most its capacity "
                 "(device='sim:SIZE'): what attach puts there (the chunks of trainable parameters, the "
                 "buffers and frozen parameters) and each step's tensors must fit; use a larger device or a "
                 "smaller batch")
#: What the message adds where the scheduler has nothing more specific to say.
RETRY_HINT = ("memsched: where the scheduler re-plans (replan='auto', the default) nothing was "
              "updated and the next step makes room: catch torch.OutOfMemoryError, call "
              "optimizer.zero_grad() and run the step again; else use a larger device (device='sim:SIZE') "
              "or a smaller batch")


def allocator_out_of_memory(requested: int, in_use: int, capacity: int) -> SimOutOfMemoryError:
    """The error the stand-in's allocator raises, all arguments bytes ([Note: the stand-in's out-of-memory
    error] in ``sim_backend.cpp``): the numbers, then the explanation of the scheduler that uses the
    stand-in (the latest attached; its ``explain``), else what to do. The scheduler's own catch points may
    add to it later; an explanation already in the message is not repeated there."""
    err = SimOutOfMemoryError(requested, in_use, capacity)
    sim = _ACTIVE[-1] if _ACTIVE else None
    note: str | None = None
    if sim is not None and sim.explain is not None:
        try:
            note = sim.explain(err) or RETRY_HINT
        except Exception:  # noqa: BLE001 - an explanation that fails must not hide the error itself
            note = RETRY_HINT
    err.args = (f"{err.args[0]}\n{note or CAPACITY_HINT}", *err.args[1:])
    return err


sim_backend.set_out_of_memory_error(allocator_out_of_memory)


def add_oom_numbers(exc: BaseException, device: torch.device | str | None = None) -> BaseException:
    """Give a CUDA out-of-memory error (torch's ``OutOfMemoryError`` from the caching allocator) the numbers
    memsched's stand-in error carries, all bytes: ``requested`` (read from the allocator's message, which
    rounds it to its unit; ``None`` where it does not say), ``in_use`` (``torch.cuda.memory_allocated``) and
    ``capacity`` (``torch.cuda.mem_get_info``'s total), and one line of them in the message. Errors that
    carry them already (the stand-in's) and errors of other devices are returned as they are. Returns
    ``exc``."""
    if not isinstance(exc, _OOM_BASE) or getattr(exc, "capacity", None) is not None:
        return exc
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return exc
    first = exc.args[0] if exc.args and isinstance(exc.args[0], str) else ""
    if "CUDA out of memory" not in first or not torch.cuda.is_available():
        return exc
    try:
        requested = oom_bytes(exc)[0]
        in_use = int(torch.cuda.memory_allocated(dev))
        free, total = (int(x) for x in torch.cuda.mem_get_info(dev))
    except Exception:  # noqa: BLE001 - the numbers are extra: never hide the error for them
        return exc
    exc.requested, exc.in_use, exc.capacity = requested, in_use, total  # type: ignore[attr-defined]
    asked = f"{format_bytes(requested)} ({requested} bytes) requested" if requested is not None else \
        "an allocation"
    exc.args = (f"{first}\nmemsched: {asked} with {format_bytes(in_use)} ({in_use} bytes) allocated by "
                f"tensors, {format_bytes(free)} free of the GPU's {format_bytes(total)} ({total} bytes)",
                *exc.args[1:])
    return exc


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
