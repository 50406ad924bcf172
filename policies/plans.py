"""Placement plans: building one from a placement, and the post-conditions every plan must meet.

``Policy.plan`` (:mod:`policies.registry`) checks every plan with :func:`check_plan`, so no policy, built-in
or custom, can hand the scheduler a plan certain to run out of memory. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from policies.schedule import ScheduleError, schedule_params
from policies.types import DEVICE, HOST, ParamSchedule, PlacementPlan, PlacementProblem
from policies.units import format_bytes


class PlacementError(ValueError):
    """No plan exists under this policy: the optimizer state (or even the non-model and resident data)
    does not fit on the device or in pinned host memory. The message gives the numbers and what to try."""


def check_base_fits(problem: PlacementProblem) -> None:
    """Raise :class:`PlacementError` when resident model data + peak non-model data exceed the capacity and
    no parameter can leave the device (the problem has no traced accesses to schedule fetches from).

    ``Policy.plan`` calls this before any policy: the GPU margin is then negative, and no placement of
    optimizer state can prevent an out-of-memory error. With accesses, a policy may still keep parameters on
    the host (:func:`param_offload_plan`); those that cannot say so themselves.
    """
    p = problem
    if p.margin_bytes < 0 and not p.accesses:
        raise PlacementError(
            f"resident model data ({format_bytes(p.resident_model_bytes)}) + peak non-model data "
            f"({format_bytes(p.peak_non_model_bytes)}) exceed the device capacity "
            f"({format_bytes(p.capacity_bytes)}) by {format_bytes(-p.margin_bytes)} before any optimizer "
            "state is placed; no placement policy can fix this: reduce activation memory (smaller batch, "
            "activation checkpointing) or use a larger device"
        )


def fixed_bytes(problem: PlacementProblem, placement: Sequence[str], param_placement: Sequence[str]) -> int:
    """Model data on the device whatever the step does, with the parameters of ``param_placement``'s host
    chunks off it: the resident model data less those parameters, plus the device-placed chunks' optimizer
    state and gradients, bytes. (The host chunks' gradients on their way to the host are in each access's
    ``non_model_bytes``.)"""
    chunks = problem.chunks
    off = sum(c.param_bytes for c, where in zip(chunks, param_placement, strict=True) if where == HOST)
    dev = sum(c.device_bytes for c, where in zip(chunks, placement, strict=True) if where == DEVICE)
    return problem.resident_model_bytes - off + dev


def param_slots(problem: PlacementProblem, placement: Sequence[str], param_placement: Sequence[str],
                limit_bytes: int, share: float = 1.0) -> list[int]:
    """Per access of ``problem.accesses``: how many host-placed parameter chunks fit on the device from it to
    the next, within ``limit_bytes``: ``share`` of what is left beside the non-model data and the fixed model
    data (:func:`fixed_bytes`), and never fewer than the two a read may need (the chunk read and the one
    read right before it) where they fit at all: ``share`` bounds what is cached and fetched ahead, not
    the reads themselves."""
    per = max((c.param_bytes for c in problem.chunks), default=0) or 1
    fixed = fixed_bytes(problem, placement, param_placement)
    out = []
    for a in problem.accesses:
        room = max(0, limit_bytes - a.non_model_bytes - fixed)
        out.append(max(int(share * room) // per, min(2, room // per)))
    return out


def schedule_for(problem: PlacementProblem, placement: Sequence[str], param_placement: Sequence[str],
                 limit_bytes: int, *, share: float = 1.0, max_prefetch: int = 2) -> ParamSchedule:
    """The fetch schedule of ``param_placement``'s host chunks within ``limit_bytes``
    (:func:`policies.schedule.schedule_params` over :func:`param_slots`).

    Raises:
        PlacementError: no schedule exists (names the read with no room and the bytes involved).
    """
    offloaded = [i for i, where in enumerate(param_placement) if where == HOST]
    slots = param_slots(problem, placement, param_placement, limit_bytes, share)
    try:
        return schedule_params(problem.accesses, offloaded, slots, max_prefetch=max_prefetch)
    except ScheduleError as e:
        raise PlacementError(
            f"{e} (device limit {format_bytes(limit_bytes)}, fixed model data "
            f"{format_bytes(fixed_bytes(problem, placement, param_placement))})") from None


def schedule_peak_bytes(problem: PlacementProblem, placement: Sequence[str], param_placement: Sequence[str],
                        schedule: ParamSchedule) -> int:
    """The most a step following ``schedule`` holds on the device, bytes: at each access its non-model data,
    the fixed model data and the host-placed parameter chunks on the device then."""
    per = max((c.param_bytes for c in problem.chunks), default=0)
    fixed = fixed_bytes(problem, placement, param_placement)
    resident: set[int] = set(schedule.keep)
    k, peak = 0, 0
    for a in problem.accesses:  # the targets apply from each scheduled access to the next one
        if k < len(schedule.accesses) and a.chunk == schedule.accesses[k].chunk and a.phase == \
                schedule.accesses[k].phase:
            resident = set(schedule.targets[k])
            k += 1
        peak = max(peak, a.non_model_bytes + fixed + len(resident) * per)
    return peak


def plan_bytes(problem: PlacementProblem, placement: Sequence[str],
          param_placement: Sequence[str] = (), speculative: Sequence[int] = ()) -> tuple[int, int]:
    """Device bytes and pinned host bytes of a placement (and of the parameters it keeps on the host, and of
    the spare host states of its ``speculative`` chunks)."""
    pairs = list(zip(problem.chunks, placement, strict=True))
    params_on_host = [i for i, where in enumerate(param_placement) if where == HOST]
    params = sum(problem.chunks[i].param_host_bytes for i in params_on_host if not problem.chunks[i].frozen)
    # the update of a host chunk whose parameters have no host copy sends them from the shared staging buffer
    staging = problem.h2d_staging_bytes if any(
        where == HOST and c.param_host_bytes and i not in params_on_host
        for i, (c, where) in enumerate(pairs)) else 0
    spare = sum(problem.chunks[i].host_bytes for i in speculative)
    return (problem.device_bytes_of(placement),
            sum(c.host_bytes for c, p in pairs if p == HOST) + params + staging + spare)


def _check_param_plan(name: str, problem: PlacementProblem, plan: PlacementPlan) -> None:
    """A plan with parameters on the host: every such chunk's optimizer state is on the host too, its
    schedule is the one of those chunks, reads each of them where it is read and fits the device at every
    access (its peak, :func:`schedule_peak_bytes`, within the capacity)."""
    n = len(problem.chunks)
    pp = plan.param_placement
    if len(pp) != n or any(p not in (DEVICE, HOST) for p in pp):
        raise ValueError(f"placement policy {name!r} returned param_placement {pp!r}: one of {DEVICE!r}/"
                         f"{HOST!r} per chunk ({n})")
    bad = [i for i, (state, param) in enumerate(zip(plan.placement, pp, strict=True))
           if param == HOST and state != HOST]
    if bad:
        raise ValueError(f"placement policy {name!r} kept chunk {bad[0]}'s parameters on the host but its "
                         "optimizer state on the device: a chunk whose parameters are on the host is updated "
                         "on the host")
    offloaded = tuple(i for i, where in enumerate(pp) if where == HOST)
    sched = plan.schedule
    if not offloaded:
        if sched is not None:
            raise ValueError(f"placement policy {name!r} returned a schedule with no parameter on the host")
        return
    if sched is None or sched.offloaded != offloaded or not problem.accesses:
        raise ValueError(f"placement policy {name!r} kept parameters of chunks {list(offloaded)} on the host "
                         "without their fetch schedule (policies.plans.schedule_for makes it)")
    if any(a.chunk not in t for a, t in zip(sched.accesses, sched.targets, strict=True)):
        raise ValueError(f"placement policy {name!r} returned a schedule that does not fetch a chunk it "
                         "reads")
    peak = schedule_peak_bytes(problem, plan.placement, pp, sched)
    if peak > problem.capacity_bytes:
        raise PlacementError(
            f"placement policy {name!r} keeps {len(offloaded)} chunks' parameters on the host, but its "
            f"schedule still needs {format_bytes(peak)} on the device, more than its capacity "
            f"{format_bytes(problem.capacity_bytes)}; try 'auto'")
    if plan.peak_bytes is not None and plan.peak_bytes != peak:
        raise ValueError(f"placement policy {name!r} returned peak_bytes={plan.peak_bytes}; its schedule "
                         f"gives {peak} (build plans with policies.make_plan)")


#: How a plan refused for host memory starts (``memsched plan``'s verdict reads it).
HOST_SHORT = "does not fit host memory"


def check_plan(name: str, problem: PlacementProblem, plan: PlacementPlan) -> None:
    """Post-conditions every plan must meet, whoever wrote the policy."""
    n = len(problem.chunks)
    if len(plan.placement) != n:
        raise ValueError(
            f"placement policy {name!r} placed {len(plan.placement)} chunks, the problem has {n}"
        )
    wrong = [p for p in plan.placement if p not in (DEVICE, HOST)]
    if wrong:
        raise ValueError(
            f"placement policy {name!r} used placement {wrong[0]!r}; allowed: {DEVICE!r}, {HOST!r}"
        )
    for field_name, chosen in (("speculative", plan.speculative), ("streamed", plan.streamed)):
        if list(chosen) != sorted(set(chosen)) or any(
                not 0 <= i < n or plan.placement[i] != HOST or problem.chunks[i].frozen for i in chosen):
            raise ValueError(f"placement policy {name!r} returned {field_name}={list(chosen)!r}: sorted, "
                             "distinct indices of host-placed chunks of trainable parameters")
    both = sorted(set(plan.speculative) & set(plan.streamed))
    if both:
        raise ValueError(f"placement policy {name!r} returned chunks {both!r} both speculative and streamed")
    dev, host = plan_bytes(problem, plan.placement, plan.param_placement, plan.speculative)
    if (plan.device_bytes, plan.host_bytes, plan.margin_bytes) != (dev, host, problem.margin_bytes):
        raise ValueError(
            f"placement policy {name!r} returned device_bytes={plan.device_bytes}, "
            f"host_bytes={plan.host_bytes}, margin_bytes={plan.margin_bytes}; the placement gives {dev}, "
            f"{host}, {problem.margin_bytes} (build plans with policies.make_plan)"
        )
    if plan.param_placement or plan.schedule is not None:
        _check_param_plan(name, problem, plan)
    elif dev > problem.margin_bytes:
        raise PlacementError(
            f"placement policy {name!r} put {format_bytes(dev)} of optimizer state on the device, more "
            f"than the GPU margin of {format_bytes(problem.margin_bytes)}; try 'auto' or 'cpu'"
        )
    cap = problem.host_capacity_bytes
    if cap is not None and host > cap:
        # Exact byte counts next to the rounded ones: the user compares them with free / ulimit output.
        source = f" ({problem.host_capacity_source})" if problem.host_capacity_source else ""
        raise PlacementError(
            f"{HOST_SHORT}: placement policy {name!r} needs {format_bytes(host)} of pinned host memory for "
            f"{plan.placement.count(HOST)} chunks ({host:,} bytes), but only {format_bytes(cap)} "
            f"({cap:,} bytes) is available{source}; short by {host - cap:,} bytes. Keep more chunks on "
            "the device (policy 'auto', a larger gpu_margin_mem_ratio) or free host memory"
        )


def make_plan(
    problem: PlacementProblem,
    placement: Sequence[str],
    *,
    budget_bytes: int,
    reasons: Iterable[str] = (),
    policy: str = "",
    options: Mapping[str, Any] | None = None,
    param_placement: Sequence[str] = (),
    schedule: ParamSchedule | None = None,
) -> PlacementPlan:
    """Build a :class:`PlacementPlan` from a placement (one ``DEVICE``/``HOST`` per chunk), computing
    ``device_bytes`` (:meth:`PlacementProblem.device_bytes_of`) and ``host_bytes`` (sums over the chunks,
    bytes) and ``margin_bytes`` from ``problem``. With ``param_placement`` (chunks whose parameters stay on
    the host) and their ``schedule`` (:func:`schedule_for`), ``peak_bytes`` is the schedule's
    (:func:`schedule_peak_bytes`). A chunk of frozen parameters (:attr:`ChunkSpec.frozen`) is placed where
    its parameters are, whatever ``placement`` says.
    ``Policy.plan`` fills in ``policy`` and ``options``.

    Raises:
        ValueError: ``placement`` does not have one ``DEVICE``/``HOST`` entry per chunk.
    """
    placement = tuple(placement)
    if len(placement) != len(problem.chunks) or any(p not in (DEVICE, HOST) for p in placement):
        raise ValueError(
            f"placement must hold one of {DEVICE!r}/{HOST!r} per chunk ({len(problem.chunks)}), "
            f"got {placement!r}"
        )
    param_placement = tuple(param_placement)
    # A chunk of frozen parameters has no optimizer state: it lives where its parameters do (a host copy
    # beside parameters kept on the device would be pinned memory for nothing).
    placement = tuple((param_placement[i] if param_placement else DEVICE) if c.frozen else where
                      for i, (c, where) in enumerate(zip(problem.chunks, placement, strict=True)))
    dev, host = plan_bytes(problem, placement, param_placement)
    peak = (schedule_peak_bytes(problem, placement, param_placement, schedule)
            if schedule is not None and param_placement else None)
    return PlacementPlan(
        policy=policy,
        placement=placement,
        device_bytes=dev,
        host_bytes=host,
        margin_bytes=problem.margin_bytes,
        budget_bytes=int(budget_bytes),
        reasons=tuple(reasons),
        options=dict(options or {}),
        param_placement=param_placement,
        schedule=schedule,
        peak_bytes=peak,
    )


