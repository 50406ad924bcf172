"""HybridAdamW.state_dict has torch.optim.AdamW's format: bit-exact round trips, loads both ways."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memsched
from tests._numerics import SIM, same, uncounted


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 5))


def groups(m: nn.Module) -> list[dict]:
    return [{"params": [*m[0].parameters(), *m[2].parameters()], "weight_decay": 0.1},
            {"params": list(m[4].parameters()), "lr": 5e-3, "weight_decay": 0.0}]


def attach(m: nn.Module, policy: str = "static") -> memsched.Scheduler:
    # "static" with half of the optimizer state offloaded: chunks on both sides.
    options = {"offload_optim_frac": 0.5} if policy == "static" else {}
    return memsched.attach(m, policy=policy, policy_options=options, device="sim:1MiB", params=groups(m),
                           lr=1e-2, chunk_numel=420)


def run(m, opt, xs, backward=None):
    for x in xs:
        loss = m(x).pow(2).mean()
        (backward or (lambda t: t.backward()))(loss)
        opt.step()
        opt.zero_grad()


def data(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 10, generator=g).to(SIM) for _ in range(n)]


def rel_err(a: nn.Module, b: nn.Module) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a.parameters(), b.parameters(),
                                                                          strict=True))


def test_format_and_loading_into_torch_adamw_and_back():
    m = make_model()
    with uncounted():  # the reference, on the stand-in beside the schedulers, is not counted
        ref = copy.deepcopy(m).to(SIM)
    sched = attach(m)
    run(m, sched.optimizer, data(3, 1), sched.backward)
    placements = {c.placement for c in sched.store.chunks}
    assert placements == {"device", "host"}, placements  # the state comes from both sides
    sd = sched.optimizer.state_dict()
    sched.close()

    with uncounted():
        ropt = torch.optim.AdamW(groups(ref), lr=1e-2)
        ref.load_state_dict(m.state_dict())
        ropt.load_state_dict(sd)
        rsd = ropt.state_dict()
    assert sd.keys() == rsd.keys() and sorted(sd["state"]) == sorted(rsd["state"]) == list(range(6))
    for i, st in sd["state"].items():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        assert st["exp_avg"].shape == list(ref.parameters())[i].shape and float(st["step"]) == 3.0
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in rsd["param_groups"]]
    assert sd["param_groups"][1]["lr"] == 5e-3

    # Continue both from the same point: plain AdamW and memsched (loading AdamW's state back).
    m2 = copy.deepcopy(ref)
    with attach(m2) as sched2:
        sched2.optimizer.load_state_dict(ropt.state_dict())
        xs = data(2, 2)
        with sched2.sim.paused():
            run(ref, ropt, xs)
        run(m2, sched2.optimizer, xs, sched2.backward)
    assert rel_err(m2, ref) < 1e-6


def test_round_trip_is_bit_exact_and_resumes_identically():
    m = make_model()
    with attach(m) as sched:
        run(m, sched.optimizer, data(3, 1), sched.backward)
        sd = sched.optimizer.state_dict()
        m_twin = copy.deepcopy(m)
    with attach(m_twin) as twin:
        twin.optimizer.load_state_dict(sd)
        sd2 = twin.optimizer.state_dict()
    for i in sd["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert same(sd["state"][i][k], sd2["state"][i][k])
    assert sd["param_groups"] == sd2["param_groups"]


def test_from_torch_adamw_into_memsched():
    with uncounted():  # the reference, on the stand-in beside the scheduler, is not counted
        ref = make_model().to(SIM)
        ropt = torch.optim.AdamW(groups(ref), lr=1e-2)
        run(ref, ropt, data(3, 1))
    m = copy.deepcopy(ref)
    with attach(m, policy="cpu") as sched:
        sched.optimizer.load_state_dict(ropt.state_dict())
        xs = data(3, 2)
        run(m, sched.optimizer, xs, sched.backward)
    run(ref, ropt, xs)
    assert rel_err(m, ref) < 1e-6


def test_bad_state_dicts_change_nothing():
    m = make_model()
    with attach(m) as sched:
        run(m, sched.optimizer, data(2, 1), sched.backward)
        sd = sched.optimizer.state_dict()
        with sched.sim.paused():
            before = [t.clone() for c in sched.store.chunks for t in (c.exp_avg, c.exp_avg_sq, c.steps)]
        bad = copy.deepcopy(sd)
        bad["state"][5]["exp_avg"] = torch.zeros(3)
        with pytest.raises(ValueError, match="shape \\(3,\\), expected \\(5,\\)"):
            sched.optimizer.load_state_dict(bad)
        with pytest.raises(ValueError, match="1 param groups"):
            sched.optimizer.load_state_dict({"state": {}, "param_groups": sd["param_groups"][:1]})
        bad = copy.deepcopy(sd)
        bad["state"][0]["step"] = "seven"
        with pytest.raises(ValueError, match="'step' of parameter .* must be a number >= 0, got 'seven'"):
            sched.optimizer.load_state_dict(bad)
        bad = copy.deepcopy(sd)
        bad["param_groups"][0]["lr"] = -1.0
        with pytest.raises(ValueError, match="param group 0: lr"):
            sched.optimizer.load_state_dict(bad)
        after = [t for c in sched.store.chunks for t in (c.exp_avg, c.exp_avg_sq, c.steps)]
        assert all(same(a, b) for a, b in zip(before, after, strict=True))
        assert sched.optimizer.param_groups[0]["lr"] == 1e-2


def test_each_parameter_keeps_its_own_step_count():
    """torch.optim.AdamW keeps one step per parameter; so does memsched (a chunk's may differ)."""
    m = make_model()
    with attach(m) as sched:
        run(m, sched.optimizer, data(2, 1), sched.backward)
        sd = sched.optimizer.state_dict()
        sd["state"][0]["step"] = torch.tensor(7.0)  # parameter 1 (same chunk) stays at step 2
        sched.optimizer.load_state_dict(sd)
        back = sched.optimizer.state_dict()
    assert float(back["state"][0]["step"]) == 7.0 and float(back["state"][1]["step"]) == 2.0
