"""overlap="backward": host chunks are updated during backward into spare state and committed at the step
only when that equals the step's own update (memsched.optim.early_update): bit for bit
torch.optim.AdamW(fused=True) whatever happens between backward and step, and the committed updates really
were made during backward.

The worker is slowed down (a sleep before each update during backward and each update at the step) so that
a missing wait shows as a wrong number.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import memsched
from memsched.chunks import Chunk
from policies.types import HOST
from tests._numerics import LR, WD, Reference, assert_same, gpt_batches, gpt_loss, same, tiny_gpt
from tests.test_overlap import CLIP, PLACEMENTS, GroupedReference, grouped_parity_run, paused, two_groups

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CASES = [(p, d, None) for p in ("auto", "cpu", "static") for d in DTYPES]
CASES += [("static", d, CLIP) for d in DTYPES]


@pytest.mark.parametrize(("placement", "dtype", "clip"), CASES)
def test_update_during_backward_is_bit_exact(placement, dtype, clip, slow_early_worker):
    """Two param groups, a StepLR, 2-step gradient accumulation, fp32/bf16/fp16, with and without clipping
    through sched.clip_grad_norm_: every parameter (and fp32 master) equals the reference after each step;
    without clipping the updates made during backward are the ones committed, with clipping none is."""
    model = tiny_gpt()
    ref = GroupedReference(model, dtype)
    batches = gpt_batches(10)
    with memsched.attach(model, lr=LR, weight_decay=WD, dtype=dtype, chunk_numel=8192,
                         params=two_groups(model), overlap="backward", **PLACEMENTS[placement]) as sched:
        grouped_parity_run(model, sched, ref, batches, clip, f"{placement} {dtype}")
        early = sched.optimizer.early_updates
        n_host = sum(c.placement == HOST for c in sched.store.chunks)
    assert_same(model, ref, f"{placement} {dtype} after close()")
    assert n_host > 0
    # 4 steady steps x 2 backwards x host chunks were started; the last of each step is committed unless the
    # gradients it read are not the step's: fp16 clipping leaves a coefficient pending (always dropped);
    # fp32/bf16 clipping scales them in place, which the update sees if the worker copied them after it.
    assert slow_early_worker["early"] == 4 * 2 * n_host
    assert early.committed + early.dropped == 4 * n_host
    if clip is None:
        assert early.committed == 4 * n_host
    elif dtype == torch.float16:
        assert early.dropped == 4 * n_host


def _train(model, sched, ref, batches, between=None, ref_between=None):
    """Plain steps; ``between(i)`` runs after backward and before step() (``ref_between``: the reference)."""
    for i, b in enumerate(batches):
        sched.backward(gpt_loss(model, b))
        if between is not None and i > 0:
            between(i)
        sched.optimizer.step()
        sched.optimizer.zero_grad()

        def loss_fn(m, batch, i=i):
            loss = gpt_loss(m, batch)
            if ref_between is None or i == 0:
                return loss
            loss.backward()
            ref_between(i)
            return torch.zeros((), requires_grad=True)

        with paused(sched):
            ref.step(b, loss_fn, None)


@pytest.mark.parametrize("what", ["grad-mul", "param-write", "lr-change", "zero-grad-and-again"])
def test_changes_between_backward_and_step_are_followed(what, slow_early_worker):
    """Whatever changes the update after the gradients were complete drops the update made during backward;
    the step makes the right one."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(4)
    sched = memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                            **PLACEMENTS["cpu"])

    def between(i, m=model, opt=None, again=True):
        if opt is None:  # the worker has copied the gradients and updated: the change comes after that
            sched.optimizer.early_updates.wait()
        opt = opt or sched.optimizer
        if what == "grad-mul":
            for p in m.parameters():
                p.grad.data.mul_(0.5)
        elif what == "param-write":
            with torch.no_grad():
                next(m.parameters()).add_(1e-3)
        elif what == "lr-change":
            for g in opt.param_groups:
                g["lr"] = LR * 2
        elif what == "zero-grad-and-again":
            opt.zero_grad()
            if again:
                sched.backward(gpt_loss(m, batches[i]))

    def ref_between(i):
        if what == "zero-grad-and-again":  # the same gradients again: that backward happens in loss_fn too
            return
        between(i, ref.model, ref.opt, again=False)

    with sched:
        _train(model, sched, ref, batches, between, ref_between)
        early = sched.optimizer.early_updates
    assert_same(model, ref, what)
    n_host = sum(c.placement == HOST for c in sched.store.chunks)
    if what == "param-write":  # only the written parameter's chunk is updated again at the step
        assert early.dropped == 3 and early.committed == 3 * (n_host - 1)
    elif what == "zero-grad-and-again":  # the second backward's updates are the step's: committed
        assert early.dropped == 0 and early.committed == 3 * n_host
    elif what == "lr-change":  # the lr stays changed: only the first change comes after the updates
        assert early.dropped == n_host and early.committed == 2 * n_host
    else:
        assert early.dropped == 3 * n_host and early.committed == 0


