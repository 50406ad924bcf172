"""Step-time timeline: where the time of each steady-state training step went.

Recorded after warmup, from host clocks (``time.perf_counter``), at points memsched already controls, so the
cost is a few clock reads per step, per host chunk and per wait:

* track ``main`` (the training thread) tiles each step's interval, from the previous ``optimizer.step()``
  return to this one's, into ``data`` (until the model's forward), ``forward``, ``backward`` (forward's end to
  ``step()``; the loss and any clipping included) and ``step``; so the phases add up to the step exactly;
* track ``waits``: each time the training thread blocked for a chunk (a module's forward waiting for an
  overlapped CPU update, a ``synchronize()``, the next ``step()``), named ``<module> <- chunk <i>``;
* track ``cpu update`` (the worker thread with ``overlap=True``, else the training thread inside ``step``):
  per host chunk, ``d2h wait`` (blocked on its gradients' copy), ``update`` (fused AdamW on the CPU) and
  ``h2d`` (issuing, or on the CPU doing, the copy of its parameters);
* tracks ``h2d`` and ``d2h`` (the stand-in's modelled host link, ``device="sim:SIZE,link=25GBps"``,
  :mod:`memsched.devices.transfers`): each copy on its copy thread, with its ``bytes``; the training thread's
  waits for copies (a module's forward waiting for its chunks' H2D, the step waiting for the gradients' D2H)
  are ``waits`` spans with a ``copy`` argument (``"h2d"``/``"d2h"``).

Under ``torch.compile`` the model's forward hooks compile to nothing (a clock read would break the graph):
a step whose forward ran compiled has no ``forward`` and ``backward`` phases but one ``compiled`` phase from
the previous ``step()`` to this one (data loading included).

On CUDA these are host times: a copy or a kernel the GPU has not reached yet is not in them, only the host's
waits for it. A span is recorded with the step that is open when it ends; the summary counts the part of
each span inside the step's interval.

The summary of a step: ``step_s``, its phases, ``cpu_update_s`` (all CPU-update spans), ``exposed_cpu_s``
(what the training thread spent on the CPU update: its own updates when serial, its waits when overlapped),
``ideal_s = max(step_s - exposed_cpu_s, cpu_update_s)`` (the step if the two sides overlapped perfectly) and
``overlap_efficiency = ideal_s / step_s``; with a modelled link, ``copy_wait_s`` (the training thread's waits
for copies, not counted in ``exposed_cpu_s``), ``h2d_s``/``d2h_s`` (time on the copy tracks) and
``h2d_copy_bytes``/``d2h_copy_bytes`` (bytes of the copies that ended in the step). No offload system
attributes a step's stalls this way; the closest is DeepSpeed's per-phase wall-clock breakdown
(``wall_clock_breakdown``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import torch

# The copy tracks of the stand-in's modelled link and the waits track are named where the copies are made
from memsched.devices.transfers import D2H, H2D, WAITS

MAIN, CPU_UPDATE = "main", "cpu update"
PHASES = ("data", "forward", "backward", "step")


@dataclass(frozen=True)
class Span:
    """One interval: ``track`` (a thread or stream), ``name``, ``start_s``/``end_s`` (``perf_counter``
    seconds), ``args`` (e.g. ``{"chunk": 3}``)."""

    track: str
    name: str
    start_s: float
    end_s: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class StepRecord:
    """The spans of one step (``step``: the optimizer step count after it) over ``[start_s, end_s]``."""

    step: int
    start_s: float
    end_s: float
    spans: tuple[Span, ...]
    overlap: bool

    @property
    def step_s(self) -> float:
        return self.end_s - self.start_s

    def phase_seconds(self) -> dict[str, float]:
        """Seconds per phase of the ``main`` track (``data``, ``forward``, ``backward``, ``step``)."""
        out = dict.fromkeys(PHASES, 0.0)
        for s in self.spans:
            if s.track == MAIN:
                out[s.name] = out.get(s.name, 0.0) + s.seconds
        return out

    def _inside(self, s: Span) -> float:
        """Seconds of ``s`` inside this step's interval (a worker span can start in one step and end, or be
        recorded, in the next)."""
        return max(0.0, min(self.end_s, s.end_s) - max(self.start_s, s.start_s))

    def summary(self) -> dict[str, Any]:
        """Step time, phases, CPU-update time, exposed CPU time, waits, the ideal step and the overlap
        efficiency (see the module docstring); seconds, each span counted for its part inside the step."""
        cpu = sum(self._inside(s) for s in self.spans if s.track == CPU_UPDATE)
        waits = sum(self._inside(s) for s in self.spans if s.track == WAITS)
        copy_waits = sum(self._inside(s) for s in self.spans if s.track == WAITS and "copy" in s.args)
        d2h_wait = sum(self._inside(s) for s in self.spans if s.track == CPU_UPDATE and s.name == "d2h wait")
        exposed = waits - copy_waits if self.overlap else cpu
        ideal = max(self.step_s - exposed, cpu)
        out = {
            "step": self.step, "step_s": self.step_s, "phases_s": self.phase_seconds(),
            "cpu_update_s": cpu, "exposed_cpu_s": exposed, "waits_s": waits, "d2h_wait_s": d2h_wait,
            "ideal_s": ideal, "overlap_efficiency": ideal / self.step_s if self.step_s > 0 else 1.0,
            "overlap": self.overlap, "copy_wait_s": copy_waits,
        }
        for track in (H2D, D2H):
            out[f"{track}_s"] = sum(self._inside(s) for s in self.spans if s.track == track)
            out[f"{track}_copy_bytes"] = sum(s.args.get("bytes", 0) for s in self.spans if s.track == track)
        return out


class StepTimeline:
    """The last ``keep`` steps' spans (``sched.step_timeline``); see the module docstring.

    Thread-safe for :meth:`span` (the CPU-update worker records too); the phase marks come from the training
    thread.
    """

    def __init__(self, keep: int = 32, *, overlap: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 step, got {keep!r}")
        self.records: deque[StepRecord] = deque(maxlen=keep)
        self.overlap = overlap
        self.enabled = False  # recording starts after warmup
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._start: float | None = None
        self._phase: tuple[str, float] | None = None
        self._depth = 0  # nested calls of the model's forward
        self._forward_seen = False  # an eager forward hook ran since the last step

    # ---- recording ----------------------------------------------------------------------------------------
    def start(self, *, overlap: bool | None = None) -> None:
        """Begin recording: the first step starts now (the end of the warmup step). ``overlap``: the steps to
        come overlap the CPU update with the next forward (``None``: as before)."""
        if overlap is not None:
            self.overlap = overlap
        self.enabled = True
        self._start = time.perf_counter()
        self._phase = ("data", self._start)

    def span(self, track: str, name: str, start_s: float, end_s: float, **args: Any) -> None:
        if self.enabled:
            sp = Span(track, name, start_s, end_s, args)
            with self._lock:
                if self._start is None or end_s >= self._start:
                    self._spans.append(sp)
                else:
                    self._late(sp)

    def _late(self, sp: Span) -> None:
        """A span that ended in a closed step but reached the lock after it closed (a worker thread
        descheduled between its clock read and this call, as on a loaded 2-core machine) goes to the step it
        ended in, not the open one it does not overlap; one that ended before the first record is dropped
        (warmup is not recorded). Called under the lock."""
        for i in range(len(self.records) - 1, -1, -1):
            rec = self.records[i]
            if rec.start_s <= sp.end_s:
                self.records[i] = replace(rec, spans=rec.spans + (sp,))
                return

    def _enter(self, phase: str) -> None:
        now = time.perf_counter()
        if self._phase is not None:
            self.span(MAIN, self._phase[0], self._phase[1], now)
        self._phase = (phase, now)

    def forward_begin(self) -> None:
        if torch.compiler.is_compiling():  # host clocks would break the graph: see the module docstring
            return
        if self.enabled:
            self._depth += 1
            self._forward_seen = True
            if self._depth == 1:
                self._enter("forward")

    def forward_end(self) -> None:
        if torch.compiler.is_compiling():
            return
        if self.enabled and self._depth > 0:
            self._depth -= 1
            if self._depth == 0:
                self._enter("backward")

    def step_begin(self) -> None:
        if self.enabled:
            self._depth = 0
            if not self._forward_seen and self._phase is not None and self._phase[0] == "data":
                self._phase = ("compiled", self._phase[1])  # the forward ran compiled: no hook marked it
            self._forward_seen = False
            self._enter("step")

    def step_end(self, step: int) -> None:
        """Close the step (``step``: the optimizer step count after it)."""
        if not self.enabled or self._start is None:
            return
        self._enter("data")
        end = self._phase[1] if self._phase is not None else time.perf_counter()
        with self._lock:
            spans, self._spans = self._spans, []
            self.records.append(StepRecord(step, self._start, end, tuple(spans), self.overlap))
            self._start = end

    def stop(self) -> None:
        self.enabled = False

    def take_last(self) -> StepRecord | None:
        """The last step's record, or ``None``; every record is dropped (the warmup steps' records are read
        once, by the cost model, and never shown)."""
        with self._lock:
            last = self.records[-1] if self.records else None
            self.records.clear()
        return last

    # ---- reading ------------------------------------------------------------------------------------------
    def summaries(self) -> list[dict[str, Any]]:
        return [r.summary() for r in self.records]

    def mean_summary(self) -> dict[str, Any] | None:
        """The mean of :meth:`summaries` over the recorded steps (``None`` before the first)."""
        rows = self.summaries()
        if not rows:
            return None
        n = len(rows)
        keys = ("step_s", "cpu_update_s", "exposed_cpu_s", "waits_s", "d2h_wait_s", "ideal_s", "copy_wait_s",
                "h2d_s", "d2h_s", "h2d_copy_bytes", "d2h_copy_bytes")
        out: dict[str, Any] = {k: sum(r[k] for r in rows) / n for k in keys}
        out["phases_s"] = {p: sum(r["phases_s"][p] for r in rows) / n for p in PHASES}
        out["overlap_efficiency"] = out["ideal_s"] / out["step_s"] if out["step_s"] > 0 else 1.0
        out["steps"], out["overlap"] = n, self.overlap
        return out

    def to_perfetto_events(self, pid: int = 1000,
                           name: str = "memsched step timeline") -> list[dict[str, Any]]:
        """Chrome / Perfetto trace events: one process ``pid``, a thread per track, complete events (``X``)
        in microseconds since the first recorded step."""
        if not self.records:
            return []
        t0 = self.records[0].start_s
        tracks: dict[str, int] = {}
        events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                                         "args": {"name": name}}]
        for rec in self.records:
            events.append({"ph": "X", "name": f"step {rec.step}", "pid": pid, "tid": 0, "cat": "step",
                           "ts": (rec.start_s - t0) * 1e6, "dur": rec.step_s * 1e6,
                           "args": {k: v for k, v in rec.summary().items() if k != "phases_s"}})
            for s in rec.spans:
                tid = tracks.setdefault(s.track, len(tracks) + 1)
                events.append({"ph": "X", "name": s.name, "pid": pid, "tid": tid, "cat": s.track,
                               "ts": (s.start_s - t0) * 1e6, "dur": s.seconds * 1e6, "args": s.args})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "steps"}})
        for track, tid in tracks.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
        return events
