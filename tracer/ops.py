"""How the storage accountant handles each aten op, decided once per ``OpOverload`` from its schema; device
names as samples write them."""

from __future__ import annotations

from typing import Any

import torch

# How an op is handled, decided once per OpOverload from its schema.
_SKIP, _TRACK, _RESIZE = 0, 1, 2

_aten = torch.ops.aten
_RESIZING_PACKETS = {_aten.resize_, _aten.resize_as_}
if hasattr(_aten, "_resize_output_"):
    _RESIZING_PACKETS.add(_aten._resize_output_)
# These alias their input in the schema, but the input was made inside the op (``torch.tensor(...)``).
_FRESH_PACKETS = {getattr(_aten, n) for n in ("lift_fresh", "lift_fresh_copy") if hasattr(_aten, n)}


def _op_kind(func: Any) -> int:
    schema = func._schema
    if func.overloadpacket in _FRESH_PACKETS:
        return _TRACK
    if not any("Tensor" in str(r.type) for r in schema.returns):
        return _SKIP  # no tensor output (``item``, in-place foreach ops returning ``()``)
    if func.overloadpacket in _RESIZING_PACKETS or any(getattr(a, "is_out", False) for a in schema.arguments):
        return _RESIZE
    if all(r.alias_info is not None for r in schema.returns):
        return _SKIP  # views and in-place ops: no new storage
    return _TRACK


def device_name(device: str | torch.device) -> str:
    """Canonical device name as used in samples: ``"cpu"``, ``"cuda:0"``; a bare ``"cuda"`` gets the current
    index (0 when CUDA is not really available, e.g. under ``FakeTensorMode``). Names torch does not know
    (a stand-in ``"sim"`` device) are returned unchanged.

    Raises:
        TypeError: ``device`` is neither a string nor a ``torch.device``.
    """
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError:
            return device
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    if dev.type == "cuda" and dev.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        dev = torch.device("cuda", index)
    return str(dev)


