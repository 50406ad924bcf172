"""The host link's bytes per step of steps that clip, against steps that do not (CPU; run by hand, a minute).

Run ``python bench/clip_link.py`` from the repository root. The built-in GPT (``--size``, default ``small``)
is attached on the stand-in with ``policy="cpu"`` (every chunk's optimizer state and gradients on the host),
in fp32 and in bf16, and trained four ways from the same start: without a clip; with
``sched.clip_grad_norm_``; the same with ``norms_from_backward=False`` (what the clip did before the norms
taken in backward: ``memsched-copy-back``); and with torch's ``clip_grad_norm_(model.parameters())`` (which
finds the host chunks' gradients on the host). Recorded per run, over the steady-state steps: the H2D and D2H
bytes per step (``sched.transfers_dict``), the clip's own H2D bytes, and how many host chunks' norms the clips
of those steps took from backward ([Note: norms taken in backward] in ``memsched/optim/clipping.py``).
Issue 41 reported that ``sched.clip_grad_norm_`` doubled nanoGPT's H2D bytes per step on the stand-in (7.0
to 14.0 MiB).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make ``bench`` and the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._machine import write_result  # noqa: E402
from memsched.models.gpt import build_gpt, lm_loss  # noqa: E402

MiB = 2**20


def run(size: str, dtype: torch.dtype, clip: str, steps: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build_gpt(size)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (2, 129), generator=g) for _ in range(steps)]
    rows = []
    with memsched.attach(model, policy="cpu", device="sim:4GiB", dtype=dtype, warmup_steps=warmup,
                         lr=1e-4) as sched:
        for i, x in enumerate(batches):
            x = x.to(sched.device.torch_device)
            t0 = dict(sched.transfers_dict)
            sched.backward(lm_loss(model, x[:, :-1], x[:, 1:]))
            t1 = dict(sched.transfers_dict)
            if clip.startswith("memsched"):  # copy-back: as before the norms taken in backward
                sched.clip_grad_norm_(1.0, norms_from_backward=clip == "memsched")
            elif clip == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            t2 = dict(sched.transfers_dict)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            t3 = dict(sched.transfers_dict)
            if i == warmup - 1:
                hits0 = sched.optimizer.clipper.backward_norm_hits
            if i >= warmup:
                rows.append({"h2d": t3["h2d_bytes"] - t0["h2d_bytes"],
                             "d2h": t3["d2h_bytes"] - t0["d2h_bytes"],
                             "clip_h2d": t2["h2d_bytes"] - t1["h2d_bytes"]})
        hits = sched.optimizer.clipper.backward_norm_hits - hits0  # in the steady-state steps
        host_chunks = len(sched.plan.host_chunks)
    n = len(rows)
    return {"dtype": str(dtype).removeprefix("torch."), "clip": clip, "steady_steps": n,
            "host_chunks": host_chunks, "backward_norm_hits": hits,
            "h2d_mib_per_step": sum(r["h2d"] for r in rows) / n / MiB,
            "d2h_mib_per_step": sum(r["d2h"] for r in rows) / n / MiB,
            "clip_h2d_mib_per_step": sum(r["clip_h2d"] for r in rows) / n / MiB}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", help="GPT size (default small)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--name", default="clip_link")
    args = ap.parse_args(argv)
    clips = ("none", "memsched", "memsched-copy-back", "torch")
    results = [run(args.size, dtype, clip, args.steps, args.warmup)
               for dtype in (torch.float32, torch.bfloat16) for clip in clips]
    for r in results:
        print(f"{r['dtype']:8s} clip={r['clip']:18s} H2D {r['h2d_mib_per_step']:8.2f} MiB/step "
              f"(clip {r['clip_h2d_mib_per_step']:7.2f}), D2H {r['d2h_mib_per_step']:8.2f} MiB/step, "
              f"{r['backward_norm_hits']} chunk norms from backward")
    path = write_result(args.name, {"size": args.size, "policy": "cpu", "device": "sim:4GiB",
                                    "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
