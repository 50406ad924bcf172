"""Probes of unusual model structures against ``torch.optim.AdamW(fused=True)``, bit for bit.

memsched installs per-module forward pre-hooks (the overlapped update's waits, placed at the first traced
module that may read a parameter: :mod:`memsched.planning.first_use`), post-accumulate-grad hooks (which
parameters have a gradient, when a chunk's gradients are complete for ``overlap="backward"``) and a warmup
tracer. Each probe below is a model whose structure strains one of those assumptions: activation checkpointing
(forward hooks run again during backward; ``use_reentrant=True`` runs nested backward passes), layers called
out of registration order or in an order that changes between steps, parameters read by a module that does not
own them or only in the loss, one layer applied several times per forward, branches taken on some steps only,
parametrizations, buffers updated in forward, and tied weights read first by a module without parameters of
its own.

Each probe runs under the ``cpu``, ``static`` and ``auto`` placements (``auto`` sized so that some chunks are
on the stand-in device and some on the host) and ``overlap`` False, True and ``"backward"``, for 5 steps (the
first is the traced warmup). The training thread's losses equal the reference's at every step (a forward that
reads a parameter whose overlapped update is unfinished shows there); parameters are compared with
``torch.equal`` after every step without overlap, and with overlap after every other step (each comparison
needs ``sched.synchronize()``, which would otherwise make every next forward trivially safe), and after
``close()``. The CPU-update worker is slowed down (``slow_worker``) so that a missing wait shows.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

import memsched
from memsched.optim.early_update import EarlyUpdates
from memsched.optim.hybrid_adamw import HybridAdamW
from policies.types import DEVICE, HOST
from tests._numerics import LR, SIM, WD, Branchy, Reference, assert_same, same, to_dev, uncounted
from tests.test_overlap import paused

D = 32  # width of every probe model
CHUNK = 1200  # elements per chunk: about one D x D linear layer (1056 elements) per chunk
STEPS = 5
OVERLAPS = [False, True, "backward"]
POLICIES = ["cpu", "static", "auto"]


@pytest.fixture
def slow_worker(monkeypatch):
    """Like tests/conftest.py's ``slow_early_worker`` with shorter delays (the file runs 171 cases): each
    host-chunk update on the worker thread starts 5 ms late, each update during backward 2 ms late, so that a
    forward that does not wait for its chunk reads the parameters before their update. Returns the delays in
    seconds, which a test may raise."""
    main = threading.get_ident()
    delays = {"host": 0.005, "early": 0.002}
    original_host, original_early = HybridAdamW._update_host, EarlyUpdates._run

    def slowed_host(self, *args, **kwargs):
        if threading.get_ident() != main:
            time.sleep(delays["host"])
        return original_host(self, *args, **kwargs)

    def slowed_early(self, *args, **kwargs):
        time.sleep(delays["early"])
        return original_early(self, *args, **kwargs)

    monkeypatch.setattr(HybridAdamW, "_update_host", slowed_host)
    monkeypatch.setattr(EarlyUpdates, "_run", slowed_early)
    return delays


def placement(policy: str, auto_capacity: str) -> dict:
    if policy == "cpu":
        return dict(policy="cpu", device="sim:64MiB")
    if policy == "static":
        return dict(policy="static", device="sim:64MiB", policy_options={"offload_optim_frac": 0.5})
    return dict(policy="auto", device=f"sim:{auto_capacity}")


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)) for _ in range(n)]


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def run_parity(make_model: Callable[[], nn.Module], policy: str, overlap, *,
               loss_fn: Callable = mse, before: Callable[[int, nn.Module], None] | None = None,
               steps: int = STEPS, auto_capacity: str = "79KiB", chunk_numel: int = CHUNK):
    """Train ``make_model()`` with memsched and a deepcopy with ``torch.optim.AdamW(fused=True)`` on the same
    batches; ``before(i, model)`` runs on both models before step ``i``'s forward. Losses must be
    equal at every step, parameters after every step (with overlap: after every odd step) and after
    ``close()``.
    Returns the set of chunk placements after warmup."""
    torch.manual_seed(0)
    model = make_model()
    with uncounted():
        ref = copy.deepcopy(model).to(SIM)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    data = to_dev(batches(steps))
    what = f"{policy} overlap={overlap}"
    sched = memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=chunk_numel, overlap=overlap,
                            **placement(policy, auto_capacity))
    with sched:
        for i, b in enumerate(data):
            if before is not None:
                before(i, model)
            loss = loss_fn(model, b)
            sched.backward(loss)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                if before is not None:
                    before(i, ref)
                ref_loss = loss_fn(ref, b)
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                assert same(loss.detach(), ref_loss.detach()), f"{what}: loss of step {i}"
            if overlap is False or i % 2 == 1:
                sched.synchronize()
                with paused(sched):
                    assert_params_same(model, ref, f"{what}, step {i}")
        places = {c.placement for c in sched.store.chunks}
        early = sched.optimizer.early_updates
        if overlap == "backward" and HOST in places:  # updates really were made during backward
            assert early.committed > 0, f"{what}: no update made during backward was committed"
    assert_params_same(model, ref, f"{what}, after close()")
    if policy == "auto":  # the probe is meaningful only with chunks on both sides
        assert places == {HOST, DEVICE}, f"auto placed every chunk on one side: {places}"
    if policy == "static":
        assert HOST in places
    return places


def assert_params_same(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        p, q = p.detach().cpu(), q.detach().cpu()
        if not same(p, q):
            d = (p - q).abs().max().item()
            raise AssertionError(f"{what}: {name} differs from the reference (max diff {d:.3g})")
    for (name, b), c in zip(model.named_buffers(), ref.buffers(), strict=True):
        assert same(b.cpu(), c.cpu()), f"{what}: buffer {name} differs from the reference"


both = pytest.mark.parametrize("overlap", OVERLAPS, ids=["serial", "overlap", "backward"])
policies = pytest.mark.parametrize("policy", POLICIES)


# ---- 1. activation checkpointing -------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, ckpt: str | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)
        self.ckpt = ckpt

    def inner(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x):
        if self.ckpt is None:
            return x + self.inner(x)
        return x + checkpoint(self.inner, x, use_reentrant=self.ckpt == "reentrant")


class Stack(nn.Module):
    def __init__(self, n: int = 2, ckpt: str | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(ckpt) for _ in range(n))
        self.out = nn.Linear(D, D)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


@both
@policies
@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
def test_activation_checkpointing_in_blocks(ckpt, policy, overlap, slow_worker):
    """Each block's inner layers run under torch.utils.checkpoint: their forward (and hooks) run again during
    backward; with use_reentrant=True their gradients come from a nested backward pass."""
    run_parity(lambda: Stack(2, ckpt), policy, overlap, auto_capacity="112KiB")


class WholeModel(nn.Module):
    """The root's own forward is checkpointed by the caller: the root's pre-hooks run again in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Stack(2)

    def forward(self, x):
        return self.net(x)


