"""The early D2H of host chunks' gradients (ZeRO-Offload's overlap of the gradient copy with backward, arXiv
2101.06840 section 4.2): with CUDA and one rank, a host chunk's gradients start their D2H copy in backward as
soon as they are complete, and are fingerprinted (:mod:`memsched.chunks.fingerprint`).

[Note: when the D2H happens]
Anything may write the gradients between backward and the step (clipping, ``p.grad.mul_()``, another
backward), and no signal says so reliably. So the copy made in backward is only a guess: at the step, after
everything that may have written them was queued, the gradients are fingerprinted again and the copy is used
only where the two fingerprints are equal; every other host chunk is copied again then. The host waits for
that comparison (on CUDA, for backward to finish on the device), so the copies made again are ordered before
anything that writes the gradients next (``zero_grad``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memsched.chunks import Chunk
from memsched.chunks.buffers import Allocator
from memsched.chunks.fingerprint import Fingerprinter


class EarlyD2H:
    """The copies made in backward and their fingerprints (see the module docstring).

    Args:
        alloc: the chunks' allocator (the fingerprints' temporaries are not device memory on the stand-in).
        start_d2h: ``f(chunk)`` starting the D2H copy of a host chunk's gradients.

    Attributes:
        enabled: copies are made in backward (after warmup, one rank, CUDA).
    """

    def __init__(self, alloc: Allocator, start_d2h: Callable[[Chunk], None]) -> None:
        self._alloc = alloc
        self._start_d2h = start_d2h
        self._fingerprints = Fingerprinter()
        self._copied: dict[int, torch.Tensor] = {}  # chunk index -> fingerprint of the gradients it copied
        self.enabled = False

    def copy(self, c: Chunk) -> None:
        """Fingerprint host chunk ``c``'s gradients and start their D2H copy."""
        with self._alloc.host_context():  # the stand-in does not count the fingerprint's temporaries
            self._copied[c.index] = self._fingerprints.of(c.grad[c.lo:c.hi])
        self._start_d2h(c)

    def take_valid(self, host_chunks: list[Chunk]) -> set[int]:
        """Indices of the host chunks copied in backward whose gradients did not change since: their copy is
        used. Every copy is forgotten (see [Note: when the D2H happens])."""
        early, self._copied = self._copied, {}
        chunks = [c for c in host_chunks if c.index in early]
        if not chunks:
            return set()
        with self._alloc.host_context():
            now = torch.stack([self._fingerprints.of(c.grad[c.lo:c.hi]) for c in chunks])
            same = (now == torch.stack([early[c.index] for c in chunks])).all(dim=1).tolist()
        return {c.index for c, ok in zip(chunks, same, strict=True) if ok}

    def forget(self) -> None:
        """The gradients copied are zeroed (``zero_grad``): the next backward copies again."""
        self._copied = {}
