"""What the chunks tell the data parallelism: the moments a chunk's gradients are complete, its shard was
updated, and its gradients are about to be zeroed.

The store depends on this protocol, not on :mod:`memsched.distributed` (which depends on the chunks), so the
imports go one way. :class:`memsched.distributed.base.DataParallel` implements it; :class:`OneProcess` is the
store's default when nothing listens (one rank, no collectives).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from memsched.chunks.sizing import PARAM_ALIGN

if TYPE_CHECKING:
    from memsched.chunks.chunk import Chunk


class ChunkEvents(Protocol):
    """The listener of a :class:`memsched.chunks.ChunkStore`: ``align`` (elements; parameters start on
    multiples of it in the chunks) and ``world`` (ranks) shape the layout and the end of backward."""

    align: int
    world: int
    shards_grads: bool  # ZeRO-2: gradients kept as reduced shards (memsched.chunks.sharded_grad)

    def install(self, store: object) -> None:
        """Know the store (called once it is built)."""

    def grads_ready(self, chunk: Chunk) -> None:
        """All of ``chunk``'s gradients are complete in this backward (ZeRO: reduce them now)."""

    def after_update(self, chunk: Chunk) -> None:
        """``chunk``'s shard was updated into ``chunk.data[lo:hi]`` (ZeRO: fetch the other shards)."""

    def before_zero_grad(self) -> None:
        """Before the gradient buffers are zeroed: nothing may still be writing into them."""


class OneProcess:
    """:class:`ChunkEvents` of one process with nobody listening."""

    align = PARAM_ALIGN  # [Note: parameter alignment in chunks]
    world = 1
    shards_grads = False

    def install(self, store: object) -> None:
        pass

    def grads_ready(self, chunk: Chunk) -> None:
        pass

    def after_update(self, chunk: Chunk) -> None:
        pass

    def before_zero_grad(self) -> None:
        pass
