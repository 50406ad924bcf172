"""memsched's own versioned timeline JSON (:meth:`tracer.MemoryTimeline.save`)."""

from __future__ import annotations

import os
from pathlib import Path

from tracer.timeline import MemoryTimeline


def write_json(timeline: MemoryTimeline, path: str | os.PathLike[str]) -> Path:
    """Write the versioned memsched timeline JSON to ``path`` atomically; returns the path."""
    timeline.save(path)
    return Path(path)
