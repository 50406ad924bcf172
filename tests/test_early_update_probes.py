"""Probes of overlap="backward" (memsched.optim.early_update) with user behaviour the main tests do not cover:
parameters without a gradient in some steps, tied weights with accumulation and ``model.zero_grad()``,
checkpoints and state dicts between backward and step, LR schedulers and tensor hyper-parameters, bf16 and
fp16 with an overflow, exceptions between backward and step, and reads between backward and step. Each run is
compared bit for bit with ``torch.optim.AdamW(fused=True)`` (parameters, and optimizer state where it is
meaningful), and checks that updates made during backward really were committed where they should be.

The worker is slowed down (as in tests/test_early_update.py) so that a missing wait shows as a wrong number.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
from torch import nn

import memsched
import memsched.checkpoint
from memsched.optim.hybrid_adamw import HybridAdamW
from policies.types import HOST
from tests._numerics import (
    BRANCHY_CHUNK_NUMEL,
    LR,
    SIM,
    WD,
    Branchy,
    Reference,
    assert_same,
    gpt_batches,
    gpt_loss,
    same,
    tiny_gpt,
    uncounted,
)
from tests.test_overlap import PLACEMENTS, accumulated, paused

CPU = dict(PLACEMENTS["cpu"])


def n_host(sched) -> int:
    return sum(c.placement == HOST for c in sched.store.chunks)


def no_worker_left() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("memsched-host-update")]


def assert_state_same(sched, ref_opt, what: str) -> None:
    """Optimizer state (moments, step counts) equal bit for bit; a parameter torch has no state for (never
    updated) has step 0 and zero moments in memsched's."""
    with paused(sched):
        ours = sched.optimizer.state_dict()["state"]
        theirs = ref_opt.state_dict()["state"]
    for i, st in theirs.items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            a, b = ours[i][k].float(), st[k].float()
            assert same(a, b), f"{what}: state {i} {k}"
    for i, st in ours.items():
        if i not in theirs:
            assert float(st["step"]) == 0 and not st["exp_avg"].any(), f"{what}: state {i} was updated"


def assert_params_same(model, ref_model, what: str) -> None:
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert same(p.detach(), q.detach()), f"{what}: {n}"


# ---- 1. parameters that get no gradient in some steps ----------------------------------------------------

def branchy_batches(n: int):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=g).to(SIM) for _ in range(n)]


def branchy_run(model, sched, ref, ref_opt, steps, *, micro_uses, between=None, set_to_none=True,
                wait_micro=False):
    """``steps`` steps; ``micro_uses(i)`` lists, per micro-batch of step ``i``, whether ``b`` runs in it.
    ``between(i, model, opt)`` runs after backward and before the step on both sides. ``wait_micro``: the
    updates made during a backward are done before the next micro-batch (else the worker may copy the
    gradients after the next backward, and its update is then the step's)."""
    batches = branchy_batches(steps * 3)
    for i in range(steps):
        uses = micro_uses(i)
        for side, m, opt in (("ours", model, sched.optimizer), ("ref", ref, ref_opt)):
            ctx = paused(sched) if side == "ref" else contextlib.nullcontext()
            with ctx:
                for k, use in enumerate(uses):
                    m.use_b = use
                    loss = m(batches[3 * i + k]).square().mean() / len(uses)
                    if side == "ours":
                        sched.backward(loss)
                        if wait_micro:
                            sched.optimizer.early_updates.wait()
                    else:
                        loss.backward()
                if between is not None:
                    between(i, m, opt)
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
        sched.synchronize()  # the overlapped update of the host chunks is done (direct reads follow)
        assert_params_same(model, ref, f"step {i}")


def _branchy_pair(**kw):
    model = Branchy()
    with uncounted():  # the reference beside the scheduler's data on the stand-in is not counted
        ref = copy.deepcopy(model).to(SIM)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    sched = memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=BRANCHY_CHUNK_NUMEL,
                            overlap="backward", **CPU, **kw)
    return model, sched, ref, ref_opt


