"""The strides of a parameter's views in its chunk: the memory formats memsched keeps (see [Note: memory
formats] in :mod:`memsched.chunks.store`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides when it is dense in a memory format memsched keeps (contiguous, channels_last,
    channels_last_3d), else the contiguous strides of its shape."""
    if not t.is_contiguous():
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
        if fmt is not None and t.is_contiguous(memory_format=fmt):
            return tuple(t.stride())
    return contiguous_strides(t.shape)
