"""Exact fingerprints of gradient buffers: did anything write them between two moments?

The early D2H copy of a host chunk's gradients (during backward, :mod:`memsched.optim.hybrid_adamw`) is only
used at the step if the gradients did not change in between (clipping, an unscale, ``p.grad.mul_()``, a second
backward). Version counters cannot tell (they do not move through ``.data`` or under a dispatch mode), so
the buffer itself is fingerprinted, on its own device, from the bit patterns of its elements ``x_i`` (as
integers):

    (sum_i x_i, sum_i (i + 1) * x_i)   modulo 2**64

Any change of one element changes the first sum; any change of two elements that keeps the first sum (a swap,
``+d`` here and ``-d`` there) changes the second. Only a coordinated change of three or more elements can
collide, with a chance of about 2**-64 for changes that are not built for it (scaling, clipping, accumulation
change every element). Integer sums are exact, so the figure does not depend on reduction order or kernel.
The buffer is read in slices of :data:`SLICE` elements, so the temporaries stay small (three int64 slices).
"""

from __future__ import annotations

import torch

SLICE = 1 << 20  # elements per slice: 8 MiB int64 temporaries (the copy is made at the backward's peak)

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Fingerprinter:
    """Computes :meth:`of` (stateless; a class so that an optimizer owns its own)."""

    @torch.no_grad()
    def of(self, t: torch.Tensor) -> torch.Tensor:
        """The fingerprint of the 1-D tensor ``t`` (any dtype), an int64 tensor ``[2]`` on ``t``'s device (see
        the module docstring). Queued on the current stream; nothing waits for it. Temporaries: three int64
        tensors of at most :data:`SLICE` elements."""
        bits = t.view(_INT_OF_SIZE[t.element_size()])
        total = torch.zeros(2, dtype=torch.int64, device=t.device)
        n = bits.numel()
        for start in range(0, n, SLICE):
            x = bits[start:start + SLICE].to(torch.int64)
            s = x.sum()
            w = torch.arange(start + 1, start + x.numel() + 1, dtype=torch.int64, device=t.device)
            total[0] += s
            total[1] += (x * w).sum()
        return total
