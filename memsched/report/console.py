"""Rich consoles that read right wherever the output goes: a terminal, a log file, CI, a notebook.

On a terminal (or in Jupyter) rich already knows the width and the colours. Anywhere else it prints no ANSI
codes but wraps at 80 columns, which folds the report's tables and bars; :func:`make_console` then takes the
width from ``COLUMNS``, else :data:`DEFAULT_WIDTH`. What colour alone would say, the report also says with
symbols and words (see :func:`plain`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import IO

from rich.console import Console

#: Columns when the output is not a terminal and ``COLUMNS`` is not set: wide enough for the report's tables
#: and bars on one line each, narrow enough for a log viewer.
DEFAULT_WIDTH = 120


def output_width(environ: Mapping[str, str] | None = None) -> int:
    """Columns for output that is not a terminal: ``COLUMNS`` when it is a positive integer, else
    :data:`DEFAULT_WIDTH`. Not the size of whatever terminal stdin or stderr is (rich's fallback): the text is
    read elsewhere, later."""
    text = (os.environ if environ is None else environ).get("COLUMNS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else DEFAULT_WIDTH


def make_console(*, stderr: bool = False, file: IO[str] | None = None) -> Console:
    """A console on stdout (``stderr``: stderr; ``file``: that file) sized for where it writes.

    A terminal or a notebook keeps rich's own sizing. Otherwise (a pipe, a file, CI) the width is
    :func:`output_width`, and rich writes plain text without ANSI codes.
    """
    console = Console(stderr=stderr, file=file)
    if console.is_terminal or console.is_jupyter:
        return console
    return Console(stderr=stderr, file=file, width=output_width())


def plain(console: Console) -> bool:
    """True when ``console`` shows no colour (not a terminal, ``NO_COLOR``, ``TERM=dumb``): then whatever
    colour would distinguish must be told by a symbol or a word."""
    return console.color_system is None or console.no_color
