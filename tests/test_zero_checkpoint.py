"""Sharded DCP checkpoints: written by 2 ranks (ZeRO-2), loaded by 3 ranks (ZeRO-1) and by one process, and
training goes on as if never interrupted (parity with single-process AdamW over all the steps)."""

from __future__ import annotations

import pytest
import torch

import memsched
from memsched import checkpoint
from tests._dist_utils import run_ranks
from tests._numerics import same
from tests.test_zero import BATCH, LR, WD, _rel, batches, make_model, reference

pytestmark = pytest.mark.slow  # several processes per test: started first (tests/conftest.py)

STEPS = 3
SIM = {"device": "sim:64MiB", "policy": "static", "policy_options": {"offload_optim_frac": 0.5}}


def _steps(sched: memsched.Scheduler, model: torch.nn.Module, rank: int, world: int, which: range) -> None:
    per = BATCH // world
    all_batches = batches(STEPS, 1)
    for s in which:
        x, y = all_batches[s][0]
        dt = next(model.parameters()).dtype
        dev = sched.device.torch_device
        xs, ys = x[rank * per : (rank + 1) * per].to(dev, dt), y[rank * per : (rank + 1) * per].to(dev, dt)
        sched.backward(torch.nn.functional.mse_loss(model(xs), ys))
        sched.optimizer.step()
        sched.optimizer.zero_grad()


def _save_rank(rank: int, world: int, path: str, dtype: torch.dtype | None) -> None:
    model = make_model()
    with memsched.attach(model, lr=LR, weight_decay=WD, zero_stage=2, dtype=dtype, **SIM) as sched:
        _steps(sched, model, rank, world, range(STEPS - 1))
        checkpoint.save(sched, path)


def _load_rank(rank: int, world: int, path: str, dtype: torch.dtype | None) -> dict:
    model = make_model(seed=7)  # other weights: the checkpoint must replace them
    with memsched.attach(model, lr=LR * 5, weight_decay=WD, zero_stage=1, dtype=dtype, **SIM) as sched:
        checkpoint.load(sched, path)
        lr = sched.optimizer.param_groups[0]["lr"]
        _steps(sched, model, rank, world, range(STEPS - 1, STEPS))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "lr": lr}


def test_checkpoint_saved_on_2_ranks_loads_on_3_ranks_and_in_one_process(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(_save_rank, 2, path, None, timeout=120)
    ref, _ = reference(STEPS, 1)
    for world, res in [
        (3, run_ranks(_load_rank, 3, path, None, timeout=120)),
        (1, [_load_rank(0, 1, path, None)]),
    ]:
        for r in range(world):
            assert res[r]["lr"] == LR  # hyper-parameters come from the checkpoint
            for name, want in ref.items():
                assert _rel(res[r]["params"][name], want) < 1e-6, (world, r, name)


def _save_state(rank: int, world: int, path: str, dtype: torch.dtype | None) -> dict:
    model = make_model()
    with memsched.attach(model, lr=LR, weight_decay=WD, zero_stage=2, dtype=dtype, **SIM) as sched:
        _steps(sched, model, rank, world, range(STEPS - 1))
        checkpoint.save(sched, path)
        return {
            "state": sched.optimizer.state_dict()["state"],
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        }


def _load_state(rank: int, world: int, path: str, dtype: torch.dtype | None) -> dict:
    model = make_model(seed=7)
    with memsched.attach(model, lr=LR, weight_decay=WD, zero_stage=1, dtype=dtype, **SIM) as sched:
        checkpoint.load(sched, path)
        return {
            "state": sched.optimizer.state_dict()["state"],
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        }


def test_checkpoint_round_trip_is_exact_with_fp32_masters(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_state, 2, path, torch.bfloat16, timeout=120)[0]
    loaded = [
        *run_ranks(_load_state, 3, path, torch.bfloat16, timeout=120),
        _load_state(0, 1, path, torch.bfloat16),
    ]
    assert "master_weight" in saved["state"][0]
    for res in loaded:  # 3 ranks and one process: the same fp32 masters, moments, steps and bf16 parameters
        for i, st in saved["state"].items():
            for k, v in st.items():
                assert same(res["state"][i][k], v), (i, k)
        for n, p in saved["params"].items():
            assert same(res["params"][n], p), n
