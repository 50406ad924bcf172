"""Parameters kept on the host and fetched for their reads (one rank), bit for bit against
``torch.optim.AdamW(fused=True)`` on a stand-in whose capacity is the non-model peak plus a quarter of the
parameters and gradients: fp32 and bf16, torch's ``clip_grad_norm_(model.parameters())`` with a norm that
triggers, gradient accumulation 2, ``overlap=True``; a model with tied weights, checkpointed blocks, a module
called twice and parameters read outside their module; a changed read order (fetched on demand, the plan
revised); a checkpoint resume; Hugging Face GPT-2 through ``Trainer`` with ``max_grad_norm``; a step after
a backward that raised is refused (a torch clip then could have seen only part of the gradients)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memsched
import memsched.checkpoint
from memsched.chunks.backward import BackwardPhase
from memsched.devices import sim_backend
from tests._numerics import LR, SIM, WD, Reference, assert_same, same, to_dev
from tracer import MemoryTracer

CLIP, ACCUM, STEPS = 0.05, 2, 6
CHUNK = 8320  # two of the blocks' Linear(64, 64): ten chunks, little padding


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(h)))


class OffloadNet(nn.Module):
    """Every reader a fetch schedule must serve: the embedding's weight is read again, outside its module, as
    the output head (tied); even blocks are checkpointed (re-read in backward); ``shared`` runs twice;
    ``gate``'s parameters are read by the root's forward, not by ``gate``'s. ``swap`` changes the order of
    two blocks (a branch the warmup did not see)."""

    def __init__(self, width: int = 64, depth: int = 8, vocab: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.shared = Block(width)
        self.gate = nn.Linear(width, width)
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        order = list(self.blocks)
        if self.swap:
            order[3], order[6] = order[6], order[3]
        for i, block in enumerate(order):
            checkpointed = i % 2 == 0 and torch.is_grad_enabled()
            h = checkpoint(block, h, use_reentrant=False) if checkpointed else block(h)
        h = self.shared(self.shared(h))
        h = h + torch.tanh(F.linear(h, self.gate.weight, self.gate.bias))
        return F.linear(h, self.emb.weight)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def batches(n: int, seed: int = 2, device: torch.device | str = "cpu",
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """On the host by default: each step moves its batch to the device (``to_dev``), as a training loop does,
    so the data set does not take the stand-in's capacity."""
    g = torch.Generator().manual_seed(seed)
    return [to_dev((torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)),
                   device) for _ in range(n)]


def capacity(dtype: torch.dtype) -> tuple[int, int]:
    """The stand-in's capacity: the peak of non-model data of a plain torch step (accumulation included) plus
    a quarter of the parameters and gradients in the compute dtype; and that peak. Bytes. Traced on the
    stand-in, where the scheduler will run."""
    model = OffloadNet().to(dtype).to(SIM)
    with MemoryTracer(model) as tracer:
        for micro in batches(ACCUM):
            loss_fn(model, to_dev(micro)).backward()
    peak = tracer.timeline.peak_non_model_bytes()
    params = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    return peak + (params + params) // 4, peak


def train(sched, model, ref, data, first: int, last: int, *, swap_at: int | None = None) -> list[dict]:
    """Steps ``first`` to ``last`` (exclusive) with ``ACCUM`` micro-batches each and torch's clip over
    ``model.parameters()``, checked against ``ref`` after each; returns the fetcher's counters per step."""
    stats = []
    for step in range(first, last):
        model.swap = ref.model.swap = swap_at is not None and step >= swap_at
        micro = to_dev(data[step * ACCUM:(step + 1) * ACCUM])
        sched.backward(loss_fn(model, micro[0]))
        loss_fn(model, micro[1]).backward()  # a plain backward accumulates the same way
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP  # the clip triggers
        sched.optimizer.step()
        sched.optimizer.zero_grad()
        with sched.sim.paused():
            ref.step(micro, loss_fn, CLIP)
            assert_same(model, ref, f"step {step}", optimizer=sched.optimizer)
        stats.append(sched.params.take_stats())
    return stats


