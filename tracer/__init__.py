"""memsched's runtime memory tracer: measures model and non-model data around forward, backward and the
optimizer step of an existing ``nn.Module``. Knows nothing of chunks or placement policies."""

from tracer.categories import MODEL_DATA, NON_MODEL_DATA, Category
from tracer.timeline import MemoryTimeline, ModuleStats, Sample

__all__ = ["Category", "MODEL_DATA", "NON_MODEL_DATA", "MemoryTimeline", "ModuleStats", "Sample"]

try:  # the tracer itself needs torch; the data types above do not
    from tracer.memory_tracer import MemoryTracer  # noqa: F401

    __all__.append("MemoryTracer")
except ImportError as _e:  # pragma: no cover - only while the module is absent or torch is missing
    if "torch" not in str(_e) and "memory_tracer" not in str(_e):
        raise
