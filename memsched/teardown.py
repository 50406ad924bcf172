"""Which parameters belong to a live scheduler: one parameter, one scheduler.

Attaching a submodule of an attached model, or a second model sharing a parameter, would leave two schedulers
writing one parameter (the first one's steps stop reaching it): refused by parameter, not by model object.
"""

from __future__ import annotations

import contextlib
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

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
        self._model_ref = weakref.ref(model)
        self._params = list(params)  # claimed by claim(); released here
        self._handles: list[Any] = []
        self._waits: Any = None  # memsched.runtime.waits.H2DWaits
        self._store: Any = None  # memsched.chunks.ChunkStore
        self._optimizer: Any = None  # memsched.optim.hybrid_adamw.HybridAdamW
        self._sim: Any = None  # memsched.devices.simdevice.SimDevice
        self._warmup: Any = None  # memsched.runtime.warmup.WarmupTrace (its tracer and compiler stance)
        self._streams: Any = None  # memsched.devices.transfers.Streams (the stand-in link's copy threads)
        self._fetcher: Any = None  # memsched.runtime.param_fetch.ParamFetcher (its hooks and read guard)

    def add_handle(self, handle: Any) -> None:
        """A hook handle (anything with ``remove()``) to remove."""
        self._handles.append(handle)

    def track(self, *, sim: Any = None, store: Any = None, optimizer: Any = None, waits: Any = None,
              warmup: Any = None, streams: Any = None, params: Any = None) -> None:
        """The components to take down, as they are built (a part given once; ``None`` leaves it as it is)."""
        self._sim = sim if sim is not None else self._sim
        self._store = store if store is not None else self._store
        self._optimizer = optimizer if optimizer is not None else self._optimizer
        self._waits = waits if waits is not None else self._waits
        self._warmup = warmup if warmup is not None else self._warmup
        self._streams = streams if streams is not None else self._streams
        self._fetcher = params if params is not None else self._fetcher

    def remove(self) -> None:
        """Wait for copies in flight, then remove everything (idempotent)."""
        try:
            try:
                # the overlapped update in flight finishes; none overlaps later
                if self._optimizer is not None:
                    self._optimizer.detach()
                if self._store is not None:
                    for c in self._store.chunks:  # a read right after this must see the updated parameters
                        c.wait_h2d()
                        c.wait_d2h()
            finally:
                if self._warmup is not None:
                    self._warmup.stop()  # the tracer's hooks and modes, the compiler stance
        finally:
            # Every part comes off even when one raises (raised once all ran, earlier ones chained): the
            # stand-in's accounting mode, say, must not outlive a store whose close() ran out of memory.
            with contextlib.ExitStack() as parts:  # callbacks run last-pushed first
                parts.callback(self._forget_model)
                parts.callback(release, self._params)
                for part, method in ((self._sim, "stop"), (self._streams, "close"), (self._store, "close"),
                                     (self._fetcher, "remove"), (self._waits, "remove")):
                    if part is not None:
                        parts.callback(getattr(part, method))
                parts.callback(self._remove_handles)

    def _remove_handles(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _forget_model(self) -> None:
        model = self._model_ref()
        if model is not None:
            ATTACHED.discard(model)
