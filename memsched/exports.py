"""Write a memory timeline to files other tools open.

* ``write_json``: memsched's own versioned JSON (:meth:`tracer.MemoryTimeline.save`), read back by
  ``memsched report``.
* ``write_perfetto``: Chrome / Perfetto trace-event JSON (the "Trace Event Format"): one counter track per
  category and device, module slices on a forward and a backward thread, one process per rank. Opens in
  https://ui.perfetto.dev and chrome://tracing.
* ``write_memory_viz``: a pickled PyTorch memory snapshot (the format of ``torch.cuda.memory._snapshot()``),
  for PyTorch's own viewer at https://pytorch.org/memory_viz. Allocations are synthesised from the
  per-category byte changes between samples (the tracer records sizes, not addresses).
* ``write_png``: a stacked area plot by category (needs matplotlib: ``pip install 'memsched[plot]'``).

Every file is written atomically (:func:`tracer.timeline.atomic_write_bytes`), so an interrupted export never
leaves a half-written file; :func:`write_all` renders every export in memory before writing the first one.
"""

from __future__ import annotations

import bisect
import io
import json
import os
import pickle
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.units import format_bytes
from tracer.categories import MODEL_DATA, Category
from tracer.timeline import MemoryTimeline, Sample, atomic_write_bytes

# Suffixes of the files write_all creates: <stem><suffix>.
SUFFIXES: dict[str, str] = {
    "json": ".json",
    "perfetto": ".perfetto.json",
    "memory_viz": ".memory_viz.pickle",
    "png": ".png",
}
PNG_HINT = "the PNG export needs matplotlib: pip install 'memsched[plot]'"

# Thread ids of the Perfetto process of each rank (one "thread" per kind of slice).
TID_STEPS, TID_FORWARD, TID_BACKWARD, TID_OPTIMIZER, TID_OTHER = 1, 2, 3, 4, 5
_PHASE_TID = {
    "forward": TID_FORWARD,
    "backward": TID_BACKWARD,
    "optimizer": TID_OPTIMIZER,
    "other": TID_OTHER,
}
_THREAD_NAMES = {
    TID_STEPS: "steps",
    TID_FORWARD: "forward (module)",
    TID_BACKWARD: "backward (module)",
    TID_OPTIMIZER: "optimizer",
    TID_OTHER: "other",
}

# Sample.cuda figures of the caching allocator, shown as counter tracks.
_CUDA_COUNTERS = ("allocated", "reserved")

# Synthetic addresses of the memory_viz export start here (a CUDA-like, page-aligned base).
_VIZ_BASE_ADDR = 0x7F0000000000
_VIZ_ALIGN = 512  # like the CUDA caching allocator's block rounding; keeps addresses readable
_MODEL_DATA_NAMES = frozenset(c.value for c in MODEL_DATA)


def _label(module: str) -> str:
    return module if module else "(root)"


# ---- JSON ------------------------------------------------------------------------------------------------
def write_json(timeline: MemoryTimeline, path: str | os.PathLike[str]) -> Path:
    """Write the versioned memsched timeline JSON to ``path`` atomically; returns the path."""
    timeline.save(path)
    return Path(path)


