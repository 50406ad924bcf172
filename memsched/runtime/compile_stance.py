"""torch.compile and the warmup: compiled code runs eagerly while memsched traces, and compiles after.

Dynamo refuses to compile a frame it first meets under a Python dispatch mode (the warmup tracer is one:
"non-infra torch dispatch mode present") and does not try that frame again, so a model compiled before or
after ``attach`` would run eagerly for the whole run. During warmup memsched sets torch's compiler stance
to ``"force_eager"`` (``torch.compiler.set_stance``, torch >= 2.6): compiled code runs eagerly, and Dynamo
neither compiles nor gives up on anything. At the end of warmup (or at ``close()``) the previous stance comes
back and the next call compiles. Older torch has no stance: nothing is done there. The step timeline's hooks
on the root module read ``time.perf_counter``, which Dynamo cannot trace: they break the graph before and
after the model's forward (the forward itself stays one graph).

The stand-in device (``sim:``) is a real PyTorch device whose capacity is enforced by its allocator, not by a
dispatch mode, so compiled code compiles there after warmup too: Dynamo's ``eager`` and ``aot_eager``
backends as asked, and torch.compile's default backend, Inductor, through ``aot_eager``, said once
([Note: torch.compile's default backend on the stand-in]).

[Note: one stance for every scheduler]
The stance is the process's. ``set_stance`` returns what restores the stance before it, so stances entered
by two schedulers whose warmups overlap (two models, a bench's interleaved runs) and left out of order would
restore the first one's ``force_eager`` last: every later compiled call of the process would run eagerly,
silently. So the schedulers share one hold: the first to start enters ``force_eager``, the last to stop
restores the stance from before the first.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from typing import Any

import torch

_lock = threading.Lock()
_holders: set[int] = set()  # ids of the EagerDuringWarmup objects holding the stance now
_restore: list[Any] = []  # what restores the stance from before the first holder (while there are holders)


class EagerDuringWarmup:
    """Holds the ``force_eager`` stance from :meth:`start` to :meth:`stop` (idempotent; see the module
    docstring and [Note: one stance for every scheduler])."""

    def start(self) -> None:
        set_stance = getattr(torch.compiler, "set_stance", None)
        with _lock:
            if set_stance is None or id(self) in _holders:
                return
            if not _holders:
                _restore.append(set_stance("force_eager"))  # sets it now; keeps the previous stance
            _holders.add(id(self))

    def stop(self) -> None:
        with _lock:
            if id(self) not in _holders:
                return
            _holders.discard(id(self))
            if not _holders:
                _restore.pop().__exit__(None, None, None)  # the stance in force before the first start()


# [Note: torch.compile's default backend on the stand-in]
# Inductor generates code per device type, and its scheduler and lowerings decide by "is this the CPU?" in
# many places, so the stand-in cannot pass as the CPU there (registering the CPU's code generators for "sim"
# gets as far as the fusion pass and fails in its GPU branch); without a registration the first compiled
# step after warmup died inside Inductor (LoweringException / KeyError 'sim'). So torch.compile's default
# backend (torch._TorchCompileInductorWrapper, what `torch.compile(model)` and `model.compile()` use) runs a
# graph whose inputs are on the stand-in through `aot_eager` instead: Dynamo still captures the graph and AOT
# autograd still traces forward and backward, then torch's own kernels run them, with eager's numbers and
# memory (the stand-in's purpose), not Inductor's fused speed. A UserWarning says so once per process. Graphs
# on other devices go to Inductor as before. Installed when the stand-in is loaded, as part of its
# registration (which cannot be undone); a torch without that wrapper class is left alone.
_routed = False
_warned = False
STAND_IN_COMPILE_WARNING = (
    "memsched: torch.compile's default backend (inductor) cannot generate code for the stand-in device "
    "'sim'; graphs on it run through backend='aot_eager' instead (traced and functionalized, torch's own "
    "kernels: eager's numbers and memory, not inductor's speed). Pass backend='aot_eager' to torch.compile "
    "to say so yourself")


def _on_the_stand_in(inputs: Iterable[Any], name: str) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == name for t in inputs)


def route_inductor_around_the_stand_in(name: str = "sim") -> bool:
    """Make torch.compile's default backend run graphs whose inputs are on the stand-in device ``name``
    through ``aot_eager``, with one warning per process ([Note: torch.compile's default backend on the
    stand-in]). Idempotent; returns whether the route is in place."""
    global _routed
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    call = getattr(wrapper, "__call__", None)  # noqa: B004 - the class's method, not callable()
    if call is None:
        return False
    with _lock:
        if _routed:
            return True

        def __call__(self: Any, model_: Any, inputs_: Any, *args: Any, **kwargs: Any) -> Any:
            if _on_the_stand_in(inputs_, name):
                _warn_once()
                from torch._dynamo.backends.registry import lookup_backend

                return lookup_backend("aot_eager")(model_, inputs_)
            return call(self, model_, inputs_, *args, **kwargs)

        wrapper.__call__ = __call__  # type: ignore[union-attr]
        _routed = True
    return True


def _warn_once() -> None:
    global _warned
    with _lock:
        if _warned:
            return
        _warned = True
    warnings.warn(STAND_IN_COMPILE_WARNING, UserWarning, stacklevel=2)