def test_reads_between_backward_and_step_see_the_state_before_the_step(slow_early_worker):
    """optimizer.state_dict() and load_state_dict() between backward and step: the state read is the one
    before the step, and a state loaded there is the one the step continues from."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(4)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                         **PLACEMENTS["cpu"]) as sched:
        _train(model, sched, ref, batches[:2])
        sched.backward(gpt_loss(model, batches[2]))
        time.sleep(0.05)  # the updates during backward are done (or nearly)
        sd = sched.optimizer.state_dict()
        with paused(sched):
            for i, m in enumerate(ref.opt.param_groups[0]["params"]):
                assert same(sd["state"][i]["exp_avg"], ref.opt.state[m]["exp_avg"]), i
        sched.optimizer.load_state_dict(sd)  # writes every chunk's state: nothing made before may commit
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        with paused(sched):
            ref.step(batches[2], gpt_loss, None)
        early = sched.optimizer.early_updates
        assert early.committed_bytes > 0  # from the two earlier steps
        dropped = early.dropped
    assert dropped == sum(c.placement == HOST for c in sched.store.chunks)
    assert_same(model, ref, "load_state_dict between backward and step")


def test_spare_state_that_cannot_be_allocated_warns_and_stays_exact(monkeypatch):
    def refuse(self, alloc):
        raise RuntimeError("injected: out of pinned memory")

    monkeypatch.setattr(Chunk, "alloc_spare", refuse)
    model = tiny_gpt()
    ref = Reference(model)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                         **PLACEMENTS["cpu"]) as sched:
        with pytest.warns(RuntimeWarning, match="could not allocate the spare host state of chunk"):
            _train(model, sched, ref, gpt_batches(3))
        assert not sched.optimizer.early_updates.enabled
    assert_same(model, ref, "without spare state")


def test_spare_state_follows_the_placement():
    """Spare state exists for host chunks only, and goes when a chunk moves to the device."""
    model = tiny_gpt()
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                         **PLACEMENTS["static"]) as sched:
        for b in gpt_batches(3):
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        sched.synchronize()
        names = {s.name for r in sched.step_timeline.records for s in r.spans if s.track == "cpu update"}
        # the step timeline shows them; the spare takes the state after the step (a refill), not in backward
        assert {"gradients in backward", "update in backward", "refill spare", "h2d"} <= names
        assert "copy in backward" not in names
        host = [c for c in sched.store.chunks if c.placement == HOST]
        assert host and all(c.spare_nbytes() == c.state_nbytes() for c in host)
        assert all(c.spare is None for c in sched.store.chunks if c.placement != HOST)
        c = host[0]
        c.move_to("device", sched.store.alloc)
        assert c.spare is None


def test_state_moved_between_backward_and_step_is_not_committed(slow_early_worker):
    """A chunk whose state moved (device and back: a new allocation, no spare) after its update in backward
    is updated at the step instead: nothing is swapped in from the old allocation."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(3)

    def move_and_back(i):
        sched.optimizer.early_updates.wait()
        c = next(c for c in sched.store.chunks if c.placement == HOST)
        sched.store.place(c, "device")  # with its gradients and its parameters' binding
        sched.store.place(c, HOST)
        assert c.spare is None

    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                         **PLACEMENTS["cpu"]) as sched:
        _train(model, sched, ref, batches, move_and_back)
        early = sched.optimizer.early_updates
        n_host = sum(c.placement == HOST for c in sched.store.chunks)
    assert_same(model, ref, "state moved between backward and step")
    assert early.dropped == 2 and early.committed == 2 * (n_host - 1)


