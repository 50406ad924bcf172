"""Resume is bit-exact in every load order and precision: a run interrupted after K steps, saved and resumed
into a fresh model and scheduler, ends exactly where the uninterrupted run ends. fp16 carries its loss scale
(and growth tracker) in ``optimizer.state_dict()`` and ``memsched.checkpoint``; bf16 keeps its fp32 masters
whether the model or the optimizer state is loaded first."""

from __future__ import annotations

import pytest
import torch

import memsched
import memsched.checkpoint
from tests._numerics import LR, WD, gpt_batches, gpt_loss, same, tiny_gpt

STEPS, CUT = 6, 3


def attach(model, dtype):
    sched = memsched.attach(model, policy="static", policy_options={"offload_optim_frac": 0.5},
                            device="sim:64MiB", dtype=dtype, lr=LR, weight_decay=WD, chunk_numel=8192)
    if sched.scaler is not None:
        sched.scaler.growth_interval = 2  # the scale grows inside the run
    return sched


def train(sched, model, batches):
    for b in batches:
        sched.backward(gpt_loss(model, b))
        sched.clip_grad_norm_(0.05)
        sched.optimizer.step()
        sched.optimizer.zero_grad()


def snapshot(sched, model):
    with sched.sim.paused():
        sd = sched.optimizer.state_dict()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, sd


def assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    for n in pa:
        assert same(pa[n], pb[n]), n
    assert sa.get("loss_scaler") == sb.get("loss_scaler")
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert same(v, sb["state"][i][k]), (i, k)


@pytest.mark.parametrize("how", ["model-first", "optimizer-first", "checkpoint"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_resume_is_bit_exact(dtype, how, tmp_path):
    batches = gpt_batches(STEPS)
    model = tiny_gpt()
    with attach(model, dtype) as sched:
        train(sched, model, batches)
        whole = snapshot(sched, model)
        scaler = sched.scaler.state_dict() if sched.scaler is not None else None
    if scaler is not None:
        assert scaler["scale"] != 2.0**16  # the scale moved: resuming it matters

    model = tiny_gpt()
    with attach(model, dtype) as sched:
        train(sched, model, batches[:CUT])
        with sched.sim.paused():
            if how == "checkpoint":
                memsched.checkpoint.save(sched, tmp_path / "ckpt")
            else:
                model_sd = {k: v.clone() for k, v in model.state_dict().items()}
                opt_sd = sched.optimizer.state_dict()

    model = tiny_gpt(seed=7)  # different initial values: everything must come from the checkpoint
    with attach(model, dtype) as sched:
        with sched.sim.paused():
            if how == "checkpoint":
                memsched.checkpoint.load(sched, tmp_path / "ckpt")
            elif how == "model-first":
                model.load_state_dict(model_sd)
                sched.optimizer.load_state_dict(opt_sd)
            else:
                sched.optimizer.load_state_dict(opt_sd)
                model.load_state_dict(model_sd)
        train(sched, model, batches[CUT:])
        assert_same(snapshot(sched, model), whole)
