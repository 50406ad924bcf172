"""`memsched plan`: predict one training step's memory without a GPU, then plan placement for a device size.

How: the model is built and run (forward + backward of one batch) under ``FakeTensorMode`` inside
:class:`tracer.MemoryTracer`. Fake tensors carry shapes, dtypes and devices but no storage, so a 1.3B GPT at
batch 8 x 1024 "runs" in seconds on a laptop CPU and allocates nothing. The trace gives the peak non-model
data; :func:`memsched.planning.build_problem` turns it and the parameters into the placement problem (chunk
sizes, resident model data, optimizer-state bytes: 8 B/param of fp32 ``exp_avg`` + ``exp_avg_sq``, plus a 4
B/param fp32 master under mixed precision), and every built-in placement policy plans it. The GPU margin and
the warmup-trace idea are PatrickStar's (arXiv 2108.05818, section 5); fake-tensor tracing is PyTorch's
``FakeTensorMode``.

Which fake device: when CUDA is available the trace runs on a fake ``cuda`` device, so torch picks its CUDA
kernels (flash attention for bf16/fp16, memory-efficient attention for fp32). Without a GPU it runs on a fake
``cpu`` device: PyTorch builds without CUDA cannot run autograd on fake CUDA tensors (autograd asks the CUDA
device guard for a stream, which such builds do not have, and the process aborts), and CUDA builds without a
device cannot choose an attention kernel. Memory is computed by the same meta kernels on both devices; the one
kernel choice that differs is attention, and the CPU's flash kernel keeps the same tensors for backward as the
CUDA flash kernel (the output and a ``[batch, heads, seq]`` fp32 log-sum-exp), so the prediction carries over.
``--attention math`` forces the math kernel on either device (it materialises the ``[batch, heads, seq, seq]``
attention matrix), which is also how a fake-CUDA trace is compared like-for-like with a real CPU run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import policies
from memsched.chunks import chunk_bytes
from memsched.commands.argtypes import positive_int, ratio
from memsched.first_use import first_use_order as order_by_first_use
from memsched.gpus import get_gpu, gpu_names
from memsched.models import build_gpt, config_for, count_parameters, lm_loss, sizes
from memsched.planning import build_problem, resident_extra_bytes, trainable_groups
from memsched.target import Workload, build_workload, load_target
from policies.types import PlacementPlan, PlacementProblem
from policies.units import format_bytes, parse_bytes
from tracer.timeline import MemoryTimeline

SCHEMA = "memsched.plan"
VERSION = 1
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ATTENTION = ("default", "math")
VERDICTS = ("fits", "offload", "does_not_fit")
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEQ_LEN = 1024


# ---- the fake trace --------------------------------------------------------------------------------------
def fake_device() -> torch.device:
    """The device of the fake trace: ``cuda`` when CUDA is available, else ``cpu`` (see the module docs)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def attention_kernel(attention: str) -> Iterator[None]:
    """``"default"``: torch's own choice of attention kernel; ``"math"``: force the math kernel
    (``torch.nn.attention.sdpa_kernel``, torch >= 2.3).

    Raises:
        ValueError: any other name.
    """
    if attention not in ATTENTION:
        raise ValueError(f"unknown attention kernel {attention!r}: expected one of {', '.join(ATTENTION)}")
    if attention == "default":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


@dataclass
class Prediction:
    """A fake (or, for comparisons, real) traced training step.

    Attributes:
        timeline: the trace (one forward + backward).
        model: the traced model (fake parameters after a fake trace: shapes and dtypes only).
        device: the traced device (``"cuda:0"`` / ``"cpu"``).
        fake: whether the trace ran under ``FakeTensorMode``.
        attention: ``"default"`` or ``"math"``.
        param_order: trainable parameters in first-use order (modules in first-call order).
        elapsed_s: wall time of build + trace, seconds.
    """

    timeline: MemoryTimeline
    model: torch.nn.Module
    device: str
    fake: bool
    attention: str
    param_order: list[torch.nn.Parameter] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def peak_non_model_bytes(self) -> int:
        """Peak non-model data (activations + temporaries) on the traced device, bytes."""
        return int(self.timeline.peak_non_model_bytes(self.device))

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the trainable parameters (the compute dtype)."""
        return trainable_groups(self.model)[0][0].dtype


def first_use_order(model: torch.nn.Module, timeline: MemoryTimeline) -> list[torch.nn.Parameter]:
    """Trainable parameters in first-use order (:func:`memsched.first_use.first_use_order` over the modules
    the trace saw run); parameters of modules the trace never saw go where their first reader is."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return order_by_first_use(model, [st.name for st in timeline.module_stats()], trainable)


