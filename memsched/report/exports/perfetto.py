"""Chrome / Perfetto trace-event JSON: counter tracks per category and device, module slices, one process
per rank (https://ui.perfetto.dev, chrome://tracing)."""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memsched.report.exports._common import label
from tracer.categories import Category
from tracer.timeline import MemoryTimeline, Sample, atomic_write_bytes

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

# Sample.cuda figures of the caching allocator, shown as counter tracks.
_CUDA_COUNTERS = ("allocated", "reserved")


def to_perfetto(timelines: MemoryTimeline | Sequence[MemoryTimeline],
                step_timelines: Sequence[Any] = ()) -> dict[str, Any]:
    """Chrome / Perfetto trace-event JSON for one or more timelines (one per rank).

    Each timeline becomes the process ``pid = timeline.meta.get("rank", 0)`` (named ``rank R (device)``), so
    the timelines of several ranks merge into one trace. Per device sampled, a counter event (``"ph": "C"``)
    per sample carries the live bytes of each category (Perfetto shows one track per category); on CUDA, more
    counters carry the caching allocator's allocated / reserved bytes and NVML's device-wide used bytes.
    Module calls are complete events (``"ph": "X"``) on one thread per phase (forward, backward, optimizer,
    other), from the ``pre``/``post`` samples of the traced device, made to nest even when a module runs
    several times, a ``post`` is missing or backward hooks fire out of order (see :func:`_slices`). Steps are
    slices on their own thread; ``mark`` samples are instant events. Timestamps (``ts``, ``dur``) are
    microseconds since the tracer was entered. Each of ``step_timelines``
    (:class:`memsched.telemetry.step_timeline.StepTimeline`, one per rank, in rank order) adds a process
    ``1000 + rank`` with a thread per track (training thread, waits, CPU update), in microseconds since its
    first step.

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
    for rank, st in enumerate(step_timelines):
        events.extend(st.to_perfetto_events(pid=1000 + rank, name=f"rank {rank} step timeline"))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "memsched", "units": "bytes; ts/dur in microseconds"},
    }


def write_perfetto(
    timelines: MemoryTimeline | Sequence[MemoryTimeline], path: str | os.PathLike[str],
    step_timelines: Sequence[Any] = (),
) -> Path:
    """Write :func:`to_perfetto` JSON to ``path`` atomically; returns the path."""
    atomic_write_bytes(path, _perfetto_bytes(timelines, step_timelines))
    return Path(path)


def _perfetto_bytes(timelines: MemoryTimeline | Sequence[MemoryTimeline],
                    step_timelines: Sequence[Any] = ()) -> bytes:
    return json.dumps(to_perfetto(timelines, step_timelines), separators=(",", ":")).encode("utf-8")


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
                    "name": label(s.module),
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
                "name": label(pre.module),
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
