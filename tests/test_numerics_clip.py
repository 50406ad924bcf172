"""Gradient clipping that triggers, bit for bit against torch.optim.AdamW(fused=True) + clip_grad_norm_.

Every built-in policy on the stand-in (real device/host splits) and on the CPU, clipping through torch and
through ``sched.clip_grad_norm_``, fp32/bf16/fp16, across the warmup boundary (warmup traced with a dispatch
mode active, where in-place foreach ops do not bump version counters).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import memsched
from policies.types import DEVICE, HOST
from tests._numerics import LR, SIM, WD, Reference, assert_same, gpt_batches, gpt_loss, tiny_gpt

CLIP = 0.05  # the tiny GPT's gradient norm is ~1-3: clipping triggers on every step

PLACEMENTS = {
    "cpu": dict(policy="cpu", device="sim:64MiB"),
    "cuda": dict(policy="cuda", device="sim:64MiB"),
    "static": dict(policy="static", device="sim:64MiB", policy_options={"offload_optim_frac": 0.5}),
    "auto": dict(policy="auto", device="sim:800KiB"),  # 2 of 5 chunks on the device
    "on-cpu": dict(policy="auto", device="cpu"),
}


def run(placement: str, dtype: torch.dtype, via: str, *, steps: int = 4, warmup: int = 2):
    model = tiny_gpt()
    dev = "cpu" if placement == "on-cpu" else SIM
    ref = Reference(model, dtype, device=dev)
    batches = gpt_batches(steps, device=dev)
    kw = dict(PLACEMENTS[placement])
    with memsched.attach(model, lr=LR, weight_decay=WD, warmup_steps=warmup, dtype=dtype,
                         chunk_numel=8192, **kw) as sched:
        norms = []
        for i, b in enumerate(batches):
            sched.backward(gpt_loss(model, b))
            devices = [p.grad.device.type if p.grad is not None else None for p in model.parameters()]
            if via == "torch":
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            else:
                norms.append(float(sched.clip_grad_norm_(CLIP)))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            ctx = sched.sim.paused() if sched.sim is not None else contextlib.nullcontext()
            with ctx:
                # torch's clip groups the gradients by device (host chunks' are on the host)
                ref.step(b, gpt_loss, CLIP, clip_devices=devices if via == "torch" else None)
                assert_same(model, ref, f"{placement} {dtype} via {via}, step {i}", sched.optimizer)
        places = {c.placement for c in sched.store.chunks}
    assert min(norms) > 5 * CLIP, norms  # clipping really triggered
    return places


@pytest.mark.parametrize("via", ["torch", "memsched"])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_clipping_fp32_bit_exact(placement, via):
    places = run(placement, torch.float32, via)
    expected = {"cpu": {HOST}, "cuda": {DEVICE}, "on-cpu": {DEVICE}}.get(placement, {DEVICE, HOST})
    assert places == expected


@pytest.mark.parametrize("via", ["torch", "memsched"])
@pytest.mark.parametrize("placement", ["static", "on-cpu"])
def test_clipping_bf16_bit_exact(placement, via):
    run(placement, torch.bfloat16, via)


@pytest.mark.parametrize("placement", ["static", "cuda", "cpu"])
def test_clipping_fp16_bit_exact(placement):
    run(placement, torch.float16, "memsched")


def test_d2h_bytes_with_clipping_equal_without():
    def d2h(clip: bool) -> tuple[int, int]:
        model = tiny_gpt()
        with memsched.attach(model, policy="cpu", device="sim:64MiB", chunk_numel=8192) as sched:
            for b in gpt_batches(3):
                sched.backward(gpt_loss(model, b))
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                sched.optimizer.step()
                sched.optimizer.zero_grad()
            return sched.transfers.last_d2h_bytes, sched.transfers.d2h_bytes

    with_clip, without = d2h(True), d2h(False)
    assert with_clip == without and with_clip[0] > 0
