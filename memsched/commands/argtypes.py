"""argparse value types shared by the sub-commands.

argparse turns their errors into a usage message and exit code 2."""

from __future__ import annotations

import argparse
import math

from policies.types import check_ratio


def _number(text: str, kind: type, expected: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _number(text, int, "an integer >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def ratio(text: str) -> float:
    """A finite number in [0, 1] (e.g. ``gpu_margin_mem_ratio``; :func:`policies.types.check_ratio`)."""
    value = _number(text, float, "a number in [0, 1]")
    try:
        return check_ratio(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None


def positive_float(text: str) -> float:
    """A finite number > 0 (e.g. a learning rate)."""
    value = _number(text, float, "a positive number")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value
