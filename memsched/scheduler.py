"""``memsched.attach``: trace during warmup, plan, then train with the hybrid optimizer (re-planning as the
inputs' shapes change: :mod:`memsched.planning.elastic`).

The life of a :class:`Scheduler` (PatrickStar's warmup-then-schedule, arXiv 2108.05818 section 5; ColossalAI
Gemini's warmup phase):

1. attach: the trainable parameters are packed into chunks (registration order) on the compute device; all
   optimizer-state chunks start on the host (safe whatever the device size); the tracer starts.
2. warmup (the first ``warmup_steps`` optimizer steps): training runs under :class:`tracer.MemoryTracer`.
3. end of warmup (inside the last warmup ``step()``, after its update): the tracer stops and its hooks go away
   (later steps carry no tracing cost); the chunks are re-packed in first-use order (optimizer state moves
   with the parameters, bit-exact); the :class:`policies.PlacementProblem` is built, the policy runs once, and
   the chunks move to their planned side. If the policy finds no plan (:class:`policies.PlacementError`, with
   the numbers), that error is raised from that ``step()``, whose update is nonetheless complete; the state
   stays on the host and training can go on.
4. steady state: with ``replan="auto"`` each step's inputs may re-plan before their forward
   (:mod:`memsched.planning.elastic`); with ``overlap=True`` host chunks update on a worker
   (:mod:`memsched.optim.host_updates`).

Devices (see :mod:`memsched.devices.spec`): ``device=None`` picks CUDA when present, else the CPU. On the CPU,
host and device memory are one: every chunk is device-resident from the start, no copies are made, and the
plan is trivially "everything on the device" (the policy is not consulted; the warmup trace still runs for
reports). On the stand-in ``sim:SIZE`` device the capacity is enforced by
:class:`memsched.devices.simdevice.SimDevice`, whose accounting is active from attach until
:meth:`Scheduler.close` (or the end of ``with memsched.attach(...)``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import policies
from memsched.chunks import Allocator, ChunkStore, build_layout
from memsched.chunks.grad_offload import GradOffload
from memsched.chunks.state_entries import own_storage_entries
from memsched.chunks.store import frozen_params
from memsched.config import SchedulerConfig, make_config
from memsched.devices.host_alias import reads_host_memory, settle
from memsched.devices.simdevice import OUT_OF_MEMORY, SimDevice, add_oom_numbers
from memsched.devices.spec import DeviceSpec
from memsched.devices.transfers import Streams, TransferStats
from memsched.distributed.base import DataParallel
from memsched.distributed.options import COLLECTIVE_TIMEOUT_S
from memsched.distributed.sharded_params import ParamShards
from memsched.lifecycle import Phase
from memsched.optim.hybrid_adamw import HybridAdamW
from memsched.optim.precision import LossScaler
from memsched.planning.cost_model import WarmupCosts
from memsched.planning.elastic import Elastic, PeakProbe, PlanChange
from memsched.planning.plan_check import PlanCheck, check_plan
from memsched.planning.planner import Planner, check_host_room
from memsched.runtime.elastic_hooks import explain_oom, install_elastic_hooks, oom_bytes, unfittable_message
from memsched.runtime.meta_init import MetaBorn, check_meta, materialise, unmaterialise
from memsched.runtime.move_guard import MoveGuard
from memsched.runtime.param_fetch import ParamFetcher
from memsched.runtime.waits import H2DWaits
from memsched.runtime.warmup import WarmupTrace
from memsched.runtime.warmup_oom import warmup_oom_message
from memsched.teardown import ATTACHED, Installed, claim, release, weak_method
from memsched.telemetry.host_usage import HostUsage, host_usage
from memsched.telemetry.step_timeline import StepTimeline
from policies.builtin import warmup_params_on_host
from policies.types import DEVICE, HOST, PlacementPlan


def cast_to_compute_dtype(model: torch.nn.Module, trainable: Iterable[torch.nn.Parameter],
                          dtype: torch.dtype) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """Under ``attach(dtype=torch.bfloat16 or torch.float16)`` the frozen floating-point parameters and the
    floating-point buffers of ``model`` take the compute ``dtype``, as ``model.to(dtype)`` converts them (the
    trainable ones become chunk views of that dtype): a frozen block (a LoRA base, a frozen encoder) then
    computes with the trainable ones instead of failing with torch's "expected scalar type" inside the
    forward, and the run equals the torch reference of a ``model.to(dtype)`` model with fp32 masters. Tensor
    subclasses (a quantized weight) and float8 tensors keep their own dtype, as memsched never converts a
    value it cannot hold exactly in its chunks; integer and complex tensors are not touched
    (``model.to`` leaves integers too).

    Returns:
        ``(module, name, old tensor)`` for each converted parameter or buffer, to undo a refused attach
        (:func:`restore_dtypes`).
    """
    if dtype == torch.float32:
        return []
    given = {id(p) for p in trainable}
    done: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    converted: dict[int, torch.Tensor] = {}  # a tied tensor converts once

    def convertible(t: torch.Tensor) -> bool:
        return (type(t.data) is torch.Tensor and t.dtype in (torch.float32, torch.float64, torch.float16,
                                                              torch.bfloat16) and t.dtype != dtype)

    with torch.no_grad():
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None or id(p) in given or p.requires_grad or not convertible(p):
                    continue
                if id(p) not in converted:
                    converted[id(p)] = p.data
                    p.data = p.data.to(dtype)
                    done.append((module, name, converted[id(p)]))
            for name, b in module._buffers.items():
                if b is None or not convertible(b):
                    continue
                new = converted.get(id(b))
                if new is None:
                    new = converted[id(b)] = b.to(dtype)
                module._buffers[name] = new
                done.append((module, name, b))
    return done


def restore_dtypes(done: list[tuple[torch.nn.Module, str, torch.Tensor]]) -> None:
    """Undo :func:`cast_to_compute_dtype` (a refused attach leaves the model as it was)."""
    with torch.no_grad():
        for module, name, old in reversed(done):
            if name in module._parameters:
                module._parameters[name].data = old
            else:
                module._buffers[name] = old


class Scheduler:
    """The scheduler :func:`attach` returns, built from a checked :class:`memsched.config.SchedulerConfig`: a
    facade over the components it composes (the chunks, the data parallelism, the optimizer, the warmup trace,
    the planner, the H2D waits, the elastic re-planner, what it installed).

    Attributes: ``model``, ``optimizer`` (:class:`HybridAdamW`), ``phase``
    (:class:`memsched.lifecycle.Phase`), ``steps`` (optimizer steps taken, skipped fp16 steps included),
    ``plan`` (the :class:`policies.PlacementPlan` in force; ``None`` until there is one), ``problem`` (the
    :class:`policies.PlacementProblem` it solved; ``None`` until warmup ends), ``timeline`` (the warmup trace;
    ``None`` until warmup ends), ``device`` (:class:`memsched.devices.spec.DeviceSpec`), ``sim`` (the stand-in
    device or ``None``), ``store`` (the chunks), ``dp`` (the data parallelism:
    :class:`memsched.distributed.base.DataParallel`, one rank or ZeRO), ``planner``
    (:class:`memsched.planning.planner.Planner`), ``warmup`` (:class:`memsched.runtime.warmup.WarmupTrace`),
    ``waits`` (:class:`memsched.runtime.waits.H2DWaits`), ``elastic``
    (:class:`memsched.planning.elastic.Elastic` or ``None``), ``plan_history``
    (:class:`memsched.planning.elastic.PlanChange` list, oldest first: the end-of-warmup plan, then each
    re-plan).
    """

    def __init__(self, model: torch.nn.Module, config: SchedulerConfig) -> None:
        if model in ATTACHED:
            raise RuntimeError("memsched is already attached to this model: close() the first scheduler (or "
                               "leave its with-block) before attaching again")
        self.config = config
        self.device: DeviceSpec = config.device
        self.compute_dtype = config.compute_dtype
        self.gpu_margin_mem_ratio = config.placement.gpu_margin_mem_ratio
        self.warmup_steps = config.placement.warmup_steps
        self.chunk_numel = config.chunk_numel
        #: The warmup's plan against ``attach(expected_plan=...)`` (:mod:`memsched.planning.plan_check`)
        self.plan_check: PlanCheck | None = None
        groups = config.adamw.groups
        trainable = [p for g in groups for p in g["params"]]
        cast = cast_to_compute_dtype(model, trainable, config.compute_dtype)  # as model.to(dtype) would
        # frozen parameters are model data too: chunks of their own, placed by the plan (issue 31)
        frozen = frozen_params(model, trainable, config.compute_dtype)
        swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        try:
            # A model built on meta: its parameters get placeholders that the chunks replace, then values
            # after attach ([Note: models built on meta])
            self._meta = check_meta(model, trainable + frozen)
            swapped = materialise(self._meta)
            claim(model, trainable + frozen)
        except BaseException:
            unmaterialise(swapped)
            restore_dtypes(cast)
            raise
        try:
            self._build(model, config, groups, frozen)
        except BaseException:
            # A refused attach leaves nothing installed: hooks on the parameters would keep the chunks (and
            # their device memory) alive with the model. The parameters keep their values, in the chunks.
            installed = getattr(self, "_installed", None)
            if installed is not None:
                installed.track(store=getattr(self, "store", None))
                installed.remove()
            release(trainable + frozen)
            unmaterialise(swapped)
            restore_dtypes(cast)  # last: taking the chunks down re-binds parameters
            raise

    def _build(self, model: torch.nn.Module, config: SchedulerConfig, groups: list[dict[str, Any]],
               frozen: list[torch.nn.Parameter]) -> None:
        from memsched.distributed import make_engine

        self.dp: DataParallel = make_engine(config.data_parallel, self.device.torch_device)
        chunk_numel = self.dp.chunk_numel_for([g["params"] for g in groups], None, config.chunk_numel)
        self.model = model
        self.phase = Phase.WARMUP
        self.steps = 0
        self.transfers = TransferStats()
        planning = config.planning()  # the options the planner reads (memsched.planning.planner)
        installed = self._installed = Installed(model, [p for g in groups for p in g["params"]] + frozen)
        tdev = self.device.torch_device
        # One rank: frozen parameters in chunks of their own; with more ranks each keeps its own copy.
        frozen = frozen if self.dp.world == 1 else []
        chunked = {id(p) for g in groups for p in g["params"]} | {id(p) for p in frozen}
        meta = self._meta
        for p in meta:
            if id(p) not in chunked:
                raise ValueError("a frozen parameter built on the meta device stays out of memsched's "
                                 f"chunks with {self.dp.world} ranks (shape {tuple(p.shape)}): materialise "
                                 "it before memsched.attach")
        packed = [[p.numel() for p in g["params"]] for g in groups] + ([[p.numel() for p in frozen]]
                                                                        if frozen else [])

        # ---- the stand-in device's accounting starts before any device buffer is made ---------------------
        self.sim: SimDevice | None = SimDevice(self.device.capacity_bytes) if self.device.is_sim else None
        installed.track(sim=self.sim)
        trainable = {id(p) for g in groups for p in g["params"]} | {id(p) for p in frozen}  # chunk views
        try:
            if self.sim is not None:
                # Model data made before attach (buffers, parameters kept out of chunks) is resident on the
                # stand-in.
                self.sim.start([t for t in (*model.parameters(), *model.buffers()) if id(t) not in trainable])
            alloc = Allocator(tdev, host_context=self.sim.paused if self.sim is not None else None)
            self.dp.prepare_build([g["params"] for g in groups], chunk_numel, self.device, alloc,
                                  self.compute_dtype)
            initial = DEVICE if self.device.kind == "cpu" else HOST
            # [Note: parameters on the host in warmup] A model whose parameters take much of the device is
            # traced with every chunk's parameters on the host, each fetched for its reads (nothing is known
            # yet to plan from): its chunks are built, given their host state and sent away one at a time.
            self.warmup_params_on_host = self.dp.world == 1 and initial == HOST and warmup_params_on_host(
                self.config.placement.policy.name, dict(self.config.placement.policy.options),
                self.device.capacity_bytes, sum(map(sum, packed)) * self.compute_dtype.itemsize)
            if self.warmup_params_on_host and alloc.pin:  # checked before anything is pinned
                layout = build_layout(packed, chunk_numel=chunk_numel, align=self.dp.align, exact=True)
                check_host_room(layout, planning, alloc, frozen_group=len(groups) if frozen else None,
                                frozen_on_host=True, host_views=reads_host_memory(tdev, pinned=alloc.pin))

            def away(store: ChunkStore, c: Any) -> None:  # built: its host state, its parameters leave
                c.init_state(HOST, alloc)
                store.note_placements()
                store.bindings.data_leaves(c)

            self.store = ChunkStore([g["params"] for g in groups], alloc, compute_dtype=self.compute_dtype,
                                    chunk_numel=chunk_numel, dp=self.dp, private_grads=bool(config.overlap),
                                    after_chunk=away if self.warmup_params_on_host else None, frozen=frozen,
                                    before_host_write=weak_method(self._wait_worker),
                                    before_device_read=weak_method(self._wait_h2d))
            # Frozen parameters and buffers go to the device too (trainable ones already are chunk views, or
            # host views when their parameters are on the host: those stay).
            model._apply(lambda t: t if t.device == tdev or id(t) in trainable
                         or self.store.in_host_memory(t) else t.to(tdev))
            self.dp.broadcast_model(model, self.store)  # rank 0's parameters everywhere
            self.dp.shard(self.store)  # each chunk's own shard
            if initial == HOST and alloc.pin and not self.warmup_params_on_host:  # before pinning
                check_host_room(self.store.layout, planning, alloc, shard_numel=None if self.store.exact
                                else max(c.hi - c.lo for c in self.store.chunks),
                                frozen_group=len(groups) if frozen else None,
                                host_views=self.store.lean_params)
            for c in self.store.chunks:
                if c.placement is None:  # a frozen chunk whose values stay has nothing to keep on the host
                    c.init_state(DEVICE if c.frozen else initial, alloc)
            self.store.note_placements()
        except BaseException:
            if self.sim is not None:
                self.sim.stop()
            raise
        self.names = {id(p): n for n, p in model.named_parameters()}
        if meta:  # refused at the first forward and step until given values ([Note: models built on meta])
            self._meta_born = MetaBorn(meta, weak_method(self._param_values), self.names)
            installed.add_handle(model.register_forward_pre_hook(weak_method(self._check_meta_forward)))
        self.streams = Streams(tdev, self.device.link_bytes_per_s)  # the stand-in's link: copy threads
        # One rank: host chunks' gradients go to the host as backward completes them (the first observer of
        # the store, before the optimizer's updates during backward).
        self.grad_offload = GradOffload(self.store, weak_method(self._start_grad_d2h),
                                        weak_method(self._wait_worker))
        self.scaler = LossScaler(tdev) if self.compute_dtype == torch.float16 else None
        self.optimizer = HybridAdamW(
            self.store, groups, defaults=config.adamw.defaults, streams=self.streams,
            transfers=self.transfers, scaler=self.scaler,
            capacity_check=self.sim.require if self.sim is not None else None, names=self.names,
            dp=self.dp, owner_thread=threading.get_ident(), grad_offload=self.grad_offload,
            update_threads=config.update_threads)
        self.store.backward.observe_grads_ready(self.optimizer.grads_ready)
        if meta:
            installed.add_handle(self.optimizer.register_step_pre_hook(weak_method(self._check_meta_step)))
        self.optimizer.checks.frozen_given = config.adamw.frozen_given
        self.streams.trace_to(self.optimizer.timeline)
        # Parameters that live on the host come to the device for their reads (one rank, not on the CPU);
        self.params: ParamFetcher | None = None
        # ZeRO-3: the same fetcher, whose chunks away keep this rank's shard and are all-gathered back
        shards = ParamShards(self.dp.comm, self.store) if getattr(self.dp, "shards_params", False) else None
        if (self.dp.world == 1 and self.device.kind != "cpu") or shards is not None:
            updates = self.optimizer.host_updates
            self.params = ParamFetcher(model, self.store, self.streams, self.transfers,
                                       lambda i: updates.wait([i]), updates.ready, shards=shards,
                                       on_move=self.sim.move if self.sim is not None else None)
            if shards is None:
                self.store.bindings.fetch_with(weak_method(self.params.fetch_between))
        self.planner = Planner(planning, model, self.store, self.dp, self.transfers,
                               self.optimizer.wait_updates, params=self.params,
                               # no reference back to the scheduler (close() frees it at once)
                               link_bytes_per_s=functools.partial(self.streams.link_bytes_per_s,
                                                                  self.store.alloc))
        self.warmup = WarmupTrace(model, self.optimizer, self.device, host_memory=self.store.in_host_memory)
        # The end of warmup runs as a global optimizer step post-hook: it fires after the optimizer's own
        # post-hooks (the tracer's among them), so the tracer sees the whole last warmup step and its hooks
        # can be removed without mutating the dict torch is iterating.
        installed.add_handle(register_optimizer_step_post_hook(weak_method(self._global_post_hook)))
        installed.add_handle(model.register_state_dict_post_hook(own_storage_entries))
        for handle in self.dp.watch_model(model):  # a pipeline stage's reductions wait for the step
            installed.add_handle(handle)
        kinds = {(self.compute_dtype, tdev)}  # every chunked parameter reads as this, wherever it lives
        installed.add_handle(MoveGuard(model, lambda: kinds))  # model.cpu() etc. refused at the move
        self._waits_forced = False  # _install_h2d_waits: the waits stay whatever the plan
        self.waits = H2DWaits(model, self.store, self.streams, self.optimizer.host_updates,
                              self.optimizer.timeline, drain_after_forward=self.dp.world > 1,
                              needed=self.streams.asynchronous or config.overlap, fetcher=self.params)
        installed.track(store=self.store, optimizer=self.optimizer, waits=self.waits, warmup=self.warmup,
                        streams=self.streams, params=self.params)
        # A scheduler dropped without close() (an exception escaped the training function) cleans up when it
        # is garbage-collected: nothing it installed outlives it.
        self._finalizer = weakref.finalize(self, installed.remove)
        self.waits.install(())
        self.optimizer.timeline.start()  # warmup steps are recorded too: the cost model reads the last one
        self.elastic: Elastic | None = None
        if config.replan == "auto" and self.device.kind != "cpu":
            probe = PeakProbe(self.device.torch_device, self.sim, weak_method(self._planned_absent_bytes),
                              moving=self.params.residency if self.params is not None else None)
            self.elastic = Elastic(weak_method(self._replan), self.dp.agree_max, probe, world=self.dp.world)
            hooks = install_elastic_hooks(model, self.elastic, self.optimizer.observe_zero_grad,
                                          weak_method(self._explain_oom))
            for h in hooks:
                installed.add_handle(h)
        if self.sim is not None:  # an out-of-memory error says why where it fails
            self.sim.explain = weak_method(self._explain_oom)
        try:
            self.warmup.start()
            if self.params is not None:  # the warmup's reads, for the plan's fetch schedule
                self.params.install()
                self.params.record(self.warmup.sample_count, classify=self.warmup.classify_parameter)
                if self.warmup_params_on_host:
                    self.params.use(range(len(self.store.chunks)), None)
        except BaseException:  # e.g. another tracer is attached to this model: leave no hooks or modes behind
            self.close()
            raise
        ATTACHED.add(model)

    # ---- the components' state, read through the facade --------------------------------------------------
    @property
    def policy(self) -> policies.Policy:
        """The placement policy (:mod:`policies`)."""
        return self.planner.policy

    @property
    def plan(self) -> PlacementPlan | None:
        """The :class:`policies.PlacementPlan` in force; ``None`` until there is one."""
        return self.planner.plan

    @property
    def problem(self) -> policies.PlacementProblem | None:
        """The :class:`policies.PlacementProblem` the plan in force solved; ``None`` until warmup ends."""
        return self.planner.problem

    def host_usage(self) -> HostUsage:
        """Host memory now against the plan: pinned bytes planned and held (and their peak), the process's
        resident set size and its peak, and the trainable parameters for bytes per parameter
        (:class:`memsched.telemetry.host_usage.HostUsage`, bytes)."""
        plan = self.plan
        return host_usage(self.device.torch_device, plan.host_bytes if plan is not None else None,
                          sum(p.numel() for p in self.store.params()))

    @property
    def plan_error(self) -> Exception | None:
        """The :class:`policies.PlacementError` of the end of warmup, or ``None``."""
        return self.planner.plan_error

    @property
    def plan_history(self) -> list[PlanChange]:
        """The end-of-warmup plan, then each re-plan (:class:`memsched.planning.elastic.PlanChange`)."""
        return self.planner.history

    @property
    def warmup_costs(self) -> WarmupCosts | None:
        """The last warmup step's measurements (:mod:`memsched.planning.cost_model`), or ``None``."""
        return self.planner.warmup_costs

    @property
    def predicted_step(self) -> dict[str, Any] | None:
        """The modelled step of the plan in force (:mod:`memsched.planning.cost_model`), or ``None``."""
        return self.planner.predicted_step

    @property
    def timeline(self) -> Any:
        """The warmup trace (:class:`tracer.MemoryTimeline`); ``None`` until warmup ends."""
        return self.warmup.timeline

    @property
    def _tracer(self) -> Any:
        return self.warmup.tracer

    @property
    def in_warmup(self) -> bool:
        return self.phase is Phase.WARMUP

    def traced_modules(self) -> list[str]:
        """Qualified names of the modules whose forward ran in the warmup trace, in first-call order; empty
        before the trace exists."""
        return self.warmup.traced_modules()

    def first_use_order(self) -> list[torch.nn.Parameter]:
        """The parameters in chunks in first-use order from the warmup trace
        (:mod:`memsched.planning.first_use`): the trainable ones, then the frozen ones; empty before the trace
        exists."""
        return self.warmup.first_use_order(list(self.store.params())) + (
            self.warmup.first_use_order(self.store.frozen) if self.store.frozen else [])

    def peak_non_model_bytes(self) -> int:
        """Peak non-model data of the warmup trace on the compute device, bytes."""
        return self.warmup.peak_non_model_bytes()

    def host_grad_working_bytes(self) -> int:
        """What the host chunks' gradients on their way to the host add to the peak of non-model data, bytes:
        the warmup trace's peak of non-model data and gradients less its peak of non-model data (one rank:
        every chunk was on the host in warmup, so every gradient left the device as backward completed it);
        0 when gradients are not offloaded."""
        if self.store.offloader is None or not self.store.lazy_grads:
            return 0
        return max(0, self.warmup.peak_non_model_grad_bytes() - self.warmup.peak_non_model_bytes())

    # ---- the end of each step, and of warmup --------------------------------------------------------------
    def _global_post_hook(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if optimizer is self.optimizer:
            self._after_step()

    def _after_step(self) -> None:
        """[Note: the end of warmup]
        Inside the last warmup ``step()``, after its update: the tracer stops first (the trace is complete),
        the last step's record gives the cost model its measurements (every chunk was updated on the host),
        then the chunks are re-packed in first-use order, the H2D waits re-installed for that packing, and
        the plan made and applied. Only then does the optimizer enter its steady state (overlap, early D2H,
        updates during backward): none of them may run while chunks move."""
        self.steps += 1
        self.waits.release_kept_guard()  # [Note: reads outside the forward]
        self.optimizer.timeline.step_end(self.steps)
        if self.elastic is not None:
            self.elastic.after_step()
        if self.phase is not Phase.WARMUP:
            self._revise_fetches()
            self._refresh_waits()
            self.waits.guard_between_steps()  # [Note: reads between steps wait]
            return
        if self.steps < self.warmup_steps:
            if self.params is not None and self.params.recorder.on:
                self.params.recorder.restart()  # the last warmup step's reads make the schedule
            return
        reads = self.params.stop_recording() if self.params is not None else []
        self.warmup.stop()
        last = self.optimizer.timeline.take_last()
        if last is not None:
            host = sum(c.hi - c.lo for c in self.store.trainable_chunks if c.placement == HOST)
            meta = self.timeline.meta if self.timeline is not None else {}
            flops = int(meta.get("flops", 0)) // max(1, int(meta.get("steps", 1) or 1))
            self.planner.measure_warmup(WarmupCosts.from_record(last, host, flops))
        self.phase = Phase.PLAN_FAILED  # until the plan is applied
        # with the parameters on the host in warmup, each new chunk's leave the device as it is built
        away = (lambda store, c: store.bindings.data_leaves(c)) if self.warmup_params_on_host else None
        if self.params is not None:
            self.params.evict_all()
        self.planner.repack(self.first_use_order(), after_chunk=away)
        if self.params is not None:
            self.params.repacked()
        self.optimizer.record_param_versions()
        self.waits.install(self.traced_modules())
        self.planner.plan_initial(self.peak_non_model_bytes(), self.timeline, self.steps,
                                  host_grad_working_bytes=self.host_grad_working_bytes(), reads=reads)
        if self.elastic is not None and self.problem is not None:
            self.elastic.start(self.problem.peak_non_model_bytes,
                               discount=self.planner.host_grad_working_bytes)
        self._refresh_waits()
        self._check_plan()
        self.phase = Phase.PLANNED
        # Host chunks' gradients go D2H during backward (checked at the step) on CUDA, where the copy engine
        # overlaps it with backward; elsewhere copies are synchronous and it would only cost. Not under ZeRO
        # (the reduction comes first).
        plan = self.plan
        self.optimizer.enter_steady_state(overlap=self.config.overlap, early_update=self.config.early_update,
                                          speculative=plan.speculative if plan is not None else (),
                                          streamed=plan.streamed if plan is not None else ())

    def _check_plan(self) -> None:
        """``attach(expected_plan=...)``: the warmup's plan against ``memsched plan``'s (issue 30); warns with
        the differences."""
        expected = self.config.expected_plan
        if expected is None or self.plan is None or self.problem is None:
            return
        self.plan_check = check_plan(
            expected, self.plan, capacity_bytes=self.problem.capacity_bytes,
            peak_non_model_bytes=self.peak_non_model_bytes(), chunk_numel=self.store.layout.chunk_numel,
            chunk_count=len(self.store.chunks), total_numel=self.store.layout.total_numel)
        if not self.plan_check.agrees:
            warnings.warn(f"memsched: {self.plan_check.summary()}", RuntimeWarning, stacklevel=2)

    def _revise_fetches(self) -> None:
        """After a step some of whose parameter reads were off the schedule (a branch taken since the trace):
        the next step records its reads, and the plan is made again from them
        (:meth:`memsched.planning.planner.Planner.revise`). Each miss was fetched on demand meanwhile."""
        fetcher = self.params
        if fetcher is None or self.phase is not Phase.PLANNED:
            return
        if fetcher.recorder.on:
            self.planner.revise(fetcher.stop_recording(), self.steps)
            self._follow_speculation()
            return
        # ZeRO-3: every rank records and revises at the same step (a revision compares the ranks' schedules)
        missed = self.dp.agree_max([fetcher.misses])[0] if self.dp.world > 1 else fetcher.misses
        if missed and fetcher.offloaded:
            fetcher.record(lambda: 0)  # in order; the bytes come from the plan in force

    def _planned_absent_bytes(self) -> int:
        """What the plan counts apart from the measured peak that is not on the device now, bytes (the elastic
        peak probe's base; see [Note: gradients in the measured peak]): the device chunks' absent gradient
        buffers and the host chunks' gradient working set."""
        return self.store.grads.absent_bytes() + self.planner.host_grad_working_bytes

    def _start_grad_d2h(self, c: Any, dst: torch.Tensor) -> int:
        """Start the D2H copy of host chunk ``c``'s gradients into ``dst``
        (:mod:`memsched.chunks.grad_offload`); returns the bytes."""
        with self.store.alloc.host_context():
            nbytes = c.start_d2h(self.streams, dst=dst)
        self.transfers.add_d2h(nbytes)
        return nbytes

    def _wait_h2d(self, c: Any) -> None:
        """The current stream waits for ``c``'s H2D copy of its updated values (the stand-in's link:
        blocks)."""
        self.streams.wait([c.h2d_event], f"zero_grad() <- chunk {c.index}")

    def _wait_worker(self, c: Any) -> None:
        """Block until the overlapped CPU update no longer reads chunk ``c``'s host buffers."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            optimizer.host_updates.wait([c.index])
            optimizer.early_updates.wait_refill(c.index)
            optimizer.streamed.wait()  # the streamed updates' D2H copies into the host state

    def _explain_oom(self, exc: BaseException) -> str | None:
        """Why the step in progress ran out of memory, when memsched knows: a warmup step, from the device's
        bytes at the failure (:func:`memsched.runtime.warmup_oom.warmup_oom_message`: the hint that would
        help, or what is too big), or inputs that do not fit with everything already on the host
        (:func:`memsched.runtime.elastic_hooks.unfittable_message`)."""
        if self.phase is Phase.WARMUP and self.dp.world == 1 and self.device.kind != "cpu":
            return self._explain_warmup_oom(exc)
        if self.elastic is None:
            return None
        sig = self.elastic.in_progress or self.elastic.failed  # failed: after on_oom()
        return unfittable_message(self.elastic, self.planner, sig, exc)

    def _explain_warmup_oom(self, exc: BaseException) -> str | None:
        """The warmup's out-of-memory explanation from what the device holds now (the failed step's tensors
        are still held by the exception's frames)."""
        dev = self.device.torch_device
        if self.sim is not None:
            from memsched.devices import sim_backend

            in_use = sim_backend.memory_allocated()
        elif dev.type == "cuda":
            in_use = torch.cuda.memory_allocated(dev)
        else:
            return None
        chunked = {id(p) for p in self.store.all_params()}
        frozen = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers())
                     if id(t) not in chunked and t.device == dev)
        chunks = self.store.chunks
        requested = oom_bytes(exc)[0] or 0
        # a chunk's gradient buffer that failed to allocate is gradients, not the step's activations
        grads = sum(c.data_bytes for c in chunks if c.grad is not None)
        grads += requested if getattr(exc, "memsched_gradient_buffer", None) else 0
        return warmup_oom_message(
            capacity=self.device.capacity_bytes, in_use=in_use, requested=requested,
            chunk_params_on_device=sum(c.data_bytes for c in chunks if c.data is not None),
            chunk_grads_on_device=grads,
            frozen_and_buffers=frozen, largest_chunk=max((c.data_bytes for c in chunks), default=0),
            policy=self.config.placement.policy.name, params_on_host=self.warmup_params_on_host)

    def _replan(self, peak: int | None, reason: str) -> None:
        """Elastic placement's re-plan (:meth:`memsched.planning.planner.Planner.replan`)."""
        self.planner.replan(peak, reason, self.steps)
        self._follow_speculation()

    def _follow_speculation(self) -> None:
        """After a re-plan: the spare host states follow the plan's speculating chunks, and the streamed
        updates its streamed chunks."""
        if self.plan is not None:
            self.optimizer.early_updates.choose(self.store.trainable_chunks, self.plan.speculative)
            self.optimizer.streamed.chunks = frozenset(self.plan.streamed)

    @property
    def zero(self) -> Any:
        """The :class:`memsched.distributed.ZeroEngine` when there is more than one rank, else ``None`` (the
        data parallelism itself is :attr:`dp` at every world size)."""
        return self.dp if self.dp.world > 1 else None

    @property
    def step_timeline(self) -> StepTimeline:
        """The last steps' time spans after warmup (:class:`memsched.telemetry.step_timeline.StepTimeline`):
        ``.records``, ``.summaries()``, ``.mean_summary()``, ``.to_perfetto_events()``."""
        return self.optimizer.timeline

    def _install_h2d_waits(self) -> None:
        """(Re)install the H2D wait hooks for the trace so far (:class:`memsched.runtime.waits.H2DWaits`),
        also where copies are synchronous (tests check where the waits are); they stay."""
        self._waits_forced = True
        self.waits.install(self.traced_modules(), needed=True)

    def _refresh_waits(self) -> None:
        """Waits only where a forward can meet a copy in flight ([Note: waits only where a copy can be in
        flight] in :mod:`memsched.runtime.waits`): an overlapped update, or asynchronous copies (CUDA, the
        stand-in's link) with a chunk on the host or more ranks."""
        needed = bool(self.config.overlap) or self._waits_forced or (self.streams.asynchronous and (
            self.dp.world > 1 or any(c.placement == HOST for c in self.store.chunks)))
        self.waits.refresh(self.traced_modules, needed=needed)

    def synchronize(self) -> None:
        """Wait for every pending update of the parameters: the overlapped CPU update (``overlap=True``; the
        host blocks), the H2D copies (CUDA; the current stream waits) and, with ``overlap="backward"``, the
        worker's copies into the spare host states (:mod:`memsched.optim.early_update`). Only reads from
        another thread need it: on the training thread a read between an overlapped step and the next
        forward waits for its chunk ([Note: reads between steps wait] in :mod:`memsched.runtime.waits`), and
        forwards,
        ``model.state_dict()``, ``model.load_state_dict()``, the optimizer's ``step()``/``state_dict()`` and
        ``close()`` wait by themselves.

        Raises:
            memsched.optim.host_updates.OverlapError: the overlapped update failed.
        """
        self.waits.synchronize()
        self.optimizer.early_updates.wait()

    # ---- training API -------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``; under fp16 the loss is multiplied by the dynamic loss scale first."""
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)
        try:
            loss.backward(**kwargs)
            if self.scaler is not None:
                self.optimizer.note_scaled_backward()
        except OUT_OF_MEMORY as e:
            add_oom_numbers(e, self.device.torch_device)  # CUDA's get the numbers the stand-in's carry
            if self.elastic is not None:
                # nothing was updated; the next step makes room (memsched.planning.elastic)
                self.elastic.on_oom()
            explain_oom(e, self._explain_oom(e))
            raise

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        norms_from_backward: bool = True) -> torch.Tensor:
        """Clip the gradients of the trainable parameters to a total norm of ``max_norm``, exactly as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)`` would on one process (with
        data parallelism: over the averaged gradients); returns the total norm before clipping.

        Under fp16 the gradients hold the loss scale: the norm is that of the fp32 unscaled gradients and the
        coefficient is applied in fp32 at the step, as with ``GradScaler.unscale_`` then ``clip_grad_norm_``
        (see :meth:`HybridAdamW.clip_grad_norm_`). Clipping with torch directly is exact too (fp32, bf16),
        except under fp16, where torch would clip the scaled gradients.

        The host chunks' per-tensor norms are taken on the device in backward, so the clip copies no host
        gradients back, unless those gradients changed since: any in-place torch op on them is seen ([Note:
        norms taken in backward] in :mod:`memsched.optim.clipping`). Code that writes gradients in ways
        torch's version counters do not see (``p.grad.data``, DLPack, raw pointers) between backward and the
        clip passes ``norms_from_backward=False``: the norms are then those of the gradients as they are.
        """
        chunked = self.store.param_chunk
        params = [p for p in self.model.parameters() if id(p) in chunked]
        scaled = self.scaler is not None and self.optimizer.scaled_grads_unchanged()
        norm = self.dp.clip_grad_norm_(lambda: self.optimizer.clip_grad_norm_(
            params, max_norm, norm_type, norms_from_backward=norms_from_backward))
        if scaled:  # the gradient reductions it finished wrote the buffers: still sched.backward's gradients
            self.optimizer.note_scaled_backward()
        return norm

    def no_sync(self) -> contextlib.AbstractContextManager:
        """[zero] Gradient accumulation: backward inside the context does not reduce gradients over the ranks;
        the next backward outside it (or the step) does, once (like DDP's ``no_sync``). A no-op with one rank.
        See :mod:`memsched.distributed.engine` for the memory cost."""
        return self.dp.no_sync()

    @contextlib.contextmanager
    def gathered_params(self) -> Iterator[None]:
        """[zero] ZeRO-3: every parameter whole on every rank inside the context, to read or write them
        between steps (``model.state_dict()``, an EMA, ``model.load_state_dict``, logging a weight). A
        collective: every rank enters it, at the same point. On leaving, this rank's part of what was written
        is kept in its shard and the chunks the schedule does not keep are sharded again. Nested contexts
        gather once. Outside it, a read of a sharded parameter between steps raises
        :class:`memsched.distributed.sharded_params.ShardedParamError`. A no-op below stage 3 and with one
        rank. DeepSpeed's ``GatheredParameters`` and FSDP's ``summon_full_params`` do the same.

        Raises:
            RuntimeError: entered while a step computes (between a forward and the end of its backward).
        """
        fetcher = self.params
        if fetcher is None or fetcher.shards is None:
            yield
            return
        if self.store.bindings.computing:
            raise RuntimeError("memsched: gathered_params() is for between steps; a forward's and its "
                               "backward's reads gather their chunks themselves")
        fetcher.hold()
        try:
            yield
        finally:
            fetcher.unhold()

    @property
    def transfers_dict(self) -> dict[str, int]:
        return self.transfers.as_dict()

    def report(self, **kwargs: Any) -> Any:
        """Render the memory report (timeline + plan + transfer volumes) with :mod:`memsched.report.text`."""
        from memsched.report.text import render_report

        if self.timeline is None:
            raise ValueError("no timeline yet: the report is available after the warmup steps")
        kwargs.setdefault("step_summary", self.step_timeline.mean_summary())
        kwargs.setdefault("plan_history", self.plan_history)
        kwargs.setdefault("problem", self.problem)
        kwargs.setdefault("plan_check", self.plan_check)
        kwargs.setdefault("predicted_step", self.predicted_step)
        return render_report(self.timeline, plan=self.plan, transfers=self.transfers.as_dict(), **kwargs)

    def _param_values(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s values now, flat, wherever its chunk keeps them (this rank's part with ZeRO-3)."""
        store = self.store
        c = store.param_chunk[id(p)]
        off, n = store.param_range[id(p)]
        if c.data is not None and not store.bindings.host_bound(c):
            return c.data[off:off + n]
        settle(c.device)  # written through device-typed host views by kernels in flight
        a, b = max(off, c.lo), min(off + n, c.hi)  # empty where this rank's shard holds none of it
        return store.values(c)[a - c.lo:max(a, b) - c.lo]

    def _check_meta_forward(self, _module: torch.nn.Module, _args: Any) -> None:
        self._meta_born.check("the model's forward")

    def _check_meta_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._meta_born.check("the optimizer step")

    def close(self) -> None:
        """Stop tracing and the stand-in's accounting and remove memsched's hooks (idempotent). Parameters
        stay views into the chunks and the optimizer keeps working (without the early D2H)."""
        if self.phase is Phase.CLOSED:
            return
        self.phase = Phase.CLOSED
        try:
            for c in self.store.chunks:  # a read right after close() must see the updated parameters
                c.wait_h2d()
                c.wait_d2h()
            deferred = getattr(self.dp, "deferred", None)  # a pipeline stage's marked gradients: unmarked
            if deferred is not None:
                deferred.disarm()
            self.warmup.stop()  # keeps the warmup timeline
        finally:
            self._finalizer()  # removes everything else (memsched.teardown.Installed.remove)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def forward_root(model: torch.nn.Module) -> torch.nn.Module:
    """The module memsched attaches to: ``model``, or the model a wrapper runs in all its entry points.

    PEFT's ``PeftModel`` is such a wrapper: its ``forward`` and its ``generate()`` both run the forward of
    ``get_base_model()``, which holds the same parameters and buffers. ``generate()`` never calls the
    wrapper's own forward, so hooks there would not fetch the chunks away for it. A wrapper is taken only
    when its ``get_base_model()`` returns a submodule with exactly its parameters and buffers; anything else
    is attached as given.
    """
    get = getattr(model, "get_base_model", None)
    inner = get() if callable(get) else None
    if not isinstance(inner, torch.nn.Module) or inner is model:
        return model
    same = ({id(p) for p in inner.parameters()} == {id(p) for p in model.parameters()}
            and {id(b) for b in inner.buffers()} == {id(b) for b in model.buffers()})
    return inner if same else model


def attach(model: torch.nn.Module, policy: str = "auto", gpu_margin_mem_ratio: float = 0.8,
           device: str | torch.device | None = None, warmup_steps: int = 1, lr: float = 1e-3,
           weight_decay: float = 1e-2, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
           params: Iterable[Any] | None = None, policy_options: dict[str, Any] | None = None,
           dtype: torch.dtype | None = None, chunk_numel: int | None = None, zero_stage: int = 1,
           process_group: Any = None, fetch: str = "all_gather", dist_timeout: float | None = None,
           collective_timeout: float | None = COLLECTIVE_TIMEOUT_S, chunk_build: str = "auto",
           overlap: bool | str = False, replan: str = "auto",
           host_memory: int | str | None = None,
           expected_plan: str | os.PathLike | Mapping[str, Any] | None = None,
           update_threads: int | None = None, host_update: str = "cpu") -> Scheduler:
    """Attach memsched to ``model``: chunks, a hybrid CPU/device AdamW, warmup tracing, one placement plan.

    Args:
        model: the model; its parameters become views into chunks on the compute device (with one rank the
            frozen ones of the compute dtype too, in chunks of their own; buffers and other frozen
            parameters are moved there). A PEFT ``PeftModel`` is attached through the model it wraps
            (:func:`forward_root`; ``sched.model`` is that one).
        policy: placement policy name (``policies.names()``: ``auto``, ``cpu``, ``cuda``, ``static``, ...).
        gpu_margin_mem_ratio: share of the GPU margin the policy may fill, in [0, 1].
        device: ``None`` (CUDA if present, else the CPU, see :mod:`memsched.scheduler`), ``"cuda"``,
            ``"cuda:1"``, ``"cpu"`` or the stand-in ``"sim:8GiB"``.
        warmup_steps: optimizer steps traced before planning (>= 1).
        lr, weight_decay, betas, eps: AdamW hyper-parameters (defaults for every group), defaulting to
            ``torch.optim.AdamW``'s (``lr=1e-3``, ``weight_decay=1e-2``), so replacing that optimizer with
            ``attach`` keeps the training the same.
        params: parameters or param-group dicts (per-group ``lr``/``betas``/``eps``/``weight_decay``); default
            all of ``model.parameters()``.
        policy_options: options of the policy (see ``memsched policies``).
        dtype: ``None``/``torch.float32`` (fp32), ``torch.bfloat16`` or ``torch.float16`` (compute in that
            dtype with fp32 master weights; fp16 adds dynamic loss scaling in :meth:`Scheduler.backward`).
            The parameters become that dtype, so floating-point inputs must be cast to it too.
        chunk_numel: chunk size (elements) instead of the searched one.
        zero_stage: with ``torch.distributed`` initialised and more than one rank: 0 (plain data parallel), 1
            (optimizer state sharded evenly over the ranks), 2 (gradients reduce-scattered too) or 3
            (parameters sharded too, all-gathered for their reads); see :mod:`memsched.distributed.engine`.
            Ignored with one rank.
        process_group: the data-parallel group; ``None`` = the default group.
        fetch: how updated shards reach every rank: ``"all_gather"`` or ``"all_reduce"``.
        dist_timeout: seconds the attach barrier waits for every rank (``None``: the group's timeout).
        collective_timeout: seconds any rank waits for one collective during training (default 60;
            ``None``: the process group's timeout, 30 minutes unless set). A rank that runs other modules than
            its peers (a rank-dependent branch, evaluation on rank 0 only) or that died then raises
            :class:`memsched.distributed.ZeroCommError` naming those causes instead of hanging. Raise it for
            a collective that legitimately takes longer (a very slow network).
        chunk_build: with ZeRO, where chunks are built: ``"auto"`` (on the device while it has room for a full
            copy, else on the CPU, per chunk), ``"device"`` or ``"cpu"``; see
            :mod:`memsched.distributed.build`.
        overlap: after warmup, ``optimizer.step()`` returns once the device chunks are updated; the host
            chunks are updated on a CPU worker thread while the next forward runs, each module waiting only
            for its own chunks (:mod:`memsched.optim.host_updates`). Bit-identical to the serial step.
            ``"backward"``: also each host chunk's update starts during backward, as soon as its gradients are
            complete, into a spare host state that ``step()`` swaps in when it equals the step's own update
            (:mod:`memsched.optim.early_update`; one rank; costs a second host copy of the state of the host
            chunks that speculate, which the plan chooses within the host budget:
            :mod:`policies.speculation`).
        host_update: where host chunks' optimizer updates run: ``"cpu"`` (default: where their state is),
            ``"device"`` (their state is streamed to the device in pieces, updated by the device's fused
            AdamW, and streamed back; one rank, chunks whose parameters live on the device) or ``"auto"``
            (per chunk, whichever the plan finds faster from the warmup's CPU update rate and the link's
            bandwidth; :mod:`policies.update_paths`). The plan's reasons say which chunks stream and why.
        update_threads: the intra-op threads of the CPU worker that updates host chunks beside the forward or
            backward (``overlap``), an integer >= 1; ``None``: all of torch's but two on CUDA, half of them
            where the compute runs on the CPU (the stand-in, ``device="cpu"``). The training thread keeps its
            own count ([Note: the update worker's threads] in :mod:`memsched.optim.host_updates`).
        replan: ``"auto"`` (default): after warmup the plan follows the inputs' shapes and out-of-memory
            errors, re-planned before the forward that needs it (:mod:`memsched.planning.elastic`; the changes
            are in ``sched.plan_history``); ``"off"``: the warmup plan stays. Nothing to plan on
            ``device="cpu"``.
        host_memory: the host memory memsched's pinned chunks may take, bytes or a size (``"64GiB"``); the
            plan's host budget is the smallest of this, the memory available to the process and the
            stand-in's ``host=`` (:mod:`memsched.devices.host_memory`). ``None``: no limit of its own.
        expected_plan: the output of ``memsched plan --json`` for this run (a path, or the parsed dict): the
            plan made after warmup is compared with it (:mod:`memsched.planning.plan_check`): capacity, peak
            non-model data within the prediction's error bar, chunks and placements. The result is
            ``sched.plan_check`` and a report section; a difference also warns (``RuntimeWarning``) with
            each difference and its likely cause.

    Returns:
        the :class:`Scheduler`; train with ``sched.backward(loss); sched.optimizer.step();
        sched.optimizer.zero_grad()``. Use it as a context manager (or call ``close()``) to stop the
        stand-in's accounting and remove hooks.

    Raises:
        ValueError: a ratio outside [0, 1] or NaN, an unknown policy or option (lists the known ones), an
            ``expected_plan`` that is not ``memsched plan --json``'s output for one workload, no
            trainable parameters, parameters on the meta device, a bad device string, ``warmup_steps < 1``, a
            bad dtype or hyper-parameter, a ``chunk_numel`` below the largest parameter.
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: memsched (or a :class:`tracer.MemoryTracer`) is already attached to ``model``.
        memsched.devices.simdevice.SimOutOfMemoryError: the stand-in cannot even hold the chunk buffers.
        ValueError (ZeRO): a ``zero_stage``, ``fetch`` or ``chunk_build`` not among the allowed values.
        memsched.distributed.ZeroCommError: another rank did not reach attach within ``dist_timeout``, or
            (during training) a collective did not complete within ``collective_timeout``.
    """
    model = forward_root(model)
    return Scheduler(model, make_config(
        model, policy=policy, gpu_margin_mem_ratio=gpu_margin_mem_ratio, device=device,
        warmup_steps=warmup_steps, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, params=params,
        policy_options=policy_options, dtype=dtype, chunk_numel=chunk_numel, zero_stage=zero_stage,
        process_group=process_group, fetch=fetch, dist_timeout=dist_timeout,
        collective_timeout=collective_timeout, chunk_build=chunk_build,
        overlap=overlap, replan=replan, host_memory=host_memory, expected_plan=expected_plan,
        update_threads=update_threads, host_update=host_update))
