"""A pickled PyTorch memory snapshot (the format of ``torch.cuda.memory._snapshot()``) for
https://pytorch.org/memory_viz; allocations synthesised from the per-category byte changes between samples."""

from __future__ import annotations

import bisect
import os
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memsched.report.exports._common import label
from tracer.categories import MODEL_DATA, Category
from tracer.timeline import MemoryTimeline, Sample, atomic_write_bytes

# Synthetic addresses of the memory_viz export start here (a CUDA-like, page-aligned base).
_VIZ_BASE_ADDR = 0x7F0000000000
_VIZ_ALIGN = 512  # like the CUDA caching allocator's block rounding; keeps addresses readable
_MODEL_DATA_NAMES = frozenset(c.value for c in MODEL_DATA)


def to_memory_viz(timeline: MemoryTimeline) -> dict[str, Any]:
    """A PyTorch memory snapshot of the traced device, for https://pytorch.org/memory_viz.

    The format is the one of ``torch.cuda.memory._snapshot()``: ``{"segments": [...], "device_traces":
    [[event, ...]]}`` where each event is ``{"action", "addr", "size", "stream", "time_us", "frames"}``.
    The tracer measures bytes per category, not allocations, so allocations are synthesised: between two
    samples, a category that grew gets one ``alloc`` of the growth; one that shrank frees its most recent
    blocks (``free_requested`` + ``free_completed``, as torch records them), splitting the last one if needed.
    The live bytes per category of the snapshot therefore equal the timeline's at every sample. The
    category, module, phase and step are in each event's ``frames`` (``filename`` = category, ``line`` =
    step, ``name`` = "phase event of module"), which the viewer shows as the stack. Addresses come from a
    first-fit allocator in one synthetic segment; ``segments`` holds the blocks live at the end. The trace is
    device 0 of the snapshot whatever the traced device was.
    """
    samples = timeline.for_device()
    heap = _FirstFit()
    live: dict[str, list[tuple[int, int, list[dict[str, Any]]]]] = {}  # category -> [(addr, size, frames)]
    trace: list[dict[str, Any]] = []
    prev: Mapping[str, int] = {}
    order = [c.value for c in Category]
    for s in samples:
        t_us = s.t_ns // 1000
        frames = None
        for cat in order + sorted(set(s.bytes) - set(order)):
            delta = int(s.bytes.get(cat, 0)) - int(prev.get(cat, 0))
            if delta == 0:
                continue
            blocks = live.setdefault(cat, [])
            if frames is None or frames[0]["filename"] != cat:
                frames = _viz_frames(cat, s)
            if delta > 0:
                addr = heap.alloc(delta)
                blocks.append((addr, delta, frames))
                trace.append(_viz_event("alloc", addr, delta, t_us, frames))
                continue
            need = -delta
            while need > 0 and blocks:
                addr, size, old_frames = blocks.pop()
                for action in ("free_requested", "free_completed"):
                    trace.append(_viz_event(action, addr, size, t_us, old_frames))
                heap.free(addr, size)
                if size > need:  # split: the rest of the block stays live
                    keep = size - need
                    new_addr = heap.alloc(keep)
                    blocks.append((new_addr, keep, old_frames))
                    trace.append(_viz_event("alloc", new_addr, keep, t_us, old_frames))
                need -= min(size, need)
        prev = s.bytes
    end_blocks = sorted((b for blocks in live.values() for b in blocks), key=lambda b: b[0])
    return {"segments": _viz_segments(end_blocks, heap.high_water), "device_traces": [trace]}


def write_memory_viz(timeline: MemoryTimeline, path: str | os.PathLike[str]) -> Path:
    """Pickle :func:`to_memory_viz` (protocol 4) to ``path`` atomically; returns the path."""
    atomic_write_bytes(path, _memory_viz_bytes(timeline))
    return Path(path)


def _memory_viz_bytes(timeline: MemoryTimeline) -> bytes:
    return pickle.dumps(to_memory_viz(timeline), protocol=4)


def _viz_frames(category: str, s: Sample) -> list[dict[str, Any]]:
    kind = "model data" if category in _MODEL_DATA_NAMES else "non-model data"
    return [
        {"filename": category, "line": s.step, "name": f"{s.phase} {s.event} of {label(s.module)}"},
        {"filename": kind, "line": s.step, "name": f"step {s.step}"},
    ]


def _viz_event(action: str, addr: int, size: int, t_us: int, frames: list[dict[str, Any]]) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t_us, "frames": frames}


def _viz_segments(blocks: Sequence[tuple[int, int, list[dict[str, Any]]]], high_water: int) -> list[dict]:
    """One segment spanning every synthetic address used: the blocks live at the end plus the gaps."""
    total = _align(high_water)
    if total == 0:
        return []
    out_blocks: list[dict[str, Any]] = []
    cursor = _VIZ_BASE_ADDR
    allocated = requested = 0
    for addr, size, frames in blocks:
        if addr > cursor:
            out_blocks.append(_inactive(cursor, addr - cursor))
        rounded = _align(size)
        out_blocks.append(
            {
                "address": addr,
                "size": rounded,
                "requested_size": size,
                "state": "active_allocated",
                "frames": frames,
            }
        )
        allocated += rounded
        requested += size
        cursor = addr + rounded
    if cursor < _VIZ_BASE_ADDR + total:
        out_blocks.append(_inactive(cursor, _VIZ_BASE_ADDR + total - cursor))
    return [
        {
            "device": 0,
            "address": _VIZ_BASE_ADDR,
            "total_size": total,
            "allocated_size": allocated,
            "active_size": allocated,
            "requested_size": requested,
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "blocks": out_blocks,
        }
    ]


def _inactive(addr: int, size: int) -> dict[str, Any]:
    return {"address": addr, "size": size, "requested_size": 0, "state": "inactive", "frames": []}


def _align(n: int) -> int:
    return -(-n // _VIZ_ALIGN) * _VIZ_ALIGN


class _FirstFit:
    """First-fit allocator over synthetic addresses, so the snapshot's address span tracks the live peak."""

    def __init__(self) -> None:
        self.free_ranges: list[tuple[int, int]] = []  # (offset, size), sorted, coalesced
        self.top = 0  # first never-used offset
        self.high_water = 0

    def alloc(self, size: int) -> int:
        size = _align(size)
        for i, (off, n) in enumerate(self.free_ranges):
            if n >= size:
                if n == size:
                    del self.free_ranges[i]
                else:
                    self.free_ranges[i] = (off + size, n - size)
                return _VIZ_BASE_ADDR + off
        off = self.top
        self.top += size
        self.high_water = max(self.high_water, self.top)
        return _VIZ_BASE_ADDR + off

    def free(self, addr: int, size: int) -> None:
        off, size = addr - _VIZ_BASE_ADDR, _align(size)
        ranges = self.free_ranges
        i = bisect.bisect_left(ranges, (off, size))
        ranges.insert(i, (off, size))
        # Coalesce with the next and the previous free range.
        if i + 1 < len(ranges) and off + size == ranges[i + 1][0]:
            ranges[i] = (off, size + ranges.pop(i + 1)[1])
        if i > 0 and ranges[i - 1][0] + ranges[i - 1][1] == off:
            ranges[i - 1] = (ranges[i - 1][0], ranges[i - 1][1] + ranges.pop(i)[1])
        if ranges and ranges[-1][0] + ranges[-1][1] == self.top:  # give the tail back
            self.top = ranges.pop()[0]
