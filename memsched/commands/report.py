"""`memsched report FILE.json`: re-render a saved timeline and, on request, re-export it.

Also holds the export options and the "where did it go" printing shared with ``memsched trace``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from rich.console import Console

from memsched import exports
from memsched.commands.argtypes import positive_int
from memsched.report import render_report
from tracer.timeline import MemoryTimeline

# CLI option -> export kind (see memsched.exports.SUFFIXES).
EXPORT_OPTIONS = {"perfetto": "perfetto", "memory_viz": "memory_viz", "png": "png"}




def add_export_options(p: argparse.ArgumentParser, *, with_json: bool) -> None:
    """The per-file export options (``--perfetto F`` ...) of ``trace`` and ``report``."""
    if with_json:
        p.add_argument("--json", metavar="FILE", help="timeline JSON path (default: OUT/trace.json)")
    p.add_argument(
        "--perfetto", metavar="FILE", help="Chrome/Perfetto trace-event JSON (open in ui.perfetto.dev)"
    )
    p.add_argument(
        "--memory-viz",
        dest="memory_viz",
        metavar="FILE",
        help="pickled PyTorch memory snapshot (open in pytorch.org/memory_viz)",
    )
    p.add_argument("--png", metavar="FILE", help="stacked-area plot by category (needs 'memsched[plot]')")


def write_exports(
    timeline: MemoryTimeline,
    *,
    out_dir: str | os.PathLike[str] | None,
    overrides: Mapping[str, str | None],
    kinds: list[str],
    console: Console,
) -> int:
    """Write the exports, print where they went, and say so when the PNG had to be skipped.

    Returns 0, or 1 when a PNG was asked for explicitly (``--png``) but matplotlib is missing.
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
    for kind, path in written.items():
        console.print(f"wrote {kind:<10} {path}", highlight=False, soft_wrap=True)
    return status


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="re-render a saved timeline (memsched trace's JSON) and optionally re-export it",
        description="Print the memory report of a timeline saved by `memsched trace` (its .json file); "
        "--perfetto/--memory-viz/--png also write those exports.",
    )
    p.add_argument("file", metavar="FILE.json", help="timeline JSON written by `memsched trace`")
    p.add_argument("--top", type=positive_int, default=10, help="modules to list (default: 10)")
    add_export_options(p, with_json=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    timeline = MemoryTimeline.load(args.file)  # FileNotFoundError / ValueError become one error line
    console = Console()
    render_report(timeline, top=args.top, console=console)
    overrides = {kind: getattr(args, opt) for opt, kind in EXPORT_OPTIONS.items()}
    kinds = [kind for kind, path in overrides.items() if path is not None]
    if not kinds:
        return 0
    return write_exports(
        timeline, out_dir=Path(args.file).parent, overrides=overrides, kinds=kinds, console=console
    )