@both
@policies
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_of_the_root_module(reentrant, policy, overlap, slow_worker):
    """The loss function checkpoints the whole model: the root module's forward (memsched's step-begin,
    gradient-binding and wait hooks) runs a second time inside backward."""
    def loss_fn(model, batch):
        x, y = batch
        if reentrant:  # the reentrant variant needs an input that requires grad to backpropagate at all
            x = x.clone().requires_grad_(True)
        return F.mse_loss(checkpoint(model, x, use_reentrant=reentrant), y)

    run_parity(WholeModel, policy, overlap, loss_fn=loss_fn, auto_capacity="112KiB")


# ---- 2. call order different from registration order, and changing between steps -------------------------

class Ordered(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(n))
        self.order = list(range(n))

    def forward(self, x):
        for k in self.order:
            x = torch.tanh(self.layers[k](x))
        return x


def reverse_always(i, model):
    model.order = [3, 2, 1, 0]


def order_changes(i, model):
    model.order = [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1], [1, 3, 0, 2]][i % 4]


@both
@policies
@pytest.mark.parametrize("before", [reverse_always, order_changes], ids=["reversed", "changing"])
def test_layer_order(before, policy, overlap, slow_worker):
    """A ModuleList applied in reverse (the trace's first-use order is the reverse of registration), and an
    order that changes every step (the warmup trace saw the registration order)."""
    run_parity(Ordered, policy, overlap, before=before)


# ---- 3. parameters read by a module that does not own them, or only in the loss ---------------------------