@pytest.mark.parametrize("set_to_none", [True, False])
def test_branch_taken_every_other_step(set_to_none, slow_early_worker):
    """``b`` gets a gradient in even steps only: with zero_grad(set_to_none=True) torch does not update it
    (nor move its step count) in odd steps, with set_to_none=False it updates it with a zero gradient. The
    chunk without ``b`` commits every step; the chunk with ``b`` commits only where every parameter got a
    gradient in one backward."""
    model, sched, ref, ref_opt = _branchy_pair()
    with sched:
        branchy_run(model, sched, ref, ref_opt, 6, micro_uses=lambda i: [i % 2 == 0], set_to_none=set_to_none)
        assert_state_same(sched, ref_opt, "every other step")
        early = sched.optimizer.early_updates
        # steps 1..5 are steady; chunk 0 commits in each, chunk 1 in the even ones (2, 4)
        assert early.committed == 5 + 2 and early.dropped == 0
    assert no_worker_left()


def test_branch_used_in_one_micro_batch_of_two(slow_early_worker):
    """Accumulation where ``b`` runs only in the first micro-batch: the chunk holding ``b`` is complete after
    the first backward only, and the second backward changes its other gradients, so its update made during
    the first backward (waited for before the second) must be dropped; the other chunk commits the second
    backward's update."""
    model, sched, ref, ref_opt = _branchy_pair()
    with sched:
        branchy_run(model, sched, ref, ref_opt, 5, micro_uses=lambda i: [True, False], wait_micro=True)
        assert_state_same(sched, ref_opt, "one micro-batch of two")
        early = sched.optimizer.early_updates
        assert early.committed == 4 and early.dropped == 4  # chunk 0 commits, chunk 1 drops, steps 1..4
    assert no_worker_left()


def test_branch_used_in_second_micro_batch_only(slow_early_worker):
    """``b`` runs only in the last of three micro-batches: its chunk is complete in that backward, and its
    update made then (from the whole accumulated gradients) commits."""
    model, sched, ref, ref_opt = _branchy_pair()
    with sched:
        branchy_run(model, sched, ref, ref_opt, 4, micro_uses=lambda i: [False, False, True])
        assert_state_same(sched, ref_opt, "last micro-batch")
        assert sched.optimizer.early_updates.committed == 2 * 3
    assert no_worker_left()


def test_requires_grad_turned_off_after_attach(slow_early_worker):
    """``b`` is frozen (requires_grad_(False)) mid-training and thawed later: torch does not update it while
    frozen (its .grad is None after zero_grad()); neither does memsched, and the update of its chunk made
    during backward never commits while it has no gradient."""
    model, sched, ref, ref_opt = _branchy_pair()
    with sched:
        branchy_run(model, sched, ref, ref_opt, 2, micro_uses=lambda i: [True])
        for m in (model, ref):
            m.b.requires_grad_(False)
        branchy_run(model, sched, ref, ref_opt, 2, micro_uses=lambda i: [True])
        for m in (model, ref):
            m.b.requires_grad_(True)
        branchy_run(model, sched, ref, ref_opt, 2, micro_uses=lambda i: [True])
        assert_state_same(sched, ref_opt, "frozen then thawed")
        early = sched.optimizer.early_updates
        # steady steps: 1 (both chunks), 2 and 3 frozen (chunk 0 only), 4 and 5 (both)
        assert early.committed == 2 + 1 + 1 + 2 + 2 and early.dropped == 0


def test_grad_set_to_none_for_one_parameter_between_backward_and_step(slow_early_worker):
    """``p.grad = None`` for one parameter of a chunk after its update was made during backward: torch skips
    that parameter, so the update made for all of the chunk's parameters must not commit."""
    model, sched, ref, ref_opt = _branchy_pair()

    def between(i, m, opt):
        if i >= 2:
            if opt is sched.optimizer:
                sched.optimizer.early_updates.wait()
            m.out.bias.grad = None

    with sched:
        branchy_run(model, sched, ref, ref_opt, 4, micro_uses=lambda i: [True], between=between)
        assert_state_same(sched, ref_opt, "grad set to None")
        early = sched.optimizer.early_updates
        assert early.committed == 2 + 2 and early.dropped == 2  # step 1: both; 2, 3: chunk 0 only


