"""The stand-in's modelled host link: the step time it adds and where the training thread stalls (CPU; run by
hand).

Run ``python bench/link_model.py`` from the repository root (about 10 s). One process, one compute thread
(``torch.set_num_threads(1)``) and, with a link, its two copy threads (which sleep through most of each
copy). Copies of the built-in GPT (``--size``, default ``tiny``) train side by side with policy ``cpu`` (every
chunk's optimizer state on the host, so every chunk's gradients cross the link D2H and its parameters H2D
each step) on stand-in devices without a link and with ``link=25GBps``, ``link=12GBps`` (PCIe 4 and 3 x16
class links) and ``link=200MBps`` (a link slow enough to show above the harness's floor on the tiny GPT)
(``device="sim:SIZE,link=..."``, :mod:`memsched.devices.transfers`), in interleaved blocks of ``--block``
steps, so all see the same machine load. Each block ends with ``sched.synchronize()`` (its last H2D copies are
inside its time).

Recorded per configuration: the step time (block wall time / steps, median over blocks), its ratio to the run
without a link (ratio of the medians, and the median of the per-block ratios against the block run just
before, which cancels most drift), and from ``sched.step_timeline`` over the steps of each block but its
first: the phases, the training thread's waits for copies (``copy_wait_s``: a forward waiting for its chunks'
H2D, the step waiting for the gradients' D2H), the time on the copy tracks and their bytes, and how far the
copies' measured durations exceed ``bytes / bandwidth`` (the harness's floor: a thread hand-off and a sleep
per copy; where a step's modelled copy time is below it, ``modelled_below_harness_floor``, the step ratio
measures the harness, not the link). The runs are checked bit for bit against each other (the link changes
when, never what).
"""

from __future__ import annotations

import argparse
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
from memsched.devices.spec import parse_bandwidth  # noqa: E402
from memsched.models import build_gpt, count_parameters, lm_loss  # noqa: E402

MACHINE_NOTE = ("the 2-core CPU development VM (no GPU), shared with other work: the stand-in device "
                "(tensors on the CPU); the link's copies are modelled by sleeping copy threads")


