"""Pipeline stages: a model whose forwards run several micro-batches ahead of their backwards, as under
``torch.distributed.pipelining``'s schedules (GPipe, 1F1B, interleaved) or any code that does the same.

[Note: micro-batches in flight]
A data-parallel stage of a pipeline accumulates every micro-batch's gradients locally and averages them over
its data-parallel group once per step, after the last micro-batch's backward: that is what plain torch does
there (``all_reduce(SUM) / world`` after ``schedule.step()``), and the schedule scales the local gradients
by ``1 / n_microbatches`` between the two (``scale_grads``). Reducing at the end of each micro-batch's
backward, as :class:`memsched.distributed.grad_reduction.GradientReducer` does for a plain backward, would
average
every micro-batch separately (the sum of averages is not bit-identical to the average of sums) and, at ZeRO-2
and 3, leave sharded gradients for the schedule's in-place scaling to refuse. So once a stage is recognised,
every gradient reduction waits for the step (``optimizer.step()`` or ``sched.clip_grad_norm_``), as under
``no_sync``: the whole local gradient buffers are kept across the micro-batches (FSDP's
``set_requires_gradient_sync(False)`` under torch's pipeline schedules), and each chunk is reduced once per
step.

A stage is recognised, before the first backward of a step, by either of:

* a forward of the model begins while an earlier forward's output is alive and no backward has reached it
  (several micro-batches in flight: every stage of GPipe, every stage but the last of 1F1B);
* a forward's tensor input is a leaf that requires grad (a stage's received activations, whose gradient goes
  back to the previous stage: every stage but the first, so also 1F1B's last stage, which runs each
  micro-batch's backward right after its forward).

Both are properties of the program's order, the same on every rank of a data-parallel group that runs the same
schedule, so every rank defers the same reductions. Once recognised a model stays a stage. Deferring is exact
for any other code too; what it costs there is the overlap of reductions with backward and, at ZeRO-2 and 3,
the whole gradient buffers kept until the step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tracer.ops import is_metadata


class _Forward:
    """One forward's outputs that require grad (weakly held) and whether a backward has reached them."""

    __slots__ = ("outputs", "reached")

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        self.outputs = [weakref.ref(t) for t in outputs]
        self.reached = False

    def in_flight(self) -> bool:
        return not self.reached and any(r() is not None for r in self.outputs)


