"""Predict one training step's memory without a GPU: a trace under ``FakeTensorMode`` (used by
``memsched plan`` and ``memsched demo``).

How: the model is built and run (forward + backward of one batch) under ``FakeTensorMode`` inside
:class:`tracer.MemoryTracer`. Fake tensors carry shapes, dtypes and devices but no storage, so a 1.3B GPT at
batch 8 x 1024 "runs" in seconds on a laptop CPU and allocates nothing. The trace gives the peak non-model
data; :func:`memsched.planning.problem.build_problem` turns it and the parameters into the placement problem
(chunk sizes, resident model data, optimizer-state bytes: 8 B/param of fp32 ``exp_avg`` + ``exp_avg_sq``, plus
a 4 B/param fp32 master under mixed precision), and every built-in placement policy plans it. The GPU margin
and the warmup-trace idea are PatrickStar's (arXiv 2108.05818, section 5); fake-tensor tracing is PyTorch's
``FakeTensorMode``.

Which fake device: when CUDA is available the trace runs on a fake ``cuda`` device, so torch picks its CUDA
kernels. Without a GPU it runs on a fake ``cpu`` device: PyTorch builds without CUDA cannot run autograd on
fake CUDA tensors (autograd asks the CUDA device guard for a stream, which such builds do not have, and the
process aborts), and CUDA builds without a device cannot choose an attention kernel. Memory is computed by
the same meta kernels on both devices; the one kernel choice that differs is attention, whose CPU and CUDA
kernels keep different tensors for backward (4.3 % of GPT-2 355M's peak non-model data in fp32). So
``attention="gpu"`` (``memsched plan``'s default) runs, on a fake CPU device, the attention kernel a CUDA GPU
would run (:mod:`memsched.planning.gpu_kernels`); on a fake CUDA device it is torch's own choice.
``"default"`` keeps the traced device's own choice (a fake trace compared with a real CPU run), and
``"math"`` forces the math kernel on either device (it materialises the ``[batch, heads, seq, seq]``
attention matrix).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memsched.devices import sim_backend
from memsched.models import build_gpt, config_for, lm_loss
from memsched.planning.first_use import first_use_order as order_by_first_use
from memsched.planning.problem import trainable_groups
from memsched.target import Workload, build_workload, load_target
from tracer.param_reads import ParamReads, Read
from tracer.timeline import MemoryTimeline

ATTENTION = ("gpu", "default", "math")


def fake_device() -> torch.device:
    """The device of the fake trace: ``cuda`` when CUDA is available, else ``cpu`` (see the module docs).

    Also ``cpu`` in a process that loaded the stand-in where torch then takes it as the accelerator in CUDA's
    place: a fake CUDA backward fails there inside torch's autograd engine, and the stand-in runs the CPU's
    kernels, so its activations are the CPU's (pass ``attention="gpu"`` for a GPU's attention kernel)."""
    if torch.cuda.is_available() and not sim_backend.took_the_accelerator():
        return torch.device("cuda")
    return torch.device("cpu")


@contextlib.contextmanager
def attention_kernel(attention: str, device: torch.device | None = None) -> Iterator[None]:
    """``"gpu"``: the kernel a CUDA GPU runs (on a CUDA ``device`` torch's own choice, elsewhere
    :func:`memsched.planning.gpu_kernels.gpu_attention`); ``"default"``: torch's own choice for ``device``;
    ``"math"``: force the math kernel (``torch.nn.attention.sdpa_kernel``, torch >= 2.3).

    Raises:
        ValueError: any other name.
    """
    if attention not in ATTENTION:
        raise ValueError(f"unknown attention kernel {attention!r}: expected one of {', '.join(ATTENTION)}")
    if attention == "default" or (attention == "gpu" and device is not None and device.type == "cuda"):
        yield
        return
    if attention == "gpu":
        from memsched.planning.gpu_kernels import gpu_attention

        with gpu_attention():
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
        attention: ``"gpu"``, ``"default"`` or ``"math"``.
        param_order: trainable parameters in first-use order (modules in first-call order).
        elapsed_s: wall time of build + trace, seconds.
        flops: floating-point operations of the step's forward and backward (matrix products, convolutions,
            attention: torch's ``torch.utils.flop_counter`` formulas, counted by the tracer), for the
            step-time model (:mod:`memsched.planning.step_model`).
        reads: the parameter reads of the step (:class:`tracer.param_reads.ParamReads`), from which a plan
            schedules the fetches of parameters kept on the host.
    """

    timeline: MemoryTimeline
    model: torch.nn.Module
    device: str
    fake: bool
    attention: str
    param_order: list[torch.nn.Parameter] = field(default_factory=list)
    elapsed_s: float = 0.0
    reads: list[Read] = field(default_factory=list)
    flops: int = 0

    @property
    def peak_non_model_bytes(self) -> int:
        """Peak non-model data (activations + temporaries) on the traced device, bytes."""
        return int(self.timeline.peak_non_model_bytes(self.device))

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the trainable parameters (the compute dtype)."""
        return trainable_groups(self.model)[0][0].dtype


def first_use_order(model: torch.nn.Module, timeline: MemoryTimeline) -> list[torch.nn.Parameter]:
    """The parameters in first-use order (:func:`memsched.planning.first_use.first_use_order` over the modules
    the trace saw run): the trainable ones, and the frozen ones after them (they are packed in chunks of their
    own); parameters of modules the trace never saw go where their first reader is."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    names = [st.name for st in timeline.module_stats()]
    return order_by_first_use(model, names, trainable) + (order_by_first_use(model, names, frozen)
                                                          if frozen else [])


