"""Tracing under FakeTensorMode (no memory, no GPU): the foundation of planning before running.

The traced figures of a model built under the fake mode must equal those of the same model traced for real on
a device of the same kind (same dtype), because storage sizes depend only on shapes and dtypes: fake CPU
against real CPU, fake CUDA against the stand-in device ``sim`` (a real device that rounds each storage up
to 512 B blocks, as the tracer does for every device but the CPU).

Caveat found on this project's CPU-only torch builds: autograd on *fake CUDA* tensors aborts the whole process
(``c10::impl::getDeviceGuardImpl``: "PyTorch is not linked with support for cuda devices", raised while
autograd records the tensor's stream). So the fake-CUDA *training* test runs only where a probe in a child
process shows the build can do it (CUDA builds); here fake CUDA is tested without autograd, and fake training
is tested on the fake CPU device, which goes through the same accounting.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch
from _numerics import SIM
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memsched.devices import sim_backend
from tracer import MemoryTimeline, MemoryTracer

B = 16


def _build() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.LayerNorm(128), nn.Linear(128, 64), nn.GELU(),
                         nn.Linear(64, 8))


def _train(model: nn.Module, x: torch.Tensor, **opt_kw) -> MemoryTimeline:
    opt = torch.optim.AdamW(model.parameters(), **opt_kw)
    with MemoryTracer(model, optimizer=opt) as t:
        for _ in range(2):
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return t.timeline


def _figures(tl: MemoryTimeline) -> tuple:
    return tl.peak_non_model_bytes(), tl.peak_bytes(), tl.model_data_bytes(), tl.peak_non_model_by_phase()


def _real_cpu(**opt_kw) -> MemoryTimeline:
    torch.manual_seed(0)
    return _train(_build(), torch.randn(B, 32), **opt_kw)


def _real_sim(**opt_kw) -> MemoryTimeline:
    """Real training on the stand-in device: storages rounded to 512 B blocks, as on CUDA."""
    torch.manual_seed(0)
    return _train(_build().to(SIM), torch.randn(B, 32).to(SIM), **opt_kw)


@functools.cache
def _fake_cuda_autograd_works() -> bool:
    code = ("import torch\nfrom torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n"
            "    p = torch.empty(4, 2, device='cuda', requires_grad=True)\n"
            "    (torch.empty(8, 4, device='cuda') @ p).sum().backward()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0


@pytest.mark.parametrize("opt_kw", [{"foreach": False}, {"foreach": True}, {"fused": True}])
def test_fake_cpu_training_equals_real_cpu_exactly(opt_kw):
    real = _real_cpu(**opt_kw)
    with FakeTensorMode():
        fake = _train(_build(), torch.empty(B, 32), **opt_kw)
    assert fake.meta["fake"] is True and real.meta["fake"] is False
    assert _figures(fake) == _figures(real)
    assert [s.bytes for s in fake.samples] == [s.bytes for s in real.samples]


def test_fake_cuda_forward_equals_real_device_without_a_gpu():
    torch.manual_seed(0)
    cpu = _build().requires_grad_(False)
    with MemoryTracer(cpu) as t:
        cpu(torch.randn(B, 32))
    real_cpu = t.timeline
    model = _build().requires_grad_(False).to(SIM)
    with MemoryTracer(model) as t:
        model(torch.randn(B, 32).to(SIM))
    real = t.timeline
    with torch.device("meta"):
        model = _build()
    with FakeTensorMode(allow_non_fake_inputs=True):  # to_empty reads the meta tensors
        model = model.to_empty(device="cuda").requires_grad_(False)
        with MemoryTracer(model) as t:
            model(torch.empty(B, 32, device="cuda"))
    fake = t.timeline
    assert fake.meta["device"] == "cuda:0" and fake.meta["backend"] == "tensor" and fake.meta["fake"] is True
    assert fake.devices() == ["cuda:0"]
    assert fake.peak_non_model_bytes("cuda:0") == real.peak_non_model_bytes("sim:0") > 0
    assert fake.model_data_bytes("cuda:0") == real.model_data_bytes("sim:0")
    # Off the CPU each storage takes whole 512 B blocks: never less than on the CPU, under a block more each.
    cpu_bytes, dev_bytes = real_cpu.model_data_bytes("cpu"), fake.model_data_bytes("cuda:0")
    n_params = len(list(model.parameters()))
    assert 0 < dev_bytes["parameter"] - cpu_bytes["parameter"] < 512 * n_params
    assert fake.peak_non_model_bytes("cuda:0") >= real_cpu.peak_non_model_bytes("cpu") > 0


def test_fake_cuda_training_equals_real_device():
    if not _fake_cuda_autograd_works():
        pytest.skip("this torch build aborts on autograd over fake CUDA tensors (no CUDA device guard)")
    real = _real_sim(foreach=True)
    if sim_backend.took_the_accelerator():  # a GPU machine: autograd here runs the stand-in's device threads
        pytest.skip("the stand-in took CUDA's place as this process's accelerator (pytorch/pytorch#161129)")
    with torch.device("meta"):
        model = _build()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cuda")
        fake = _train(model, torch.empty(B, 32, device="cuda"), foreach=True)
    assert fake.meta["device"] == "cuda:0" and fake.meta["backend"] == "tensor"
    # Exact on the model data; within 1 % on the peaks (CUDA may pick other kernels than the stand-in, which
    # runs CPU kernels). Unfused, uncapturable AdamW keeps each parameter's step count (a 4-byte fp32 scalar)
    # on the host on both devices, so those bytes are device model data on neither.
    assert fake.model_data_bytes("cuda:0") == real.model_data_bytes("sim:0")
    assert fake.peak_non_model_bytes("cuda:0") == pytest.approx(real.peak_non_model_bytes("sim:0"), rel=0.01)
    assert fake.peak_bytes("cuda:0") == pytest.approx(real.peak_bytes("sim:0"), rel=0.01)
