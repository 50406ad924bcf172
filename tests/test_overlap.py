"""overlap=True: host chunks are updated on a worker thread during the next forward, bit for bit as the serial
step (torch.optim.AdamW(fused=True)), and everything that reads or writes parameters waits for it.

The worker is slowed down (a sleep before each chunk's update) so that a missing wait shows as a wrong number.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import pytest
import torch

import memsched
from memsched.optim.host_updates import OverlapError
from memsched.optim.hybrid_adamw import HybridAdamW
from policies.types import HOST
from tests._numerics import (
    LR,
    SIM,
    WD,
    Reference,
    assert_same,
    gpt_batches,
    gpt_loss,
    same,
    tiny_gpt,
    uncounted,
)

CLIP = 0.05
PLACEMENTS = {
    "cpu": dict(policy="cpu", device="sim:64MiB"),
    "cuda": dict(policy="cuda", device="sim:64MiB"),
    "static": dict(policy="static", device="sim:64MiB", policy_options={"offload_optim_frac": 0.5}),
    "auto": dict(policy="auto", device="sim:800KiB"),  # 2 of 5 chunks on the device
}


@pytest.fixture
def slow_worker(monkeypatch):
    """Every host-chunk update on a thread other than the training thread starts 20 ms late."""
    original = HybridAdamW._update_host
    main = threading.get_ident()
    calls = {"worker": 0}

    def slowed(self, *args, **kwargs):
        if threading.get_ident() != main:
            calls["worker"] += 1
            time.sleep(0.02)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(HybridAdamW, "_update_host", slowed)
    return calls


def plain_steps(sched, model, batches) -> None:
    for b in batches:
        sched.backward(gpt_loss(model, b))
        sched.optimizer.step()
        sched.optimizer.zero_grad()


def paused(sched):
    return sched.sim.paused() if sched.sim is not None else contextlib.nullcontext()


def two_groups(model):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": LR * 3}]


class GroupedReference(Reference):
    """The reference with the same two param groups and a StepLR on both."""

    def __init__(self, model, dtype):
        super().__init__(model, dtype)
        groups = two_groups(self.model)
        if dtype != torch.float32:  # the masters stand for the parameters, in the model's order
            by_id = {id(p): m for p, m in zip(self.model.parameters(), self.masters, strict=True)}
            groups = [{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in groups]
        self.opt = torch.optim.AdamW(groups, lr=LR, weight_decay=WD, fused=True)
        self.lr_sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_overlap_bit_exact(placement, dtype, slow_worker):
    """Two param groups, a StepLR, clipping through sched.clip_grad_norm_, gradient accumulation (2 micro
    batches), fp32/bf16/fp16; model.state_dict() right after step() holds the updated values."""
    model = tiny_gpt()
    ref = GroupedReference(model, dtype)
    kw = dict(PLACEMENTS[placement])
    batches = gpt_batches(10)
    with memsched.attach(model, lr=LR, weight_decay=WD, warmup_steps=1, dtype=dtype, chunk_numel=8192,
                         params=two_groups(model), overlap=True, **kw) as sched:
        grouped_parity_run(model, sched, ref, batches, CLIP, f"{placement} {dtype}")
        places = {c.placement for c in sched.store.chunks}
    assert_same(model, ref, f"{placement} {dtype} after close()")  # close() waited for the last update
    if HOST in places and placement != "cuda":
        assert slow_worker["worker"] > 0  # the worker really ran the host updates


def grouped_parity_run(model, sched, ref, batches, clip, what: str) -> None:
    """Five steps of 2 micro batches with a StepLR (and clipping through sched.clip_grad_norm_ unless ``clip``
    is None, which then must trigger), against ``ref`` (a GroupedReference); after steps 1 and 3
    model.state_dict(), the parameters and the fp32 masters equal the reference's. After the other steps
    nothing is read, so the next forward must wait by itself."""
    dtype = ref.dtype
    lr_sched = torch.optim.lr_scheduler.StepLR(sched.optimizer, step_size=2, gamma=0.5)
    for i in range(5):
        micro = batches[2 * i:2 * i + 2]
        for b in micro:
            sched.backward(gpt_loss(model, b) / 2)
        if clip is not None:
            assert float(sched.clip_grad_norm_(clip)) > clip  # the clipping really scales the gradients
        sched.optimizer.step()
        lr_sched.step()
        sched.optimizer.zero_grad()
        with paused(sched):
            ref.step(None, accumulated(ref, micro), clip)
            ref.lr_sched.step()
        if i % 2 == 0:
            continue
        state = model.state_dict()  # waits for the overlapped update
        with paused(sched):
            for name, q in ref.model.state_dict().items():
                assert same(state[name], q), f"{what} step {i}: {name}"
            assert_same(model, ref, f"{what} step {i}")
            if dtype != torch.float32:  # the fp32 masters, in the groups' order
                sd = sched.optimizer.state_dict()["state"]
                masters = [m for g in ref.opt.param_groups for m in g["params"]]
                for k, m in enumerate(masters):
                    assert same(sd[k]["master_weight"], m), f"{what} master {k}, step {i}"


def accumulated(ref: Reference, micro):
    """A loss function for Reference.step that runs the backward of all micro batches but the last (each its
    own backward, as memsched's run does: one backward of the sum adds the gradients in another order)."""
    def loss_fn(model, _batch):
        for b in micro[:-1]:
            loss = gpt_loss(model, b) / len(micro)
            (loss.float() * ref.scale if ref.scale is not None else loss).backward()
        return gpt_loss(model, micro[-1]) / len(micro)
    return loss_fn


def test_forward_waits_for_its_chunks_and_records_the_wait(slow_worker):
    """The next forward reads the updated parameters: its outputs equal the reference's, and the step timeline
    names the module that waited for a chunk."""
    model = tiny_gpt()
    ref = Reference(model)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap=True,
                         **PLACEMENTS["cpu"]) as sched:
        for b in gpt_batches(4):
            loss = gpt_loss(model, b)
            with paused(sched):
                ref_loss = gpt_loss(ref.model, b)
            assert same(loss.detach(), ref_loss.detach())
            sched.backward(loss)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                ref.step(b, gpt_loss, None)
        waits = [s for r in sched.step_timeline.records for s in r.spans if s.track == "waits"]
    assert waits and any("<- chunk" in s.name for s in waits)


