"""ZeRO collectives on this machine: how updated shards are fetched, how gradients are reduced, and what a
whole training step costs in each configuration.

Run ``python bench/zero_fetch.py [--world 2] [--chunk-mib 4 16] [--repeats 7] [--steps 5]`` from the
repository root; ranks are local processes on gloo (CPU); the result goes to
``bench/results/zero_fetch.json`` via :func:`bench._machine.write_result` (rank 0 writes it). A GPU run
(NCCL) would come from a task that has one.

What is timed, per chunk size (fp32 chunks of ``--chunk-mib`` MiB), every repetition calling every variant
once in a fixed order (ABCD ABCD ...) with a barrier before each, median over repetitions of the slowest rank:

* ``fetch_all_gather``: ``all_gather_into_tensor`` of each rank's shard straight into the flat chunk
  (``fetch="all_gather"``; gloo needs the own shard cloned first, NCCL gathers in place).
* ``fetch_all_reduce``: zero the rest of the chunk, ``all_reduce`` the whole chunk (``fetch="all_reduce"``).
* ``grad_reduce_scatter``: ZeRO-2's gradient reduction (``reduce_scatter_tensor`` into the own part).
* ``grad_all_reduce``: ZeRO-0/1's gradient reduction (``all_reduce`` of the whole chunk).

End to end: ``memsched.attach(device="cpu", zero_stage=S, fetch=F)`` on an MLP, ``--steps`` timed optimizer
steps after two untimed ones; the attach time (chunk build, broadcast, sharding, state init) is recorded too,
after one untimed attach (imports, first allocations).

Chunk build: attach time with ``chunk_build="device"`` vs ``"cpu"`` (``--repeats`` each, interleaved). On this
CPU-only machine both build in host memory ("cpu" adds one packing copy into flat host buffers), so the
numbers show that path's overhead only; the comparison that matters (device-to-device packing vs pinned host
packing and H2D) needs a GPU run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._harness import summarize
from bench._machine import write_result  # noqa: E402
from memsched.distributed.comm import Comm  # noqa: E402
from memsched.distributed.layout import shard_range  # noqa: E402

HIDDEN = 1024
LAYERS = 4
BATCH = 32



def _slowest(comm: Comm, xs: list[float]) -> list[float]:
    """Per repetition, the slowest rank's time (a collective finishes when its last rank does)."""
    every = comm.all_gather_object(xs, what="collecting timings")
    return [max(r[i] for r in every) for i in range(len(xs))]


def _micro(comm: Comm, chunk_mib: float, repeats: int) -> dict[str, dict[str, float]]:
    numel = int(chunk_mib * 2**20) // 4 // comm.world * comm.world
    lo, hi = shard_range(numel, comm.rank, comm.world)
    data = torch.randn(numel)
    grad = torch.randn(numel)
    out = torch.empty(hi - lo)

    def fetch_all_gather() -> None:
        comm.all_gather(data, data[lo:hi])

    def fetch_all_reduce() -> None:
        data[:lo].zero_()
        data[hi:].zero_()
        comm.all_reduce(data)

    def grad_reduce_scatter() -> None:
        comm.reduce_scatter(out, grad)

    def grad_all_reduce() -> None:
        comm.all_reduce(grad)

    variants = [fetch_all_gather, fetch_all_reduce, grad_reduce_scatter, grad_all_reduce]
    times: dict[str, list[float]] = {f.__name__: [] for f in variants}
    for f in variants:  # one untimed call each
        f()
    for _ in range(repeats):
        for f in variants:
            dist.barrier()
            t0 = time.perf_counter()
            f()
            times[f.__name__].append(time.perf_counter() - t0)
    res = {k: summarize(_slowest(comm, v)) for k, v in times.items()}
    for k in res:
        res[k]["chunk_bytes"] = numel * 4
        res[k]["GiB_per_s_chunk"] = numel * 4 / res[k]["median_s"] / 2**30
    return res


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _attach_time(comm: Comm, build: str) -> tuple[float, dict]:
    model = _model()
    dist.barrier()
    t0 = time.perf_counter()
    sched = memsched.attach(model, device="cpu", zero_stage=1, chunk_build=build)
    took = time.perf_counter() - t0
    stats = dict(sched.zero.build_stats)
    sched.close()
    return max(comm.all_gather_object(took, what="collecting timings")), stats


