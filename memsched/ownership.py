"""Which parameters belong to a live scheduler: one parameter, one scheduler.

Attaching a submodule of an attached model, or a second model sharing a parameter, would leave two schedulers
writing one parameter (the first one's steps stop reaching it): refused by parameter, not by model object.
"""

from __future__ import annotations

import weakref

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