def test_reads_wait(slow_worker):
    """optimizer.state_dict(), sched.synchronize() and close() see the whole update."""
    model = tiny_gpt()
    ref = Reference(model)
    b = gpt_batches(2)
    sched = memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap=True,
                            **PLACEMENTS["cpu"])
    for batch in b:
        sched.backward(gpt_loss(model, batch))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        with paused(sched):
            ref.step(batch, gpt_loss, None)
    assert sched.optimizer.host_updates.pending
    sd = sched.optimizer.state_dict()
    with paused(sched):
        for i, m in enumerate(ref.opt.param_groups[0]["params"]):
            assert same(sd["state"][i]["exp_avg"], ref.opt.state[m]["exp_avg"])
    sched.backward(gpt_loss(model, b[0]))
    sched.optimizer.step()
    with paused(sched):
        ref.step(b[0], gpt_loss, None)
    sched.close()  # waits, then removes the worker
    assert_same(model, ref, "after close()")
    assert not [t for t in threading.enumerate() if t.name.startswith("memsched-host-update")]


def test_user_write_after_step_is_kept(slow_worker):
    """model.load_state_dict() right after an overlapped step waits for the update, so the loaded values win
    (the worker's H2D copy cannot overwrite them later)."""
    model = tiny_gpt()
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap=True,
                         **PLACEMENTS["cpu"]) as sched:
        plain_steps(sched, model, gpt_batches(2))
        with paused(sched):
            zeros = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(zeros)
        sched.synchronize()
        with paused(sched):
            assert all(torch.count_nonzero(p) == 0 for p in model.parameters())


