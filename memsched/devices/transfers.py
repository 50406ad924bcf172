"""H2D/D2H copies between device chunks and their host buffers, and the bytes they move.

On CUDA, copies run non_blocking from/to pinned memory on side streams and are ordered with events (the
overlap of ZeRO-Offload, arXiv 2101.06840, section 4.2): the D2H of the host chunks' gradients starts at the
optimizer step, after everything that may write them, and each chunk's CPU update waits for its own copy; the
H2D of its updated parameters follows its CPU update; the next forward of a module waits only for the events
of the chunks it may read (:mod:`memsched.planning.first_use`). Elsewhere (CPU, the stand-in device) copies
are synchronous, unless the stand-in models a host link.

[Note: the stand-in's link]
``device="sim:SIZE,link=25GBps"`` (:mod:`memsched.devices.spec`) gives the stand-in two copy engines
(:class:`SimStream`), one thread per direction, as CUDA's side streams: a copy is queued (FIFO) and returns a
:class:`SimEvent` at once; its thread makes the copy and then sleeps until ``start + bytes / bandwidth``, so
copies in one direction are serialised like a copy engine's, and the two directions overlap each other and
the training thread. The events have the host-side API of ``torch.cuda.Event`` (``query``, ``synchronize``,
``wait``), so every path that waits on CUDA events waits on them. Ordering is CUDA's:

* a copy comes after the work queued so far: the training thread's work is synchronous on the CPU, so that
  work is done when the copy is queued (:meth:`Streams.record` has nothing to record); a copy given an
  ``after`` event of another copy waits for it on its thread;
* what CUDA does as "the current stream waits for the event" (:meth:`Streams.wait`: a forward before reading
  its chunks, the step before the gradients may be written again) blocks the calling thread here, since the
  training thread is the compute stream; so nothing reads a copy's destination, or writes its source, before
  its event completes. The parameters' version counters move when the copy is queued, as with a CUDA copy.

The copies are spans of the step timeline (tracks ``h2d`` and ``d2h``, with their bytes) and the training
thread's waits for them are ``waits`` spans (:mod:`memsched.telemetry.step_timeline`). The threads start with
the first copy and end with the scheduler (``close()``, or its garbage collection: :mod:`memsched.teardown`);
after that copies are synchronous again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import increment_version

from policies.units import format_bytes

# The tracks the copies are recorded on (:meth:`Streams.trace_to`): the stand-in's modelled link, one per
# direction, and the training thread's waits for copies. Named here, where the copies are made; the step
# timeline (memsched.telemetry.step_timeline) takes them from this room, so devices import nothing after them.
H2D, D2H = "h2d", "d2h"
WAITS = "waits"


@dataclass(eq=False)
class TransferStats(Mapping):
    """Bytes copied between the device and host memory (bytes), in total and in the last optimizer step.

    Also a read-only mapping with the keys of :meth:`as_dict` (``sched.transfers["h2d_bytes"]``).
    ``steps`` counts optimizer steps (skipped fp16 steps included); ``chunk_moves_bytes`` counts the one-off
    moves of optimizer state when a plan is applied.
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    steps: int = 0
    last_h2d_bytes: int = 0
    last_d2h_bytes: int = 0
    chunk_moves_bytes: int = 0

    _cur_h2d: int = 0
    _cur_d2h: int = 0

    def add_h2d(self, nbytes: int) -> None:
        self.h2d_bytes += nbytes
        self._cur_h2d += nbytes

    def add_d2h(self, nbytes: int) -> None:
        self.d2h_bytes += nbytes
        self._cur_d2h += nbytes

    def add_chunk_move(self, nbytes: int) -> None:
        """A chunk's optimizer state moved between host and device to apply a plan (bytes)."""
        self.chunk_moves_bytes += nbytes

    def end_step(self) -> None:
        """Close the current step: its bytes (its backward's D2H included) become the last-step values."""
        self.steps += 1
        self.last_h2d_bytes, self.last_d2h_bytes = self._cur_h2d, self._cur_d2h
        self._cur_h2d = self._cur_d2h = 0

    def __getitem__(self, key: str) -> int:
        return self.as_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())

    def as_dict(self) -> dict[str, int]:
        return {"h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "steps": self.steps,
                "last_h2d_bytes": self.last_h2d_bytes, "last_d2h_bytes": self.last_d2h_bytes,
                "chunk_moves_bytes": self.chunk_moves_bytes}


