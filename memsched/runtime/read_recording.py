"""The recording of parameter reads: what the plan's fetch schedule is made from.

:class:`ReadRecorder` owns the reads recorded (:attr:`ReadRecorder.reads`, :class:`tracer.param_reads.Read`:
the parameter, its phase, the tracer's sample count and the innermost module running), the stack of modules
whose forward runs and the sample counter. Its lifecycle: off until :meth:`ReadRecorder.start` (warmup, or a
step after reads off the schedule, :meth:`memsched.planning.planner.Planner.revise`), on until
:meth:`ReadRecorder.stop` hands the reads over. Each forward begins a ``"begin"`` read, each backward's end an
``END`` one, and each gradient made a ``GRAD`` one (for the gradients in flight). The parameter fetcher
(:class:`memsched.runtime.param_fetch.ParamFetcher`) tells it what is read; it decides nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from policies.types import BACKWARD
from tracer.param_reads import END, GRAD, Read


class ReadRecorder:
    """Every read of every chunk while recording (see the module docstring).

    Attributes:
        reads: the reads recorded so far, or ``None`` while not recording.
    """

    def __init__(self) -> None:
        self.reads: list[Read] | None = None
        self._stack: list[str] = []  # the modules whose forward is running
        self._sample: Callable[[], int] = lambda: 0

    @property
    def on(self) -> bool:
        """Reads are recorded."""
        return self.reads is not None

    def start(self, sample: Callable[[], int]) -> None:
        """Record from now on, each read with ``sample()`` (the tracer's sample count)."""
        self.reads = []
        self._sample = sample

    def stop(self) -> list[Read]:
        """The reads recorded; recording stops."""
        reads, self.reads = self.reads or [], None
        return reads

    def restart(self) -> None:
        """Only the reads from now on are kept (a warmup step that is not the last)."""
        if self.reads is not None:
            self.reads.clear()

    def record(self, params: Iterable[torch.nn.Parameter], phase: str) -> None:
        """``params`` are read now, in ``phase``: a training step's reads are recorded (an evaluation's
        forward is not), with the innermost module running."""
        if self.reads is not None and (torch.is_grad_enabled() or phase == BACKWARD):
            module = self._stack[-1] if self._stack else ""
            sample = self._sample()
            for p in params:
                self.reads.append(Read(p, phase, sample, module))

    def enter(self, name: str) -> None:
        """Module ``name``'s forward begins."""
        self._stack.append(name)

    def leave(self) -> None:  # a forward hook's: returning anything would replace the module's output
        """The innermost module's forward ends."""
        if self._stack:
            self._stack.pop()

    def forward_begins(self) -> None:
        """The root's forward begins (a step's, when it records a graph)."""
        self._stack.clear()
        if self.reads is not None and torch.is_grad_enabled():
            self.reads.append(Read(None, "begin", self._sample(), ""))  # type: ignore[arg-type]

    def grad_made(self, p: torch.nn.Parameter) -> None:
        """Backward made ``p``'s gradient."""
        if self.reads is not None:
            self.reads.append(Read(p, GRAD, self._sample(), ""))

    def backward_ends(self) -> None:
        """Backward's end: its gradients leave for the host, none is in flight any more."""
        if self.reads is not None:
            self.reads.append(Read(None, END, self._sample(), ""))  # type: ignore[arg-type]
