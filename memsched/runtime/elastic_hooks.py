"""The hooks that feed elastic placement (:mod:`memsched.planning.elastic`): the model's forward pre-hook
plans for the step's inputs, its always-called forward hook notices an out-of-memory error, and the
optimizer's ``zero_grad()`` notices one that a compiled forward raised (the retry loop calls it in its
``except``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from memsched.devices.simdevice import OUT_OF_MEMORY
from memsched.planning.elastic import Elastic
from tracer.hook_handles import Detachable


def install_elastic_hooks(model: torch.nn.Module, elastic: Elastic,
                          observe_zero_grad: Callable[[Callable[[], None]], None]) -> list[Any]:
    """Install the hooks on ``model`` and register the ``zero_grad`` observer through ``observe_zero_grad``;
    returns the hook handles (the caller removes them at ``close()``)."""

    def before(_m: torch.nn.Module, args: Any, kwargs: Any) -> None:
        elastic.before_forward(args, kwargs)

    def after(_m: torch.nn.Module, _args: Any, output: Any) -> None:
        # On failure torch calls always-called hooks inside its ``except`` with no output; a forward that
        # succeeds inside the user's own ``except`` (the retry) has an output. Compiled code never calls this
        # on failure (the retry loop's zero_grad() reports it: on_zero_grad below).
        if torch.compiler.is_compiling():
            return
        if output is None and isinstance(sys.exc_info()[1], OUT_OF_MEMORY):
            elastic.on_oom()

    def on_zero_grad() -> None:  # in the retry loop's ``except``: the compiled forward ran out of memory
        if isinstance(sys.exc_info()[1], OUT_OF_MEMORY):
            elastic.on_oom()

    observe_zero_grad(on_zero_grad)
    return [model.register_forward_pre_hook(Detachable(before), prepend=True, with_kwargs=True),
            model.register_forward_hook(Detachable(after), always_call=True)]
