"""What every benchmark script shares: one summary of repeated timings, and a free port for the ranks a
benchmark launches (the machine description is :mod:`bench._machine`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


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


def train_seconds(sched: Any, part: Sequence[Any], loss_of: Callable[[Any], Any]) -> float:
    """Seconds to train on the batches ``part`` with memsched (``sched.backward(loss_of(batch))``, step,
    ``zero_grad``), the overlapped CPU update of the last step included (``sched.synchronize()``)."""
    t0 = time.perf_counter()
    for batch in part:
        sched.backward(loss_of(batch))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
    sched.synchronize()
    return time.perf_counter() - t0


def free_port() -> int:
    """A TCP port free on this machine now (the ranks' ``MASTER_PORT``)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