def planned(model: nn.Module, data: list) -> memsched.Scheduler:
    """``model`` attached on the fp32 stand-in and trained a step per batch of ``data`` (past warmup): some
    of its parameters are on the host."""
    sched = attach(model, torch.float32, capacity(torch.float32)[0])
    for b in data:
        sched.backward(loss_fn(model, to_dev(b)))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
    assert sched.plan.param_host_chunks
    return sched


def attach(model: nn.Module, dtype: torch.dtype, cap: int, **kwargs) -> memsched.Scheduler:
    return memsched.attach(model, policy="auto", device=f"sim:{cap}B", lr=LR, weight_decay=WD, dtype=dtype,
                           chunk_numel=CHUNK, **kwargs)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bit_exact_with_parameters_fetched_for_their_reads(dtype: torch.dtype, overlap: bool) -> None:
    cap, peak = capacity(dtype)
    model = OffloadNet()
    params = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    assert cap < peak + 2 * params  # the parameters and gradients do not fit beside the non-model peak
    ref = Reference(model, dtype)
    with attach(model, dtype, cap, overlap=overlap) as sched:
        assert sched.warmup_params_on_host  # they take more than a fifth of the device: traced on the host
        stats = train(sched, model, ref, batches(STEPS * ACCUM), 0, STEPS)
        plan = sched.plan
        offloaded = plan.param_host_chunks
        assert len(sched.store.chunks) >= 8 and 0 < len(offloaded) < len(sched.store.chunks)
        assert set(plan.placement) == {"host"}  # optimizer state and gradients went first
        assert any("Parameters do not all fit" in r for r in plan.reasons)
        assert plan.peak_bytes <= cap and sched.sim.peak_bytes <= cap
        for s in stats[1:]:  # planned steps: on the schedule, some chunks fetched ahead of their read
            assert s["misses"] == 0 and s["fetches"] > 0 and s["prefetches"] > 0
        assert [h.reason for h in sched.plan_history] == ["end of warmup"]  # the plan held
        # Between steps the offloaded parameters and their gradients are host views: torch sees them all.
        assert all(not sched.store.resident(sched.store.chunks[i]) for i in offloaded) or plan.schedule.keep
    # close(): a plain model again, every parameter back in its device buffer, values unchanged
    assert all(c.data is not None for c in sched.store.chunks)
    assert not any(sched.store.in_host_memory(p) for p in model.parameters())
    assert_same(model, ref, "after close()")


def test_a_changed_read_order_is_fetched_on_demand_and_the_plan_revised() -> None:
    cap = capacity(torch.float32)[0]
    model = OffloadNet()
    ref = Reference(model)
    with attach(model, torch.float32, cap) as sched:
        stats = train(sched, model, ref, batches(STEPS * ACCUM), 0, STEPS, swap_at=3)
        assert stats[2]["misses"] == 0 and stats[3]["misses"] > 0  # the swapped blocks' reads missed
        assert stats[5]["misses"] == 0 and stats[5]["prefetches"] > 0  # the revised schedule is followed
        reasons = [h.reason for h in sched.plan_history]
        assert reasons == ["end of warmup", "the parameter reads came in another order than the schedule's"]
        swapped = sched.plan_history[-1].plan.schedule.accesses
        assert swapped != sched.plan_history[0].plan.schedule.accesses


def test_checkpoint_resume_is_bit_exact(tmp_path) -> None:
    cap, _ = capacity(torch.float32)
    data = batches(STEPS * ACCUM)
    model = OffloadNet()
    ref = Reference(model)
    with attach(model, torch.float32, cap) as sched:
        train(sched, model, ref, data, 0, 3)
        assert sched.plan.param_host_chunks
        with sched.sim.paused():
            memsched.checkpoint.save(sched, tmp_path / "ckpt")
    del model, sched  # off the stand-in (a closed scheduler keeps its optimizer state there until dropped)
    gc.collect()
    resumed = OffloadNet()
    with torch.no_grad():
        for p in resumed.parameters():
            p.normal_()  # other values: everything must come from the checkpoint
    with attach(resumed, torch.float32, cap) as sched:
        with sched.sim.paused():
            memsched.checkpoint.load(sched, tmp_path / "ckpt")
        train(sched, resumed, ref, data, 3, STEPS)
        assert sched.plan.param_host_chunks


