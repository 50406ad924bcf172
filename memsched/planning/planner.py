"""Planning for :class:`memsched.Scheduler`: the plan at the end of warmup, the re-plans of elastic placement
(:mod:`memsched.planning.elastic`), the chunk moves that apply a plan, the host-budget check of the initial
state, and each plan's predicted step (:mod:`memsched.planning.cost_model`). A mixin: the scheduler's state is
its state."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any

import torch

import policies
from memsched.chunks import Allocator, chunk_bytes, pinned_bytes
from memsched.devices.host_memory import check_initial_host_state, host_budget
from memsched.devices.simdevice import OUT_OF_MEMORY
from memsched.planning.elastic import Elastic, PeakProbe, PlanChange
from memsched.planning.problem import build_problem, machine_inputs
from memsched.teardown import weak_method
from policies.types import DEVICE, HOST, PlacementPlan
from tracer.hook_handles import Detachable


class PlanningMixin:
    """The planning half of :class:`memsched.Scheduler` (see the module docstring)."""

    # The scheduler's attributes this mixin reads and writes (set in Scheduler._build).
    store: Any
    dp: Any
    device: Any
    model: torch.nn.Module
    plan: PlacementPlan | None
    problem: policies.PlacementProblem | None

    def _check_host_room(self, alloc: Allocator) -> None:
        """All optimizer state starts pinned on the host until the plan: refuse before pinning it when the
        host budget cannot hold it (:func:`memsched.devices.host_memory.check_initial_host_state`)."""
        sizes = [chunk_bytes(c.numel, compute_dtype=self.compute_dtype, shard_numel=c.hi - c.lo,
                             n_params=len(c.params)) for c in self.store.chunks]
        need = sum(pinned_bytes(b.host_state_bytes, pinned=alloc.pin) for b in sizes)
        check_initial_host_state(need, host_budget(pinned=alloc.pin,
                                                   stand_in_bytes=self.device.host_capacity_bytes))

    def _install_elastic(self) -> None:
        """The re-planning hooks on the model (:mod:`memsched.planning.elastic`): its forward pre-hook plans
        for the inputs, its always-called forward hook notices an out-of-memory error."""
        elastic = self.elastic = Elastic(weak_method(self._replan), self.dp.agree_max,
                                         PeakProbe(self.device.torch_device, self.sim), world=self.dp.world)

        def before(_m: torch.nn.Module, args: Any, kwargs: Any) -> None:
            elastic.before_forward(args, kwargs)

        def after(_m: torch.nn.Module, _args: Any, output: Any) -> None:
            # On failure torch calls always-called hooks inside its ``except`` with no output; a forward that
            # succeeds inside the user's own ``except`` (the retry) has an output. Compiled code never calls
            # this on failure (the retry loop's zero_grad() reports it: Scheduler.zero_grad_hook).
            if torch.compiler.is_compiling():
                return
            if output is None and isinstance(sys.exc_info()[1], OUT_OF_MEMORY):
                elastic.on_oom()

        def on_zero_grad() -> None:  # in the retry loop's ``except``: the compiled forward ran out of memory
            if isinstance(sys.exc_info()[1], OUT_OF_MEMORY):
                elastic.on_oom()

        self.optimizer.on_zero_grad = on_zero_grad
        self._handles.append(self.model.register_forward_pre_hook(Detachable(before), prepend=True,
                                                                  with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(Detachable(after), always_call=True))


    def _make_plan(self) -> None:
        order = self.first_use_order()
        try:
            self.dp.repack(self.store, order, self.chunk_numel)
        except OUT_OF_MEMORY as e:  # the store put the old packing back, values and state intact
            warnings.warn(f"memsched: re-packing the chunks in first-use order ran out of memory ({e}); the "
                          "chunks keep their registration-order packing", RuntimeWarning, stacklevel=3)
        self.optimizer.record_param_versions()
        self.waits.install(self.traced_modules())
        problem = self.problem = self._problem(self.peak_non_model_bytes())
        layout = self.store.layout
        if self.device.kind == "cpu":
            self.plan = policies.make_plan(
                problem, [DEVICE] * layout.n_chunks, budget_bytes=max(0, problem.margin_bytes),
                policy="cpu-device",
                reasons=("the compute device is the CPU: host and device memory are the same, so every chunk "
                         "is device-resident and nothing is copied",))
            return
        try:
            plan = self.policy.plan(problem)
        except policies.PlacementError as e:
            self.plan_error = e
            raise policies.PlacementError(
                f"{e} (the warmup step itself completed; the optimizer state stays on the host)") from e
        self.dp.check_same("placement plan", tuple(plan.placement))  # or the collectives would not match
        plan = self._with_predicted_step(plan)
        self._apply(plan)
        self.plan_history.append(PlanChange(self.steps, "end of warmup", plan, problem.peak_non_model_bytes,
                                            self.transfers.chunk_moves_bytes))
        if self.elastic is not None:
            self.elastic.start(problem.peak_non_model_bytes)

    def _with_predicted_step(self, plan: PlacementPlan) -> PlacementPlan:
        """``plan`` with its predicted step among its reasons (:mod:`memsched.planning.cost_model`); the
        prediction is ``self.predicted_step``."""
        if self.warmup_costs is None:
            return plan
        host = [c for c, where in zip(self.store.chunks, plan.placement, strict=True) if where == HOST]
        elements = sum(c.hi - c.lo for c in host)
        self.predicted_step = self.warmup_costs.predict(elements, self.config.overlap)
        text = self.warmup_costs.reason(elements, len(host), self.config.overlap)
        return dataclasses.replace(plan, reasons=(*plan.reasons, text))

    def _problem(self, peak_non_model_bytes: int) -> policies.PlacementProblem:
        """The placement problem of the chunks in force for a peak non-model data (bytes)."""
        order = [p for g in self.store.groups for p in g]  # the packing in force
        capacity, peak = self.dp.agree_margin_inputs(self.device.capacity_bytes, peak_non_model_bytes)
        problem, layout = build_problem(
            self.model, peak, capacity,
            gpu_margin_mem_ratio=self.gpu_margin_mem_ratio, param_order=order,
            chunk_numel=self.store.layout.chunk_numel, param_groups=self.store.groups,
            compute_dtype=self.compute_dtype, align=self.store.align, pinned=self.store.alloc.pin,
            world_size=self.dp.world if self.dp.sharded else 1,
            **machine_inputs(self.timeline, self.device, self.store, self.dp))  # host budget, fragmentation
        assert layout == self.store.layout, "planning and chunks disagree on the layout"
        return problem

    def _replan(self, peak: int | None, reason: str) -> None:
        """Elastic placement (:mod:`memsched.planning.elastic`): make the plan for ``peak`` non-model bytes
        (``None``: every chunk on the host) and move the chunks, before the forward that needs it."""
        self.optimizer.wait_updates("re-plan")  # no chunk moves under an overlapped update
        problem = self._problem(peak if peak is not None else self.problem.peak_non_model_bytes)
        plan = (policies.get("cpu").plan(problem) if peak is None else self.policy.plan(problem))
        self.dp.check_same("placement plan", tuple(plan.placement))
        if self.plan is not None and plan.placement == self.plan.placement:
            return
        before = self.transfers.chunk_moves_bytes
        self._apply(plan)
        self.problem = problem
        self.plan_history.append(PlanChange(self.steps, reason, plan, peak,
                                            self.transfers.chunk_moves_bytes - before))

    def _apply(self, plan: PlacementPlan) -> None:
        """Move chunks per ``plan``; on failure (e.g. the stand-in runs out) move back and re-raise."""
        moved = []
        try:
            for c, where in zip(self.store.chunks, plan.placement, strict=True):
                if c.placement != where:
                    self.transfers.chunk_moves_bytes += c.move_to(where, self.store.alloc)
                    moved.append(c)
        except BaseException:
            for c in moved:
                c.move_to(HOST, self.store.alloc)
            raise
        self.plan = plan