# ---- Perfetto / Chrome trace events ----------------------------------------------------------------------
def to_perfetto(timelines: MemoryTimeline | Sequence[MemoryTimeline]) -> dict[str, Any]:
    """Chrome / Perfetto trace-event JSON for one or more timelines (one per rank).

    Each timeline becomes the process ``pid = timeline.meta.get("rank", 0)`` (named ``rank R (device)``), so
    the timelines of several ranks merge into one trace. Per device sampled, a counter event (``"ph": "C"``)
    per sample carries the live bytes of each category (Perfetto shows one track per category); on CUDA, more
    counters carry the caching allocator's allocated / reserved bytes and NVML's device-wide used bytes.
    Module calls are complete events (``"ph": "X"``) on one thread per phase (forward, backward, optimizer,
    other), from the ``pre``/``post`` samples of the traced device, made to nest even when a module runs
    several times, a ``post`` is missing or backward hooks fire out of order (see :func:`_slices`). Steps are
    slices on their own thread; ``mark`` samples are instant events. Timestamps (``ts``, ``dur``) are
    microseconds since the tracer was entered.

    Raises:
        ValueError: two timelines share a rank, or an element is not a :class:`MemoryTimeline`.
    """
    if isinstance(timelines, MemoryTimeline):
        timelines = [timelines]
    events: list[dict[str, Any]] = []
    seen: dict[int, int] = {}
    for i, tl in enumerate(timelines):
        if not isinstance(tl, MemoryTimeline):
            raise ValueError(f"timelines[{i}] is {type(tl).__name__}, expected a MemoryTimeline")
        rank = int(tl.meta.get("rank", 0))
        if rank in seen:
            raise ValueError(
                f"timelines[{seen[rank]}] and timelines[{i}] both have rank {rank}; "
                "expected one timeline per rank"
            )
        seen[rank] = i
        events.extend(_perfetto_process(tl, rank))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "memsched", "units": "bytes; ts/dur in microseconds"},
    }


def write_perfetto(
    timelines: MemoryTimeline | Sequence[MemoryTimeline], path: str | os.PathLike[str]
) -> Path:
    """Write :func:`to_perfetto` JSON to ``path`` atomically; returns the path."""
    atomic_write_bytes(path, _perfetto_bytes(timelines))
    return Path(path)


def _perfetto_bytes(timelines: MemoryTimeline | Sequence[MemoryTimeline]) -> bytes:
    return json.dumps(to_perfetto(timelines), separators=(",", ":")).encode("utf-8")


def _us(t_ns: int) -> float:
    return t_ns / 1000.0


def _perfetto_process(tl: MemoryTimeline, pid: int) -> list[dict[str, Any]]:
    ev: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": pid,
            "tid": 0,
            "args": {"name": f"rank {pid} ({tl.device})"},
        },
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    for tid, name in _THREAD_NAMES.items():
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        ev.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )

    # Counters: every device sampled (the traced device, and e.g. the host), one event per sample.
    for s in tl.samples:
        ts = _us(s.t_ns)
        ev.append(
            {
                "ph": "C",
                "name": f"{s.device} live bytes",
                "pid": pid,
                "tid": 0,
                "ts": ts,
                "args": {c.value: int(s.bytes.get(c.value, 0)) for c in Category},
            }
        )
        ev.append(
            {
                "ph": "C",
                "name": f"{s.device} non-model peak bytes",
                "pid": pid,
                "tid": 0,
                "ts": ts,
                "args": {"peak_non_model": int(s.peak_non_model_bytes)},
            }
        )
        if s.cuda:
            ev.append(
                {
                    "ph": "C",
                    "name": f"{s.device} CUDA allocator bytes",
                    "pid": pid,
                    "tid": 0,
                    "ts": ts,
                    "args": {k: int(v) for k, v in s.cuda.items() if k in _CUDA_COUNTERS and v is not None},
                }
            )
            if s.cuda.get("nvml_used") is not None:  # device-wide, all processes
                ev.append(
                    {
                        "ph": "C",
                        "name": f"{s.device} NVML used bytes",
                        "pid": pid,
                        "tid": 0,
                        "ts": ts,
                        "args": {"nvml_used": int(s.cuda["nvml_used"])},
                    }
                )

    samples = tl.for_device()
    ev.extend(_slices(samples, pid))
    ev.extend(_step_slices(samples, pid))
    for s in samples:
        if s.event == "mark":
            ev.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": _label(s.module),
                    "pid": pid,
                    "tid": _PHASE_TID.get(s.phase, TID_OTHER),
                    "ts": _us(s.t_ns),
                    "args": {"step": s.step, "phase": s.phase},
                }
            )
    return ev


@dataclass
class _Call:
    """One module call of one phase: from its ``pre`` sample to its ``post`` sample (ns)."""

    tid: int
    pre: Sample
    start_ns: int
    post: Sample | None = None
    end_ns: int = 0
    clipped: bool = False