def test_a_step_after_a_backward_that_raised_is_refused_and_nothing_is_lost() -> None:
    """The backward raises half way: some chunks' gradients went to the host, others did not. A torch clip
    over ``model.parameters()`` then sees only part of them; the step that would use it refuses."""
    cap, _ = capacity(torch.float32)
    model = OffloadNet()
    ref = Reference(model)
    data = batches(STEPS * ACCUM)
    with attach(model, torch.float32, cap) as sched:
        train(sched, model, ref, data, 0, 2)
        with sched.sim.paused():  # host copies
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            state = copy.deepcopy(sched.optimizer.state_dict())

        def fail(*_args):
            raise RuntimeError("boom in backward")

        handle = model.blocks[2].register_full_backward_hook(fail)
        with pytest.raises(RuntimeError, match="boom in backward"):
            loss_fn(model, to_dev(data[4])).backward()
        handle.remove()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # over whatever gradients there are
        with pytest.raises(RuntimeError, match="would see only part of them. Nothing was updated"):
            sched.optimizer.step()
        with sched.sim.paused():
            for n, p in model.named_parameters():
                assert same(p.detach(), before[n]), n
            after = sched.optimizer.state_dict()
            for i, st in state["state"].items():
                for k, v in st.items():
                    assert same(v, after["state"][i][k]), (i, k)
        # [Note: the backward phase] in memsched.chunks.store: ended in its place, then reset by zero_grad()
        assert sched.store.backward.phase is not BackwardPhase.IDLE
        sched.store.backward.end_aborted()  # as zero_grad() does first
        assert sched.store.backward.phase is BackwardPhase.ABORTED and not sched.store.backward.in_backward
        sched.optimizer.zero_grad()
        assert sched.store.backward.phase is BackwardPhase.IDLE
        train(sched, model, ref, data, 2, 4)  # training goes on, exactly
        assert sched.store.backward.phase is BackwardPhase.IDLE


def test_a_warmup_out_of_memory_with_the_parameters_on_the_device_says_how_to_trace_them_on_the_host():
    """Non-model data takes most of the device, so ``auto`` keeps the parameters there in warmup (they take
    less than a fifth of it) and the first step runs out: the error says which option traces them on the
    host, and with it the same run trains."""
    g = torch.Generator().manual_seed(3)
    big = [to_dev((torch.randint(0, 64, (64, 16), generator=g), torch.randint(0, 64, (64, 16), generator=g)))]
    model = OffloadNet().to(SIM)  # traced on the stand-in, where the scheduler will run
    with MemoryTracer(model) as tracer:
        loss_fn(model, big[0]).backward()
    params = sum(p.numel() for p in model.parameters()) * 4
    cap = tracer.timeline.peak_non_model_bytes() + params
    assert params < 0.2 * cap
    del tracer  # its trace holds tensors on the stand-in
    model = OffloadNet()
    with attach(model, torch.float32, cap) as sched:
        assert not sched.warmup_params_on_host
        with pytest.raises(torch.OutOfMemoryError, match="warmup_non_model_share"):
            sched.backward(loss_fn(model, big[0]))
    del model, sched  # the failed run off the stand-in (its traceback and closed scheduler held its tensors)
    gc.collect()
    model = OffloadNet()
    ref = Reference(model)
    # a reserve of 1 % of the device: the default 5 % is more than the parameters here
    options = {"warmup_non_model_share": 1.0, "reserve_frac": 0.01}
    with attach(model, torch.float32, cap, policy_options=options) as sched:
        assert sched.warmup_params_on_host
        for step in range(3):
            sched.backward(loss_fn(model, big[0]))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(big[0], loss_fn, None)
                assert_same(model, ref, f"step {step}")
        assert sched.plan.param_host_chunks


