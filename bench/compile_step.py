"""torch.compile: the steady-state step of compiled + memsched against compiled + fused AdamW (run by hand).

Run ``python bench/compile_step.py`` from the repository root (a few minutes: two compilations). One process,
the built-in GPT (``--size``), compiled with ``--backend`` (default ``inductor``) on ``--device`` (default:
``cuda`` when available, else ``cpu``). Two copies of the same model train side by side on the same batches:
one with ``memsched.attach`` (compiled after attach), one with ``torch.optim.AdamW(fused=True)``, under
``torch.use_deterministic_algorithms(True)``: inductor's CPU backward of an embedding (a scatter-add over
threads) is not deterministic otherwise, so two plain torch copies of the model would already differ. The
first ``--warmup`` steps are untimed: memsched's traced warmup step runs eagerly (``force_eager``) on both
sides, then both compile. Then ``--blocks`` interleaved blocks of ``--block`` steps (memsched block, AdamW
block, ...) are timed, each ending with a device synchronisation, so both see the same moments of the machine.

Recorded: the step time of each (block wall time / steps, median over blocks), their ratio (the target is
<= 1.02), Dynamo's graph breaks and graphs compiled after warmup (``torch._dynamo.utils.counters``; memsched's
hooks must add none), and whether the two models' parameters are bit-identical at the end. To tell where a
difference comes from (issue 28, item 11: on the H200 not bit-identical, 3 graph breaks), also: each graph
break's reason, each recompilation's failed guards (``torch._dynamo.utils.guard_failures``), the first step
whose loss differs, and a control: a third copy trained with torch alone beside the reference, whose
bit-identity to it says whether compiled torch is deterministic here at all.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
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
    ap.add_argument("--name", default="compile_step")
    args = ap.parse_args(argv)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # see the module docstring
    try:
        return run(args)
    finally:  # the process's setting back (a test calls main in its own process)
        torch.use_deterministic_algorithms(deterministic)


def run(args: argparse.Namespace) -> int:
    """One measurement (see the module docstring); writes the result. Returns 0."""
    dev = torch.device(args.device)
    torch._dynamo.reset()  # counters and guard failures of this run only
    counters.clear()
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", category=UserWarning)

    model = build_gpt(args.size, device=dev)
    ref = copy.deepcopy(model)
    control = copy.deepcopy(model)
    sched = memsched.attach(model, device=args.device, lr=1e-3, weight_decay=0.1, overlap=args.overlap)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    control_opt = torch.optim.AdamW(control.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    sides: dict[str, dict[str, Any]] = {
        "memsched": {"model": torch.compile(model, backend=args.backend), "opt": sched.optimizer,
                     "backward": sched.backward, "losses": []},
        "adamw": {"model": torch.compile(ref, backend=args.backend), "opt": opt,
                  "backward": lambda loss: loss.backward(), "losses": []},
        "control": {"model": torch.compile(control, backend=args.backend), "opt": control_opt,
                    "backward": lambda loss: loss.backward(), "losses": []},
    }
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    n = args.warmup + args.blocks * args.block
    shape = (args.batch, args.seq_len + 1)
    batches = [torch.randint(0, vocab, shape, generator=gen).to(dev) for _ in range(n)]

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def train(side: dict[str, Any], part: list[torch.Tensor], eager: bool = False) -> float:
        sync()
        t0 = time.perf_counter()
        for b in part:
            if eager:  # the traced warmup step: memsched holds force_eager; the reference does the same
                with torch.compiler.set_stance("force_eager"):
                    loss = lm_loss(side["model"], b[:, :-1], b[:, 1:])
            else:
                loss = lm_loss(side["model"], b[:, :-1], b[:, 1:])
            side["backward"](loss)
            side["losses"].append(loss.detach())
            side["opt"].step()
            side["opt"].zero_grad()
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

    def first_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> int | None:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if not torch.equal(x, y)), None)

    guard_failures = {f"{code.co_name} ({Path(code.co_filename).name}:{code.co_firstlineno})": [
        str(r) for r in reasons] for code, reasons in torch._dynamo.utils.guard_failures.items()}
    placement = sched.plan.placement if sched.plan is not None else None
    explain = torch._dynamo.explain(lambda t: model(t))(batches[0][:, :-1])
    sched.close()

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
    }
    path = write_result(args.name, result)
    ms = {k: result[k]["median_s"] * 1e3 for k in sides}
    print(f"memsched {ms['memsched']:.2f} ms, AdamW {ms['adamw']:.2f} ms per step: "
          f"{result['ratio_memsched_vs_adamw']:.3f}x; graph breaks {result['graph_breaks_total']};"
          f" bit-identical: {same}; {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
