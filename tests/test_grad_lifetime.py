"""Gradients exist only while they are needed (one rank): a chunk's gradient buffer is made by the first
gradient a backward gives one of its parameters and freed by ``zero_grad()`` (``set_to_none=True``, torch's
default), so it is not alive through the forward's peak, and ``p.grad`` is None exactly when torch's is."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memsched
from memsched.chunks import PARAM_ALIGN
from memsched.devices.simdevice import SimDevice
from tests._numerics import LR, SIM, WD, same, uncounted

VOCAB, WIDTH, SEQ, BATCH = 4096, 64, 32, 8


class Logits(nn.Module):
    """A small language model whose logits (batch x seq x 4096 fp32 = 4 MiB, and the loss's temporaries of
    the same size) make the end of the forward the step's peak; the head's weight is tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(SIM)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def loss_of(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = b
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def torch_peak_without_state(model: nn.Module, data: list) -> int:
    """Plain ``torch.optim.AdamW(fused=True)`` with ``zero_grad(set_to_none=True)``: the peak bytes of its
    last step on an accounting stand-in (the same counter memsched's stand-in uses), its optimizer state
    (alive for the whole step) left out."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    sim = SimDevice(2**40)
    sim.start(list(model.parameters()))
    try:
        for i, b in enumerate(data):
            if i == len(data) - 1:
                sim.reset_peak()
            loss_of(model, b).backward()
            opt.step()
            opt.zero_grad()
        state = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
        return sim.peak_bytes - state
    finally:
        sim.stop()


def test_the_device_peak_with_policy_cpu_is_no_higher_than_torch_adamw_beyond_chunk_padding():
    data = batches(3)
    model = Logits()
    torch_peak = torch_peak_without_state(copy.deepcopy(model).to(SIM), data)
    with memsched.attach(model, policy="cpu", device="sim:64MiB", lr=LR, weight_decay=WD) as sched:
        for i, b in enumerate(data):
            if i == len(data) - 1:
                sched.sim.reset_peak()
            sched.backward(loss_of(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        peak = sched.sim.peak_bytes
        lay = sched.store.layout
        unused = lay.total_numel - sum(p.numel() for p in sched.store.params())
        # one rank: exact chunks ([Note: exact chunks]), with alignment gaps between parameters only
        assert unused == lay.waste_numel < PARAM_ALIGN * len(list(sched.store.params()))
        padding = unused * 4 * 2  # the chunks' room beyond their parameters: compute + gradient buffers
        freed = all(c.grad is None for c in sched.store.chunks)
    assert peak <= torch_peak + padding, (peak, torch_peak, padding)
    assert freed  # by zero_grad


def test_gradient_buffers_live_from_the_first_gradient_to_zero_grad():
    model = Logits()
    b = batches(1)[0]
    with memsched.attach(model, policy="cpu", device="sim:64MiB", lr=LR, weight_decay=WD) as sched:
        store = sched.store
        assert all(c.grad is None for c in store.chunks) and all(p.grad is None for p in model.parameters())
        before = sched.sim.live_bytes()
        sched.backward(loss_of(model, b))
        # policy cpu: every chunk's gradients went to the host as backward completed them; the device buffers
        # are gone and every gradient is a view into its chunk's host gradients
        assert all(c.grad is None for c in store.chunks)
        for p in model.parameters():
            assert p.grad.data_ptr() == store.host_view("grad", p).data_ptr()
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        assert all(c.grad is None for c in store.chunks) and all(p.grad is None for p in model.parameters())
        sched.backward(loss_of(model, b))
        sched.optimizer.step()
        model.zero_grad()  # torch's own (set_to_none): the buffers go before the next forward's peak
        with torch.no_grad():
            model(b[0][:1])
        assert all(c.grad is None for c in store.chunks)
        assert sched.sim.live_bytes() == before


class Branch(nn.Module):
    """``b`` is used on odd micro-batches only: within one step some parameters of a chunk get a gradient and
    others none."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if use_b:
            h = h + self.b(h)
        return self.out(h).square().mean()


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
@pytest.mark.parametrize("zero", ["optimizer", "model", "keep"])
def test_bit_exact_with_accumulation_clipping_and_gradients_missing_or_set_by_hand(policy, zero):
    """Against ``torch.optim.AdamW(fused=True)`` with torch's ``clip_grad_norm_`` (which triggers): two
    micro-batches, a parameter without a gradient in one step, a gradient set by hand on a parameter whose
    chunk has no buffer, and three ways of zeroing (the optimizer's, the model's, set_to_none=False)."""
    model = Branch()
    with uncounted():  # the reference beside the scheduler's data on the stand-in is not counted
        ref = copy.deepcopy(model).to(SIM)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 16, generator=g).to(SIM) for _ in range(12)]
    with memsched.attach(model, policy=policy, device="sim:8MiB", lr=LR, weight_decay=WD,
                         chunk_numel=300) as sched:
        for step in range(6):
            for side, m, opt in ((0, model, sched.optimizer), (1, ref, ref_opt)):
                ctx = sched.sim.paused() if side else torch.enable_grad()
                with ctx:
                    for k in range(2):
                        use_b = step % 3 != 0 and k == 1
                        m(xs[2 * step + k], use_b).backward()
                    if step == 4:  # a gradient set by hand where backward gave none
                        m.b.bias.grad = torch.full_like(m.b.bias, 0.5)
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                    opt.step()
                    if zero == "model":
                        m.zero_grad()
                    else:
                        opt.zero_grad(set_to_none=zero != "keep")
            sched.synchronize()
            for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert same(p.detach(), q.detach()), (step, n)
                assert (p.grad is None) == (q.grad is None), (step, n)