class ParentReads(nn.Module):
    """``mode`` "direct": ``proj`` is never called, the parent reads its weight and bias with F.linear.
    "direct_then_call": the parent reads ``proj.weight`` first, then also calls ``proj``.
    "called_in_warmup": ``proj`` is called in the warmup step (the trace sees it run), later read directly."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.mid = nn.Linear(D, D)
        self.proj = nn.Linear(D, D)
        self.out = nn.Linear(D, D)
        self.mode = mode
        self.call_proj = True

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.mode == "direct" or (self.mode == "called_in_warmup" and not self.call_proj):
            h = torch.tanh(F.linear(h, self.proj.weight, self.proj.bias))
        elif self.mode == "called_in_warmup":
            h = torch.tanh(self.proj(h))
        else:  # direct_then_call
            h = torch.tanh(F.linear(h, self.proj.weight)) + torch.tanh(self.proj(h))
        h = torch.tanh(self.mid(h))
        return self.out(h)


def proj_after_warmup(i, model):
    model.call_proj = i == 0


@both
@policies
@pytest.mark.parametrize("mode", ["direct", "direct_then_call", "called_in_warmup"])
def test_parent_reads_child_parameter(mode, policy, overlap, slow_worker):
    """"direct" passes: the never-called ``proj``'s parameters are given to the nearest traced ancestor (the
    root), whose pre-hook waits. "direct_then_call" and "called_in_warmup" fail under overlap with ``proj``'s
    chunk on the host: the trace saw ``proj`` run, so its parameters' wait is at ``proj``'s pre-hook
    (memsched/planning/first_use.py:51), but the parent's F.linear reads ``proj.weight`` before that hook (or
    with no call to ``proj`` at all), while the worker has not yet updated the chunk: the forward reads the
    previous step's value and the loss differs from the first unsynchronised overlapped forward on."""
    slow_worker["host"] = 0.02  # the stale read must not depend on the machine's load
    run_parity(lambda: ParentReads(mode), policy, overlap,
               before=proj_after_warmup if mode == "called_in_warmup" else None,
               auto_capacity="86KiB" if mode == "direct_then_call" else "79KiB")


class WithExtra(nn.Module):
    """``extra`` (a root parameter) and ``aux.weight`` (a never-called submodule's) are read only by the loss
    function, outside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Stack(2)
        self.aux = nn.Linear(D, D, bias=False)
        self.extra = nn.Parameter(torch.randn(D, D) * 0.1)

    def forward(self, x):
        return self.net(x)


def loss_reading_after_forward(model, batch):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    return loss + model.extra.pow(2).sum() * 1e-2 + (model.aux.weight @ x.T).square().mean()


def loss_reading_before_forward(model, batch):
    x, y = batch
    penalty = model.extra.pow(2).sum() * 1e-2 + (model.aux.weight @ x.T).square().mean()
    return penalty + F.mse_loss(model(x), y)


@both
@pytest.mark.parametrize("policy", POLICIES)
def test_parameters_read_only_in_the_loss_after_the_forward(policy, overlap, slow_worker):
    """``loss + model.extra.pow(2).sum()``: the parameters are read after the model's forward (whose root
    pre-hook waited for their chunks)."""
    run_parity(WithExtra, policy, overlap, loss_fn=loss_reading_after_forward, auto_capacity="152KiB")


@both
@policies
def test_parameters_read_only_in_the_loss_before_the_forward(policy, overlap, slow_worker):
    """The same penalty computed before ``model(x)`` in the loss function: the first read of ``extra`` and
    ``aux.weight`` in the step happens before any module forward, between steps, where they may be host views
    (after a step whose update is still running, too; under ``auto`` some live on the host only). Each read
    that records a graph takes the chunks to the device first, fetching those that live on the host only
    ([Note: graph reads between steps]): exact, with no ``sched.synchronize()``."""
    slow_worker["host"] = 0.02
    run_parity(WithExtra, policy, overlap, loss_fn=loss_reading_before_forward, auto_capacity="152KiB")


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("term", ["penalty", "dropout"])
def test_a_loss_term_before_the_forward_with_gradients_on_the_host_is_exact(term, micro_batches):
    """Policy ``cpu``: from backward's end the parameters and their gradients are host views, so the loss term
    of a second micro-batch, computed before its forward, read host tensors, and backward then added a host
    gradient to device ones (torch's device error, found while fixing the retained graph). Now the term is
    computed on the device, bit for bit as torch computes it, a random one (DropConnect-like dropout of a
    weight) included: the host's generator is set back before the read runs again on the device."""

    def loss_fn(model, batch):
        x, y = batch
        w = F.dropout(model.extra, 0.25) if term == "dropout" else model.extra
        return w.pow(2).sum() * 1e-2 + F.mse_loss(model(x), y)

    torch.manual_seed(0)
    model = WithExtra()
    with uncounted():
        ref = copy.deepcopy(model).to(SIM)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    data = to_dev(batches(3 * micro_batches))
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=CHUNK, **placement("cpu", "")) as sched:
        for i in range(3):
            micro = data[i * micro_batches:(i + 1) * micro_batches]
            for b in micro:
                torch.manual_seed(100 + i)
                (loss_fn(model, b) / micro_batches).backward()
            # host views, read as the device: [Note: parameters read where they compute]
            assert all(p.device == SIM and sched.store.in_host_memory(p) for p in model.parameters())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                for b in micro:
                    torch.manual_seed(100 + i)
                    (loss_fn(ref, b) / micro_batches).backward()
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
                ref_opt.step()
                ref_opt.zero_grad()
                assert_params_same(model, ref, f"step {i}")
        assert {c.placement for c in sched.store.chunks} == {HOST}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_loss_term_before_the_forward_under_mixed_precision_is_exact(dtype):
    """The same in bf16 (clipped in the compute dtype) and fp16 (``sched.backward`` scales the loss): two
    micro-batches whose loss reads ``extra`` and ``aux.weight`` before the forward, against fp32 masters
    trained by fused AdamW (``tests._numerics.Reference``)."""

    def loss_fn(model, batch):
        x, y = batch
        penalty = model.extra.float().pow(2).sum() * 1e-2 + model.aux.weight.float().pow(2).sum() * 1e-3
        return penalty + F.mse_loss(model(x.to(dtype)).float(), y)

    torch.manual_seed(0)
    model = WithExtra()
    ref = Reference(model, dtype)
    data = batches(6)
    clip = 0.05 if dtype == torch.bfloat16 else None
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=CHUNK, dtype=dtype,
                         **placement("cpu", "")) as sched:
        for i in range(3):
            micro = to_dev(data[2 * i:2 * i + 2])
            for b in micro:
                sched.backward(loss_fn(model, b))
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                ref.step(micro, loss_fn, clip)
                assert_same(model, ref, f"step {i}", optimizer=sched.optimizer)


