"""Parameter alignment in chunks on a real GPU (run by hand): do parameters packed at any 4-byte offset change
CUDA's results against torch's own tensors, which start on 512-byte boundaries?

Run ``python bench/param_alignment.py`` from the repository root on a CUDA machine (about half a minute;
``--device sim:64MiB`` is the CPU smoke test, where both packings must be exact: the CPU's kernels do not
choose by address). An MLP of odd sizes (61 -> 253 -> 253 -> 61, LayerNorm, -> 7; ten parameters, most of
whose densely packed offsets are not multiples of 4 elements) trains ``--steps`` steps with memsched (policy
``cuda``: every chunk on the device) and torch's ``clip_grad_norm_(model.parameters(), 0.05)`` between
backward and step (it triggers), against a copy trained by ``torch.optim.AdamW(fused=True)`` with the same
clip. Twice: packed as memsched packs, every parameter at a multiple of
:data:`memsched.chunks.PARAM_ALIGN` elements ([Note: parameter alignment in chunks] in
``memsched/chunks/sizing.py``), and packed densely (alignment 1, memsched before 2026-11-27).

Recorded per packing: ``unaligned_parameters`` (addresses not on a 16-byte boundary), ``bit_identical``,
``first_different_step`` and ``max_abs_diff`` of the parameters, and the clip's total norms on both sides
(``norms_equal``). The expectation: ``aligned`` bit-identical; ``dense`` shows whether the alignment matters
on this card (``_foreach_norm`` sums an unaligned gradient in another order there). Results go to
``bench/results/param_alignment_<device>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make ``bench``, ``tests`` and the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._machine import write_result  # noqa: E402
from memsched.chunks import PARAM_ALIGN  # noqa: E402
from memsched.chunks.events import OneProcess  # noqa: E402
from memsched.devices.spec import parse_device  # noqa: E402
from memsched.distributed.base import DataParallel  # noqa: E402
from tests._numerics import LR, WD, uncounted  # noqa: E402

CLIP = 0.05


def odd_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(61, 253), nn.GELU(), nn.Linear(253, 253), nn.GELU(), nn.Linear(253, 61),
                         nn.LayerNorm(61), nn.Linear(61, 7))


@contextlib.contextmanager
def packing(align: int) -> Iterator[None]:
    """Schedulers attached inside pack parameters at multiples of ``align`` elements (one rank)."""
    saved = DataParallel.align, OneProcess.align
    DataParallel.align = OneProcess.align = align
    try:
        yield
    finally:
        DataParallel.align, OneProcess.align = saved


def run(device: str, align: int, steps: int) -> dict[str, Any]:
    """One training run of each side (see the module docstring); its row."""
    dev = parse_device(device).torch_device
    model = odd_mlp().to(dev)
    with uncounted():
        ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(32, 61, generator=g).to(dev) for _ in range(steps)]
    first, norms_equal, diff = None, True, 0.0
    attach = {"device": device, "policy": "cuda", "lr": LR, "weight_decay": WD}
    with packing(align), memsched.attach(model, **attach) as sched:
        for i, x in enumerate(xs):
            sched.backward(model(x).pow(2).mean())
            ours = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with uncounted():
                ref(x).pow(2).mean().backward()
                theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
            norms_equal &= bool(torch.equal(ours.cpu(), theirs.cpu()))
            step_diff = max(float((p.detach().cpu().double() - q.detach().cpu().double()).abs().max())
                            for p, q in zip(model.parameters(), ref.parameters(), strict=True))
            if step_diff > 0 and first is None:
                first = i
            diff = max(diff, step_diff)
        unaligned = sum(p.data_ptr() % 16 != 0 for p in model.parameters())
    return {"align_elements": align, "unaligned_parameters": unaligned, "bit_identical": first is None,
            "first_different_step": first, "max_abs_diff": diff, "norms_equal": norms_equal}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "sim:64MiB",
                    help="memsched's device (default: cuda when available, else the stand-in)")
    ap.add_argument("--steps", type=int, default=5, help="training steps per run")
    args = ap.parse_args(argv)
    rows = {"aligned": run(args.device, PARAM_ALIGN, args.steps), "dense": run(args.device, 1, args.steps)}
    for name, row in rows.items():
        print(f"{name:>8}: {row}")
    slug = parse_device(args.device).kind
    write_result(f"param_alignment_{slug}", {"device": args.device, "steps": args.steps, "clip": CLIP,
                                             "runs": rows})
    return 0 if rows["aligned"]["bit_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