# ---- 2. tied weights, 3 micro-batches, model.zero_grad() -------------------------------------------------

def test_tied_weights_three_micro_batches_model_zero_grad(slow_early_worker):
    """The tiny GPT ties wte and lm_head; 3 micro-batches per step and model.zero_grad() (set_to_none): each
    host chunk commits the update made during the last backward."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(12)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                         **CPU) as sched:
        assert model.lm_head.weight is model.wte.weight
        for i in range(4):
            micro = batches[3 * i:3 * i + 3]
            for b in micro:
                sched.backward(gpt_loss(model, b) / 3)
            sched.optimizer.step()
            model.zero_grad()
            assert all(p.grad is None for p in model.parameters())
            with paused(sched):
                ref.step(None, accumulated(ref, micro), None)
            sched.synchronize()
            assert_same(model, ref, f"step {i}")
        assert_state_same(sched, ref.opt, "tied, accumulation")
        early = sched.optimizer.early_updates
        assert early.committed == 3 * n_host(sched) and early.dropped == 0


# ---- 3. checkpoints between backward and step, resume with overlap="backward" ----------------------------

def test_checkpoint_between_backward_and_step_and_resume(tmp_path, slow_early_worker):
    """memsched.checkpoint.save between backward and step saves the state before the step; loading (the same
    values) between backward and step drops the updates made during backward; a fresh scheduler with
    overlap="backward" resumed from the first checkpoint ends where the uninterrupted run ends."""
    batches = gpt_batches(6)
    model = tiny_gpt()
    ref = Reference(model)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward", **CPU) as sched:
        for i, b in enumerate(batches):
            sched.backward(gpt_loss(model, b))
            if i == 3:
                memsched.checkpoint.save(sched, tmp_path / "before-step-3")
                with paused(sched):
                    saved_params = {n: p.detach().clone() for n, p in model.named_parameters()}
                dropped = sched.optimizer.early_updates.dropped
            if i == 4:
                memsched.checkpoint.save(sched, tmp_path / "before-step-4")
                memsched.checkpoint.load(sched, tmp_path / "before-step-4")
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            if i == 3:  # the save itself changed nothing
                assert sched.optimizer.early_updates.dropped == dropped
            if i == 4:
                assert sched.optimizer.early_updates.dropped == dropped + n_host(sched)
            with paused(sched):
                ref.step(b, gpt_loss, None)
                if i == 2:
                    after_3 = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
            sched.synchronize()
            assert_same(model, ref, f"step {i}")
        assert_state_same(sched, ref.opt, "with checkpoints")
    assert all(same(saved_params[n], after_3[n]) for n in after_3)

    resumed = tiny_gpt(seed=7)
    with memsched.attach(resumed, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                         **CPU) as sched:
        with sched.sim.paused():
            memsched.checkpoint.load(sched, tmp_path / "before-step-3")
        for b in batches[3:]:
            sched.backward(gpt_loss(resumed, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        assert sched.optimizer.early_updates.committed > 0
        sched.synchronize()
        assert_same(resumed, ref, "resumed")
        assert_state_same(sched, ref.opt, "resumed")


# ---- 4. optimizer.load_state_dict, add_param_group, OneCycleLR ------------------------------------------

def test_torch_state_dict_loaded_and_one_cycle_lr(slow_early_worker):
    """A torch.optim.AdamW state dict of an earlier step is loaded into both optimizers between steps and
    (another one) between backward and step; OneCycleLR moves lr and beta1 every step; add_param_group is
    refused and changes nothing."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(8)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward", **CPU) as sched:
        opt = sched.optimizer
        kw = dict(max_lr=LR, total_steps=len(batches), pct_start=0.3)
        sch = torch.optim.lr_scheduler.OneCycleLR(opt, **kw)
        with paused(sched):
            ref_sch = torch.optim.lr_scheduler.OneCycleLR(ref.opt, **kw)
        with pytest.raises(RuntimeError, match="cannot take new param groups"):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
        saved = {}
        for i, b in enumerate(batches):
            if i == 4:  # between steps: the state of step 1 (both optimizers)
                opt.load_state_dict(copy.deepcopy(saved[1]))
                with paused(sched):
                    ref.opt.load_state_dict(copy.deepcopy(saved[1]))
            sched.backward(gpt_loss(model, b))
            if i == 6:  # between backward and step: the state of step 2
                opt.load_state_dict(copy.deepcopy(saved[2]))
            opt.step()
            opt.zero_grad()
            sch.step()

            def loss_fn(m, batch, i=i):
                if i == 6:
                    ref.opt.load_state_dict(copy.deepcopy(saved[2]))
                return gpt_loss(m, batch)

            with paused(sched):
                ref.step(b, loss_fn, None)
                ref_sch.step()
                saved[i] = copy.deepcopy(ref.opt.state_dict())
            assert opt.param_groups[0]["betas"] == ref.opt.param_groups[0]["betas"]
            sched.synchronize()
            assert_same(model, ref, f"step {i}")
        assert_state_same(sched, ref.opt, "one cycle, loaded state dicts")
        early = opt.early_updates
        assert early.committed == (7 - 1) * n_host(sched) and early.dropped == n_host(sched)


