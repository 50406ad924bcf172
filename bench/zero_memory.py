"""ZeRO memory per rank: the steady-state device peak of each rank for each ZeRO stage at 1 to 4 gloo ranks,
on the stand-in device, and the step time against ZeRO-1.

Run ``python bench/zero_memory.py [--worlds 1 2 3 4] [--steps 4] [--policy cpu]`` from the repository root
(ranks are local processes on gloo; run it alone: they share the machine's cores). The result goes to
``bench/results/zero_memory.json`` (``zero_memory_<policy>.json`` for another policy) via
:func:`bench._machine.write_result`.

The model is the tied-embedding GPT of :mod:`memsched.models.gpt` (``n_layer=4, n_embd=256``, vocabulary
4096, batch 4 x 128, fp32), its first block checkpointed and its second frozen. Each rank trains on its own
batch; after two untimed steps the stand-in's peak is reset and ``--steps`` steps are measured: the peak
(``SimDevice.peak_bytes``, bytes; the largest over the ranks) and the median step time of the slowest rank.
A stage memsched refuses gets a row with the error.

What to read from it: ``trainable_param_bytes`` (the fp32 parameters that get gradients) and, per stage and
world size, ``peak_bytes``; ZeRO-2 divides the gradient bytes by the world size only if its row lies below
ZeRO-1's by about ``(1 - 1/world) * trainable_param_bytes``, and ZeRO-3 the parameter bytes too only if its
row lies lower still by about as much again.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._harness import free_port  # noqa: E402
from bench._machine import write_result  # noqa: E402
from memsched.models.gpt import GPT, GPTConfig  # noqa: E402

CONFIG = {"n_layer": 4, "n_head": 4, "n_embd": 256, "vocab_size": 4096, "block_size": 128}
BATCH, SEQ = 4, 128
CAPACITY = "sim:1GiB"


class Model(torch.nn.Module):
    """The GPT with its first block checkpointed and its second frozen."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(GPTConfig(**CONFIG))
        self.gpt.blocks[1].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        pos = torch.arange(x.shape[1], device=x.device)
        h = g.wte(x) + g.wpe(pos)
        for i, block in enumerate(g.blocks):
            h = checkpoint(block, h, use_reentrant=False) if i == 0 else block(h)
        return F.linear(g.ln_f(h), g.wte.weight)


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def _rank(rank: int, world: int, port: int, stage: int, steps: int, policy: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        model = Model()
        g = torch.Generator().manual_seed(1 + rank)
        vocab = CONFIG["vocab_size"]
        batches = [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g) for _ in range(steps + 2)]
        row: dict = {}
        try:
            sched = memsched.attach(model, device=CAPACITY, policy=policy, zero_stage=stage)
        except (ValueError, NotImplementedError, RuntimeError) as e:
            row = {"refused": str(e).splitlines()[0]}
        else:
            with sched:
                times = []
                for i, x in enumerate(batches):
                    if i == 2:
                        sched.sim.reset_peak()
                    t0 = time.perf_counter()
                    sched.backward(_loss(model, x.to(sched.device.torch_device)))
                    sched.optimizer.step()
                    sched.optimizer.zero_grad()
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                row = {"peak_bytes": sched.sim.peak_bytes, "step_s": times}
        torch.save(row, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def measure(world: int, stage: int, steps: int, policy: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        # not fork: autograd refuses to run in a process forked after a backward on the stand-in (or CUDA)
        # started its device threads
        # not from a fork server where CUDA is available (see tests/_dist_utils.py: its preload initialises
        # CUDA's driver, and ranks forked after that cannot run a backward)
        forks = "forkserver" in mp.get_all_start_methods() and not torch.cuda.is_available()
        method = "forkserver" if forks else "spawn"
        mp.start_processes(_rank, args=(world, free_port(), stage, steps, policy, out), nprocs=world,
                           start_method=method)
        rows = [torch.load(Path(out) / f"{r}.pt") for r in range(world)]
    if "refused" in rows[0]:
        return {"refused": rows[0]["refused"]}
    slowest = [max(r["step_s"][i] for r in rows) for i in range(steps)]
    return {"peak_bytes": max(r["peak_bytes"] for r in rows),
            "peak_bytes_per_rank": [r["peak_bytes"] for r in rows],
            "step_s_median": statistics.median(slowest)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--policy", default="cpu")
    args = ap.parse_args()
    model = Model()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    results: dict = {}
    for world in args.worlds:
        for stage in args.stages:
            if world == 1 and stage > 0:
                continue  # one rank: no sharding, one row
            r = measure(world, stage, args.steps, args.policy)
            results[f"world{world}_zero{stage}"] = {"world": world, "stage": stage, **r}
            print(world, stage, r, flush=True)
    for world in args.worlds:
        base = results.get(f"world{world}_zero1")
        for stage in args.stages:
            r = results.get(f"world{world}_zero{stage}")
            if r and base and "step_s_median" in r and "step_s_median" in base:
                r["step_time_vs_zero1"] = r["step_s_median"] / base["step_s_median"]
                r["peak_saved_vs_zero1_bytes"] = base["peak_bytes"] - r["peak_bytes"]
    path = write_result("zero_memory" if args.policy == "cpu" else f"zero_memory_{args.policy}", {
        "model": {**CONFIG, "batch": BATCH, "seq": SEQ, "dtype": "float32", "checkpointed_blocks": [0],
                  "frozen_blocks": [1], "tied_embedding": True},
        "device": CAPACITY, "policy": args.policy, "steps": args.steps,
        "trainable_param_bytes": trainable, "param_bytes": total, "results": results,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
