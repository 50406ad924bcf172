"""The warmup trace of a :class:`memsched.Scheduler`: the :class:`tracer.MemoryTracer` of the warmup steps
(and the eager compiler stance held while it runs), and what its timeline tells once it stops: the traced
modules, the first-use order of the parameters, the peak non-model data (PatrickStar's warmup-then-schedule,
arXiv 2108.05818 section 5; ColossalAI Gemini's warmup phase)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import policies
from memsched.devices.spec import DeviceSpec
from memsched.planning.first_use import first_use_order
from memsched.runtime.compile_stance import EagerDuringWarmup


class WarmupTrace:
    """Owns the warmup tracer from :meth:`start` to :meth:`stop`, then the timeline it recorded.

    Args:
        model: the model traced.
        optimizer: the optimizer whose steps delimit the traced steps.
        device: the compute device (the stand-in's is ``sim:0``, a device of its own: host tensors are not
            on it).

    Attributes:
        tracer: the live :class:`tracer.MemoryTracer` during warmup, else ``None``.
        timeline: the :class:`tracer.MemoryTimeline` once the trace stopped, else ``None``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: DeviceSpec,
                 host_memory: Callable[[torch.Tensor], bool] | None = None) -> None:
        self._model = model
        # parameters and gradients that read as the device but are views of host buffers ([Note: parameters
        # read where they compute] in memsched.devices.host_alias): no device memory
        self._host_memory = host_memory
        self._optimizer = optimizer
        self._device = device
        # torch.compile: eager while tracing (memsched.runtime.compile_stance)
        self._eager = EagerDuringWarmup()
        self.tracer: Any = None
        self.timeline: Any = None

    def start(self) -> None:
        """Hold the eager stance and enter the tracer.

        Raises:
            RuntimeError: another tracer is attached to the model (nothing stays installed).
        """
        from tracer import MemoryTracer

        self._eager.start()
        try:
            tracer = MemoryTracer(self._model, optimizer=self._optimizer, device=self._device.name,
                                  ignore=self._host_memory)
            tracer.__enter__()
        except BaseException:
            self._eager.stop()
            raise
        self.tracer = tracer

    def stop(self) -> None:
        """Leave the tracer (its hooks go away; later steps carry no tracing cost), keep its timeline, and
        give the compiler its stance back. Idempotent."""
        tracer, self.tracer = self.tracer, None
        try:
            if tracer is not None:
                tracer.__exit__(None, None, None)
                self.timeline = tracer.timeline
                if self._device.is_sim:  # say in reports that the traced device is the stand-in
                    self.timeline.meta["stand_in"] = (
                        f"sim:{policies.format_bytes(self._device.capacity_bytes)}")
        finally:
            self._eager.stop()  # compiled code compiles from the next call on

    def classify_parameter(self, t: torch.Tensor) -> None:
        """``t`` (a chunk's compute buffer fetched during warmup) is parameter memory, not an activation."""
        tracer = self.tracer
        if tracer is not None and tracer.accountant is not None:
            from tracer.categories import Category

            tracer.accountant.classify(t, Category.PARAMETER)

    def sample_count(self) -> int:
        """The tracer's samples so far (0 when it is not running)."""
        return self.tracer.sample_count if self.tracer is not None else 0

    def traced_modules(self) -> list[str]:
        """Qualified names of the modules whose forward ran in the trace, in first-call order; empty before
        the trace exists."""
        if self.timeline is None:
            return []
        return [st.name for st in self.timeline.module_stats()]

    def first_use_order(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """``params`` in first-use order from the trace (:mod:`memsched.planning.first_use`: each parameter at
        the first traced module that may read it, ties in the model's order); empty before the trace
        exists."""
        if self.timeline is None:
            return []
        return first_use_order(self._model, self.traced_modules(), params)

    def peak_non_model_bytes(self) -> int:
        """Peak non-model data of the trace on the compute device, bytes (0 before the trace exists)."""
        if self.timeline is None:
            return 0
        return int(self.timeline.peak_non_model_bytes(self.timeline.device))

    def peak_non_model_grad_bytes(self) -> int:
        """Peak of non-model data plus gradients of the trace on the compute device, bytes (0 before the trace
        exists): with the host chunks' gradients offloaded as backward completes them (every chunk is on the
        host during warmup), what the device holds besides persistent model data."""
        if self.timeline is None:
            return 0
        return int(self.timeline.peak_non_model_grad_bytes(self.timeline.device))