# ---- 5. hyper-parameters as tensors, weight decay changed ------------------------------------------------

def test_tensor_lr_and_weight_decay_changes(slow_early_worker):
    """lr is a 0-d tensor that an ExponentialLR updates in place (fill_), and once between backward and
    step; weight_decay changes between steps and once between backward and step."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(7)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward", **CPU) as sched:
        opt = sched.optimizer
        for o in (opt, ref.opt):
            o.param_groups[0]["lr"] = torch.tensor(LR)
        sch = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)
        with paused(sched):
            ref_sch = torch.optim.lr_scheduler.ExponentialLR(ref.opt, gamma=0.7)
        lr_tensor = opt.param_groups[0]["lr"]

        def change(i, o):
            if i == 2:
                o.param_groups[0]["weight_decay"] = 0.3
            if i == 4:  # in place: the group holds the same tensor
                o.param_groups[0]["lr"].fill_(3e-3)
            if i == 5:
                o.param_groups[0]["weight_decay"] = 0.0

        for i, b in enumerate(batches):
            if i == 3:  # between steps
                for o in (opt, ref.opt):
                    o.param_groups[0]["weight_decay"] = 0.05
            sched.backward(gpt_loss(model, b))
            if i in (4, 5):  # the updates made during backward are done: the change comes after them
                opt.early_updates.wait()
            change(i, opt)
            opt.step()
            opt.zero_grad()
            sch.step()

            def loss_fn(m, batch, i=i):
                loss = gpt_loss(m, batch)
                change(i, ref.opt)
                return loss

            with paused(sched):
                ref.step(b, loss_fn, None)
                ref_sch.step()
            sched.synchronize()
            assert_same(model, ref, f"step {i}")
        assert opt.param_groups[0]["lr"] is lr_tensor and isinstance(lr_tensor, torch.Tensor)
        assert_state_same(sched, ref.opt, "tensor lr")
        early = opt.early_updates
        # steady steps 1..6; changes between backward and step in 2, 4 and 5 drop every host chunk's update
        assert early.dropped == 3 * n_host(sched) and early.committed == 3 * n_host(sched)


# ---- 6. bf16, fp16 with an overflow injected after backward ----------------------------------------------

def test_bf16_with_accumulation(slow_early_worker):
    model = tiny_gpt()
    ref = Reference(model, torch.bfloat16)
    batches = gpt_batches(8)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                         dtype=torch.bfloat16, **CPU) as sched:
        for i in range(4):
            micro = batches[2 * i:2 * i + 2]
            for b in micro:
                sched.backward(gpt_loss(model, b) / 2)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                ref.step(None, accumulated(ref, micro), None)
            sched.synchronize()
            assert_same(model, ref, f"bf16 step {i}", optimizer=sched.optimizer)
        assert sched.optimizer.early_updates.committed == 3 * n_host(sched)


def test_fp16_inf_injected_after_backward_skips_and_commits_nothing(slow_early_worker):
    """An inf written into a host chunk's gradient after backward (after the update made during backward
    read the gradients): the step is skipped on both sides, nothing is committed in it, and the next steps
    (with the backed-off scale) commit again."""
    model = tiny_gpt()
    ref = Reference(model, torch.float16)
    batches = gpt_batches(6)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                         dtype=torch.float16, **CPU) as sched:
        early = sched.optimizer.early_updates
        for i, b in enumerate(batches):
            sched.backward(gpt_loss(model, b))
            if i == 3:
                early.wait()
                committed = early.committed
                with torch.no_grad():
                    model.blocks[0].linear1.weight.grad[0, 0] = float("inf")
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            if i == 3:
                assert early.committed == committed and not early.tickets
                assert sched.scaler.skipped_steps == 1

            def loss_fn(m, batch, i=i):
                loss = gpt_loss(m, batch)
                (loss.float() * ref.scale).backward()
                if i == 3:
                    with torch.no_grad():
                        m.blocks[0].linear1.weight.grad[0, 0] = float("inf")
                return torch.zeros((), requires_grad=True)

            with paused(sched):
                ref.step(b, loss_fn, None)
            sched.synchronize()
            assert_same(model, ref, f"fp16 step {i}", optimizer=sched.optimizer)
        assert ref.skipped == 1
        # steady steps 1..5 but 3 (skipped) commit (the warmup step's overflow check set the inverse scale
        # the first steady backward uses)
        assert early.committed == 4 * n_host(sched) and early.dropped == n_host(sched)


# ---- 7. exceptions between backward and step -------------------------------------------------------------

def test_exception_between_backward_and_step_then_training_goes_on(slow_early_worker):
    """The user's code raises after backward: (a) the batch is abandoned (zero_grad, next batch); (b) the step
    is made anyway after the exception was handled; (c) step() itself raises (a negative lr), the lr is
    fixed and step() is called again; (d) the update made during backward raises on the worker. Every run
    equals the reference, and no worker thread is left after close()."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(9)
    fail_worker = {"on": False}
    original = HybridAdamW._adamw_all

    def maybe_fail(self, *args, **kwargs):
        if fail_worker["on"]:
            raise RuntimeError("injected failure in the update during backward")
        return original(self, *args, **kwargs)

    HybridAdamW._adamw_all = maybe_fail
    try:
        sched = memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward", **CPU)
        with sched:
            opt = sched.optimizer
            for i, b in enumerate(batches):
                fail_worker["on"] = i == 7
                sched.backward(gpt_loss(model, b))
                if i in (2, 4):
                    with pytest.raises(KeyError):
                        {}["logging failed"]  # the user's code between backward and step
                    if i == 2:  # (a) abandon the batch
                        opt.zero_grad()
                        continue
                if i == 5:  # (c)
                    opt.param_groups[0]["lr"] = -1.0
                    with pytest.raises(ValueError, match="lr must be"):
                        opt.step()
                    opt.param_groups[0]["lr"] = LR
                opt.step()
                opt.zero_grad()
                with paused(sched):
                    ref.step(b, gpt_loss, None)
                sched.synchronize()
                assert_same(model, ref, f"step {i}")
            assert_state_same(sched, ref.opt, "after exceptions")
            early = opt.early_updates
            # steady steps made: 1, 3, 4, 5, 6, 7, 8. Step 2's updates (abandoned batch) are replaced by step
            # 3's; step 5's survive the step() that raised and commit at the next; step 7's failed on the
            # worker and are dropped
            assert early.committed == 6 * n_host(sched) and early.dropped == n_host(sched)
    finally:
        HybridAdamW._adamw_all = original
    assert no_worker_left()


