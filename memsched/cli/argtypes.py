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


def positive_int_list(text: str) -> list[int]:
    """A comma-separated list of distinct integers >= 1 (``"512,1024,2048"``); one value is a list of one.

    The error names the bad item as well as the whole text, so ``--seq-len 512,1k,2048`` says which is wrong.
    """
    allowed = "a comma-separated list of distinct integers >= 1 (e.g. 512,1024,2048)"
    values: list[int] = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = int(item)
        except ValueError:
            value = 0
        if value < 1:
            what = "an empty item" if not item else repr(item)
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {what} in {text!r}")
        if value in values:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {value} twice in {text!r}")
        values.append(value)
    return values


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


def bandwidth(text: str) -> float:
    """A bandwidth in bytes per second, such as ``25GBps`` or ``12GiB/s``
    (:func:`memsched.devices.spec.parse_bandwidth`)."""
    from memsched.devices.spec import parse_bandwidth

    try:
        return parse_bandwidth(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
