"""Elastic placement: the plan follows the training's shapes (``memsched.attach(..., replan="auto")``).

The plan made at the end of warmup fits the warmup batch. Real training changes shape (collators pad to the
longest sequence, curricula grow it, the last batch is smaller), and ColossalAI Gemini's ``auto`` policy is
known to run out of memory there (its issues #2246, #3155). After warmup, memsched watches every step:

* **Measure.** Each step's peak non-model data is measured on the device, cheaply: the stand-in's peak counter
  or the CUDA caching allocator's peak (``torch.cuda.max_memory_allocated``), from the model's forward to
  ``optimizer.step()``, minus what was allocated when the forward began (the model data). It is remembered
  per *input signature* (the shapes of the forward's tensor inputs).
* **Before the forward that needs it.** The model's forward pre-hook sees each step's inputs. A signature
  whose peak was measured is planned for exactly (chunks move to the host if the plan in force does not leave
  it room). A signature that *exceeds* everything seen (some input has a dimension larger than the largest
  seen at that position, or a new input) has no measurement: the step runs conservatively with every chunk on
  the host (the ``cpu`` placement, the most room a plan can give), its peak is measured, and the plan is made
  from the measurement at the end of the step. A signature within what was seen needs nothing.
* **Out of memory that slips through.** An out-of-memory error raised in the forward or in
  :meth:`memsched.Scheduler.backward` leaves parameters and optimizer state untouched (the step never ran) and
  makes the next step conservative, as above. The loop users write::

      try:
          train_step(batch)
      except torch.OutOfMemoryError:
          optimizer.zero_grad(); train_step(batch)   # memsched re-planned with room

* **Shrinking back.** When the steps of the last ``shrink_after`` steps all measured less than the peak the
  plan was made for, the plan is remade for the largest of them (chunks move back to the device); the window
  keeps a rare long batch from causing a move on every step.

**Under torch.compile** the pre-hook is traced into the model's compiled graph. For a signature that needs
nothing (measured before, within the plan in force, one rank, no out-of-memory error pending) it compiles to
nothing: Dynamo guards on :attr:`Elastic.quiet`, an immutable tuple that changes only when the plan or the set
of such signatures does, so the steady state has no graph break and no recompilation. Any other case calls the
eager check through ``torch.compiler.disable`` (one graph break, at the start of the forward, only in the
graphs compiled for such steps). A dimension Dynamo made dynamic matches no quiet signature (comparing it
would specialise the graph to one length): with dynamic shapes every compiled step takes the eager check.
Steps whose compiled hook did nothing are not measured (nothing resets the peak there), so under compile the
plan does not shrink back. A forward that runs out of memory inside compiled code never reaches an
always-called hook; the ``optimizer.zero_grad()`` of the retry loop, called in the ``except`` block, tells
memsched instead.

Every change is a :class:`PlanChange` in ``sched.plan_history`` (the first is the plan made at the end of
warmup), with the bytes it moved (also in ``sched.transfers["chunk_moves_bytes"]``).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_flatten

from policies.types import PlacementPlan

Signature = tuple[tuple[int, ...], ...]
MEASURED_KEPT = 4096  # signatures whose measured peak is remembered (least recently seen dropped first)
QUIET_KEPT = 16  # the most recently seen of them that a compiled pre-hook can pass without a graph break


@dataclass(frozen=True)
class PlanChange:
    """One plan in force from ``step`` (the optimizer step count when it was made) on.

    ``reason``: why it was made; ``plan``: the :class:`policies.PlacementPlan`;
    ``predicted_peak_non_model_bytes``: the peak non-model data it was made for, bytes (``None`` for a
    conservative all-host step, made before the peak is known); ``moved_bytes``: optimizer state it moved.
    """

    step: int
    reason: str
    plan: PlacementPlan
    predicted_peak_non_model_bytes: int | None
    moved_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON form: the fields, with the plan's placement only (``"device"``/``"host"`` per chunk)."""
        return {"step": self.step, "reason": self.reason, "placement": list(self.plan.placement),
                "predicted_peak_non_model_bytes": self.predicted_peak_non_model_bytes,
                "moved_bytes": self.moved_bytes}


