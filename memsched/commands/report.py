"""`memsched report FILE.json`: re-render a saved timeline and, on request, re-export it.

Also holds the checks of the export options (before any work; the options themselves are in
:mod:`memsched.commands.parsers`) and the "where did it go" printing shared with ``memsched trace``. Exports
replace existing files of the same name (atomically); a path that is a folder, or lies under a file, is
refused before the work starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from rich.console import Console

from memsched import exports
from memsched.console import make_console
from memsched.report import render_report
from tracer.timeline import MemoryTimeline

# CLI option -> export kind (see memsched.exports.SUFFIXES).
EXPORT_OPTIONS = {"perfetto": "perfetto", "memory_viz": "memory_viz", "png": "png"}
# Export kind -> the option that overrides its path, for messages.
OPTION_OF = {"json": "--json", "perfetto": "--perfetto", "memory_viz": "--memory-viz", "png": "--png"}


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


def run(args: argparse.Namespace) -> int:
    try:
        timeline = MemoryTimeline.load(args.file)  # its ValueErrors name the file and the problem
    except OSError as e:  # missing, a folder, no permission
        raise ValueError(f"cannot read {args.file!r}: {e.strerror or e}") from None
    overrides = {kind: getattr(args, opt) for opt, kind in EXPORT_OPTIONS.items()}
    kinds = [kind for kind, path in overrides.items() if path is not None]
    check_exports(Path(args.file).parent, overrides, kinds)  # before the report is rendered
    console = make_console()
    render_report(timeline, top=args.top, console=console)
    if not kinds:
        return 0
    return write_exports(
        timeline, out_dir=Path(args.file).parent, overrides=overrides, kinds=kinds, console=console
    )
