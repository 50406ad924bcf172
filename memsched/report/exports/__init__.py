"""Write a memory timeline to files other tools open.

* ``write_json``: memsched's own versioned JSON (:meth:`tracer.MemoryTimeline.save`), read back by
  ``memsched report``.
* ``write_perfetto``: Chrome / Perfetto trace-event JSON (the "Trace Event Format"): one counter track per
  category and device, module slices on a forward and a backward thread, one process per rank. Opens in
  https://ui.perfetto.dev and chrome://tracing.
* ``write_memory_viz``: a pickled PyTorch memory snapshot (the format of ``torch.cuda.memory._snapshot()``),
  for PyTorch's own viewer at https://pytorch.org/memory_viz. Allocations are synthesised from the
  per-category byte changes between samples (the tracer records sizes, not addresses).
* ``write_png``: a stacked area plot by category and, given the placement plan, the decision on the same
  axis: capacity, resident model data, peak non-model data, GPU margin, budget, optimizer state on the device
  and on the host (needs matplotlib: ``pip install 'memsched[plot]'``; :func:`render_figure` returns the
  matplotlib Figure).

Every file is written atomically (:func:`tracer.timeline.atomic_write_bytes`), so an interrupted export never
leaves a half-written file; :func:`write_all` renders every export in memory before writing the first one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from memsched.report.exports._common import META_DECISION, META_DEVICE_GIVEN
from memsched.report.exports.jsonfile import write_json
from memsched.report.exports.memory_viz import _memory_viz_bytes, to_memory_viz, write_memory_viz
from memsched.report.exports.perfetto import (
    TID_BACKWARD,
    TID_FORWARD,
    TID_OPTIMIZER,
    TID_OTHER,
    TID_STEPS,
    _perfetto_bytes,
    to_perfetto,
    write_perfetto,
)
from memsched.report.exports.png import (
    PNG_HINT,
    _png_bytes,
    decision_of,
    png_available,
    render_figure,
    write_png,
)
from policies.types import PlacementPlan, PlacementProblem
from tracer.timeline import MemoryTimeline, atomic_write_bytes

# Suffixes of the files write_all creates: <stem><suffix>.
SUFFIXES: dict[str, str] = {
    "json": ".json",
    "perfetto": ".perfetto.json",
    "memory_viz": ".memory_viz.pickle",
    "png": ".png",
}

__all__ = [
    "PNG_HINT",
    "SUFFIXES",
    "TID_BACKWARD",
    "TID_FORWARD",
    "TID_OPTIMIZER",
    "TID_OTHER",
    "TID_STEPS",
    "export_paths",
    "png_available",
    "render_figure",
    "to_memory_viz",
    "to_perfetto",
    "write_all",
    "write_json",
    "write_memory_viz",
    "write_perfetto",
    "write_png",
]


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
    step_timelines: Sequence[Any] = (),
    plan: PlacementPlan | None = None,
    problem: PlacementProblem | None = None,
    device: str | None = None,
) -> dict[str, Path]:
    """Write the JSON, Perfetto, memory_viz and PNG exports; returns ``{kind: path}`` of what was written.

    Paths are ``out_dir/<stem>.json``, ``.perfetto.json``, ``.memory_viz.pickle`` and ``.png``, unless
    ``overrides`` maps a kind to another path. ``kinds`` limits the exports (default: all). The PNG is
    skipped (absent from the result) when matplotlib is missing; see :func:`png_available`. All exports are
    rendered in memory first, so a failure while rendering writes nothing. ``step_timelines``
    (:class:`memsched.telemetry.step_timeline.StepTimeline`) go into the Perfetto trace too. ``plan`` and
    ``problem`` (``sched.plan``, ``sched.problem``) add the decision to the PNG, and ``device`` (as the user
    gave it, e.g. ``"sim:8GiB"``) names it in the PNG's title; both are saved in the JSON's ``meta``
    (``"decision"``, ``"device_given"``, optional keys that older files lack), so a re-export of that JSON
    draws them too.

    Raises:
        ValueError: an unknown kind in ``kinds`` or ``overrides``, a bad ``stem``, or a ``plan`` without the
            ``problem`` it was made for.
    """
    paths = export_paths(out_dir, stem, overrides)
    wanted = list(SUFFIXES) if kinds is None else list(kinds)
    for kind in wanted:
        if kind not in SUFFIXES:
            raise ValueError(f"unknown export kind {kind!r}; expected one of {', '.join(SUFFIXES)}")
    data = timeline.to_dict()
    decision = decision_of(timeline, plan, problem) if plan is not None else None
    if decision is not None or device is not None:
        data["meta"] = dict(data["meta"])  # the timeline's own meta stays as it is
        if decision is not None:
            data["meta"][META_DECISION] = decision.to_dict()
        if device is not None:
            data["meta"][META_DEVICE_GIVEN] = device
    render = {
        "json": lambda: json.dumps(data, separators=(",", ":")).encode("utf-8"),
        "perfetto": lambda: _perfetto_bytes([timeline], step_timelines),
        "memory_viz": lambda: _memory_viz_bytes(timeline),
        "png": lambda: _png_bytes(timeline, plan=plan, problem=problem, device=device),
    }
    payloads: dict[str, bytes] = {}
    for kind in wanted:
        if kind == "png" and not png_available():
            continue
        payloads[kind] = render[kind]()
    for kind, data in payloads.items():
        atomic_write_bytes(paths[kind], data)
    return {kind: paths[kind] for kind in payloads}
