"""fp16 with a loss scale that grows: device- and host-placed chunks give the same model, equal to fp32 master
weights updated by torch.optim.AdamW(fused=True) under GradScaler's semantics, bit for bit (issue: device
chunks were unscaled with the grown scale of the next step)."""

from __future__ import annotations

import pytest
import torch

import memsched
from tests._numerics import LR, WD, Reference, assert_same, gpt_batches, gpt_loss, tiny_gpt

GROWTH_INTERVAL = 2  # the scale doubles every second clean step


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("policy", ["cuda", "cpu", "static"])
def test_growing_scale_bit_exact(policy, clip):
    model = tiny_gpt()
    ref = Reference(model, torch.float16, growth_interval=GROWTH_INTERVAL)
    opts = {"offload_optim_frac": 0.5} if policy == "static" else None
    scales = []
    with memsched.attach(model, policy=policy, policy_options=opts, device="sim:64MiB", chunk_numel=8192,
                         dtype=torch.float16, lr=LR, weight_decay=WD, warmup_steps=2) as sched:
        sched.scaler.growth_interval = GROWTH_INTERVAL
        for i, b in enumerate(gpt_batches(7)):
            sched.backward(gpt_loss(model, b))
            if clip is not None:
                sched.clip_grad_norm_(clip)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            scales.append(float(sched.scaler.scale))
            with sched.sim.paused():
                ref.step(b, gpt_loss, clip)
                assert_same(model, ref, f"{policy} step {i}", sched.optimizer)
                assert float(ref.scale) == scales[-1]
        assert sched.scaler.skipped_steps == ref.skipped
    assert len(set(scales)) >= 3  # the scale grew (at least twice) during the run
