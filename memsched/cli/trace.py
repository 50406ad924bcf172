"""`memsched trace TARGET`: run a few training steps of a workload under the memory tracer, print the report
(``--json``: as JSON, :func:`memsched.cli.report.report_dict`) and write the exports (timeline JSON,
Perfetto, PyTorch memory_viz snapshot, PNG).

The TARGET contract is documented in :mod:`memsched.target` and in ``memsched trace --help``; the parser is
:func:`memsched.cli.parsers.add_trace`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import TYPE_CHECKING

from memsched.cli.report import check_exports, print_json, report_dict, write_exports
from memsched.report.console import make_console
from memsched.report.exports import SUFFIXES
from memsched.report.text import render_report

if TYPE_CHECKING:
    import torch

    from tracer.timeline import MemoryTimeline


def resolve_device(name: str | None) -> torch.device:
    """``--device``: default cuda when available, else cpu (:func:`memsched.devices.spec.parse_device`,
    without the stand-in: a TARGET runs on a real torch device).

    Raises:
        ValueError: not cpu, cuda or cuda:N, or a CUDA device that is not there (names the value).
    """
    from memsched.devices.spec import parse_device

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
    device = resolve_device(args.device)
    overrides = {"json": args.timeline, "perfetto": args.perfetto, "memory_viz": args.memory_viz,
                 "png": args.png}
    check_exports(args.out, overrides, list(SUFFIXES))  # a bad output path fails before the trace runs
    # Under --json, whatever the TARGET prints goes to stderr: stdout carries the JSON document alone.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        timeline = trace_target(args, device)

    console = None if args.json else make_console()
    if console is not None and not args.quiet:
        render_report(timeline, top=args.top, console=console)
    status, written = write_exports(
        timeline, out_dir=args.out, overrides=overrides, kinds=list(SUFFIXES), console=console
    )
    if args.json:
        print_json({**report_dict(timeline, top=args.top), "command": "trace",
                    "exports": {kind: str(path) for kind, path in written.items()}})
    return status


def trace_target(args: argparse.Namespace, device: torch.device) -> MemoryTimeline:
    """Build ``args.target`` on ``device`` and trace ``args.steps`` training steps of it (``args.optimizer``,
    ``args.lr``, ``args.backend``); the timeline's meta names the target and the steps.

    Raises:
        ValueError, TypeError: a bad TARGET, or a model without trainable parameters (names the target).
    """
    import torch

    from memsched.target import build_workload

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
    return timeline
