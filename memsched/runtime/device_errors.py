"""torch's errors in a forward of an attached model, explained by memsched: an input on another device, and
the numbers of a CUDA out-of-memory error.

Every parameter of an attached model reads as the compute device, wherever memsched keeps it ([Note:
parameters read where they compute] in :mod:`memsched.devices.host_alias`), so an input on another device
fails inside the forward with torch's "Expected all tensors to be on the same device". memsched does not
move inputs (Accelerate's offload hooks do; that leaves ``model.device`` reading ``cpu`` and breaks
``generate()``), and does not refuse them up front either (a forward may move its inputs itself, or need
some on the CPU, as ``pack_padded_sequence``'s lengths). Instead, an always-called forward hook of the root
rewrites that error, while it propagates, into memsched's message naming the device to move the input to.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from memsched.devices.simdevice import OUT_OF_MEMORY, add_oom_numbers

_MARK = "memsched: the model computes on"


def explain_device_error(device: torch.device) -> None:
    """Called from a forward hook with ``always_call=True`` (torch runs it inside its ``except`` block when
    the forward raised): a device-mismatch ``RuntimeError`` in flight gets memsched's explanation in front of
    torch's message (same exception object and type, so ``except RuntimeError`` keeps working)."""
    exc = sys.exc_info()[1]
    if isinstance(exc, OUT_OF_MEMORY):
        add_oom_numbers(exc, device)
        return
    if not isinstance(exc, RuntimeError) or not exc.args or not isinstance(exc.args[0], str):
        return
    msg = exc.args[0]
    if "same device" not in msg or _MARK in msg:
        return
    exc.args = (f"{_MARK} {device}: its parameters read as {device} wherever memsched keeps them (the "
                f"device or pinned host memory), so inputs belong there too. Move them with "
                f"x.to(model.device) (here {device}), or x.to(sched.device.torch_device). torch said: {msg}",
                *exc.args[1:])


def device_error_hook(device: torch.device) -> Any:
    """A ``register_forward_hook(..., always_call=True)`` hook that calls :func:`explain_device_error`."""

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        # torch calls it with no output when the forward raised; a forward that succeeds inside the caller's
        # own ``except`` (a retry) leaves that handled exception alone
        if output is None and not torch.compiler.is_compiling():
            explain_device_error(device)

    return hook