def _builds(comm: Comm, repeats: int) -> dict[str, dict]:
    times: dict[str, list[float]] = {"device": [], "cpu": []}
    info: dict[str, dict] = {}
    for _ in range(repeats):
        for build in times:
            t, stats = _attach_time(comm, build)
            times[build].append(t)
            info[build] = {k: v for k, v in stats.items() if k not in ("decisions", "seconds")}
    return {b: {**summarize(v), **info[b]} for b, v in times.items()}


def _end_to_end(comm: Comm, stage: int, fetch: str, steps: int) -> dict[str, float]:
    model = _model()
    dist.barrier()
    t0 = time.perf_counter()
    sched = memsched.attach(model, device="cpu", zero_stage=stage, fetch=fetch, lr=1e-4)
    attach_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, HIDDEN, generator=g)
    times = []
    with sched:
        for i in range(steps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            sched.backward(torch.nn.functional.mse_loss(model(x), y))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        state_bytes = sum(c.state_nbytes() for c in sched.store.chunks)
        stats = dict(sched.zero.stats) if sched.zero is not None else {}
    attach_all = comm.all_gather_object(attach_s, what="collecting timings")
    return {
        **summarize(_slowest(comm, times)),
        "attach_s_slowest_rank": max(attach_all),
        "optimizer_state_bytes_per_rank": state_bytes,
        "collectives": stats,
    }


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    comm = Comm()
    micro = {f"{mib:g}MiB": _micro(comm, mib, args.repeats) for mib in args.chunk_mib}
    _attach_time(comm, "auto")  # untimed: imports and first allocations
    builds = _builds(comm, args.repeats)
    e2e = {}
    for stage, fetch in [
        (0, "all_gather"),
        (1, "all_gather"),
        (1, "all_reduce"),
        (2, "all_gather"),
        (2, "all_reduce"),
    ]:
        e2e[f"stage{stage}_{fetch}"] = _end_to_end(comm, stage, fetch, args.steps)
    if rank == 0:
        n_params = sum(p.numel() for p in _model().parameters())
        path = write_result(
            "zero_fetch",
            {
                "config": {
                    "world": world,
                    "backend": "gloo",
                    "device": "cpu",
                    "repeats": args.repeats,
                    "steps": args.steps,
                    "model": f"MLP {LAYERS}x Linear({HIDDEN},{HIDDEN})",
                    "parameters": n_params,
                    "batch_per_rank": BATCH,
                    "torch_threads_per_rank": torch.get_num_threads(),
                },
                "collectives_per_chunk": micro,
                "training_step": e2e,
                "chunk_build_attach": {"note": "CPU-only: both modes build in host memory here", **builds},
            },
        )
        print(f"wrote {path}")
        for size, r in micro.items():
            print(size, {k: round(v["median_s"] * 1e3, 2) for k, v in r.items()}, "ms")
        for k, v in builds.items():
            print(f"attach with chunk_build={k}: {v['median_s'] * 1e3:.0f} ms")
        for k, v in e2e.items():
            print(
                k,
                f"step {v['median_s'] * 1e3:.1f} ms, attach {v['attach_s_slowest_rank'] * 1e3:.0f} ms, "
                f"state {v['optimizer_state_bytes_per_rank']} B/rank",
            )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (local processes)")
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=[4.0, 16.0], help="fp32 chunk sizes, MiB")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error(f"--world must be >= 2, got {args.world}")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(args.world, port, args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
