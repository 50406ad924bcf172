"""Which parameters belong to a live scheduler: one parameter, one scheduler.

Attaching a submodule of an attached model, or a second model sharing a parameter, would leave two schedulers
writing one parameter (the first one's steps stop reaching it): refused by parameter, not by model object.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

# Models a live Scheduler owns (their parameters are views into its chunks), and the parameters themselves:
# id(param) -> (weak reference to it, the owner's model class name).
ATTACHED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
OWNED: dict[int, tuple[weakref.ref, str]] = {}


def claim(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
    """Register ``params`` as owned by a scheduler of ``model``.

    Raises:
        RuntimeError: one of them is owned by another live scheduler (names it).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    for p in params:
        entry = OWNED.get(id(p))
        if entry is not None and entry[0]() is p:
            raise RuntimeError(
                f"parameter {names.get(id(p), tuple(p.shape))!r} is already managed by memsched (attached to "
                f"a {entry[1]}): a parameter can belong to one scheduler only; close() the other scheduler, "
                "or attach once to the model that holds every parameter")
    for p in params:
        OWNED[id(p)] = (weakref.ref(p), type(model).__name__)


def release(params: list[torch.nn.Parameter]) -> None:
    for p in params:
        entry = OWNED.get(id(p))
        if entry is not None and entry[0]() in (p, None):
            del OWNED[id(p)]


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """A callable that calls ``method`` while its object lives and does nothing after: for global hooks
    (torch's optimizer step hooks) that must not keep a scheduler alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        fn = ref()
        return fn(*args, **kwargs) if fn is not None else None

    return call


class Installed:
    """Everything one scheduler installs in the process: hooks, dispatch modes (the warmup tracer's, the
    stand-in's), the claim on its parameters. Removable without the scheduler, so that a scheduler that is
    never closed cleans up when it is garbage-collected (``weakref.finalize`` holds this, never the
    scheduler)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_ref = weakref.ref(model)
        self.params: list[torch.nn.Parameter] = []
        self.handles: list[Any] = []
        self.waits: Any = None
        self.store: Any = None
        self.optimizer: Any = None
        self.sim: Any = None
        self.tracer: Any = None
        self.eager: Any = None  # memsched.runtime.compile_stance.EagerDuringWarmup

    def remove(self) -> None:
        """Wait for copies in flight, then remove everything (idempotent)."""
        try:
            if self.optimizer is not None:  # the overlapped update in flight finishes; no later step overlaps
                self.optimizer.overlap = self.optimizer.early_d2h = False
                self.optimizer.timeline.stop()
                self.optimizer.host_updates.close()
            if self.store is not None:
                for c in self.store.chunks:  # a read right after this must see the updated parameters
                    c.wait_h2d()
                    c.wait_d2h()
            tracer, self.tracer = self.tracer, None
            if tracer is not None:
                tracer.__exit__(None, None, None)
        finally:
            if self.eager is not None:
                self.eager.stop()
            for h in self.handles:
                h.remove()
            self.handles.clear()
            if self.waits is not None:
                self.waits.remove()
            if self.store is not None:
                self.store.close()
            if self.optimizer is not None:
                self.optimizer.owner_thread = None
            if self.sim is not None:
                self.sim.stop()
            release(self.params)
            model = self.model_ref()
            if model is not None:
                ATTACHED.discard(model)
