"""What the process holds in host memory next to what the plan says: the report's host-memory section.

Pinned bytes are memsched's own (:mod:`memsched.devices.pinned`: pages registered with CUDA, or the stand-in's
pinned allocator); the resident set size is the whole process's, from psutil, and its peak from
``getrusage`` (Linux reports KiB, macOS bytes).
"""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch

__all__ = ["HostUsage", "host_usage"]


@dataclass(frozen=True)
class HostUsage:
    """Host memory of a scheduler's process, bytes.

    Attributes:
        planned_pinned_bytes: the plan's pinned host memory (``PlacementPlan.host_bytes``); ``None`` before a
            plan.
        pinned_bytes: pinned host memory memsched holds now; ``None`` where nothing is pinned (the CPU).
        max_pinned_bytes: its peak since the device's statistics were reset; ``None`` as above.
        rss_bytes: the process's resident set size now.
        max_rss_bytes: the process's peak resident set size.
        parameters: the trainable parameters (elements), for the bytes per parameter.
    """

    planned_pinned_bytes: int | None
    pinned_bytes: int | None
    max_pinned_bytes: int | None
    rss_bytes: int
    max_rss_bytes: int
    parameters: int

    @property
    def pinned_bytes_per_param(self) -> float | None:
        """Pinned host bytes per trainable parameter now (``None`` without pinned memory or parameters)."""
        if self.pinned_bytes is None or not self.parameters:
            return None
        return self.pinned_bytes / self.parameters

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pinned_bytes_per_param": self.pinned_bytes_per_param}


def _max_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def host_usage(device: torch.device, planned_pinned_bytes: int | None, parameters: int) -> HostUsage:
    """The host memory of this process now, for a scheduler on ``device`` (``"cuda"``, ``"sim"`` or
    ``"cpu"``) whose plan pins ``planned_pinned_bytes`` (bytes; ``None`` before a plan) for ``parameters``
    trainable elements."""
    pinned = peak = None
    if device.type == "sim":
        from memsched.devices import sim_backend

        pinned, peak = sim_backend.pinned_bytes(), sim_backend.max_pinned_bytes()
    elif device.type == "cuda":
        from memsched.devices.pinned import registered_bytes

        pinned, peak = registered_bytes()
    rss = int(psutil.Process().memory_info().rss)
    # the kernel's high-water mark is updated lazily: it may lag the current size by a little
    return HostUsage(planned_pinned_bytes, pinned, peak, rss, max(rss, _max_rss_bytes()), parameters)
