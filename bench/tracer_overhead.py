"""Overhead of MemoryTracer on a CPU training step, side by side with other memory tools, in ONE process.

A 12-layer ``nn.TransformerEncoder`` training step (forward, backward, fused AdamW, zero_grad) is timed:

* ``untraced``: nothing attached;
* ``memory_tracer``: inside ``tracer.MemoryTracer``;
* ``after_exit``: untraced again, right after a MemoryTracer exited (nothing may be left behind);
* ``mem_tracker``: inside ``torch.distributed._tools.mem_tracker.MemTracker``;
* ``profiler``: inside ``torch.profiler.profile(profile_memory=True)``;
* ``dispatch_floor``: inside a ``TorchDispatchMode`` that only forwards each op: the fixed price of seeing
  every op from Python, which any dispatch-level tracer pays (context for the MemoryTracer figure).

Each repetition runs every variant once, interleaved (A B C ... A B C ...), one step per context entry
(the step alone is timed, not enter/exit; MemTracker cannot trace two iterations in one entry), after
warm-up steps. Medians, quartiles and the per-repetition ratio to the ``untraced`` step of the same
repetition (paired, so slow drifts of a shared machine cancel) go to ``bench/results/tracer_overhead.json``,
for two step sizes.

Run by hand: ``python bench/tracer_overhead.py`` (``--help`` for sizes, repetitions and threads).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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


def _measure(args: argparse.Namespace, batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(args.d_model, args.heads, args.ff, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(batch, args.seq, args.d_model)

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
            gc.collect()  # garbage of the previous variant (MemTracker makes a lot) is not this one's cost
            with make():
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    load_after = os.getloadavg()

    base = times["untraced"]
    med = {name: statistics.median(ts) for name, ts in times.items()}
    results: dict[str, Any] = {}
    for name, ts in times.items():
        paired = [t / b for t, b in zip(ts, base, strict=True)]
        results[name] = {
            "step_s": _quartiles(ts),
            "ratio_of_medians": med[name] / med["untraced"],
            "paired_ratio": _quartiles(paired),
        }
    return {
        "workload": {"model": "nn.TransformerEncoder", "layers": args.layers, "d_model": args.d_model,
                     "heads": args.heads, "ff": args.ff, "batch": batch, "seq": args.seq, "dropout": 0.1,
                     "optimizer": "AdamW(fused=True)", "dtype": "float32", "aten_ops_per_step": counter.ops,
                     "memory_tracer_samples_per_step": samples_per_step},
        "load_average_before": load_before,
        "load_average_after": load_after,
        "results": results,
        # Where MemoryTracer's time goes: seeing every op from Python at all (the floor any dispatch-level
        # tracer pays) versus its own accounting, hooks and samples on top of that.
        "overhead_split_ms": {
            "dispatch_floor": (med["dispatch_floor"] - med["untraced"]) * 1e3,
            "dispatch_floor_per_op_us": (med["dispatch_floor"] - med["untraced"]) / counter.ops * 1e6,
            "memory_tracer_total": (med["memory_tracer"] - med["untraced"]) * 1e3,
            "memory_tracer_own": (med["memory_tracer"] - med["dispatch_floor"]) * 1e3,
        },
        "targets": {k: {"max_ratio": v, "ratio_of_medians": results[k]["ratio_of_medians"],
                        "met": results[k]["ratio_of_medians"] <= v} for k, v in TARGETS.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ff", type=int, default=1024, help="feed-forward width")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 8],
                        help="batch sizes, one workload each (default: ~0.3 s and ~0.5 s steps, 1 thread)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30, help="interleaved repetitions of every variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the machine's cores are shared, and "
                             "OpenMP threads waiting on each other under foreign load make timings erratic)")
    parser.add_argument("--name", default="tracer_overhead", help="result file name under bench/results")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1 or min(args.batch) < 1:
        parser.error(f"--repeats, --threads and --batch must be >= 1 and --warmup >= 0, got {args.repeats}, "
                     f"{args.threads}, {args.batch}, {args.warmup}")
    torch.set_num_threads(args.threads)

    configs = [_measure(args, batch) for batch in args.batch]
    payload = {
        "benchmark": "tracer_overhead",
        "method": "one process; every repetition runs each variant once in the listed order (interleaved); "
                  "gc.collect() before each; one step per context entry, only the step timed; ratios are to "
                  "'untraced' (ratio of medians, and per repetition 'paired' ratios with their quartiles for "
                  "the spread)",
        "threads": args.threads,
        "repeats": args.repeats,
        "configs": configs,
    }
    path = write_result(args.name, payload)
    for cfg in configs:
        w, split = cfg["workload"], cfg["overhead_split_ms"]
        load = f"{cfg['load_average_before'][0]:.1f} -> {cfg['load_average_after'][0]:.1f}"
        print(f"batch {w['batch']}: {w['aten_ops_per_step']} aten ops/step, "
              f"{w['memory_tracer_samples_per_step']} samples/step, load {load}")
        width = max(map(len, cfg["results"]))
        for name, r in cfg["results"].items():
            st, p = r["step_s"], r["paired_ratio"]
            print(f"  {name:<{width}}  median {st['median'] * 1e3:8.1f} ms  "
                  f"ratio {r['ratio_of_medians']:.3f}  paired p25..p75 {p['p25']:.3f}..{p['p75']:.3f}")
        print(f"  overhead: floor {split['dispatch_floor']:.1f} ms "
              f"({split['dispatch_floor_per_op_us']:.1f} us/op), MemoryTracer "
              f"{split['memory_tracer_total']:.1f} ms of which own {split['memory_tracer_own']:.1f} ms")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
