"""torch.compile: the steady-state step of compiled + memsched against compiled + fused AdamW (run by hand).

Run ``python bench/compile_step.py`` from the repository root (a few minutes: two compilations). One process,
the built-in GPT (``--size``), compiled with ``--backend`` (default ``inductor``) on ``--device`` (default:
``cuda`` when available, else ``cpu``). Copies of the same model train side by side on the same batches:
one with ``memsched.attach`` (compiled after attach), one with ``torch.optim.AdamW(fused=True)`` (and a
control, below), under
``torch.use_deterministic_algorithms(True)``: inductor's CPU backward of an embedding (a scatter-add over
threads) is not deterministic otherwise, so two plain torch copies of the model would already differ. The
first ``--warmup`` steps are untimed: memsched's traced warmup step runs eagerly (``force_eager``) on both
sides, then both compile. Then ``--blocks`` interleaved blocks of ``--block`` steps (memsched block, AdamW
block, ...) are timed, each ending with a device synchronisation, so both see the same moments of the machine.

Recorded: the step time of each (block wall time / steps, median over blocks), their ratio (the target is
<= 1.02), Dynamo's graph breaks and graphs compiled after warmup (``torch._dynamo.utils.counters``; memsched's
hooks add one break, where the root waits for its chunks, and only where waits are needed: CUDA,
``--overlap``), and whether the two models' parameters are bit-identical at the end. To tell where a
difference comes from (issue 28, item 11: on the H200 not bit-identical, 3 graph breaks), also: each graph
break's reason, each recompilation's failed guards (``torch._dynamo.utils.guard_failures``), the first step
whose loss differs, and a control: a third copy trained with torch alone beside the reference, whose
bit-identity to it says whether compiled torch is deterministic here at all. Three models of one class in one
process share Dynamo's caches (a frame compiled for one is guarded on its hooks, and recompiled for another),
so their graphs may be cut differently from a process that trains one model; ``--own-process-steps`` steps of
memsched and of the reference then also run each in a process of its own (``--side``), as a user's training
runs, and their parameters and losses are compared there too.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

if __package__ in (None, ""):  # run as a script: make ``bench`` and the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._harness import summarize  # noqa: E402
from bench._machine import write_result  # noqa: E402
from memsched.models.gpt import build_gpt, lm_loss  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", help="built-in GPT size (default tiny)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--blocks", type=int, default=8, help="timed blocks per side")
    ap.add_argument("--block", type=int, default=10, help="steps per block")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps (memsched's traced one included)")
    ap.add_argument("--overlap", action="store_true",
                    help="memsched's overlap=True (on the CPU: the root's designed graph break, as on CUDA)")
    ap.add_argument("--own-process-steps", type=int, default=12,
                    help="steps of memsched and of the reference, each in a process of its own, compared bit "
                         "for bit (0: none)")
    ap.add_argument("--side", choices=["memsched", "adamw"],
                    help="(internal) train this side alone for --own-process-steps steps, save to --save")
    ap.add_argument("--save", type=Path, help="(internal) where --side writes its parameters and losses")
    ap.add_argument("--name", default="compile_step")
    args = ap.parse_args(argv)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # see the module docstring
    try:
        return train_alone(args) if args.side else run(args)
    finally:  # the process's setting back (a test calls main in its own process)
        torch.use_deterministic_algorithms(deterministic)


def memsched_side(model: torch.nn.Module, args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """``model`` with memsched attached, then compiled: its side (see :func:`adamw_side`) and scheduler."""
    sched = memsched.attach(model, device=args.device, lr=1e-3, weight_decay=0.1, overlap=args.overlap)
    return {"model": torch.compile(model, backend=args.backend), "opt": sched.optimizer,
            "backward": sched.backward, "losses": []}, sched


def adamw_side(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """``model`` compiled, trained by ``torch.optim.AdamW(fused=True)``: its compiled model, optimizer,
    backward and the losses it will record."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    return {"model": torch.compile(model, backend=args.backend), "opt": opt,
            "backward": lambda loss: loss.backward(), "losses": []}


