"""H2D/D2H copies between device chunks and their host buffers, and the bytes they move.

On CUDA, copies run non_blocking from/to pinned memory on side streams and are ordered with events (the
overlap of ZeRO-Offload, arXiv 2101.06840, section 4.2): the D2H of the host chunks' gradients starts at the
optimizer step, after everything that may write them, and each chunk's CPU update waits for its own copy; the
H2D of its updated parameters follows its CPU update; the next forward of a module waits only for the events
of the chunks it may read (:mod:`memsched.planning.first_use`). Elsewhere (CPU, the stand-in device) copies
are synchronous.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch


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


class Streams:
    """Side streams for D2H and H2D copies on CUDA; ``None`` members elsewhere (copies are synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.d2h = torch.cuda.Stream(device=device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device=device) if self.cuda else None

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None = None):
        """``dst.copy_(src)`` after the work queued so far on the current stream (or after ``after``, an event
        of :meth:`record`); returns a CUDA event or ``None``."""
        return self._copy(self.d2h, dst, src, src.device, after)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None = None):
        """``dst.copy_(src)`` (``src`` pinned host memory) ordered after the current stream's work, or after
        ``after`` (an event of :meth:`record`; the overlap worker issues copies while the training thread
        queues the next forward), so the compute buffer is not overwritten while earlier kernels still read
        it; returns a CUDA event or None."""
        return self._copy(self.h2d, dst, src, dst.device, after)

    def record(self) -> torch.cuda.Event | None:
        """An event on the current stream after the work queued so far (``None`` without CUDA)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def wait(self, events) -> None:
        """Make the current stream wait for ``events`` (``None`` entries skipped). No-op without CUDA."""
        if not self.cuda:
            return
        stream = None
        for ev in events:
            if ev is not None:
                stream = stream or torch.cuda.current_stream(self.device)
                stream.wait_event(ev)

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor, device: torch.device, after=None):
        # On a side stream that first waits for the compute stream, so the copy overlaps later compute.
        if not self.cuda:
            dst.copy_(src)
            return None
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