def copy_overshoot(sched: Any, bytes_per_s: float) -> dict[str, float] | None:
    """The copy spans of the recorded steps: measured / modelled duration (median, p90), the median excess
    over the modelled duration (seconds per copy: the harness's floor) and the count; ``None`` without
    copies."""
    spans = [s for r in sched.step_timeline.records for s in r.spans
             if s.track in ("h2d", "d2h") and s.args.get("bytes")]
    if not spans:
        return None
    ratios = sorted(s.seconds / (s.args["bytes"] / bytes_per_s) for s in spans)
    excess = [s.seconds - s.args["bytes"] / bytes_per_s for s in spans]
    return {"median": statistics.median(ratios), "p90": ratios[int(0.9 * (len(ratios) - 1))],
            "excess_s": statistics.median(excess), "n": len(ratios),
            "steps": len(sched.step_timeline.records)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", help="GPT preset (memsched.models)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--links", default="25GBps,12GBps,200MBps",
                    help="comma-separated link bandwidths (200MBps: slow enough that the tiny GPT's copies "
                         "take longer than what the harness adds to them)")
    ap.add_argument("--capacity", default="1GiB", help="the stand-in's size")
    ap.add_argument("--overlap", action="store_true", help="overlap=True (the CPU update on a worker)")
    ap.add_argument("--blocks", type=int, default=10, help="timed blocks per configuration")
    ap.add_argument("--block", type=int, default=6, help="steps per block")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (the traced warmup step included)")
    ap.add_argument("--name", default="link_model")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    links = {"none": None, **{text: parse_bandwidth(text) for text in args.links.split(",")}}
    runs: dict[str, dict[str, Any]] = {}
    for name, bw in links.items():
        torch.manual_seed(0)
        model = build_gpt(args.size)
        device = f"sim:{args.capacity}" + (f",link={name}" if bw is not None else "")
        sched = memsched.attach(model, policy="cpu", device=device, overlap=args.overlap)
        runs[name] = {"model": model, "sched": sched, "bandwidth": bw, "device": device}
    vocab = runs["none"]["model"].config.vocab_size
    on = runs["none"]["sched"].device.torch_device  # every run's device: the stand-in, sim:0
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.warmup + args.blocks * args.block):
        x = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen).to(on)
        batches.append((x[:, :-1], x[:, 1:]))

    def train(run: dict[str, Any], part: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        return train_seconds(run["sched"], part, lambda b: lm_loss(run["model"], *b))

    for run in runs.values():
        train(run, batches[:args.warmup])
        run["block_s"], run["rows"], run["overshoot_records"] = [], [], []
    for b in range(args.blocks):
        part = batches[args.warmup + b * args.block:args.warmup + (b + 1) * args.block]
        for run in runs.values():  # interleaved blocks: the same moments of the machine for all
            run["sched"].step_timeline.records.clear()
            run["block_s"].append(train(run, part) / len(part))
            run["rows"] += run["sched"].step_timeline.summaries()[1:]  # the first includes the other runs
            if run["bandwidth"] is not None:
                run["overshoot_records"].append(copy_overshoot(run["sched"], run["bandwidth"]))
    base = runs["none"]
    same = all(torch.equal(p.detach().cpu(), q.detach().cpu()) for name, run in runs.items() if name != "none"
               for p, q in zip(base["model"].parameters(), run["model"].parameters(), strict=True))

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    out: dict[str, Any] = {}
    base_step = statistics.median(base["block_s"])
    for name, run in runs.items():
        sched, rows, bw = run["sched"], run["rows"], run["bandwidth"]
        step = statistics.median(run["block_s"])
        ratios = [s / n for s, n in zip(run["block_s"], base["block_s"], strict=True)]
        q = statistics.quantiles(ratios, n=4, method="inclusive")
        per_step_bytes = sched.transfers.last_h2d_bytes + sched.transfers.last_d2h_bytes
        entry: dict[str, Any] = {
            "device": run["device"],
            "step": summarize(run["block_s"]),
            "vs_no_link": step / base_step,
            "paired_vs_no_link": {"median": statistics.median(ratios), "p25": q[0], "p75": q[2],
                                  "n": len(ratios)},
            "phases_s": {p: statistics.median(r["phases_s"][p] for r in rows) for p in rows[0]["phases_s"]},
            "cpu_update_s": med(rows, "cpu_update_s"),
            "waits_s": med(rows, "waits_s"),
            "copy_wait_s": med(rows, "copy_wait_s"),
            "d2h_wait_in_cpu_update_s": med(rows, "d2h_wait_s"),
            "h2d_copy_s": med(rows, "h2d_s"),
            "d2h_copy_s": med(rows, "d2h_s"),
            "h2d_copy_bytes": med(rows, "h2d_copy_bytes"),
            "d2h_copy_bytes": med(rows, "d2h_copy_bytes"),
            "bytes_per_step": per_step_bytes,
            "host_chunks": sum(c.placement == "host" for c in sched.store.chunks),
        }
        if bw is not None:
            spans = [o for o in run["overshoot_records"] if o is not None]
            entry.update({
                "bandwidth_bytes_per_s": bw,
                "modelled_copy_s_per_step": per_step_bytes / bw,  # both directions, back to back
                "extra_step_s": step - base_step,
                "copy_wait_share_of_extra": (entry["copy_wait_s"] / (step - base_step)
                                             if step > base_step else None),
                "copy_duration_vs_modelled": {
                    "median": statistics.median(o["median"] for o in spans),
                    "p90": statistics.median(o["p90"] for o in spans), "copies": sum(o["n"] for o in spans)},
                # what the harness adds to each copy (a thread hand-off and a sleep's wake-up), and whether
                # the modelled copy time of a step is below what the harness adds to its copies
                "harness_excess_s_per_copy": statistics.median(o["excess_s"] for o in spans),
                "copies_per_step": sum(o["n"] for o in spans) / sum(o["steps"] for o in spans),
            })
            entry["modelled_below_harness_floor"] = (
                entry["modelled_copy_s_per_step"]
                < entry["harness_excess_s_per_copy"] * entry["copies_per_step"])
        out[name] = entry
    result = {
        "what": "step time of the built-in GPT on the stand-in with a modelled host link (sim:SIZE,link=...) "
                "against no link, policy cpu (every chunk crosses the link each step), one compute thread, "
                "interleaved blocks; step = block wall time / steps (median over blocks); stalls from "
                "sched.step_timeline (host clocks)",
        "machine_note": MACHINE_NOTE,
        "config": vars(args),
        "model": {"size": args.size, "parameters": count_parameters(base["model"]),
                  "chunks": len(base["sched"].store.chunks)},
        "bit_identical": same,
        "runs": out,
    }
    path = write_result(args.name, result)
    for run in runs.values():
        run["sched"].close()
    parts = [f"no link {base_step * 1e3:.2f} ms"]
    for name, entry in out.items():
        if name == "none":
            continue
        parts.append(f"link={name} {entry['step']['median_s'] * 1e3:.2f} ms = {entry['vs_no_link']:.3f}x "
                     f"(paired {entry['paired_vs_no_link']['median']:.3f}x), waits for copies "
                     f"{entry['copy_wait_s'] * 1e3:.2f} ms/step, copies H2D "
                     f"{entry['h2d_copy_s'] * 1e3:.2f} + D2H {entry['d2h_copy_s'] * 1e3:.2f} ms/step "
                     f"(modelled "
                     f"{entry['modelled_copy_s_per_step'] * 1e3:.3f} ms; each copy took "
                     f"{entry['copy_duration_vs_modelled']['median']:.1f}x its modelled time)")
    print(f"{args.size} GPT, {out['none']['host_chunks']} host chunks, {out['none']['bytes_per_step']} bytes "
          f"over the link per step: " + "; ".join(parts) + f"; bit-identical: {same}; wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