@contextlib.contextmanager
def fake_module_conversions() -> Iterator[None]:
    """Let ``Module.to()`` / ``.half()`` / ``.cuda()`` work on ``FakeTensorMode`` parameters.

    ``Module._apply`` replaces fake parameters with ``torch.utils.swap_tensors``, which refuses tensors that
    have weak references, and ``FakeTensorMode`` keeps one on every fake tensor (torch 2.13), so
    ``model.to(device)`` fails for any fake model. Inside this context a refused swap of two fake tensors
    falls back to ``.data`` assignment, what ``_apply`` does for ordinary tensors (the parameter object, and
    so weight tying, is kept).
    """
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch.utils.swap_tensors

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            original(t1, t2)
        except RuntimeError:
            if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
                raise
            t1.data = t2.data

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


LossFn = Callable[[torch.nn.Module], torch.Tensor]
WorkloadFn = Callable[[torch.device], "Workload | tuple[torch.nn.Module, LossFn]"]


def trace_step(build: str | WorkloadFn, *, dtype: torch.dtype | None = None, fake: bool = True,
               device: torch.device | str | None = None, attention: str = "default") -> Prediction:
    """Build the workload and trace one forward + backward inside :class:`tracer.MemoryTracer`.

    Args:
        build: a TARGET string or callable ``fn(device) -> (model, loss_fn)`` (see :mod:`memsched.target`).
        dtype: convert the model's floating-point parameters and buffers to this dtype first (``None``: keep).
        fake: run under ``FakeTensorMode`` (no memory is allocated); ``False`` runs for real (tests compare).
        device: the device to build on; default :func:`fake_device` when ``fake``, else the CPU.
        attention: ``"default"`` or ``"math"`` (see :func:`attention_kernel`).

    Raises:
        ValueError / TypeError / FileNotFoundError: from the TARGET (see
            :func:`memsched.target.build_workload`), an unknown ``attention``, or a loss that is not a scalar
            requiring grad.
    """
    from tracer import MemoryTracer

    if attention not in ATTENTION:
        raise ValueError(f"unknown attention kernel {attention!r}: expected one of {', '.join(ATTENTION)}")
    dev = torch.device(device) if device is not None else (fake_device() if fake else torch.device("cpu"))
    t0 = time.perf_counter()
    mode: Any = contextlib.nullcontext()
    conversions: Any = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        # Real tensors made outside the mode (constants of the user's code) are converted, not refused.
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        conversions = fake_module_conversions()
    # Import a TARGET outside the fake mode, so module-level code of the user's file runs normally.
    fn = load_target(build) if isinstance(build, str) else build
    with mode:
        with conversions:
            workload = build_workload(fn, dev)
            if dtype is not None:
                workload.model.to(dtype=dtype)
        if isinstance(build, str):
            workload.name = build
        try:
            with attention_kernel(attention), MemoryTracer(workload.model, device=str(dev)) as tr:
                loss = workload.loss()
                loss.backward()
        except _fake_errors() as e:
            raise ValueError(f"{workload.name or 'the workload'} cannot run on fake tensors: {e!r}; "
                             "data-dependent operations (.item(), .tolist(), nonzero, printing values) need "
                             "real data: keep them out of the model and loss_fn") from None
        timeline = tr.timeline
    traced = timeline.device
    return Prediction(timeline=timeline, model=workload.model, device=traced, fake=fake, attention=attention,
                      param_order=first_use_order(workload.model, timeline),
                      elapsed_s=time.perf_counter() - t0)


