"""Byte sizes: parsing ("8GiB", "512MB", "1.5 GiB") and honest formatting (MiB = 2**20, GiB = 2**30).

Pure Python, no torch: shared by the policies, the scheduler, reports and the CLI.
"""

from __future__ import annotations

import math
import re

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Parse a size such as ``"8GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``"4096"`` into bytes.

    Binary units (KiB, MiB, GiB, TiB) are powers of 2**10; decimal units (KB, MB, GB, TB) powers of 10**3;
    a bare number or ``B`` is bytes. Units are case-insensitive.

    Raises:
        ValueError: the text is not a non-negative number with one of those units (the message names both).
    """
    if isinstance(text, bool):
        raise ValueError(f"size must be a number of bytes or a string like '8GiB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0 bytes, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or (unit and unit not in _UNITS):
        allowed = ", ".join(["B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB"])
        raise ValueError(f"cannot parse size {text!r}: expected a number with a unit among {allowed}")
    number, scale = m.group(1), _UNITS[unit or "b"]
    if number.isdigit():  # whole numbers stay exact (a float would round sizes above 2**53 bytes)
        return int(number) * scale
    value = float(number) * scale
    if not math.isfinite(value):
        raise ValueError(f"size {text!r} is not finite")
    return int(round(value))


def parse_positive_bytes(text: str | int) -> int:
    """:func:`parse_bytes`, and the size must be > 0.

    Raises:
        ValueError: as :func:`parse_bytes`, or the size is 0 (the message names the text).
    """
    value = parse_bytes(text)
    if value <= 0:
        raise ValueError(f"size must be > 0 bytes, got {text!r}")
    return value


def format_bytes(n: int | float, precision: int = 1) -> str:
    """Format bytes with binary units: ``format_bytes(3 * 2**30) == "3.0 GiB"``; negatives keep the sign."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.{precision}f} {unit}"
    return f"{sign}{int(n)} B"
