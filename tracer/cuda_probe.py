"""The CUDA view of memory for the ``cuda`` backend: the caching allocator and NVML.

At each read: ``allocated`` (``torch.cuda.memory_allocated``), ``peak_allocated`` (``max_memory_allocated``:
the allocator's high-water mark since the process started or the user last reset it; the probe never resets
it, so the user's own peak statistics stay theirs), ``reserved`` (``memory_reserved``) and ``nvml_used``
(device-level used memory of all processes from NVML, ``pynvml`` from nvidia-ml-py; ``None`` when NVML is
unavailable or this device cannot be matched to an NVML device with certainty, with the reason in
:attr:`CudaProbe.nvml_error`). All in bytes.

Matching a CUDA device to NVML: torch's index counts the devices of ``CUDA_VISIBLE_DEVICES`` in CUDA's order
(fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), NVML's counts all devices in PCI order, and MIG
instances have ``MIG-`` UUIDs. The probe matches by UUID (``GPU-``/``MIG-`` forms), then by the UUID or MIG
UUID written in ``CUDA_VISIBLE_DEVICES``, then by PCI bus id; it never guesses from an index.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["CudaProbe"]


def _pci_bus_id(props: Any) -> str | None:
    """``"DDDD:BB:DD.0"`` from torch's device properties (torch >= 2.5 exposes the parts), else None."""
    parts = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(p is None for p in parts):
        return None
    domain, bus, dev = (int(p) for p in parts)
    return f"{domain:08X}:{bus:02X}:{dev:02X}.0"


def nvml_handle(pynvml: Any, props: Any, index: int, visible: str) -> Any:
    """The NVML handle of torch's CUDA device ``index`` (``props``: its ``torch.cuda.get_device_properties``;
    ``visible``: ``CUDA_VISIBLE_DEVICES``), matched by UUID (``GPU-``/``MIG-`` forms), by the UUID written in
    ``visible``, or by PCI bus id (see the module doc).

    Raises:
        LookupError: no certain match (an index is never used: the orders differ).
        pynvml.NVMLError: from NVML.
    """
    candidates = []
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        candidates += [text, f"GPU-{text}", f"MIG-{text}"]
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if index < len(entries) and entries[index].startswith(("GPU-", "MIG-")):
        candidates.append(entries[index])
    for candidate in candidates:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(candidate)
        except Exception:
            continue
    bus = _pci_bus_id(props)
    if bus is not None:
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
    raise LookupError("no UUID or PCI bus id of this device is known to NVML; not guessing from an index")


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
        props = torch.cuda.get_device_properties(self.index)
        return nvml_handle(pynvml, props, self.index, os.environ.get("CUDA_VISIBLE_DEVICES", ""))

    def read(self) -> dict[str, int | None]:
        """Allocator and NVML figures now, bytes (see the module doc)."""
        idx = self.index
        out: dict[str, int | None] = {
            "allocated": int(torch.cuda.memory_allocated(idx)),
            "peak_allocated": int(torch.cuda.max_memory_allocated(idx)),
            "reserved": int(torch.cuda.memory_reserved(idx)),
            "nvml_used": None,
        }
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