class SimEvent:
    """The completion of one copy on the stand-in's link (see [Note: the stand-in's link]): the host-side API
    of ``torch.cuda.Event``. ``kind``: ``"h2d"`` or ``"d2h"``; ``nbytes``: the bytes copied."""

    def __init__(self, link: LinkModel, stream: SimStream, nbytes: int) -> None:
        self.kind = stream.kind
        self.nbytes = nbytes
        self._link = link
        self._stream = stream
        self._done = threading.Event()
        self._error: BaseException | None = None

    def query(self) -> bool:
        """True once the copy is done (its destination may be read, its source written)."""
        return self._done.is_set()

    def synchronize(self) -> None:
        """Block the calling thread until the copy is done (the training thread's wait is a span).

        Raises:
            RuntimeError: the copy failed (from its error).
        """
        self._link.wait([self])

    def wait(self, stream: Any = None) -> None:
        """``torch.cuda.Event.wait``: the current stream waits for the copy; the training thread is the
        stand-in's compute stream, so it blocks."""
        self.synchronize()

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"memsched: a {self.kind} copy of {self.nbytes} bytes on the stand-in's link "
                               f"failed ({type(self._error).__name__}: {self._error})") from self._error


class SimStream:
    """One copy engine of the stand-in's link: a thread making the copies queued on it in order, each taking
    at least ``bytes / bandwidth`` (see [Note: the stand-in's link]). ``kind``: ``"h2d"`` or ``"d2h"``."""

    def __init__(self, link: LinkModel, kind: str) -> None:
        self.link = link
        self.kind = kind
        self.closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.thread: threading.Thread | None = None  # the copy thread, kept after close (it may still drain)
        self._lock = threading.Lock()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> SimEvent | None:
        """Queue ``dst.copy_(src)`` (after the copy event ``after``, if one); returns its event, or ``None``
        once the stream is closed (the caller then copies synchronously)."""
        with self._lock:
            if self.closed:
                return None
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=f"memsched-{self.kind}-copy", daemon=True)
                self._thread = self.thread = thread
                thread.start()
            ev = SimEvent(self.link, self, dst.numel() * dst.element_size())
            increment_version(dst)  # as a CUDA copy does when queued (the copy itself goes through .data)
            self._queue.put((dst, src, after, ev))
        return ev

    def _run(self) -> None:
        bandwidth = self.link.bytes_per_s
        while True:
            item = self._queue.get()
            if item is None:
                return
            dst, src, after, ev = item
            item = None
            error: BaseException | None = None
            start = time.perf_counter()
            try:
                if after is not None and hasattr(after, "synchronize"):
                    after.synchronize()
                    start = time.perf_counter()
                with torch.no_grad():
                    dst.data.copy_(src)
                rest = start + ev.nbytes / bandwidth - time.perf_counter()
                if rest > 0:
                    time.sleep(rest)
            except BaseException as e:  # raised where the event is waited for
                error = e
            # No tensor outlives its copy here (the stand-in counts live storages; chunks may be rebuilt).
            dst = src = after = None
            try:
                name = f"{self.kind} {format_bytes(ev.nbytes)}"
                self.link.span(self.kind, name, start, time.perf_counter(), bytes=ev.nbytes)
            except Exception as e:  # the copies go on; the waiter sees it
                error = error or e
            ev._finish(error)

    def close(self) -> None:
        """Finish the copies queued and end the thread (idempotent); later copies are synchronous."""
        with self._lock:
            self.closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join()