def test_close_with_updates_made_during_backward_and_no_step(slow_early_worker):
    """Backward, then close() without a step: the worker finishes, nothing is committed, no thread is left,
    and the parameters are those of the last step."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(3)
    sched = memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                            **PLACEMENTS["cpu"])
    _train(model, sched, ref, batches[:2])
    early = sched.optimizer.early_updates
    committed = early.committed
    sched.backward(gpt_loss(model, batches[2]))
    assert early.tickets
    sched.close()
    assert early.committed == committed  # nothing swapped in without a step
    assert not [t for t in threading.enumerate() if t.name.startswith("memsched-host-update")]
    assert_same(model, ref, "close() after backward, before step")


def test_gradients_are_compared_by_their_bits(slow_early_worker):
    """A gradient element that changed from +0.0 to -0.0 after the update read it is a change (the values
    compare equal, the bits do not, and AdamW can round the two differently): the update is made again."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(2)
    sched = memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                            **PLACEMENTS["cpu"])
    host = [c for c in sched.store.chunks]  # every chunk is on the host under "cpu"
    _train(model, sched, ref, batches[:1])
    p = host[0].params[0]
    sched.backward(gpt_loss(model, batches[1]))
    with torch.no_grad():
        p.grad.view(-1)[0] = 0.0  # before the worker copies it (it starts 10 ms late)
    sched.optimizer.early_updates.wait()
    with torch.no_grad():
        p.grad.view(-1)[0] = -0.0
    sched.optimizer.step()
    early = sched.optimizer.early_updates
    assert early.dropped == 1 and early.committed == len(host) - 1
    sched.close()


def test_the_spare_state_is_planned_and_counted():
    """[Note: the spare state is planned]: with ``overlap="backward"`` the plan's host bytes include each host
    chunk's spare host state, so the pinned bytes ``sched.host_usage()`` reports held equal those planned, and
    the plan's reasons say how much of them is spare."""
    model = tiny_gpt()
    # policy cpu: every chunk's state on the host from warmup on (with device chunks, the warmup's host state
    # of the chunks the plan moves to the device stays pinned: docs/limitations.md, host memory)
    with memsched.attach(model, lr=LR, weight_decay=WD, overlap="backward", chunk_numel=8192,
                         **PLACEMENTS["cpu"]) as sched:
        for b in gpt_batches(3):
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        host = [c for c in sched.store.chunks if c.placement == HOST]
        assert host and all(c.spare is not None for c in host)
        spare = sum(c.spare_nbytes() for c in host)
        usage = sched.host_usage()
        assert usage.pinned_bytes == usage.planned_pinned_bytes == sched.plan.host_bytes
        assert spare > 0 and sched.plan.host_bytes >= 2 * spare - 4096 * len(host)  # state + spare, in pages
        assert any("spare host state" in r for r in sched.plan.reasons)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_speculation_over_a_modelled_link_is_validated_or_redone(dtype):
    """On the stand-in with a modelled host link (``link=25GBps``: the gradients reach the host on the link's
    copy thread), host chunks' updates start and finish while backward is still running (a hook on the first
    layer, whose gradients come last, holds backward until one has), and each step is bit for bit fused
    AdamW's: a clip that triggers in some steps and not in others, and under fp16 an overflow step, drop the
    speculative updates they invalidate, which the step then redoes; the others are committed."""
    model = tiny_gpt()
    ref = Reference(model, dtype)
    batches = gpt_batches(7)
    clips = [None, None, 1e-3, 1e6, None, 1e-3, None]  # 1e-3 triggers, 1e6 does not
    inf_step = 4 if dtype == torch.float16 else None
    during: list[bool] = []
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward", dtype=dtype,
                         policy="cpu", device="sim:64MiB,link=25GBps") as sched:
        early = sched.optimizer.early_updates

        def hold_backward(grad):  # the first layer's weight gradient: the last chunk's gradients are done
            if early.tickets:
                deadline = time.monotonic() + 30
                while not any(t.future is not None and t.future.done() for t in early.tickets.values()):
                    assert time.monotonic() < deadline, "no update finished during backward"
                    time.sleep(0.001)
                during.append(True)
            return grad

        model.blocks[0].linear1.weight.register_hook(hold_backward)
        for i, (b, clip) in enumerate(zip(batches, clips, strict=True)):
            sched.backward(gpt_loss(model, b))
            if i == inf_step:
                early.wait()
                with torch.no_grad():
                    model.blocks[-1].linear2.weight.grad[0, 0] = float("inf")
            if clip is not None:
                norm = float(sched.clip_grad_norm_(clip))
                assert (norm > clip) == (clip < 1)
            sched.optimizer.step()
            sched.optimizer.zero_grad()

            def loss_fn(m, batch, i=i):
                loss = gpt_loss(m, batch)
                (loss.float() * ref.scale if ref.scale is not None else loss).backward()
                if i == inf_step:
                    with torch.no_grad():
                        m.blocks[-1].linear2.weight.grad[0, 0] = float("inf")
                return torch.zeros((), requires_grad=True)

            with paused(sched):
                ref.step(b, loss_fn, clip)
            sched.synchronize()
            assert_same(model, ref, f"{dtype} step {i}", optimizer=sched.optimizer)
        records = list(sched.step_timeline.records)
    assert len(during) == len(batches) - 1  # every steady backward
    assert early.committed > 0 and early.dropped > 0  # validated, and undone then redone at the step
    if dtype == torch.float16:
        assert sched.scaler.skipped_steps == 1 and ref.skipped == 1
    # the step timeline shows updates that ended inside the backward phase of their step
    inside = [s for r in records for s in r.spans if s.name == "update in backward" and any(
        p.name == "backward" and p.start_s <= s.start_s and s.end_s <= p.end_s for p in r.spans)]
    assert inside


