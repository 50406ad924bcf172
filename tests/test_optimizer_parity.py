"""HybridAdamW equals torch.optim.AdamW: mixed device/host chunks, param groups, LR schedulers, clipping,
every built-in policy through memsched.attach on the stand-in device; failed steps change nothing."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memsched
from memsched.chunks import PARAM_ALIGN, Allocator, ChunkStore
from memsched.devices.transfers import Streams, TransferStats
from memsched.optim.hybrid_adamw import HybridAdamW
from policies.types import DEVICE, HOST
from tests._numerics import LR, SIM, WD, Reference, assert_same, same, to_dev

RTOL = 1e-6


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        # Registered out of call order on purpose: first-use re-packing has something to do.
        self.l2 = nn.Linear(32, 32)
        self.l1 = nn.Linear(16, 32)
        self.l3 = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))))


def groups_of(m: MLP) -> list[dict]:
    return [{"params": [*m.l1.parameters(), *m.l2.parameters(), *m.l3.parameters()], "lr": 1e-2,
             "weight_decay": 0.1},
            {"params": list(m.out.parameters()), "lr": 3e-3, "weight_decay": 0.0}]


def rel_err(model: nn.Module, ref: nn.Module) -> float:
    return max(((a.cpu() - b.cpu()).abs().max() / b.abs().max().cpu().clamp_min(1e-12)).item()
               for a, b in zip(model.parameters(), ref.parameters(), strict=True))


def make_hybrid(model: nn.Module, groups: list[dict], placements, chunk_numel=1100):
    alloc = Allocator(torch.device("cpu"))
    store = ChunkStore([g["params"] for g in groups], alloc, chunk_numel=chunk_numel)
    for i, c in enumerate(store.chunks):
        c.init_state(placements[i % len(placements)], alloc)
    transfers = TransferStats()
    opt = HybridAdamW(store, groups, defaults={"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                               "weight_decay": 0.01},
                      streams=Streams(torch.device("cpu")), transfers=transfers,
                      names={id(p): n for n, p in model.named_parameters()})
    return opt, store, transfers


def train(model, opt, sched, xs, clip=None):
    for x in xs:
        loss = model(x).pow(2).mean()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("placements", [(DEVICE,), (HOST,), (DEVICE, HOST)])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_parity_groups_lr_scheduler_clip(placements, clip):
    torch.manual_seed(0)
    m = MLP()
    ref = copy.deepcopy(m)
    opt, store, transfers = make_hybrid(m, groups_of(m), placements)
    ropt = torch.optim.AdamW(groups_of(ref), lr=1e-3)
    lam = lambda s: 1.0 / (1 + s)  # noqa: E731
    xs = [torch.randn(8, 16) for _ in range(5)]
    train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lam), xs, clip)
    train(ref, ropt, torch.optim.lr_scheduler.LambdaLR(ropt, lam), xs, clip)
    assert rel_err(m, ref) < RTOL
    assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"]
    host_numel = sum(c.numel for c in store.chunks if c.placement == HOST)
    assert transfers.steps == 5
    assert transfers.h2d_bytes == 5 * host_numel * 4
    # The gradients of host chunks are copied once per step, at the step, after clipping: never twice.
    assert transfers.d2h_bytes == 5 * host_numel * 4


def test_gradient_writes_invisible_to_version_counters_reach_the_host_update():
    """``p.grad.data.mul_()`` bumps no version counter the optimizer could watch; the host update still sees
    it, because host gradients are copied at the step, after everything that may write them."""
    torch.manual_seed(0)
    m = MLP()
    ref = copy.deepcopy(m)
    opt, store, _ = make_hybrid(m, groups_of(m), (HOST,))
    ropt = torch.optim.AdamW(groups_of(ref), lr=1e-3, fused=True)
    x = torch.randn(8, 16)
    for model, o in ((m, opt), (ref, ropt)):
        model(x).pow(2).mean().backward()
        versions = [p.grad._version for p in model.parameters()]
        for p in model.parameters():
            p.grad.data.mul_(0.25)
        assert [p.grad._version for p in model.parameters()] == versions
        o.step()
    for a, b in zip(m.parameters(), ref.parameters(), strict=True):
        assert same(a, b)


def test_unused_parameters_and_grads_set_to_none():
    """Parameters without a gradient are updated with a zero gradient (torch.optim.AdamW with
    zero_grad(set_to_none=False) behaves the same)."""
    torch.manual_seed(0)
    m = MLP()
    ref = copy.deepcopy(m)
    opt, _, _ = make_hybrid(m, groups_of(m), (HOST, DEVICE))
    ropt = torch.optim.AdamW(groups_of(ref), lr=1e-3)
    for _ in range(3):
        x = torch.randn(8, 16)
        for model, o in ((m, opt), (ref, ropt)):
            model.zero_grad(set_to_none=True)  # nn.Module.zero_grad: grads to None
            model.out(torch.tanh(model.l1(x))).sum().backward()  # l2, l3 unused
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            o.step()
    assert rel_err(m, ref) < RTOL


def snapshot(store):
    return [t.clone() for c in store.chunks
            for t in (c.data, c.master_view(), c.exp_avg, c.exp_avg_sq, c.steps)]


@pytest.mark.parametrize("bad, match", [
    ({"lr": float("nan")}, "param group 1: lr must be a finite number >= 0, got nan"),
    ({"betas": (0.9, 1.0)}, "param group 1: betas must be two numbers in \\[0, 1\\)"),
    ({"weight_decay": -1.0}, "param group 1: weight_decay"),
    ({"eps": float("inf")}, "param group 1: eps"),
    ({"amsgrad": True}, "amsgrad"),
])
def test_failed_step_changes_nothing(bad, match):
    torch.manual_seed(0)
    m = MLP()
    opt, store, transfers = make_hybrid(m, groups_of(m), (DEVICE, HOST))
    train(m, opt, None, [torch.randn(8, 16)])
    m(torch.randn(8, 16)).pow(2).mean().backward()
    before = snapshot(store)
    steps = transfers.steps
    opt.param_groups[1].update(bad)
    with pytest.raises(ValueError, match=match):
        opt.step()
    for a, b in zip(before, snapshot(store), strict=True):
        assert same(a, b)
    assert transfers.steps == steps


def test_user_writes_to_parameters_reach_the_host_master():
    torch.manual_seed(0)
    m = MLP()
    ref = copy.deepcopy(m)
    opt, _, _ = make_hybrid(m, groups_of(m), (HOST,))
    ropt = torch.optim.AdamW(groups_of(ref), lr=1e-3)
    train(m, opt, None, [torch.randn(8, 16)])
    train(ref, ropt, None, [torch.randn(8, 16)])
    m.load_state_dict(ref.state_dict())  # in-place copies into the parameter views
    opt.load_state_dict(ropt.state_dict())
    xs = [torch.randn(8, 16) for _ in range(2)]
    train(m, opt, None, xs)
    train(ref, ropt, None, xs)
    assert rel_err(m, ref) < RTOL


def test_add_param_group_after_construction_is_refused():
    m = MLP()
    opt, _, _ = make_hybrid(m, groups_of(m), (DEVICE,))
    with pytest.raises(RuntimeError, match="after attach"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


# ---- through memsched.attach on the stand-in device, every built-in policy -------------------------------
def run_attached(m: MLP, xs, lam, **kw) -> memsched.Scheduler:
    with memsched.attach(m, params=groups_of(m), lr=1e-3, chunk_numel=1200, **kw) as sched:
        lr_sched = torch.optim.lr_scheduler.LambdaLR(sched.optimizer, lam)
        for i, x in enumerate(xs):
            sched.backward(m(x.to(sched.device.torch_device)).pow(2).mean())
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            assert (sched.plan is None) == (i == 0)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            lr_sched.step()
    return sched


@functools.cache
def base_and_chunks() -> tuple[int, tuple[int, ...]]:
    """(capacity - margin, each chunk's device bytes in first-use order) of the MLP run below, from a warmup
    on a roomy device."""
    torch.manual_seed(0)
    sched = run_attached(MLP(), [torch.randn(8, 16) for _ in range(2)], lambda s: 1.0, policy="cpu",
                         device="sim:1GiB")
    p = sched.problem
    return p.capacity_bytes - p.margin_bytes, tuple(c.device_bytes for c in p.chunks)


@pytest.mark.parametrize("policy", ["cpu", "cuda", "static", "auto"])
def test_attach_parity_every_policy_on_the_stand_in(policy):
    base, chunk_dev = base_and_chunks()
    assert len(chunk_dev) >= 3
    ratio = 0.8
    # Room for the first two chunks of optimizer state within the ratio (one and a half was enough before the
    # stand-in counted every device allocation, rounded to 512 B): auto must split.
    capacity = base + int(sum(chunk_dev[:2]) / ratio) + 1
    if policy == "cuda":
        capacity = base + sum(chunk_dev) + 1  # cuda needs everything on the device
    torch.manual_seed(0)
    m = MLP()
    ref = copy.deepcopy(m)
    lam = lambda s: 0.5 ** s  # noqa: E731
    xs = [torch.randn(8, 16) for _ in range(5)]
    # The reference runs first: everything allocated while the stand-in is active counts against it.
    ropt = torch.optim.AdamW(groups_of(ref), lr=1e-3)
    train(ref, ropt, torch.optim.lr_scheduler.LambdaLR(ropt, lam), xs, 0.5)
    sched = run_attached(m, xs, lam, policy=policy, device=f"sim:{capacity}B", gpu_margin_mem_ratio=ratio)
    assert rel_err(m, ref) < RTOL
    placement = sched.plan.placement
    assert sched.problem.capacity_bytes - sched.problem.margin_bytes == base  # same trace, same numbers
    if policy == "auto":
        assert DEVICE in placement and HOST in placement, placement
    if policy == "cuda":
        assert set(placement) == {DEVICE}
    if policy == "cpu":
        assert set(placement) == {HOST}
    # Transfers: host chunks move their gradients down and parameters up each step after warmup.
    host_bytes = sum(c.numel * 4 for c in sched.store.chunks if c.placement == HOST)
    assert sched.transfers.last_h2d_bytes == host_bytes


class BigEmbedding(nn.Module):
    """An embedding and a head each eight times the blocks between them (GPT-2's shape in small)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(2048, 32)
        self.blocks = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
        self.head = nn.Linear(32, 2048, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.blocks(self.emb(x))))


def _big_embedding_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
def test_exact_chunks_train_bit_exactly_with_a_large_parameter_in_a_chunk_of_its_own(policy):
    torch.manual_seed(0)
    model = BigEmbedding()
    ref = Reference(model, device=SIM)
    g = torch.Generator().manual_seed(1)
    batches = [to_dev((torch.randint(0, 2048, (2, 8), generator=g),
                       torch.randint(0, 2048, (2, 8), generator=g))) for _ in range(3)]
    with memsched.attach(model, policy=policy, device="sim:64MiB", lr=LR, weight_decay=WD,
                         warmup_steps=1) as sched:
        chunks = sched.store.chunks
        # every chunk as long as what it holds (each parameter aligned: [Note: parameter alignment in
        # chunks]); the embedding and the head alone in theirs
        ends = [max(off + n for off, n in c.ranges) for c in chunks]
        assert [c.numel for c in chunks] == [-(-end // PARAM_ALIGN) * PARAM_ALIGN for end in ends]
        assert all(off % PARAM_ALIGN == 0 for c in chunks for off, _n in c.ranges)
        alone = [c.params for c in chunks if len(c.params) == 1]
        assert any(ps[0] is model.emb.weight for ps in alone)
        assert any(ps[0] is model.head.weight for ps in alone)
        assert sched.store.layout.chunk_numel < model.emb.weight.numel()
        for b in batches:
            sched.backward(_big_embedding_loss(model, b))
            norm = sched.clip_grad_norm_(0.01)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            assert float(norm) > 0.05  # the clip triggers
            with sched.sim.paused():
                ref.step(b, _big_embedding_loss, 0.01)
                assert_same(model, ref, f"{policy}", sched.optimizer)
        assert {c.placement for c in chunks} == {HOST if policy == "cpu" else DEVICE}