class LinkModel:
    """The stand-in's host link (see [Note: the stand-in's link]): its bandwidth (bytes per second), its two
    copy engines ``h2d`` and ``d2h``, and where their spans go."""

    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"the link's bandwidth must be > 0 bytes per second, got {bytes_per_s!r}")
        self.bytes_per_s = float(bytes_per_s)
        self.owner = threading.get_ident()  # the training thread: its waits are spans
        self._span: Callable[..., None] | None = None
        self.h2d = SimStream(self, H2D)
        self.d2h = SimStream(self, D2H)

    @property
    def closed(self) -> bool:
        return self.h2d.closed

    def trace_to(self, span: Callable[..., None]) -> None:
        """Record the copies and the training thread's waits with ``span(track, name, start, end, **args)``
        (:meth:`memsched.telemetry.step_timeline.StepTimeline.span`)."""
        self._span = span

    def span(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        if self._span is not None:
            self._span(track, name, start, end, **args)

    def wait(self, events: Sequence[SimEvent], what: str | None = None) -> None:
        """Block until ``events`` are done; a wait of the training thread that blocked is a ``waits`` span
        named after ``what`` (who waits).

        Raises:
            RuntimeError: a copy failed.
        """
        # A copy thread never waits for its own copies: it would wait forever (the scheduler's finalizer, run
        # by the garbage collector on that thread; the copies then finish after it, in order).
        me = threading.current_thread()
        pending = [ev for ev in events if not ev.query() and ev._stream.thread is not me]
        if pending:
            t0 = time.perf_counter()
            for ev in pending:
                ev._done.wait()
            # the training thread's waits, and those of a backward it runs (on a device, autograd runs it
            # on a device thread of its own): the training is stalled either way
            if threading.get_ident() == self.owner or torch._C._current_graph_task_id() != -1:
                kinds = "+".join(sorted({ev.kind for ev in pending}))
                copies = f"{kinds} copy" if len(pending) == 1 else f"{len(pending)} {kinds} copies"
                name = f"{what} ({copies})" if what else f"wait <- {copies}"
                nbytes = sum(ev.nbytes for ev in pending)
                self.span(WAITS, name, t0, time.perf_counter(), copy=kinds, bytes=nbytes)
        for ev in events:
            ev._check()

    def close(self) -> None:
        try:
            self.h2d.close()
        finally:
            self.d2h.close()


class Streams:
    """Side streams for D2H and H2D copies on CUDA; the stand-in's copy engines when it models a host link
    (``link_bytes_per_s``, see [Note: the stand-in's link]); ``None`` members elsewhere (copies are
    synchronous)."""

    def __init__(self, device: torch.device, link_bytes_per_s: float | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.link = LinkModel(link_bytes_per_s) if link_bytes_per_s is not None and not self.cuda else None
        self.d2h: Any = torch.cuda.Stream(device=device) if self.cuda else self.link and self.link.d2h
        self.h2d: Any = torch.cuda.Stream(device=device) if self.cuda else self.link and self.link.h2d
        self._measured: float | None = None

    def link_bytes_per_s(self, alloc: Any) -> float | None:
        """The host link's bandwidth per direction, bytes per second: the stand-in's modelled link; on CUDA a
        64 MiB pinned H2D copy on the side stream, timed with CUDA events (measured once, after one untimed
        copy); ``None`` elsewhere (synchronous copies: no link to model), or when the probe's buffers do not
        fit. ``alloc``: where the copy's pinned and device buffers come from
        (:class:`memsched.chunks.Allocator`)."""
        if self.link is not None:
            return self.link.bytes_per_s
        if not self.cuda:
            return None
        if self._measured is None:
            n = 64 << 20
            try:
                src, dst = alloc.host_empty(n, torch.uint8), alloc.device_empty(n, torch.uint8)
            except RuntimeError:  # out of device or pinned memory (torch.OutOfMemoryError is one): unknown
                return None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.h2d):
                dst.copy_(src, non_blocking=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
            end.synchronize()
            self._measured = n / max(start.elapsed_time(end) / 1e3, 1e-9)
        return self._measured

    @property
    def asynchronous(self) -> bool:
        """Copies may still run when their call returns (CUDA, or the stand-in's link until ``close``):
        readers must wait for their events."""
        return self.cuda or (self.link is not None and not self.link.closed)

    def trace_to(self, timeline: Any) -> None:
        """The stand-in's copies and the waits for them become spans of ``timeline``
        (:class:`memsched.telemetry.step_timeline.StepTimeline`); nothing to record on CUDA or without a
        link."""
        if self.link is not None:
            self.link.trace_to(timeline.span)

    def close(self) -> None:
        """Finish the stand-in's queued copies and end its copy threads (idempotent); copies are synchronous
        afterwards. Nothing to do on CUDA."""
        if self.link is not None:
            self.link.close()

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None = None):
        """``dst.copy_(src)`` after the work queued so far on the current stream (or after ``after``, an event
        of :meth:`record`); returns a CUDA event, a :class:`SimEvent` or ``None``."""
        return self._copy(self.d2h, dst, src, src.device, after)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None = None):
        """``dst.copy_(src)`` (``src`` pinned host memory) ordered after the current stream's work, or after
        ``after`` (an event of :meth:`record`; the overlap worker issues copies while the training thread
        queues the next forward), so the compute buffer is not overwritten while earlier kernels still read
        it; returns a CUDA event, a :class:`SimEvent` or None."""
        return self._copy(self.h2d, dst, src, dst.device, after)

    def record(self) -> torch.cuda.Event | None:
        """An event on the current stream after the work queued so far (``None`` without CUDA: that work is
        done already)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def wait(self, events, what: str | None = None) -> None:
        """Make the current stream wait for ``events`` (``None`` entries skipped). The stand-in's link: the
        calling thread blocks (a span of the step timeline named after ``what`` when the training thread
        blocked). No-op otherwise."""
        if not self.cuda:
            if self.link is not None:
                self.link.wait([ev for ev in events if isinstance(ev, SimEvent)], what)
            return
        stream = None
        for ev in events:
            if ev is not None:
                stream = stream or torch.cuda.current_stream(self.device)
                stream.wait_event(ev)

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor, device: torch.device, after=None):
        # On a side stream that first waits for the compute stream, so the copy overlaps later compute.
        if not self.cuda:
            ev = stream.copy(dst, src, after) if stream is not None else None
            if ev is None:
                dst.copy_(src)
            return ev
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        # a buffer freed before the copy ran (a gradient buffer at zero_grad) is not reused
        for t in (src, dst):
            if t.is_cuda:
                t.record_stream(stream)
        return ev
