"""Capacity verdicts: plan a predicted step (:mod:`memsched.planning.prediction`) for a device size with every
built-in placement policy, and say whether it fits, fits only with offload, or does not fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import policies
from memsched.chunks import chunk_bytes
from memsched.models import count_parameters
from memsched.planning.prediction import Prediction
from memsched.planning.problem import build_problem, resident_extra_bytes, trainable_groups
from policies.types import PlacementPlan, PlacementProblem
from policies.units import format_bytes

SCHEMA = "memsched.plan"
VERSION = 1
VERDICTS = ("fits", "offload", "does_not_fit")


@dataclass
class CapacityPlan:
    """Plans of every policy for one device capacity.

    Attributes:
        problem: the placement problem (from :func:`memsched.planning.problem.build_problem`).
        chunk_numel: chunk size, elements; ``n_chunks``: number of chunks.
        model_data: bytes by category: ``parameter`` and ``gradient`` (the chunks' compute and gradient
            buffers, padding included), ``optimizer_state`` (every chunk's device-side state), ``other``
            (frozen parameters and buffers); all bytes.
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
                      policy_names: list[str] | None = None) -> CapacityPlan:
    """Build the placement problem for ``capacity_bytes`` and plan it with each policy (default: all
    registered).

    Raises:
        ValueError: a ratio outside [0, 1] or a negative capacity (from :class:`PlacementProblem`), an unknown
            policy name (lists the known ones).
    """
    model = prediction.model
    dtype = prediction.dtype
    master = dtype != torch.float32
    problem, layout = build_problem(model, prediction.peak_non_model_bytes, capacity_bytes,
                                    gpu_margin_mem_ratio=gpu_margin_mem_ratio, master_weights=master,
                                    param_order=prediction.param_order or None, compute_dtype=dtype,
                                    pinned=True)  # planned for a CUDA device: host state is pinned
    cb = chunk_bytes(layout.chunk_numel, compute_dtype=dtype, master_weights=master)
    model_data = {
        "parameter": layout.n_chunks * cb.compute_bytes,
        "gradient": layout.n_chunks * cb.grad_bytes,
        "optimizer_state": sum(c.device_bytes for c in problem.chunks),
        "other": resident_extra_bytes(model, trainable_groups(model)),
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


def verdict(cplan: CapacityPlan, policy: str = "auto") -> dict[str, Any]:
    """Does the step fit the device under ``policy``?

    Returns:
        ``{"status", "policy", "message", "device_bytes", "host_bytes", "offloaded_bytes", "short_bytes",
        "needed_all_on_device_bytes"}``: ``status`` is ``"fits"`` (the plan keeps every optimizer-state chunk
        on the device), ``"offload"`` (it fits only with ``offloaded_bytes`` of optimizer state, needing
        ``host_bytes`` of pinned CPU memory, on the host) or ``"does_not_fit"`` (resident model data + peak
        non-model data alone exceed the capacity by ``short_bytes``); all bytes.

    Raises:
        LookupError: ``policy`` was not planned.
    """
    if policy not in cplan.plans:
        raise LookupError(f"policy {policy!r} was not planned; planned: {', '.join(cplan.plans)}")
    p = cplan.problem
    total_opt = sum(c.device_bytes for c in p.chunks)
    needed = p.peak_non_model_bytes + p.resident_model_bytes + total_opt
    out: dict[str, Any] = {"policy": policy, "needed_all_on_device_bytes": needed, "device_bytes": 0,
                           "host_bytes": 0, "offloaded_bytes": 0, "short_bytes": 0}
    plan = cplan.plans[policy]
    if p.margin_bytes < 0:
        out.update(status="does_not_fit", short_bytes=-p.margin_bytes, message=(
            f"does not fit: resident model data + peak non-model data exceed "
            f"{format_bytes(p.capacity_bytes)} by {format_bytes(-p.margin_bytes)} even with all optimizer "
            "state on the CPU"))
        return out
    if isinstance(plan, str):
        # The base fits but this policy found no plan (e.g. 'cuda' when the optimizer state does not fit).
        short = max(0, needed - p.capacity_bytes)
        out.update(status="does_not_fit" if short else "fits", short_bytes=short,
                   message=f"policy {policy!r} found no plan: {plan}")
        return out
    offloaded = total_opt - plan.device_bytes
    out.update(device_bytes=plan.device_bytes, host_bytes=plan.host_bytes, offloaded_bytes=offloaded)
    if not plan.host_chunks:
        out.update(status="fits", message=(
            f"fits: everything on the device, {format_bytes(p.capacity_bytes - needed)} to spare "
            f"(needs {format_bytes(needed)} of {format_bytes(p.capacity_bytes)})"))
    else:
        out.update(status="offload", message=(
            f"fits only with offload: {format_bytes(offloaded)} of optimizer state "
            f"({len(plan.host_chunks)} of {len(plan.placement)} chunks) goes to the CPU, needing "
            f"{format_bytes(plan.host_bytes)} of pinned host memory"))
    return out


def result_dict(prediction: Prediction, cplan: CapacityPlan, *, what: dict[str, Any], policy: str = "auto",
                gpu: str | None = None) -> dict[str, Any]:
    """The machine-readable result (``memsched plan --json``).

    Keys: ``schema`` (``"memsched.plan"``), ``version`` (1); ``workload`` (``what`` plus ``parameters``:
    trainable parameter count, ``dtype``); ``trace``: ``device``, ``fake``, ``attention``,
    ``peak_non_model_bytes``, ``peak_module``, ``peak_phase``, ``elapsed_s``; ``model_data``: bytes by
    category (see :class:`CapacityPlan`; chunk padding included) plus ``resident_bytes``; ``chunks``:
    ``numel`` and ``count``, and ``padding``: the padding's ``numel`` and its bytes in ``parameter``,
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
        "model_data": {**cplan.model_data, "resident_bytes": p.resident_model_bytes},
        "chunks": {"numel": cplan.chunk_numel, "count": cplan.n_chunks, "padding": dict(cplan.padding)},
        "capacity_bytes": p.capacity_bytes,
        "gpu": gpu,
        "gpu_margin_mem_ratio": p.gpu_margin_mem_ratio,
        "margin_bytes": p.margin_bytes,
        "plans": {name: (plan.to_dict() if isinstance(plan, PlacementPlan) else {"error": plan})
                  for name, plan in cplan.plans.items()},
        "verdict": verdict(cplan, policy),
    }


SWEEP_SCHEMA = "memsched.plan_sweep"
#: The policies whose largest fitting size a sweep reports: ``auto`` (offloads what does not fit) and ``cpu``
#: (offloads everything, the most a plan can free on the device).
SWEEP_POLICIES = ("auto", "cpu")


def largest_fitting(entries: list[tuple[int, CapacityPlan]], policy: str, *,
                    all_on_device: bool = False) -> int | None:
    """The largest size value whose plan under ``policy`` fits (:func:`verdict` status ``"fits"`` or
    ``"offload"``; ``all_on_device``: ``"fits"`` only, nothing offloaded); ``None`` when none fits.

    ``entries`` pairs each size value (a sequence length or a batch size) with its :class:`CapacityPlan`.
    The largest fitting value is reported, not the last before the first failure: a larger size needs more
    memory, so in practice the fitting values are a prefix anyway.
    """
    ok = ("fits",) if all_on_device else ("fits", "offload")
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

    Without a host-memory limit (``memsched plan`` sets none) ``auto`` and ``cpu`` fit the same sizes: both
    need only resident + peak non-model data to fit the device; ``auto_all_on_device`` tells them apart.
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
