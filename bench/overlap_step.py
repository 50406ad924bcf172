"""The overlapped hybrid step against the serial one, on the stand-in device (CPU; run by hand).

Run ``python bench/overlap_step.py`` from the repository root (about a minute). One process, one compute
thread (``torch.set_num_threads(1)``) and, with ``overlap``, one CPU-update thread. Three copies of an MLP
train side by side on three stand-in devices with the ``static`` policy (``--offload`` of the optimizer
state on the host: the last-used chunks), with ``overlap=False``, ``overlap=True`` (the CPU update overlaps
the next forward) and ``overlap="backward"`` (it starts during backward, :mod:`memsched.optim.early_update`),
in interleaved blocks of ``--block`` steps (serial block, overlapped block, ...), so all see the same machine
load. Blocks, not single steps: an overlapped run's CPU update must not run during another run's step. Each
block ends with ``sched.synchronize()`` (the last update is inside the block's time). The batch and the
offloaded share are sized so that the CPU update of the host chunks takes about as long as the forward.

The machine is shared and noisy (2 cores, one per thread here): besides the ratio of the median steps, each
overlapped block is compared with the serial block run just before it (``paired_vs_serial``: median and
quartiles of those per-block ratios), which cancels most of the drift between blocks.

Recorded per configuration: the step time (block wall time / steps, median over blocks) and, from
``sched.step_timeline`` (host clocks) over the steps of each block but its first, the phases, the CPU-update
time, the time exposed to it, and the ideal step:

* ``ideal_from_serial_s``: from the serial run's phases, the step if the CPU update overlapped perfectly
  with everything else: ``max(serial step - CPU update, CPU update)``;
* each overlapped step's ratio to the serial step and to that ideal;
* ``phase_sum_error_pct``: how far the phases add up from the measured step (by construction, ~0).

The runs are checked bit for bit against each other (the overlapped steps are exact). The Perfetto trace of
the ``"backward"`` run (its warmup memory timeline and its step timeline) goes beside the JSON result
(``bench/results/overlap_step.perfetto.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make ``bench`` and the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._harness import summarize, train_seconds  # noqa: E402
from bench._machine import write_result  # noqa: E402
from memsched.report.exports.perfetto import write_perfetto  # noqa: E402


def mlp(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def worker_spans(records: Sequence[Any]) -> dict[str, float]:
    """Seconds per step on the CPU-update track, by span name (median over the steps of ``records``, step
    timeline records). Serial runs record their updates on that track too (on the training thread)."""
    per_step: dict[str, list[float]] = {}
    for r in records:
        totals: dict[str, float] = {}
        for s in r.spans:
            if s.track == "cpu update":
                totals[s.name] = totals.get(s.name, 0.0) + s.seconds
        for name, t in totals.items():
            per_step.setdefault(name, []).append(t)
    return {name: statistics.median(ts) for name, ts in per_step.items()}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=20, help="rows per step (sets forward vs CPU update time)")
    ap.add_argument("--offload", type=float, default=0.85, help="share of optimizer state on the host")
    ap.add_argument("--blocks", type=int, default=12, help="timed blocks per configuration")
    ap.add_argument("--block", type=int, default=6, help="steps per block")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (the traced warmup step included)")
    ap.add_argument("--name", default="overlap_step")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    runs: dict[str, dict[str, Any]] = {}
    for name, overlap in (("serial", False), ("overlap", True), ("backward", "backward")):
        model = mlp(args.width, args.depth)
        sched = memsched.attach(model, policy="static", policy_options={"offload_optim_frac": args.offload},
                                device="sim:4GiB", overlap=overlap, chunk_numel=args.width * (args.width + 1))
        runs[name] = {"model": model, "sched": sched}
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, args.width, generator=gen), torch.randn(args.batch, 1, generator=gen))
               for _ in range(args.warmup + args.blocks * args.block)]

    def train(run: dict[str, Any], part: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        dev = run["sched"].device.torch_device  # the stand-in is a device: inputs go there, as on a GPU
        return train_seconds(run["sched"], part,
                             lambda b: nn.functional.mse_loss(run["model"](b[0].to(dev)), b[1].to(dev)))

    for run in runs.values():
        train(run, batches[:args.warmup])
        run["block_s"], run["rows"], run["records"] = [], [], []
    for b in range(args.blocks):
        part = batches[args.warmup + b * args.block:args.warmup + (b + 1) * args.block]
        for run in runs.values():  # interleaved blocks: the same moments of the machine for both
            run["sched"].step_timeline.records.clear()
            run["block_s"].append(train(run, part) / len(part))
            run["rows"] += run["sched"].step_timeline.summaries()[1:]  # the first includes the other run
            run["records"] += list(run["sched"].step_timeline.records)[1:]
    same = all(torch.equal(p, q) for other in ("overlap", "backward")
               for p, q in zip(runs["serial"]["model"].parameters(), runs[other]["model"].parameters(),
                               strict=True))

    out: dict[str, Any] = {}
    for name, run in runs.items():
        sched = run["sched"]
        rows = run["rows"]
        out[name] = {
            "step": summarize(run["block_s"]),
            "timeline_step": summarize([r["step_s"] for r in rows]),
            "phases_s": {p: statistics.median(r["phases_s"][p] for r in rows) for p in rows[0]["phases_s"]},
            "cpu_update_s": statistics.median(r["cpu_update_s"] for r in rows),
            "exposed_cpu_s": statistics.median(r["exposed_cpu_s"] for r in rows),
            "overlap_efficiency": statistics.median(r["overlap_efficiency"] for r in rows),
            "phase_sum_error_pct": max(100 * abs(sum(r["phases_s"].values()) - r["step_s"]) / r["step_s"]
                                       for r in rows),
            "placement": [c.placement for c in sched.store.chunks],
            "host_chunks": sum(c.placement == "host" for c in sched.store.chunks),
        }
    serial, over, back = out["serial"], out["overlap"], out["backward"]
    serial_step, serial_cpu = serial["step"]["median_s"], serial["cpu_update_s"]
    over_step, back_step = over["step"]["median_s"], back["step"]["median_s"]
    ideal = max(serial_step - serial_cpu, serial_cpu)

    def paired(name: str) -> dict[str, float]:  # each block against the serial block just before it
        ratios = [o / s for o, s in zip(runs[name]["block_s"], runs["serial"]["block_s"], strict=True)]
        q = statistics.quantiles(ratios, n=4, method="inclusive")
        return {"median": statistics.median(ratios), "p25": q[0], "p75": q[2], "n": len(ratios)}

    spans = {name: worker_spans(runs[name]["records"]) for name in ("serial", "backward")}
    result = {
        "what": "overlap=True and overlap='backward' vs overlap=False, static policy on the stand-in, one "
                "compute thread + one CPU-update thread, interleaved blocks of steps; step = block wall time "
                "/ steps (median over blocks), phases from sched.step_timeline (host clocks)",
        "config": vars(args),
        "bit_identical": same,
        "serial_forward_s": serial["phases_s"]["forward"],
        "serial_cpu_update_s": serial_cpu,
        "serial_step_s": serial_step,
        "overlap_step_s": over_step,
        "ideal_from_serial_s": ideal,
        "overlap_vs_serial": over_step / serial_step,
        "overlap_vs_ideal": over_step / ideal,
        "overlap_paired_vs_serial": paired("overlap"),
        "overlap_exposed_cpu_s": over["exposed_cpu_s"],
        "backward_step_s": back_step,
        "backward_vs_serial": back_step / serial_step,
        "backward_vs_ideal": back_step / ideal,
        "backward_paired_vs_serial": paired("backward"),
        "backward_exposed_cpu_s": back["exposed_cpu_s"],
        "backward_worker_spans_s": spans["backward"],
        "serial_worker_spans_s": spans["serial"],
        # issue 41's criterion: the worker's update during backward against the serial update of the same
        # chunks with the same threads (the kernel's pace when it runs beside backward)
        "backward_update_vs_serial_update": spans["backward"].get("update in backward", 0.0)
        / max(spans["serial"].get("update", 0.0), 1e-12),
        # the copy of the state into the spare (after the step, beside the next forward), against the same
        "backward_refill_vs_serial_update": spans["backward"].get("refill spare", 0.0)
        / max(spans["serial"].get("update", 0.0), 1e-12),
        "backward_speculative_chunks": len(runs["backward"]["sched"].plan.speculative),
        "backward_committed": runs["backward"]["sched"].optimizer.early_updates.committed,
        "backward_dropped": runs["backward"]["sched"].optimizer.early_updates.dropped,
        "runs": out,
    }
    # The cost model (memsched.planning.cost_model) against the measured steps: the plan's own prediction
    # (from the warmup step alone, with the run's overlap mode and its speculating chunks), and the same with
    # the steady-state forward and backward of the serial run.
    modes = {"serial": False, "overlap": True, "backward": "backward"}
    for name, run in runs.items():
        sched = run["sched"]
        host = sum(c.hi - c.lo for c in sched.store.chunks if c.placement == "host")
        spec = sum(sched.store.chunks[i].hi - sched.store.chunks[i].lo for i in sched.plan.speculative)
        costs = sched.warmup_costs
        steady = costs.with_steady_phases(runs["serial"]["sched"].step_timeline.mean_summary())
        measured = out[name]["step"]["median_s"]
        result[f"{name}_predicted"] = {
            "plan_s": sched.predicted_step["step_s"],
            "from_warmup_s": costs.predict(host, modes[name], speculative_elements=spec)["step_s"],
            "from_steady_phases_s": steady.predict(host, modes[name], speculative_elements=spec)["step_s"],
            "measured_s": measured}
    path = write_result(args.name, result)
    trace = path.with_suffix(".perfetto.json")
    osched = runs["backward"]["sched"]
    write_perfetto([osched.timeline], trace, step_timelines=[osched.step_timeline])
    for run in runs.values():
        run["sched"].close()
    print(f"serial step {serial_step * 1e3:.1f} ms (forward {result['serial_forward_s'] * 1e3:.1f} ms, "
          f"CPU update {serial_cpu * 1e3:.1f} ms); overlapped {over_step * 1e3:.1f} ms = "
          f"{result['overlap_vs_serial']:.2f}x serial (paired blocks: "
          f"{result['overlap_paired_vs_serial']['median']:.2f}x), {result['overlap_vs_ideal']:.2f}x ideal "
          f"({ideal * 1e3:.1f} ms); updated during backward {back_step * 1e3:.1f} ms = "
          f"{result['backward_vs_serial']:.2f}x serial, {result['backward_vs_ideal']:.2f}x ideal; "
          f"bit-identical: {same}; wrote {path} and {trace}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