def _is_ancestor(outer: str, inner: str) -> bool:
    """Whether module ``outer`` contains module ``inner`` by qualified name (``""`` is the root)."""
    return outer != inner and (outer == "" or inner.startswith(outer + "."))


def _depth(module: str) -> int:
    return 0 if module == "" else module.count(".") + 1


def _slices(samples: Sequence[Sample], pid: int) -> list[dict[str, Any]]:
    """Complete ("X") events from pre/post pairs, one thread per phase, made to nest.

    Forward hooks nest strictly. Backward hooks do not quite: a module's backward ``post`` (grad of its input
    ready) and the next module's ``pre`` (grad of its output ready) are the same instant and fire in either
    order, and so are the ends and starts of consecutive calls of one module, and a parent's ``pre`` with its
    first child's. So in backward a ``post`` closes the oldest open call of its module, and overlaps are
    resolved in favour of the module tree (``args.clipped``): an ancestor starting inside a descendant's call
    starts with it; a call ending after its ancestor's is cut at the ancestor's end; any other call is cut
    where the overlapping one starts. A call without ``post`` ends with the trace, then is cut the same way
    (``args.unclosed``).
    """
    calls: list[_Call] = []
    open_calls: dict[tuple[int, int, str], list[_Call]] = {}
    for s in samples:
        tid = _PHASE_TID.get(s.phase, TID_OTHER)
        key = (tid, s.step, s.module)
        if s.event == "pre":
            call = _Call(tid, s, s.t_ns)
            calls.append(call)
            open_calls.setdefault(key, []).append(call)
        elif s.event == "post" and open_calls.get(key):  # a post with no open pre has nothing to close
            call = open_calls[key].pop(0 if s.phase == "backward" else -1)
            call.post, call.end_ns = s, s.t_ns
    trace_end = samples[-1].t_ns if samples else 0
    for call in calls:
        if call.post is None:
            call.end_ns = trace_end

    # An ancestor whose pre fired just after a descendant's (same instant) starts with that descendant, unless
    # another call of that ancestor module already holds the descendant's start.
    by_step: dict[tuple[int, int], list[_Call]] = {}
    for call in calls:
        by_step.setdefault((call.tid, call.pre.step), []).append(call)
    for group in by_step.values():
        group.sort(key=lambda c: c.start_ns)
        starts = [c.start_ns for c in group]
        for inner in group:
            # Only calls starting strictly inside ``inner`` can be such an ancestor.
            for k in range(
                bisect.bisect_right(starts, inner.start_ns), bisect.bisect_left(starts, inner.end_ns)
            ):
                outer = group[k]
                if outer.end_ns < inner.end_ns or not _is_ancestor(outer.pre.module, inner.pre.module):
                    continue
                if not any(
                    c.pre.module == outer.pre.module and c.start_ns <= inner.start_ns < c.end_ns
                    for c in group
                ):
                    outer.start_ns, outer.clipped = inner.start_ns, True

    by_tid: dict[int, list[_Call]] = {}
    for call in calls:
        by_tid.setdefault(call.tid, []).append(call)
    for thread in by_tid.values():
        # Outer calls first: earlier start, then later end, then shallower module.
        thread.sort(key=lambda c: (c.start_ns, -c.end_ns, _depth(c.pre.module)))
        stack: list[_Call] = []  # open calls, each inside the one below it
        for call in thread:
            while stack:
                top = stack[-1]
                if top.end_ns <= call.start_ns:  # ended before this call starts
                    stack.pop()
                elif top.end_ns >= call.end_ns:  # this call nests inside it
                    break
                elif _is_ancestor(top.pre.module, call.pre.module):  # a child cannot outlive its parent
                    call.end_ns, call.clipped = top.end_ns, True
                    break
                else:  # the earlier call was over when this one began
                    top.end_ns, top.clipped = call.start_ns, True
                    stack.pop()
            stack.append(call)

    out: list[dict[str, Any]] = []
    for call in calls:
        pre, post = call.pre, call.post
        args: dict[str, Any] = {
            "step": pre.step,
            "module": pre.module,
            "non_model_bytes_before": pre.non_model_bytes,
        }
        if post is not None:
            act = Category.ACTIVATION.value
            args["non_model_bytes_after"] = post.non_model_bytes
            args["activation_delta_bytes"] = post.bytes.get(act, 0) - pre.bytes.get(act, 0)
        else:
            args["unclosed"] = True
        if call.clipped:
            args["clipped"] = True
        out.append(
            {
                "ph": "X",
                "name": _label(pre.module),
                "cat": pre.phase,
                "pid": pid,
                "tid": call.tid,
                "ts": _us(call.start_ns),
                "dur": _us(call.end_ns - call.start_ns),
                "args": args,
            }
        )
    return out


