"""``torch.optim.AdamW`` state dicts load into memsched's optimizer and back, bit for bit against continuing
with ``torch.optim.AdamW(fused=True)``: parameters without state (one that never got a gradient, frozen ones
listed in the groups of an AdamW built over all parameters) and a param group of frozen parameters only,
which keeps its index (per-group LR schedulers such as OneCycleLR with a list of ``max_lr``)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import memsched
from tests._numerics import SIM, same, uncounted

LR, WD = 1e-2, 0.1
STEPS, CUT = 7, 3

PLACEMENTS = {
    "cpu": dict(policy="cpu", device="sim:64MiB"),
    "cuda": dict(policy="cuda", device="sim:64MiB"),
    "static": dict(policy="static", device="sim:64MiB", policy_options={"offload_optim_frac": 0.5}),
}


class Net(nn.Module):
    """``embed`` is frozen when asked (a LoRA-style frozen base layer); ``aux`` is used only when asked."""

    def __init__(self, frozen: bool = True, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(8, 8)
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4)
        self.embed.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(self.embed(x)))
        return self.head(h) + self.aux(h) if use_aux else self.head(h)


def batches(n: int) -> list[tuple[torch.Tensor, bool]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g).to(SIM), i % 2 == 1) for i in range(n)]


def loss(model: nn.Module, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
    return model(x, use_aux).pow(2).mean()


def paused(sched: memsched.Scheduler | None) -> contextlib.AbstractContextManager:
    """Reference work and state-dict copies are not the stand-in device's memory (a reference run without a
    scheduler too: it may live on beside a later one)."""
    return sched.sim.paused() if sched is not None and sched.sim is not None else uncounted()


def state_by_name(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, dict[str, Any]]:
    """A torch optimizer's state keyed by parameter name: comparable whatever the numbering."""
    return {n: opt.state[p] for n, p in model.named_parameters() if p in opt.state}


