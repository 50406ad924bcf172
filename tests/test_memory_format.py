"""channels_last: a model converted after attach (``model.to(memory_format=torch.channels_last)``, as vision
users do) is followed, not refused: each parameter's slot is put in the new memory order with its optimizer
state, and training stays bit-exact against ``torch.optim.AdamW(fused=True)`` on the same channels_last model;
a model that is channels_last before attach keeps its memory format."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import memsched
from tests._numerics import LR, SIM, WD, same, to_dev, uncounted

CL = torch.channels_last


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv1(x)))
        h = torch.relu(self.conv2(h))
        return self.fc(h.flatten(1))


def inputs(n: int, device: torch.device | str = SIM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [to_dev((torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 5, (4,), generator=g)), device)
            for _ in range(n)]


def step(model: nn.Module, opt, sched, b, clip: bool) -> None:
    x, y = b
    loss = nn.functional.cross_entropy(model(x.contiguous(memory_format=CL)), y)
    if sched is not None:
        sched.backward(loss)
    else:
        loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # triggers
    opt.step()
    opt.zero_grad()


def assert_same(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert same(p.detach(), q.detach()), (what, n)
        assert p.stride() == q.stride(), (what, n, p.stride(), q.stride())


@pytest.mark.parametrize("device, policy, overlap", [
    ("sim:8MiB", "cpu", False), ("sim:8MiB", "cpu", True),
    ("sim:8MiB", "cuda", False), ("cpu", "auto", False)])
@pytest.mark.parametrize("when", ["after-warmup", "before-first-step"])
def test_channels_last_after_attach_is_bit_exact(device, policy, overlap, when):
    model = ConvNet()
    dev = "cpu" if device == "cpu" else SIM
    with uncounted():  # the reference beside the scheduler's data on the stand-in is not counted
        # converted when the model is: torch's clip sums a gradient's squares in its memory order, so a
        # contiguous and a channels_last gradient of equal values can give norms an ulp apart
        ref = copy.deepcopy(model).to(dev, memory_format=CL if when == "before-first-step" else None)
        data = inputs(6, dev)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    with memsched.attach(model, policy=policy, device=device, lr=LR, weight_decay=WD, overlap=overlap,
                         chunk_numel=1600) as sched:
        if when == "before-first-step":
            model.to(memory_format=CL)
        for i, b in enumerate(data):
            if when == "after-warmup" and i == 2:
                model.to(memory_format=CL)
                with uncounted():
                    ref.to(memory_format=CL)
                    for st in ref_opt.state.values():  # torch keeps its state as it was: the same, converted
                        for key in ("exp_avg", "exp_avg_sq"):
                            if st[key].dim() == 4:
                                st[key] = st[key].contiguous(memory_format=CL)
            step(model, sched.optimizer, sched, b, clip=i % 2 == 1)
            with sched.sim.paused() if sched.sim is not None else contextlib.nullcontext():
                step(ref, ref_opt, None, b, clip=i % 2 == 1)
            sched.synchronize()
            if i >= 2 or when == "before-first-step":
                assert model.conv1.weight.is_contiguous(memory_format=CL)
                assert_same(model, ref, f"step {i}")
            else:
                pairs = zip(model.parameters(), ref.parameters(), strict=True)
                assert all(same(p, q) for p, q in pairs)
        # torch's state dict: the moments equal torch's, in the parameter's memory format
        ours, theirs = sched.optimizer.state_dict()["state"], ref_opt.state_dict()["state"]
        for k, st in theirs.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert same(ours[k][key], st[key]) and ours[k][key].stride() == st[key].stride()
        # and back to contiguous: followed too
        model.to(memory_format=torch.contiguous_format)
        with uncounted():
            ref.to(memory_format=torch.contiguous_format)
            # torch leaves its state channels_last: the same state, contiguous
            for st in ref_opt.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    st[key] = st[key].contiguous()
            more = inputs(2, dev)
        for b in more:
            step(model, sched.optimizer, sched, b, clip=True)
            with sched.sim.paused() if sched.sim is not None else contextlib.nullcontext():
                step(ref, ref_opt, None, b, clip=True)
        sched.synchronize()
        assert model.conv1.weight.is_contiguous()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert same(p.detach(), q.detach())


def test_a_model_channels_last_before_attach_keeps_its_memory_format():
    model = ConvNet().to(memory_format=CL)
    with uncounted():  # the reference beside the scheduler's data on the stand-in is not counted
        ref = copy.deepcopy(model).to(SIM)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    with memsched.attach(model, policy="cpu", device="sim:8MiB", lr=LR, weight_decay=WD) as sched:
        assert model.conv1.weight.is_contiguous(memory_format=CL)
        for b in inputs(3):
            step(model, sched.optimizer, sched, b, clip=False)
            with sched.sim.paused():
                step(ref, ref_opt, None, b, clip=False)
        assert_same(model, ref, "end")


def test_a_dtype_change_is_still_refused():
    model = ConvNet()
    with memsched.attach(model, policy="cpu", device="sim:8MiB") as sched:
        step(model, sched.optimizer, sched, inputs(1)[0], clip=False)
        with pytest.raises(RuntimeError, match="from torch.float32 to torch.float64"):  # at the move
            model.to(dtype=torch.float64, memory_format=CL)