@contextlib.contextmanager
def fake_module_conversions() -> Iterator[None]:
    """Let ``Module.to()`` / ``.half()`` / ``.cuda()`` work on ``FakeTensorMode`` parameters.

    ``Module._apply`` replaces fake parameters with ``torch.utils.swap_tensors``, which refuses tensors that
    have weak references, and ``FakeTensorMode`` keeps one on every fake tensor (torch 2.13), so
    ``model.to(device)`` fails for any fake model. Inside this context a refused swap of two fake tensors
    falls back to ``.data`` assignment, what ``_apply`` does for ordinary tensors (the parameter object, and
    so weight tying, is kept), and takes the new fake device along (``model.to("cuda")`` on fake CPU tensors).
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
            # A fake tensor's device is a Python attribute, which ``.data`` assignment does not carry over.
            t1.fake_device = t2.fake_device

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


LossFn = Callable[[torch.nn.Module], torch.Tensor]
WorkloadFn = Callable[[torch.device], "Workload | tuple[torch.nn.Module, LossFn]"]


def trace_step(build: str | WorkloadFn, *, dtype: torch.dtype | None = None, fake: bool = True,
               device: torch.device | str | None = None, attention: str = "default",
) -> Prediction:
    """Build the workload and trace one forward + backward inside :class:`tracer.MemoryTracer`.

    Args:
        build: a TARGET string or callable ``fn(device) -> (model, loss_fn)`` (see :mod:`memsched.target`).
        dtype: convert the model's floating-point parameters and buffers to this dtype first (``None``: keep).
        fake: run under ``FakeTensorMode`` (no memory is allocated); ``False`` runs for real (tests compare).
        device: the device to build on; default :func:`fake_device` when ``fake``, else the CPU.
        attention: ``"gpu"``, ``"default"`` or ``"math"`` (see :func:`attention_kernel`).

    Raises:
        ValueError / TypeError / FileNotFoundError: from the TARGET (see
            :func:`memsched.target.build_workload`), an unknown ``attention``, ``"gpu"`` for real tensors off
            CUDA (those CUDA kernels exist on a GPU only), or a loss that is not a scalar requiring grad.
    """
    from tracer import MemoryTracer

    if attention not in ATTENTION:
        raise ValueError(f"unknown attention kernel {attention!r}: expected one of {', '.join(ATTENTION)}")
    dev = torch.device(device) if device is not None else (fake_device() if fake else torch.device("cpu"))
    if attention == "gpu" and not fake and dev.type != "cuda":
        raise ValueError(f"attention 'gpu' runs CUDA's attention kernels: a real trace on {dev.type!r} "
                         "cannot (use fake=True, or attention 'default')")
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
            with attention_kernel(attention, dev), gradients_land_in_chunks(workload.model), \
                    MemoryTracer(workload.model, device=str(dev)) as tr, \
                    ParamReads(workload.model, lambda: tr.sample_count) as reads:
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
                      elapsed_s=time.perf_counter() - t0, reads=reads.reads,
                      flops=int(timeline.meta.get("flops", 0)))


@contextlib.contextmanager
def gradients_land_in_chunks(model: torch.nn.Module) -> Iterator[None]:
    """[Note: gradients land in chunks]
    Under memsched a parameter's gradient is added into its chunk's gradient buffer, which exists before it
    arrives (:mod:`memsched.chunks.store`): the gradient autograd computed stays non-model data (a temporary)
    until it was added, then dies. A plain backward instead keeps that tensor as ``p.grad``, and the tracer
    classifies it as a gradient from its allocation on. The two differ by that tensor at its accumulation:
    for GPT-2 124M's tied embedding, whose two gradients autograd sums into a third before accumulating it,
    one 147 MiB tensor at the end of backward, where a plan trusting the plain trace found room that the run
    did not. So, while tracing, each trainable parameter's gradient is dropped as soon as autograd stored it
    (a post-accumulate hook, entered before the tracer's and the read recorder's, which then see no
    gradient but still record when it was made): the trace's non-model data is what memsched's step holds
    besides its chunks, whose gradient buffers the plan counts itself (gradients in flight,
    :mod:`memsched.planning.reads`)."""
    def drop(p: torch.Tensor) -> None:
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(drop) for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _fake_errors() -> tuple[type[Exception], ...]:
    """What FakeTensorMode raises for an op it cannot run without data."""
    from torch._subclasses import fake_tensor as ft

    names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedFakeTensorException")
    found = tuple(getattr(ft, n) for n in names if isinstance(getattr(ft, n, None), type))
    return found or (RuntimeError,)


def gpt_workload(size: str, batch_size: int, seq_len: int, *, seed: int = 0,
                 lora_rank: int | None = None) -> WorkloadFn:
    """A workload function for the built-in GPT of ``size`` on random tokens ``[batch_size, seq_len]``;
    ``lora_rank``: its parameters frozen, with rank-``lora_rank`` LoRA adapters on its feed-forward layers
    (:func:`memsched.models.lora.add_lora`).

    Raises:
        ValueError: unknown size (lists the known ones), non-positive batch/sequence, a sequence longer
            than the model's ``block_size``, or a bad ``lora_rank``.
    """
    config = config_for(size)
    for name, value in (("batch size", batch_size), ("sequence length", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if seq_len > config.block_size:
        raise ValueError(f"sequence length {seq_len} exceeds the {size!r} model's block_size "
                         f"{config.block_size}")
    if lora_rank is not None and (isinstance(lora_rank, bool) or not isinstance(lora_rank, int)
                                  or lora_rank < 1):
        raise ValueError(f"LoRA rank must be a positive integer, got {lora_rank!r}")

    def build(device: torch.device) -> Workload:
        torch.manual_seed(seed)
        model = build_gpt(size, device=device)
        if lora_rank is not None:
            from memsched.models.lora import add_lora

            add_lora(model, lora_rank)

        def loss_fn(m: torch.nn.Module) -> torch.Tensor:
            tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device=device)
            return lm_loss(m, tokens[:, :-1], tokens[:, 1:])

        return Workload(model, loss_fn, f"gpt {size}" + (f" + LoRA r={lora_rank}" if lora_rank else ""))

    build.__qualname__ = f"gpt[{size}]"
    return build