def _fake_errors() -> tuple[type[Exception], ...]:
    """What FakeTensorMode raises for an op it cannot run without data."""
    from torch._subclasses import fake_tensor as ft

    names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedFakeTensorException")
    found = tuple(getattr(ft, n) for n in names if isinstance(getattr(ft, n, None), type))
    return found or (RuntimeError,)


def gpt_workload(size: str, batch_size: int, seq_len: int, *, seed: int = 0) -> WorkloadFn:
    """A workload function for the built-in GPT of ``size`` on random tokens ``[batch_size, seq_len]``.

    Raises:
        ValueError: unknown size (lists the known ones), non-positive batch/sequence, or a sequence longer
            than the model's ``block_size``.
    """
    config = config_for(size)
    for name, value in (("batch size", batch_size), ("sequence length", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if seq_len > config.block_size:
        raise ValueError(f"sequence length {seq_len} exceeds the {size!r} model's block_size "
                         f"{config.block_size}")

    def build(device: torch.device) -> Workload:
        torch.manual_seed(seed)
        model = build_gpt(size, device=device)

        def loss_fn(m: torch.nn.Module) -> torch.Tensor:
            tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device=device)
            return lm_loss(m, tokens[:, :-1], tokens[:, 1:])

        return Workload(model, loss_fn, f"gpt {size}")

    build.__qualname__ = f"gpt[{size}]"
    return build


# ---- planning --------------------------------------------------------------------------------------------
@dataclass
class CapacityPlan:
    """Plans of every policy for one device capacity.

    Attributes:
        problem: the placement problem (from :func:`memsched.planning.build_problem`).
        chunk_numel: chunk size, elements; ``n_chunks``: number of chunks.
        model_data: bytes by category: ``parameter`` and ``gradient`` (the chunks' compute and gradient
            buffers, padding included), ``optimizer_state`` (every chunk's device-side state), ``other``
            (frozen parameters and buffers); all bytes.
        plans: policy name -> :class:`PlacementPlan`, or the error message when the policy found no plan.
    """

    problem: PlacementProblem
    chunk_numel: int
    n_chunks: int
    model_data: dict[str, int]
    plans: dict[str, PlacementPlan | str]


def plan_for_capacity(prediction: Prediction, capacity_bytes: int, *, gpu_margin_mem_ratio: float = 0.8,
                      policy_names: list[str] | None = None) -> CapacityPlan:
    """Build the placement problem for ``capacity_bytes`` and plan it with each policy (default: all
    registered).

    Raises:
        ValueError: a ratio outside [0, 1] or a negative capacity (from :class:`PlacementProblem`), an unknown
            policy name (lists the known ones).
    """
    model = prediction.model
    dtype = prediction.dtype
    master = dtype != torch.float32
    problem, layout = build_problem(model, prediction.peak_non_model_bytes, capacity_bytes,
                                    gpu_margin_mem_ratio=gpu_margin_mem_ratio, master_weights=master,
                                    param_order=prediction.param_order or None, compute_dtype=dtype,
                                    pinned=True)  # planned for a CUDA device: host state is pinned
    cb = chunk_bytes(layout.chunk_numel, compute_dtype=dtype, master_weights=master)
    model_data = {
        "parameter": layout.n_chunks * cb.compute_bytes,
        "gradient": layout.n_chunks * cb.grad_bytes,
        "optimizer_state": sum(c.device_bytes for c in problem.chunks),
        "other": resident_extra_bytes(model, trainable_groups(model)),
    }
    plans: dict[str, PlacementPlan | str] = {}
    for name in policy_names if policy_names is not None else policies.names():
        policy = policies.get(name)  # unknown name: UnknownPolicyError (a ValueError) listing the known ones
        try:
            plans[name] = policy.plan(problem)
        except policies.PlacementError as e:
            plans[name] = str(e)
    return CapacityPlan(problem=problem, chunk_numel=layout.chunk_numel, n_chunks=layout.n_chunks,
                        model_data=model_data, plans=plans)


def verdict(cplan: CapacityPlan, policy: str = "auto") -> dict[str, Any]:
    """Does the step fit the device under ``policy``?

    Returns:
        ``{"status", "policy", "message", "device_bytes", "host_bytes", "offloaded_bytes", "short_bytes",
        "needed_all_on_device_bytes"}``: ``status`` is ``"fits"`` (the plan keeps every optimizer-state chunk
        on the device), ``"offload"`` (it fits only with ``offloaded_bytes`` of optimizer state, needing
        ``host_bytes`` of pinned CPU memory, on the host) or ``"does_not_fit"`` (resident model data + peak
        non-model data alone exceed the capacity by ``short_bytes``); all bytes.

    Raises:
        LookupError: ``policy`` was not planned.
    """
    if policy not in cplan.plans:
        raise LookupError(f"policy {policy!r} was not planned; planned: {', '.join(cplan.plans)}")
    p = cplan.problem
    total_opt = sum(c.device_bytes for c in p.chunks)
    needed = p.peak_non_model_bytes + p.resident_model_bytes + total_opt
    out: dict[str, Any] = {"policy": policy, "needed_all_on_device_bytes": needed, "device_bytes": 0,
                           "host_bytes": 0, "offloaded_bytes": 0, "short_bytes": 0}
    plan = cplan.plans[policy]
    if p.margin_bytes < 0:
        out.update(status="does_not_fit", short_bytes=-p.margin_bytes, message=(
            f"does not fit: resident model data + peak non-model data exceed "
            f"{format_bytes(p.capacity_bytes)} by {format_bytes(-p.margin_bytes)} even with all optimizer "
            "state on the CPU"))
        return out
    if isinstance(plan, str):
        # The base fits but this policy found no plan (e.g. 'cuda' when the optimizer state does not fit).
        short = max(0, needed - p.capacity_bytes)
        out.update(status="does_not_fit" if short else "fits", short_bytes=short,
                   message=f"policy {policy!r} found no plan: {plan}")
        return out
    offloaded = total_opt - plan.device_bytes
    out.update(device_bytes=plan.device_bytes, host_bytes=plan.host_bytes, offloaded_bytes=offloaded)
    if not plan.host_chunks:
        out.update(status="fits", message=(
            f"fits: everything on the device, {format_bytes(p.capacity_bytes - needed)} to spare "
            f"(needs {format_bytes(needed)} of {format_bytes(p.capacity_bytes)})"))
    else:
        out.update(status="offload", message=(
            f"fits only with offload: {format_bytes(offloaded)} of optimizer state "
            f"({len(plan.host_chunks)} of {len(plan.placement)} chunks) goes to the CPU, needing "
            f"{format_bytes(plan.host_bytes)} of pinned host memory"))
    return out


def result_dict(prediction: Prediction, cplan: CapacityPlan, *, what: dict[str, Any], policy: str = "auto",
                gpu: str | None = None) -> dict[str, Any]:
    """The machine-readable result (``memsched plan --json``).

    Keys: ``schema`` (``"memsched.plan"``), ``version`` (1); ``workload`` (``what`` plus ``parameters``:
    trainable parameter count, ``dtype``); ``trace``: ``device``, ``fake``, ``attention``,
    ``peak_non_model_bytes``, ``peak_module``, ``peak_phase``, ``elapsed_s``; ``model_data``: bytes by
    category (see :class:`CapacityPlan`) plus ``resident_bytes``; ``chunks``: ``numel`` and ``count``;
    ``capacity_bytes``, ``gpu`` (table name or ``None``), ``gpu_margin_mem_ratio``, ``margin_bytes``;
    ``plans``: policy name -> :meth:`PlacementPlan.to_dict` or ``{"error": message}``; ``verdict``: see
    :func:`verdict`. Sizes in bytes.
    """
    peak = prediction.timeline.peak_non_model_sample(prediction.device)
    p = cplan.problem
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "workload": {**what, "parameters": count_parameters(prediction.model, trainable_only=True),
                     "dtype": str(prediction.dtype).removeprefix("torch.")},
        "trace": {"device": prediction.device, "fake": prediction.fake, "attention": prediction.attention,
                  "peak_non_model_bytes": prediction.peak_non_model_bytes,
                  "peak_module": peak.module if peak else None, "peak_phase": peak.phase if peak else None,
                  "elapsed_s": round(prediction.elapsed_s, 3)},
        "model_data": {**cplan.model_data, "resident_bytes": p.resident_model_bytes},
        "chunks": {"numel": cplan.chunk_numel, "count": cplan.n_chunks},
        "capacity_bytes": p.capacity_bytes,
        "gpu": gpu,
        "gpu_margin_mem_ratio": p.gpu_margin_mem_ratio,
        "margin_bytes": p.margin_bytes,
        "plans": {name: (plan.to_dict() if isinstance(plan, PlacementPlan) else {"error": plan})
                  for name, plan in cplan.plans.items()},
        "verdict": verdict(cplan, policy),
    }


