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

Recorded: the step time of each (block wall time / steps, median over blocks), their ratio (the target is <=
1.02), Dynamo's graph breaks and graphs compiled after warmup (``torch._dynamo.utils.counters``; memsched's
hooks add one break, where the root waits for its chunks, and only where waits are needed: host chunks on
CUDA, ``--overlap``; with every chunk on the device none of memsched's hooks is in the graph), and whether the
two models' parameters are bit-identical at the end. To tell where a difference comes from (issue 28, item 11:
on the H200 not bit-identical, 3 graph breaks), also: each graph break's reason, each recompilation's failed
guards (``torch._dynamo.utils.guard_failures``), the first step whose loss differs, and a control: a third
copy trained with torch alone beside the reference, whose bit-identity to it says whether compiled torch is
deterministic here at all. Three models of one class in one process share Dynamo's caches (a frame compiled
for one is guarded on its hooks, and recompiled for another), so their graphs may be cut differently from a
process that trains one model; ``--own-process-steps`` steps of memsched and of the reference then also run
each in a process of its own (``--side``), as a user's training runs, and their parameters and losses are
compared there too, each process with an empty inductor and Triton cache of its own, with the reference
trained twice as their control. Through warmup the run also compares the gradients after each backward and the
parameters after each update, so a difference is placed in the compiled forward and backward or in the update;
whether inductor generated the same code (forward and backward wrappers and their kernels) for memsched's
graphs as for the reference's; and the process-wide numerics settings (matmul precision, TF32, attention
kernels) memsched would have changed. ``--inductor-deterministic`` runs all of it under inductor's
deterministic mode (no kernel or padding chosen by timing on the device).

``--model unfamiliar`` trains the transformer of ``tests/_compile_models.py`` instead (tied embeddings, a
checkpointed block, a block applied twice, a frozen block, ``nn.MultiheadAttention``; issue 41, item 5), with
``--size tiny`` or ``small`` (:data:`UNFAMILIAR`). Two flags show what the comparison needs to be meaningful
(docs/compile.md): ``--torch-nondeterministic`` leaves deterministic algorithms off (the control then tells
whether compiled torch is reproducible alone), and ``--reference-compiles-step-0`` compiles the reference (and
the control) from its first step, where memsched's warmup step runs eagerly.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import _disable_current_modes

if __package__ in (None, ""):  # run as a script: make ``bench`` and the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._harness import summarize  # noqa: E402
from bench._machine import write_result  # noqa: E402
from memsched.models.gpt import build_gpt, lm_loss  # noqa: E402
from tests import _compile_models  # noqa: E402

# --model unfamiliar: --size -> (model sizes, batch, sequence length)
UNFAMILIAR = {"tiny": ({"vocab": 96, "d": 32, "heads": 2, "seq_len": 16}, 4, 16),
              "small": ({"vocab": 512, "d": 128, "heads": 4, "seq_len": 64}, 8, 64)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["gpt", "unfamiliar"], default="gpt",
                    help="the built-in GPT, or tests/_compile_models.py's transformer (--size tiny or small; "
                         "its batch and sequence length, not --batch and --seq-len)")
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
    ap.add_argument("--inductor-deterministic", action="store_true",
                    help="inductor's deterministic mode (torch._inductor.config.deterministic: no choice "
                         "made by timing on the device), on both sides and in the processes of their own")
    ap.add_argument("--torch-nondeterministic", action="store_true",
                    help="leave torch.use_deterministic_algorithms off (inductor's CPU scatter-adds then use "
                         "atomic adds from several threads)")
    ap.add_argument("--reference-compiles-step-0", action="store_true",
                    help="the reference and the control compile from their first step (memsched's warmup "
                         "step runs eagerly, traced)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: torch's default); on a shared 2-core VM 2 OpenMP threads "
                         "spin against other processes' work and a step takes 10x longer")
    ap.add_argument("--name", default="compile_step")
    args = ap.parse_args(argv)
    if args.inductor_deterministic:
        if not hasattr(torch._inductor.config, "deterministic"):
            ap.error(f"--inductor-deterministic: torch {torch.__version__} has no "
                     "torch._inductor.config.deterministic")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(not args.torch_nondeterministic)  # see the module docstring
    mode = (torch._inductor.config.patch(deterministic=True) if args.inductor_deterministic
            else contextlib.nullcontext())
    try:
        with mode:
            return train_alone(args) if args.side else run(args)
    finally:  # the process's settings back (a test calls main in its own process)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


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
            "backward": lambda loss: loss.backward(), "losses": [],
            "eager_warmup": not args.reference_compiles_step_0}


