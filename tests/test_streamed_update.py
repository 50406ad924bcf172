"""host_update="device"/"auto": a host chunk's update on the device, its state streamed over the link in
pieces (memsched.optim.streamed_update), chosen per chunk by the plan (policies.update_paths): bit for bit
fused AdamW on the device that runs it, whatever the dtype, clipping, accumulation and overlap mode."""

from __future__ import annotations

import pytest
import torch

import memsched
from memsched.chunks import sizing
from memsched.optim.adam import KERNEL_ALIGN, fused_adamw_, kernel_spans
from policies import ChunkSpec, PlacementProblem, make_plan
from policies.types import DEVICE, HOST
from policies.update_paths import choose_update_paths, streaming_bytes
from tests._numerics import LR, WD, Reference, assert_same, gpt_batches, gpt_loss, same, tiny_gpt
from tests.test_overlap import CLIP, GroupedReference, grouped_parity_run, paused, two_groups

LINK = "sim:64MiB,link=25GBps"


def _train(model, sched, ref, steps: int) -> None:
    """``steps`` plain steps with memsched and with ``ref``."""
    for b in gpt_batches(steps):
        sched.backward(gpt_loss(model, b))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        with paused(sched):
            ref.step(b, gpt_loss, None)


@pytest.mark.parametrize("overlap", [False, True, "backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streamed_update_is_bit_exact(dtype, overlap, monkeypatch):
    """Two param groups, a StepLR, a clip that triggers, 2 micro-batches, over a modelled link; pieces of 256
    elements, so each chunk streams in several pieces through both buffer sets. model.state_dict() and the
    fp32 masters after steps 1 and 3 equal the reference's (the D2H copies of the state were waited for)."""
    monkeypatch.setattr(sizing, "STREAM_PIECE_NUMEL", 256)
    model = tiny_gpt()
    ref = GroupedReference(model, dtype)
    with memsched.attach(model, lr=LR, weight_decay=WD, dtype=dtype, chunk_numel=8192, policy="cpu",
                         device=LINK, params=two_groups(model), overlap=overlap,
                         host_update="device") as sched:
        grouped_parity_run(model, sched, ref, gpt_batches(10), CLIP, f"{dtype} overlap={overlap}")
        plan, updates = sched.plan, sched.optimizer.streamed.updates
    assert_same(model, ref, f"{dtype} overlap={overlap} after close()")
    assert plan.streamed == tuple(plan.host_chunks) and plan.speculative == ()
    assert updates == 4 * len(plan.streamed)  # the 4 steady steps, each chunk on the device
    assert any("updated on the device" in r for r in plan.reasons)


def test_auto_streams_over_a_fast_link_and_not_over_a_slow_one():
    """host_update="auto" weighs the CPU update rate measured in warmup against the link's bandwidth: over a
    25 GB/s link the tiny model's chunks stream, over a 4 MB/s one they stay on the CPU (each side by a factor
    of about 50 at the VM's rate, so a CPU slowed by load does not change the choice); both exact, and the
    plan says why."""
    for device, streams in (("sim:64MiB,link=25GBps", True), ("sim:64MiB,link=4MBps", False)):
        model = tiny_gpt()
        ref = Reference(model)
        with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, policy="cpu", device=device,
                             host_update="auto") as sched:
            _train(model, sched, ref, 4)
            plan = sched.plan
        assert_same(model, ref, device)
        assert bool(plan.streamed) == streams, (device, plan.reasons)
        assert any("/s per direction" in r for r in plan.reasons)


def test_parameters_on_the_host_keep_their_chunks_on_the_cpu():
    """A chunk whose parameters live on the host is not streamed (its parameters would have to come to the
    device first); the others are, and training stays exact."""
    model = tiny_gpt()
    ref = Reference(model)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, policy="static", device=LINK,
                         policy_options={"offload_optim_frac": 1.0, "offload_param_frac": 0.5},
                         host_update="device") as sched:
        _train(model, sched, ref, 4)
        plan = sched.plan
    assert_same(model, ref, "params offloaded")
    assert plan.param_host_chunks and plan.streamed
    assert not set(plan.streamed) & set(plan.param_host_chunks)


def test_the_plan_holds_the_streamed_updates_device_buffers():
    """The plan's ``staging_bytes`` are the device bytes the step's streamed updates allocate."""
    model = tiny_gpt()
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, policy="cpu", device=LINK,
                         host_update="device") as sched:
        sched.backward(gpt_loss(model, gpt_batches(1)[0]))
        sched.optimizer.step()
        plan, streamed = sched.plan, sched.optimizer.streamed
        streamed.prepare([sched.store.chunks[i] for i in plan.streamed])
        held = sum(t.numel() * t.element_size() for s in streamed._sets for t in s.values())
        streamed.release()
    assert plan.streamed and plan.staging_bytes == held > 0
    assert plan.to_dict()["staging_bytes"] == held


