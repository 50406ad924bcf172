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