# ---- CLI -------------------------------------------------------------------------------------------------




def _size(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"capacity must be > 0 bytes, got {text!r}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="predict a training step's memory with fake tensors (no GPU needed) and plan placement",
        description=textwrap.fill(
            "Build the model and run forward + backward of one batch under FakeTensorMode (no memory is "
            "allocated), then show peak non-model data, model data by category, each placement policy's plan "
            "for the device size, and a verdict: fits / fits only with offload / does not fit.", 79),
        epilog="examples: memsched plan --model 1.3b --batch-size 8 --seq-len 1024 --capacity 24GiB\n"
               "          memsched plan examples/trace_target.py:build --gpu a100-40gb --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", nargs="?", metavar="TARGET",
                   help="file.py:function or module:function returning (model, loss_fn) for a device "
                        "(see memsched trace); or use --model")
    p.add_argument("--model", metavar="SIZE", help=f"the built-in GPT at this size: {', '.join(sizes())}")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help=f"batch size for --model (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help=f"sequence length for --model (default {DEFAULT_SEQ_LEN}, at most the model's "
                        "block size)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="compute dtype (bf16/fp16 add an fp32 master copy to the optimizer state); default: "
                        "fp32 for --model, the model's own dtype for a TARGET")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--capacity", type=_size, metavar="SIZE", help="device capacity, e.g. 24GiB")
    cap.add_argument("--gpu", metavar="NAME", help=f"a named GPU: {', '.join(gpu_names())}")
    p.add_argument("--gpu-margin-mem-ratio", type=ratio, default=0.8, metavar="R",
                   help="share of the GPU margin policies may fill, in [0, 1] (default 0.8)")
    p.add_argument("--policy", default="auto", help="policy the verdict uses (default auto)")
    p.add_argument("--attention", choices=ATTENTION, default="default",
                   help="attention kernel of the trace: torch's default for the device, or math (keeps the "
                        "[batch, heads, seq, seq] attention matrix)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (see result_dict)")
    p.set_defaults(func=run)