def start(args: argparse.Namespace) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A fresh Dynamo, the seeded model on ``args.device`` and every batch of the run (the same in any
    process)."""
    dev = torch.device(args.device)
    torch._dynamo.reset()  # counters and guard failures of this run only
    counters.clear()
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", category=UserWarning)
    n = max(args.warmup + args.blocks * args.block, args.own_process_steps)
    if args.model == "unfamiliar":
        sizes, args.batch, args.seq_len = UNFAMILIAR[args.size]
        model = _compile_models.unfamiliar_transformer(**sizes).to(dev)
        return model, _compile_models.batches(model, n, args.batch, args.seq_len, dev)
    model = build_gpt(args.size, device=dev)
    gen = torch.Generator().manual_seed(1)
    shape = (args.batch, args.seq_len + 1)
    batches = [torch.randint(0, model.config.vocab_size, shape, generator=gen).to(dev) for _ in range(n)]
    return model, batches


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The training loss of ``model`` (maybe its compiled wrapper, whose ``_orig_mod`` is the model) on
    ``batch``: inputs and next tokens."""
    vocab = getattr(getattr(model, "_orig_mod", model), "vocab", None)
    if vocab is not None:  # --model unfamiliar
        return _compile_models.loss(model, batch, vocab)
    return lm_loss(model, batch[:, :-1], batch[:, 1:])


def forward_backward(side: dict[str, Any], batch: torch.Tensor, eager: bool) -> None:
    """The forward and backward of one training step of ``side``; ``eager``: the traced warmup step (memsched
    holds ``force_eager``; the reference does the same unless ``--reference-compiles-step-0``)."""
    if side.get("eager_warmup", True):
        stance = torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
    else:  # compiled from its first step: memsched's hold of force_eager is the process's (compile_stance)
        stance = torch.compiler.set_stance("default")
    with outside_the_tracer(side):
        with stance:
            loss = loss_of(side["model"], batch)
        side["backward"](loss)
    side["losses"].append(loss.detach())


def outside_the_tracer(side: dict[str, Any]) -> Any:
    """For a reference side: a context outside memsched's warmup tracer, a dispatch mode of this thread. The
    tracer would count the reference's tensors in memsched's trace, Dynamo does not compile a frame under a
    dispatch mode, and a compiled backward's ``run_with_rng_state`` (checkpointing) fails under it."""
    return _disable_current_modes() if "eager_warmup" in side else contextlib.nullcontext()


def update(side: dict[str, Any]) -> None:
    with outside_the_tracer(side):
        side["opt"].step()
        side["opt"].zero_grad()


def step(side: dict[str, Any], batch: torch.Tensor, eager: bool) -> None:
    """One training step of ``side`` (see :func:`forward_backward`)."""
    forward_backward(side, batch, eager)
    update(side)


def differences(ours: torch.nn.Module, theirs: torch.nn.Module, grads: bool) -> dict[str, float]:
    """``{name: max |difference|}`` of the parameters (``grads``: their gradients) of two copies of a model
    that differ (a missing gradient on one side only: ``inf``)."""
    out = {}
    with torch.no_grad():
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            a, b = (p.grad, q.grad) if grads else (p, q)
            if a is None or b is None:
                if (a is None) != (b is None):
                    out[name] = float("inf")
                continue
            a = a.to(b.device)
            if not torch.equal(a, b):
                out[name] = float((a.double() - b.double()).abs().max())
    return out


class GeneratedCode:
    """The source of every module inductor generated and loaded (forward and backward wrappers with their
    kernels), by the side whose step compiled it: whether memsched's compiled graphs are the reference's,
    kernel for kernel (fusion decides rounding on a GPU, where Triton contracts multiply-adds)."""

    def __init__(self) -> None:
        self.sources: dict[str, list[str]] = {}
        self._side: str | None = None
        try:
            from torch._inductor.codecache import PyCodeCache as cache
        except ImportError:
            cache = None
        self._load = getattr(cache, "load_by_key_path", None)
        if self._load is not None:  # an internal API: where it is missing nothing is recorded
            def load(key: str, path: str, *a: Any, **k: Any) -> Any:
                if self._side is not None:
                    self.sources.setdefault(self._side, []).append(Path(path).read_text())
                return self._load(key, path, *a, **k)
            cache.load_by_key_path = load
            self._cache = cache

    @contextlib.contextmanager
    def of(self, side: str) -> Any:
        self._side = side
        try:
            yield
        finally:
            self._side = None

    def close(self) -> None:
        """Stop recording (inductor's own loader back)."""
        if self._load is not None:
            self._cache.load_by_key_path = self._load

    def summary(self) -> dict[str, Any] | None:
        if self._load is None:
            return None
        ours, theirs = self.sources.get("memsched", []), self.sources.get("adamw", [])
        return {"modules": {k: len(v) for k, v in self.sources.items()},
                "memsched_equals_reference": sorted(ours) == sorted(theirs) if theirs else None}