def test_a_graph_read_between_backward_and_step_is_followed_by_an_exact_step():
    """The parameters flattened into one vector with gradients enabled, between backward and the step (a
    logging or a regulariser's bookkeeping): the first view records a graph, so every chunk leaves the host,
    as a forward would make them, and the next parameters are on the device too, while their gradients stay
    on the host. The clip over ``model.parameters()`` and the step then see every gradient, and the step
    makes the chunks host-bound again: exact."""
    torch.manual_seed(0)
    model = WithExtra()
    with uncounted():
        ref = copy.deepcopy(model).to(SIM)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    data = to_dev(batches(3))

    def loss_fn(m, b):
        x, y = b
        return F.mse_loss(m(x), y) + m.aux.weight.pow(2).sum() * 1e-3

    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=CHUNK, **placement("cpu", "")) as sched:
        for i, b in enumerate(data):
            loss_fn(model, b).backward()
            vec = torch.cat([p.reshape(-1) for p in model.parameters()])
            assert vec.device == SIM and vec.grad_fn is not None  # read on the device, as torch reads it
            assert all(p.grad is None or (p.grad.device == SIM and sched.store.in_host_memory(p.grad))
                       for p in model.parameters())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            sched.optimizer.step()
            # host-bound again by the step (their host buffers, read as the device)
            assert all(p.device == SIM and sched.store.in_host_memory(p) for p in model.parameters())
            sched.optimizer.zero_grad()
            with paused(sched):
                loss_fn(ref, b).backward()
                assert same(vec.detach().cpu(), torch.cat([p.reshape(-1) for p in ref.parameters()]).cpu())
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
                ref_opt.step()
                ref_opt.zero_grad()
                assert_params_same(model, ref, f"step {i}")