def test_hugging_face_trainer_with_max_grad_norm(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    base = GPT2LMHeadModel(cfg)  # tied input/output embeddings
    tokens = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    probe = copy.deepcopy(base)
    with MemoryTracer(probe) as tracer:
        for _ in range(2):
            probe(input_ids=tokens[:4], labels=tokens[:4]).loss.backward()
    params = sum(p.numel() for p in base.parameters()) * 4
    cap = tracer.timeline.peak_non_model_bytes() + (2 * params) // 4

    from tests.test_hf_trainer import _trainer_run

    # non-model data takes most of the device: the warmup traces with the parameters on the host
    attach_kwargs = {"device": f"sim:{cap}B", "chunk_numel": 4096,
                     "policy_options": {"warmup_non_model_share": 1.0}}
    ref_losses, ref, _, _ = _trainer_run(base, data, tmp_path, False, max_grad_norm=0.05)
    losses, model, _, plan = _trainer_run(base, data, tmp_path, True, max_grad_norm=0.05,
                                          attach_kwargs=attach_kwargs)
    assert plan.param_host_chunks  # the Trainer's steps fetched parameters kept on the host
    assert len(losses) == 4 and losses == ref_losses
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert same(p, q)


def test_the_benchmark_runs(tmp_path, monkeypatch) -> None:
    # bench/param_offload.py, tiny: it cannot rot (timings live in its committed result, not here).
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import param_offload

    monkeypatch.setenv("MEMSCHED_BENCH_OUT", str(tmp_path))
    assert param_offload.main(["--size", "tiny", "--batch", "2", "--seq", "16", "--links", "500MBps",
                               "--rounds", "1", "--blocks", "1", "--block", "2", "--warmup", "2",
                               "--name", "smoke"]) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    link = result["links"]["500MBps"]
    assert result["bit_identical"] and link["offloaded"]["placement"]["param_host_chunks"] > 0
    assert link["offloaded"]["device_model_bytes_per_parameter_at_peak"] < \
        link["resident"]["device_model_bytes_per_parameter_at_peak"]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bit_exact_with_half_the_parameters_on_the_host_on_a_device_with_copy_streams(
        target, dtype: torch.dtype, overlap: bool) -> None:
    """On CUDA's streams (the stand-in's link threads in CI): a fetched chunk is read after its H2D copy, an
    evicted one is freed after the reads queued before; against torch's fused AdamW run where memsched
    updates (the CPU: every chunk is on the host)."""
    dev = target.device
    model = OffloadNet().to(dev)
    ref = Reference(model, dtype, device=dev)
    data = batches(STEPS * ACCUM, device=dev)
    with memsched.attach(model, policy="static", device=target.spec, lr=LR, weight_decay=WD, dtype=dtype,
                         chunk_numel=CHUNK, overlap=overlap,
                         policy_options={"offload_param_frac": 0.5}) as sched:
        assert sched.warmup_params_on_host
        on_host = range(len(list(model.parameters())))
        for step in range(STEPS):
            micro = data[step * ACCUM:(step + 1) * ACCUM]
            for m in micro:
                sched.backward(loss_fn(model, m))
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            ref.step(micro, loss_fn, CLIP, on_host=on_host)  # the clip over device-typed gradients
            sched.synchronize()
            assert_same(model, ref, f"step {step}", optimizer=sched.optimizer)
        assert sched.plan.param_host_chunks and sched.params.stats["fetches"] > 0


def test_compiled_code_reading_parameters_on_the_host_is_refused(monkeypatch) -> None:
    """torch.compile traces the fetcher's hooks to nothing; a compiled forward that would read parameters
    kept on the host raises at the first module that reads them, rather than read NaN. (The stand-in keeps
    compiled code eager: compilation is simulated by ``torch.compiler.is_compiling``.)"""
    model, data = OffloadNet(), batches(4)
    with planned(model, data[:2]) as sched:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        with pytest.raises(RuntimeError, match=r"compiled code reads parameters the plan keeps on the host"):
            model(data[2][0].to(SIM))
        monkeypatch.undo()
        sched.backward(loss_fn(model, to_dev(data[3])))  # eager training goes on
        sched.optimizer.step()
        sched.optimizer.zero_grad()


def test_close_with_gradients_that_do_not_fit_leaves_them_on_the_host_and_says_so() -> None:
    cap, _ = capacity(torch.float32)
    model = OffloadNet()
    data = batches(4)
    sched = attach(model, torch.float32, cap)
    for b in data[:2]:
        sched.backward(loss_fn(model, to_dev(b)))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
    sched.backward(loss_fn(model, to_dev(data[2])))  # gradients on the host, not stepped
    with sched.sim.paused():
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.warns(RuntimeWarning, match=r"close\(\): \d+ bytes of parameters stay on the host"):
        sched.close()
    stayed = [c for c in sched.store.chunks if c.data is None]
    assert stayed and len(stayed) < len(sched.store.chunks)
    for n, p in model.named_parameters():  # nothing lost: every value and gradient where it now lives
        assert same(p.detach(), values[n]) and same(p.grad, grads[n]), n


def test_longer_inputs_are_re_planned_with_parameters_on_the_host() -> None:
    """``replan="auto"``: a longer sequence than the warmup's runs once with every chunk's parameters on the
    host and nothing fetched beyond the reads, is measured, and gets its own plan; exact throughout."""
    cap = capacity(torch.float32)[0] * 13 // 10
    model = OffloadNet()
    ref = Reference(model)
    g = torch.Generator().manual_seed(5)

    def batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 64, (2, seq), generator=g), torch.randint(0, 64, (2, seq), generator=g)

    data = [batch(16) for _ in range(2)] + [batch(24) for _ in range(3)] + [batch(16) for _ in range(2)]
    with attach(model, torch.float32, cap) as sched:
        for i, b in enumerate(data):
            b = to_dev(b)
            sched.backward(loss_fn(model, b))
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(b, loss_fn, CLIP)
                assert_same(model, ref, f"step {i}")
        history = sched.plan_history
        assert [h.step for h in history] == [1, 2, 3]
        assert "every chunk on the host" in history[1].reason
        assert history[1].plan.param_host_chunks == list(range(len(sched.store.chunks)))
        assert 0 < len(history[2].plan.param_host_chunks) < len(sched.store.chunks)
        assert len(history[2].plan.param_host_chunks) >= len(history[0].plan.param_host_chunks)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_an_evaluation_between_steps_sees_current_values_and_training_goes_on_exactly(mode) -> None:
    """An evaluation forward between steps (``no_grad`` or ``inference_mode``) fetches what it reads; after
    it the model is between steps again (host-placed parameters read their host values, not the NaN of
    absent views), its outputs and ``state_dict()`` equal torch's, and the chunks it fetched are not
    inference tensors that the next training step could not save for backward."""
    cap, _ = capacity(torch.float32)
    model = OffloadNet()
    ref = Reference(model)
    data, probe = batches(STEPS * ACCUM), batches(1, seed=9)[0]
    with attach(model, torch.float32, cap) as sched:
        for step in range(STEPS):
            train(sched, model, ref, data, step, step + 1)
            model.eval()
            seen: list[bool] = []  # inside the evaluation: are the chunks it fetched inference tensors?

            def look(*_a, seen=seen) -> None:
                seen.extend(c.data.is_inference() for c in sched.store.chunks if c.data is not None)

            handle = model.shared.register_forward_pre_hook(look)
            with mode():
                out = model(probe[0].to(SIM))
            handle.remove()
            model.train()
            assert seen and not any(seen)
            assert not any(p.is_inference() for p in model.parameters())
            with sched.sim.paused():
                assert sched.plan is None or sched.plan.param_host_chunks  # parameters on the host
                with torch.no_grad():
                    assert same(out, ref.model(probe[0].to(SIM))), f"step {step}"
                state = model.state_dict()
                for k, v in ref.model.state_dict().items():
                    assert same(state[k], v), (step, k)
            del out


