"""Autocast on the stand-in casts as CUDA's does ([Note: autocast on the stand-in] in
memsched/devices/sim_backend.cpp): the op lists torch registers for AutocastCUDA, under AutocastPrivateUse1.
So HF Trainer's ``bf16=True``-style training (fp32 parameters under ``torch.autocast(device, bfloat16)``)
computes in bf16 on CI as on a GPU, and memsched's run equals torch's fused AdamW under the same autocast, bit
for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memsched
from tests._numerics import LR, SIM, WD, Reference, assert_same, gpt_batches, gpt_loss, tiny_gpt


def test_the_op_lists_are_cuda_s():
    lin, ln = nn.Linear(8, 8).to(SIM), nn.LayerNorm(8).to(SIM)
    x = torch.randn(4, 8, device=SIM)
    with torch.autocast("sim", dtype=torch.bfloat16):
        y = lin(x)  # lower precision: matrix products
        assert y.dtype == torch.bfloat16
        assert ln(y).dtype == torch.float32  # fp32: norms
        assert torch.softmax(y, -1).dtype == torch.float32  # fp32: softmax, as on CUDA
        assert F.cross_entropy(y, torch.zeros(4, dtype=torch.long, device=SIM)).dtype == torch.float32
        assert torch.addcmul(x, y, y).dtype == torch.float32  # promote: the widest input
        assert (y + y).dtype == torch.bfloat16  # not listed: passes through
    with torch.autocast("sim", dtype=torch.float16):
        assert lin(x).dtype == torch.float16
    assert lin(x).dtype == torch.float32  # outside autocast nothing is cast


def _autocast_loss(model: nn.Module, batch) -> torch.Tensor:
    with torch.autocast("sim", dtype=torch.bfloat16):
        return gpt_loss(model, batch)


@pytest.mark.parametrize("policy", ["auto", "cpu"])
def test_fp32_parameters_under_autocast_train_as_fused_adamw(policy):
    """The first bf16 form users write (fp32 parameters, autocast), with a clip that triggers: bit-exact
    against ``torch.optim.AdamW(fused=True)`` under the same autocast; and the autocast really computed in
    bf16 (the losses differ from fp32's)."""
    model = tiny_gpt()
    ref, ref32 = Reference(model), Reference(model)
    batches = gpt_batches(4)
    kw = {"device": "sim:800KiB"} if policy == "auto" else {"device": "sim:64MiB"}
    with memsched.attach(model, policy=policy, lr=LR, weight_decay=WD, chunk_numel=8192, **kw) as sched:
        for i, b in enumerate(batches):
            loss = _autocast_loss(model, b)
            sched.backward(loss)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            assert norm > 0.05
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(b, _autocast_loss, 0.05)
                ref32.step(b, gpt_loss, 0.05)
                assert_same(model, ref, f"step {i}")
        assert "host" in {c.placement for c in sched.store.chunks}
        with sched.sim.paused(), torch.no_grad():
            assert not torch.equal(_autocast_loss(ref.model, batches[0]).cpu(),
                                   gpt_loss(ref32.model, batches[0]).cpu())
