"""ZeRO-1/2/3 at 2 gloo ranks, bit for bit against plain PyTorch: each rank's gradients computed on its own
micro-batches, averaged ((g0 + g1) / 2), clipped by ``torch.nn.utils.clip_grad_norm_`` and stepped by
``torch.optim.AdamW(fused=True)``.

Covers clipping that triggers (through memsched, with host- and device-placed chunks), and gradient
accumulation with a parameter unused in one micro-batch (readiness is per backward pass: a chunk is never
reduced while a backward still writes into it).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import memsched
from tests._dist_utils import run_ranks
from tests._numerics import same

WORLD, STEPS, LR, WD, CLIP = 2, 3, 1e-2, 0.1, 0.05
PER_RANK = 4


class AuxNet(nn.Module):
    """``aux`` runs only when asked: unused in some micro-batches."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.aux = nn.Linear(13, 13)
        self.b = nn.Linear(13, 5)

    def forward(self, x, use_aux: bool = True):
        h = torch.tanh(self.a(x))
        if use_aux:
            h = h + torch.tanh(self.aux(h))
        return self.b(h)


def make_model() -> AuxNet:
    torch.manual_seed(0)
    return AuxNet()


def data(accum: int):
    g = torch.Generator().manual_seed(3)
    # [step][micro][rank] -> (x, y, use_aux); aux unused in the first micro-batch of each step
    return [[[(torch.randn(PER_RANK, 7, generator=g), torch.randn(PER_RANK, 5, generator=g), k > 0 or accum ==
    1)
              for _ in range(WORLD)] for k in range(accum)] for _ in range(STEPS)]


def loss_of(model, x, y, use_aux, accum):
    dev = next(model.parameters()).device  # the stand-in's for memsched, the CPU for references
    return nn.functional.mse_loss(model(x.to(dev), use_aux), y.to(dev)) / accum


def reference(accum: int, clip: float | None) -> dict[str, torch.Tensor]:
    model = make_model().to("sim")  # on the stand-in, as memsched: its backward runs where memsched's does
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    for step in data(accum):
        per_rank = []
        for r in range(WORLD):
            model.zero_grad()
            for micro in step:
                loss_of(model, *micro[r], accum).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *per_rank, strict=True):
            p.grad = torch.add(g0, g1).div_(WORLD)  # all-reduce SUM, then / world
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank(rank: int, world: int, cfgs: list[dict]) -> list[dict]:
    return [_rank_run(rank, cfg) for cfg in cfgs]


def _rank_run(rank: int, cfg: dict) -> dict:
    import warnings

    model = make_model()
    accum = cfg["accum"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with memsched.attach(model, policy="static", policy_options={"offload_optim_frac": 0.5},
                             device="sim:64MiB", chunk_numel=cfg["chunk_numel"], lr=LR, weight_decay=WD,
                             zero_stage=cfg["stage"], overlap=cfg.get("overlap", False)) as sched:
            norms = []
            for step in data(accum):
                for k, micro in enumerate(step):
                    ctx = sched.no_sync() if k < accum - 1 else contextlib.nullcontext()
                    with ctx:
                        sched.backward(loss_of(model, *micro[rank], accum))
                if cfg["clip"] is not None:
                    norms.append(float(sched.clip_grad_norm_(cfg["clip"])))
                sched.optimizer.step()
                sched.optimizer.zero_grad()
            places = {c.placement for c in sched.store.chunks}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms,
            "places": places, "chunks": len(sched.store.chunks), "warnings": [str(w.message) for w in seen]}


CFGS = [
    {"stage": 1, "clip": CLIP, "accum": 1, "chunk_numel": 170},
    {"stage": 2, "clip": CLIP, "accum": 1, "chunk_numel": 170},
    {"stage": 2, "clip": None, "accum": 2, "chunk_numel": 400},  # one chunk: aux shares it with the rest
    {"stage": 1, "clip": CLIP, "accum": 2, "chunk_numel": 400},
    # overlap=True: host shards updated on the worker, all-gathered by the training thread in chunk order
    {"stage": 1, "clip": CLIP, "accum": 2, "chunk_numel": 170, "overlap": True},
    {"stage": 2, "clip": CLIP, "accum": 1, "chunk_numel": 170, "overlap": True},
    # overlap="backward" needs one rank: it warns and runs as overlap=True
    {"stage": 1, "clip": None, "accum": 1, "chunk_numel": 170, "overlap": "backward"},
    {"stage": 3, "clip": CLIP, "accum": 1, "chunk_numel": 170},
    {"stage": 3, "clip": None, "accum": 2, "chunk_numel": 400},
    {"stage": 3, "clip": CLIP, "accum": 2, "chunk_numel": 170, "overlap": True},
    {"stage": 3, "clip": CLIP, "accum": 1, "chunk_numel": 170, "overlap": "backward"},
]


@pytest.mark.slow
def test_zero_clipping_and_accumulation_bit_exact():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_ranks(_rank, WORLD, CFGS, timeout=120)
    for i, cfg in enumerate(CFGS):
        ref = reference(cfg["accum"], cfg["clip"])
        for r in range(WORLD):
            res = results[r][i]
            if cfg["chunk_numel"] == 170:
                assert res["places"] == {"device", "host"} and res["chunks"] > 2
            if cfg["clip"] is not None:
                assert min(res["norms"]) > 3 * cfg["clip"]  # clipping triggered
            if cfg.get("overlap") == "backward":
                assert any("overlap='backward' needs one rank" in w for w in res["warnings"])
            for n, want in ref.items():
                assert same(res["params"][n], want), (cfg, r, n, (res["params"][n] - want).abs().max())
