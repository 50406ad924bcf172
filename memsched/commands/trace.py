"""`memsched trace TARGET`: run a few training steps of a workload under the memory tracer, print the report
and write the exports (timeline JSON, Perfetto, PyTorch memory_viz snapshot, PNG).

The TARGET contract is documented in :mod:`memsched.target` and in ``memsched trace --help``; the parser is
:func:`memsched.commands.parsers.add_trace`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from memsched.commands.report import check_exports, write_exports
from memsched.console import make_console
from memsched.exports import SUFFIXES
from memsched.report import render_report

if TYPE_CHECKING:
    import torch


def resolve_device(name: str | None) -> torch.device:
    """``--device``: default cuda when available, else cpu (:func:`memsched.devices.parse_device`, without the
    stand-in: a TARGET runs on a real torch device).

    Raises:
        ValueError: not cpu, cuda or cuda:N, or a CUDA device that is not there (names the value).
    """
    from memsched.devices import parse_device

    try:
        spec = parse_device(name)
    except ValueError as e:
        if not str(name).strip().lower().startswith(("cpu", "cuda", "sim")):
            raise ValueError(f"--device {name!r} is not a torch device; expected cpu, cuda or cuda:N") \
                from None
        raise ValueError(f"--device {name!r}: {e}") from None
    if spec.is_sim:
        raise ValueError(f"--device {name!r}: memsched trace runs on cpu, cuda or cuda:N, not the stand-in")
    return spec.torch_device


def run(args: argparse.Namespace) -> int:
    import torch

    from memsched.target import build_workload

    device = resolve_device(args.device)
    overrides = {"json": args.json, "perfetto": args.perfetto, "memory_viz": args.memory_viz, "png": args.png}
    check_exports(args.out, overrides, list(SUFFIXES))  # a bad output path fails before the trace runs
    workload = build_workload(args.target, device)  # bad input fails here, before anything is traced
    from tracer import MemoryTracer

    model = workload.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(
            f"TARGET {args.target!r}: the model has no trainable parameters; expected at least one "
            "parameter with requires_grad=True"
        )
    optimizer = torch.optim.AdamW(trainable, lr=args.lr) if args.optimizer == "adamw" else None
    with MemoryTracer(model, optimizer=optimizer, device=device, backend=args.backend) as tracer:
        for _ in range(args.steps):
            loss = workload.loss()
            loss.backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
            del loss
    timeline = tracer.timeline
    timeline.meta.setdefault("target", args.target)
    timeline.meta.setdefault("steps", args.steps)

    console = make_console()
    if not args.quiet:
        render_report(timeline, top=args.top, console=console)
    return write_exports(
        timeline, out_dir=args.out, overrides=overrides, kinds=list(SUFFIXES), console=console
    )