def signature(args: Sequence[Any], kwargs: dict[str, Any]) -> Signature:
    """The shapes of the tensors among a forward's inputs, in ``tree_flatten`` order."""
    leaves, _ = tree_flatten((tuple(args), kwargs))
    return tuple(tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor))


def covers(big: Signature, small: Signature) -> bool:
    """``big`` has the same number of inputs as ``small``, with the same ranks, and every dimension at least
    as large."""
    return len(big) == len(small) and all(len(a) == len(b) and all(x <= y for x, y in zip(a, b, strict=True))
                                          for a, b in zip(small, big, strict=True))


def exceeds(sig: Signature, seen: Sequence[Signature]) -> bool:
    """True when no signature in ``seen`` covers ``sig``. Larger batches, longer sequences and larger images
    all exceed; the last, smaller batch of an epoch does not."""
    return not any(covers(s, sig) for s in seen)


def add_maximal(seen: list[Signature], sig: Signature) -> None:
    """Add ``sig`` to ``seen`` unless covered, dropping what it covers: ``seen`` stays the few largest
    signatures, so the check stays cheap when every batch has its own shape."""
    if not exceeds(sig, seen):
        return
    seen[:] = [s for s in seen if not covers(sig, s)]
    seen.append(sig)


class PeakProbe:
    """The device's peak allocated bytes between :meth:`begin` and :meth:`read`, minus what was allocated at
    :meth:`begin`: the step's non-model data, bytes. ``sim``: the stand-in (its peak counter); otherwise the
    CUDA caching allocator of ``device``."""

    def __init__(self, device: torch.device, sim: Any = None,
                 absent_bytes: Callable[[], int] | None = None, moving: Any = None) -> None:
        self.device, self.sim = device, sim
        self.absent_bytes = absent_bytes
        # model data that comes and goes within a step (parameters fetched for their reads): ``begin()`` at
        # the probe's begin, ``correction()`` at its read (see [Note: parameters in the measured peak])
        self.moving = moving
        self.base: int | None = None
        self._moving_at_begin = 0

    @property
    def available(self) -> bool:
        return self.sim is not None or self.device.type == "cuda"

    def begin(self) -> None:
        # [Note: gradients in the measured peak]
        # The plan counts a device chunk's gradient buffer as resident model data, but with one rank it exists
        # only from backward on, and a host chunk's gradients only on their way to the host (the plan counts
        # their working set, from the warmup trace, apart). Counting both in the base keeps the measurement
        # what the plan in force needs: plan + measured <= capacity still bounds the real peak. A step under
        # a plan with more chunks on the device measures less than under the all-host step of the same
        # inputs (its gradients are counted whole by the plan): a plan made from such a measurement keeps at
        # least as many chunks on the device, or re-measures inputs that exceed what was seen.
        absent = self.absent_bytes() if self.absent_bytes is not None else 0
        if self.moving is not None:
            self.moving.begin()
        if self.sim is not None:
            self.base = self.sim.reset_peak() + absent
            self._moving_at_begin = self.sim.moving_bytes
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device) + absent

    def cancel(self) -> None:
        """The measurement begun is void (the step failed); :meth:`read` gives ``None`` until the next
        begin."""
        self.base = None

    def read(self) -> int | None:
        """The peak non-model bytes since :meth:`begin` (``None`` when not begun)."""
        if self.base is None:
            return None
        # [Note: parameters in the measured peak]
        # Parameters fetched for their reads come and go within the step; the plan counts them apart (its
        # schedule). The stand-in leaves them out of its fixed peak. On CUDA the base holds those on the
        # device at the begin, and at the peak at least the fewest that were on the device at any read since
        # were there: adding the difference bounds the non-model data.
        if self.sim is not None:
            peak, correction = self.sim.peak_fixed_bytes + self._moving_at_begin, 0
        else:
            peak = torch.cuda.max_memory_allocated(self.device)
            correction = self.moving.correction() if self.moving is not None else 0
        out, self.base = max(0, int(peak) - self.base + correction), None  # a forward's peak may be lower
        return out