class MicroBatchesInFlight:
    """Recognises a pipeline stage from its forwards (see [Note: micro-batches in flight]).

    Attributes:
        detected: why the model was recognised as a pipeline stage (a sentence), or ``None``.
        on_detect: called once, with the reason, when the model is first recognised.
    """

    def __init__(self, on_detect: Callable[[str], None] | None = None) -> None:
        self.detected: str | None = None
        self.on_detect = on_detect
        self._flights: list[_Forward] = []

    def install(self, model: torch.nn.Module) -> list[Any]:
        """Hook ``model``'s forward; returns the hook handles (removed with the scheduler's hooks)."""
        return [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                model.register_forward_hook(self._post)]

    def _detect(self, reason: str) -> None:
        if self.detected is None:
            self.detected = reason
            if self.on_detect is not None:
                self.on_detect(reason)

    @staticmethod
    def _recording() -> bool:
        # a forward that records a graph, not one re-run inside a backward (activation checkpointing)
        return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def _pre(self, _module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.detected is not None or not self._recording():
            return
        self._flights = [f for f in self._flights if f.in_flight()]
        if self._flights:
            self._detect("a forward began while an earlier forward's output awaited its backward (several "
                         "micro-batches in flight)")
            return
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is None:
                self._detect("a forward's input is a leaf that requires grad (activations received from an "
                             "earlier pipeline stage)")
                return

    def _post(self, _module: torch.nn.Module, _args: tuple, output: Any) -> None:
        if self.detected is not None or not self._recording():
            return
        outs = [t for t in pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not outs:
            return
        flight = _Forward(outs)
        self._flights.append(flight)

        def reached(_grad_outputs: Any) -> None:
            flight.reached = True

        for fn in {id(t.grad_fn): t.grad_fn for t in outs}.values():
            fn.register_prehook(reached)


class DeferredGradients:
    """[Note: gradients read before their reduction]
    A pipeline stage's gradients are reduced at the step ([Note: micro-batches in flight]), after the
    schedule's ``scale_grads``. Between the stage's last backward and the step they are this rank's own, and
    torch's ``clip_grad_norm_(model.parameters())`` (Trainer, Accelerate and every plain loop call it there)
    would clip with a local norm on each rank: a silently different model. So a stage's gradients are marked
    as their chunk completes in a backward; the first torch function that computes from one (a norm, a sum;
    not an attribute read or an in-place write, such as ``scale_grads``' division) reduces every chunk first
    (ZeRO-0 and 1: in place, into the buffers the gradients view) and then runs on the averaged gradients,
    as plain torch's clip after its own ``all_reduce`` does, bit for bit. At ZeRO-2 and 3 the reduction
    leaves shards whose buffers the marked gradients no longer view: such a read is refused, naming
    ``sched.clip_grad_norm_``. The marks go at the reduction, the step and ``zero_grad``.

    Args:
        flush: reduces every chunk now (the reducer's ``before_update``).
        sharded: whether the reduction leaves shards (ZeRO-2 and 3).
    """

    def __init__(self, flush: Callable[[], Any], sharded: bool) -> None:
        self._flush = flush
        self._sharded = sharded
        self._marked: list[torch.Tensor] = []

    def arm(self, grads: list[torch.Tensor]) -> None:
        """Mark ``grads`` too (a chunk's gradients, complete in a backward of the stage)."""
        for g in grads:
            if id(g) in _ARMED:
                continue
            cls = type(g)
            marked = _DEFERRED_TYPES.get(cls)
            if marked is None:
                marked = _DEFERRED_TYPES[cls] = type(cls.__name__, (cls,), {
                    "__torch_function__": classmethod(_deferred_torch_function),
                    "__module__": cls.__module__, "__qualname__": cls.__qualname__})
            g.__class__ = marked
            _ARMED[id(g)] = weakref.ref(self)
            self._marked.append(g)

    def disarm(self) -> None:
        """Every gradient its own class again."""
        for g in self._marked:
            _ARMED.pop(id(g), None)
            if type(g) in _DEFERRED_TYPES.values():
                g.__class__ = type(g).__mro__[1]
        self._marked = []

    def read(self, func: Callable) -> None:
        """A torch function computes from a marked gradient: reduce first, or refuse (see the note).

        Raises:
            RuntimeError: ZeRO-2 or 3 (names the function and what to call instead).
        """
        self.disarm()
        if self._sharded:
            raise RuntimeError(
                f"memsched: {getattr(func, '__name__', func)} reads a pipeline stage's gradients before "
                "their reduction, at ZeRO-2/3 (each chunk is reduce-scattered once per step, at the step): "
                "call sched.clip_grad_norm_(...) instead of torch.nn.utils.clip_grad_norm_; it reduces first "
                "and clips with the global norm")
        self._flush()


_DEFERRED_TYPES: dict[type, type] = {}
_ARMED: dict[int, weakref.ref] = {}


def _deferred_torch_function(cls: type, func: Callable, types: tuple, args: tuple = (),
                             kwargs: dict | None = None) -> Any:
    kwargs = kwargs or {}
    name = getattr(func, "__name__", "").split(".")[0]  # an op overload: "add_.Tensor"
    # metadata and attribute reads, in-place writes (scale_grads) and the next micro-batch's backward (which
    # accumulates into the gradients) go through; anything else computing from them does not
    if (not is_metadata(func) and name != "__get__" and not (name.endswith("_") and not name.startswith("__"))
            and torch._C._current_graph_task_id() == -1):
        owners = {id(o): o for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
                  and (r := _ARMED.get(id(a))) is not None and (o := r()) is not None}
        with torch._C.DisableTorchFunctionSubclass():
            for owner in owners.values():
                owner.read(func)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)