# ---- 8. reads between backward and step ------------------------------------------------------------------

def test_reads_between_backward_and_step_see_the_values_before_the_step(slow_early_worker):
    """sched.synchronize(), model.state_dict(), direct parameter reads and optimizer.state_dict() between
    backward and step: the values before the step, while the updates during backward are in flight."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(5)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward", **CPU) as sched:
        for i, b in enumerate(batches):
            sched.backward(gpt_loss(model, b))
            if i > 0:
                assert sched.optimizer.early_updates.tickets
                sched.synchronize()
                assert_same(model, ref, f"synchronize() before step {i}")
                state = model.state_dict()
                with paused(sched):
                    for name, q in ref.model.state_dict().items():
                        assert same(state[name], q), f"model.state_dict() before step {i}: {name}"
                assert_state_same(sched, ref.opt, f"optimizer.state_dict() before step {i}")
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                ref.step(b, gpt_loss, None)
            sched.synchronize()
            assert_same(model, ref, f"step {i}")
        assert sched.optimizer.early_updates.committed == 4 * n_host(sched)


# ---- more: step(closure) ---------------------------------------------------------------------------------

def test_step_with_closure(slow_early_worker):
    """The backward runs inside optimizer.step(closure): its updates made during backward commit in that
    step."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(4)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward", **CPU) as sched:
        for i, b in enumerate(batches):
            def closure(b=b):
                sched.optimizer.zero_grad()
                loss = gpt_loss(model, b)
                sched.backward(loss)
                return loss

            sched.optimizer.step(closure)
            with paused(sched):
                ref.step(b, gpt_loss, None)
            sched.synchronize()
            assert_same(model, ref, f"step {i}")
        assert sched.optimizer.early_updates.committed == 3 * n_host(sched)


