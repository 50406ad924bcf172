"""Parameters kept on the host and fetched for their reads, against every parameter on the device, with a
modelled host link (CPU; run by hand).

Run ``python bench/param_offload.py`` from the repository root (about a minute). One process, one compute
thread (``torch.set_num_threads(1)``) and the link's two copy threads. Copies of the built-in GPT
(``--size``, default ``demo``) train side by side on stand-in devices with links of 25 GB/s and 12 GB/s (PCIe
4 and 3 x16 class, ``sim:SIZE,link=...``), one scheduler at a time (a stand-in counts every tensor made
while it is attached), in ABBA rounds of ``--blocks`` blocks of ``--block`` steps:

* ``resident``: policy ``cpu`` on a stand-in that holds every parameter (``--resident-capacity``): every
  chunk's optimizer state and gradients on the host, its parameters on the device (ZeRO-Offload's layout);
* ``offloaded``: policy ``auto`` on the stand-in ``memsched demo`` sizes for this model and batch
  (:func:`memsched.cli.demo.stand_in`): it does not hold the parameters and gradients beside the peak of
  non-model data, so some chunks' parameters stay on the host and come to the device for their reads, on
  the schedule made from the warmup (prefetched up to ``max_prefetch`` reads ahead).

Recorded per link and configuration: the step time (block wall time / steps, median over blocks) and the
ratio offloaded / resident (of the medians, and per round); from
``sched.step_timeline`` over the steps of each block but its first: the phases and where the training thread
stalled (waiting for a fetch's H2D copy, for other copies, for the CPU update); the fetch counters per step
(fetches, how many ahead of their read, misses); the device's model bytes per parameter at the step's peak
(the stand-in's peak less the measured peak of non-model data, over the parameter count); the schedule's
working set (the offloaded chunks on the device at the read of most non-model data, and the most at any
read, where room allows caching) against the prefetch depth and the number of offloaded chunks. All runs
must end bit-identical (placement changes where and when, never what).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make ``bench`` and the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._harness import summarize, train_seconds  # noqa: E402
from bench._machine import write_result  # noqa: E402
from memsched.cli.demo import stand_in  # noqa: E402
from memsched.devices.spec import parse_bandwidth  # noqa: E402
from memsched.models import build_gpt, count_parameters, lm_loss  # noqa: E402
from memsched.telemetry.step_timeline import WAITS  # noqa: E402

MACHINE_NOTE = ("the 2-core CPU development VM (no GPU), shared with other work: the stand-in device "
                "(tensors on the CPU); the link's copies are modelled by sleeping copy threads")


def fetch_waits_s(sched: Any) -> list[float]:
    """Per recorded step, seconds the training thread waited for a fetched chunk's H2D copy."""
    return [sum(s.seconds for s in r.spans if s.track == WAITS and s.name.startswith("fetch <-"))
            for r in sched.step_timeline.records]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="demo", help="GPT preset (memsched.models)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--links", default="25GBps,12GBps", help="comma-separated link bandwidths")
    ap.add_argument("--rounds", type=int, default=2, help="attach-train rounds per configuration (ABBA)")
    ap.add_argument("--blocks", type=int, default=3, help="timed blocks per round")
    ap.add_argument("--block", type=int, default=3, help="steps per block")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (the traced warmup step included)")
    ap.add_argument("--resident-capacity", default="2GiB",
                    help="the stand-in of the resident configuration (it holds every parameter)")
    ap.add_argument("--name", default="param_offload")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    chosen = stand_in(args.size, args.batch, args.seq)
    if not chosen.params_on_host:
        raise SystemExit(f"the {args.size} GPT at {args.batch} x {args.seq} keeps its parameters on the "
                         "device in every predicted plan: nothing to measure")
    # One scheduler at a time: a stand-in counts every tensor made while it is attached, another run's too.
    # So the configurations run one after the other, in ABBA rounds (resident, offloaded, offloaded,
    # resident, ...) so that drift of the machine falls on both alike; each round attaches anew (its warmup
    # untimed) and trains the same batches.
    gen = torch.Generator().manual_seed(1)
    vocab = build_gpt(args.size).config.vocab_size
    batches = []
    for _ in range(args.warmup + args.blocks * args.block):
        x = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
        batches.append((x[:, :-1], x[:, 1:]))
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for link in args.links.split(","):
        parse_bandwidth(link)  # a bad spelling fails here, before any training
        for kind in ("resident", "offloaded"):
            runs[(link, kind)] = {"block_s": [], "round_s": [], "rows": [], "fetch_wait_s": [],
                                  "fetch_stats": []}
    order = [k for r in range(args.rounds) for k in (("resident", "offloaded") if r % 2 == 0
                                                      else ("offloaded", "resident"))]
    for link in args.links.split(","):
        for kind in order:
            run = runs[(link, kind)]
            torch.manual_seed(0)
            model = build_gpt(args.size)
            if kind == "resident":
                device = f"sim:{args.resident_capacity},link={link}"
                sched = memsched.attach(model, policy="cpu", device=device)
            else:
                device = f"sim:{chosen.capacity_bytes},link={link}"
                sched = memsched.attach(model, policy="auto", device=device,
                                        policy_options={"warmup_non_model_share": 1.0})
            with sched:
                on = sched.device.torch_device  # each batch moves to the device at its step, as on a GPU

                def loss(b, m=model, on=on):
                    return lm_loss(m, *(t.to(on) for t in b))

                train_seconds(sched, batches[:args.warmup], loss)
                sched.sim.reset_peak()
                if sched.params is not None:
                    sched.params.take_stats()
                blocks = []
                for b in range(args.blocks):
                    part = batches[args.warmup + b * args.block:args.warmup + (b + 1) * args.block]
                    sched.step_timeline.records.clear()
                    blocks.append(train_seconds(sched, part, loss) / len(part))
                    run["rows"] += sched.step_timeline.summaries()[1:]  # the first includes the block start
                    run["fetch_wait_s"] += fetch_waits_s(sched)[1:]
                    if sched.params is not None:
                        stats = sched.params.take_stats()
                        run["fetch_stats"].append({k: v / len(part) for k, v in stats.items()})
                run["block_s"] += blocks
                run["round_s"].append(statistics.median(blocks))
                run.update(device=device, peak=sched.sim.peak_bytes, plan=sched.plan, problem=sched.problem,
                           history=[h.reason for h in sched.plan_history], chunks=len(sched.store.chunks))
            run["params"] = [p.detach().cpu().clone() for p in model.parameters()]
            run["n_params"] = count_parameters(model)
            del model, sched, loss  # off the stand-in before the next run attaches (its scheduler keeps its
            gc.collect()  # optimizer state on the device until it is dropped)
    params = [run["params"] for run in runs.values()]
    same = all(torch.equal(p, q) for other in params[1:] for p, q in zip(params[0], other, strict=True))
    first = next(iter(runs.values()))
    n_params = first["n_params"]

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    out: dict[str, dict[str, Any]] = {}
    for (link, kind), run in runs.items():
        rows, plan, problem = run["rows"], run["plan"], run["problem"]
        entry: dict[str, Any] = {
            "device": run["device"],
            "step": summarize(run["block_s"]),
            "round_medians_s": run["round_s"],
            "phases_s": {p: statistics.median(r["phases_s"][p] for r in rows) for p in rows[0]["phases_s"]},
            "stalls_s": {  # where the training thread waited, per step (median)
                "fetch_h2d": statistics.median(run["fetch_wait_s"]),
                "other_copies": med(rows, "copy_wait_s") - statistics.median(run["fetch_wait_s"]),
                "all_waits": med(rows, "waits_s"),
                "cpu_update_exposed": med(rows, "exposed_cpu_s"),
            },
            "h2d_copy_bytes_per_step": med(rows, "h2d_copy_bytes"),
            "d2h_copy_bytes_per_step": med(rows, "d2h_copy_bytes"),
            "device_peak_bytes": run["peak"],
            "peak_non_model_bytes": problem.peak_non_model_bytes,
            "device_model_bytes_per_parameter_at_peak":
                (run["peak"] - problem.peak_non_model_bytes) / n_params,
            "placement": {"host_chunks": len(plan.host_chunks), "chunks": len(plan.placement),
                          "param_host_chunks": len(plan.param_host_chunks)},
            "plan_history": run["history"],
        }
        if plan.schedule is not None:
            sched_ = plan.schedule
            at_peak = max(range(len(sched_.accesses)), key=lambda k: sched_.accesses[k].non_model_bytes)
            entry["schedule"] = {
                "resident_at_peak": len(sched_.targets[at_peak]),  # offloaded chunks on the device there
                "fetches": sched_.fetches, "prefetched": sched_.prefetched,
                "max_resident": sched_.max_resident, "keep": len(sched_.keep),
                "chunk_param_bytes": max(c.param_bytes for c in problem.chunks),
                "max_prefetch": plan.options.get("max_prefetch"),
                "offloaded_chunks": len(plan.param_host_chunks), "predicted_peak_bytes": plan.peak_bytes}
            entry["fetches_per_step"] = {k: statistics.median(s[k] for s in run["fetch_stats"])
                                         for k in run["fetch_stats"][0]}
        out.setdefault(link, {})[kind] = entry
    for link, pair in out.items():
        res, off = runs[(link, "resident")], runs[(link, "offloaded")]
        # the condition of the target: each chunk's compute (forward + backward over the chunks) outlasts
        # the modelled copy of its parameters
        phases = pair["resident"]["phases_s"]
        sched_info = pair["offloaded"]["schedule"]
        pair["compute_s_per_chunk"] = (phases["forward"] + phases["backward"]) / first["chunks"]
        pair["modelled_copy_s_per_chunk"] = sched_info["chunk_param_bytes"] / parse_bandwidth(link)
        ratios = [o / r for o, r in zip(off["round_s"], res["round_s"], strict=True)]
        pair["offloaded_vs_resident"] = {
            "of_medians": pair["offloaded"]["step"]["median_s"] / pair["resident"]["step"]["median_s"],
            "per_round": ratios,
        }
    result = {
        "what": "step time with some parameters kept on the host and fetched for their reads (policy auto on "
                "the stand-in memsched demo sizes: parameters and gradients do not fit beside the non-model "
                "peak) against every parameter on the device (policy cpu on a larger stand-in), with a "
                "modelled host link, one compute thread, ABBA rounds; step = block wall time / steps "
                "(median over blocks); stalls from sched.step_timeline (host clocks)",
        "machine_note": MACHINE_NOTE,
        "config": vars(args),
        "model": {"size": args.size, "parameters": n_params, "chunks": first["chunks"],
                  "parameter_bytes": n_params * 4},
        "stand_in_capacity_bytes": chosen.capacity_bytes,
        "bit_identical": same,
        "links": out,
    }
    path = write_result(args.name, result)
    parts = []
    for link, pair in out.items():
        off = pair["offloaded"]
        rounds = ", ".join(f"{r:.3f}" for r in pair["offloaded_vs_resident"]["per_round"])
        parts.append(
            f"link={link}: offloaded {off['step']['median_s'] * 1e3:.0f} ms vs resident "
            f"{pair['resident']['step']['median_s'] * 1e3:.0f} ms = "
            f"{pair['offloaded_vs_resident']['of_medians']:.3f}x "
            f"(per round {rounds}), "
            f"fetch waits "
            f"{off['stalls_s']['fetch_h2d'] * 1e3:.1f} ms/step, model bytes/param at the peak "
            f"{off['device_model_bytes_per_parameter_at_peak']:.2f} vs "
            f"{pair['resident']['device_model_bytes_per_parameter_at_peak']:.2f}, offloaded chunks on the "
            f"device at the peak {off['schedule']['resident_at_peak']} of "
            f"{off['schedule']['offloaded_chunks']}")
    print(f"{args.size} GPT ({n_params:,} parameters) at {args.batch} x {args.seq}, stand-in "
          f"{chosen.capacity_bytes} bytes: " + "; ".join(parts) + f"; bit-identical: {same}; wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
