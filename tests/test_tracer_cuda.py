"""The ``cuda`` backend on a real GPU: allocator and NVML figures next to the exact tensor accounting.
Skipped without CUDA (CI and the development machine have none)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tracer import MemoryTracer
from tracer.cuda_probe import CudaProbe

MiB = 2**20
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_probe_refuses_a_device_that_is_not_real_cuda():
    with pytest.raises(ValueError, match="CudaProbe needs a real CUDA device, got cpu"):
        CudaProbe(torch.device("cpu"))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.LayerNorm(1024),
                         nn.Linear(1024, 256)).cuda()


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.cuda
@cuda
def test_allocator_and_nvml_fields_are_present_and_plausible():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(512, 1024, device="cuda")
    _step(model, opt, x)  # warm up: optimizer states, cuBLAS workspace
    torch.cuda.synchronize()
    with MemoryTracer(model, optimizer=opt) as t:  # backend "auto" picks "cuda" on a real GPU
        _step(model, opt, x)
    tl = t.timeline
    assert tl.meta["backend"] == "cuda" and tl.meta["device"] == f"cuda:{torch.cuda.current_device()}"
    assert tl.meta["nvml"] == "ok" or tl.meta["nvml"].startswith(("pynvml", "nvml", "no NVML"))
    cuda_samples = [s for s in tl.samples if s.device == tl.device]
    assert cuda_samples and all(s.cuda is not None for s in cuda_samples)
    total = torch.cuda.get_device_properties(tl.device).total_memory
    for s in cuda_samples:
        c = s.cuda
        assert set(c) == {"allocated", "peak_allocated", "reserved", "nvml_used"}
        # The allocator holds at least what the tracer counts (x, made before the tracer, is extra; blocks are
        # rounded up to 512 bytes).
        assert c["allocated"] >= s.total_bytes
        assert c["peak_allocated"] >= c["allocated"] and c["reserved"] >= c["allocated"]
        assert c["peak_allocated"] >= s.peak_bytes  # rounding only adds
        if c["nvml_used"] is not None:
            assert c["reserved"] <= c["nvml_used"] <= total


@pytest.mark.cuda
@cuda
def test_non_model_peak_is_close_to_the_allocator_peak():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(512, 1024, device="cuda")
    _step(model, opt, x)
    torch.cuda.synchronize()
    # Untraced reference: the allocator's peak above the memory held before the step.
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(model, opt, x)
    torch.cuda.synchronize()
    untraced_delta = torch.cuda.max_memory_allocated() - base
    with MemoryTracer(model, optimizer=opt, backend="tensor") as t:
        _step(model, opt, x)
    tl = t.timeline
    start = tl.samples[0]
    traced_delta = tl.peak_bytes() - start.total_bytes
    # Storage bytes vs allocator blocks (512-byte rounding, kernels' own workspaces): within 5 % + 2 MiB.
    assert traced_delta == pytest.approx(untraced_delta, rel=0.05, abs=2 * MiB)
    # Model data is exact: parameters and AdamW states are plain tensors.
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert tl.model_data_bytes()["parameter"] == params
    assert tl.model_data_bytes()["gradient"] == params
    assert tl.model_data_bytes()["optimizer_state"] >= 2 * params


class _FakeNVML:
    """NVML that knows some UUIDs and PCI bus ids (handles are the strings themselves)."""

    def __init__(self, uuids=(), buses=()):
        self.uuids, self.buses = set(uuids), set(buses)

    def nvmlDeviceGetHandleByUUID(self, u):  # noqa: N802 (NVML's name)
        if u not in self.uuids:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return u

    def nvmlDeviceGetHandleByPciBusId(self, b):  # noqa: N802
        if b not in self.buses:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return b


class _Props:
    def __init__(self, uuid=None, bus=None):
        self.uuid = uuid
        if bus is not None:
            self.pci_domain_id, self.pci_bus_id, self.pci_device_id = bus


def test_nvml_matching_never_guesses_from_an_index():
    from tracer.cuda_probe import nvml_handle

    # MIG instance: torch's UUID is known to NVML in its MIG- form
    assert nvml_handle(_FakeNVML({"MIG-abc"}), _Props("abc"), 0, "") == "MIG-abc"
    # a UUID written in CUDA_VISIBLE_DEVICES for this index
    assert nvml_handle(_FakeNVML({"MIG-x"}), _Props(None), 1, "GPU-y,MIG-x") == "MIG-x"
    # PCI bus id when no UUID matches
    assert nvml_handle(_FakeNVML(buses={"00000000:3B:00.0"}), _Props("zz", (0, 0x3B, 0)), 0, "3") \
        == "00000000:3B:00.0"
    # digits in CUDA_VISIBLE_DEVICES and nothing else: refuse rather than pick NVML device 3
    with pytest.raises(LookupError, match="not guessing"):
        nvml_handle(_FakeNVML(), _Props(None), 0, "3,1")
