"""A module of an attached model moved or converted after attach is refused at the move, whichever module
the framework calls.

``model.cpu()``, ``.to(device)``, ``.half()``, ``.double()`` (Lightning moves the module after ``fit`` and at
``test``) would give memsched's chunked parameters new storage: its updates would then go to the chunks and
never reach the model. The forward's check (:meth:`memsched.chunks.binding.ChunkBindings.check_bound`)
catches that at the attached root's next forward only; a framework that calls a child module, or an
evaluation under ``no_grad``, would meet torch's device error instead. So ``nn.Module._apply`` (every move and
conversion goes through it) checks, while a scheduler is attached to the module, what its function would make
of each (dtype, device) its chunked parameters have, on an empty tensor of that kind, before anything moves: a
change is refused with memsched's error; a no-op (``.to(model.device)``, ``.float()`` of an fp32 model) and
a memory-format change (followed by the store) go through. The patch is installed while at least one
scheduler is attached and removed with the last one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

#: module -> the check of the scheduler attached to it (``check(module, fn)`` raises to refuse the move)
_GUARDED: weakref.WeakKeyDictionary[torch.nn.Module, Callable[[torch.nn.Module, Callable], None]] = (
    weakref.WeakKeyDictionary())
_lock = threading.Lock()
# torch's own, captured once: a thread inside _guarded_apply while the last guard goes still calls it
_original: Callable[..., Any] = torch.nn.Module._apply


def _guarded_apply(self: torch.nn.Module, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    check = _GUARDED.get(self)
    if check is not None:
        check(self, fn)
    return _original(self, fn, *args, **kwargs)


class MoveGuard:
    """Refuses moves and conversions of ``model``'s chunked parameters at ``nn.Module._apply`` (see the module
    docstring). ``kinds()`` gives the ``(dtype, device)`` pairs of the chunked parameters now; ``name`` of a
    module, for the message. :meth:`remove` takes it away (idempotent)."""

    def __init__(self, model: torch.nn.Module,
                 kinds: Callable[[], set[tuple[torch.dtype, torch.device]]]) -> None:
        self._modules = weakref.WeakSet(model.modules())
        self._names = weakref.WeakKeyDictionary(
            {m: n or type(model).__name__ for n, m in model.named_modules()})
        self._kinds = kinds
        with _lock:
            for m in self._modules:
                _GUARDED[m] = self._check
            if torch.nn.Module._apply is not _guarded_apply:
                torch.nn.Module._apply = _guarded_apply  # type: ignore[method-assign]

    def _check(self, module: torch.nn.Module, fn: Callable) -> None:
        """Raises:
            RuntimeError: ``fn`` would change the device or dtype of chunked parameters (names the module,
                the change and what to do)."""
        for dtype, device in self._kinds():
            try:
                with _disable_current_modes(), torch._C.DisableTorchFunction():
                    out = fn(torch.empty(0, dtype=dtype, device=device))
            except Exception:  # noqa: BLE001 - a function the probe cannot run (share_memory_): not a move
                continue
            if not isinstance(out, torch.Tensor) or (out.device, out.dtype) == (device, dtype):
                continue
            change = (f"from {device} to {out.device}" if out.device != device
                      else f"from {dtype} to {out.dtype}")
            if out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                change += (f" ({str(out.dtype).removeprefix('torch.')} is not supported: memsched trains "
                           "float32, bfloat16 and float16 parameters)")
            raise RuntimeError(
                f"memsched: moving or converting module {self._names.get(module, type(module).__name__)!r} "
                f"({type(module).__name__}) would take memsched's chunked parameters {change} after "
                "memsched.attach (model.cpu(), .to(...), .half(), .double()); its optimizer steps would no "
                "longer reach the model, so nothing was moved. Parameters already read as the device they "
                "compute on, wherever memsched keeps them: move inputs with .to(model.device) instead. To "
                "move or convert the model, close() the scheduler first (leave its with-block), then attach "
                "again; to compute in bfloat16/float16, pass dtype= to memsched.attach")

    def remove(self) -> None:
        with _lock:
            for m in list(self._modules):
                if _GUARDED.get(m) == self._check:
                    del _GUARDED[m]
            self._modules = weakref.WeakSet()
            # the last guard takes the patch away, unless another library patched _apply over it since
            if not _GUARDED and torch.nn.Module._apply is _guarded_apply:
                torch.nn.Module._apply = _original  # type: ignore[method-assign]
