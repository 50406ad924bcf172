"""From the reads the warmup recorded (:class:`tracer.param_reads.Read`) to what a placement policy
schedules parameter fetches from: the step's chunk accesses, each with the most non-model data (and gradients
on their way to the host) the device holds from it to the next (:class:`policies.types.ChunkAccess`), and the
chunks each module's forward reads.

The reads name parameters, not chunks, so they outlive the re-packing at the end of warmup: they are mapped to
the chunks in force when the problem is built. One micro-batch is used (the first of the last warmup step):
its forward and its backward, re-forwards of checkpointed blocks included. The bytes come from the tracer's
samples taken between two reads (each read recorded the tracer's sample count): the peak of non-model data
plus gradients of every interval that closes between them, and of the one that closes after the second (a
read falls inside an interval, whose peak may come after it), so the figure bounds what the device holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.types import BACKWARD, FORWARD, ChunkAccess


def one_micro_batch(reads: Sequence[Any]) -> list[Any]:
    """The reads of the first training forward (and its backward) among ``reads``: from the first
    ``"begin"`` marker to the next."""
    begins = [k for k, r in enumerate(reads) if r.phase == "begin"]
    if not begins:
        return [r for r in reads if r.phase in (FORWARD, BACKWARD)]
    end = begins[1] if len(begins) > 1 else len(reads)
    return [r for r in reads[begins[0] + 1:end] if r.phase in (FORWARD, BACKWARD)]


def chunk_accesses(reads: Sequence[Any], param_chunk: Mapping[int, int], timeline: Any,
                   device: str | None = None, *, grad_working_bytes: int | None = None,
                   ) -> tuple[list[ChunkAccess], dict[str, tuple[int, ...]]]:
    """The step's chunk accesses and each module's chunks (see the module docstring).

    Args:
        reads: the recorded reads (``param``, ``phase``, ``sample``, ``module``), markers included.
        param_chunk: ``id(parameter) -> chunk index`` of the packing in force.
        timeline: the warmup trace (:class:`tracer.MemoryTimeline`), whose samples the reads'
            ``sample`` count.
        device: the traced device (default: the timeline's).
        grad_working_bytes: for a trace in which gradients did not leave the device (a fake trace of plain
            torch, ``memsched plan``): at most these bytes of the traced gradients count
            (:func:`non_model_grad_bytes`).

    Returns:
        ``(accesses, module_reads)``: the accesses in order (consecutive reads of one chunk in one phase
        merged), and ``module name -> chunks`` read while that module's forward (a re-forward in backward
        included) was the innermost running.
    """
    batch = [r for r in one_micro_batch(reads) if id(r.param) in param_chunk]
    dev = device or timeline.device
    samples = timeline.samples
    module_reads: dict[str, set[int]] = {}
    merged: list[tuple[int, str, int]] = []  # (chunk, phase, sample of its first read)
    for r in batch:
        ci = param_chunk[id(r.param)]
        if r.phase == FORWARD or r.module:  # a backward read outside any forward is no module's
            module_reads.setdefault(r.module, set()).add(ci)
        if not merged or merged[-1][:2] != (ci, r.phase):
            merged.append((ci, r.phase, r.sample))
    out = []
    for k, (ci, phase, start) in enumerate(merged):
        stop = merged[k + 1][2] if k + 1 < len(merged) else len(samples) - 1
        window = samples[start:max(stop, start) + 1] if start < len(samples) else samples[-1:]
        peak = max((non_model_grad_bytes(s, grad_working_bytes) for s in window if s.device == dev),
                   default=0)
        out.append(ChunkAccess(ci, phase, peak))
    return out, {m: tuple(sorted(v)) for m, v in module_reads.items()}


def non_model_grad_bytes(sample: Any, grad_working_bytes: int | None = None) -> int:
    """The most non-model data and gradients a timeline sample's interval held, bytes (a version-1 sample,
    without the figure: its non-model peak plus its gradient bytes); with ``grad_working_bytes``, at most
    that much of the gradients (a trace in which gradients did not leave the device)."""
    v = sample.peak_non_model_grad_bytes
    total = int(v if v is not None else sample.peak_non_model_bytes + sample.bytes.get("gradient", 0))
    if grad_working_bytes is None:
        return total
    return sample.peak_non_model_bytes + min(total - sample.peak_non_model_bytes, grad_working_bytes)


def scaled(accesses: Sequence[ChunkAccess], peak: int, traced_peak: int) -> list[ChunkAccess]:
    """``accesses`` for a step whose peak non-model data is ``peak`` instead of the traced ``traced_peak``
    (elastic re-planning): every access's bytes scaled by their ratio, rounded up (never below the
    traced figure when the peak grew)."""
    if traced_peak <= 0 or peak == traced_peak:
        return list(accesses)
    return [ChunkAccess(a.chunk, a.phase, -(-a.non_model_bytes * peak // traced_peak)) for a in accesses]
