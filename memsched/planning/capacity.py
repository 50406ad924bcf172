"""Capacity verdicts: plan a predicted step (:mod:`memsched.planning.prediction`) for a device size with every
built-in placement policy, and say whether it fits, fits only with offload, or does not fit."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import policies
from memsched.chunks import chunk_bytes
from memsched.chunks.sizing import stream_piece_numel, stream_staging_bytes
from memsched.models import count_parameters
from memsched.planning.prediction import Prediction
from memsched.planning.problem import (
    build_problem,
    layout_param_chunks,
    packed_groups,
    resident_extra_bytes,
)
from memsched.planning.reads import chunk_accesses, grad_working_bytes
from policies.types import PlacementPlan, PlacementProblem
from policies.units import format_bytes
from policies.update_paths import HOST_UPDATE_MODES, choose_update_paths, streaming_bytes

SCHEMA = "memsched.plan"
VERSION = 2  # 2: gradients placed with their chunk, parameters that may stay on the host, link bytes
VERDICTS = ("fits", "offload", "offload_params", "does_not_fit", "does_not_fit_host")
#: How far a GPU's peak non-model data may lie above the fake trace's prediction, as a share of it: a plan
#: whose device slack is smaller is "tight" (:func:`verdict`). ``tests/test_gpu_calibration.py`` holds
#: every committed GPU measurement within it (on an H200, GPT-2 355M fp32: 0.0004 % above).
PEAK_ERROR_BAR = 0.01


@dataclass
class CapacityPlan:
    """Plans of every policy for one device capacity.

    Attributes:
        problem: the placement problem (from :func:`memsched.planning.problem.build_problem`), with the
            traced step's chunk accesses (parameters may stay on the host).
        chunk_numel: the searched chunk size, elements (one rank: each chunk as long as what it holds, a
            larger parameter in a chunk of its own: ``problem.chunks[i].numel``); ``n_chunks``: number of
            chunks.
        model_data: bytes by category: ``parameter`` and ``gradient`` (the chunks' compute and gradient
            buffers, padding included), ``frozen`` (the compute buffers of the chunks of frozen
            parameters), ``optimizer_state`` (every chunk's optimizer state as it would be on the device:
            ``exp_avg``, ``exp_avg_sq``, the fp32 master under mixed precision, step counts), ``other``
            (buffers and the frozen parameters kept out of chunks); all bytes.
        plans: policy name -> :class:`PlacementPlan`, or the error message when the policy found no plan.
        padding: the chunks' padding (the elements past the last parameter of each chunk, allocated but
            holding no parameter): ``numel`` (elements) and the bytes it adds to ``parameter``, ``gradient``
            and ``optimizer_state`` of ``model_data``.
    """

    problem: PlacementProblem
    chunk_numel: int
    n_chunks: int
    model_data: dict[str, int]
    plans: dict[str, PlacementPlan | str]
    padding: dict[str, int] = field(default_factory=dict)


def plan_for_capacity(prediction: Prediction, capacity_bytes: int, *, gpu_margin_mem_ratio: float = 0.8,
                      policy_names: list[str] | None = None, world_size: int = 1,
                      zero_stage: int | None = None, host_capacity_bytes: int | None = None,
                      host_capacity_source: str | None = None) -> CapacityPlan:
    """Build the placement problem for ``capacity_bytes`` and plan it with each policy (default: all
    registered). With ``world_size`` > 1 and a ``zero_stage``, the problem is one rank's at that ZeRO stage
    (:func:`memsched.planning.problem.build_problem`), its batch the traced one, and the parameters stay on
    the device (memsched fetches host-placed parameters with one rank only). ``host_capacity_bytes``: the
    pinned host memory the plans may take (``None``: unlimited), named by ``host_capacity_source`` in a
    refusal; a plan over it is refused (:data:`policies.plans.HOST_SHORT`).

    The problem carries the predicted step's chunk accesses (:attr:`Prediction.reads` mapped to the chunks,
    :func:`memsched.planning.reads.chunk_accesses`), so a policy may keep parameters on the host when they do
    not fit. The trace is of plain torch, whose gradients all stay on the device: the gradients memsched
    has in flight to the host follow from the recorded gradient events ([Note: gradients in flight] in
    :mod:`memsched.planning.reads`), at each access and in the problem's ``host_grad_working_bytes``.

    Raises:
        ValueError: a ratio outside [0, 1] or a negative capacity (from :class:`PlacementProblem`), an unknown
            policy name (lists the known ones), a bad ``world_size`` or ``zero_stage``.
    """
    model = prediction.model
    dtype = prediction.dtype
    master = dtype != torch.float32
    order = prediction.param_order or None
    ranks = world_size > 1 and zero_stage is not None
    problem, layout = build_problem(model, prediction.peak_non_model_bytes, capacity_bytes,
                                    gpu_margin_mem_ratio=gpu_margin_mem_ratio, master_weights=master,
                                    param_order=order, compute_dtype=dtype, world_size=world_size,
                                    zero_stage=zero_stage, host_capacity_bytes=host_capacity_bytes,
                                    host_capacity_source=host_capacity_source,
                                    pinned=True)  # planned for a CUDA device: host state is pinned
    # The trace is of plain torch, whose gradients stay on the device; memsched's leave it chunk by chunk:
    # the gradients in flight follow from the recorded gradient events in this packing (memsched.planning.
    # reads), and so what they add to the peak.
    # one chunk's gradient buffer, the largest (as the runtime's planner counts it)
    grad_bytes = chunk_bytes(max(layout.numels), compute_dtype=dtype, master_weights=master).grad_bytes
    accesses: list[Any] = []
    if prediction.reads and not ranks:
        chunks = layout_param_chunks(model, layout, order, compute_dtype=dtype)
        accesses = chunk_accesses(prediction.reads, chunks, prediction.timeline, prediction.device,
                                  grad_bytes=grad_bytes)
        working = grad_working_bytes(prediction.reads, chunks, prediction.timeline, grad_bytes,
                                     prediction.device)
        if working is not None:
            problem = dataclasses.replace(problem, host_grad_working_bytes=working)
    problem = dataclasses.replace(problem, accesses=tuple(accesses))
    frozen = [c.frozen for c in problem.chunks]
    per_chunk = [chunk_bytes(numel, compute_dtype=dtype, master_weights=master, n_params=len(slots), frozen=f)
                 for slots, numel, f in zip(layout.chunks, layout.numels, frozen, strict=True)]
    packed = {id(p) for p in _chunked_params(model, order, dtype, world_size)}
    model_data = {
        "parameter": sum(c.compute_bytes for c, f in zip(per_chunk, frozen, strict=True) if not f),
        "frozen": sum(c.compute_bytes for c, f in zip(per_chunk, frozen, strict=True) if f),
        "gradient": sum(c.grad_bytes for c in per_chunk),
        "optimizer_state": sum(c.device_state_bytes for c in per_chunk),
        "other": resident_extra_bytes(model, [[p for p in model.parameters() if id(p) in packed]]),
    }
    # The same arithmetic over the padding elements alone (no parameters, so no step counts).
    pad = chunk_bytes(layout.waste_numel, compute_dtype=dtype, master_weights=master, n_params=0)
    padding = {"numel": layout.waste_numel, "parameter": pad.compute_bytes, "gradient": pad.grad_bytes,
               "optimizer_state": pad.device_state_bytes}
    plans: dict[str, PlacementPlan | str] = {}
    for name in policy_names if policy_names is not None else policies.names():
        policy = policies.get(name)  # unknown name: UnknownPolicyError (a ValueError) listing the known ones
        try:
            plans[name] = policy.plan(problem)
        except policies.PlacementError as e:
            plans[name] = str(e)
    return CapacityPlan(problem=problem, chunk_numel=layout.chunk_numel, n_chunks=layout.n_chunks,
                        model_data=model_data, plans=plans, padding=padding)


def _chunked_params(model: torch.nn.Module, order: Any, dtype: torch.dtype,
                    world_size: int) -> list[torch.nn.Parameter]:
    """The parameters :func:`build_problem` packs into chunks (trainable, and with one rank the frozen
    ones)."""
    groups, frozen = packed_groups(model, None, order, dtype, world_size)
    return [p for g in (*groups, frozen) for p in g]


def stream_link_bytes(problem: PlacementProblem) -> list[tuple[int, int]]:
    """Per chunk of a one-rank plan, the ``(H2D, D2H)`` bytes of its update streamed through the device
    (:func:`policies.update_paths.streaming_bytes`): its gradients went to the host in backward and come back
    with the state; it keeps no host copy of its parameters beside the master (fp32, or a lean chunk under
    mixed precision: [Note: lean host chunks])."""
    return [streaming_bytes(c.numel, c.param_bytes // max(1, c.numel), c.param_bytes // max(1, c.numel),
                            grads_on_host=True, host_param_copy=False) for c in problem.chunks]


def with_update_paths(cplan: CapacityPlan, policy: str, *, mode: str, dtype: torch.dtype,
                      cpu_elements_per_s: float | None, link_bytes_per_s: float | None,
                      rate_source: str = "--cpu-adam-rate", link_source: str = "") -> None:
    """``memsched plan --host-update``: ``policy``'s plan in ``cplan`` takes the update path of each host
    chunk (:func:`policies.update_paths.choose_update_paths`, as ``attach(host_update=mode)`` chooses after
    warmup) from the training host's CPU AdamW rate and the link's bandwidth (elements/s, bytes/s; ``None``:
    unknown; ``rate_source`` and ``link_source`` name their origins in the reason). A chunk whose parameters
    live on the host stays on the CPU. Nothing happens to a policy that found no plan.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in HOST_UPDATE_MODES:
        raise ValueError(f"host_update must be one of {HOST_UPDATE_MODES}, got {mode!r}")
    plan = cplan.plans.get(policy)
    if not isinstance(plan, PlacementPlan):
        return
    problem = cplan.problem
    eligible = [i for i in plan.host_chunks if not plan.params_on_host(i) and not problem.chunks[i].frozen]
    size = torch.empty((), dtype=dtype).element_size()
    staging = stream_staging_bytes(stream_piece_numel([problem.chunks[i].numel for i in eligible]), dtype) \
        if eligible else 0
    cplan.plans[policy] = choose_update_paths(
        problem, plan, mode=mode, eligible=eligible, cpu_elements_per_s=cpu_elements_per_s,
        link_bytes_per_s=link_bytes_per_s, link_bytes=stream_link_bytes(problem),
        param_h2d_bytes=[c.numel * size for c in problem.chunks], staging_bytes=staging,
        rate_source=rate_source, link_source=link_source)