def global_flags() -> dict[str, Any]:
    """Process-wide numerics settings a library could change: matmul precision, TF32, SDPA kernels."""
    flags: dict[str, Any] = {"float32_matmul_precision": torch.get_float32_matmul_precision(),
                             "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                             "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    cuda = torch.backends.cuda
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"):
        if hasattr(cuda, name):
            flags[name] = getattr(cuda, name)()
    flags["matmul_allow_tf32"] = cuda.matmul.allow_tf32
    flags["matmul_allow_fp16_reduced"] = cuda.matmul.allow_fp16_reduced_precision_reduction
    return flags


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
    """Each side trained alone in a child process (:func:`train_alone`), each with an empty inductor and
    Triton cache of its own (nothing compiled or tuned by another run is reused); compared bit for bit. The
    reference is trained twice: the control says whether compiled torch alone gives the same bits in two
    processes here at all."""
    saved = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run_name, side in (("memsched", "memsched"), ("adamw", "adamw"), ("adamw_again", "adamw")):
            path = Path(tmp) / f"{run_name}.pt"
            argv = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--save", str(path)]
            for key in ("model", "size", "batch", "seq_len", "device", "backend", "warmup",
                        "own_process_steps", "threads"):
                argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
            argv += [flag for flag, on in (("--overlap", args.overlap),
                                           ("--inductor-deterministic", args.inductor_deterministic),
                                           ("--torch-nondeterministic", args.torch_nondeterministic),
                                           ("--reference-compiles-step-0", args.reference_compiles_step_0))
                     if on]
            cache = Path(tmp) / f"cache_{run_name}"
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                   "TRITON_CACHE_DIR": str(cache / "triton")}
            subprocess.run(argv, check=True, env=env)
            saved[run_name] = torch.load(path)

    def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        same = all(torch.equal(p, q) for p, q in zip(a["params"], b["params"], strict=True))
        return {"bit_identical": same,
                "first_step_with_a_different_loss": first_difference(a["losses"], b["losses"]),
                "loss_max_abs_diff": max(float((x.double() - y.double()).abs()) for x, y in
                                         zip(a["losses"], b["losses"], strict=True))}

    return {"steps": args.own_process_steps, "fresh_caches": True,
            **compare(saved["memsched"], saved["adamw"]),
            "control": compare(saved["adamw_again"], saved["adamw"])}


def relative_difference(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    """||ours - theirs|| / ||theirs|| over every parameter at once (2-norms, in float64; 0.0: equal)."""
    with torch.no_grad():
        num = sum(float((p.detach().cpu().double() - q.detach().cpu().double()).pow(2).sum())
                  for p, q in zip(ours.parameters(), theirs.parameters(), strict=True))
        den = sum(float(q.detach().cpu().double().pow(2).sum()) for q in theirs.parameters())
    return (num / den) ** 0.5


def first_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> int | None:
    """The first index where ``a`` and ``b`` differ (``None``: nowhere)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if not torch.equal(x, y)), None)


def warm_up(args: argparse.Namespace, sides: dict[str, dict[str, Any]], batches: list[torch.Tensor],
            sched: Any, model: torch.nn.Module, ref: torch.nn.Module, code: GeneratedCode,
            sync: Callable[[], None]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The untimed warmup steps, step by step: where the gradients first differ from the reference's (the
    compiled forward and backward), and where the parameters do (the update). Returns both (``None``:
    equal)."""
    first_grads, first_params = None, None
    for i in range(args.warmup):
        for name, side in sides.items():
            with code.of(name):  # the compilations happen in the first compiled forward and backward
                forward_backward(side, batches[i], eager=i == 0)
        sched.synchronize()
        grads = differences(model, ref, grads=True)
        if grads and first_grads is None:
            first_grads = {"step": i, "parameters": len(grads), "max_abs_diff": max(grads.values()),
                           "first": dict(list(grads.items())[:5])}
        for side in sides.values():
            update(side)
        sched.synchronize()
        sync()
        params = differences(model, ref, grads=False)
        if params and first_params is None:
            first_params = {"step": i, "parameters": len(params), "max_abs_diff": max(params.values()),
                            "first": dict(list(params.items())[:5])}
    return first_grads, first_params


def run(args: argparse.Namespace) -> int:
    """One measurement (see the module docstring); writes the result. Returns 0."""
    dev = torch.device(args.device)
    model, batches = start(args)
    ref = copy.deepcopy(model)
    control = copy.deepcopy(model)
    flags_before = global_flags()
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

    code = GeneratedCode()
    try:
        first_grads, first_params = warm_up(args, sides, batches, sched, model, ref, code, sync)
    finally:
        code.close()
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
        "relative_difference": relative_difference(model, ref),
        "control_relative_difference": relative_difference(control, ref),
        "first_step_with_a_different_loss": first_difference(sides["memsched"]["losses"],
                                                             sides["adamw"]["losses"]),
        "generated_code": code.summary(),
        "warmup_first_different_gradients": first_grads,
        "warmup_first_different_parameters": first_params,
        "loss_max_abs_diff": max(float((x.double() - y.double()).abs()) for x, y in
                                 zip(sides["memsched"]["losses"], sides["adamw"]["losses"], strict=True)),
        "global_flags_changed_by_memsched": {k: [v, global_flags()[k]] for k, v in flags_before.items()
                                             if global_flags()[k] != v},
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
