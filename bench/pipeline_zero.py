"""Pipeline parallelism x ZeRO on the CPU: 2 stages x 2 data-parallel gloo ranks, per-rank memory and step
time at ZeRO-1, 2 and 3 under 1F1B (and GPipe at ZeRO-1).

Run ``python bench/pipeline_zero.py [--steps 4]`` from the repository root, alone (the 4 ranks share the
machine's cores). The result goes to ``bench/results/pipeline_zero.json`` via
:func:`bench._machine.write_result`. ``--device cuda`` (2 GPUs or more; NCCL, policy ``auto``) puts rank ``r``
on GPU ``(stage + replica) % gpus``, so that no process group holds one GPU twice, adds each rank's
``cuda_peak_bytes`` (``torch.cuda.max_memory_allocated`` over the measured steps) and writes
``pipeline_zero_cuda.json``.

The model is the GPT of :mod:`memsched.models.gpt` (``n_layer=4, n_embd=256``, vocabulary 4096), cut in two
(:mod:`memsched.models.gpt_stages`); each step is 4 micro-batches of 2 x 128 tokens per replica. Rank ``r`` is
stage ``r % 2`` of replica ``r // 2``, attached with ``device="cpu", policy="cpu"`` and its stage's
data-parallel group. After two untimed steps, ``--steps`` steps are measured. Per rank:

* ``chunk_bytes``: what memsched's chunks hold between steps (parameters, whole gradient buffers, gradient and
  parameter shards, optimizer state), bytes;
* ``grad_bytes_at_step``: the gradient bytes the chunks hold when ``optimizer.step()`` begins (every
  micro-batch's gradients accumulated, none reduced yet: [Note: micro-batches in flight]), bytes;
* ``traced_peak_non_model_bytes``: the warmup's peak of activations and temporaries, bytes;
* ``rss_peak_bytes``: the process's peak resident set (``ru_maxrss``) less its resident set before the model
  was built, bytes (allocator caching included: read it as an upper bound);
* ``step_s_median``: the median step time of the slowest rank, seconds (4 ranks on a shared machine).
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._harness import free_port  # noqa: E402
from bench._machine import write_result  # noqa: E402
from memsched.models.gpt import GPT, GPTConfig  # noqa: E402
from memsched.models.gpt_stages import split_gpt, stage_loss  # noqa: E402

CONFIG = {"n_layer": 4, "n_head": 4, "n_embd": 256, "vocab_size": 4096, "block_size": 128}
STAGES, REPLICAS, MICRO, ROWS, SEQ = 2, 2, 4, 2, 128
CASES = [("1f1b", 1), ("1f1b", 2), ("1f1b", 3), ("gpipe", 1)]


def _chunk_bytes(sched: memsched.Scheduler, *, grads_only: bool = False) -> int:
    kinds = ("grad", "grad_shard") if grads_only else (
        "data", "grad", "grad_shard", "param_shard", "master", "exp_avg", "exp_avg_sq")
    seen: set[int] = set()
    total = 0
    for c in sched.store.chunks:
        for kind in kinds:
            t = getattr(c, kind, None)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def _rank(rank: int, world: int, port: int, schedule_name: str, zero: int, steps: int, out: str,
          kind: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    stage_i, replica = rank % STAGES, rank // STAGES
    device = torch.device("cpu")
    if kind == "cuda":  # no group holds a GPU twice: (stage + replica) % gpus
        device = torch.device("cuda", (stage_i + replica) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        pp = [dist.new_group([d * STAGES + s for s in range(STAGES)]) for d in range(REPLICAS)]
        dp = [dist.new_group([d * STAGES + s for d in range(REPLICAS)]) for s in range(STAGES)]
        rss0 = psutil.Process().memory_info().rss
        torch.manual_seed(0)
        module = split_gpt(GPT(GPTConfig(**CONFIG)), STAGES)[stage_i]
        g = torch.Generator().manual_seed(1 + replica)
        with memsched.attach(module, policy="auto" if kind == "cuda" else "cpu", device=str(device),
                             zero_stage=zero, process_group=dp[stage_i]) as sched:
            stage = PipelineStage(module, stage_i, STAGES, device, group=pp[replica])
            cls = Schedule1F1B if schedule_name == "1f1b" else ScheduleGPipe
            schedule = cls(stage, n_microbatches=MICRO, loss_fn=stage_loss)
            times, at_step = [], 0
            for i in range(steps + 2):
                tokens = torch.randint(0, CONFIG["vocab_size"], (MICRO * ROWS, SEQ + 1), generator=g)
                tokens = tokens.to(device)
                if i == 2 and kind == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                if stage_i == 0:
                    schedule.step(tokens[:, :-1])
                else:
                    schedule.step(target=tokens[:, 1:], losses=[])
                at_step = max(at_step, _chunk_bytes(sched, grads_only=True))
                sched.optimizer.step()
                sched.optimizer.zero_grad()
                if kind == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            row = {"chunk_bytes": _chunk_bytes(sched), "grad_bytes_at_step": at_step,
                   "traced_peak_non_model_bytes": sched.peak_non_model_bytes(),
                   "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0,
                   "step_s": times, "stage_reason": sched.dp.pipeline.detected}
            if kind == "cuda":
                row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        torch.save(row, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def measure(schedule_name: str, zero: int, steps: int, kind: str = "cpu") -> dict:
    """One launch of the 4 ranks; per-rank rows and the slowest rank's median step time."""
    world = STAGES * REPLICAS
    with tempfile.TemporaryDirectory() as out:
        forks = "forkserver" in mp.get_all_start_methods() and not torch.cuda.is_available()
        mp.start_processes(_rank, args=(world, free_port(), schedule_name, zero, steps, out, kind),
                           nprocs=world,
                           start_method="forkserver" if forks else "spawn")
        rows = [torch.load(Path(out) / f"{r}.pt") for r in range(world)]
    slowest = [max(r["step_s"][i] for r in rows) for i in range(steps)]
    return {"schedule": schedule_name, "zero_stage": zero, "step_s_median": statistics.median(slowest),
            "ranks": [{"rank": r, "stage": r % STAGES, **{k: v for k, v in row.items() if k != "step_s"}}
                      for r, row in enumerate(rows)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs 2 GPUs or more (no process group may hold one GPU twice)")
    results = {}
    for name, zero in CASES:
        r = measure(name, zero, args.steps, args.device)
        results[f"{name}_zero{zero}"] = r
        print(name, zero, f"{r['step_s_median'] * 1e3:.1f} ms",
              [(x["chunk_bytes"], x["grad_bytes_at_step"], x["rss_peak_bytes"]) for x in r["ranks"]],
              flush=True)
    base = results["1f1b_zero1"]["step_s_median"]
    for r in results.values():
        r["step_time_vs_1f1b_zero1"] = r["step_s_median"] / base
    path = write_result("pipeline_zero" if args.device == "cpu" else "pipeline_zero_cuda", {
        "model": {**CONFIG, "dtype": "float32", "stages": STAGES, "replicas": REPLICAS,
                  "micro_batches": MICRO, "micro_batch": [ROWS, SEQ]},
        "device": args.device, "policy": "cpu" if args.device == "cpu" else "auto",
        "backend": "gloo" if args.device == "cpu" else "nccl", "steps": args.steps, "results": results,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
