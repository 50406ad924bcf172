"""Elastic placement on the stand-in: predicted vs measured peak non-model data per sequence length, and the
time a re-plan takes (CPU; run by hand, a few minutes).

Run ``python bench/replan.py`` from the repository root. The built-in GPT (``--size``, default ``demo``) is
attached with ``replan="auto"`` on a stand-in, warmed up at the first ``--seq-lens`` entry and trained at the
others in turn (each twice: the first step of a new length runs all-host and is measured, the second runs
with the plan made from that measurement). Recorded per length:

* ``measured_bytes``: the peak non-model data memsched measured in that step (the stand-in's peak counter
  from the forward to the step, minus what was allocated when the forward began);
* ``fake_trace_bytes``: what ``memsched plan`` predicts without running (a ``FakeTensorMode`` trace of one
  forward + backward at that length), and its error against the measurement;
* ``linear_bytes``: the warmup length's measurement scaled by the token count (the cheapest prediction), and
  its error;
* ``replan_s``: the seconds of each plan change (choosing the plan and moving the chunks), from
  ``sched.plan_history`` and a timer around the scheduler's re-plan.

The result says which prediction could replace the measured all-host step, and what that step costs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make ``bench`` and the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._machine import write_result  # noqa: E402
from memsched.models.gpt import build_gpt, lm_loss  # noqa: E402
from memsched.planning.prediction import gpt_workload, trace_step  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="demo")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--device", default="sim:260MiB",
                    help="the stand-in (sized so that the longest needs offload)")
    ap.add_argument("--name", default="replan")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_gpt(args.size)
    vocab = model.config.vocab_size if hasattr(model, "config") else 256
    sched = memsched.attach(model, device=args.device, lr=1e-3, chunk_numel=1 << 20)
    timings: list[tuple[int, float]] = []
    original = sched._replan

    def timed(peak: int | None, reason: str) -> None:
        t0 = time.perf_counter()
        original(peak, reason)
        timings.append((sched.steps, time.perf_counter() - t0))

    sched.elastic.replan = timed
    gen = torch.Generator().manual_seed(0)
    schedule = [args.seq_lens[0]] + [s for s in args.seq_lens for _ in range(2)]
    for seq in schedule:
        x = torch.randint(0, vocab, (args.batch, seq + 1), generator=gen)
        sched.backward(lm_loss(model, x[:, :-1], x[:, 1:]))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
    measured = {sig[0][1]: peak for sig, peak in sched.elastic.measured.items()}
    history = [h.to_dict() for h in sched.plan_history]
    sched.close()  # the stand-in's accounting stops before the fake traces
    base_seq = args.seq_lens[0]
    rows: list[dict[str, Any]] = []
    for seq in args.seq_lens:
        fake = trace_step(gpt_workload(args.size, args.batch, seq), fake=True,
                          device="cpu").peak_non_model_bytes
        linear = measured[base_seq] * seq // base_seq
        m = measured[seq]
        rows.append({"seq_len": seq, "measured_bytes": m, "fake_trace_bytes": fake,
                     "fake_trace_error_pct": 100 * (fake - m) / m, "linear_bytes": linear,
                     "linear_error_pct": 100 * (linear - m) / m})
    result = {
        "what": "elastic placement on the stand-in: predicted vs measured peak non-model data, re-plan time",
        "config": vars(args), "per_seq_len": rows, "plan_history": history,
        "replan_s": [{"step": s, "seconds": t} for s, t in timings],
    }
    path = write_result(args.name, result)
    for r in rows:
        print(f"seq {r['seq_len']:5d}: measured {r['measured_bytes']:>12,} B, fake trace "
              f"{r['fake_trace_error_pct']:+6.1f} %, linear {r['linear_error_pct']:+6.1f} %")
    print(f"{len(history)} plans; re-plan times {', '.join(f'{t * 1e3:.0f} ms' for _, t in timings)}; "
          f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
