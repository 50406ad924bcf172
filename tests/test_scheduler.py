"""memsched.attach: warmup tracing, first-use re-packing, planning, no tracing cost afterwards, bad input."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import memsched
import policies
from memsched.chunks import PARAM_ALIGN
from memsched.devices.spec import parse_device
from policies.types import DEVICE, HOST
from tests._numerics import SIM, same, uncounted


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.second = nn.Linear(24, 24)  # registered first, called second
        self.first = nn.Linear(12, 24)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.second(torch.relu(self.first(x))))))


def step(sched, x):
    sched.backward(sched.model(x).pow(2).mean())
    sched.optimizer.step()
    sched.optimizer.zero_grad()


def hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
            + len(getattr(m, "_forward_hooks_always_called", {})) for m in model.modules()]


def test_warmup_traces_then_plans_and_removes_the_tracer():
    torch.manual_seed(0)
    m = Net()
    hooks_before = hook_counts(m)
    with memsched.attach(m, policy="auto", device="sim:64MiB", warmup_steps=2, chunk_numel=600) as sched:
        x = torch.randn(4, 12, device=SIM)
        step(sched, x)
        assert sched.plan is None and sched.timeline is None and sched.in_warmup
        assert hook_counts(m) != hooks_before  # the tracer is hooked in
        step(sched, x)
        assert sched.plan is not None and not sched.in_warmup
        assert sched.timeline.meta["optimizer_steps"] == 2
        assert sched.peak_non_model_bytes() > 0
        # No tracing cost after warmup: the tracer's module and optimizer hooks are gone (the root keeps a
        # forward pre-hook and an always-called forward hook each for the step timeline and for elastic
        # placement, a pre-hook that re-binds dropped gradients, one that refuses a model converted since
        # attach, and an always-called forward hook that explains torch's errors in the forward:
        # memsched.runtime.device_errors), and no dispatch mode is left (the stand-in is a device whose
        # allocator counts its memory).
        assert hook_counts(m) == [hooks_before[0] + 10, *hooks_before[1:]]
        opt = sched.optimizer
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
        n_samples = len(sched.timeline.samples)
        step(sched, x)
        assert len(sched.timeline.samples) == n_samples
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        assert not _get_current_dispatch_mode_stack()
        # Re-packed in first-use order: `first` (called first) now leads chunk 0.
        assert sched.store.chunks[0].params[0] is m.first.weight
        assert sched.plan.placement == tuple(c.placement for c in sched.store.chunks)
        assert set(sched.plan.placement) == {DEVICE}  # 64 MiB holds everything
    assert not _get_current_dispatch_mode_stack()
    assert sched.transfers.as_dict()["steps"] == 3


def test_first_use_order_and_problem_match_the_model():
    torch.manual_seed(0)
    m = Net()
    with memsched.attach(m, policy="cpu", device="sim:64MiB", chunk_numel=600) as sched:
        step(sched, torch.randn(4, 12, device=SIM))
        order = sched.first_use_order()
        assert order[:2] == [m.first.weight, m.first.bias]
        assert order[-2:] == [m.head.weight, m.head.bias]
        p = sched.problem
        assert p.capacity_bytes == 64 * 2**20
        # resident: the compute buffers (a chunk placed on the device would add its gradient buffer); the host
        # chunks' gradients on their way to the host add what the warmup trace saw them add to its peak
        buffers = sum(c.data.nbytes for c in sched.store.chunks)
        # exact chunks: no padding but the alignment gaps between parameters
        gaps = sched.store.layout.waste_numel
        assert buffers == 4 * (sum(q.numel() for q in m.parameters()) + gaps)
        assert 0 <= gaps < PARAM_ALIGN * len(list(m.parameters()))
        assert p.resident_model_bytes == buffers
        timeline = sched.timeline
        assert p.peak_non_model_bytes == timeline.peak_non_model_bytes()
        working = timeline.peak_non_model_grad_bytes() - timeline.peak_non_model_bytes()
        assert p.host_grad_working_bytes == working and 0 < working <= buffers
        assert set(sched.plan.placement) == {HOST}
        assert sched.plan.device_bytes == working


def test_cpu_device_plan_is_everything_on_the_device():
    torch.manual_seed(0)
    m = Net()
    with memsched.attach(m, device="cpu", chunk_numel=600) as sched:
        assert all(c.placement == DEVICE for c in sched.store.chunks)
        step(sched, torch.randn(4, 12))
        assert sched.plan.policy == "cpu-device" and set(sched.plan.placement) == {DEVICE}
        assert sched.transfers.h2d_bytes == 0 and sched.transfers.d2h_bytes == 0


def test_device_none_without_cuda_is_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: device=None means CUDA")
    assert parse_device(None).kind == "cpu"


def test_report_renders():
    if importlib.util.find_spec("memsched.report.text") is None:
        pytest.skip("memsched.report.text not there yet")
    from rich.console import Console

    torch.manual_seed(0)
    m = Net()
    with memsched.attach(m, policy="auto", device="sim:64MiB", chunk_numel=600) as sched:
        with pytest.raises(ValueError, match="after the warmup"):
            sched.report()
        step(sched, torch.randn(4, 12, device=SIM))
        console = Console(record=True, width=120)
        sched.report(console=console)
    text = console.export_text()
    assert "auto" in text


def test_context_manager_closes_and_optimizer_keeps_working():
    torch.manual_seed(0)
    m = Net()
    sched = memsched.attach(m, policy="cpu", device="sim:64MiB", chunk_numel=600)
    step(sched, torch.randn(4, 12, device=SIM))
    sched.close()
    sched.close()  # idempotent
    before = m.head.weight.detach().clone()
    step(sched, torch.randn(4, 12, device=SIM))  # no early D2H any more: the step copies the gradients
    assert not same(before, m.head.weight)


@pytest.mark.parametrize("kwargs, match", [
    ({"gpu_margin_mem_ratio": 1.5}, r"gpu_margin_mem_ratio must be a number in \[0, 1\], got 1.5"),
    ({"gpu_margin_mem_ratio": float("nan")}, "got nan"),
    ({"policy": "fastest"}, "auto"),  # the message lists the known names
    ({"device": "tpu:0"}, "bad device 'tpu:0'.*'sim:SIZE'"),
    ({"device": "sim:8 parsecs"}, "bad device 'sim:8 parsecs'"),
    ({"device": "sim:"}, "lacks a size"),
    ({"warmup_steps": 0}, "warmup_steps must be an integer >= 1, got 0"),
    ({"dtype": torch.int8}, "dtype must be one of"),
    ({"lr": -1.0}, "lr must be a finite number >= 0"),
    ({"chunk_numel": 10}, "chunk_numel must be an integer >= the largest parameter"),
    ({"policy_options": {"bogus": 1}}, "bogus"),
])
def test_bad_input_is_refused_before_touching_the_model(kwargs, match):
    m = Net()
    ptr = m.first.weight.data_ptr()
    with pytest.raises(ValueError, match=match):
        memsched.attach(m, **kwargs)
    assert m.first.weight.data_ptr() == ptr


def test_unknown_policy_lists_names():
    with pytest.raises(ValueError) as e:
        memsched.attach(Net(), policy="fastest")
    for name in policies.names():
        assert name in str(e.value)


def test_no_trainable_parameters_and_meta_parameters():
    m = Net().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        memsched.attach(m, device="cpu")
    with torch.device("meta"):
        meta = Net()
    with memsched.attach(meta, device="cpu"):  # made in the chunks; values must follow (test_meta_attach.py)
        assert {p.device.type for p in meta.parameters()} == {"cpu"}
        with pytest.raises(ValueError, match=r"8 parameter\(s\) built on the meta device were never given"):
            meta(torch.ones(2, 12))
    with pytest.raises(TypeError, match="nn.Module"):
        memsched.attach("model")


def test_cuda_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="needs CUDA"):
        memsched.attach(Net(), device="cuda:1")


def test_frozen_parameters_and_tied_weights_train_correctly():
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.frozen = nn.Linear(8, 8)
            self.frozen.requires_grad_(False)
            self.head = nn.Linear(8, 20, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(self.frozen(self.emb(idx)))

    m = Tied()
    frozen = m.frozen.weight.detach().clone()
    ref = Tied()
    ref.load_state_dict(m.state_dict())
    idx = torch.randint(0, 20, (2, 5)).to(SIM)
    with uncounted():  # the reference beside the scheduler's data on the stand-in is not counted
        ref.to(SIM)
        ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            ref(idx).logsumexp(-1).mean().backward()
            ropt.step()
            ropt.zero_grad()
    with memsched.attach(m, policy="auto", device="sim:16MiB", lr=1e-2, weight_decay=0.1) as sched:
        for _ in range(3):
            sched.backward(m(idx).logsumexp(-1).mean())
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        # the tied weight once; the frozen layer's weight and bias in a chunk of their own (issue 31)
        assert sum(len(c.params) for c in sched.store.trainable_chunks) == 1
        assert sorted(id(q) for c in sched.store.chunks if c.frozen for q in c.params) == \
            sorted([id(m.frozen.weight), id(m.frozen.bias)])
    assert same(m.frozen.weight, frozen)
    assert torch.allclose(m.emb.weight, ref.emb.weight, rtol=1e-6, atol=1e-7)
    assert m.head.weight is m.emb.weight


def test_a_second_attach_on_the_model_fails_cleanly():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    m = Net()
    with memsched.attach(m, device="sim:64MiB", chunk_numel=600):
        hooks = hook_counts(m)
        ptr = m.first.weight.data_ptr()
        with pytest.raises(RuntimeError, match="already attached"):
            memsched.attach(m, device="sim:64MiB", chunk_numel=600)
        assert hook_counts(m) == hooks and m.first.weight.data_ptr() == ptr
        assert len(_get_current_dispatch_mode_stack()) == 1  # the first one's tracer only
    # Someone else's tracer on the model: attach fails and leaves no hooks or dispatch modes behind.
    from tracer import MemoryTracer

    m2 = Net()
    with MemoryTracer(m2):
        hooks = hook_counts(m2)
        with pytest.raises(RuntimeError, match="already attached"):
            memsched.attach(m2, device="sim:64MiB", chunk_numel=600)
        assert hook_counts(m2) == hooks
        assert len(_get_current_dispatch_mode_stack()) == 1
    sched = memsched.attach(m2, device="sim:64MiB", chunk_numel=600)  # allowed again
    sched.close()


def test_transfers_read_as_a_mapping():
    torch.manual_seed(0)
    m = Net()
    with memsched.attach(m, policy="cpu", device="sim:64MiB", chunk_numel=600) as sched:
        for _ in range(2):
            step(sched, torch.randn(4, 12, device=SIM))
        t = sched.transfers
        numel = sum(c.numel for c in sched.store.chunks)
        assert dict(t) == t.as_dict() and t["steps"] == 2
        assert t["last_h2d_bytes"] == t["last_d2h_bytes"] == numel * 4
        assert t["last_h2d_bytes"] < t["h2d_bytes"] == t["d2h_bytes"]  # the warmup step had its own layout
