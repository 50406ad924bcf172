"""[Note: norms taken in backward] (memsched.optim.clipping): once sched.clip_grad_norm_ has run, a host
chunk's per-tensor gradient norms are taken on the device as backward completes them, so the clip copies no
host gradients back; whenever the host gradients are no longer exactly what landed, the clip copies them back
as before. Bit for bit torch.optim.AdamW(fused=True) + clip_grad_norm_ on the device either way."""

from __future__ import annotations

import pytest
import torch

import memsched
from tests._numerics import LR, WD, Reference, assert_same, gpt_batches, gpt_loss, tiny_gpt, uncounted

CLIP = 0.05  # the tiny GPT's gradient norm is ~1-3: clipping triggers on every step


def _ref_step(ref: Reference, parts, between, norm_type: float, clips: int = 1) -> torch.Tensor:
    """The reference's step: backward of each micro-batch, ``between``, torch's clip on the device, fused
    AdamW (under bf16 on fp32 masters, the gradients clipped in bf16 as users do)."""
    with uncounted():
        params = list(ref.model.parameters())
        for mb in parts:
            gpt_loss(ref.model, mb).backward()
        if between is not None:
            between(ref.model)
        for _ in range(clips):
            norm = torch.nn.utils.clip_grad_norm_(params, CLIP, norm_type)
        if ref.dtype != torch.float32:
            for m, p in zip(ref.masters, params, strict=True):
                m.grad = p.grad.float()
            ref.model.zero_grad()
        ref.opt.step()
        ref.opt.zero_grad()
        ref.sync()
    return norm


def _train(dtype: torch.dtype, *, steps: int = 5, micro: int = 1, between=None, norm_type: float = 2.0,
           policy: str = "cpu", device: str = "sim:64MiB", clips: int = 1, set_to_none: bool = True,
           from_backward: bool = True, **attach):
    """``steps`` steps of ``micro`` micro-batches with sched.clip_grad_norm_ (``clips`` times in a row)
    against the reference; returns each step's clip H2D bytes and the clipper's hits so far after it.
    ``between(model)`` runs between backward and the clip (what a user may do to the gradients), and on the
    reference's gradients too; ``set_to_none``: ``zero_grad``'s; ``from_backward``: the clip's
    ``norms_from_backward``; ``attach``: more attach options."""
    model = tiny_gpt()
    ref = Reference(model, dtype)
    out = []
    with memsched.attach(model, lr=LR, weight_decay=WD, dtype=dtype, chunk_numel=8192, policy=policy,
                         device=device, policy_options={"offload_optim_frac": 0.5} if policy == "static"
                         else None, **attach) as sched:
        clipper = sched.optimizer.clipper
        batches = gpt_batches(steps * micro)
        for i in range(steps):
            parts = batches[i * micro:(i + 1) * micro]
            for mb in parts:
                sched.backward(gpt_loss(model, mb))
            if between is not None:
                between(model)
            before = sched.transfers_dict["h2d_bytes"]
            for _ in range(clips):
                norm = sched.clip_grad_norm_(CLIP, norm_type, norms_from_backward=from_backward)
            out.append((sched.transfers_dict["h2d_bytes"] - before, clipper.backward_norm_hits))
            sched.optimizer.step()
            sched.optimizer.zero_grad(set_to_none=set_to_none)
            with sched.sim.paused():
                ref_norm = _ref_step(ref, parts, between, norm_type, clips)
                assert_same(model, ref, f"{dtype} step {i}", sched.optimizer)
                assert torch.equal(norm.cpu(), ref_norm.cpu()), (i, norm, ref_norm)
            assert float(norm) > 5 * CLIP or clips > 1  # the clip triggers (a second one finds it clipped)
        host = [c for c in sched.store.chunks if c.placement == "host"]
    assert host
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_clip_takes_the_norms_from_backward_and_copies_nothing_back(dtype):
    """After the first clip, every step's clip uses the norms taken in backward: no H2D bytes, one hit per
    host chunk, and the run is the reference's bit for bit."""
    out = _train(dtype)
    assert out[0][0] > 0 and out[0][1] == 0  # the first clip: no norms yet, the gradients come back
    assert all(h2d == 0 for h2d, _ in out[1:]), out
    hits = [h for _, h in out]
    assert hits[1] > 0 and all(b - a == hits[1] for a, b in zip(hits[1:], hits[2:], strict=False)), hits


def test_a_write_to_the_gradients_before_the_clip_brings_them_back():
    """A user's in-place write through p.grad between backward and the clip moves the version counters: the
    clip copies the gradients back and clips what they are now (exact)."""
    def halve(model):
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)

    out = _train(torch.float32, between=halve)
    assert all(h2d > 0 for h2d, _ in out) and out[-1][1] == 0, out


def test_accumulation_and_another_norm_type_bring_them_back():
    """Two micro-batches add on the host (the device never held the sum), and a clip in another norm type
    than the last has no norms of its type: both copy the gradients back (exact)."""
    out = _train(torch.float32, micro=2)
    assert all(h2d > 0 for h2d, _ in out) and out[-1][1] == 0, out
    out = _train(torch.float32, norm_type=1.0)
    assert all(h2d == 0 for h2d, _ in out[1:]), out  # the same type every step: taken in backward


@pytest.mark.parametrize("overlap", [True, "backward"])
def test_with_each_overlap_mode(overlap):
    """The overlapped update (its own copy of the gradients) and the updates during backward (validated or
    undone by the clip's coefficient) take the clip's norms from backward too, exact."""
    out = _train(torch.float32, overlap=overlap)
    assert all(h2d == 0 for h2d, _ in out[1:]) and out[-1][1] > 0, out


def test_a_second_clip_in_the_same_step_sees_the_first_ones_scaling():
    """The first clip scales the gradients in place (their version counters move): the second copies them
    back and takes their norms as they are now, as torch's second clip does."""
    out = _train(torch.float32, clips=2)
    hits = [h for _, h in out]
    assert all(h2d > 0 for h2d, _ in out[1:]) and hits[-1] > 0, out  # each step: one hit, then a copy


def test_writes_torch_does_not_count_need_the_norms_of_the_gradients_as_they_are():
    """A write through ``p.grad.data`` moves no version counter, so the norms taken in backward would not see
    it ([Note: norms taken in backward]): ``norms_from_backward=False`` takes the gradients as they are
    (exact), and backward then takes no norms."""
    def halve(model):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.data.mul_(0.5)

    out = _train(torch.float32, between=halve, from_backward=False)
    assert all(h2d > 0 for h2d, _ in out) and out[-1][1] == 0, out


def test_zero_grad_in_place_is_exact():
    """``zero_grad(set_to_none=False)`` keeps the host gradients (zeros), so the next backward's are added to
    them on the host: the clip copies them back (exact; no norms from backward on this path)."""
    out = _train(torch.float32, set_to_none=False)
    assert out[-1][1] == 0, out