def link_bytes(cplan: CapacityPlan, plan: PlacementPlan) -> dict[str, int]:
    """The bytes a step of ``plan`` moves over the host link (one micro-batch), bytes.

    ``h2d``: each host chunk's updated parameters once (after its CPU update), and each fetch of a chunk
    whose parameters stay on the host (:attr:`policies.ParamSchedule.h2d_copies` counts both for those);
    ``d2h``: each host chunk's gradients once per micro-batch. A chunk streamed through the device for its
    update (:attr:`PlacementPlan.streamed`) sends its state and gradients H2D and its state back D2H instead
    of its parameters (:func:`stream_link_bytes`).
    """
    chunks = cplan.problem.chunks
    offloaded = set(plan.param_host_chunks)
    streamed = set(plan.streamed)
    stream = stream_link_bytes(cplan.problem) if streamed else []
    h2d = sum(stream[c.index][0] if c.index in streamed else c.param_bytes for c in chunks
              if plan.placement[c.index] == policies.HOST and c.index not in offloaded)
    if plan.schedule is not None:
        per = max(c.param_bytes for c in chunks)
        h2d += plan.schedule.h2d_copies * per
    # a chunk's gradient buffer is as large as its compute buffer; a frozen chunk has none
    return {"h2d": h2d, "d2h": sum(chunks[i].param_bytes + (stream[i][1] if i in streamed else 0)
                                   for i in plan.host_chunks if not chunks[i].frozen)}