def test_bad_host_update_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"host_update must be one of \('cpu', 'device', 'auto'\), got "):
        memsched.attach(tiny_gpt(), device="sim:64MiB", host_update="gpu")


def test_pieces_compute_what_the_whole_computes():
    """The CPU kernel over pieces cut by kernel_spans equals one call over each whole parameter, bit for bit
    (a cut at another offset does not: the kernel's scalar tail rounds differently)."""
    torch.manual_seed(0)
    sizes = [1000, 37, 4099, 64, 513]
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n + 128 - (n % 128))  # aligned starts, padding between, as in a chunk
    total = starts[-1] + sizes[-1]
    state = [torch.randn(total), torch.randn(total), torch.randn(total), torch.rand(total)]  # p, g, m, v

    def run(spans):
        p, g, m, v = (t.clone() for t in state)
        steps = [torch.tensor(3.0) for _ in sizes]
        for lo, hi in spans:
            sel = [(k, max(s, lo), min(s + n, hi)) for k, (s, n) in enumerate(zip(starts, sizes, strict=True))
                   if max(s, lo) < min(s + n, hi)]
            fused_adamw_([p[a:b] for _, a, b in sel], [g[a:b] for _, a, b in sel],
                         [m[a:b] for _, a, b in sel], [v[a:b] for _, a, b in sel],
                         [steps[k] for k, _, _ in sel], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.01, increment_steps=False)
        return p, m, v

    assert sizing.STREAM_ALIGN == KERNEL_ALIGN  # a streamed piece is at least one aligned cut long
    whole = run([(0, total)])
    spans = kernel_spans(list(zip(starts, sizes, strict=True)), 256)
    assert len(spans) > 3 and spans[0][0] == 0 and spans[-1][1] == total
    assert all(torch.equal(a, b) for a, b in zip(whole, run(spans), strict=True))
    misaligned = [(0, 1000 - 5), (1000 - 5, total)]  # cuts the first parameter 5 elements before its end
    assert not all(torch.equal(a, b) for a, b in zip(whole, run(misaligned), strict=True))


def _plan(n: int = 4):
    p = PlacementProblem(2**34, 0, 0, tuple(ChunkSpec(i, 8 << 20, 10 << 20, numel=1 << 20) for i in range(n)))
    return p, make_plan(p, [DEVICE] + [HOST] * (n - 1), budget_bytes=0, policy="static")


def test_choice_balances_the_cpu_against_the_link():
    """Pure policy: the first-used host chunks stream while that lowers max(CPU time, link time)."""
    p, plan = _plan(5)
    link = [streaming_bytes(c.numel, 2, 2, grads_on_host=True, host_param_copy=False) for c in p.chunks]
    kw = dict(eligible=[1, 2, 3, 4], link_bytes=link, param_h2d_bytes=[2 << 20] * 5, staging_bytes=1 << 20)
    # CPU: 1 Mi elements in 10 ms; link: a chunk's 14 MiB H2D in 10 ms as well: two of four stream
    out = choose_update_paths(p, plan, mode="auto", cpu_elements_per_s=100 * 2**20,
                              link_bytes_per_s=14 * 2**20 * 100, **kw)
    assert out.streamed == (1, 2) and out.staging_bytes == 1 << 20
    assert "host_update='auto': 2 of the 4 host chunks" in out.reasons[-1]
    assert choose_update_paths(p, plan, mode="cpu", cpu_elements_per_s=1.0, link_bytes_per_s=1e12,
                               **kw).streamed == ()
    assert choose_update_paths(p, plan, mode="device", cpu_elements_per_s=None, link_bytes_per_s=None,
                               **kw).streamed == (1, 2, 3, 4)
    unknown = choose_update_paths(p, plan, mode="auto", cpu_elements_per_s=None, link_bytes_per_s=1e9, **kw)
    assert unknown.streamed == () and "unknown" in unknown.reasons[-1]
    big = choose_update_paths(p, plan, mode="device", cpu_elements_per_s=None, link_bytes_per_s=None,
                              **{**kw, "staging_bytes": 2**35})
    assert big.streamed == () and big.staging_bytes == 0 and "device memory at the step" in big.reasons[-1]
    with pytest.raises(ValueError, match="not on the host"):
        choose_update_paths(p, plan, mode="device", cpu_elements_per_s=None, link_bytes_per_s=None,
                            **{**kw, "eligible": [0]})


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameters_read_between_step_and_zero_grad_are_the_steps(dtype, overlap, monkeypatch):
    """Between ``step()`` and ``zero_grad()`` a host chunk's parameters are views of its host values: after a
    streamed update those are the step's (its D2H copies are done when ``step()`` returns, and under mixed
    precision the parameters' host copy follows), so ``model.state_dict()`` there equals the reference's."""
    monkeypatch.setattr(sizing, "STREAM_PIECE_NUMEL", 256)
    model = tiny_gpt()
    ref = Reference(model, dtype)
    with memsched.attach(model, lr=LR, weight_decay=WD, dtype=dtype, chunk_numel=8192, policy="cpu",
                         device=LINK, overlap=overlap, host_update="device") as sched:
        for i, b in enumerate(gpt_batches(5)):
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            with paused(sched):
                ref.step(b, gpt_loss, None)
            state = model.state_dict()
            with paused(sched):
                for name, q in ref.model.state_dict().items():
                    assert same(state[name], q), f"step {i}: {name}"
            sched.optimizer.zero_grad()
        assert sched.plan.streamed


