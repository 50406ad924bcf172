"""Placement plans: building one from a placement, and the post-conditions every plan must meet.

``Policy.plan`` (:mod:`policies.registry`) checks every plan with :func:`check_plan`, so no policy, built-in
or custom, can hand the scheduler a plan certain to run out of memory. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from policies.types import DEVICE, HOST, PlacementPlan, PlacementProblem
from policies.units import format_bytes


class PlacementError(ValueError):
    """No plan exists under this policy: the optimizer state (or even the non-model and resident data)
    does not fit on the device or in pinned host memory. The message gives the numbers and what to try."""


def check_base_fits(problem: PlacementProblem) -> None:
    """Raise :class:`PlacementError` when resident model data + peak non-model data exceed the capacity.

    ``Policy.plan`` calls this before any policy: the GPU margin is then negative, and no placement of
    optimizer state can prevent an out-of-memory error.
    """
    p = problem
    if p.margin_bytes < 0:
        raise PlacementError(
            f"resident model data ({format_bytes(p.resident_model_bytes)}) + peak non-model data "
            f"({format_bytes(p.peak_non_model_bytes)}) exceed the device capacity "
            f"({format_bytes(p.capacity_bytes)}) by {format_bytes(-p.margin_bytes)} before any optimizer "
            "state is placed; no placement policy can fix this: reduce activation memory (smaller batch, "
            "activation checkpointing) or use a larger device"
        )


def _sums(problem: PlacementProblem, placement: Sequence[str]) -> tuple[int, int]:
    pairs = list(zip(problem.chunks, placement, strict=True))
    return problem.device_bytes_of(placement), sum(c.host_bytes for c, p in pairs if p == HOST)


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
    dev, host = _sums(problem, plan.placement)
    if (plan.device_bytes, plan.host_bytes, plan.margin_bytes) != (dev, host, problem.margin_bytes):
        raise ValueError(
            f"placement policy {name!r} returned device_bytes={plan.device_bytes}, "
            f"host_bytes={plan.host_bytes}, margin_bytes={plan.margin_bytes}; the placement gives {dev}, "
            f"{host}, {problem.margin_bytes} (build plans with policies.make_plan)"
        )
    if dev > problem.margin_bytes:
        raise PlacementError(
            f"placement policy {name!r} put {format_bytes(dev)} of optimizer state on the device, more "
            f"than the GPU margin of {format_bytes(problem.margin_bytes)}; try 'auto' or 'cpu'"
        )
    cap = problem.host_capacity_bytes
    if cap is not None and host > cap:
        # Exact byte counts next to the rounded ones: the user compares them with free / ulimit output.
        source = f" ({problem.host_capacity_source})" if problem.host_capacity_source else ""
        raise PlacementError(
            f"placement policy {name!r} needs {format_bytes(host)} of pinned host memory for "
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
) -> PlacementPlan:
    """Build a :class:`PlacementPlan` from a placement (one ``DEVICE``/``HOST`` per chunk), computing
    ``device_bytes`` (:meth:`PlacementProblem.device_bytes_of`) and ``host_bytes`` (sums over the chunks,
    bytes) and ``margin_bytes`` from ``problem``.
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
    dev, host = _sums(problem, placement)
    return PlacementPlan(
        policy=policy,
        placement=placement,
        device_bytes=dev,
        host_bytes=host,
        margin_bytes=problem.margin_bytes,
        budget_bytes=int(budget_bytes),
        reasons=tuple(reasons),
        options=dict(options or {}),
    )