def verdict(cplan: CapacityPlan, policy: str = "auto") -> dict[str, Any]:
    """Does the step fit the device under ``policy``?

    Returns:
        ``{"status", "policy", "message", "device_bytes", "host_bytes", "offloaded_bytes",
        "params_on_host_bytes", "peak_bytes", "h2d_bytes_per_step", "d2h_bytes_per_step", "short_bytes",
        "needed_all_on_device_bytes"}``. ``status`` is ``"fits"`` (every chunk's model data on the device),
        ``"offload"`` (it fits with ``offloaded_bytes`` of optimizer state and gradients on the host, needing
        ``host_bytes`` of pinned CPU memory), ``"offload_params"`` (it fits only with ``params_on_host_bytes``
        of parameters on the host too, fetched for their reads; ``peak_bytes`` is the schedule's predicted
        device peak), ``"does_not_fit_host"`` (the device could hold the step with offload, but the host
        budget cannot hold the offloaded state: the message says "does not fit host memory" with both
        numbers) or ``"does_not_fit"`` (no plan: short by ``short_bytes`` at least). The link bytes are
        those of one step (:func:`link_bytes`). ``slack_bytes``: what the device has to spare at the
        step's peak under a plan; ``tight``: that slack is under :data:`PEAK_ERROR_BAR` of the peak
        non-model data, so an error of the prediction within its bar could exhaust it (the message then
        starts with "tight"). All bytes.

    Raises:
        LookupError: ``policy`` was not planned.
    """
    if policy not in cplan.plans:
        raise LookupError(f"policy {policy!r} was not planned; planned: {', '.join(cplan.plans)}")
    p = cplan.problem
    total_opt = sum(c.device_bytes for c in p.chunks)
    needed = p.peak_non_model_bytes + p.resident_model_bytes + total_opt
    out: dict[str, Any] = {"policy": policy, "needed_all_on_device_bytes": needed, "device_bytes": 0,
                           "host_bytes": 0, "offloaded_bytes": 0, "params_on_host_bytes": 0,
                           "peak_bytes": None, "h2d_bytes_per_step": 0, "d2h_bytes_per_step": 0,
                           "short_bytes": 0, "slack_bytes": None, "tight": False}
    plan = cplan.plans[policy]
    if isinstance(plan, str):
        # No plan: the parameters do not fit even where they could leave (or this policy keeps them all, or,
        # like 'cuda', all the optimizer state, on the device).
        short = max(0, needed - p.capacity_bytes) if p.margin_bytes >= 0 else -p.margin_bytes
        status = "does_not_fit" if short else "fits"
        if policies.plans.HOST_SHORT in plan and p.margin_bytes >= 0:
            status, message = "does_not_fit_host", plan[plan.index(policies.plans.HOST_SHORT):]
        elif p.margin_bytes < 0:
            message = (f"does not fit: resident model data + peak non-model data exceed "
                       f"{format_bytes(p.capacity_bytes)} by {format_bytes(-p.margin_bytes)}; {plan}")
        else:
            message = f"policy {policy!r} found no plan: {plan}"
        out.update(status=status, short_bytes=short, message=message)
        return out
    offloaded = total_opt - (plan.device_bytes - (p.host_grad_working_bytes if plan.host_chunks else 0))
    link = link_bytes(cplan, plan)
    out.update(device_bytes=plan.device_bytes, host_bytes=plan.host_bytes, offloaded_bytes=offloaded,
               h2d_bytes_per_step=link["h2d"], d2h_bytes_per_step=link["d2h"])
    over_link = (f"; {format_bytes(link['h2d'])} H2D and {format_bytes(link['d2h'])} D2H per step (one "
                 "micro-batch)")
    if plan.param_host_chunks:
        on_host = sum(p.chunks[i].param_bytes for i in plan.param_host_chunks)
        out.update(status="offload_params", params_on_host_bytes=on_host, peak_bytes=plan.peak_bytes,
                   message=(
                       f"fits only with parameter offload: every chunk's optimizer state and gradients and "
                       f"the parameters of {len(plan.param_host_chunks)} of {len(plan.placement)} chunks "
                       f"({format_bytes(on_host)}) on the host, fetched for their reads; predicted device "
                       f"peak {format_bytes(plan.peak_bytes or 0)} of {format_bytes(p.capacity_bytes)}, "
                       f"{format_bytes(plan.host_bytes)} of pinned host memory{over_link}"))
    elif not plan.host_chunks:
        out.update(status="fits", message=(
            f"fits: everything on the device, {format_bytes(p.capacity_bytes - needed)} to spare "
            f"(needs {format_bytes(needed)} of {format_bytes(p.capacity_bytes)})"))
    else:
        out.update(status="offload", message=(
            f"fits only with offload: {format_bytes(offloaded)} of optimizer state and gradients "
            f"({len(plan.host_chunks)} of {len(plan.placement)} chunks) go to the CPU, needing "
            f"{format_bytes(plan.host_bytes)} of pinned host memory{over_link}"))
    # the device at the step's peak: the schedule's peak with parameters on the host, else the peak
    # non-model data beside the resident model data and the chunks the plan keeps on the device
    at_peak = (plan.peak_bytes if plan.param_host_chunks and plan.peak_bytes is not None
               else needed if out["status"] == "fits"
               else p.peak_non_model_bytes + p.resident_model_bytes + plan.device_bytes)
    slack = p.capacity_bytes - at_peak
    bar = int(PEAK_ERROR_BAR * p.peak_non_model_bytes)
    out["slack_bytes"] = slack
    if slack < bar:
        out["tight"] = True
        out["message"] = (f"tight: {format_bytes(max(0, slack))} to spare at the peak, within the "
                          f"prediction's error bar ({PEAK_ERROR_BAR:.0%} of the peak non-model data, "
                          f"{format_bytes(bar)}): {out['message']}")
    return out


