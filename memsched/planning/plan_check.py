"""The runtime plan against the plan ``memsched plan --json`` made before the run: do they agree, and if not,
why.

``memsched plan`` predicts a step from a fake trace; the runtime plans from the warmup step it measured. Given
the CLI's JSON (``attach(expected_plan=...)``), the runtime compares what both planned with: the device
capacity, the peak non-model data (predicted, measured), the chunks, the GPU margin and where each chunk's
optimizer state and parameters went. They agree when the capacity and the chunks are the same, the measured
peak is within the prediction's error bar (:data:`memsched.planning.capacity.PEAK_ERROR_BAR` below it, 5 %
above it: the calibration's bounds, ``tests/test_gpu_calibration.py``) and the placements are equal; else each
difference is a sentence saying which and by how much. Idea: DeepSpeed's and ColossalAI's memory estimators
predict, this one also checks its prediction against the run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memsched.planning.capacity import PEAK_ERROR_BAR
from memsched.planning.capacity import SCHEMA as PLAN_SCHEMA
from policies.types import DEVICE, HOST, PlacementPlan
from policies.units import format_bytes

#: How far above the prediction the measured peak non-model data may be and still agree (the calibration's).
PEAK_ABOVE_BAR = 0.05
#: Capacities closer than this are the same device (a per-process fraction rounds ``fraction x total``),
#: bytes: the CUDA caching allocator's smallest segment.
CAPACITY_SLACK = 2 << 20


@dataclass(frozen=True)
class PlanCheck:
    """The runtime plan after warmup against a CLI plan.

    Attributes:
        policy: the policy compared (the runtime's).
        rows: ``(what, CLI, runtime)`` per compared figure, as printed (bytes, counts, placements).
        differences: one sentence per difference; empty when the plans agree.
    """

    policy: str
    rows: tuple[tuple[str, str, str], ...]
    differences: tuple[str, ...]

    @property
    def agrees(self) -> bool:
        return not self.differences

    def summary(self) -> str:
        if self.agrees:
            return f"the runtime plan agrees with memsched plan's ({self.policy})"
        return (f"the runtime plan differs from memsched plan's ({self.policy}): "
                + "; ".join(self.differences))

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "agrees": self.agrees, "differences": list(self.differences),
                "rows": [{"what": w, "cli": c, "runtime": r} for w, c, r in self.rows]}


def _counts(placement: list[str] | tuple[str, ...]) -> str:
    host = [i for i, p in enumerate(placement) if p == HOST]
    return f"{len(host)} of {len(placement)} on the host" + (f" ({_ranges(host)})" if host else "")


def _ranges(idx: list[int]) -> str:
    out, start = [], None
    for k, i in enumerate(idx):
        if start is None:
            start = i
        if k + 1 == len(idx) or idx[k + 1] != i + 1:
            out.append(f"{start}" if start == i else f"{start}-{i}")
            start = None
    return "chunks " + ", ".join(out)


def load_expected_plan(expected: str | os.PathLike | Mapping[str, Any]) -> Mapping[str, Any]:
    """``attach(expected_plan=...)``: the JSON of ``memsched plan --json``, from a file path or as a dict.

    Raises:
        ValueError: the file cannot be read or parsed, or it is not a ``memsched plan --json`` result of one
            workload (names what it is).
    """
    if isinstance(expected, (str, os.PathLike)):
        try:
            with open(expected, encoding="utf-8") as f:
                loaded = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"expected_plan {str(expected)!r} cannot be read as JSON: {e}") from None
    elif isinstance(expected, Mapping):
        loaded = expected
    else:
        raise ValueError("expected_plan must be the path of `memsched plan --json`'s output or its dict, "
                         f"got {type(expected).__name__}")
    if not isinstance(loaded, Mapping) or loaded.get("schema") != PLAN_SCHEMA or "plans" not in loaded:
        what = loaded.get("schema", "no schema") if isinstance(loaded, Mapping) else type(loaded).__name__
        raise ValueError(f"expected_plan must be the JSON of `memsched plan --json` for one workload (schema "
                         f"{PLAN_SCHEMA!r} with 'plans'); got {what!r}. A sweep (several batch sizes or "
                         "sequence lengths) has one plan per point: plan the point you run")
    return loaded


def check_plan(expected: Mapping[str, Any], plan: PlacementPlan, *, capacity_bytes: int,
               peak_non_model_bytes: int, chunk_numel: int, chunk_count: int,
               total_numel: int) -> PlanCheck:
    """Compare the runtime ``plan`` (made for ``capacity_bytes`` from a measured ``peak_non_model_bytes``,
    over ``chunk_count`` chunks packed to ``chunk_numel`` elements, ``total_numel`` in all) with
    ``expected``, the JSON of ``memsched plan --json`` (one workload, not a sweep).

    Raises:
        ValueError: ``expected`` is not a ``memsched plan --json`` result of one workload, or has no plan for
            ``plan.policy`` (names what it has).
    """
    expected = load_expected_plan(expected)
    cli = expected["plans"].get(plan.policy)
    if cli is None or "error" in cli:
        have = sorted(k for k, v in expected["plans"].items() if "error" not in v)
        why = cli["error"] if cli is not None else f"it has plans for {have}"
        raise ValueError(f"expected_plan has no plan for policy {plan.policy!r}: {why}")
    rows: list[tuple[str, str, str]] = []
    diffs: list[str] = []

    cap = int(expected["capacity_bytes"])
    rows.append(("device capacity", format_bytes(cap), format_bytes(capacity_bytes)))
    if abs(cap - capacity_bytes) > CAPACITY_SLACK:
        diffs.append(f"it was made for a capacity of {format_bytes(cap)}, this device has "
                     f"{format_bytes(capacity_bytes)}")

    predicted = int(expected["trace"]["peak_non_model_bytes"])
    rel = (peak_non_model_bytes - predicted) / predicted if predicted else 0.0
    measured = f"{format_bytes(peak_non_model_bytes)} ({rel:+.2%})"
    rows.append(("peak non-model data", format_bytes(predicted), measured))
    if rel < -PEAK_ERROR_BAR or rel > PEAK_ABOVE_BAR:
        diffs.append(
            f"the measured peak non-model data is {rel:+.2%} off the prediction ({peak_non_model_bytes} B "
            f"measured, {predicted} B predicted; the error bar is -{PEAK_ERROR_BAR:.0%} / "
            f"+{PEAK_ABOVE_BAR:.0%}): the run is not the step the CLI traced (another batch shape, dtype or "
            "loss, work outside the traced model, or other kernels: plan with --attention gpu for a GPU, "
            "--attention math for the stand-in, which runs the math kernel)")

    chunks = expected["chunks"]
    total = total_numel
    theirs_total = int(chunks.get("total_numel", int(chunks["count"]) * int(chunks["numel"])))
    planned = f"{chunks['count']} chunks, {theirs_total:,} elements"
    here = f"{chunk_count} chunks, {total:,} elements"
    rows.append(("chunks", planned, here))
    if (int(chunks["count"]), int(chunks["numel"]), theirs_total) != (chunk_count, chunk_numel, total):
        diffs.append(f"the chunks differ ({planned} planned, packed to {chunks['numel']}; {here} here, "
                     f"packed to {chunk_numel}): other parameters, param groups or chunk_numel")

    rows.append(("GPU margin", format_bytes(int(cli["margin_bytes"])), format_bytes(plan.margin_bytes)))
    for what, theirs, ours in (("optimizer state and gradients", cli["placement"], list(plan.placement)),
                               ("parameters", cli.get("param_placement") or [DEVICE] * len(cli["placement"]),
                                list(plan.param_placement) or [DEVICE] * len(plan.placement))):
        rows.append((what, _counts(theirs), _counts(ours)))
        if list(theirs) != list(ours):
            diffs.append(f"{what}: {_counts(theirs)} planned, {_counts(ours)} here")
    return PlanCheck(plan.policy, tuple(rows), tuple(diffs))