@pytest.mark.parametrize("overlap", [False, True])
def test_a_streamed_chunk_whose_parameters_leave_the_device_comes_back_trained(overlap, monkeypatch):
    """bf16: after streamed updates, a chunk's parameters leave the device (as a re-plan that keeps them on
    the host does); their next fetch brings the trained values back, not the host copy of an older step."""
    monkeypatch.setattr(sizing, "STREAM_PIECE_NUMEL", 256)
    model = tiny_gpt()
    ref = Reference(model, torch.bfloat16)
    with memsched.attach(model, lr=LR, weight_decay=WD, dtype=torch.bfloat16, chunk_numel=8192,
                         policy="static", device=LINK,
                         policy_options={"offload_optim_frac": 1.0, "offload_param_frac": 0.01},
                         overlap=overlap, host_update="device") as sched:
        for i, b in enumerate(gpt_batches(6)):
            if i == 3:
                assert 1 in sched.plan.streamed and 0 in sched.plan.param_host_chunks
                sched.params.use(frozenset({0, 1}), None)  # what the re-plan's Planner._apply does
                sched.optimizer.streamed.chunks -= {0, 1}  # and _follow_speculation: kept on the host
                assert sched.store.chunks[1].data is None
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                ref.step(b, gpt_loss, None)
            sched.synchronize()
            assert_same(model, ref, f"step {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_gradients_zeroed_right_after_the_step_over_a_slow_link(dtype, monkeypatch):
    """Over a slow link (20 MB/s) the streamed update's copies of the host gradients are still queued when
    ``step()`` is called; ``model.zero_grad(set_to_none=False)`` right after it does not change what they
    read."""
    monkeypatch.setattr(sizing, "STREAM_PIECE_NUMEL", 256)
    model = tiny_gpt()
    ref = Reference(model, dtype)
    with memsched.attach(model, lr=LR, weight_decay=WD, dtype=dtype, chunk_numel=8192, policy="cpu",
                         device="sim:64MiB,link=20MBps", host_update="device") as sched:
        for b in gpt_batches(4):
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            model.zero_grad(set_to_none=False)
            sched.optimizer.zero_grad()
            with paused(sched):
                ref.step(b, gpt_loss, None)
        assert sched.plan.streamed
    assert_same(model, ref, "model.zero_grad(set_to_none=False) after the step")


def test_out_of_device_memory_for_the_streamed_buffers_leaves_everything_as_it_was(monkeypatch):
    """The streamed update's device buffers are allocated before the step's first in-place write: when the
    device cannot hold them (CUDA raises ``torch.OutOfMemoryError``), the step raises with every parameter
    and all optimizer state as before it, and the same step made again is the reference's."""
    from memsched.optim.streamed_update import StreamedUpdates

    model = tiny_gpt()
    ref = Reference(model)
    batches = gpt_batches(4)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=8192, policy="static", device=LINK,
                         policy_options={"offload_optim_frac": 0.5}, host_update="device") as sched:
        _train(model, sched, ref, 3)
        plan = sched.plan
        assert plan.streamed and plan.device_chunks  # device chunks would be written first
        sched.backward(gpt_loss(model, batches[3]))
        before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        state = sched.optimizer.state_dict()
        real = StreamedUpdates.prepare

        def no_room(self, chunks):
            if chunks:
                raise torch.OutOfMemoryError("test: no room for the streamed buffers")
            return real(self, chunks)

        monkeypatch.setattr(StreamedUpdates, "prepare", no_room)
        with pytest.raises(torch.OutOfMemoryError, match="no room"):
            sched.optimizer.step()
        monkeypatch.setattr(StreamedUpdates, "prepare", real)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k].detach().cpu()) for k in before)
        again = sched.optimizer.state_dict()
        for k, s in state["state"].items():
            for name, t in s.items():
                if torch.is_tensor(t):
                    assert torch.equal(t, again["state"][k][name]), (k, name)
        sched.optimizer.step()  # the same step, made again
        sched.optimizer.zero_grad()
        with paused(sched):
            ref.step(batches[3], gpt_loss, None)
    assert_same(model, ref, "after the retried step")