def test_worker_failure_raises_at_the_next_wait(monkeypatch):
    model = tiny_gpt()
    sched = memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap=True,
                            **PLACEMENTS["cpu"])
    b = gpt_batches(1)[0]
    sched.backward(gpt_loss(model, b))
    sched.optimizer.step()  # warmup: serial
    sched.optimizer.zero_grad()

    def boom(*_a, **_k):
        raise RuntimeError("injected CPU update failure")

    monkeypatch.setattr(HybridAdamW, "_update_host", boom)
    sched.backward(gpt_loss(model, b))
    sched.optimizer.step()
    with pytest.raises(OverlapError, match="chunk 0 failed.*injected CPU update failure"):
        sched.synchronize()
    sched.close()


def test_step_timeline_phases_add_up_and_export():
    model = tiny_gpt()
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap=True,
                         **PLACEMENTS["static"]) as sched:
        plain_steps(sched, model, gpt_batches(5))
        tl = sched.step_timeline
        assert len(tl.records) == 4  # the warmup step is not recorded
        for r in tl.records:
            s = r.summary()
            assert sum(s["phases_s"].values()) == pytest.approx(s["step_s"], rel=1e-6)
            assert 0 < s["overlap_efficiency"] <= 1.0
        # Each step's worker spans land in the step in which they end: usually the next one (its forward),
        # on a loaded machine sometimes the step itself (the worker done before the next step begins). So the
        # worker's update and H2D are asserted over the steps, not per step (no wall-clock dependence).
        assert sum(r.summary()["cpu_update_s"] for r in tl.records) > 0
        worker = {sp.name for r in tl.records for sp in r.spans if sp.track == "cpu update"}
        assert worker >= {"update", "h2d"}
        events = tl.to_perfetto_events()
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"main", "cpu update"} <= names
    assert sum(1 for e in events if e["ph"] == "X" and e["name"].startswith("step ")) == 4


def test_a_span_that_reaches_the_timeline_after_its_step_closed_goes_to_that_step():
    # A worker descheduled between its clock read and span() (a loaded 2-core CI machine) must not hand its
    # span to the open step, where it overlaps nothing and reads as a step with no CPU update.
    from memsched.telemetry.step_timeline import CPU_UPDATE, StepTimeline

    tl = StepTimeline(overlap=True)
    tl.start()
    t0 = tl._start
    tl.step_begin()
    tl.step_end(2)
    t1 = tl.records[-1].end_s
    tl.step_begin()
    tl.step_end(3)
    t2 = tl.records[-1].end_s
    mid1, mid2 = (t0 + t1) / 2, (t1 + t2) / 2
    start1 = mid1 - 1e-9  # on the clock's scale (seconds since boot) 1e-9 is a few ulps: compare what it is
    tl.span(CPU_UPDATE, "update", start1, mid1)  # ended in step 2, arrives after step 3 closed
    tl.span(CPU_UPDATE, "update", mid1, mid2)  # ended in step 3, started in step 2
    tl.span(CPU_UPDATE, "update", t0 - 2.0, t0 - 1.0)  # ended before recording started: dropped
    first, second = tl.records
    assert [sp.end_s for sp in first.spans if sp.track == CPU_UPDATE] == [mid1]
    assert [sp.end_s for sp in second.spans if sp.track == CPU_UPDATE] == [mid2]
    assert first.summary()["cpu_update_s"] == pytest.approx(mid1 - start1, abs=1e-15) and 0 < mid1 - start1
    assert second.summary()["cpu_update_s"] == pytest.approx(mid2 - t1)
    assert tl._spans == []


def test_overlap_must_be_a_known_mode():
    with pytest.raises(ValueError, match="overlap must be False, True or 'backward', got 'yes'"):
        memsched.attach(tiny_gpt(), overlap="yes", device="sim:64MiB")


