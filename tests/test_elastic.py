"""Elastic placement (replan="auto"): the plan follows the inputs' shapes and out-of-memory errors, on the
stand-in device, bit for bit against torch.optim.AdamW(fused=True) on the same batches."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import memsched
from memsched.models.gpt import GPT, GPTConfig, lm_loss
from memsched.planning.elastic import exceeds, signature
from policies.types import DEVICE, HOST
from tests._dist_utils import run_ranks
from tests._numerics import SIM, same, uncounted

LR, WD = 1e-3, 0.1
# sequence 32 leaves room for every chunk on the device; 128 only with some offloaded (on the stand-in device
# SDPA takes its math path, whose attention matrices make sequence 128's peak larger than on the CPU)
CAP = "56MiB"
# the shrink test needs room for a plan between the long inputs' and the short ones'
SHRINK_CAP = "58MiB"


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256))


def lm_batch(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (batch, seq + 1), generator=g).to(SIM)
    return x[:, :-1], x[:, 1:]


def train(model, batches, loss_fn, **attach_kw):
    """memsched and torch.optim.AdamW(fused=True) side by side on ``batches``; returns the scheduler
    (closed; its ``plan_history`` says where the chunks were) and the reference model (on the stand-in too,
    not counted against its capacity)."""
    with uncounted():
        ref = copy.deepcopy(model).to(SIM)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    with memsched.attach(model, device=f"sim:{CAP}", lr=LR, weight_decay=WD, chunk_numel=65536,
                         **attach_kw) as sched:
        for b in batches:
            sched.backward(loss_fn(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                loss_fn(ref, b).backward()
                opt.step()
                opt.zero_grad()
    return sched, ref


def assert_equal(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert same(p.detach(), q.detach()), name


def test_signature_and_exceeds():
    x, y = torch.zeros(8, 32), torch.zeros(8, 32, 3)
    sig = signature((x,), {"y": y, "n": 3})
    assert sig == ((8, 32), (8, 32, 3))
    assert not exceeds(((4, 32), (4, 32, 3)), [sig])  # the last, smaller batch of an epoch
    assert exceeds(((8, 64), (8, 64, 3)), [sig])  # a longer sequence
    assert exceeds(((16, 32), (16, 32, 3)), [sig])  # a bigger batch
    assert exceeds(((8, 32),), [sig])  # another input set
    assert not exceeds(((8, 32), (8, 32, 3)), [((4, 64), (4, 64, 3)), sig])


@pytest.mark.parametrize("grow", ["seq", "batch"])
def test_longer_inputs_replan_before_the_forward_and_stay_exact(grow):
    sizes = [32, 32, 64, 64, 128, 128, 32, 32]
    if grow == "seq":  # batch 8 at these sequence lengths
        batches = [lm_batch(8, s, i) for i, s in enumerate(sizes)]
    else:  # the same tokens per step as batch 8, 8, 16, 16, 32, 32, 8, 8 at sequence 32
        batches = [lm_batch(s // 4, 32, i) for i, s in enumerate(sizes)]
    model = gpt()
    sched, ref = train(model, batches, lambda m, b: lm_loss(m, *b))
    assert_equal(model, ref)
    history = sched.plan_history
    assert history[0].reason == "end of warmup" and set(history[0].plan.placement) == {DEVICE}
    # The first input of the largest size was run with every chunk on the host, then planned from its
    # measured peak, which keeps some optimizer state on the host: no out-of-memory error on the way.
    largest = [h for h in history if "exceed" in h.reason and (("8x128" if grow == "seq" else "32x32")
                                                              in h.reason)]
    assert largest and set(largest[0].plan.placement) == {HOST} and largest[0].moved_bytes > 0
    final = history[-1]
    assert final.predicted_peak_non_model_bytes is not None and HOST in final.plan.placement
    assert DEVICE in final.plan.placement
    assert sched.transfers["chunk_moves_bytes"] == sum(h.moved_bytes for h in history)


def test_replan_off_runs_out_of_memory_where_auto_does_not():
    # 8 x 128 does not fit under the plan for 8 x 32 (every chunk on the device), but does with the optimizer
    # state on the host (the stand-in device counts the gradient buffers and SDPA's attention matrices).
    batches = [lm_batch(8, 32, 0), lm_batch(8, 32, 1), lm_batch(8, 128, 2)]
    with pytest.raises(torch.OutOfMemoryError):  # the stand-in's allocator raises torch's error, as CUDA's
        train(gpt(), batches, lambda m, b: lm_loss(m, *b), replan="off")
    gc.collect()  # the failed run's model and scheduler (held by its traceback) leave the stand-in
    model = gpt()
    sched, ref = train(model, batches, lambda m, b: lm_loss(m, *b), replan="auto")
    assert HOST in sched.plan_history[-1].plan.placement
    assert_equal(model, ref)


class EncoderDecoder(nn.Module):
    """Several inputs: source and target token sequences of different lengths."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 64)
        self.t = nn.Transformer(64, 4, 2, 2, 256, dropout=0.0, batch_first=True)
        self.out = nn.Linear(64, 64)

    def forward(self, src, tgt):
        return self.out(self.t(self.emb(src), self.emb(tgt)))