# ---- more: close() between backward and step, then step -------------------------------------------------

def test_close_between_backward_and_step_then_step(slow_early_worker):
    """close() between backward and step, then the step (the optimizer keeps working after close()): the
    updates made during that backward are the step's and commit; the result is the reference's, and no
    worker thread is left."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(3)
    sched = memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward", **CPU)
    for i, b in enumerate(batches):
        sched.backward(gpt_loss(model, b))
        if i == 2:
            sched.close()
            assert no_worker_left()
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        with paused(sched):
            ref.step(b, gpt_loss, None)
    assert_same(model, ref, "step after close()")
    assert sched.optimizer.early_updates.committed == 2 * n_host(sched)
    assert no_worker_left()


# ---- more: the early D2H path (CUDA), emulated on the stand-in -------------------------------------------

def test_early_copy_without_a_new_update_drops_the_older_one(slow_early_worker):
    """On CUDA a host chunk's gradients are copied (and fingerprinted) at every backward that completes it,
    and the commit trusts the fingerprint. If a later backward copies them again without starting a new
    update (here: an invalid lr at that moment), the older update (of the first micro-batch's gradients)
    must not commit even though the fingerprint matches the last copy: the copy into the state's host buffer
    moves its version counter. The CUDA path is forced on the stand-in (``early_d2h``: synchronous copies)."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(6)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward", **CPU) as sched:
        opt = sched.optimizer
        for i in range(3):
            micro = batches[2 * i:2 * i + 2]
            opt.early_d2h = i > 0  # after warmup, as the scheduler sets it on CUDA
            sched.backward(gpt_loss(model, micro[0]) / 2)
            if i == 2:
                opt.early_updates.wait()  # the update of the first micro-batch's gradients is made
                opt.param_groups[0]["lr"] = -1.0
            sched.backward(gpt_loss(model, micro[1]) / 2)
            if i == 2:
                with pytest.raises(ValueError, match="lr must be"):
                    opt.step()
                opt.param_groups[0]["lr"] = LR
            opt.step()
            opt.zero_grad()
            with paused(sched):
                ref.step(None, accumulated(ref, micro), None)
            sched.synchronize()
            assert_same(model, ref, f"step {i}")
        early = opt.early_updates
        assert early.committed == n_host(sched) and early.dropped == n_host(sched)
