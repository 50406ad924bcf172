"""Mixed precision: bf16/fp16 compute parameters with fp32 master weights; fp16 dynamic loss scaling."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memsched
from policies.types import DEVICE, HOST
from tests._numerics import SIM, same


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 4))


def attach(m: nn.Module, dtype: torch.dtype) -> memsched.Scheduler:
    return memsched.attach(m, policy="static", policy_options={"offload_optim_frac": 0.5}, device="sim:1MiB",
                           dtype=dtype, lr=1e-2, weight_decay=0.1, chunk_numel=600)


def masters(sched: memsched.Scheduler) -> list[torch.Tensor]:
    sd = sched.optimizer.state_dict()
    return [sd["state"][i]["master_weight"] for i in range(len(sd["state"]))]


class Reference:
    """What mixed precision means: fp32 masters updated by torch.optim.AdamW from the low-precision gradients,
    copied into a low-precision model before each forward; fp16 with GradScaler's dynamic loss scale."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.master = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        self.model = copy.deepcopy(model).to(dtype)
        self.opt = torch.optim.AdamW(self.master, lr=1e-2, weight_decay=0.1)
        self.scale = 2.0**16 if dtype == torch.float16 else None
        self.skipped = 0
        self.dtype = dtype

    def step(self, x: torch.Tensor) -> None:
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.master, strict=True):
                p.copy_(m)
        loss = self.model(x.to(self.dtype)).float().pow(2).mean()
        (loss * self.scale if self.scale else loss).backward()
        grads = [p.grad.float() for p in self.model.parameters()]
        self.model.zero_grad()
        if self.scale:
            if not all(torch.isfinite(g).all() for g in grads):
                self.scale /= 2
                self.skipped += 1
                return
            grads = [g / self.scale for g in grads]
        for m, g in zip(self.master, grads, strict=True):
            m.grad = g
        self.opt.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_fp32_masters_updated_by_adamw(dtype):
    m = make_model()
    ref = Reference(m, dtype)
    xs = [torch.randn(8, 12) for _ in range(4)]
    with attach(m, dtype) as sched:
        for x in xs:
            sched.backward(m(x.to(SIM, dtype)).float().pow(2).mean())  # inputs in the compute dtype
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        with sched.sim.paused():
            ref_state = [(m_.detach().clone()) for m_ in ref.master]
            for x in xs:
                ref.step(x)  # on the CPU: compared within a tolerance
            got = masters(sched)
        places = {c.placement for c in sched.store.chunks}
        for c in sched.store.chunks:
            assert c.data.dtype == dtype and c.grad is None  # freed by zero_grad (made in backward, dtype)
            assert c.master_view().dtype == torch.float32 and c.exp_avg.dtype == torch.float32
    assert places == {DEVICE, HOST}
    assert all(p.dtype == dtype for p in m.parameters())
    for a, b, start in zip(got, ref.master, ref_state, strict=True):
        assert not same(b, start)
        assert ((a.cpu() - b).abs().max() / b.abs().max()).item() < 1e-5
    # The compute parameters are the masters rounded to the compute dtype.
    for p, mw in zip(m.parameters(), got, strict=True):
        assert same(p.detach(), mw.to(dtype))


@pytest.mark.parametrize("layer", [0, 4])  # chunk 0 is on the device, the last one on the host
def test_fp16_step_with_inf_is_skipped_and_the_scale_backs_off(layer):
    m = make_model()
    with attach(m, torch.float16) as sched:
        x = torch.randn(8, 12, dtype=torch.float16).to(SIM)
        sched.backward(m(x).float().pow(2).mean())
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        with sched.sim.paused():
            params = [p.detach().clone() for p in m.parameters()]
            state = copy.deepcopy(sched.optimizer.state_dict())
        scale = float(sched.scaler.scale)
        sched.backward(m(x).float().pow(2).mean())
        chunk = sched.store.param_chunk[id(m[layer].weight)]
        assert chunk.placement == (DEVICE if layer == 0 else HOST)
        with torch.no_grad():
            m[layer].weight.grad[0, 0] = float("inf")  # an overflow in one gradient of one chunk
        sched.optimizer.step()
        assert float(sched.scaler.scale) == scale / 2 and sched.scaler.skipped_steps == 1
        with sched.sim.paused():
            after = sched.optimizer.state_dict()
        for p, q in zip(m.parameters(), params, strict=True):
            assert same(p, q)
        for i, st in state["state"].items():
            for k, v in st.items():
                assert same(v, after["state"][i][k]), (i, k)
        # The next clean step updates again.
        sched.optimizer.zero_grad()
        sched.backward(m(x).float().pow(2).mean())
        sched.optimizer.step()
        assert not same(m[0].weight.detach(), params[0])
        assert sched.transfers.steps == 3


def test_fp16_clip_grad_norm_sees_true_gradients():
    m = make_model()
    with attach(m, torch.float16) as sched:
        sched.backward(m(torch.randn(8, 12, dtype=torch.float16).to(SIM)).float().pow(2).mean())
        scale = float(sched.scaler.scale)
        with sched.sim.paused():
            true = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad.float() / scale) for p in m.parameters()]))
        norm = sched.clip_grad_norm_(1e-3)
        assert torch.allclose(norm.float(), true, rtol=1e-2)
        # The coefficient waits for the step, where it multiplies the fp32 unscaled gradients (as GradScaler
        # users clip fp32 master gradients): the gradients the update sees have the clipped norm.
        (coef,) = sched.optimizer._clip_coefs
        assert (coef * true).item() == pytest.approx(1e-3, rel=2e-2)


def test_bf16_has_no_loss_scaler():
    m = make_model()
    with attach(m, torch.bfloat16) as sched:
        assert sched.scaler is None
