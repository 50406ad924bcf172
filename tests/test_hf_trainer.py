"""Hugging Face Trainer with memsched's optimizer (``optimizers=(sched.optimizer, None)``): gradient
accumulation, ``max_grad_norm`` and the Trainer's LR scheduler, bit for bit against the same Trainer with
``torch.optim.AdamW(fused=True)``, with host-resident chunks, and gradients kept in the chunk views although
the Trainer sets them to None (``model.zero_grad()``)."""

from __future__ import annotations

import copy

import pytest
import torch

import memsched
from tests._numerics import count_grad_copies

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _trainer_run(base, data, tmp_path, use_memsched: bool, monkeypatch=None, *, max_grad_norm: float = 0.5,
                 attach_kwargs: dict | None = None):
    """Train a copy of ``base`` with the Trainer (accumulation 2, ``max_grad_norm``, a linear LR schedule),
    with memsched's optimizer (``attach_kwargs``; default: half the optimizer state on the host) or
    ``torch.optim.AdamW(fused=True)``. Returns the logged losses, the model, the gradients memsched had to
    copy into its chunks (``monkeypatch`` given) and the plan memsched ended with."""
    from transformers import Trainer, TrainingArguments

    model = copy.deepcopy(base)
    args = TrainingArguments(str(tmp_path / ("m" if use_memsched else "t")), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-3, weight_decay=0.1,
                             max_grad_norm=max_grad_norm, lr_scheduler_type="linear", warmup_steps=1,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             dataloader_num_workers=0, seed=0)
    copies: list = []
    sched = None
    if use_memsched:
        if monkeypatch is not None:
            count_grad_copies(monkeypatch, copies)
        kwargs = attach_kwargs or {"device": "sim:64MiB", "chunk_numel": 16384, "policy": "static",
                                   "policy_options": {"offload_optim_frac": 0.5}}
        sched = memsched.attach(model, lr=1e-3, weight_decay=0.1, **kwargs)
        opt = sched.optimizer
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    plan = None
    if sched is not None:
        plan = sched.plan
        sched.close()
    return losses, model, copies, plan


def test_trainer_with_memsched_equals_fused_adamw(tmp_path, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    base = GPT2LMHeadModel(cfg)  # tied input/output embeddings
    tokens = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    ref_losses, ref, _, _ = _trainer_run(base, data, tmp_path, False, monkeypatch)
    losses, model, copies, plan = _trainer_run(base, data, tmp_path, True, monkeypatch)
    assert set(plan.placement) == {"device", "host"}
    assert len(losses) == 4 and losses == ref_losses
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert copies == []  # the Trainer's model.zero_grad() did not make backward allocate new gradients