def test_encoder_decoder_with_two_inputs():
    def batch(s, t, seed):
        g = torch.Generator().manual_seed(seed)
        src, tgt = torch.randint(0, 64, (8, s), generator=g), torch.randint(0, 64, (8, t + 1), generator=g)
        return src.to(SIM), tgt.to(SIM)

    def loss_fn(m, b):
        src, tgt = b
        logits = m(src, tgt[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, 64), tgt[:, 1:].reshape(-1))

    shapes = [(16, 8), (16, 8), (64, 8), (64, 8), (64, 64), (16, 8)]
    batches = [batch(s, t, i) for i, (s, t) in enumerate(shapes)]
    model = EncoderDecoder()
    sched, ref = train(model, batches, loss_fn)
    assert_equal(model, ref)
    reasons = [h.reason for h in sched.plan_history]
    assert any("8x64, 8x8 exceed" in r for r in reasons) and any("8x64, 8x64 exceed" in r for r in reasons)


class Spiky(nn.Module):
    """A model whose forward (or backward) allocates a large temporary when told to: an out-of-memory error
    that no shape check sees coming. 1M parameters: 16 MiB of model data with the optimizer state."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(1024, 1024), nn.Linear(1024, 1)
        self.spike = None  # None, "forward" or "backward"

    def forward(self, x):
        if self.spike == "forward":
            _spike(x.device)
        h = self.a(x)
        if self.spike == "backward":
            h = _Spike.apply(h)
        return self.b(torch.relu(h)).sum()


def _spike(device: torch.device) -> None:
    # 17 MiB: fits only with the optimizer state on the host (4 MiB of parameters, 4 MiB of gradients in
    # backward only, 8 MiB of optimizer state on the device)
    torch.empty(17 * 2**20, dtype=torch.uint8, device=device)


class _Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _spike(g.device)
        return g


def _spiky_run(where: str | None, replan: str = "auto", **attach_kw):
    """Six steps on a 28 MiB stand-in (one chunk); step 3 (and its retry) allocates the spike in ``where``.
    The loop is the one memsched documents: on an out-of-memory error, zero_grad and run the step again."""
    xs = [torch.randn(16, 1024, generator=torch.Generator().manual_seed(i)).to(SIM) for i in range(6)]
    model = Spiky()
    errors = 0
    with memsched.attach(model, device="sim:28MiB", lr=LR, weight_decay=WD, chunk_numel=1_050_625,
                         replan=replan, **attach_kw) as sched:
        for i, x in enumerate(xs):
            model.spike = where if i == 3 else None
            try:
                sched.backward(model(x))
                sched.optimizer.step()
            except torch.OutOfMemoryError:
                errors += 1
                sched.optimizer.zero_grad()
                sched.backward(model(x))
                sched.optimizer.step()
            sched.optimizer.zero_grad()
    return model, errors, sched


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_retry_loop_loses_nothing(where):
    """The retry runs with every chunk on the host (the failed step changed nothing), is measured, and the
    next plan leaves room for it: the run equals one that never saw the error, bit for bit."""
    clean, errors, sched = _spiky_run(None)
    assert errors == 0 and set(sched.plan_history[0].plan.placement) == {DEVICE}
    clean.cpu()  # the clean run off the stand-in (its closed scheduler keeps its optimizer state there): the
    del sched  # next run has the whole capacity
    gc.collect()
    hit, errors, sched = _spiky_run(where)
    assert errors == 1
    oom = [h for h in sched.plan_history if h.reason.startswith("out of memory")]
    assert oom and set(oom[0].plan.placement) == {HOST}
    assert HOST in sched.plan_history[-1].plan.placement  # planned from the measured spike
    assert_equal(hit, clean)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_retry_after_a_plan_that_fills_the_margin(where):
    """The GPU run's pattern (`auto` filled the margin, then a steady-state allocation above the traced peak
    ran out of memory): with gpu_margin_mem_ratio=1 the retry loop recovers, and the parameters equal
    torch.optim.AdamW(fused=True) trained on the same six steps, bit for bit."""
    hit, errors, sched = _spiky_run(where, policy="auto", gpu_margin_mem_ratio=1.0)
    assert errors == 1 and set(sched.plan_history[0].plan.placement) == {DEVICE}
    assert [h for h in sched.plan_history if h.reason.startswith("out of memory")]
    with uncounted():
        ref = Spiky().to(SIM)
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
        for i in range(6):
            ref(torch.randn(16, 1024, generator=torch.Generator().manual_seed(i)).to(SIM)).backward()
            opt.step()
            opt.zero_grad()
    assert_equal(hit, ref)


def test_out_of_memory_retry_fails_again_without_replanning():
    with pytest.raises(torch.OutOfMemoryError):
        _spiky_run("forward", replan="off")


def test_replan_must_be_auto_or_off():
    with pytest.raises(ValueError, match="replan must be 'auto' or 'off', got 'on'"):
        memsched.attach(gpt(), device=f"sim:{CAP}", replan="on")


def _rank(rank: int, world: int) -> dict:
    model = gpt()
    seqs = [32, 32, 64, 32]
    with memsched.attach(model, device=f"sim:{CAP}", lr=LR, weight_decay=WD, chunk_numel=65536) as sched:
        for i, s in enumerate(seqs):
            seq = s if rank == world - 1 else 32  # only the last rank gets the longer sequence
            sched.backward(lm_loss(model, *lm_batch(8, seq, 10 * i + rank)))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        return {"history": [(h.step, h.plan.placement) for h in sched.plan_history],
                "params": [p.detach().cpu().clone() for p in model.parameters()]}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_replan_together(world):
    results = run_ranks(_rank, world, timeout=180)
    histories = [r["history"] for r in results]
    assert all(h == histories[0] for h in histories) and len(histories[0]) > 1
    for r in results[1:]:
        assert all(same(p, q) for p, q in zip(r["params"], results[0]["params"], strict=True))


def test_report_and_json_show_the_plan_history():
    import io
    import json

    from rich.console import Console

    batches = [lm_batch(8, s, i) for i, s in enumerate([32, 32, 128, 128])]
    sched, _ = train(gpt(), batches, lambda m, b: lm_loss(m, *b))
    out = io.StringIO()
    sched.report(console=Console(file=out, width=160))
    text = out.getvalue()
    assert f"Plan history ({len(sched.plan_history)} plans)" in text and "8x128 exceed" in text
    rows = json.loads(json.dumps([h.to_dict() for h in sched.plan_history]))
    assert rows[0]["reason"] == "end of warmup" and rows[1]["predicted_peak_non_model_bytes"] is None
    assert sum(r["moved_bytes"] for r in rows) == sched.transfers["chunk_moves_bytes"]


def test_shrinks_back_after_a_run_of_smaller_steps():
    """After the longest inputs, a window of shorter steps (here 3 instead of 50) lets chunks move back to the
    device: bit-exact, the moves counted, and no move while the window is still filling (hysteresis)."""
    from collections import deque

    model = gpt()
    with uncounted():
        ref = copy.deepcopy(model).to(SIM)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    seqs = [32, 128, 128, 32, 32, 32, 32]
    on_device = []
    with memsched.attach(model, device=f"sim:{SHRINK_CAP}", lr=LR, weight_decay=WD,
                         chunk_numel=65536) as sched:
        sched.elastic.recent = deque(maxlen=3)
        for i, s in enumerate(seqs):
            b = lm_batch(8, s, i)
            sched.backward(lm_loss(model, *b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            on_device.append(sum(c.placement == DEVICE for c in sched.store.chunks))
            with sched.sim.paused():
                lm_loss(ref, *b).backward()
                opt.step()
                opt.zero_grad()
        history = sched.plan_history
    assert_equal(model, ref)
    shrink = [h for h in history if "stayed below" in h.reason]
    # Steps 2-3 (sequence 128) fill the window; 4-6 (32) replace them. The conservative all-host step 2
    # measured the long inputs with every gradient on its way to the host; step 3 measured them under the plan
    # made from that, whose device chunks' gradient buffers the plan counts whole: less. So once step 2 has
    # left the window (end of step 5) the plan shrinks to step 3's peak, and once step 3 has (end of step 6)
    # to the short inputs' peak.
    assert [h.step for h in shrink] == [5, 6] and all(h.moved_bytes > 0 for h in shrink)
    long_peaks = [h.predicted_peak_non_model_bytes for h in history if h.reason.startswith("measured peak")]
    assert long_peaks and shrink[0].predicted_peak_non_model_bytes < long_peaks[0]
    n = len(sched.store.chunks)
    assert on_device[0] == n and on_device[1] < n and on_device[1:4] == [on_device[1]] * 3
    assert on_device[1] < on_device[4] < n and on_device[5:] == [n, n]


def test_seen_signatures_stay_the_maximal_few():
    from memsched.planning.elastic import add_maximal

    seen: list = []
    for seq in [32, 16, 64, 48, 128, 8]:  # every batch its own length
        add_maximal(seen, ((8, seq),))
    assert seen == [((8, 128),)]
    add_maximal(seen, ((16, 64),))  # a larger batch of shorter sequences: neither covers the other
    assert seen == [((8, 128),), ((16, 64),)]
    add_maximal(seen, ((16, 128),))
    assert seen == [((16, 128),)]
