"""Where chunk tensors come from: the compute device, and host memory (pinned when CUDA is present), one
allocation (an arena) per chunk's optimizer state."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from memsched.chunks.sizing import dtype_bytes
from policies.types import DEVICE


class Allocator:
    """Where chunk tensors come from: the compute device, and host memory (pinned when CUDA is present).

    ``host_context`` wraps host allocations (the stand-in device pauses its accounting there, so host-placed
    buffers are not counted as device memory).
    """

    def __init__(self, device: torch.device, *, pin: bool | None = None,
                 host_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        self.device = device
        # Pinning needs a CUDA runtime; CPU-only torch cannot pin, so skip it cleanly.
        self.pin = (device.type == "cuda" and torch.cuda.is_available()) if pin is None else pin
        self.host_context = host_context or contextlib.nullcontext

    def device_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self.host_context():
            return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin)

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

        One allocation per chunk, not one per tensor: PyTorch's pinned-memory cache rounds every allocation up
        to a power of two, so four or five separate pinned tensors per chunk could cost up to twice the bytes
        the plan counts (:func:`pinned_bytes` gives the rounded size of the one arena).
        """
        sizes = [max(n, 1) * dtype_bytes(dt) for _, dt, n in parts]
        total = sum(sizes)
        if placement == DEVICE:
            raw = torch.empty(total, dtype=torch.uint8, device=self.device)
        else:
            with self.host_context():
                raw = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
        out, off = {}, 0
        with self.context(placement):
            for (name, dt, n), size in zip(parts, sizes, strict=True):
                # Parts are ordered by decreasing element size, so every view is aligned to its dtype.
                v = raw[off:off + size].view(dt)
                out[name] = v.reshape(()) if n == 0 else v
                off += size
        return out


def pinned_bytes(nbytes: int, *, pinned: bool = True) -> int:
    """Host bytes an allocation of ``nbytes`` really takes: PyTorch's caching host allocator rounds pinned
    allocations up to the next power of two (unpinned ones are taken as they are), bytes."""
    if not pinned or nbytes <= 0:
        return max(0, nbytes)
    return 1 << (nbytes - 1).bit_length()
