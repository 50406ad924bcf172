"""Parameters without a gradient follow torch.optim.AdamW(fused=True) exactly: with ``zero_grad()``'s default
(``set_to_none=True``) a parameter that gets no gradient in a step is not updated (no weight decay, no moment
decay, its step count does not move) and one that never had a gradient has no state; with
``set_to_none=False`` it is updated with a zero gradient. Bit for bit, every placement."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import memsched
from tests._numerics import SIM, same, uncounted

LR, WD = 1e-2, 0.1


class AuxNet(nn.Module):
    """``aux`` is used every third step, ``never`` never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4)
        self.never = nn.Linear(16, 4)

    def forward(self, x, use_aux):
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        return out + self.aux(h) if use_aux else out


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), i % 3 == 0) for i in range(n)]


PLACEMENTS = {
    "cpu": dict(policy="cpu", device="sim:64MiB"),
    "cuda": dict(policy="cuda", device="sim:64MiB"),
    "static": dict(policy="static", device="sim:64MiB", policy_options={"offload_optim_frac": 0.4}),
    "on-cpu": dict(policy="auto", device="cpu"),
}


@pytest.mark.parametrize("zero_grad", ["optimizer", "optimizer-keep", "model"])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_parameters_without_gradients_match_torch_adamw(placement, zero_grad):
    model = AuxNet()
    dev = torch.device("cpu") if PLACEMENTS[placement]["device"] == "cpu" else SIM
    with uncounted():  # the reference beside the scheduler's data on the stand-in is not counted
        ref = copy.deepcopy(model).to(dev)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    set_to_none = zero_grad != "optimizer-keep"
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=200, warmup_steps=2,
                         **PLACEMENTS[placement]) as sched:
        for i, (x, use_aux) in enumerate(batches(7)):
            x = x.to(dev)
            sched.backward(model(x, use_aux).pow(2).mean())
            sched.optimizer.step()
            if zero_grad == "model":
                model.zero_grad()  # what Hugging Face's Trainer does: every .grad to None
            else:
                sched.optimizer.zero_grad(set_to_none=set_to_none)
            with sched.sim.paused() if sched.sim is not None else contextlib.nullcontext():
                ref(x, use_aux).pow(2).mean().backward()
                ropt.step()
                if zero_grad == "model":
                    ref.zero_grad()
                else:
                    ropt.zero_grad(set_to_none=set_to_none)
                for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                    assert same(p.detach(), q.detach()), (placement, zero_grad, i, n)
        assert len({c.placement for c in sched.store.chunks}) == (2 if placement == "static" else 1)
        with sched.sim.paused() if sched.sim is not None else contextlib.nullcontext():
            sd, rsd = sched.optimizer.state_dict(), ropt.state_dict()
    assert sorted(sd["state"]) == sorted(rsd["state"])  # the never-used head has no state in either
    for i, st in rsd["state"].items():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert same(sd["state"][i][k], st[k]), (i, k)
    # and memsched's state dict loads into torch's AdamW and back
    ropt2 = torch.optim.AdamW(copy.deepcopy(ref).parameters(), lr=LR, weight_decay=WD, fused=True)
    ropt2.load_state_dict(sd)


def test_model_zero_grad_keeps_gradients_in_the_chunks(monkeypatch):
    """``model.zero_grad()`` (set_to_none, as Hugging Face Trainer does) drops the ``.grad`` views; the next
    forward binds them again, so backward accumulates into the chunks (no separate gradient to copy back),
    and parameters that get no gradient are not updated, as with torch.optim.AdamW."""
    import copy

    import memsched
    from memsched.chunks.gradients import GradBuffers

    copies = []
    original = GradBuffers.rebind

    def counted(self, p, c=None):
        if p.grad is not None and p.grad.data_ptr() != self.view(p, c).data_ptr():
            copies.append(p.shape)
        return original(self, p, c)

    monkeypatch.setattr(GradBuffers, "rebind", counted)

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = torch.nn.Linear(16, 16)
            self.a, self.b = torch.nn.Linear(16, 1), torch.nn.Linear(16, 1)

        def forward(self, x, head):
            return (self.a if head == "a" else self.b)(torch.relu(self.body(x))).sum()

    model = TwoHeads()
    with uncounted():  # the reference beside the scheduler's data on the stand-in is not counted
        ref = copy.deepcopy(model).to(SIM)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)).to(SIM) for i in range(6)]
    with memsched.attach(model, device="sim:16MiB", lr=1e-2, weight_decay=0.1) as sched:
        for i, x in enumerate(xs):
            head = "a" if i % 3 else "b"  # head b only every third step
            model.zero_grad(set_to_none=True)
            sched.backward(model(x, head))
            sched.optimizer.step()
            with sched.sim.paused():
                ref.zero_grad(set_to_none=True)
                ref(x, head).backward()
                opt.step()
    assert copies == []  # every gradient was accumulated in its chunk view
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert same(p, q)
