"""Hooks that stay behind when a model is copied: a copy of a hooked model gets inert hooks.

``copy.deepcopy(model)``, ``pickle.dumps(model)`` and ``torch.save(model)`` copy a module's hook dictionaries
(and a parameter's post-accumulate-grad hooks) with it. A hook bound to a tracer or a scheduler would drag
that whole object (dispatch-mode state, chunks, weak references) into the copy, which fails ("cannot pickle
'_Entry' object") or silently makes the copy report into the original's trace. Wrapped in :class:`Detachable`,
the hook acts on the original only; its copies are :func:`inert`, which does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def inert(*_args: Any, **_kwargs: Any) -> None:
    """What a copied hook becomes: nothing happens (picklable by reference)."""
    return None


class Detachable:
    """A hook callable that copies (``copy.deepcopy``, ``pickle``) as :func:`inert`."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return inert

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert_factory, ())


def _inert_factory() -> Callable[..., None]:
    return inert
