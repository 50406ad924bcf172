"""From the reads a traced step recorded (:class:`tracer.param_reads.Read`) to what a placement policy
schedules parameter fetches from: the step's chunk accesses, each with the most non-model data and gradients
on their way to the host the device holds from it to the next (:class:`policies.types.ChunkAccess`), and
what those gradients add to the peak of non-model data.

The reads name parameters, not chunks, so they outlive the re-packing at the end of warmup: they are mapped to
the chunks in force when the problem is built. One micro-batch is used (the first of the last warmup step):
its forward and its backward, re-forwards of checkpointed blocks included. The bytes come from the tracer's
samples taken between two reads (each read recorded the tracer's sample count): the peak of every interval
that closes between them, and of the one that closes after the second (a read falls inside an interval,
whose peak may come after it), so the figure bounds what the device holds.

[Note: gradients in flight]
A host chunk's gradient buffer is on the device from the first gradient backward makes for one of its
parameters to the last (then it goes to the host, :mod:`memsched.chunks.grad_offload`). Which buffers are
alive together depends on the packing: the warmup traced another one (registration order), and a fake trace
of plain torch keeps every gradient. So the figures are the samples' non-model data plus the buffers the
recorded ``"grad"`` events put alive at each sample in the packing in force: a tied embedding whose first
gradient comes at the head and last at the lookup keeps its chunk's buffer alive through backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.types import BACKWARD, FORWARD, ChunkAccess
from tracer.param_reads import END, GRAD


def one_micro_batch(reads: Sequence[Any]) -> list[Any]:
    """The reads (and gradient events) of the first training forward and its backward among ``reads``: from
    a ``"begin"`` marker to the next, the first such segment whose backward ran (a forward that raised,
    an evaluation under ``no_grad``, has none), else the first."""
    begins = [k for k, r in enumerate(reads) if r.phase == "begin"]
    kept = (FORWARD, BACKWARD, GRAD, END)
    if not begins:
        return [r for r in reads if r.phase in kept]
    segments = [reads[b + 1:e] for b, e in zip(begins, [*begins[1:], len(reads)], strict=True)]
    trained = next((s for s in segments if any(r.phase in (BACKWARD, GRAD, END) for r in s)), segments[0])
    return [r for r in trained if r.phase in kept]


def grads_in_flight(batch: Sequence[Any], param_chunk: Mapping[int, int], n_samples: int) -> list[int] | None:
    """Per sample of the trace, the most chunk gradient buffers alive at once during its interval (see
    [Note: gradients in flight]): a chunk's buffer is alive from its parameters' first ``"grad"`` event of a
    backward pass to their last one before the pass's ``"end"`` (its gradients then go to the host). The
    events are swept in order, so passes that share a sample (nested backward passes of reentrant
    checkpointing) do not add up. ``None`` when no gradient event was recorded."""
    events = [r for r in batch if r.phase == END or (r.phase == GRAD and id(r.param) in param_chunk)]
    if not any(r.phase == GRAD for r in events):
        return None
    # the last event of each chunk in each backward pass (a pass ends at an "end" marker)
    last: dict[tuple[int, int], int] = {}
    segment = 0
    for k, r in enumerate(events):
        if r.phase == END:
            segment += 1
        else:
            last[(segment, param_chunk[id(r.param)])] = k
    alive = [0] * n_samples
    open_: set[int] = set()
    segment, at = 0, 0  # at: the sample the sweep stands in
    for k, r in enumerate(events):
        for j in range(at + 1, min(r.sample, n_samples)):  # samples between events: what is open then
            alive[j] = max(alive[j], len(open_))
        at = max(at, r.sample)
        if r.phase == END:
            segment += 1
            open_.clear()
            continue
        ci = param_chunk[id(r.param)]
        open_.add(ci)
        if r.sample < n_samples:
            alive[r.sample] = max(alive[r.sample], len(open_))
        if last[(segment, ci)] == k:  # its gradients are complete: they leave for the host
            open_.discard(ci)
    return alive


def _figure(sample: Any, k: int, alive: list[int] | None, grad_bytes: int | None) -> int:
    """Sample ``k``'s non-model data and gradients in flight, bytes: from the recorded gradient events in
    this packing when given ``grad_bytes`` (and events), else as traced."""
    if grad_bytes is None or alive is None:
        v = sample.peak_non_model_grad_bytes
        return int(v if v is not None else sample.peak_non_model_bytes + sample.bytes.get("gradient", 0))
    return int(sample.peak_non_model_bytes) + alive[k] * grad_bytes


def chunk_accesses(reads: Sequence[Any], param_chunk: Mapping[int, int], timeline: Any,
                   device: str | None = None, *, grad_bytes: int | None = None,
                   ) -> list[ChunkAccess]:
    """The step's chunk accesses (see the module docstring).

    Args:
        reads: the recorded reads (``param``, ``phase``, ``sample``, ``module``), markers and gradient
            events included.
        param_chunk: ``id(parameter) -> chunk index`` of the packing in force.
        timeline: the trace (:class:`tracer.MemoryTimeline`), whose samples the reads' ``sample`` count.
        device: the traced device (default: the timeline's).
        grad_bytes: one chunk's gradient buffer, bytes: the gradients in flight are those the recorded
            gradient events put alive in this packing ([Note: gradients in flight]); ``None``: as traced.

    Returns:
        the accesses in order (consecutive reads of one chunk in one phase merged).
    """
    batch = one_micro_batch(reads)
    samples = timeline.samples
    alive = grads_in_flight(batch, param_chunk, len(samples))
    batch = [r for r in batch if id(r.param) in param_chunk]
    dev = device or timeline.device
    merged = _merged_reads(batch, param_chunk)
    out = []
    for k, (ci, phase, start) in enumerate(merged):
        stop = merged[k + 1][2] if k + 1 < len(merged) else len(samples) - 1
        first = min(start, len(samples) - 1)
        window = range(first, max(stop, first) + 1)
        peak = max((_figure(samples[j], j, alive, grad_bytes) for j in window if j < len(samples)
                    and samples[j].device == dev), default=0)
        out.append(ChunkAccess(ci, phase, peak))
    return out


def _merged_reads(batch: Sequence[Any], param_chunk: Mapping[int, int]) -> list[tuple[int, str, int]]:
    """The reads of one micro-batch as ``(chunk, phase, sample of its first read)``, consecutive reads of one
    chunk in one phase merged."""
    merged: list[tuple[int, str, int]] = []
    for r in batch:
        if r.phase == GRAD:
            continue
        ci = param_chunk[id(r.param)]
        if not merged or merged[-1][:2] != (ci, r.phase):
            merged.append((ci, r.phase, r.sample))
    return merged


def reordered(reads: Sequence[Any], param_chunk: Mapping[int, int], known: Sequence[ChunkAccess],
              ) -> list[ChunkAccess]:
    """The accesses of a step whose reads came in another order than the traced step's (a branch taken
    since, :meth:`memsched.planning.planner.Planner.revise`), recorded without a tracer: each access takes
    the most bytes ``known`` had for the same chunk and phase, else the most of any access (the peak)."""
    batch = [r for r in one_micro_batch(reads) if id(r.param) in param_chunk]
    merged = _merged_reads(batch, param_chunk)
    most: dict[tuple[int, str], int] = {}
    for a in known:
        most[(a.chunk, a.phase)] = max(most.get((a.chunk, a.phase), 0), a.non_model_bytes)
    peak = max(most.values(), default=0)
    return [ChunkAccess(ci, phase, most.get((ci, phase), peak)) for ci, phase, _ in merged]


def grad_working_bytes(reads: Sequence[Any], param_chunk: Mapping[int, int], timeline: Any, grad_bytes: int,
                       device: str | None = None) -> int | None:
    """What the host chunks' gradients in flight add to the peak of non-model data in the packing in force,
    bytes: the most non-model data and gradients in flight at once ([Note: gradients in flight]) less the
    peak of non-model data; ``None`` when no gradient event was recorded."""
    alive = grads_in_flight(one_micro_batch(reads), param_chunk, len(timeline.samples))
    if alive is None:
        return None
    dev = device or timeline.device
    on = [(k, s) for k, s in enumerate(timeline.samples) if s.device == dev]
    most = max((_figure(s, k, alive, grad_bytes) for k, s in on), default=0)
    return max(0, most - max((int(s.peak_non_model_bytes) for _, s in on), default=0))


def scaled(accesses: Sequence[ChunkAccess], peak: int, traced_peak: int) -> list[ChunkAccess]:
    """``accesses`` for a step whose peak non-model data is ``peak`` instead of the traced ``traced_peak``
    (elastic re-planning): each access's bytes shifted by the difference (never below 0). A shift bounds
    both causes of a change: inputs of another size (whose activations grow at most by the difference of
    the peaks before the peak, proportionally or less) and a plan whose step holds more at the same point
    (gradients on their way to the host that the trace did not have in flight together)."""
    if peak == traced_peak:
        return list(accesses)
    return [ChunkAccess(a.chunk, a.phase, max(0, a.non_model_bytes + peak - traced_peak)) for a in accesses]