def result_dict(prediction: Prediction, cplan: CapacityPlan, *, what: dict[str, Any], policy: str = "auto",
                gpu: str | None = None) -> dict[str, Any]:
    """The machine-readable result (``memsched plan --json``).

    Keys: ``schema`` (``"memsched.plan"``), ``version`` (1); ``workload`` (``what`` plus ``parameters``:
    trainable parameter count, ``dtype``); ``trace``: ``device``, ``fake``, ``attention``,
    ``peak_non_model_bytes``, ``peak_module``, ``peak_phase``, ``elapsed_s``; ``model_data``: bytes by
    category (see :class:`CapacityPlan`; chunk padding included) plus ``resident_bytes`` and
    ``host_grad_working_bytes`` (what the host chunks' gradients add to the peak); ``chunks``:
    ``numel`` (the searched size), ``count``, ``total_numel`` and ``largest_numel`` (one rank: chunks as long
    as what they hold, [Note: exact chunks] in :mod:`memsched.chunks.layout`; more ranks: ``count x numel``
    and ``numel``), and ``padding``: the padding's ``numel`` and its bytes in ``parameter``,
    ``gradient`` and ``optimizer_state`` (subtract them from ``model_data`` for the parameters' own bytes);
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
        "model_data": {**cplan.model_data, "resident_bytes": p.resident_model_bytes,
                       "host_grad_working_bytes": p.host_grad_working_bytes},
        "chunks": {"numel": cplan.chunk_numel, "count": cplan.n_chunks, "padding": dict(cplan.padding),
                   "total_numel": sum(c.numel for c in p.chunks),
                   "largest_numel": max((c.numel for c in p.chunks), default=0)},
        "capacity_bytes": p.capacity_bytes,
        "host_capacity_bytes": p.host_capacity_bytes,
        "host_capacity_source": p.host_capacity_source,
        "gpu": gpu,
        "gpu_margin_mem_ratio": p.gpu_margin_mem_ratio,
        "margin_bytes": p.margin_bytes,
        "plans": {name: (plan.to_dict() if isinstance(plan, PlacementPlan) else {"error": plan})
                  for name, plan in cplan.plans.items()},
        "verdict": verdict(cplan, policy),
    }


#: What each :func:`largest_preset` answer accepts, by verdict status.
PRESET_FITS = {"any": ("fits", "offload", "offload_params"), "params_on_device": ("fits", "offload"),
               "all_on_device": ("fits",)}


def largest_preset(presets: Sequence[str], plan_of: Callable[[str], CapacityPlan],
                   policy: str = "auto") -> dict[str, str | None]:
    """The largest of ``presets`` (ordered by size, smallest first) whose plan fits, for each way of fitting
    (:data:`PRESET_FITS`: with any offload, with the parameters on the device, with everything on the
    device); ``None`` when none does.

    A binary search per answer, over the verdicts of ``policy`` (``plan_of(preset)`` is called at most once
    per preset): a larger preset at the same batch needs more memory, so the fitting presets are a prefix.
    """
    cache: dict[int, str] = {}

    def status(k: int) -> str:
        if k not in cache:
            cache[k] = verdict(plan_of(presets[k]), policy)["status"]
        return cache[k]

    out: dict[str, str | None] = {}
    for name, ok in PRESET_FITS.items():
        lo, hi = -1, len(presets) - 1  # presets[:lo + 1] fit, presets[hi + 1:] do not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if status(mid) in ok:
                lo = mid
            else:
                hi = mid - 1
        out[name] = presets[lo] if lo >= 0 else None
    return out


SWEEP_SCHEMA = "memsched.plan_sweep"
#: The policies whose largest fitting size a sweep reports: ``auto`` (offloads what does not fit) and ``cpu``
#: (offloads everything, the most a plan can free on the device).
SWEEP_POLICIES = ("auto", "cpu")


def largest_fitting(entries: list[tuple[int, CapacityPlan]], policy: str, *,
                    all_on_device: bool = False) -> int | None:
    """The largest size value whose plan under ``policy`` fits (:func:`verdict` status ``"fits"``,
    ``"offload"`` or ``"offload_params"``; ``all_on_device``: ``"fits"`` only, nothing offloaded); ``None``
    when none fits.

    ``entries`` pairs each size value (a sequence length or a batch size) with its :class:`CapacityPlan`.
    The largest fitting value is reported, not the last before the first failure: a larger size needs more
    memory, so in practice the fitting values are a prefix anyway.
    """
    ok = ("fits",) if all_on_device else ("fits", "offload", "offload_params")
    fitting = [value for value, cplan in entries if verdict(cplan, policy)["status"] in ok]
    return max(fitting, default=None)


def sweep_dict(over: str, entries: list[tuple[int, dict[str, Any], CapacityPlan]]) -> dict[str, Any]:
    """The machine-readable result of ``memsched plan --json`` for several sizes.

    Args:
        over: the swept workload key, ``"seq_len"`` or ``"batch_size"``.
        entries: per size, in the order given: its value, its :func:`result_dict` and its
            :class:`CapacityPlan`.

    Returns:
        ``schema`` (``"memsched.plan_sweep"``), ``version`` (1), ``over``, ``values``; ``capacity_bytes``,
        ``gpu``, ``gpu_margin_mem_ratio`` (the same for every size); ``sizes``: per size ``{over: value,
        "peak_non_model_bytes", "margin_bytes", "verdicts": {policy: verdict}, "result": the full
        result_dict}`` (verdicts of ``auto``, ``cpu`` and the result's verdict policy, see :func:`verdict`);
        ``largest_fitting``: ``auto``, ``cpu`` (the largest value whose plan fits under that policy, ``None``
        when none does) and ``auto_all_on_device`` (the largest with nothing offloaded). Sizes in bytes.

    ``auto`` fits every size ``cpu`` fits, and more where parameters must stay on the host (``cpu`` keeps
    them on the device); ``auto_all_on_device`` is the largest with nothing offloaded.
    """
    pairs = [(value, cplan) for value, _, cplan in entries]
    first = entries[0][1]
    sizes = []
    for value, result, cplan in entries:
        policies_seen = dict.fromkeys((*SWEEP_POLICIES, result["verdict"]["policy"]))
        sizes.append({
            over: value,
            "peak_non_model_bytes": result["trace"]["peak_non_model_bytes"],
            "margin_bytes": result["margin_bytes"],
            "verdicts": {name: verdict(cplan, name) for name in policies_seen},
            "result": result,
        })
    largest: dict[str, int | None] = {name: largest_fitting(pairs, name) for name in SWEEP_POLICIES}
    largest["auto_all_on_device"] = largest_fitting(pairs, "auto", all_on_device=True)
    return {
        "schema": SWEEP_SCHEMA,
        "version": VERSION,
        "over": over,
        "values": [value for value, _, _ in entries],
        "capacity_bytes": first["capacity_bytes"],
        "gpu": first["gpu"],
        "gpu_margin_mem_ratio": first["gpu_margin_mem_ratio"],
        "sizes": sizes,
        "largest_fitting": largest,
    }


#: The ZeRO stages ``memsched plan --world-size`` predicts (those :func:`memsched.attach` runs).
PREDICTED_STAGES = (0, 1, 2, 3)


def per_rank_dict(prediction: Prediction, capacity_bytes: int, world_size: int, *, policy: str = "auto",
                  gpu_margin_mem_ratio: float = 0.8) -> dict[str, Any]:
    """One rank's memory at each ZeRO stage with ``world_size`` ranks (``memsched plan --world-size``): the
    predicted step is one rank's micro-batch, planned with ``policy`` at stages 0, 1 and 2
    (:func:`plan_for_capacity` with ``zero_stage``; see :func:`memsched.planning.problem.build_problem` for
    what each stage keeps per rank), and 3.

    Returns:
        ``{"world_size", "policy", "stages"}``; each stage: ``zero_stage``, ``status`` (a :func:`verdict`
        status), ``message``, ``chunk_numel`` (padded for the ranks),
        ``resident_model_bytes`` (the parameters and gradients the stage keeps, frozen parameters and
        buffers), ``device_state_bytes`` (optimizer state the plan keeps on the device), ``host_bytes``
        (pinned host bytes of the host-placed shards) and ``peak_bytes`` (peak non-model data + resident model
        data + device state: the rank's predicted device peak); ``None`` where the policy found no plan. All
        bytes.

    Raises:
        ValueError: ``world_size`` < 2 (names it), or an unknown policy (lists the known ones).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an integer >= 2 (one rank is the plan without it), got "
                         f"{world_size!r}")
    stages: list[dict[str, Any]] = []
    for stage in PREDICTED_STAGES:
        cplan = plan_for_capacity(prediction, capacity_bytes, gpu_margin_mem_ratio=gpu_margin_mem_ratio,
                                  policy_names=[policy], world_size=world_size, zero_stage=stage)
        p, plan, v = cplan.problem, cplan.plans[policy], verdict(cplan, policy)
        state = plan.device_bytes if isinstance(plan, PlacementPlan) else None
        stages.append({
            "zero_stage": stage, "status": v["status"], "message": v["message"],
            "chunk_numel": cplan.chunk_numel, "resident_model_bytes": p.resident_model_bytes,
            "device_state_bytes": state, "host_bytes": v["host_bytes"] if state is not None else None,
            "peak_bytes": None if state is None else p.peak_non_model_bytes + p.resident_model_bytes + state,
        })
    return {"world_size": world_size, "policy": policy, "stages": stages}