def test_host_memory_limits_which_chunks_speculate_and_the_rest_wait_for_the_step():
    """With less host memory than every host chunk's spare state needs, the plan lets only the chunks whose
    gradients come first in backward speculate (policies.speculation); only they hold a spare state, the
    pinned bytes held equal the plan's, the other host chunks are updated at the step, and training is
    exact."""
    def run(host_memory=None):
        model = tiny_gpt()
        ref = Reference(model)
        with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                             host_memory=host_memory, **PLACEMENTS["cpu"]) as sched:
            _train(model, sched, ref, gpt_batches(4))
            usage = sched.host_usage()
            assert usage.pinned_bytes == usage.planned_pinned_bytes == sched.plan.host_bytes
            spares = {c.index: c.spare_nbytes() for c in sched.store.chunks if c.spare is not None}
            plan, problem, committed = sched.plan, sched.problem, sched.optimizer.early_updates.committed
        assert_same(model, ref, f"host_memory={host_memory}")
        return plan, problem, spares, committed

    plan, problem, spares, committed = run()
    n = len(plan.host_chunks)
    assert n >= 4 and plan.speculative == tuple(plan.host_chunks) and set(spares) == set(plan.host_chunks)
    assert committed == 3 * n
    spare = {i: problem.chunks[i].host_bytes for i in plan.speculative}
    base = plan.host_bytes - sum(spare.values())
    last = sorted(spare)[-2:]  # the last-used two: their gradients come first in backward
    limited, _, spares, committed = run(
        host_memory=base + sum(spare[i] for i in last) + min(spare.values()) // 2)
    assert limited.speculative == tuple(last) and set(spares) == set(last)
    assert limited.host_bytes == base + sum(spare[i] for i in last)
    assert any("2 of the" in r and "would not fit" in r for r in limited.reasons)
    assert committed == 3 * 2  # the others were updated at the step


def test_a_replan_to_the_device_frees_the_speculating_chunks_host_state():
    """A re-plan that moves every speculating chunk to the device frees their host state: nothing memsched
    keeps for the speculation (a refill of the spare) holds it, so the pinned bytes held stay the plan's."""
    import gc

    import policies

    model = tiny_gpt()
    ref = Reference(model)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                         **PLACEMENTS["cpu"]) as sched:
        for i, b in enumerate(gpt_batches(6)):
            if i == 3:
                assert sched.plan.speculative
                sched.planner.policy = policies.get("static", offload_optim_frac=0.0)
                sched._replan(sched.problem.peak_non_model_bytes, "test: every chunk to the device")
                assert set(sched.plan.placement) == {"device"} and not sched.plan.speculative
                gc.collect()
                usage = sched.host_usage()
                assert not sched.optimizer.early_updates.refills
                assert usage.pinned_bytes <= usage.planned_pinned_bytes + 4096, usage
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                ref.step(b, gpt_loss, None)
    assert_same(model, ref, "re-planned to the device")


def test_a_refill_after_an_update_at_the_step_is_used():
    """After a step whose speculative updates were dropped (the gradients scaled after backward), the chunks
    are updated at the step and their spares refilled after that update: the next backward's speculation
    uses the refill and copies no state during backward."""
    model = tiny_gpt()
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap="backward",
                         **PLACEMENTS["cpu"]) as sched:
        early = sched.optimizer.early_updates
        for i, b in enumerate(gpt_batches(5)):
            sched.backward(gpt_loss(model, b))
            if i == 2:
                early.wait()
                with torch.no_grad():
                    for p in model.parameters():
                        p.grad.mul_(0.5)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            if i == 2:
                sched.synchronize()
                # synchronize() waited for the refills too
                assert early.dropped > 0 and all(r.ok for r in early.refills.values()), early.refills
        sched.synchronize()
        names = {s.name for r in sched.step_timeline.records for s in r.spans if s.track == "cpu update"}
    assert "refill spare" in names and "copy in backward" not in names
