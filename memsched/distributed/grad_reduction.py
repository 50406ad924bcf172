"""The gradient reductions of :class:`memsched.distributed.engine.ZeroEngine` (see that module's docstring
for the stages and the collective order): each chunk's gradients are all-reduced (stages 0, 1) or
reduce-scattered into the owning shard (stage 2) as soon as backward completes them, launched in a fixed chunk
order (last chunk first, DistributedDataParallel's in-order bucket launch), averaged, and finished before the
update; ``no_sync`` accumulates without reducing. The engine holds one :class:`GradientReducer`.

[Note: the order of gradient reductions]
Every rank must issue the same collectives in the same order, but backward completes chunks in an order that
may differ between ranks (a branch taken on one rank only). So reductions are launched in a fixed chunk
order, last chunk first, and a chunk that is ready early waits for its predecessors; whatever backward did not
complete is reduced, in that order, before the update (:meth:`GradientReducer.before_update`). A second
backward in one step window first closes the round of the first.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from memsched.chunks import Chunk, ChunkStore


class ZeroAccumulationWarning(UserWarning):
    """ZeRO-2 with gradient accumulation: gradient sharding saves nothing there."""


class GradientReducer:
    """The gradient reductions of one rank (see the module docstring).

    Args:
        comm: the process group (:class:`memsched.distributed.comm.Comm`).
        stage: the ZeRO stage: 0 and 1 all-reduce whole gradients, 2 reduce-scatters them into the own shard.

    Attributes:
        reduce_bytes: bytes this rank sent into gradient collectives.
        reductions: gradient collectives launched.
    """

    def __init__(self, comm: Any, stage: int) -> None:
        self.comm = comm
        self.stage = stage
        self.world = comm.world
        self.store: ChunkStore | None = None
        self._sync = True
        self._warned_accumulation = False
        self._reduced: set[int] = set()  # chunks reduced since the last zero_grad
        self._flushed_at: int | None = None  # store.grad_events at the last flush
        self.reduce_bytes = 0
        self.reductions = 0
        self._reset_round()

    def install(self, store: ChunkStore) -> None:
        """Know the chunks."""
        self.store = store

    def add_reduce_bytes(self, nbytes: int) -> None:
        """Bytes sent into a gradient collective outside a reduction (the gather of clipping at stage 2)."""
        self.reduce_bytes += nbytes

    def reset(self) -> None:
        """Forget every round and reduction (the chunks were re-packed)."""
        self._reset_round()
        self._reduced.clear()

    def _reset_round(self) -> None:
        self._next = 0
        self._ready: set[int] = set()
        self._launched: set[int] = set()
        self._pending: list[tuple[Chunk, Any, torch.Tensor | None]] = []

    def _order(self) -> list[int]:
        assert self.store is not None
        return list(range(len(self.store.chunks) - 1, -1, -1))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside only accumulates local gradients (no collective, no D2H); see the module docstring
        for the memory cost. Warns (:class:`ZeroAccumulationWarning`) once at stage 2."""
        if self.stage == 2 and not self._warned_accumulation:
            self._warned_accumulation = True
            warnings.warn(
                "zero_stage=2 with gradient accumulation (no_sync): the whole gradient buffer is kept across "
                "micro-batches, so gradient sharding saves no memory; zero_stage=1 keeps the same memory "
                "(DeepSpeed allows only ZeRO-1 with pipeline parallelism for the same reason)",
                ZeroAccumulationWarning,
                stacklevel=3,
            )
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def grads_ready(self, c: Chunk) -> None:
        """Hook: all of ``c``'s gradients are complete in this backward. Launch reductions in the fixed
        order."""
        if not self._sync:
            return
        if c.index in self._launched:  # a second backward in one step window: close the previous round first
            self._finish_round()
        self._ready.add(c.index)
        order = self._order()
        while self._next < len(order) and order[self._next] in self._ready:
            self._launch(self.store.chunks[order[self._next]])
            self._next += 1
        self._poll()

    def _launch(self, c: Chunk) -> None:
        w = self.world
        with torch.no_grad():
            if self.stage == 2 and c.index in self._reduced:
                # The own shard holds an average already; scale it back to a sum so that adding the new local
                # gradients of every rank and averaging again is right.
                c.grad[c.lo : c.hi].mul_(w)
            what = f"gradient reduction of chunk {c.index}"
            if self.stage < 2:
                work, out = self.comm.all_reduce(c.grad, what=what, async_op=True), None
                self.reduce_bytes += 2 * (w - 1) * c.grad.numel() * c.grad.element_size() // w
            else:
                # NCCL reduces in place when the output is the own shard of the input; elsewhere a temporary.
                out = (
                    c.grad[c.lo : c.hi]
                    if self.comm.nccl
                    else torch.empty(c.shard_numel, dtype=c.grad.dtype, device=c.grad.device)
                )
                work = self.comm.reduce_scatter(out, c.grad, what=what, async_op=True)
                self.reduce_bytes += (w - 1) * c.grad.numel() * c.grad.element_size() // w
        self.reductions += 1
        self._launched.add(c.index)
        self._pending.append((c, work, out))

    def _finalize(self, c: Chunk, work: Any, out: torch.Tensor | None) -> None:
        self.comm.wait(work, f"gradient reduction of chunk {c.index}")
        with torch.no_grad():
            if self.stage < 2:
                c.grad.div_(self.world)
            else:
                own = c.grad[c.lo : c.hi]
                if out is not None and out.data_ptr() != own.data_ptr():
                    own.copy_(out)
                own.div_(self.world)
                c.grad[: c.lo].zero_()
                c.grad[c.hi :].zero_()
        self._reduced.add(c.index)

    def _poll(self) -> None:
        while self._pending:
            c, work, out = self._pending[0]
            if work is not None and not work.is_completed():
                return
            self._pending.pop(0)
            self._finalize(c, work, out)

    def _finish_round(self) -> None:
        order = self._order()
        for i in order[self._next :]:
            self._launch(self.store.chunks[i])
        for c, work, out in self._pending:
            self._finalize(c, work, out)
        self._reset_round()

    def before_update(self) -> None:
        """Before the update (and before clipping): reduce whatever backward did not (in order) and wait for
        every reduction. A second flush with no backward in between reduces nothing again (the gradients are
        averaged already; reducing them twice would scale them)."""
        if self.store is not None and self._flushed_at == self.store.grad_events:
            return
        self._finish_round()
        self._flushed_at = self.store.grad_events if self.store is not None else None

    def before_zero_grad(self) -> None:
        """Hook, before the gradient buffers are zeroed: no reduction may still be writing into them."""
        if self._launched or self._pending:
            self._finish_round()
        self._reset_round()
        self._reduced.clear()
        self._flushed_at = None