def penalised(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """An L2 penalty over ``model.parameters()`` computed before the forward, as a user's loss term may."""
    penalty = sum(p.pow(2).sum() for p in model.parameters())
    return 1e-3 * penalty + loss_fn(model, batch)


def test_a_loss_term_read_before_the_forward_is_exact_also_across_an_out_of_memory_retry() -> None:
    """The penalty reads every parameter between steps, before the forward, where the host-placed ones are
    host tensors (found by the stand-in: their host gradients met the forward's device gradients, torch's
    device error). Its first read that records a graph fetches the chunks whose parameters live on the host
    only and takes every chunk to the device ([Note: graph reads between steps]); autograd saves them all.
    A forward that then runs out of memory is retried after ``zero_grad()`` and re-planned at its begin
    (every chunk on the host): the parameters the penalty of the retry saved on the device have moved to the
    host by backward, which must read their values, not the NaN of their absent views."""
    model = OffloadNet()
    # the penalty's gradients come last in backward, so every chunk's gradients are complete only at its end
    cap = capacity(torch.float32)[0] + sum(p.numel() for p in model.parameters()) * 4 * 3 // 4
    ref = Reference(model)
    data = batches(STEPS)
    oom_at = 3
    with attach(model, torch.float32, cap) as sched:
        for step, b in enumerate(data):
            b = to_dev(b)
            if step == oom_at:
                def oom(*_a):
                    raise memsched.devices.simdevice.SimOutOfMemoryError(1 << 30, 0, cap)

                handle = model.blocks[5].register_forward_hook(oom)
                raised = False
                try:  # not pytest.raises: its traceback would keep the failed forward's graph alive
                    sched.backward(penalised(model, b))
                except torch.OutOfMemoryError:
                    raised = True
                assert raised
                handle.remove()
                sched.optimizer.zero_grad()
            sched.backward(penalised(model, b))
            with sched.sim.paused():
                assert not any(torch.isnan(p.grad).any() for p in model.parameters() if p.grad is not None)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(b, penalised, CLIP)
                assert_same(model, ref, f"step {step}", optimizer=sched.optimizer)
        assert sched.plan_history[0].plan.param_host_chunks  # some parameters read on the host between steps
        reasons = [h.reason for h in sched.plan_history]
        assert len(reasons) >= 2 and "out of memory" in reasons[1], reasons
        assert sched.plan_history[1].step == oom_at  # optimizer steps done before the retry


def test_an_activation_modified_in_place_after_it_was_saved_is_refused_as_torch_refuses_it() -> None:
    """Under saved-tensor hooks autograd no longer checks the version of what it saved; memsched's hooks (on
    while parameters live on the host) check it themselves, so the in-place write is an error as in torch,
    not a silently wrong gradient."""
    model, data = OffloadNet(), batches(4)
    with planned(model, data[:2]) as sched:
        x, y = to_dev(data[2])
        h = model(x).sigmoid()  # sigmoid saves its output
        h.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            F.mse_loss(h, torch.zeros_like(h)).backward()
        sched.optimizer.zero_grad()


@pytest.mark.parametrize("where", ["re-forward", "hook"])
def test_a_backward_that_raised_leaves_every_parameter_readable_and_training_exact(where: str) -> None:
    """Issue 28, item 3: a backward raises half way (in a checkpointed block's re-forward, or in a backward
    hook), with some chunks' parameters fetched and others away. Right after it, ``state_dict()`` holds the
    values of before the step (no NaN of an absent parameter); the step over its partial gradients is still
    refused; every parameter holds its value after ``zero_grad()``; the chunks fetched for it leave, and
    training then goes on bit for bit ([Note: a backward that raised] in memsched.chunks.store)."""
    cap, _ = capacity(torch.float32)
    model = OffloadNet()
    ref = Reference(model)
    data = batches(STEPS * ACCUM)
    armed = {"on": False}

    def fail(*_args):
        in_backward = torch._C._current_graph_task_id() != -1
        if armed["on"] and (in_backward or where == "hook"):
            armed["on"] = False
            raise RuntimeError("boom")

    block = model.blocks[0]  # checkpointed: its forward runs again during backward
    handle = (block.register_forward_pre_hook(fail) if where == "re-forward"
              else model.blocks[3].register_full_backward_hook(fail))
    with attach(model, torch.float32, cap) as sched:
        train(sched, model, ref, data, 0, 2)
        with sched.sim.paused():
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
        gc.collect()
        live = sim_backend.memory_allocated()
        armed["on"] = True
        with pytest.raises(RuntimeError, match="boom") as raised:
            sched.backward(loss_fn(model, to_dev(data[4])))
        del raised  # its traceback holds the backward's frames, and their tensors
        with sched.sim.paused():
            state = model.state_dict()
            for n, v in before.items():
                assert same(state[n], v), n
            del state
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # over whatever gradients there are
        with pytest.raises(RuntimeError, match="would see only part of them. Nothing was updated"):
            sched.optimizer.step()  # still refused after state_dict() ended the backward
        sched.optimizer.zero_grad()
        with sched.sim.paused():
            for n, p in model.named_parameters():
                assert same(p.detach(), before[n]), n
        gc.collect()
        assert sim_backend.memory_allocated() <= live  # the chunks fetched for the backward left
        handle.remove()
        train(sched, model, ref, data, 2, 4)


def test_another_thread_reading_a_parameter_away_from_the_device_is_refused_not_nan() -> None:
    """[Note: foreign reads] in memsched.chunks.binding: while a step computes, the parameters of a chunk on
    the host are absent views (NaN). The training thread's reads fetch them; another thread's read (a
    monitoring or checkpoint thread) is refused, naming the thread, instead of computing with NaN. Parameters
    on the device read as usual from any thread."""
    import threading

    from memsched.chunks.binding import Binding

    data = batches(3)
    model = OffloadNet()
    sched = planned(model, data[:2])
    seen: dict = {}

    def probe(_module, _args) -> None:  # a forward pre-hook of the last block: mid-forward
        bindings = sched.store.bindings
        absent = [c for c in sched.store.chunks if bindings.state(c) is Binding.ABSENT]
        present = [c for c in sched.store.chunks if bindings.state(c) is Binding.DEVICE]
        out: list = []

        def read() -> None:
            for c in (absent[0], present[0]):
                try:
                    out.append(c.params[0].detach().sum().item())
                except RuntimeError as e:
                    out.append(str(e))
        t = threading.Thread(target=read, name="monitor")
        t.start()
        t.join()
        seen.update(absent=len(absent), out=out)

    handle = model.blocks[-1].register_forward_pre_hook(probe)
    with sched:
        sched.backward(loss_fn(model, to_dev(data[2])))
        handle.remove()
        sched.optimizer.step()
    assert seen["absent"] > 0
    refusal, value = seen["out"]
    assert "from thread 'monitor'" in refusal and "its values are not on this device" in refusal, refusal
    assert isinstance(value, float) and value == value  # a parameter on the device: read, not NaN


def test_a_forward_on_another_thread_is_refused_before_it_changes_anything() -> None:
    """Training stays on the attaching thread (its read guards and the stand-in's accounting are that
    thread's). With parameters offloaded, a forward on another thread is refused at its start, so the model
    still trains exactly on the attaching thread (before, the refusal came at the step, and the fetcher,
    left mid-step, computed NaN afterwards)."""
    import threading

    data = batches(4)
    model = OffloadNet()
    ref = Reference(model)
    sched = planned(model, data[:2])
    errors: list = []

    def forward() -> None:
        try:
            loss_fn(model, to_dev(data[2]))
        except RuntimeError as e:
            errors.append(str(e))
    t = threading.Thread(target=forward)
    t.start()
    t.join()
    assert len(errors) == 1 and "forward ran on another thread than memsched.attach" in errors[0], errors
    with sched:
        for b in data[2:]:
            sched.backward(loss_fn(model, to_dev(b)))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        with sched.sim.paused():
            for b in data:
                ref.step([b], loss_fn, None)
            assert_same(model, ref, "after the refused forward")