def test_a_graph_read_between_backward_and_step_leaves_the_clip_every_gradient_with_parameters_on_host():
    """``auto`` keeping some chunks' parameters on the host only: a sum over every parameter with gradients
    enabled, between backward and the step, fetches those chunks and takes every chunk to the device
    ([Note: graph reads between steps]). torch's ``clip_grad_norm_(model.parameters())`` then still sees every
    gradient: the same count and the same total norm at every step, and the same parameters at the end, as
    the run without that read."""

    def run(read: bool):
        torch.manual_seed(0)
        model = WithExtra()
        g = torch.Generator().manual_seed(1)
        seen = []
        sched = memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=4096, policy="auto",
                                device="sim:104KiB")  # some chunks' parameters on the host
        with sched:
            for _ in range(5):
                x, y = torch.randn(4, D, generator=g).to(SIM), torch.randn(4, D, generator=g).to(SIM)
                penalty = sum(p.pow(2).sum() for p in model.parameters()) * 1e-3
                sched.backward(penalty + F.mse_loss(model(x), y))
                if read:
                    total = sum(p.sum() for p in model.parameters())
                    assert total.device == SIM and total.grad_fn is not None
                with_grad = sum(p.grad is not None for p in model.parameters())
                seen.append((with_grad, float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))))
                sched.optimizer.step()
                sched.optimizer.zero_grad()
            assert sched.plan.param_host_chunks  # some parameters live on the host only
        return seen, [p.detach().cpu() for p in model.parameters()]

    seen, params = run(read=False)
    seen_read, params_read = run(read=True)
    assert all(n == len(params) for n, _ in seen) and seen_read == seen
    assert all(same(p, q) for p, q in zip(params, params_read, strict=True))


def test_host_views_between_steps_copy_pickle_and_close_as_plain_parameters():
    """Between backward and ``zero_grad()`` the host chunks' parameters are host views whose class carries
    memsched's check of graph reads ([Note: graph reads between steps]): ``isinstance`` holds, a deepcopy (an
    EMA) and ``torch.save(model)`` (pickle) give plain parameters of the same values, and ``close()`` gives
    every parameter its own class back, with nothing of memsched's left."""
    import io

    from memsched.chunks import binding

    torch.manual_seed(0)
    model = WithExtra()
    x, y = to_dev(batches(1)[0])
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=CHUNK, **placement("cpu", "")) as sched:
        F.mse_loss(model(x), y).backward()
        # host views that read as the device ([Note: parameters read where they compute])
        assert all(isinstance(p, nn.Parameter) and p.device == SIM for p in model.parameters())
        assert any(type(p) is not nn.Parameter for p in model.parameters())  # marked: the check is on
        acc = torch.zeros(model.extra.shape, device=SIM)
        acc.add_(model.extra)  # an in-place op, gradients enabled: run once, where its operands are
        assert same(acc.detach(), model.extra.detach()) and sched.store.in_host_memory(model.extra)
        ema = copy.deepcopy(model)
        pairs = list(zip(model.parameters(), ema.parameters(), strict=True))
        assert all(type(q) is nn.Parameter and same(q.detach(), p.detach()) for p, q in pairs)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert all(type(q) is nn.Parameter and same(q.detach(), p.detach())
                   for p, q in zip(model.parameters(), loaded.parameters(), strict=True))
        sched.optimizer.step()
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert not any(id(p) in binding._MARKS for p in model.parameters())


# ---- 4. one layer applied several times per forward (ALBERT) ------------------------------------------

