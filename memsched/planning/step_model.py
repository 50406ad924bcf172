"""A step-time model for `memsched plan`: the step's FLOPs at a calibrated share of the GPU's peak, plus the
CPU update of the plan's host chunks that its overlap leaves exposed.

* compute ``C = flops / (peak x efficiency)``: ``flops`` counted in the fake trace (matrix products,
  convolutions, attention; ``torch.utils.flop_counter``), ``peak`` the GPU's dense FLOP/s in the compute dtype
  (:class:`memsched.devices.gpus.GPU`), ``efficiency`` (:data:`EFFICIENCY`) calibrated on the committed GPU
  runs of plain torch training;
* CPU update ``U = host elements / rate`` (the training host's fused CPU AdamW throughput, elements/s);
* step ``C + U`` serial; ``C + max(0, U - C / 3)`` with ``overlap=True`` (the update runs during the next
  forward, a third of the step's FLOPs); ``C + max(0, U - C)`` with ``overlap="backward"``.

The copies over the host link are not modelled: a host chunk's gradients go D2H during backward and its
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


@dataclass(frozen=True)
class StepPrediction:
    """A predicted step, seconds: ``step_s = compute_s + exposed_cpu_s``; with the inputs (``flops``, the
    GPU's ``peak_flops`` (FLOP/s) and the ``efficiency`` applied, the ``host_elements`` updated on the CPU
    at ``cpu_elements_per_s``, and the ``overlap`` mode)."""

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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict_step(flops: int, gpu: GPU, dtype: torch.dtype, host_elements: int, cpu_elements_per_s: float,
                 overlap: bool | str = False) -> StepPrediction | None:
    """The step time of a plan that updates ``host_elements`` on the CPU; ``None`` where the dtype is not
    calibrated (:data:`EFFICIENCY`) or the GPU's peak for it is unknown.

    Raises:
        ValueError: a CPU rate that is not > 0, or an unknown overlap mode.
    """
    if not cpu_elements_per_s > 0:
        raise ValueError(f"the CPU AdamW rate must be > 0 elements/s, got {cpu_elements_per_s!r}")
    if overlap not in (False, True, "backward"):
        raise ValueError(f"overlap must be False, True or 'backward', got {overlap!r}")
    efficiency = EFFICIENCY.get(dtype)
    peak = gpu.fp32_flops if dtype == torch.float32 else gpu.half_flops
    if efficiency is None or not peak:
        return None
    compute = flops / (peak * efficiency)
    cpu = host_elements / cpu_elements_per_s
    hidden = compute if overlap == "backward" else FORWARD_SHARE * compute if overlap else 0.0
    exposed = max(0.0, cpu - hidden)
    return StepPrediction(compute + exposed, compute, cpu, exposed, overlap, int(flops), peak, efficiency,
                          int(host_elements), float(cpu_elements_per_s))


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
