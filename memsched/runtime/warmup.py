"""Warmup for :class:`memsched.Scheduler`: the tracer of the warmup steps, the end of warmup (the cost model's
measurements, the plan, the steady-state switches: overlap, early D2H, updates during backward) and what the
trace tells (the traced modules, the first-use order, the peak non-model data). A mixin: the scheduler's state
is its state (PatrickStar's warmup-then-schedule, arXiv 2108.05818 section 5)."""

from __future__ import annotations

import enum
from typing import Any

import torch

import policies
from memsched.planning.cost_model import WarmupCosts
from memsched.planning.first_use import first_use_order
from policies.types import HOST


class Phase(enum.Enum):
    """Where a :class:`Scheduler` is in its life (the module docstring tells the story)."""

    WARMUP = "warmup"  # traced steps; all optimizer state on the host
    PLANNED = "planned"  # the plan is applied; no tracing cost
    PLAN_FAILED = "plan failed"  # the policy found no plan; the state stays on the host, training goes on
    CLOSED = "closed"  # hooks, modes and accounting removed


class WarmupMixin:
    """The warmup half of :class:`memsched.Scheduler` (see the module docstring)."""

    # The scheduler's attributes this mixin reads and writes (set in Scheduler._build).
    model: torch.nn.Module
    device: Any
    optimizer: Any
    store: Any
    dp: Any
    streams: Any
    config: Any
    phase: Phase
    steps: int
    warmup_steps: int
    timeline: Any
    elastic: Any
    warmup_costs: WarmupCosts | None
    _installed: Any
    _eager: Any

    def _start_tracer(self) -> None:
        from tracer import MemoryTracer

        # The stand-in's tensors are CPU tensors: the tracer measures the CPU, which is the stand-in's memory.
        dev = "cpu" if self.device.is_sim else self.device.name
        tracer = MemoryTracer(self.model, optimizer=self.optimizer, device=dev)
        tracer.__enter__()
        self._installed.tracer = tracer

    @property
    def _tracer(self) -> Any:
        return self._installed.tracer

    def _stop_tracer(self) -> None:
        if self._installed.tracer is not None:
            tr, self._installed.tracer = self._installed.tracer, None
            tr.__exit__(None, None, None)
            self.timeline = tr.timeline
            if self.device.is_sim:  # say in reports that the traced CPU memory is the stand-in's
                self.timeline.meta["stand_in"] = f"sim:{policies.format_bytes(self.device.capacity_bytes)}"

    @property
    def in_warmup(self) -> bool:
        return self.phase is Phase.WARMUP

    def _global_post_hook(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if optimizer is self.optimizer:
            self._after_step()

    def _after_step(self) -> None:
        self.steps += 1
        self.optimizer.timeline.step_end(self.steps)
        if self.elastic is not None:
            self.elastic.after_step()
        if self.phase is not Phase.WARMUP or self.steps < self.warmup_steps:
            return
        self._stop_tracer()
        self._eager.stop()  # compiled code compiles from the next call on
        timeline = self.optimizer.timeline
        # the last warmup step: every chunk updated on the host (memsched.planning.cost_model)
        if timeline.records:
            host = sum(c.hi - c.lo for c in self.store.chunks if c.placement == HOST)
            self.warmup_costs = WarmupCosts.from_record(timeline.records[-1], host)
            timeline.records.clear()
        self.phase = Phase.PLAN_FAILED  # until the plan is applied
        self._make_plan()
        self.phase = Phase.PLANNED
        # Steady state: the step timeline starts, and with overlap=True host chunks update on the worker.
        self.optimizer.overlap = self.config.overlap
        # Host chunks' gradients go D2H during backward (checked at the step) on CUDA, where the copy engine
        # overlaps it with backward; elsewhere copies are synchronous and it would only cost. Not under ZeRO
        # (the reduction comes first).
        self.optimizer.early_d2h = self.dp.world == 1 and self.streams.cuda
        # overlap="backward": host chunks update during backward, committed at step()
        # (memsched.optim.early_update)
        if self.config.early_update:
            self.optimizer.early_updates.enable(self.dp.world, self.store.chunks)
        self.optimizer.timeline.overlap = self.config.overlap
        self.optimizer.timeline.start()

    def traced_modules(self) -> list[str]:
        """Qualified names of the modules whose forward ran in the warmup trace, in first-call order; empty
        before the trace exists."""
        if self.timeline is None:
            return []
        return [st.name for st in self.timeline.module_stats()]

    def first_use_order(self) -> list[torch.nn.Parameter]:
        """Trainable parameters in first-use order from the warmup trace (:mod:`memsched.planning.first_use`:
        each parameter at the first traced module that may read it, ties in the model's order); empty before
        the trace exists."""
        if self.timeline is None:
            return []
        return first_use_order(self.model, self.traced_modules(), list(self.store.params()))

    def peak_non_model_bytes(self) -> int:
        """Peak non-model data of the warmup trace on the compute device, bytes."""
        if self.timeline is None:
            return 0
        dev = self.timeline.device
        return int(self.timeline.peak_non_model_bytes(dev))
