"""`memsched trace TARGET`: run a few training steps of a workload under the memory tracer, print the report
and write the exports (timeline JSON, Perfetto, PyTorch memory_viz snapshot, PNG).

The TARGET contract is documented in :mod:`memsched.target` and in ``memsched trace --help``.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from rich.console import Console

from memsched.commands.argtypes import positive_int
from memsched.commands.report import add_export_options, check_exports, write_exports
from memsched.exports import SUFFIXES
from memsched.report import render_report

if TYPE_CHECKING:  # torch is imported when the command runs, so `memsched --help` stays quick
    import torch

TARGET_HELP = """\
TARGET is path/to/file.py:function or package.module:function. memsched calls
function(device) with a torch.device; it must return (model, loss_fn), or
memsched.target.Workload(model, loss_fn), where model is an nn.Module on that
device and loss_fn(model) builds one batch on the device and returns a scalar
loss. memsched then runs loss.backward() and the optimizer step. The device
may be a fake CUDA device under FakeTensorMode (memsched plan), so create
tensors on the given device. Example:

  def build(device):
      model = MyNet().to(device)
      def loss_fn(m):
          x = torch.randn(32, 128, device=device)
          return m(x).square().mean()
      return model, loss_fn

  memsched trace examples/trace_target.py:build --steps 2
"""


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="trace the memory of a few training steps of TARGET; print the report and write exports",
        description="Run --steps training steps of TARGET under memsched's memory tracer, print the report "
        "and write the timeline JSON, a Perfetto trace, a PyTorch memory_viz snapshot and a PNG "
        "(when matplotlib is installed) to --out.",
        epilog=TARGET_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="TARGET", help="path/to/file.py:function or package.module:function")
    p.add_argument("--steps", type=positive_int, default=2, help="training steps to trace (>= 1, default: 2)")
    p.add_argument("--device", default=None, help="device to train on (default: cuda if available, else cpu)")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "none"),
        default="adamw",
        help="adamw: torch.optim.AdamW, so optimizer states appear in the trace (default); "
        "none: backward only",
    )
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    p.add_argument(
        "--backend",
        choices=("auto", "tensor", "cuda"),
        default="auto",
        help="how the tracer measures: cuda (allocator statistics), tensor (tracks tensors; any "
        "device), auto (cuda on CUDA, else tensor; the default)",
    )
    p.add_argument(
        "--out",
        default="memsched-out/trace",
        metavar="DIR",
        help="folder for the exports (default: memsched-out/trace; created if missing): "
        + ", ".join(f"trace{s}" for s in SUFFIXES.values())
        + "; existing files are replaced",
    )
    add_export_options(p, with_json=True)
    p.add_argument("--top", type=positive_int, default=10, help="modules to list in the report (default: 10)")
    p.add_argument("--quiet", action="store_true", help="do not print the report, only where files went")
    p.set_defaults(func=run)


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

    console = Console()
    if not args.quiet:
        render_report(timeline, top=args.top, console=console)
    return write_exports(
        timeline, out_dir=args.out, overrides=overrides, kinds=list(SUFFIXES), console=console
    )
