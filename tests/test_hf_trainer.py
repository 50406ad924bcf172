"""Hugging Face Trainer with memsched's optimizer (``optimizers=(sched.optimizer, None)``): gradient
accumulation, ``max_grad_norm`` and the Trainer's LR scheduler, bit for bit against the same Trainer with
``torch.optim.AdamW(fused=True)``, with host-resident chunks, and gradients kept in the chunk views although
the Trainer sets them to None (``model.zero_grad()``).

Both runs train on the stand-in ``sim:0`` while the Trainer's device is the CPU (``use_cpu``): the Trainer
and its Accelerator place nothing (a ``model.to("cpu")`` would move memsched's parameters out of its chunks,
which it refuses) and the inputs go to the stand-in (:class:`SimTrainer`)."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch

import memsched
from tests._numerics import SIM, count_grad_copies, same, uncounted

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _sim_arguments(output_dir: str, **kwargs):
    """``TrainingArguments`` for a model already on sim:0 (memsched's, or a reference moved there) while
    the Trainer's Accelerator runs on the CPU (``use_cpu``): the Trainer's device (inputs, loss) is sim:0, and
    it does not place the model (a no-op there, but nothing is to move memsched's parameters)."""
    from transformers import TrainingArguments

    class SimArguments(TrainingArguments):
        @property
        def device(self) -> torch.device:
            _ = super().device  # sets the Trainer's process state up (on the CPU)
            return SIM

        @property
        def place_model_on_device(self) -> bool:
            return False

    return SimArguments(output_dir, use_cpu=True, **kwargs)


def _sim_trainer(**kwargs):
    """A Trainer whose Accelerator places nothing: its ``prepare`` would move the model to its device, the
    CPU (and round-trip the optimizer's state through it)."""
    from transformers import Trainer

    class SimTrainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            self.accelerator.device_placement = False

    return SimTrainer(**kwargs)


@contextlib.contextmanager
def _clip_on_devices(clip_devices: list | None, record: bool):
    """torch's ``clip_grad_norm_`` (which the Trainer calls through Accelerate) stacks the per-gradient norms
    grouped by device: over memsched's model, whose host chunks' gradients are CPU tensors at the clip (host
    views), the total norm rounds differently from the same norm over gradients all on one device. ``record``:
    note the devices of the gradients at each clip in ``clip_devices``; else (a reference run, all on sim:0)
    compute each clip's norm over the gradients placed on the devices noted, as torch groups them there."""
    if clip_devices is None:
        yield
        return
    original = torch.nn.utils.clip_grad_norm_
    calls = iter(list(clip_devices))

    def clip(parameters, max_norm, norm_type=2.0, **kwargs):
        params = [parameters] if torch.is_tensor(parameters) else list(parameters)
        if record:
            clip_devices.append([p.grad.device if p.grad is not None else None for p in params])
            return original(params, max_norm, norm_type, **kwargs)
        devices = next(calls)
        placed = [p.grad.to(d) for p, d in zip(params, devices, strict=True) if p.grad is not None]
        total = torch.nn.utils.get_total_norm(placed, norm_type).to(params[0].device)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    with mock.patch.object(torch.nn.utils, "clip_grad_norm_", clip):
        yield


def _trainer_run(base, data, tmp_path, use_memsched: bool, monkeypatch=None, *, max_grad_norm: float = 0.5,
                 attach_kwargs: dict | None = None, clip_devices: list | None = None):
    """Train a copy of ``base`` with the Trainer (accumulation 2, ``max_grad_norm``, a linear LR schedule),
    with memsched's optimizer (``attach_kwargs``; default: half the optimizer state on the host) or
    ``torch.optim.AdamW(fused=True)``. Returns the logged losses, the model, the gradients memsched had to
    copy into its chunks (``monkeypatch`` given) and the plan memsched ended with. ``clip_devices`` (a list):
    memsched's run records its gradients' devices at each clip there, and a reference run given that list
    clips as torch does over them (see :func:`_clip_on_devices`)."""
    model = copy.deepcopy(base)
    args = _sim_arguments(str(tmp_path / ("m" if use_memsched else "t")), per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-3, weight_decay=0.1,
                          max_grad_norm=max_grad_norm, lr_scheduler_type="linear", warmup_steps=1,
                          logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0, seed=0)
    copies: list = []
    sched = None
    if use_memsched:
        if monkeypatch is not None:
            count_grad_copies(monkeypatch, copies)
        kwargs = attach_kwargs or {"device": "sim:64MiB", "chunk_numel": 16384, "policy": "static",
                                   "policy_options": {"offload_optim_frac": 0.5}}
        sched = memsched.attach(model, lr=1e-3, weight_decay=0.1, **kwargs)
        opt = sched.optimizer
    else:  # on the stand-in too (attach moved memsched's model there), not counted beside the scheduler's run
        with uncounted():
            model.to(SIM)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    trainer = _sim_trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    with _clip_on_devices(clip_devices, record=use_memsched):
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
    clip_devices: list = []  # where memsched's gradients were at each clip, for the reference's clip
    losses, model, copies, plan = _trainer_run(base, data, tmp_path, True, monkeypatch,
                                               clip_devices=clip_devices)
    ref_losses, ref, _, _ = _trainer_run(base, data, tmp_path, False, monkeypatch,
                                         clip_devices=clip_devices)
    # host chunks' gradients read as the device too ([Note: parameters read where they compute]): the
    # Trainer's clip sees one device, as on a GPU
    assert len(clip_devices) == 4 and {d.type for d in clip_devices[-1] if d is not None} == {"sim"}
    assert set(plan.placement) == {"device", "host"}
    assert len(losses) == 4 and losses == ref_losses
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert same(p, q)
    assert copies == []  # the Trainer's model.zero_grad() did not make backward allocate new gradients