def assert_same_state(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> None:
    assert sorted(a) == sorted(b)
    for name, st in b.items():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert same(a[name][k], st[k]), (name, k)


def assert_same_params(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert same(p.detach(), q.detach()), (what, n)


def in_torch(sd: dict[str, Any], model: Net, params: Any) -> torch.optim.AdamW:
    """``sd`` loaded into a ``torch.optim.AdamW(fused=True)`` built as ``params(model)``."""
    opt = torch.optim.AdamW(params(model), lr=LR, weight_decay=WD, fused=True)
    opt.load_state_dict(copy.deepcopy(sd))
    return opt


def torch_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, use_aux: bool) -> None:
    loss(model, x, use_aux).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize(
    "frozen, torch_params",
    [(False, "all"), (True, "all"), (True, "trainable")],
    ids=["never-updated", "frozen-adamw-over-all", "frozen-adamw-over-trainable"],
)
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_torch_state_without_entries_loads_and_trains_on(placement, frozen, torch_params):
    """torch keeps no state for ``aux`` (never got a gradient) nor for the frozen ``embed``; an AdamW over
    all parameters still numbers ``embed``. Loading gives memsched's ``aux`` no state (step 0, zero moments)
    although memsched had trained it, training on equals torch bit for bit, and memsched's state dict numbers
    the parameters as given to attach (all of them): it loads into an AdamW over all parameters, which then
    continues exactly as the uninterrupted torch run."""
    def build_params(m: nn.Module) -> list[nn.Parameter]:
        return [p for p in m.parameters() if torch_params == "all" or p.requires_grad]

    xs = batches(STEPS + 2)
    with uncounted():  # the reference lives on the stand-in beside the scheduler, not counted
        ref = Net(frozen).to(SIM)
        ropt = torch.optim.AdamW(build_params(ref), lr=LR, weight_decay=WD, fused=True)
        for x, _ in xs[:CUT]:
            torch_step(ref, ropt, x, False)
        rsd = ropt.state_dict()
    stateless = {"aux.weight", "aux.bias"} | ({"embed.weight", "embed.bias"} if frozen else set())
    assert {n for n, _ in ref.named_parameters()} - set(state_by_name(ropt, ref)) == stateless  # the premise

    model = Net(frozen, seed=7)
    with memsched.attach(model, lr=LR, weight_decay=WD, chunk_numel=200, **PLACEMENTS[placement]) as sched:
        for x, _ in xs[:2]:  # memsched has state for aux before loading: loading must clear it
            sched.backward(loss(model, x, True))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        with paused(sched):
            model.load_state_dict(ref.state_dict())
            sched.optimizer.load_state_dict(copy.deepcopy(rsd))
        for i, (x, use_aux) in enumerate(xs[CUT:STEPS]):  # aux gets its first gradient here: from step 0
            sched.backward(loss(model, x, use_aux))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with paused(sched):
                torch_step(ref, ropt, x, use_aux)
                assert_same_params(model, ref, f"step {CUT + i}")
        with paused(sched):
            sd = sched.optimizer.state_dict()
            weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert [g["params"] for g in sd["param_groups"]] == [list(range(8))]  # every parameter given, in order
    back_model = Net(frozen, seed=7).to(SIM)
    back_model.load_state_dict(weights)
    back = in_torch(sd, back_model, lambda m: m.parameters())
    assert_same_state(state_by_name(back, back_model), state_by_name(ropt, ref))
    for x, use_aux in xs[STEPS:]:
        torch_step(back_model, back, x, use_aux)
        torch_step(ref, ropt, x, use_aux)
    assert_same_params(back_model, ref, "torch AdamW resumed from memsched's state dict")


def groups(m: Net) -> list[dict[str, Any]]:
    """Group 0 holds frozen parameters only (its index must stay 0)."""
    return [{"params": list(m.embed.parameters()), "lr": 1e-3},
            {"params": [*m.trunk.parameters(), *m.head.parameters()], "weight_decay": 0.05},
            {"params": list(m.aux.parameters()), "lr": 5e-3}]


MAX_LR = [1e-3, 2e-2, 1e-2]  # one per group, as torch's OneCycleLR requires


class Run:
    """Training of ``model`` with memsched or ``torch.optim.AdamW(fused=True)`` over :func:`groups`, with an
    OneCycleLR per group; state saved and loaded as a training script resumes."""

    def __init__(self, kind: str, model: Net) -> None:
        self.model = model
        self.sched = None
        if kind == "memsched":
            self.sched = memsched.attach(model, params=groups(model), lr=LR, weight_decay=WD, chunk_numel=200,
                                         **PLACEMENTS["static"])
            self.opt = self.sched.optimizer
        else:
            with uncounted():  # on the stand-in, as the scheduler's model, beside it and not counted
                model.to(SIM)
            self.opt = torch.optim.AdamW(groups(model), lr=LR, weight_decay=WD, fused=True)
        self.lr = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=MAX_LR, total_steps=STEPS)

    def step(self, x: torch.Tensor, use_aux: bool) -> None:
        with paused(None) if self.sched is None else contextlib.nullcontext():
            if self.sched is not None:
                self.sched.backward(loss(self.model, x, use_aux))
            else:
                loss(self.model, x, use_aux).backward()
            self.opt.step()
            self.lr.step()
            self.opt.zero_grad()

    def save(self) -> tuple[dict[str, Any], ...]:
        with paused(self.sched):
            model_sd = {k: v.clone() for k, v in self.model.state_dict().items()}
            return model_sd, self.opt.state_dict(), self.lr.state_dict()

    def load(self, saved: tuple[dict[str, Any], ...]) -> None:
        model_sd, opt_sd, lr_sd = copy.deepcopy(saved)
        with paused(self.sched):
            self.model.load_state_dict(model_sd)
            self.opt.load_state_dict(opt_sd)
            self.lr.load_state_dict(lr_sd)

    @contextlib.contextmanager
    def running(self) -> Iterator[Run]:
        with self.sched if self.sched is not None else contextlib.nullcontext():
            yield self


@pytest.mark.parametrize("first, then",
                         [("memsched", "memsched"), ("torch", "memsched"), ("memsched", "torch")])
def test_frozen_only_group_keeps_its_index(first, then):
    """A run of ``first`` interrupted after CUT steps and resumed with ``then`` from the state dicts (model,
    optimizer, OneCycleLR) ends exactly where uninterrupted torch AdamW ends."""
    xs = batches(STEPS)
    ref = Run("torch", Net())
    for x, use_aux in xs:
        ref.step(x, use_aux)

    with Run(first, Net()).running() as run:
        for x, use_aux in xs[:CUT]:
            run.step(x, use_aux)
        saved = run.save()
    opt_sd = saved[1]
    assert [g["params"] for g in opt_sd["param_groups"]] == [[0, 1], [2, 3, 4, 5], [6, 7]]  # torch's
    assert [g["lr"] for g in opt_sd["param_groups"]][0] < MAX_LR[0]  # group 0's own schedule

    with Run(then, Net(seed=7)).running() as run:
        run.load(saved)
        for x, use_aux in xs[CUT:]:
            run.step(x, use_aux)
        with paused(run.sched):
            assert_same_params(run.model, ref.model, f"{first} then {then}")
            assert [g["lr"] for g in run.opt.param_groups] == [g["lr"] for g in ref.opt.param_groups]
            assert [g["betas"] for g in run.opt.param_groups] == [g["betas"] for g in ref.opt.param_groups]
            sd = run.opt.state_dict()
            if run.sched is not None:
                assert len(run.opt.param_groups) == 3 and run.opt.param_groups[0]["params"] == []
    fresh = Net()
    assert_same_state(state_by_name(in_torch(sd, fresh, groups), fresh), state_by_name(ref.opt, ref.model))
