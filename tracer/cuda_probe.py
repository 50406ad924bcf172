"""The CUDA view of memory for the ``cuda`` backend: the caching allocator and NVML.

At each read: ``allocated`` (``torch.cuda.memory_allocated``), ``peak_allocated`` (``max_memory_allocated``
since the previous read: the probe calls ``torch.cuda.reset_peak_memory_stats`` after reading it, which also
resets the peaks the user would read from torch), ``reserved`` (``memory_reserved``) and ``nvml_used``
(device-level used memory of all processes from NVML, ``pynvml`` from nvidia-ml-py; ``None`` when NVML is
unavailable, with the reason in :attr:`CudaProbe.nvml_error`). All in bytes.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["CudaProbe"]


class CudaProbe:
    """Reads allocator and NVML figures for one real CUDA device.

    Raises:
        ValueError: ``device`` is not a CUDA device, or CUDA is not available.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"CudaProbe needs a real CUDA device, got {device} "
                             f"(torch.cuda.is_available() = {torch.cuda.is_available()})")
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.nvml_error: str | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self._open_nvml()
        torch.cuda.reset_peak_memory_stats(self.index)

    def _open_nvml(self) -> None:
        try:
            import pynvml
        except ImportError as e:
            self.nvml_error = f"pynvml not importable: {e}"
            return
        try:
            pynvml.nvmlInit()
        except Exception as e:  # NVMLError subclasses: no driver, no permission, ...
            self.nvml_error = f"nvmlInit failed: {e}"
            return
        try:
            self._handle = self._nvml_handle(pynvml)
            self._nvml = pynvml
        except Exception as e:
            self.nvml_error = f"no NVML handle for cuda:{self.index}: {e}"
            pynvml.nvmlShutdown()

    def _nvml_handle(self, pynvml: Any) -> Any:
        # torch's index is relative to CUDA_VISIBLE_DEVICES; NVML's is not. Match by UUID when torch knows it.
        uuid = getattr(torch.cuda.get_device_properties(self.index), "uuid", None)
        if uuid is not None:
            text = str(uuid)
            for candidate in (text, f"GPU-{text}"):
                try:
                    return pynvml.nvmlDeviceGetHandleByUUID(candidate)
                except Exception:
                    continue
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = self.index
        if visible:
            entries = [v.strip() for v in visible.split(",") if v.strip()]
            if index < len(entries) and entries[index].isdigit():
                index = int(entries[index])
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def read(self) -> dict[str, int | None]:
        """Allocator and NVML figures now, bytes; resets the allocator peak (see the module doc)."""
        idx = self.index
        out: dict[str, int | None] = {
            "allocated": int(torch.cuda.memory_allocated(idx)),
            "peak_allocated": int(torch.cuda.max_memory_allocated(idx)),
            "reserved": int(torch.cuda.memory_reserved(idx)),
            "nvml_used": None,
        }
        torch.cuda.reset_peak_memory_stats(idx)
        if self._nvml is not None:
            try:
                out["nvml_used"] = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
            except Exception as e:  # a transient NVML failure must not break training
                self.nvml_error = f"nvmlDeviceGetMemoryInfo failed: {e}"
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
