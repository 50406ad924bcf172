"""`memsched demo`: the main job end to end. Train the built-in GPT on real text (the Python standard
library's sources, byte-level) under memsched: warmup trace, placement plan, hybrid CPU/device AdamW; then the
report, the plan and the exports (``--json``: the report, ``plan.json``'s and ``demo.json``'s contents and the
exports' paths as one JSON document on stdout).

Device: CUDA when present. Without a GPU the stand-in accelerator ``sim:SIZE`` is used, sized by
:func:`stand_in_capacity` from a fake trace of the same model and batch so that its parameters and gradients
do not all fit: the plan keeps the optimizer state, the gradients and some chunks' parameters on the host,
and the parameters come to the device for their reads, with real H2D/D2H traffic.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

import memsched
import policies
from memsched.cli import parsers
from memsched.cli.report import print_json, report_dict
from memsched.data import TextCorpus, batches, load_stdlib_corpus
from memsched.devices.spec import ALLOWED as DEVICE_FORMS
from memsched.devices.spec import parse_device
from memsched.models import config_for, lm_loss
from memsched.models.gpt import build_gpt
from memsched.report.console import make_console
from memsched.report.progress import StepStats, TrainingProgress
from policies.types import check_ratio
from policies.units import format_bytes
from tracer.timeline import atomic_write_text

# The defaults live with the parser (memsched.cli.parsers), which --help reads without torch.
DEFAULT_SIZE = parsers.DEMO_SIZE
DEFAULT_STEPS = parsers.DEMO_STEPS
DEFAULT_BATCH_SIZE = parsers.DEMO_BATCH_SIZE
DEFAULT_SEQ_LEN = parsers.DEMO_SEQ_LEN
DEFAULT_LR = parsers.DEMO_LR
DEFAULT_OUT = parsers.DEMO_OUT
EVAL_BATCHES = 4
# torch.OutOfMemoryError exists from torch 2.5; torch 2.4 has the same class under torch.cuda.
_OOM: type[Exception] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


STAND_IN_GRANULE = 64 * 2**10  # bytes
#: Where the auto-sized stand-in's capacity lies between the smallest that a predicted plan fits (every
#: parameter it can keep on the host there) and the smallest whose plan keeps them all on the device.
STAND_IN_PARAM_SHARE = 0.5
#: On a GPU the cap also leaves this share of itself to the caching allocator's rounding (2 MiB segments),
#: which a fake trace does not see: at the demo's few hundred MiB, 29 MiB (8 %) were reserved but
#: unallocated when an H200 capped at the fake trace's size alone ran out of memory
#: (bench/results/demo_cuda_capped_h200.log). With that share, capped at 468.1 MiB, the first planned step ran
#: out with 45.8 MiB (9.8 %) reserved but unallocated (demo_cuda_capped_2026-11-27_h200.log): the cap also
#: switches the allocator to expandable segments (:func:`_fewer_gaps`).
GPU_ALLOCATOR_SHARE = 0.10


def _fewer_gaps() -> Callable[[], None]:
    """Where the user set no ``PYTORCH_CUDA_ALLOC_CONF``: the caching allocator's expandable segments, which
    grow one mapping instead of keeping a gap in each fixed 2 or 20 MiB segment, for the capped demo. Returns
    what sets it back (the setting is the process's, the demo's only while it runs)."""
    setting = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setting is None or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return lambda: None
    setting("expandable_segments:True")
    return lambda: setting("expandable_segments:False")


@dataclass(frozen=True)
class StandIn:
    """The auto-sized stand-in of :func:`stand_in`.

    Attributes:
        capacity_bytes: its capacity, bytes.
        params_on_host: the predicted plan keeps some parameters on the host (the warmup traces with them
            there: ``auto``'s ``warmup_non_model_share`` 1).
    """

    capacity_bytes: int
    params_on_host: bool


def stand_in(size: str, batch_size: int, seq_len: int, *, gpu_margin_mem_ratio: float = 0.8,
             device: torch.device | None = None) -> StandIn:
    """The stand-in device (its capacity a whole number of 64 KiB: a MiB is too coarse for the smallest
    models, where it is several chunks) on which the parameters and gradients of GPT ``size`` trained on
    ``[batch_size, seq_len]`` batches do not all fit: ``auto`` keeps every chunk's optimizer state and
    gradients, and some chunks' parameters, on the host.

    From a fake trace (:func:`memsched.planning.prediction.trace_step`) and the plans of ``auto`` for it
    (:func:`memsched.planning.capacity.plan_for_capacity`): the capacity is ``STAND_IN_PARAM_SHARE`` of the
    way from the smallest capacity with a plan to the smallest whose plan keeps every parameter on the
    device (binary searches over the capacity). ``device``: the device traced (fake tensors), the stand-in
    by default; a CUDA device for the cap put on a GPU (the stand-in cannot be loaded beside CUDA:
    [Note: one accelerator per process] in :mod:`memsched.devices.sim_backend`).

    Raises:
        ValueError: unknown size, bad batch/sequence, or a ratio outside [0, 1].
    """
    from memsched.devices import sim_backend
    from memsched.planning.capacity import plan_for_capacity, verdict
    from memsched.planning.prediction import gpt_workload, trace_step

    gpu_margin_mem_ratio = check_ratio(gpu_margin_mem_ratio)
    # traced on the device itself (fake tensors: nothing allocated), whose kernels, and so activations,
    # differ from the CPU's (the stand-in's attention, for one, keeps more)
    if device is None:
        sim_backend.load()
        device = torch.device(sim_backend.NAME, 0)
    prediction = trace_step(gpt_workload(size, batch_size, seq_len), fake=True, device=device)

    def status(capacity: float) -> str:
        cp = plan_for_capacity(prediction, int(capacity), gpu_margin_mem_ratio=gpu_margin_mem_ratio,
                               policy_names=["auto"])
        return verdict(cp)["status"]

    def smallest(ok: tuple[str, ...], lo: int, hi: int) -> int:
        """The smallest capacity in (lo, hi] whose status is in ``ok`` (to a granule; ``hi`` is one)."""
        while hi - lo > STAND_IN_GRANULE // 4:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if status(mid) in ok else (mid, hi)
        return hi

    problem = plan_for_capacity(prediction, 1, policy_names=[]).problem
    everything = problem.peak_non_model_bytes + problem.resident_model_bytes + \
        sum(c.device_bytes for c in problem.chunks)
    # Where the predicted plans keep parameters on the host: from the smallest capacity with a plan to the
    # smallest whose plan keeps every parameter on the device. The stand-in is put STAND_IN_PARAM_SHARE of
    # the way up that window, so that the real warmup trace, a little different, still finds such a plan.
    low = smallest(("offload_params", "offload", "fits"), problem.peak_non_model_bytes, everything)
    high = smallest(("offload", "fits"), low, everything)
    capacity = low + STAND_IN_PARAM_SHARE * (high - low)
    capacity = int(math.ceil(capacity / STAND_IN_GRANULE)) * STAND_IN_GRANULE
    return StandIn(capacity, status(capacity) == "offload_params")


def evaluate(model: torch.nn.Module, tokens: torch.Tensor, batch_size: int, seq_len: int,
             device: torch.device, *, seed: int = 0, n_batches: int = EVAL_BATCHES) -> float:
    """Mean loss (nats per token) of ``model`` over ``n_batches`` fixed batches of ``tokens``, no grad."""
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in batches(tokens, batch_size, seq_len, seed=seed, steps=n_batches):
            total += float(lm_loss(model, x.to(device), y.to(device)))
    model.train(was_training)
    return total / n_batches


def cuda_workspace_bytes(dev: torch.device) -> int:
    """Device memory that a training step holds beyond its tensors, measured: the cuBLAS workspaces of the
    forward's thread and of autograd's device thread (one per handle, allocated by the caching allocator at
    the first matrix product and kept), which a fake trace does not allocate. Bytes, from
    ``torch.cuda.memory_allocated`` around one small forward and backward."""
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    a = torch.randn(64, 64, device=dev, requires_grad=True)
    (a @ a).sum().backward()
    del a
    torch.cuda.synchronize(dev)
    return max(0, torch.cuda.memory_allocated(dev) - before)


def _choose_device(args: argparse.Namespace) -> tuple[str, bool, int | None]:
    """The device string for attach, whether the warmup should trace with the parameters on the host (the
    auto-sized device's prediction says they do not all fit), and the cap put on the GPU (bytes; ``None``:
    none). Validates ``--device`` (ValueError naming it and the allowed forms).

    Without ``--device`` on a CUDA machine the GPU is capped at the size the stand-in would get
    (:func:`stand_in`, ``torch.cuda.set_per_process_memory_fraction``): on a whole 80 GB GPU the demo model
    fits with room to spare and the report would show none of the plan's work. ``--device cuda`` uses the
    whole GPU. On the GPU the cap adds what a fake trace cannot see: the allocator's rounding
    (``GPU_ALLOCATOR_SHARE``) and the cuBLAS workspaces (:func:`cuda_workspace_bytes`)."""
    text = args.device
    if text is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        chosen = stand_in(args.size, args.batch_size, args.seq_len,
                          gpu_margin_mem_ratio=args.gpu_margin_mem_ratio, device=dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        cap = int(chosen.capacity_bytes * (1 + GPU_ALLOCATOR_SHARE)) + cuda_workspace_bytes(dev)
        if cap < total:
            torch.cuda.set_per_process_memory_fraction(cap / total, dev)
            return "cuda", chosen.params_on_host, cap
        return "cuda", False, None
    if text is None:
        text = "sim"
    if text.strip().lower() == "sim":
        chosen = stand_in(args.size, args.batch_size, args.seq_len,
                          gpu_margin_mem_ratio=args.gpu_margin_mem_ratio)
        return f"sim:{chosen.capacity_bytes}", chosen.params_on_host, None
    try:
        parse_device(text)
    except ValueError as e:
        raise ValueError(f"{e} (allowed: {DEVICE_FORMS}, or 'sim' to size the stand-in "
                         "automatically)") from None
    return text, False, None


def run(args: argparse.Namespace) -> int:
    # ---- validate everything before any work ---------------------------------------------------------------
    config = config_for(args.size)  # ValueError listing the known sizes
    if args.seq_len > config.block_size:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the {args.size!r} model's block size "
                         f"{config.block_size}")
    if args.policy not in policies.names():
        raise ValueError(f"unknown policy {args.policy!r}: known policies are {', '.join(policies.names())}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a folder")

    console = make_console(stderr=args.json)  # under --json stdout carries the JSON document alone
    device, params_on_host, gpu_cap = _choose_device(args)
    restore_allocator = _fewer_gaps() if gpu_cap is not None else (lambda: None)
    try:
        return _run(args, console, out, device, params_on_host, gpu_cap)
    finally:
        if gpu_cap is not None:  # the cap is the demo's, not the process's
            torch.cuda.set_per_process_memory_fraction(1.0)
        restore_allocator()


def _run(args: argparse.Namespace, console: Console, out: Path, device: str, params_on_host: bool,
         gpu_cap: int | None) -> int:
    corpus = load_stdlib_corpus()
    torch.manual_seed(args.seed)
    model = build_gpt(args.size)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(f"[bold]memsched demo[/bold]: GPT [cyan]{args.size}[/cyan] ({n_params:,} parameters), "
                  f"{args.steps} steps of {args.batch_size} x {args.seq_len} bytes of the Python standard "
                  f"library ({corpus.files} files), policy [cyan]{args.policy}[/cyan], device "
                  f"[cyan]{_device_label(device, gpu_cap)}[/cyan]")
    val_before = evaluate(model, corpus.val, args.batch_size, args.seq_len, torch.device("cpu"),
                          seed=args.seed)

    try:
        summary = _train(args, model, corpus, device, console, params_on_host=params_on_host)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: training stopped, no exports written[/yellow]")
        return 130
    except _OOM as e:
        hint = ("--device cuda uses the whole GPU" if device.startswith("cuda") else
                "try a larger device (--device sim:SIZE) or leave --device out to size the stand-in "
                "automatically")
        console.print(f"[red]memsched demo: the device ran out of memory[/red]: {e}\n{hint}")
        return 1
    sched = summary.pop("_sched")
    tdev = sched.device.torch_device
    summary["val_loss_before"] = val_before
    summary["val_loss_after"] = evaluate(model, corpus.val, args.batch_size, args.seq_len, tdev,
                                         seed=args.seed)

    # ---- report, plan, exports ----------------------------------------------------------------------------
    from memsched.report.exports import write_all
    from memsched.report.text import render_report

    step_summary = sched.step_timeline.mean_summary()
    summary["step_timeline"] = step_summary
    summary["predicted_step"] = sched.predicted_step
    usage = sched.host_usage()
    summary["host_memory"] = usage.to_dict()
    report: dict[str, Any] = {"plan": sched.plan, "transfers": sched.transfers.as_dict(),
                              "step_summary": step_summary, "plan_history": sched.plan_history,
                              "host_usage": usage}
    if not args.json:
        render_report(sched.timeline, console=console, problem=sched.problem,
                      predicted_step=sched.predicted_step, **report)
        losses = summary["losses"]
        console.print(f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}; held-out loss {val_before:.3f} -> "
                      f"{summary['val_loss_after']:.3f} (nats per byte)")
    paths = write_all(sched.timeline, out, stem="trace", step_timelines=[sched.step_timeline],
                      plan=sched.plan, problem=sched.problem,  # the PNG names --device as given, if it was
                      device=args.device if args.device == device else None)
    plan_path, summary_path = out / "plan.json", out / "demo.json"
    plan_dict = _plan_dict(sched)
    atomic_write_text(plan_path, json.dumps(plan_dict, indent=2) + "\n")
    atomic_write_text(summary_path, json.dumps(summary, indent=2) + "\n")
    written = [*paths.items(), ("plan", plan_path), ("summary", summary_path)]
    if args.json:
        # The report's figures (plan.json's plan and history among them), plan.json's placement problem,
        # demo.json's run, and where every export went.
        print_json({**report_dict(sched.timeline, **report), "command": "demo",
                    "problem": plan_dict.get("problem"), "run": summary,
                    "exports": {kind: str(path) for kind, path in written}})
        return 0
    console.print(f"exports written to [bold]{out}[/bold]:")
    for kind, path in written:
        console.print(f"  {kind:<10} {path}")
    return 0


def _device_label(device: str, gpu_cap: int | None = None) -> str:
    if device.startswith("sim:"):
        return f"stand-in sim:{format_bytes(int(device[4:]))}" if device[4:].isdigit() else device
    if gpu_cap is not None:
        name = torch.cuda.get_device_name()
        return (f"{device} ({name}) capped at {format_bytes(gpu_cap)}, sized as the stand-in would be "
                f"(from a fake trace on this GPU) so that the plan has work to do "
                f"(--device cuda: the whole GPU)")
    return device


def _train(args: argparse.Namespace, model: torch.nn.Module, corpus: TextCorpus, device: str,
           console: Console, *, params_on_host: bool = False) -> dict[str, Any]:
    # The prediction says the parameters do not all fit: the warmup traces with them on the host too.
    options = {"warmup_non_model_share": 1.0} if params_on_host and args.policy == "auto" else None
    sched = memsched.attach(model, policy=args.policy, gpu_margin_mem_ratio=args.gpu_margin_mem_ratio,
                            device=device, lr=args.lr, weight_decay=0.1, overlap=args.overlap,
                            policy_options=options)
    tdev = sched.device.torch_device
    tokens = args.batch_size * args.seq_len
    steps: list[dict[str, Any]] = []
    with sched, TrainingProgress(args.steps, console=console) as bar:
        data = batches(corpus.train, args.batch_size, args.seq_len, seed=args.seed, steps=args.steps)
        for x, y in data:
            t0 = time.perf_counter()
            loss = lm_loss(model, x.to(tdev, non_blocking=True), y.to(tdev, non_blocking=True))
            sched.backward(loss)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            value = float(loss.detach())  # synchronises with the device
            stats = StepStats(value, time.perf_counter() - t0, tokens, sched.transfers.last_h2d_bytes,
                              sched.transfers.last_d2h_bytes)
            bar.update(stats)
            steps.append({"loss": value, "seconds": stats.seconds, "tokens_per_s": stats.tokens_per_s,
                          "h2d_bytes": stats.h2d_bytes, "d2h_bytes": stats.d2h_bytes})
    return {
        "_sched": sched,
        "size": args.size, "parameters": sum(p.numel() for p in model.parameters()), "device": device,
        "capacity_bytes": sched.device.capacity_bytes, "policy": args.policy,
        "gpu_margin_mem_ratio": args.gpu_margin_mem_ratio, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed, "overlap": args.overlap,
        "losses": [s["loss"] for s in steps], "steps": steps, "transfers": sched.transfers.as_dict(),
    }


def _plan_dict(sched: memsched.Scheduler) -> dict[str, Any]:
    problem = getattr(sched, "problem", None)
    out: dict[str, Any] = {"plan": sched.plan.to_dict() if sched.plan is not None else None,
                           "history": [h.to_dict() for h in sched.plan_history]}
    if problem is not None:
        out["problem"] = {"capacity_bytes": problem.capacity_bytes,
                          "peak_non_model_bytes": problem.peak_non_model_bytes,
                          "resident_model_bytes": problem.resident_model_bytes,
                          "margin_bytes": problem.margin_bytes,
                          "gpu_margin_mem_ratio": problem.gpu_margin_mem_ratio,
                          "chunks": [{"index": c.index, "device_bytes": c.device_bytes,
                                      "host_bytes": c.host_bytes, "numel": c.numel} for c in problem.chunks]}
    return out
