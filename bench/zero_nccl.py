"""ZeRO-1/2/3 over NCCL on several GPUs, bit for bit against emulated DDP on the same GPUs.

Run ``torchrun --nproc_per_node N bench/zero_nccl.py`` (N >= 2 GPUs) from the repository root. Each rank runs
the configurations of ``tests/test_zero_sharded_grads.py`` (clip that triggers, accumulation with and without
``no_sync``, ``overlap=True``; a tied embedding, a checkpointed block, a frozen block) on its own GPU with
``policy="static"`` (half the chunks' optimizer state on the host); rank 0 computes the emulated-DDP reference
(plain torch on ``cuda:0``: per-rank gradients averaged in rank order, ``clip_grad_norm_``,
``torch.optim.AdamW(fused=True)``) and writes ``bench/results/zero_nccl.json`` via
:func:`bench._machine.write_result` with ``"failed"``: the configurations whose parameters differ on any rank.
The machines lent here have one GPU, so this waits in ``bench/GPU-PENDING.md``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._machine import write_result  # noqa: E402
from tests import test_zero_sharded_grads as t  # noqa: E402


def _run(rank: int, world: int, device: torch.device, cfg: dict) -> dict[str, torch.Tensor]:
    model = t.make_model().to(device)
    with memsched.attach(model, lr=t.LR, weight_decay=t.WD, zero_stage=cfg["stage"], device=str(device),
                         policy="static", policy_options={"offload_optim_frac": 0.5},
                         overlap=cfg.get("overlap", False)) as sched:
        accum = cfg["accum"]
        for step in t.data(accum):
            for k, (x, y, use_aux) in enumerate(step):
                quiet = cfg.get("no_sync", True) and k < accum - 1
                xs, ys = t.rows(x, rank, world).to(device), t.rows(y, rank, world).to(device)
                with sched.no_sync() if quiet else contextlib.nullcontext():
                    sched.backward(t.loss_of(model, xs, ys, use_aux, accum))
            if cfg["clip"] is not None:
                sched.clip_grad_norm_(cfg["clip"])
            sched.optimizer.step()
            sched.optimizer.zero_grad()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _reference(world: int, device: torch.device, cfg: dict) -> dict[str, torch.Tensor]:
    """:func:`tests.test_zero_sharded_grads.reference` on ``device``."""
    real = t.make_model

    def on_device() -> torch.nn.Module:
        return real().to(device)

    t.make_model = on_device
    real_rows = t.rows
    t.rows = lambda x, r, w: real_rows(x, r, w).to(device)
    try:
        ref = t.reference([world] * t.STEPS, cfg["accum"], cfg["clip"], each=not cfg.get("no_sync", True))
    finally:
        t.make_model, t.rows = real, real_rows
    return {n: v.cpu() for n, v in ref.items()}


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    rows = []
    for cfg in t.CFGS:
        got = _run(rank, world, device, cfg)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, got)
        if rank == 0:
            ref = _reference(world, device, cfg)
            bad = sorted({n for g in gathered for n in ref if not torch.equal(g[n], ref[n])})
            rows.append({"config": cfg, "bit_exact": not bad, "differ": bad})
    if rank == 0:
        result = {"world": world, "backend": "nccl", "configs": rows,
                  "failed": sum(not r["bit_exact"] for r in rows)}
        print(write_result("zero_nccl", result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
