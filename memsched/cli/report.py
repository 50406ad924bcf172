"""`memsched report FILE.json`: re-render a saved timeline and, on request, re-export it.

Also holds what ``memsched trace`` and ``memsched demo`` share with it: the checks of the export options
(before any work; the options themselves are in :mod:`memsched.cli.parsers`), the "where did it go"
printing, and :func:`report_dict`, the report's figures as the JSON document ``--json`` prints. Exports
replace existing files of the same name (atomically); a path that is a folder, or lies under a file, is
refused before the work starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from memsched.report import exports
from memsched.report.console import make_console
from memsched.report.text import peak_total, render_report, traced_steps
from policies.types import PlacementPlan
from tracer.timeline import MemoryTimeline

# CLI option -> export kind (see memsched.report.exports.SUFFIXES).
EXPORT_OPTIONS = {"perfetto": "perfetto", "memory_viz": "memory_viz", "png": "png"}
# Export kind -> the option that overrides its path, for messages.
OPTION_OF = {"json": "--timeline", "perfetto": "--perfetto", "memory_viz": "--memory-viz", "png": "--png"}
#: ``schema`` and ``version`` of :func:`report_dict`, the document ``--json`` prints.
SCHEMA = "memsched.report.text"
VERSION = 1


def report_dict(
    timeline: MemoryTimeline,
    *,
    top: int = 10,
    plan: PlacementPlan | None = None,
    transfers: Mapping[str, int] | None = None,
    step_summary: Mapping[str, Any] | None = None,
    plan_history: Sequence[Any] | None = None,
    host_usage: Any = None,
) -> dict[str, Any]:
    """The figures of the text report (:func:`memsched.report.text.render_report`, same arguments) as
    JSON-ready
    data: what ``memsched demo/trace/report --json`` print. Sizes are bytes, times seconds.

    Keys: ``schema`` (:data:`SCHEMA`), ``version``; ``meta`` (the timeline's); ``summary``
    (:meth:`tracer.MemoryTimeline.summary` of the traced device, with ``steps`` as the report counts them,
    ``peak_total_bytes`` and ``peak_total_at``: the report's one peak total
    (:func:`memsched.report.text.peak_total`) and the sample closing its interval, and ``other_devices``: peak
    bytes per other sampled device);
    ``modules``: ``count`` and the ``top`` modules by activations kept for backward, as the module table
    orders them (:class:`tracer.timeline.ModuleStats` fields, per call, plus ``calls_per_step``); ``plan``
    (:meth:`policies.PlacementPlan.to_dict`), ``transfers``, ``step_summary`` and ``plan_history``
    (:meth:`memsched.planning.elastic.PlanChange.to_dict` each) and ``host_memory``
    (:meth:`memsched.telemetry.host_usage.HostUsage.to_dict`): ``None`` when not given.

    Raises:
        ValueError: ``top`` is not an integer >= 1.
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be an integer >= 1, got {top!r}")
    steps = traced_steps(timeline)
    total, at = peak_total(timeline)
    modules = sorted(timeline.module_stats(), key=lambda m: m.activation_bytes, reverse=True)
    summary = {
        **timeline.summary(),
        "steps": steps,
        "peak_total_bytes": total,
        "peak_total_at": None if at is None else {"step": at.step, "phase": at.phase, "module": at.module,
                                                  "event": at.event},
        "other_devices": {d: timeline.peak_bytes(d) for d in timeline.devices() if d != timeline.device},
    }
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "meta": timeline.meta,
        "summary": summary,
        "modules": {"count": len(modules), "top": [
            {**dataclasses.asdict(m), "calls_per_step": m.calls / max(1, steps)} for m in modules[:top]]},
        "plan": plan.to_dict() if plan is not None else None,
        "transfers": dict(transfers) if transfers is not None else None,
        "step_summary": dict(step_summary) if step_summary is not None else None,
        "plan_history": [h.to_dict() for h in plan_history] if plan_history is not None else None,
        "host_memory": host_usage.to_dict() if host_usage is not None else None,
    }


