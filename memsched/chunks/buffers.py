"""Where chunk tensors come from: the compute device, and host memory (pinned for CUDA and the stand-in, at
its size: :mod:`memsched.devices.pinned`), one allocation (an arena) per chunk's optimizer state."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from memsched.chunks.sizing import dtype_bytes
from memsched.devices.pinned import can_pin, pin_empty, pinned_bytes
from policies.types import DEVICE

__all__ = ["Allocator", "pinned_bytes"]


class Allocator:
    """Where chunk tensors come from: the compute device, and host memory (pinned for CUDA and the stand-in).

    ``host_context`` wraps host allocations (the stand-in device pauses its accounting there, so host-placed
    buffers are not counted as device memory).
    """

    def __init__(self, device: torch.device, *, pin: bool | None = None,
                 host_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        self.device = device
        self.pin = can_pin(device) if pin is None else pin
        self.host_context = host_context or contextlib.nullcontext

    def device_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` in host memory, pinned at its size (:mod:`memsched.devices.pinned`)
        when :attr:`pin`."""
        with self.host_context():
            if not self.pin:
                return torch.empty(numel, dtype=dtype, device="cpu")
            return pin_empty(numel * dtype_bytes(dtype), self.device).view(dtype)

    def host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = self.host_empty(numel, dtype)
        with self.host_context():
            t.zero_()
        return t

    def context(self, placement: str) -> contextlib.AbstractContextManager:
        """Where work on ``placement``'s tensors runs: host work inside ``host_context``."""
        return contextlib.nullcontext() if placement == DEVICE else self.host_context()

    def arena(self, placement: str, parts: Sequence[tuple[str, torch.dtype, int]]) -> dict[str, torch.Tensor]:
        """One allocation holding several flat tensors (``(name, dtype, numel)``; a numel of 0 gives a 0-d
        scalar of one element), returned as views by name.

        One allocation per chunk, not one per tensor: pinned memory is pinned in whole pages
        (:func:`memsched.devices.pinned.pinned_bytes` gives the size of the one arena).
        """
        sizes = [max(n, 1) * dtype_bytes(dt) for _, dt, n in parts]
        total = sum(sizes)
        if placement == DEVICE:
            raw = torch.empty(total, dtype=torch.uint8, device=self.device)
        else:
            with self.host_context():
                raw = pin_empty(total, self.device) if self.pin else torch.empty(total, dtype=torch.uint8)
        out, off = {}, 0
        with self.context(placement):
            for (name, dt, n), size in zip(parts, sizes, strict=True):
                # Parts are ordered by decreasing element size, so every view is aligned to its dtype.
                v = raw[off:off + size].view(dt)
                out[name] = v.reshape(()) if n == 0 else v
                off += size
        return out