class Elastic:
    """The re-planning of one scheduler (see the module docstring).

    During warmup it only measures (:meth:`start` begins the re-planning, with the peak the warmup plan was
    made for).

    Args:
        replan: ``f(peak_non_model_bytes or None, reason)``: make and apply a plan (``None``: the conservative
            all-host plan) and record it in the plan history when it differs from the plan in force.
        agree: ``f([ints]) -> [ints]``: element-wise maximum over the data-parallel ranks (identity with one).
        probe: the peak measurement.
        shrink_after: steps below the planned peak before the plan is remade smaller (>= 1).

    Raises:
        ValueError: ``shrink_after`` is not an integer >= 1.
    """

    def __init__(self, replan: Callable[[int | None, str], None], agree: Callable[[list[int]], list[int]],
                 probe: PeakProbe, shrink_after: int = 50, world: int = 1) -> None:
        if isinstance(shrink_after, bool) or not isinstance(shrink_after, int) or shrink_after < 1:
            raise ValueError(f"shrink_after must be an integer >= 1 step, got {shrink_after!r}")
        self.replan, self.agree, self.probe = replan, agree, probe
        self.active = False  # re-planning on (after warmup); before, steps are only measured
        self.planned_peak: int | None = None
        self.seen: list[Signature] = []  # the maximal signatures seen (add_maximal)
        self.measured: OrderedDict[Signature, int] = OrderedDict()  # the last MEASURED_KEPT signatures
        self.recent: deque[int] = deque(maxlen=shrink_after)
        self.oom = False
        self.world = world
        # Signatures that need nothing before their forward (measured, within the plan in force): what a
        # compiled pre-hook checks; replaced, never mutated, and only when it changes (Dynamo guards on it).
        self.quiet: tuple[Signature, ...] = ()
        self._sig: Signature | None = None  # the signature of the step in progress (its first forward)
        self.failed: Signature | None = None  # the inputs of the last step that ran out of memory

    def start(self, planned_peak: int, discount: int = 0) -> int:
        """Re-planning begins; ``planned_peak``: the peak non-model data the warmup plan was made for (the
        tracer's). Returns the peak the plan in force stands for: the larger of it and what the warmup steps'
        own measurement gave (the two count the same bytes, up to the step's temporaries). ``discount``
        (bytes): what the probe's base leaves out of later measurements, but the warmup steps' held (the host
        chunks' gradient working set, known once warmup ends); it comes off those."""
        self.active = True
        if discount:
            self.measured = OrderedDict((sig, max(0, v - discount)) for sig, v in self.measured.items())
        self.planned_peak = max([planned_peak, *self.measured.values()])
        self._update_quiet()
        return self.planned_peak

    # ---- hooks --------------------------------------------------------------------------------------------
    def before_forward(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """The model's forward pre-hook: plan for this step's inputs before they run (traceable by Dynamo:
        see the module docstring)."""
        if torch.compiler.is_compiling():
            if self._sig is not None or not torch.is_grad_enabled():
                return
            sig = signature(args, kwargs)
            if self.active and not self.oom and self.world == 1 and _quiet(sig, self.quiet):
                self._sig = sig  # nothing to do: the compiled graph holds no memsched code
                return
            _before_forward_eager(self, args, kwargs)
            return
        if self._sig is not None:  # a later forward of the same step (gradient accumulation)
            return
        if not torch.is_grad_enabled():  # evaluation: no step follows; training shapes decide the plan
            return
        sig = signature(args, kwargs)
        self._sig = sig
        if not self.active:  # warmup: measured only
            add_maximal(self.seen, sig)
            self.probe.begin()
            return
        new = exceeds(sig, self.seen) and sig not in self.measured
        flags = self.agree([int(new), int(self.oom), self.measured.get(sig, 0)])  # every rank, one plan
        new, oom, known = bool(flags[0]), bool(flags[1]), flags[2]
        self.oom = False
        add_maximal(self.seen, sig)
        if new or oom:
            why = ("out of memory in the last step" if oom else
                   f"inputs {shapes(sig)} exceed the largest seen; their peak is not known yet")
            self.replan(None, f"{why}: every chunk on the host for this step, which is measured")
            self.planned_peak = None
        elif self.planned_peak is not None and known > self.planned_peak:
            self._replan_for(known, f"inputs {shapes(sig)} were measured at a larger peak")
        self.probe.begin()

    def on_oom(self) -> None:
        """An out-of-memory error escaped the forward or ``sched.backward``: the next step makes room."""
        self.oom = True
        self.failed, self._sig = self._sig, None
        self.probe.cancel()

    @property
    def in_progress(self) -> Signature | None:
        """The inputs of the step in progress (from its first forward to its step), or ``None``."""
        return self._sig

    def estimate(self, sig: Signature) -> tuple[int, Signature, int] | None:
        """About the peak non-model data of inputs ``sig`` (bytes), scaled linearly by element count from the
        measured signature with the largest peak per element: ``(estimate, that signature, its peak)``;
        ``None`` when nothing was measured."""
        best = None
        for s, peak in self.measured.items():
            n = sum(math.prod(d) for d in s) or 1
            if best is None or peak / n > best[2] / best[3]:
                best = (s, peak, peak, n)
        if best is None:
            return None
        s, peak, _, n = best
        return int(peak * (sum(math.prod(d) for d in sig) or 1) / n), s, peak

    def after_step(self) -> None:
        """End of a step (after ``optimizer.step()``): record its measured peak, finish a conservative step,
        shrink back after a long enough run of smaller steps."""
        self._record_step()
        if self.active:
            self._update_quiet()

    def _record_step(self) -> None:
        sig, self._sig = self._sig, None
        peak = self.probe.read()
        if sig is None or peak is None:
            return
        (peak,) = self.agree([peak])
        self.measured[sig] = max(peak, self.measured.get(sig, 0))
        self.measured.move_to_end(sig)
        if len(self.measured) > MEASURED_KEPT:  # every batch may have its own shape: keep memory bounded
            self.measured.popitem(last=False)
        if not self.active:
            return
        self.recent.append(peak)
        if self.planned_peak is None:  # the conservative step: plan from what it measured
            self._replan_for(max(self.recent), f"measured peak of inputs {shapes(sig)}")
        elif len(self.recent) == self.recent.maxlen and max(self.recent) < self.planned_peak:
            self._replan_for(max(self.recent),
                             f"the last {self.recent.maxlen} steps stayed below the planned peak")

    def _replan_for(self, peak: int, reason: str) -> None:
        self.replan(peak, reason)
        self.planned_peak = peak
        self._update_quiet()

    def _update_quiet(self) -> None:
        planned = self.planned_peak
        # The most recently seen only: a guard on a long tuple would cost every call.
        recent = itertools.islice(reversed(self.measured.items()), QUIET_KEPT)
        quiet = () if planned is None or not self.active else tuple(sorted(
            s for s, peak in recent if peak <= planned))
        if quiet != self.quiet:
            self.quiet = quiet


def _quiet(sig: Signature, quiet: tuple[Signature, ...]) -> bool:
    """``sig in quiet`` in compiled code, true only where it holds for every value of its dynamic dimensions.

    A dimension Dynamo made dynamic (``dynamic=True``, or automatic dynamic after a second shape) is symbolic
    here. ``sig in quiet`` would guard on it: the graph would be specialised to one length (a recompilation
    per length, then eager at torch's recompile limit), and with four or more quiet signatures torch's
    symbolic reasoning about the guard does not finish (torch 2.13). ``statically_known_true`` adds no guard:
    a dynamic dimension matches nothing, so such steps take the eager check (one graph break).
    """
    for q in quiet:
        if len(q) != len(sig):
            continue
        match = True
        for a, b in zip(q, sig, strict=True):
            if len(a) != len(b):
                match = False
                break
            for x, y in zip(a, b, strict=True):
                if not statically_known_true(x == y):
                    match = False
                    break
            if not match:
                break
        if match:
            return True
    return False


@torch.compiler.disable
def _before_forward_eager(elastic: Elastic, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """The eager check, called from compiled code (a graph break; see the module docstring)."""
    elastic.before_forward(args, kwargs)


def shapes(sig: Signature) -> str:
    """``sig`` as text, e.g. ``16x256, 16x256``."""
    return ", ".join("x".join(map(str, s)) or "scalar" for s in sig) or "(no tensors)"