def _capacity(args: argparse.Namespace) -> tuple[int, str | None]:
    if args.capacity is not None:
        return args.capacity, None
    if args.gpu is not None:
        gpu = get_gpu(args.gpu)
        return gpu.memory_bytes, gpu.name
    if torch.cuda.is_available():
        from memsched.devices import cuda_capacity_bytes

        return cuda_capacity_bytes(torch.device("cuda")), torch.cuda.get_device_name()
    raise ValueError(f"no GPU here: give --capacity SIZE (e.g. 24GiB) or --gpu NAME "
                     f"({', '.join(gpu_names())})")


def run(args: argparse.Namespace) -> int:
    # ---- validate everything before the (possibly long) trace ----------------------------------------------
    if (args.target is None) == (args.model is None):
        raise ValueError("give either a TARGET (file.py:function or module:function) or --model SIZE "
                         f"(one of {', '.join(sizes())}), not both or neither")
    if args.policy not in policies.names():
        raise ValueError(f"unknown policy {args.policy!r}: known policies are {', '.join(policies.names())}")
    capacity, gpu = _capacity(args)
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.model is not None:
        batch = args.batch_size or DEFAULT_BATCH_SIZE
        seq = args.seq_len or DEFAULT_SEQ_LEN
        build: str | WorkloadFn = gpt_workload(args.model, batch, seq)
        what: dict[str, Any] = {"model": args.model, "batch_size": batch, "seq_len": seq}
    else:
        if args.batch_size is not None or args.seq_len is not None:
            raise ValueError("--batch-size and --seq-len apply to --model only; a TARGET's loss_fn makes "
                             "its own batch")
        build, what = args.target, {"target": args.target}

    console = Console(stderr=args.json)
    with console.status("tracing one training step with fake tensors ...") if not args.json else \
            contextlib.nullcontext():
        prediction = trace_step(build, dtype=dtype or (torch.float32 if args.model else None),
                                attention=args.attention)
    cplan = plan_for_capacity(prediction, capacity, gpu_margin_mem_ratio=args.gpu_margin_mem_ratio)
    result = result_dict(prediction, cplan, what=what, policy=args.policy, gpu=gpu)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render(result, console)
    return 0