@pytest.mark.parametrize("threads", [1, 3, None])
def test_the_update_worker_runs_its_own_thread_count(threads):
    """[Note: the update worker's threads]: the worker updates with ``update_threads`` intra-op threads of its
    own (``None``: the default for the device), while the training thread and threads started later keep
    torch's count; training stays bit-exact against fused AdamW."""
    from memsched.optim.host_updates import default_update_threads

    before = torch.get_num_threads()
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(3)
    with memsched.attach(model, lr=LR, weight_decay=WD, overlap=True, update_threads=threads,
                         **PLACEMENTS["static"]) as sched:
        for b in batches:
            sched.backward(gpt_loss(model, b))
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                ref.step(b, gpt_loss, CLIP)
            sched.synchronize()
            with paused(sched):
                assert_same(model, ref)
        want = threads if threads is not None else default_update_threads(SIM, before)
        assert sched.optimizer.host_updates.worker_threads() == want
        assert torch.get_num_threads() == before
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [before]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_update_threads_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=f"update_threads must be an integer >= 1 or None, got {bad!r}"):
        memsched.attach(tiny_gpt(), overlap=True, update_threads=bad, device="sim:64MiB")


@pytest.mark.parametrize("write", [None, "clip", "data-mul", "accumulate"])
def test_host_gradients_leave_the_device_once_in_backward_and_writes_reach_the_update(write, monkeypatch):
    """Host chunks' gradients go D2H during backward, once per backward, and ``p.grad`` is then the host
    gradient itself: a write after it (torch's clipping, ``p.grad.data.mul_`` which moves no version counter,
    a second backward adding on the host) reaches the CPU update with nothing copied at the step: bit-exact,
    and the step copies nothing (with ``overlap=True`` the worker reads its own copy, made at the step)."""
    from memsched.chunks import Chunk

    copies = {"backward": 0, "step": 0}
    where = {"now": "backward"}
    original = Chunk.start_d2h

    def counted(self, *a, **k):
        copies[where["now"]] += 1
        return original(self, *a, **k)

    monkeypatch.setattr(Chunk, "start_d2h", counted)
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(8)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap=True,
                         **PLACEMENTS["cpu"]) as sched:
        for i in range(4):
            micro = batches[2 * i:2 * i + 2] if write == "accumulate" else [batches[i]]
            where["now"] = "backward"
            for b in micro:
                sched.backward(gpt_loss(model, b) / len(micro))
            host = [p for p in model.parameters() if sched.store.bindings.param_host_bound(p)]
            assert host and all(p.grad.data_ptr() == sched.store.host_view("grad", p).data_ptr()
                                for p in host)
            if write == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            elif write == "data-mul":
                for p in model.parameters():
                    p.grad.data.mul_(0.5)
            where["now"] = "step"
            sched.optimizer.step()
            sched.optimizer.zero_grad()

            def loss_fn(m, _b, micro=micro):
                for b in micro[:-1]:
                    (gpt_loss(m, b) / len(micro)).backward()
                if write == "data-mul":  # the halving happens after the last backward, as above
                    loss = gpt_loss(m, micro[-1]) / len(micro)
                    loss.backward()
                    for p in m.parameters():
                        p.grad.data.mul_(0.5)
                    return torch.zeros((), requires_grad=True)  # nothing more to add
                return gpt_loss(m, micro[-1]) / len(micro)

            with paused(sched):
                ref.step(None, loss_fn, CLIP if write == "clip" else None)
        n_host = sum(c.placement == HOST for c in sched.store.chunks)
        n_chunks = len(sched.store.chunks)
    assert_same(model, ref, f"write={write}")
    per_step = 2 if write == "accumulate" else 1
    # every chunk is on the host in the warmup step, then the plan's host chunks: once per backward each
    assert copies["backward"] == per_step * (n_chunks + 3 * n_host)
    assert copies["step"] == 0


def test_a_write_to_p_grad_after_an_overlapped_step_does_not_reach_the_update_in_flight(slow_worker):
    """With ``overlap=True`` ``step()`` returns before the host chunks are updated; ``p.grad`` (the host
    gradients) may be written right after (``model.zero_grad(set_to_none=False)``): the update in flight
    reads its own copy, made at the step, and equals torch's."""
    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(4)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap=True,
                         **PLACEMENTS["cpu"]) as sched:
        for b in batches:
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            model.zero_grad(set_to_none=False)  # the slowed worker has not updated anything yet
            with paused(sched):
                ref.step(b, gpt_loss, None)
        sched.synchronize()
        with paused(sched):
            assert_same(model, ref, "zeroed right after an overlapped step")
            assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