def _step_slices(samples: Sequence[Sample], pid: int) -> list[dict[str, Any]]:
    out = []
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for s in samples:
        first.setdefault(s.step, s.t_ns)
        last[s.step] = s.t_ns
    for step, t in first.items():
        out.append(
            {
                "ph": "X",
                "name": f"step {step}",
                "cat": "step",
                "pid": pid,
                "tid": TID_STEPS,
                "ts": _us(t),
                "dur": _us(last[step] - t),
                "args": {"step": step},
            }
        )
    return out


# ---- PyTorch memory snapshot (memory_viz) ----------------------------------------------------------------
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
        {"filename": category, "line": s.step, "name": f"{s.phase} {s.event} of {_label(s.module)}"},
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


# ---- PNG -------------------------------------------------------------------------------------------------
def png_available() -> bool:
    """Whether matplotlib (the ``plot`` extra) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_png(timeline: MemoryTimeline, path: str | os.PathLike[str]) -> Path:
    """Stacked area plot of live bytes by category over time, the non-model peak marked; returns the path.

    Rendered with matplotlib's Agg canvas (no display, no pyplot global state) and written atomically.

    Raises:
        ImportError: matplotlib is missing (the message says to ``pip install 'memsched[plot]'``).
    """
    atomic_write_bytes(path, _png_bytes(timeline))
    return Path(path)


def _png_bytes(timeline: MemoryTimeline) -> bytes:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, MultipleLocator
    except ImportError as e:
        raise ImportError(PNG_HINT) from e
    # Shared with the terminal report: the colours, and the step count.
    from memsched.report import CATEGORY_COLORS, CATEGORY_ORDER, traced_steps

    samples = timeline.for_device()
    fig = Figure(figsize=(10, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    steps = traced_steps(timeline)
    ax.set_title(
        f"memsched trace: {timeline.device} ({timeline.meta.get('backend', '?')}), "
        f"{steps} step{'s' if steps != 1 else ''}"
    )
    ax.set_xlabel("time since the tracer started (ms)")
    ax.set_ylabel("live bytes")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_bytes(v)))
    if samples:
        t0 = samples[0].t_ns
        xs = [(s.t_ns - t0) / 1e6 for s in samples]
        cats = [c for c in CATEGORY_ORDER if any(s.bytes.get(c, 0) for s in samples)]
        if cats:
            ax.stackplot(
                xs,
                [[s.bytes.get(c, 0) for s in samples] for c in cats],
                labels=cats,
                colors=[CATEGORY_COLORS[c] for c in cats],
                step="post",
                alpha=0.9,
            )
        peak = timeline.peak_non_model_sample()
        if peak is not None and peak.peak_non_model_bytes > 0:
            x = (peak.t_ns - t0) / 1e6
            ax.axvline(x, color="black", linestyle="--", linewidth=1)
            ax.annotate(
                f"peak non-model {format_bytes(peak.peak_non_model_bytes)}\n"
                f"{peak.phase} of {_label(peak.module)}",
                xy=(x, 0.97),
                xycoords=("data", "axes fraction"),
                # Label on the side with room: right of the line, or left of it near the right edge.
                xytext=(4, 0) if x <= 0.7 * xs[-1] else (-4, 0),
                ha="left" if x <= 0.7 * xs[-1] else "right",
                textcoords="offset points",
                va="top",
                fontsize=8,
            )
        for i in range(1, len(samples)):  # faint line where each new step begins
            if samples[i].step != samples[i - 1].step:
                ax.axvline(xs[i], color="grey", linewidth=0.6, alpha=0.6)
        ax.set_xlim(xs[0], max(xs[-1], xs[0] + 1e-3))
        ymax = max(s.total_bytes for s in samples)
        if ymax > 0:
            ax.set_ylim(0, ymax * 1.08)
            ax.yaxis.set_major_locator(MultipleLocator(_tick_step(ymax)))
        if cats:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _tick_step(ymax: int) -> int:
    """A y tick step of 1, 2 or 5 times a power of ten of a binary unit (ticks read 10.0 MiB, not 9.5 MiB)."""
    unit = next((u for u in (2**40, 2**30, 2**20, 2**10) if ymax >= u), 1)
    for mult in (1, 2, 5, 10, 20, 50, 100, 200, 500):
        if ymax / (mult * unit) <= 6:
            return mult * unit
    return 1000 * unit


# ---- everything ------------------------------------------------------------------------------------------
def export_paths(
    out_dir: str | os.PathLike[str],
    stem: str = "trace",
    overrides: Mapping[str, str | os.PathLike[str] | None] | None = None,
) -> dict[str, Path]:
    """Where :func:`write_all` writes each export: ``out_dir/<stem><suffix>`` unless overridden by kind.

    Raises:
        ValueError: an override names an unknown kind (the message lists the kinds), or ``stem`` is empty
            or contains a path separator.
    """
    if not stem or "/" in stem or os.sep in stem:
        raise ValueError(f"stem must be a plain file name prefix, got {stem!r}")
    paths = {kind: Path(out_dir) / f"{stem}{suffix}" for kind, suffix in SUFFIXES.items()}
    for kind, path in (overrides or {}).items():
        if kind not in SUFFIXES:
            raise ValueError(f"unknown export kind {kind!r}; expected one of {', '.join(SUFFIXES)}")
        if path is not None:
            paths[kind] = Path(path)
    return paths


def write_all(
    timeline: MemoryTimeline,
    out_dir: str | os.PathLike[str],
    stem: str = "trace",
    *,
    overrides: Mapping[str, str | os.PathLike[str] | None] | None = None,
    kinds: Iterable[str] | None = None,
) -> dict[str, Path]:
    """Write the JSON, Perfetto, memory_viz and PNG exports; returns ``{kind: path}`` of what was written.

    Paths are ``out_dir/<stem>.json``, ``.perfetto.json``, ``.memory_viz.pickle`` and ``.png``, unless
    ``overrides`` maps a kind to another path. ``kinds`` limits the exports (default: all). The PNG is
    skipped (absent from the result) when matplotlib is missing; see :func:`png_available`. All exports are
    rendered in memory first, so a failure while rendering writes nothing.

    Raises:
        ValueError: an unknown kind in ``kinds`` or ``overrides``, or a bad ``stem``.
    """
    paths = export_paths(out_dir, stem, overrides)
    wanted = list(SUFFIXES) if kinds is None else list(kinds)
    for kind in wanted:
        if kind not in SUFFIXES:
            raise ValueError(f"unknown export kind {kind!r}; expected one of {', '.join(SUFFIXES)}")
    render = {
        "json": lambda: json.dumps(timeline.to_dict(), separators=(",", ":")).encode("utf-8"),
        "perfetto": lambda: _perfetto_bytes([timeline]),
        "memory_viz": lambda: _memory_viz_bytes(timeline),
        "png": lambda: _png_bytes(timeline),
    }
    payloads: dict[str, bytes] = {}
    for kind in wanted:
        if kind == "png" and not png_available():
            continue
        payloads[kind] = render[kind]()
    for kind, data in payloads.items():
        atomic_write_bytes(paths[kind], data)
    return {kind: paths[kind] for kind in payloads}
