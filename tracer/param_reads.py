"""Which parameters a traced step reads, and when: the input of a parameter-fetch schedule.

A parameter is read by the forward of the module that holds it (a re-forward of a checkpointed block in
backward included) and by backward when it unpacks what forward saved of it (``F.linear`` saves its weight,
or a view of it). :class:`ParamReads` records each read as a :class:`Read`: the parameter, the phase, the
tracer's sample count at that moment (so the read can be placed on the memory timeline) and the innermost
module running; and, as ``"grad"`` events, each time backward accumulates a parameter's gradient (from which
the gradients alive at each moment follow, for any packing of the parameters into buffers). It works on real
and on fake tensors (``FakeTensorMode``), and installs nothing that outlives its ``with`` block.

The idea of recording the parameter accesses of a warmup step to plan fetches comes from ColossalAI Gemini
(its compute list) and DeepSpeed ZeRO-3 (its recorded module trace). The scheduler records more than this
(reads by torch functions outside a module's forward, through its read guard: ``memsched.runtime``); a plan
made from these reads alone is a prediction, checked against the scheduler's own at runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from tracer.hook_handles import Detachable
from tracer.ops import graph_task_id

FORWARD, BACKWARD, BEGIN, GRAD, END = "forward", "backward", "begin", "grad", "end"


def phase_now() -> str:
    """``"backward"`` while the autograd engine runs on this thread (a checkpointed block's re-forward
    included), else ``"forward"``."""
    task = graph_task_id()
    return BACKWARD if task is not None and task != -1 else FORWARD


@dataclass(frozen=True)
class Read:
    """One read of a parameter in a traced step.

    Attributes:
        param: the parameter read (``None`` for a ``"begin"`` marker: a training forward starts).
        phase: ``"forward"``, ``"backward"``, ``"begin"``, ``"grad"`` (its gradient was accumulated) or
            ``"end"`` (a backward pass ended; ``param`` is ``None``).
        sample: the tracer's sample count when it was read (an index into the timeline's samples).
        module: the innermost module whose forward was running (``""``: the root, or none).
    """

    param: torch.nn.Parameter | None
    phase: str
    sample: int
    module: str


class ParamReads:
    """Record the reads of ``model``'s parameters while it is entered (see the module docstring).

    Args:
        model: the traced model (hooks on its modules, removed on exit).
        sample: the tracer's sample count now (:attr:`tracer.MemoryTracer.sample_count`).

    Attributes:
        reads: the reads so far, a ``"begin"`` marker before each training forward of the root.
    """

    def __init__(self, model: torch.nn.Module, sample: Callable[[], int]) -> None:
        self.model = model
        self.reads: list[Read] = []
        self._sample = sample
        self._stack: list[str] = []
        self._handles: list[Any] = []
        self._saved: Any = None
        self._storages: dict[int, torch.nn.Parameter] = {}
        self._in_backward = False

    def __enter__(self) -> ParamReads:
        self._storages = {id(p.untyped_storage()): p for p in self.model.parameters()}
        for p in self.model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(Detachable(self._grad_made)))
        for name, m in self.model.named_modules():
            own = list(m.parameters(recurse=False))
            root = m is self.model
            self._handles.append(m.register_forward_pre_hook(Detachable(self._pre(name, own, root))))
            self._handles.append(m.register_forward_hook(Detachable(self._post(root)), always_call=True))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._leave_saved()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, name: str, own: list[torch.nn.Parameter], root: bool) -> Callable[..., None]:
        def pre(*_a: Any) -> None:
            phase = phase_now()
            if root and phase == FORWARD and torch.is_grad_enabled() and self._saved is None:
                self.reads.append(Read(None, BEGIN, self._sample(), ""))
                # a forward's saved parameters are named by these until backward unpacks them
                self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                self._saved.__enter__()
            self._stack.append(name)
            self._record(own, phase)
        return pre

    def _post(self, root: bool) -> Callable[..., None]:
        def post(*_a: Any) -> None:  # returns nothing: a value would replace the module's output
            if self._stack:
                self._stack.pop()
            if root and phase_now() == FORWARD:
                self._leave_saved()
        return post

    def _grad_made(self, p: torch.nn.Parameter) -> None:
        if not self._in_backward:  # the backward's end is marked once it is over
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        self.reads.append(Read(p, GRAD, self._sample(), ""))

    def _backward_end(self) -> None:
        self._in_backward = False
        self.reads.append(Read(None, END, self._sample(), ""))

    def _leave_saved(self) -> None:
        if self._saved is not None:
            saved, self._saved = self._saved, None
            saved.__exit__(None, None, None)

    def _record(self, params: list[torch.nn.Parameter], phase: str) -> None:
        if not params or not (torch.is_grad_enabled() or phase == BACKWARD):
            return  # an evaluation forward is not a training step's read
        module = self._stack[-1] if self._stack else ""
        sample = self._sample()
        self.reads.extend(Read(p, phase, sample, module) for p in params)

    def _pack(self, t: torch.Tensor) -> Any:
        p = self._storages.get(id(t.untyped_storage())) if isinstance(t, torch.Tensor) else None
        return (p, t) if p is not None else t

    def _unpack(self, saved: Any) -> Any:
        if isinstance(saved, tuple):
            p, t = saved
            self._record([p], BACKWARD)
            return t
        return saved