# ---- rendering -------------------------------------------------------------------------------------------
def render(result: dict[str, Any], console: Console) -> None:
    """Print a :func:`result_dict` as rich tables."""
    w, tr, md = result["workload"], result["trace"], result["model_data"]
    fb = format_bytes
    head = Table(title="Workload and trace", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row("workload",
                 w.get("target") or f"GPT {w['model']}, batch {w['batch_size']} x seq {w['seq_len']}")
    head.add_row("parameters", f"{w['parameters']:,} ({w['dtype']})")
    stand_in = " standing in for CUDA" if tr["device"] == "cpu" else ""
    head.add_row("traced on", f"fake {tr['device']}{stand_in} (attention: {tr['attention']}), "
                              f"{tr['elapsed_s']:.1f} s")
    where = ""
    if tr["peak_module"] is not None:
        where = f" in {tr['peak_module'] or '(root)'} ({tr['peak_phase']})"
    head.add_row("peak non-model data", f"{fb(tr['peak_non_model_bytes'])}{where}")
    head.add_row("all on the device", f"{fb(result['verdict']['needed_all_on_device_bytes'])} (peak "
                 "non-model + resident model data + all optimizer states)")
    console.print(head)

    chunks = result["chunks"]
    data = Table(title=f"Model data ({chunks['count']} chunks of {chunks['numel']:,} elements)",
                 title_justify="left")
    data.add_column("category")
    data.add_column("bytes", justify="right")
    data.add_column("where")
    data.add_row("parameters", fb(md["parameter"]), "device (resident)")
    data.add_row("gradients", fb(md["gradient"]), "device (resident)")
    data.add_row("buffers + frozen parameters", fb(md["other"]), "device (resident)")
    data.add_row("optimizer states (AdamW)", fb(md["optimizer_state"]), "placed by the policy")
    console.print(data)

    cap = fb(result["capacity_bytes"]) + (f" ({result['gpu']})" if result["gpu"] else "")
    plans = Table(title=f"Plans for {cap}: GPU margin {fb(result['margin_bytes'])}, "
                        f"gpu_margin_mem_ratio {result['gpu_margin_mem_ratio']:g}", title_justify="left")
    for col in ("policy", "chunks on device", "device bytes", "chunks on host", "pinned host bytes"):
        plans.add_column(col, justify="left" if col == "policy" else "right")
    errors = []
    for name, plan in result["plans"].items():
        if "error" in plan:
            plans.add_row(name, "[red]no plan[/red]", "-", "-", "-")
            errors.append((name, plan["error"]))
            continue
        n_dev = plan["placement"].count(policies.DEVICE)
        plans.add_row(name, str(n_dev), fb(plan["device_bytes"]), str(len(plan["placement"]) - n_dev),
                      fb(plan["host_bytes"]))
    console.print(plans)
    if result["margin_bytes"] < 0:
        errors = errors[:1]  # every policy fails for the same reason: say it once
    for name, message in errors:
        console.print(f"[red]{name}[/red]: {message}")
    chosen = result["plans"].get(result["verdict"]["policy"], {})
    for reason in chosen.get("reasons", []):
        console.print(f"  [dim]{result['verdict']['policy']}:[/dim] {reason}")

    v = result["verdict"]
    style = {"fits": "bold green", "offload": "bold yellow", "does_not_fit": "bold red"}[v["status"]]
    console.print(f"[{style}]Verdict ({v['policy']}):[/{style}] {v['message']}")