class Albert(nn.Module):
    def __init__(self, ckpt: str | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.shared = Block()
        self.out = nn.Linear(D, D)
        self.ckpt = ckpt

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            if self.ckpt is None:
                h = self.shared(h)
            else:
                h = checkpoint(self.shared, h, use_reentrant=self.ckpt == "reentrant")
        return self.out(h)


@both
@policies
@pytest.mark.parametrize("ckpt", [None, "reentrant"], ids=["plain", "reentrant"])
def test_layer_shared_across_depth(ckpt, policy, overlap, slow_worker):
    """One block applied three times per forward; with reentrant checkpointing each application is recomputed
    and accumulates into the shared gradients in its own nested backward (each completes the shared chunk)."""
    cap = "80KiB" if ckpt == "reentrant" else "92KiB"
    run_parity(lambda: Albert(ckpt), policy, overlap, auto_capacity=cap)


# ---- 5. branches taken on some steps only ------------------------------------------------------------------

def b_on_even_steps(i, model):
    model.use_b = i % 2 == 0


def b_after_warmup(i, model):
    model.use_b = i in (2, 3, 5)


@both
@policies
@pytest.mark.parametrize("before", [b_on_even_steps, b_after_warmup], ids=["even_steps", "not_in_warmup"])
def test_branch_on_some_steps(before, policy, overlap, slow_worker):
    """``b`` gets no gradient on some steps (torch's AdamW skips it then); in the second case the warmup trace
    never saw it run."""
    run_parity(lambda: Branchy(D, D, D), policy, overlap, before=before)


# ---- 6. others: parametrizations, buffers updated in forward, tied weights read first by a bare module -----

class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(0, 1)


class Parametrized(nn.Module):
    """``lin.weight`` is symmetric via torch.nn.utils.parametrize (the trainable tensor is
    ``lin.parametrizations.weight.original``, read by a ParametrizationList module called from ``lin``);
    ``wn`` uses parametrizations.weight_norm (two originals)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.lin = nn.Linear(D, D)
        parametrize.register_parametrization(self.lin, "weight", Symmetric())
        self.wn = nn.utils.parametrizations.weight_norm(nn.Linear(D, D))
        self.out = nn.Linear(D, D)

    def forward(self, x):
        return self.out(torch.tanh(self.wn(torch.tanh(self.lin(torch.tanh(self.inp(x)))))))


@both
@policies
def test_parametrizations(policy, overlap, slow_worker):
    run_parity(Parametrized, policy, overlap, auto_capacity="87KiB")


class Normed(nn.Module):
    """BatchNorm1d (running stats updated in every training forward), LayerNorm, and the legacy
    torch.nn.utils.spectral_norm (a forward pre-hook of its own computes ``weight`` from the parameter
    ``weight_orig`` and updates the buffers ``weight_u``/``weight_v`` by power iteration)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.mid = nn.utils.spectral_norm(nn.Linear(D, D))
        self.ln = nn.LayerNorm(D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        return self.out(self.ln(torch.tanh(self.mid(self.bn(self.inp(x))))))


@both
@policies
def test_buffers_updated_in_forward(policy, overlap, slow_worker):
    """Parameters bit-exact, and the running statistics and power-iteration vectors equal too (they depend on
    the parameters read)."""
    run_parity(Normed, policy, overlap, auto_capacity="84KiB")


class TwoPart(nn.Module):
    """The training loop never calls the root: it calls ``body`` and then ``head`` (memsched's root hooks, the
    step's start and the re-binding of dropped gradients, never run)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Stack(1)
        self.head = nn.Linear(D, D)


def loss_without_root(model, batch):
    x, y = batch
    return F.mse_loss(model.head(torch.tanh(model.body(x))), y)


@both
@policies
def test_root_module_never_called(policy, overlap, slow_worker):
    """[Note: a forward that never runs the root] (memsched.planning.planner): ``auto`` on a device where the
    warmup fits keeps every parameter on the device (no hook of the root would fetch them), and the run is
    exact."""
    run_parity(TwoPart, policy, overlap, loss_fn=loss_without_root, auto_capacity="105KiB")


def test_root_module_never_called_with_parameters_on_the_host_is_refused_naming_the_module():
    """Where the warmup itself needs parameters on the host (the device holds less than them and the step),
    a submodule called without the root reads them as host tensors on the device: refused at its first
    read, naming the module and the fix, before any update (torch's device error before)."""
    torch.manual_seed(0)
    model = TwoPart()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=CHUNK, policy="auto",
                         device="sim:89KiB") as sched:
        with pytest.raises(RuntimeError, match=r"module 'body.inp' runs outside a forward of the attached "
                                               r"TwoPart.*Call the attached model"):
            sched.backward(loss_without_root(model, to_dev(batches(1))[0]))
    for n, p in model.named_parameters():
        assert torch.equal(p.detach().cpu(), before[n]), n


class TiedBare(nn.Module):
    """``a`` and ``b`` share one weight and have no other parameter. The warmup step calls ``a`` first, later
    steps call ``b`` first (which owns no chunk of its own: it has no wait hook of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.a = nn.Linear(D, D, bias=False)
        self.b = nn.Linear(D, D, bias=False)
        self.b.weight = self.a.weight
        self.out = nn.Linear(D, D)
        self.a_first = True

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        first, second = (self.a, self.b) if self.a_first else (self.b, self.a)
        h = torch.tanh(first(h))
        h = torch.tanh(second(h * 0.5))
        return self.out(h)


def a_first_in_warmup(i, model):
    model.a_first = i == 0


@both
@policies
def test_tied_weight_read_first_by_the_other_module(policy, overlap, slow_worker):
    """Fails under overlap: the shared weight's wait is at ``a``'s pre-hook only (``a`` ran first in the
    warmup trace: memsched/planning/first_use.py:53 keeps the first-called owner), ``b`` gets no wait hook
    (memsched/runtime/waits.py:75-85 installs hooks for owners only), so when ``b`` runs first it reads the
    weight before the worker updated its host chunk."""
    slow_worker["host"] = 0.02
    run_parity(TiedBare, policy, overlap, before=a_first_in_warmup, auto_capacity="63KiB")
