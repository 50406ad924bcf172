"""The workload users run (issue 42) on the stand-in: a small Llama (transformers ``LlamaConfig``: 2 layers,
GQA, tied and untied embeddings, built from the config) in both bf16 forms users write, with a clip that
triggers, accumulation of 2 and ``auto`` keeping parameters on the host; half the cases build the model on the
meta device and load its weights after attach ([Note: models built on meta])."""

from __future__ import annotations

import pytest
import torch

import memsched
from tests._numerics import LR, WD, Reference, assert_same, gpt_batches

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")


def _config(tied: bool):
    return transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=64, tie_word_embeddings=tied)


def _build(tied: bool, meta: bool):
    if not meta:
        return transformers.LlamaForCausalLM(_config(tied))
    with accelerate.init_empty_weights():  # parameters on meta, buffers (RoPE's inv_freq) for real
        model = transformers.LlamaForCausalLM(_config(tied))
    model.tie_weights()  # transformers ties at loading; a model built empty ties here
    return model


def _lm_loss(model, batch) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def _autocast_loss(model, batch) -> torch.Tensor:
    with torch.autocast("sim", dtype=torch.bfloat16):
        return _lm_loss(model, batch)


def _reference(form: str, tied: bool):
    """A seeded Llama (in ``bf16`` form its weights are bf16 values), the compute dtype, the loss function of
    the form, and its torch reference: ``(model, dtype, loss_fn, Reference)``."""
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(_config(tied))
    if form == "bf16":
        with torch.no_grad():
            for p in real.parameters():
                p.copy_(p.bfloat16().float())
    dtype = torch.bfloat16 if form == "bf16" else torch.float32
    loss_fn = _autocast_loss if form == "autocast" else _lm_loss
    return real, dtype, loss_fn, Reference(real, dtype)


@pytest.mark.parametrize(("form", "tied", "meta"), [("autocast", True, True), ("autocast", False, False),
                                                    ("bf16", True, False), ("bf16", False, True)])
def test_a_small_llama_trains_bit_exact_in_both_bf16_forms(form: str, tied: bool, meta: bool) -> None:
    """``autocast``: fp32 parameters under ``torch.autocast("sim", bfloat16)`` (HF Trainer's ``bf16=True``)
    against fused AdamW under the same autocast. ``bf16``: ``attach(dtype=torch.bfloat16)`` against a bf16
    model with fp32 masters updated by fused AdamW (the weights are bf16 values, so masters loaded from them
    after a meta build start where the reference's do). Every step bit for bit, masters included."""
    real, dtype, loss_fn, ref = _reference(form, tied)
    model = _build(tied, meta)
    if not meta:
        model.load_state_dict(real.state_dict())
    batches = gpt_batches(6)
    cap = "sim:900KiB" if form == "bf16" else "sim:1800KiB"  # the parameters do not all fit: some on the host
    with memsched.attach(model, device=cap, dtype=dtype if form == "bf16" else None, lr=LR,
                         weight_decay=WD, chunk_numel=32768) as sched:
        if meta:
            model.load_state_dict(real.state_dict())  # low-memory loading: the weights come after attach
        clipped = 0
        for i in range(3):
            micro = batches[2 * i:2 * i + 2]
            for b in micro:
                sched.backward(loss_fn(model, b))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            clipped += bool(norm > 1.0)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(micro, loss_fn, 1.0)
                assert_same(model, ref, f"step {i}", sched.optimizer)
        assert clipped >= 1
        assert sched.plan.param_host_chunks, "auto kept every chunk's parameters on the device"
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied



@pytest.mark.parametrize("form", ["autocast", "bf16"])
def test_memscheds_clip_with_parameters_on_the_host(form: str) -> None:
    """The same Llama with parameters on the host, one micro-batch per step and ``sched.clip_grad_norm_``:
    from the second step the host chunks' norms come from backward ([Note: norms taken in backward]); every
    step is the reference's bit for bit."""
    real, dtype, loss_fn, ref = _reference(form, False)
    model = _build(False, False)
    model.load_state_dict(real.state_dict())
    cap = "sim:900KiB" if form == "bf16" else "sim:1800KiB"
    with memsched.attach(model, device=cap, dtype=dtype if form == "bf16" else None, lr=LR,
                         weight_decay=WD, chunk_numel=32768) as sched:
        for i, b in enumerate(gpt_batches(5)):
            sched.backward(loss_fn(model, b))
            assert float(sched.clip_grad_norm_(0.5)) > 0.5
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(b, loss_fn, 0.5)
                assert_same(model, ref, f"step {i}", sched.optimizer)
        assert sched.plan.param_host_chunks and sched.optimizer.clipper.backward_norm_hits > 0


#: Found 2026-11-29, present before that day's changes (issue 42): in the first steady step's backward, the
#: eviction of a chunk the layer's re-forward read frees no device bytes (earlier evictions free the whole
#: buffer), so the device runs out of memory at a fetch the plan said fits. The re-forward saves the layer's
#: parameters for its backward as plain tensors (under the checkpoint's own saved-tensor hooks, not memsched's
#: tokens), which keeps their chunks' storage alive after eviction; the schedule counts them as gone.
CHECKPOINT_PLAN_NOT_TRUE = pytest.mark.xfail(
    strict=True, raises=getattr(torch, "OutOfMemoryError", RuntimeError),
    reason="checkpointed layers with parameters on the host: the plan is not true (the first steady step "
           "runs out of memory)")


@CHECKPOINT_PLAN_NOT_TRUE
def test_checkpointed_layers_with_parameters_on_the_host_fit_their_plan() -> None:
    """HF gradient checkpointing (non-reentrant) on the bf16 Llama with parameters on the host: the steady
    steps must fit the device the plan was made for."""
    torch.manual_seed(0)
    model = _build(False, False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with memsched.attach(model, device="sim:1000KiB", dtype=torch.bfloat16, lr=LR, weight_decay=WD,
                         chunk_numel=32768, replan="off") as sched:
        for b in gpt_batches(3):
            sched.backward(_lm_loss(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        assert sched.plan.param_host_chunks