def start(args: argparse.Namespace) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A fresh Dynamo, the seeded model on ``args.device`` and every batch of the run (the same in any
    process)."""
    dev = torch.device(args.device)
    torch._dynamo.reset()  # counters and guard failures of this run only
    counters.clear()
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", category=UserWarning)
    model = build_gpt(args.size, device=dev)
    gen = torch.Generator().manual_seed(1)
    n = max(args.warmup + args.blocks * args.block, args.own_process_steps)
    shape = (args.batch, args.seq_len + 1)
    batches = [torch.randint(0, model.config.vocab_size, shape, generator=gen).to(dev) for _ in range(n)]
    return model, batches


def step(side: dict[str, Any], batch: torch.Tensor, eager: bool) -> None:
    """One training step of ``side``; ``eager``: the traced warmup step (memsched holds ``force_eager``; the
    reference does the same)."""
    with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
        loss = lm_loss(side["model"], batch[:, :-1], batch[:, 1:])
    side["backward"](loss)
    side["losses"].append(loss.detach())
    side["opt"].step()
    side["opt"].zero_grad()


def train_alone(args: argparse.Namespace) -> int:
    """``--side``: that side alone in this process, ``--own-process-steps`` steps; saves its parameters and
    losses (on the CPU) to ``--save``."""
    model, batches = start(args)
    side, sched = memsched_side(model, args) if args.side == "memsched" else (adamw_side(model, args), None)
    for i, b in enumerate(batches[:args.own_process_steps]):
        step(side, b, eager=i == 0)
    if sched is not None:
        sched.close()
    torch.save({"params": [p.detach().cpu() for p in model.parameters()],
                "losses": [x.cpu() for x in side["losses"]]}, args.save)
    return 0


def in_own_processes(args: argparse.Namespace) -> dict[str, Any]:
    """Each side trained alone in a child process (:func:`train_alone`); compared bit for bit."""
    saved = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("memsched", "adamw"):
            path = Path(tmp) / f"{name}.pt"
            argv = [sys.executable, str(Path(__file__).resolve()), "--side", name, "--save", str(path)]
            for key in ("size", "batch", "seq_len", "device", "backend", "warmup", "own_process_steps"):
                argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
            if args.overlap:
                argv.append("--overlap")
            subprocess.run(argv, check=True)
            saved[name] = torch.load(path)
    ours, theirs = saved["memsched"], saved["adamw"]
    return {"steps": args.own_process_steps,
            "bit_identical": all(torch.equal(p, q) for p, q in zip(ours["params"], theirs["params"],
                                                                    strict=True)),
            "first_step_with_a_different_loss": first_difference(ours["losses"], theirs["losses"])}


def first_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> int | None:
    """The first index where ``a`` and ``b`` differ (``None``: nowhere)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if not torch.equal(x, y)), None)


def run(args: argparse.Namespace) -> int:
    """One measurement (see the module docstring); writes the result. Returns 0."""
    dev = torch.device(args.device)
    model, batches = start(args)
    ref = copy.deepcopy(model)
    control = copy.deepcopy(model)
    memsched_one, sched = memsched_side(model, args)
    sides: dict[str, dict[str, Any]] = {"memsched": memsched_one, "adamw": adamw_side(ref, args),
                                        "control": adamw_side(control, args)}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def train(side: dict[str, Any], part: list[torch.Tensor], eager: bool = False) -> float:
        sync()
        t0 = time.perf_counter()
        for b in part:
            step(side, b, eager)
        sched.synchronize()
        sync()
        return time.perf_counter() - t0

    for i in range(args.warmup):
        for side in sides.values():
            train(side, batches[i:i + 1], eager=i == 0)
    breaks_after_warmup = sum(counters["graph_break"].values())
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    times: dict[str, list[float]] = {k: [] for k in sides}
    for b in range(args.blocks):
        part = batches[args.warmup + b * args.block:args.warmup + (b + 1) * args.block]
        for name, side in sides.items():
            times[name].append(train(side, part) / len(part))
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    control_same = all(torch.equal(p, q) for p, q in zip(control.parameters(), ref.parameters(), strict=True))

    guard_failures = {f"{code.co_name} ({Path(code.co_filename).name}:{code.co_firstlineno})": [
        str(r) for r in reasons] for code, reasons in torch._dynamo.utils.guard_failures.items()}
    placement = sched.plan.placement if sched.plan is not None else None
    explain = torch._dynamo.explain(lambda t: model(t))(batches[0][:, :-1])
    sched.close()
    alone = in_own_processes(args) if args.own_process_steps > 0 else None

    result = {
        "what": "compiled + memsched vs compiled + torch.optim.AdamW(fused=True), the same model and "
                "batches, "
                "interleaved blocks; step = block wall time / steps (median over blocks)",
        "config": vars(args),
        "memsched": summarize(times["memsched"]),
        "adamw": summarize(times["adamw"]),
        "control": summarize(times["control"]),
        "ratio_memsched_vs_adamw": statistics.median(times["memsched"]) / statistics.median(times["adamw"]),
        "graph_breaks_total": sum(counters["graph_break"].values()),
        "graph_breaks_during_warmup": breaks_after_warmup,
        "unique_graphs_after_warmup": graphs_after_warmup,
        "unique_graphs_total": counters["stats"]["unique_graphs"],
        "explain_memsched_model": {"graph_count": explain.graph_count,
                                   "graph_break_count": explain.graph_break_count},
        "bit_identical": same,
        "first_step_with_a_different_loss": first_difference(sides["memsched"]["losses"],
                                                             sides["adamw"]["losses"]),
        "control_bit_identical": control_same,
        "control_first_step_with_a_different_loss": first_difference(sides["control"]["losses"],
                                                                     sides["adamw"]["losses"]),
        "graph_break_reasons": {k.split("\n")[0]: v for k, v in counters["graph_break"].items()},
        "recompile_guard_failures": guard_failures,
        "placement": placement,
        "in_own_processes": alone,
    }
    path = write_result(args.name, result)
    ms = {k: result[k]["median_s"] * 1e3 for k in sides}
    print(f"memsched {ms['memsched']:.2f} ms, AdamW {ms['adamw']:.2f} ms per step: "
          f"{result['ratio_memsched_vs_adamw']:.3f}x; graph breaks {result['graph_breaks_total']};"
          f" bit-identical: {same}; {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
