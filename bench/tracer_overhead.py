"""Overhead of MemoryTracer on a CPU training step, side by side with other memory tools, in ONE process.

A 12-layer ``nn.TransformerEncoder`` training step (forward, backward, fused AdamW, zero_grad) is timed:

* ``untraced``: nothing attached;
* ``memory_tracer``: inside ``tracer.MemoryTracer``;
* ``after_exit``: untraced again, right after a MemoryTracer exited (nothing may be left behind);
* ``mem_tracker``: inside ``torch.distributed._tools.mem_tracker.MemTracker``;
* ``profiler``: inside ``torch.profiler.profile(profile_memory=True)``;
* ``dispatch_floor``: inside a ``TorchDispatchMode`` that only forwards each op: the fixed price of seeing
  every op from Python, which any dispatch-level tracer pays (context for the MemoryTracer figure).

Each repetition runs every variant once, interleaved (A B C ... A B C ...), one step per context entry (the
step alone is timed, not enter/exit; MemTracker cannot trace two iterations in one entry), after warm-up
steps. Medians, quartiles and the per-repetition ratio to the ``untraced`` step of the same repetition (paired,
so slow drifts of a shared machine cancel) go to ``bench/results/tracer_overhead.json``.

Run by hand: ``python bench/tracer_overhead.py`` (``--help`` for sizes, repetitions and threads).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._machine import write_result  # noqa: E402
from tracer import MemoryTracer  # noqa: E402

TARGETS = {"memory_tracer": 1.15, "after_exit": 1.02}


class _ForwardOnly(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _quartiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"min": min(values), "p25": q[0], "median": statistics.median(values), "p75": q[2],
            "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ff", type=int, default=1024, help="feed-forward width")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30, help="interleaved repetitions of every variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch intra-op threads (default: torch's choice for this machine)")
    parser.add_argument("--name", default="tracer_overhead", help="result file name under bench/results")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error(f"--repeats and --threads must be >= 1 and --warmup >= 0, got {args.repeats}, "
                     f"{args.threads}, {args.warmup}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(args.d_model, args.heads, args.ff, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(args.batch, args.seq, args.d_model)

    def step() -> None:
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    from torch.distributed._tools.mem_tracker import MemTracker

    variants: dict[str, Callable[[], Any]] = {
        "untraced": contextlib.nullcontext,
        "memory_tracer": lambda: MemoryTracer(model, optimizer=opt),
        "after_exit": contextlib.nullcontext,  # runs right after memory_tracer in every repetition
        "mem_tracker": MemTracker,
        "profiler": lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   profile_memory=True),
        "dispatch_floor": _ForwardOnly,
    }
    for _ in range(args.warmup):
        step()
    counter = _CountOps()
    with counter:
        step()
    with MemoryTracer(model, optimizer=opt) as t:
        step()
    samples_per_step = len(t.timeline.samples)

    times: dict[str, list[float]] = {k: [] for k in variants}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for name, make in variants.items():
            with make():
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    load_after = os.getloadavg()

    base = times["untraced"]
    results: dict[str, Any] = {}
    for name, ts in times.items():
        paired = [t / b for t, b in zip(ts, base, strict=True)]
        results[name] = {
            "step_s": _quartiles(ts),
            "ratio_of_medians": statistics.median(ts) / statistics.median(base),
            "paired_ratio": _quartiles(paired),
        }
    payload = {
        "benchmark": "tracer_overhead",
        "workload": {"model": "nn.TransformerEncoder", "layers": args.layers, "d_model": args.d_model,
                     "heads": args.heads, "ff": args.ff, "batch": args.batch, "seq": args.seq,
                     "dropout": 0.1, "optimizer": "AdamW(fused=True)", "dtype": "float32",
                     "aten_ops_per_step": counter.ops, "memory_tracer_samples_per_step": samples_per_step},
        "method": "one process; every repetition runs each variant once in the listed order (interleaved); "
                  "one step per context entry, only the step timed; ratios are to 'untraced'",
        "threads": args.threads,
        "repeats": args.repeats,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "results": results,
        "targets": {k: {"max_ratio": v, "ratio_of_medians": results[k]["ratio_of_medians"],
                        "met": results[k]["ratio_of_medians"] <= v} for k, v in TARGETS.items()},
    }
    path = write_result(args.name, payload)
    width = max(map(len, results))
    for name, r in results.items():
        s, p = r["step_s"], r["paired_ratio"]
        print(f"{name:<{width}}  median {s['median'] * 1e3:8.1f} ms  ratio {r['ratio_of_medians']:.3f}  "
              f"paired p25..p75 {p['p25']:.3f}..{p['p75']:.3f}")
    print(f"{counter.ops} aten ops/step, {samples_per_step} samples/step, threads {args.threads}, "
          f"load {load_before[0]:.1f} -> {load_after[0]:.1f}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