def print_json(document: Mapping[str, Any]) -> None:
    """``--json``: ``document`` as the only thing on stdout."""
    print(json.dumps(document, indent=2))


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (where a missing folder would be created)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_can_create_in(folder: Path, what: str) -> None:
    """``folder`` exists as a writable folder or can be created as one."""
    base = _nearest_existing(Path(os.path.abspath(folder)))
    if not base.is_dir():
        raise ValueError(f"{what}: {str(base)!r} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: no permission to write in the folder {str(base)!r}")


def check_exports(
    out_dir: str | os.PathLike[str], overrides: Mapping[str, str | None], kinds: list[str]
) -> None:
    """Check, before any work, where :func:`write_exports` will write ``kinds``: ``out_dir`` (when a kind
    is not overridden) is a folder or can be made one, each path is not a folder and its folder can be
    written, and no two exports share a path. An existing file is fine: it is replaced.

    Raises:
        ValueError: one line naming the option, the path and the problem.
    """
    if any(overrides.get(k) is None for k in kinds):
        out = Path(out_dir)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {str(out)!r} is a file; expected a folder for the exports (created if "
                             "missing)")
        _check_can_create_in(out, f"--out {str(out)!r}")
    paths = exports.export_paths(out_dir, overrides=overrides)
    seen: dict[str, str] = {}
    for kind in kinds:  # the PNG too, even when matplotlib is missing and it will be skipped
        path = paths[kind]
        overridden = overrides.get(kind) is not None
        what = f"{OPTION_OF[kind]} {str(path)!r}" if overridden else f"{str(path)!r} (in --out)"
        if path.is_dir():
            raise ValueError(f"{what} is a folder; expected a file path (an existing file is replaced)")
        _check_can_create_in(path.parent, what)
        key = os.path.abspath(path)
        if key in seen:
            raise ValueError(f"{seen[key]} and {what} are the same file; give each export its own path")
        seen[key] = what


def write_exports(
    timeline: MemoryTimeline,
    *,
    out_dir: str | os.PathLike[str] | None,
    overrides: Mapping[str, str | None],
    kinds: list[str],
    console: Console | None,
) -> tuple[int, dict[str, Path]]:
    """Write the exports, print where they went on ``console`` (``None``: nowhere; ``--json`` says it), and
    say so on stderr when the PNG had to be skipped.

    Returns ``(status, {kind: path written})``; status is 0, or 1 when a PNG was asked for explicitly
    (``--png``) but matplotlib is missing.
    """
    wanted = list(kinds)
    status = 0
    if "png" in wanted and not exports.png_available():
        wanted.remove("png")
        explicit = overrides.get("png") is not None
        print(
            f"memsched: {'cannot write' if explicit else 'skipped'} PNG: {exports.PNG_HINT}", file=sys.stderr
        )
        status = 1 if explicit else 0
    written = exports.write_all(
        timeline, out_dir if out_dir is not None else ".", overrides=overrides, kinds=wanted
    )
    if console is not None:
        for kind, path in written.items():
            console.print(f"wrote {kind:<10} {path}", highlight=False, soft_wrap=True)
    return status, written


def run(args: argparse.Namespace) -> int:
    try:
        timeline = MemoryTimeline.load(args.file)  # its ValueErrors name the file and the problem
    except OSError as e:  # missing, a folder, no permission
        raise ValueError(f"cannot read {args.file!r}: {e.strerror or e}") from None
    overrides = {kind: getattr(args, opt) for opt, kind in EXPORT_OPTIONS.items()}
    kinds = [kind for kind, path in overrides.items() if path is not None]
    check_exports(Path(args.file).parent, overrides, kinds)  # before the report is rendered
    console = None if args.json else make_console()
    if console is not None:
        render_report(timeline, top=args.top, console=console)
    status, written = 0, {}
    if kinds:
        status, written = write_exports(
            timeline, out_dir=Path(args.file).parent, overrides=overrides, kinds=kinds, console=console
        )
    if args.json:
        print_json({**report_dict(timeline, top=args.top), "command": "report", "file": str(args.file),
                    "exports": {kind: str(path) for kind, path in written.items()}})
    return status
