"""What every benchmark script shares: one summary of repeated timings (the machine description is
:mod:`bench._machine`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def summarize(times: Sequence[float]) -> dict[str, float]:
    """Median, min, max, quartiles (seconds) and the spread ``(max - min) / median`` in percent of
    ``times`` (seconds, at least one)."""
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
    med = statistics.median(times)
    return {
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "p25_s": q[0],
        "p75_s": q[2],
        "spread_pct": 100.0 * (max(times) - min(times)) / med if med else 0.0,
        "n": len(times),
    }
