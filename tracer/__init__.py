"""memsched's runtime memory tracer: measures model and non-model data around forward, backward and the
optimizer step of an existing ``nn.Module``. Knows nothing of chunks or placement policies."""

from tracer.accounting import StorageAccountant
from tracer.categories import MODEL_DATA, NON_MODEL_DATA, Category
from tracer.memory_tracer import MemoryTracer
from tracer.timeline import MemoryTimeline, ModuleStats, Sample

__all__ = [
    "Category",
    "MODEL_DATA",
    "NON_MODEL_DATA",
    "MemoryTimeline",
    "MemoryTracer",
    "ModuleStats",
    "Sample",
    "StorageAccountant",
]
