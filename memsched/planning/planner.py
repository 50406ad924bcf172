"""The plan in force and its life: the plan made at the end of warmup, the re-plans of elastic placement
(:mod:`memsched.planning.elastic`), the chunk moves that apply a plan, the host-budget check of the initial
state, and each plan's predicted step (:mod:`memsched.planning.cost_model`).

[Note: planning at the end of warmup]
The chunks are re-packed in first-use order *before* the problem is built (the problem's chunk sizes are the
new packing's), and the H2D waits are re-installed for the new packing between the two (the scheduler does
that: :meth:`Planner.repack` then :meth:`Planner.plan_initial`). The plan is compared over the ranks before
any chunk moves, or the collectives of the first steady-state step would not match.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

import policies
from memsched.chunks import Allocator, ChunkLayout, ChunkStore, chunk_bytes, pinned_bytes
from memsched.chunks.sizing import stream_piece_numel, stream_staging_bytes
from memsched.devices.gpus import get_gpu
from memsched.devices.host_memory import check_initial_host_state, host_budget
from memsched.devices.simdevice import OUT_OF_MEMORY
from memsched.devices.spec import DeviceSpec
from memsched.devices.transfers import TransferStats
from memsched.distributed.base import DataParallel
from memsched.planning.cost_model import WarmupCosts
from memsched.planning.elastic import PlanChange
from memsched.planning.problem import DEFAULT_GRAD_WORKING_CHUNKS, build_problem, machine_inputs
from memsched.planning.reads import chunk_accesses, grad_working_bytes, reordered, scaled
from memsched.planning.step_model import MODE_NAMES, predict_step
from policies.plans import make_plan, schedule_for
from policies.schedule import schedule_sharded
from policies.speculation import speculate
from policies.types import DEVICE, HOST, ChunkAccess, PlacementPlan
from policies.units import format_bytes
from policies.update_paths import choose_update_paths, stream_seconds, streaming_bytes
from tracer.param_reads import BEGIN, FORWARD


@dataclasses.dataclass(frozen=True)
class PlanningOptions:
    """The options of :func:`memsched.attach` that planning reads, checked already. The scheduler builds them
    from its options (:meth:`memsched.config.SchedulerConfig.planning`), so the planning room imports
    nothing from the attach options' module, which imports the rooms.

    Fields: ``device`` (the device and its host link), ``policy`` and ``gpu_margin_mem_ratio`` (the
    placement), ``compute_dtype``, ``chunk_numel`` (the chunk size override, ``None``: searched),
    ``overlap`` (``overlap=True``: the CPU update beside the next forward), ``early_update``
    (``overlap="backward"``), ``host_memory_bytes`` (``host_memory=``, the host budget's own limit) and
    ``host_update`` (where host chunks are updated).
    """

    device: DeviceSpec
    policy: policies.Policy
    gpu_margin_mem_ratio: float
    compute_dtype: torch.dtype
    chunk_numel: int | None
    overlap: bool = False
    early_update: bool = False
    host_memory_bytes: int | None = None
    host_update: str = "cpu"


def check_host_room(layout: ChunkLayout, config: PlanningOptions, alloc: Allocator,
                    shard_numel: int | None = None, *, frozen_group: int | None = None,
                    frozen_on_host: bool = False, host_views: bool = True) -> None:
    """All optimizer state starts pinned on the host until the plan: refuse before pinning it when the host
    budget cannot hold it (:func:`memsched.devices.host_memory.check_initial_host_state`). ``layout``: the
    chunks; ``shard_numel``: the elements of each chunk a rank keeps state for (default: all);
    ``frozen_group``: the layout's group of frozen parameters (their chunks hold values only, on the host
    when ``frozen_on_host``, as every chunk's parameters then are); ``host_views``: the device reads pinned
    host memory in place (:func:`memsched.chunks.chunk_bytes`).

    Raises:
        policies.PlacementError: the host budget is too small (names both sizes and the limit).
    """
    sizes = [chunk_bytes(numel, compute_dtype=config.compute_dtype, shard_numel=shard_numel,
                         n_params=len(slots), private_grads=bool(config.overlap), frozen=frozen,
                         host_views=host_views)
             for slots, numel, frozen in zip(layout.chunks, layout.numels,
                                             (g == frozen_group for g in layout.chunk_groups), strict=True)
             if frozen_on_host or not frozen]
    need = sum(pinned_bytes(b.host_state_bytes, pinned=alloc.pin)
               + (pinned_bytes(b.param_host_bytes, pinned=alloc.pin) if frozen_on_host else 0) for b in sizes)
    check_initial_host_state(need, host_budget(pinned=alloc.pin,
                                               stand_in_bytes=config.device.host_capacity_bytes,
                                               user_bytes=config.host_memory_bytes))


class Planner:
    """Owns the placement plan of one scheduler and moves the chunks to it.

    Args:
        config: the scheduler's checked options that planning reads (:class:`PlanningOptions`: policy,
            ``gpu_margin_mem_ratio``, chunk size, dtype, overlap).
        model: the model (its parameters' names and shapes make the problem).
        store: the chunks.
        dp: the data parallelism (plans agree over the ranks).
        transfers: the byte counters; chunk moves add to ``chunk_moves_bytes``.
        wait_updates: ``f(what)`` blocking until no overlapped update reads the chunks (before chunks move).
        params: what brings parameters that live on the host to the device
            (:class:`memsched.runtime.param_fetch.ParamFetcher`: ``offloaded`` and ``use(offloaded,
            schedule)``), or ``None`` (parameters never leave the device).

    Attributes:
        policy: the placement policy (:mod:`policies`).
        plan: the :class:`policies.PlacementPlan` in force, ``None`` until there is one.
        problem: the :class:`policies.PlacementProblem` it solved, ``None`` until warmup ends.
        plan_error: the :class:`policies.PlacementError` of the end of warmup, if any.
        history: :class:`memsched.planning.elastic.PlanChange` list, oldest first.
        warmup_costs: the last warmup step's measurements (:mod:`memsched.planning.cost_model`) or ``None``.
        predicted_step: the modelled step of the plan in force, or ``None``.
        host_grad_working_bytes: what the host chunks' gradients add to the peak on their way to the host,
            bytes (from the warmup trace; 0 before).
    """

    def __init__(self, config: PlanningOptions, model: torch.nn.Module, store: ChunkStore, dp: DataParallel,
                 transfers: TransferStats, wait_updates: Callable[[str], None], params: Any = None,
                 link_bytes_per_s: Callable[[], float | None] = lambda: None) -> None:
        self._config = config
        self._device = config.device
        self._model = model
        self._store = store
        self._dp = dp
        self._transfers = transfers
        self._wait_updates = wait_updates
        self._link_bytes_per_s = link_bytes_per_s  # the host link's bandwidth (host_update="auto")
        self._timeline: Any = None  # the warmup trace (machine inputs: fragmentation)
        self.policy = config.policy
        self.plan: PlacementPlan | None = None
        self.problem: policies.PlacementProblem | None = None
        self.plan_error: Exception | None = None
        self.history: list[PlanChange] = []
        self.warmup_costs: WarmupCosts | None = None
        self.predicted_step: dict[str, Any] | None = None
        # What the host chunks' gradients on their way to the host add to the peak (from the warmup trace):
        # every plan counts it while a chunk is on the host, and measured peaks leave it out (probe's base)
        self.host_grad_working_bytes = 0
        self._params = params
        self.accesses: tuple[ChunkAccess, ...] = ()  # the warmup step's chunk reads (in the packing in force)
        self.rootless = False  # no root forward in warmup ([Note: a forward that never runs the root])
        self._traced_peak = 0  # the peak non-model data the accesses were traced with

    def measure_warmup(self, costs: WarmupCosts) -> None:
        """Keep the last warmup step's measurements for the predicted steps of the plans to come."""
        self.warmup_costs = costs

    def repack(self, order: list[torch.nn.Parameter],
               after_chunk: Callable[[ChunkStore, Any], None] | None = None) -> None:
        """Re-pack the chunks in first-use ``order`` (across ranks: :meth:`DataParallel.repack`;
        ``after_chunk`` as :meth:`memsched.chunks.ChunkStore.repack`). Out of memory keeps the old packing,
        values and state intact, with a warning."""
        try:
            self._dp.repack(self._store, order, self._config.chunk_numel, after_chunk=after_chunk)
        except OUT_OF_MEMORY as e:  # the store put the old packing back, values and state intact
            warnings.warn(f"memsched: re-packing the chunks in first-use order ran out of memory ({e}); the "
                          "chunks keep their registration-order packing", RuntimeWarning, stacklevel=4)

    def plan_initial(self, peak_non_model_bytes: int, timeline: Any, steps: int, *,
                     host_grad_working_bytes: int = 0, reads: Sequence[Any] = ()) -> PlacementPlan:
        """The plan of the end of warmup, applied (see [Note: planning at the end of warmup]).
        ``host_grad_working_bytes``: what the host chunks' gradients add to the peak on their way to the host
        (:meth:`memsched.Scheduler.host_grad_working_bytes`); ``reads``: the warmup's recorded parameter
        reads (:mod:`memsched.planning.reads`), from which plans schedule parameter fetches.

        Raises:
            policies.PlacementError: the policy found no plan; the optimizer state stays on the host.
        """
        self._timeline = timeline
        self.host_grad_working_bytes = host_grad_working_bytes
        # forward reads recorded, but no forward of the root began (a compiled forward records neither)
        self.rootless = (not self._sharded_params and any(r.phase == FORWARD for r in reads)
                         and not any(r.phase == BEGIN for r in reads))
        if reads and self._params is not None and (self._device.kind != "cpu" or self._sharded_params):
            chunks = {k: c.index for k, c in self._store.param_chunk.items()}
            grad_bytes = max(c.data_bytes for c in self._store.chunks)
            accesses = chunk_accesses(reads, chunks, timeline, grad_bytes=grad_bytes)
            # [Note: a forward that never runs the root] memsched fetches parameters from the attached
            # module's forward (its hooks begin and end a step's reads); a warmup that only called its
            # submodules (``model.body(x)``, then ``model.head(h)``) would leave parameters on the host that
            # no hook fetches, read as host tensors on the device. Such a plan keeps every parameter on the
            # device: exact where they fit, refused at once, naming the cause, where they do not.
            self.accesses = () if self.rootless else tuple(accesses)
            self._traced_peak = peak_non_model_bytes
            # the gradients in flight in this packing ([Note: gradients in flight] in
            # memsched.planning.reads); the warmup measured them in its own packing: the larger of the two
            simulated = grad_working_bytes(reads, chunks, timeline, grad_bytes)
            if simulated is not None and self._store.offloader is not None:
                self.host_grad_working_bytes = max(host_grad_working_bytes, simulated)
        problem = self.problem = self._problem(peak_non_model_bytes)
        if self._device.kind == "cpu":
            self.plan = policies.make_plan(
                problem, [DEVICE] * self._store.layout.n_chunks, budget_bytes=max(0, problem.margin_bytes),
                policy="cpu-device",
                reasons=("the compute device is the CPU: host and device memory are the same, so every chunk "
                         "is device-resident and nothing is copied",))
            return self.plan
        try:
            plan = self.policy.plan(problem)
        except policies.PlacementError as e:
            self.plan_error = e
            rootless = ""
            if self.rootless:
                rootless = (
                    "; parameters could not go to the host: the warmup step ran submodules of the attached "
                    f"{type(self._model).__name__} but never its own forward, from whose hooks memsched "
                    "fetches them: call the attached model (a forward that calls its parts), or attach the "
                    "module you call")
            raise policies.PlacementError(
                f"{e} (the warmup step itself completed; the optimizer state stays on the host){rootless}"
            ) from e
        plan = self._speculate(problem, self._update_paths(problem, plan))
        self._dp.check_same("placement plan", tuple(plan.placement))  # or the collectives would not match
        plan = self._with_overlap_modes(problem, self._with_predicted_step(plan))
        self._apply(plan)
        self.history.append(PlanChange(steps, "end of warmup", plan, problem.peak_non_model_bytes,
                                       self._transfers.chunk_moves_bytes))
        return plan

    def replan(self, peak: int | None, reason: str, steps: int) -> None:
        """Elastic placement (:mod:`memsched.planning.elastic`): make the plan for ``peak`` non-model bytes
        (``None``: every chunk on the host) and move the chunks, before the forward that needs it."""
        self._wait_updates("re-plan")  # no chunk moves under an overlapped update
        assert self.problem is not None, "re-planning before the end of warmup"
        problem = self._problem(peak if peak is not None else self.problem.peak_non_model_bytes)
        try:  # peak None: every chunk's state on the host (cpu); parameters too when they do not all fit
            plan = policies.get("cpu").plan(problem) if peak is None else self.policy.plan(problem)
        except policies.PlacementError:
            plan = self._most_offloaded(problem)
        plan = self._speculate(problem, self._update_paths(problem, plan))
        self._dp.check_same("placement plan", tuple(plan.placement))
        same = ("placement", "param_placement", "schedule", "speculative", "streamed")
        if self.plan is not None and all(getattr(plan, k) == getattr(self.plan, k) for k in same):
            return
        before = self._transfers.chunk_moves_bytes
        self._apply(plan)
        self.problem = problem
        self.history.append(PlanChange(steps, reason, plan, peak, self._transfers.chunk_moves_bytes - before))

    def revise(self, reads: Sequence[Any], steps: int) -> None:
        """The parameter reads of a step came in an order the schedule did not expect (read off it, fetched
        on demand): make the plan again from the reads of the step after it, ``reads``
        (:func:`memsched.planning.reads.reordered`), and apply it."""
        if self.rootless:  # its plan keeps every parameter on the device: nothing to revise
            return
        chunks = {k: c.index for k, c in self._store.param_chunk.items()}
        accesses = reordered(reads, chunks, self.accesses)
        if not accesses or self.problem is None:
            return
        self.accesses = tuple(accesses)
        self._traced_peak = self.problem.peak_non_model_bytes  # the bytes are those of the plan in force
        self.replan(self.problem.peak_non_model_bytes,
                    "the parameter reads came in another order than the schedule's", steps)
        if self._sharded_params:  # the placement may not have changed: the schedule has
            self._shard_params()
        elif self._params is not None:
            self._params.resume_schedule()

    @property
    def _sharded_params(self) -> bool:
        """ZeRO-3: the fetcher's chunks are sharded over the ranks (memsched.distributed.sharded_params)."""
        return self._params is not None and self._params.shards is not None

    def _shard_params(self) -> None:
        """ZeRO-3: every chunk's parameters are sharded while a step computes, on the schedule of the
        recorded reads (:func:`policies.schedule.schedule_sharded`), the same on every rank (compared: the
        all-gathers must match)."""
        assert self._params is not None
        n = len(self._store.chunks)
        schedule = schedule_sharded(self.accesses, n)
        self._dp.check_same("ZeRO-3 parameter schedule",
                            tuple((a.chunk, a.phase) for a in schedule.accesses) + (schedule.targets,))
        self._params.use(range(n), schedule)

    def _most_offloaded(self, problem: policies.PlacementProblem) -> PlacementPlan:
        """The plan that keeps the least on the device: everything on the host, every parameter fetched for
        its reads and nothing more (no chunk cached or fetched ahead beyond what a read needs: the step's
        non-model data may be larger than any measured); the plan in force when even that finds no room (its
        step runs as it can)."""
        n = len(problem.chunks)
        try:
            sched = schedule_for(problem, [HOST] * n, [HOST] * n, problem.capacity_bytes, share=0.0)
        except policies.PlacementError:
            assert self.plan is not None
            return self.plan
        return make_plan(problem, [HOST] * n, budget_bytes=0, policy="cpu", param_placement=[HOST] * n,
                         schedule=sched, reasons=("every chunk on the host, parameters fetched for their "
                                                  "reads, for a step whose peak is not known yet",))

    def _update_paths(self, problem: policies.PlacementProblem, plan: PlacementPlan) -> PlacementPlan:
        """``attach(host_update="device" | "auto")``, one rank: the host chunks whose update runs on the
        device, their state streamed over the link (:func:`policies.update_paths.choose_update_paths`,
        :mod:`memsched.optim.streamed_update`). Chunks whose parameters live on the host stay on the CPU."""
        mode = self._config.host_update
        if mode == "cpu":
            return plan
        if self._dp.world != 1:
            return dataclasses.replace(plan, reasons=(*plan.reasons, (
                f"host_update={mode!r} needs one rank; with {self._dp.world} host chunks are updated on the "
                "CPU")))
        store = self._store
        dtype = self._config.compute_dtype
        size = torch.empty((), dtype=dtype).element_size()
        eligible = [i for i, where in enumerate(plan.placement)
                    if where == HOST and not plan.params_on_host(i) and not store.chunks[i].frozen]
        numel = [c.hi - c.lo for c in store.chunks]
        costs = self.warmup_costs
        piece = stream_piece_numel([numel[i] for i in eligible])
        staging = stream_staging_bytes(piece, dtype) if eligible else 0
        return choose_update_paths(
            problem, plan, mode=mode, eligible=eligible,
            cpu_elements_per_s=costs.cpu_elements_per_s if costs is not None else None,
            link_bytes_per_s=self._link_bytes_per_s(), link_bytes=self._stream_link_bytes(),
            param_h2d_bytes=[n * size for n in numel], staging_bytes=staging)

    def _stream_link_bytes(self) -> list[tuple[int, int]]:
        """Per chunk, the ``(H2D, D2H)`` bytes of its update streamed through the device
        (:func:`policies.update_paths.streaming_bytes`)."""
        store = self._store
        size = torch.empty((), dtype=self._config.compute_dtype).element_size()
        on_host = store.offloader is not None  # the host chunks' gradients go to the host in backward
        # a mixed-precision chunk with a host copy of its parameters (not lean) gets them back D2H too
        return [streaming_bytes(c.hi - c.lo, size, size, grads_on_host=on_host,
                                host_param_copy=c.mixed and not c.lean) for c in store.chunks]

    def _stream_seconds(self, plan: PlacementPlan) -> float:
        """The plan's streamed updates over the link, seconds (0 without streamed chunks or a known link)."""
        if not plan.streamed:
            return 0.0
        return stream_seconds(plan.streamed, self._stream_link_bytes(), self._link_bytes_per_s())

    def _speculate(self, problem: policies.PlacementProblem, plan: PlacementPlan) -> PlacementPlan:
        """[Note: the spare state is planned] With ``overlap="backward"`` and one rank, the host chunks whose
        update starts during backward (:func:`policies.speculation.speculate`): each keeps a spare host state
        (memsched.optim.early_update), which the plan's host bytes, the host budget and
        ``sched.host_usage()`` count. Backward completes gradients in the reverse of the chunks' first-use
        order, so the last-used host chunks come first; the warmup's CPU update rate and backward time stop
        the count where the updates would outlast backward."""
        if not self._config.early_update or self._dp.world != 1:
            return plan
        return self._speculation(problem, plan)

    def _speculation(self, problem: policies.PlacementProblem, plan: PlacementPlan) -> PlacementPlan:
        """:meth:`_speculate`'s choice, whatever the overlap mode in force."""
        costs = self.warmup_costs
        update_s = backward_s = None
        if costs is not None and costs.cpu_elements_per_s:
            rate = costs.cpu_elements_per_s
            update_s = [(c.hi - c.lo) / rate for c in self._store.chunks]
            backward_s = costs.backward_s
        order = range(len(problem.chunks) - 1, -1, -1)
        return speculate(problem, plan, order=order, update_s=update_s, backward_s=backward_s)

    def _with_predicted_step(self, plan: PlacementPlan) -> PlacementPlan:
        """``plan`` with its predicted step among its reasons; the prediction is :attr:`predicted_step`.

        On a GPU the table knows (CUDA's name, or the stand-in's ``gpu=NAME``), in a calibrated dtype, the
        roofline of :mod:`memsched.planning.step_model` (the warmup's FLOPs at the GPU's calibrated share of
        its peak, plus the exposed CPU update at the rate the warmup measured), the model ``memsched plan``
        uses: the traced warmup's own phases overstate a GPU step several times (a first, traced step).
        Elsewhere, the warmup's phases (:mod:`memsched.planning.cost_model`)."""
        costs = self.warmup_costs
        if costs is None:
            return plan
        streamed = set(plan.streamed)
        host = [c for c, where in zip(self._store.chunks, plan.placement, strict=True)
                if where == HOST and not c.frozen and c.index not in streamed]  # updated on the CPU
        elements = sum(c.hi - c.lo for c in host)
        speculative = sum(self._store.chunks[i].hi - self._store.chunks[i].lo for i in plan.speculative)
        link_s = self._stream_seconds(plan)
        overlap: bool | str = "backward" if self._config.early_update else bool(self._config.overlap)
        roofline = None
        if self._device.gpu is not None and costs.flops > 0 and costs.cpu_elements_per_s:
            roofline = predict_step(costs.flops, get_gpu(self._device.gpu), self._config.compute_dtype,
                                    elements, costs.cpu_elements_per_s, overlap,
                                    speculative_elements=speculative, link_s=link_s)
        if roofline is None:
            self.predicted_step = costs.predict(elements, overlap, speculative_elements=speculative,
                                                link_s=link_s)
            text = costs.reason(elements, len(host), overlap, speculative_elements=speculative, link_s=link_s,
                                streamed_chunks=len(streamed))
        else:
            self.predicted_step = {"model": "roofline", "gpu": self._device.gpu, **roofline.as_dict()}
            mode = MODE_NAMES[overlap]
            text = (f"Predicted step {roofline.step_s * 1e3:.1f} ms on {self._device.gpu} ({mode} CPU "
                    f"update): compute {roofline.compute_s * 1e3:.1f} ms ({roofline.flops / 1e12:.2f} TFLOP "
                    f"at {roofline.efficiency:.2f} of {roofline.peak_flops / 1e12:.0f} TFLOP/s) + CPU update "
                    f"of {len(host)} host chunks {roofline.cpu_update_s * 1e3:.1f} ms at "
                    f"{roofline.cpu_elements_per_s / 1e6:.0f} M elements/s measured in warmup"
                    + (f" ({speculative / roofline.cpu_elements_per_s * 1e3:.1f} ms of it from backward)"
                       if overlap == "backward" else "")
                    + (f" + the update of {len(streamed)} chunks streamed through the device, "
                       f"{link_s * 1e3:.1f} ms over the link" if streamed else "")
                    + f", of which {roofline.exposed_cpu_s * 1e3:.1f} ms exposed.")
        return dataclasses.replace(plan, reasons=(*plan.reasons, text))

    def _with_overlap_modes(self, problem: policies.PlacementProblem, plan: PlacementPlan) -> PlacementPlan:
        """``plan`` with a sentence comparing the overlap modes (one rank, with host chunks updated on the
        CPU): the step each is predicted to take by the warmup model (:mod:`memsched.planning.cost_model`),
        the host memory each would add to this plan (``overlap=True``: each host chunk's own fp32 gradients,
        ``private_grads``; ``overlap="backward"``: the spare states of the chunks
        :func:`policies.speculation.speculate` would choose), the mode in force, and the faster one when it
        is not in force. memsched does not switch by itself: the mode decides the chunks' layout at attach,
        and no committed GPU measurement has shown the model's gain yet (``bench/overlap_step.py``,
        ``bench/GPU-PENDING.md``)."""
        costs = self.warmup_costs
        if costs is None or not costs.cpu_elements_per_s or self._dp.world != 1:
            return plan
        store, streamed = self._store, set(plan.streamed)
        host = [c for c, where in zip(store.chunks, plan.placement, strict=True)
                if where == HOST and not c.frozen and c.index not in streamed]
        if not host:
            return plan
        elements = sum(c.hi - c.lo for c in host)
        link_s = self._stream_seconds(plan)
        in_force: bool | str = "backward" if self._config.early_update else bool(self._config.overlap)
        spec_plan = plan if in_force == "backward" else self._speculation(problem, plan)
        spec = sum(store.chunks[i].hi - store.chunks[i].lo for i in spec_plan.speculative)

        def private(flag: bool) -> int:
            views = store.lean_params or not store.backward_offload
            return sum(chunk_bytes(c.numel, compute_dtype=self._config.compute_dtype, shard_numel=c.hi - c.lo,
                                   n_params=len(c.params), offload_grads=c.offload_grads, private_grads=flag,
                                   host_views=views).host_state_bytes for c in host)

        extra = {False: 0, True: 0 if store.private_grads else private(True) - private(False),
                 "backward": 0 if in_force == "backward" else spec_plan.host_bytes - plan.host_bytes}
        steps = {mode: costs.predict(elements, mode, speculative_elements=spec, link_s=link_s)["step_s"]
                 for mode in (False, True, "backward")}
        names = {False: "serial", True: "overlap=True", "backward": "overlap='backward'"}
        parts = [f"{names[m]} {steps[m] * 1e3:.1f} ms"
                 + (f" (+{format_bytes(extra[m])} of host memory)" if extra[m] else "") for m in steps]
        best = min(steps, key=lambda m: (steps[m], m != in_force))
        advice = ("" if best == in_force or steps[best] > 0.95 * steps[in_force] else
                  f"; {names[best]} is predicted {steps[in_force] / steps[best]:.2f}x faster (attach(overlap="
                  f"{best!r}))")
        text = (f"Overlap modes, predicted from the warmup step: {', '.join(parts)}"
                + (f", {len(spec_plan.speculative)} chunks speculating" if spec_plan.speculative else "")
                + f". In force: {names[in_force]}{advice}.")
        return dataclasses.replace(plan, reasons=(*plan.reasons, text))

    def _problem(self, peak_non_model_bytes: int) -> policies.PlacementProblem:
        """The placement problem of the chunks in force for a peak non-model data (bytes), with the host
        chunks' gradient working set measured in warmup (:attr:`host_grad_working_bytes`)."""
        store, dp = self._store, self._dp
        order = list(store.all_params())  # the packing in force (frozen parameters last)
        capacity, peak = dp.agree_margin_inputs(self._device.capacity_bytes, peak_non_model_bytes)
        # one rank: the host chunks' gradients in flight are measured in warmup (below); more ranks: what the
        # ZeRO stage keeps per rank, whole gradient buffers in flight included (build_problem)
        grads: dict[str, Any] = (
            {"world_size": dp.world, "zero_stage": dp.stage,
             "grad_working_chunks": DEFAULT_GRAD_WORKING_CHUNKS} if dp.world > 1 else
            {"offload_grads": store.offloader is not None and store.lazy_grads, "grad_working_chunks": 0})
        problem, layout = build_problem(
            self._model, peak, capacity,
            gpu_margin_mem_ratio=self._config.gpu_margin_mem_ratio, param_order=order,
            chunk_numel=store.layout.chunk_numel, param_groups=store.groups,
            compute_dtype=self._config.compute_dtype, align=store.align, pinned=store.alloc.pin,
            private_grads=store.private_grads, host_views=store.lean_params or not store.backward_offload,
            # parameters leave the device for the host with one rank only (ZeRO-3 shards them: _apply)
            accesses=scaled(self.accesses, peak_non_model_bytes, self._traced_peak) if dp.world == 1 else (),
            **grads,
            **machine_inputs(self._timeline, self._device, store, dp,
                             host_memory_bytes=self._config.host_memory_bytes))  # host budget, fragmentation
        assert layout == store.layout, "planning and chunks disagree on the layout"
        if self.host_grad_working_bytes and dp.world == 1:
            problem = dataclasses.replace(problem, host_grad_working_bytes=self.host_grad_working_bytes)
        return problem

    def _apply(self, plan: PlacementPlan) -> None:
        """Move chunks per ``plan``: optimizer state to the host first, then the parameters (those that stay
        on the host leave the device, those that come back are fetched to stay), then state to the device;
        on failure (e.g. the stand-in runs out) the state moved to the device goes back and the error is
        re-raised."""
        store = self._store
        for c, where in zip(store.chunks, plan.placement, strict=True):
            if where == HOST and c.placement != HOST:
                self._transfers.add_chunk_move(store.place(c, HOST))
        if self._sharded_params:
            self._shard_params()
        elif self._params is not None:
            offloaded = plan.param_host_chunks
            if offloaded or self._params.offloaded:
                self._params.use(offloaded, plan.schedule)
        moved = []
        try:
            for c, where in zip(store.chunks, plan.placement, strict=True):
                if c.placement != where:
                    self._transfers.add_chunk_move(store.place(c, where))
                    moved.append(c)
        except BaseException:
            for c in moved:
                store.place(c, HOST)
            raise
        self.plan = plan