class _ParentReadsChild(torch.nn.Module):
    """The root reads ``proj.weight`` with a functional call, then calls ``proj``: the first read of the
    weight comes before ``proj``'s forward pre-hook (where the warmup trace puts its wait)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.inp(x)
        return self.proj(torch.nn.functional.linear(h, self.proj.weight))


def test_a_read_before_its_module_waits_at_the_read_and_the_guard_leaves(slow_worker):
    """The read guard (memsched.runtime.read_guard) waits for the chunk at the functional read (a span of the
    step timeline says so), results equal torch's, and no torch function mode is left after the forward, after
    a forward that raised, or after close()."""
    model = _ParentReadsChild()
    with uncounted():
        ref = copy.deepcopy(model).to(SIM)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)).to(SIM) for i in range(4)]
    stack = torch._C._len_torch_function_stack
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=300, overlap=True,
                         **PLACEMENTS["cpu"]) as sched:
        for x in xs:
            loss = model(x).square().mean()
            assert stack() == 0
            sched.backward(loss)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                ref_loss = ref(x).square().mean()
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                assert same(loss.detach(), ref_loss.detach())
        reads = [s.name for r in sched.step_timeline.records for s in r.spans if "(read)" in s.name]
        assert reads and all(name.startswith("linear (read) <- chunk") for name in reads)
        with pytest.raises(RuntimeError):
            model(torch.randn(4, 15, device=SIM))  # fails inside the forward, guard entered
        assert stack() == 0
        sched.synchronize()
        with paused(sched):
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                assert same(p, q)
    assert stack() == 0


@pytest.mark.parametrize("placement", ["cpu", "auto"])
def test_reads_right_after_an_overlapped_step_wait_without_synchronize(slow_worker, placement):
    """Issue 28, item 6: an EMA (``AveragedModel``) updated right after ``step()``, a logged norm and a clone
    read the updated parameters, with no ``sched.synchronize()``: each read waits for its chunk's update (a
    ``waits`` span says so). A step followed by code that reads no parameter keeps the overlap: the update
    is still running when ``zero_grad()`` returns."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = tiny_gpt()
    ref = Reference(model)
    with uncounted():
        ema_ref = AveragedModel(ref.model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema = None
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, overlap=True,
                         **PLACEMENTS[placement]) as sched:
        for step, b in enumerate(gpt_batches(4)):
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                ref.step(b, gpt_loss, None)
            if step == 0:  # warmup: serial; the EMA is made from the updated model
                with paused(sched):
                    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
                continue
            if step == 1:
                assert sched.optimizer.host_updates.pending  # nothing read: still overlapped
            with paused(sched):
                ema.update_parameters(model)
                ema_ref.update_parameters(ref.model)
                norm = torch.stack([p.detach().norm() for p in model.parameters()]).norm()
                ref_norm = torch.stack([p.detach().norm() for p in ref.model.parameters()]).norm()
                clones = [p.detach().clone() for p in model.parameters()]
            assert same(norm.cpu(), ref_norm.cpu()), f"step {step}"
            for c, r in zip(clones, ref.model.parameters(), strict=True):
                assert same(c.cpu(), r.detach().cpu()), f"step {step}"
        waits = [s.name for r in sched.step_timeline.records for s in r.spans if s.track == "waits"]
        assert any("(read between steps)" in w for w in waits), waits
    with paused(sched):
        for a, r in zip(ema.module.parameters(), ema_ref.module.parameters(), strict=True):
            assert same(a.detach().cpu(), r.detach().cpu())
    # nothing memsched installs outlives it: no torch function mode left on this thread's stack
    assert torch._C._len_torch_function_stack() == 0
