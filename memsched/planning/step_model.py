"""A step-time model for `memsched plan`: the step's FLOPs at a calibrated share of the GPU's peak, plus the
CPU update of the plan's host chunks that its overlap leaves exposed.

* compute ``C = flops / (peak x efficiency)``: ``flops`` counted in the fake trace (matrix products,
  convolutions, attention; ``torch.utils.flop_counter``), ``peak`` the GPU's dense FLOP/s in the compute dtype
  (:class:`memsched.devices.gpus.GPU`), ``efficiency`` (:data:`EFFICIENCY`) calibrated on the committed GPU
  runs of plain torch training;
* CPU update ``U = host elements / rate`` (the training host's fused CPU AdamW throughput, elements/s);
* step ``C + exposed``, the exposed update of :func:`exposed_update` with the forward a third of the
  step's FLOPs and the backward the rest: ``U`` serial; ``max(0, U - C / 3)`` with ``overlap=True`` (the
  update runs during the next forward); with ``overlap="backward"`` the plan's speculating chunks update
  during backward and the rest during the next forward, ``max(0, U - C)`` when they all speculate.
* chunks streamed through the device (``attach(host_update=...)``) are not in ``U``: their update takes the
  link's time ``L`` at the step, beside the CPU's.

The other copies over the host link are not modelled: a host chunk's gradients go D2H during backward and its
parameters H2D behind the update, both overlapped on the GPU runs measured. ``tests/test_gpu_calibration.py``
holds the model to 25 % of every committed memsched step time. The roofline itself is the standard one
(Williams et al., CACM 2009); the split into compute and exposed CPU update follows ZeRO-Offload's analysis
(arXiv 2101.06840, section 4).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from memsched.devices.gpus import GPU

#: Share of the GPU's peak dense FLOP/s a training step reaches, per compute dtype. fp32: torch AdamW on GPT-2
#: 355M at batch 4 x 1024 (10.13 TFLOP a step) reached 0.671 of 67 TFLOP/s on an H200 and 0.656 to 0.661 on
#: an H100 (``bench/results/step_model_check.json``, from the committed ``gpu_step_time_*.json``). No other
#: dtype is calibrated yet: none is predicted.
EFFICIENCY: dict[torch.dtype, float] = {torch.float32: 0.67}
#: The forward's share of a training step's FLOPs (backward computes about twice the forward's).
FORWARD_SHARE = 1 / 3


#: The overlap modes (``attach(overlap=...)``) in words.
MODE_NAMES: dict[bool | str, str] = {False: "serial", True: "overlapped",
                                     "backward": "overlapped from backward"}


def speculative_elements_of(host_elements: int, overlap: bool | str, speculative_elements: int | None) -> int:
    """The elements whose update starts during backward: none unless ``overlap="backward"``, where ``None``
    means all ``host_elements``.

    Raises:
        ValueError: ``speculative_elements`` outside ``[0, host_elements]``.
    """
    if overlap != "backward":
        return 0
    spec = host_elements if speculative_elements is None else speculative_elements
    if not 0 <= spec <= host_elements:
        raise ValueError(f"speculative_elements must be in [0, host_elements={host_elements}], got "
                         f"{speculative_elements!r}")
    return spec


def exposed_update(cpu_s: float, forward_s: float, backward_s: float, overlap: bool | str, *,
                   speculative_s: float = 0.0, link_s: float = 0.0) -> float:
    """The seconds of the host chunks' update a step leaves exposed (not hidden behind compute).

    Args:
        cpu_s: the CPU update of the host chunks, seconds (``speculative_s`` of it for the chunks whose update
            starts during backward).
        forward_s, backward_s: the step's forward and backward, seconds.
        overlap: ``False`` (serial: the update runs after backward), ``True`` (on a worker during the next
            forward) or ``"backward"`` (the speculating chunks' updates run during backward, the rest and
            what backward did not hide during the next forward; :mod:`memsched.optim.early_update`).
        speculative_s: the CPU update of the speculating chunks, seconds (``overlap="backward"`` only).
        link_s: the streamed chunks' update at the step (their state over the link,
            :mod:`memsched.optim.streamed_update`), seconds: the step waits for it, and the CPU works beside
            it.

    Raises:
        ValueError: an unknown overlap mode, negative seconds, or ``speculative_s`` above ``cpu_s``.
    """
    if overlap not in (False, True, "backward"):
        raise ValueError(f"overlap must be False, True or 'backward', got {overlap!r}")
    if min(cpu_s, forward_s, backward_s, speculative_s, link_s) < 0 or speculative_s > cpu_s:
        raise ValueError(f"seconds must be >= 0 with speculative_s <= cpu_s, got cpu_s={cpu_s!r}, "
                         f"forward_s={forward_s!r}, backward_s={backward_s!r}, "
                         f"speculative_s={speculative_s!r}, link_s={link_s!r}")
    if not overlap:
        return max(cpu_s, link_s)  # the CPU and the stream work at once, and the step waits for both
    # what is left after backward runs on the worker during the stream's wait and the next forward
    after_backward = cpu_s - min(speculative_s, backward_s) if overlap == "backward" else cpu_s
    return link_s + max(0.0, after_backward - link_s - forward_s)


@dataclass(frozen=True)
class StepPrediction:
    """A predicted step, seconds: ``step_s = compute_s + exposed_cpu_s``; with the inputs (``flops``, the
    GPU's ``peak_flops`` (FLOP/s) and the ``efficiency`` applied, the ``host_elements`` updated on the CPU
    at ``cpu_elements_per_s``, ``speculative_elements`` of them during backward, the ``overlap`` mode, and
    ``link_s``, the streamed chunks' update over the link). ``exposed_cpu_s`` is all of the host chunks'
    update the step waits for, the stream's included."""

    step_s: float
    compute_s: float
    cpu_update_s: float
    exposed_cpu_s: float
    overlap: bool | str
    flops: int
    peak_flops: float
    efficiency: float
    host_elements: int
    cpu_elements_per_s: float
    speculative_elements: int = 0
    link_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict_step(flops: int, gpu: GPU, dtype: torch.dtype, host_elements: int, cpu_elements_per_s: float,
                 overlap: bool | str = False, *, speculative_elements: int | None = None,
                 link_s: float = 0.0) -> StepPrediction | None:
    """The step time of a plan that updates ``host_elements`` on the CPU (``speculative_elements`` of them
    from backward with ``overlap="backward"``; ``None``: all of them) and streams others through the device
    in ``link_s`` seconds (:func:`exposed_update`); ``None`` where the dtype is not calibrated
    (:data:`EFFICIENCY`) or the GPU's peak for it is unknown.

    Raises:
        ValueError: a CPU rate that is not > 0, an unknown overlap mode, or speculative elements that are
            not among the host elements.
    """
    if not cpu_elements_per_s > 0:
        raise ValueError(f"the CPU AdamW rate must be > 0 elements/s, got {cpu_elements_per_s!r}")
    if overlap not in (False, True, "backward"):
        raise ValueError(f"overlap must be False, True or 'backward', got {overlap!r}")
    speculative_elements = speculative_elements_of(host_elements, overlap, speculative_elements)
    efficiency = EFFICIENCY.get(dtype)
    peak = gpu.fp32_flops if dtype == torch.float32 else gpu.half_flops
    if efficiency is None or not peak:
        return None
    compute = flops / (peak * efficiency)
    cpu = host_elements / cpu_elements_per_s
    speculative = speculative_elements / cpu_elements_per_s
    exposed = exposed_update(cpu, FORWARD_SHARE * compute, (1 - FORWARD_SHARE) * compute, overlap,
                             speculative_s=speculative, link_s=link_s)
    return StepPrediction(compute + exposed, compute, cpu, exposed, overlap, int(flops), peak, efficiency,
                          int(host_elements), float(cpu_elements_per_s), int(speculative_elements),
                          float(link_s))


def measure_cpu_adam_rate(numel: int = 1 << 21, steps: int = 3) -> float:
    """This machine's fused CPU AdamW throughput, elements/s (the best of ``steps`` steps over ``numel`` fp32
    elements, after one untimed): the default of ``memsched plan --cpu-adam-rate``, right when the plan runs
    on the training host."""
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.full((numel,), 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    return numel / best
