"""The gradient reductions of :class:`memsched.distributed.engine.ZeroEngine` (see that module's docstring
for the stages and the collective order): each chunk's gradients are reduced as soon as backward completes
them, launched in a fixed chunk order (last chunk first, DistributedDataParallel's in-order bucket launch),
averaged, and finished before the update; ``no_sync`` accumulates without reducing. The engine holds one
:class:`GradientReducer`.

What each stage does with a chunk's gradient buffer ``[numel]``:

* 0: at two ranks, all-reduce (SUM) in place, then divide by the world size; at three or more, as stage 1
  (below; [Note: sums in rank order]). Stage 0 does not pad its chunks to a multiple of the world size, so a
  chunk that is not one is sent as a zero-padded copy (``[world * ceil(numel / world)]``), which then receives
  the all-gather and is copied into the buffer.
* 1: the sums of the own shard in rank order (below), divided by the world size, then all-gathered into the
  whole buffer: every rank holds the whole averaged gradients (the bytes of a ring all-reduce).
* 2: the same sums of the own shard, divided, kept as the chunk's reduced shard (``Chunk.grad_shard``,
  ``[numel / world]``); the whole buffer is freed (:meth:`memsched.chunks.gradients.GradBuffers.keep_shard`).
  With accumulation outside ``no_sync`` each micro-batch is reduced and the averages are added to the shard
  (DeepSpeed ZeRO-2's way): the whole buffer lives only from a chunk's first gradient to its reduction, at the
  price of one reduce-scatter per micro-batch. Under ``no_sync`` the whole buffers accumulate locally and are
  reduced once: fewer bytes sent, whole buffers kept across the micro-batches.

[Note: sums in rank order]
A ring reduce-scatter or all-reduce adds the ranks' values in an order that depends on the element's position
and the world size, so with three or more ranks its sums differ in the last bit from plain torch averaging the
per-rank gradients (``(g0 + g1 + g2) / 3``, left to right), and Adam amplifies such bits. With three or more
ranks, every stage (0 included: gloo's all-reduce of three ranks moved parameters by ~6e-8 after three steps,
tests/test_zero_sharded_grads.py) sends each rank its part of every rank's buffer with one all-to-all (the
bytes a reduce-scatter sends; a receive buffer of the chunk's size while in flight) and adds the parts in rank
order, then divides, so the averaged gradients are bit-identical to that reference at any world size; stages 0
and 1 then all-gather the averaged parts (the bytes of a ring all-reduce). Two ranks use the backend's
reduce-scatter or all-reduce (a sum of two is the same in either order). A backend without all-to-all falls
back to its reduce-scatter and warns once.

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
from dataclasses import dataclass
from typing import Any

import torch

from memsched.chunks import Chunk, ChunkStore


class ZeroAccumulationWarning(UserWarning):
    """ZeRO-2 with gradient accumulation: gradient sharding saves nothing there."""


@dataclass
class _Reduction:
    """One chunk's reduction in flight: its collective's work, the all-to-all's receive buffer (``[numel]``,
    or the own shard after a reduce-scatter: ``summed``), at stages 0 and 1 whether its all-gather was
    launched, and at stage 0 the zero-padded copy sent when the chunk is not a multiple of the world size
    (``padded``, ``[world * ceil(numel / world)]``), which then receives the all-gather."""

    chunk: Chunk
    work: Any
    recv: torch.Tensor | None = None
    summed: bool = False
    gathering: bool = False
    padded: torch.Tensor | None = None


class GradientReducer:
    """The gradient reductions of one rank (see the module docstring).

    Args:
        comm: the process group (:class:`memsched.distributed.comm.Comm`).
        stage: the ZeRO stage: 0 and 1 average whole gradients, 2 and 3 reduce them into the own shard (see
            the module docstring).

    Attributes:
        reduce_bytes: bytes this rank sent into gradient collectives.
        reductions: gradient collectives launched.
    """

    def __init__(self, comm: Any, stage: int) -> None:
        self.comm = comm
        self.zero_stage = stage  # as attached (named in warnings)
        self.stage = min(stage, 2)  # ZeRO-3 reduces gradients as ZeRO-2 does
        self.world = comm.world
        # the averaged parts are all-gathered into the whole buffer: stage 1, and stage 0 above two ranks
        self._gathers = self.stage == 1 or (self.stage == 0 and self.world > 2)
        self.store: ChunkStore | None = None
        self._sync = True
        # a pipeline stage: every reduction waits for the step ([Note: micro-batches in flight] in
        # memsched.distributed.pipeline)
        self.defer_to_step = False
        self._warned_accumulation = False
        self._warned_unordered = False
        self._flushed_at: int | None = None  # store.backward.grad_events at the last flush
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

    def _reset_round(self) -> None:
        self._next = 0
        self._ready: set[int] = set()
        self._launched: set[int] = set()
        self._pending: list[_Reduction] = []

    def _order(self) -> list[int]:
        assert self.store is not None
        return list(range(len(self.store.chunks) - 1, -1, -1))

    @property
    def synchronizing(self) -> bool:
        """Whether backward reduces now (outside ``no_sync``, and not a pipeline stage, whose reductions wait
        for the step)."""
        return self._sync and not self.defer_to_step

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside only accumulates local gradients (no collective, no D2H); see the module docstring
        for the memory cost. Warns (:class:`ZeroAccumulationWarning`) once at stages 2 and 3."""
        if self.stage == 2 and not self._warned_accumulation:
            self._warned_accumulation = True
            warnings.warn(
                f"zero_stage={self.zero_stage} with gradient accumulation under no_sync: the whole gradient "
                "buffers are kept across the micro-batches, so gradient sharding saves no memory until the "
                "last one; without "
                "no_sync each micro-batch's gradients are reduce-scattered and only this rank's shard is "
                "kept (one reduce-scatter per micro-batch instead of one per step)",
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
        if not self.synchronizing:
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
        if self._gathers:
            self._gather_reduced()  # collectives only at launches: the same order on every rank
        elif self.stage == 2:  # one reduction in flight: the whole buffers do not pile up behind backward
            while self._pending:
                self._finalize(self._pending.pop(0))
        if c.grad is None:  # no gradient on this rank in this round (lazy buffers): its part is zeros
            self.store.grads.alloc(c)
        what = f"gradient reduction of chunk {c.index}"
        nbytes = c.grad.numel() * c.grad.element_size()
        with torch.no_grad():
            if self.stage == 0 and not self._gathers:  # two ranks: a sum of two in either order is the same
                work = self.comm.all_reduce(c.grad, what=what, async_op=True)
                self._pending.append(_Reduction(c, work))
                self.reduce_bytes += 2 * (w - 1) * nbytes // w
            else:
                r = _Reduction(c, None)
                sent, k = c.grad, -(-c.grad.numel() // w)  # k: elements of each rank's part
                if sent.numel() != w * k:  # stage 0: chunks not padded to a multiple of the world size
                    r.padded = sent = torch.zeros(w * k, dtype=c.grad.dtype, device=c.grad.device)
                    sent[: c.grad.numel()].copy_(c.grad)
                    nbytes = sent.numel() * sent.element_size()
                try:  # [Note: sums in rank order]
                    if w == 2:  # a sum of two is the same in either order: the backend's reduce-scatter
                        raise NotImplementedError
                    r.recv = torch.empty_like(sent)
                    r.work = self.comm.all_to_all(r.recv, sent, what=what, async_op=True)
                except NotImplementedError:
                    if w > 2:
                        self._warn_unordered()
                    r.recv = torch.empty(k, dtype=c.grad.dtype, device=c.grad.device)
                    r.work = self.comm.reduce_scatter(r.recv, sent, what=what, async_op=True)
                    r.summed = True
                self._pending.append(r)
                self.reduce_bytes += (w - 1) * nbytes // w
        self.reductions += 1
        self._launched.add(c.index)

    def _warn_unordered(self) -> None:
        if not self._warned_unordered:
            self._warned_unordered = True
            warnings.warn(
                f"the {self.comm.backend} backend has no all-to-all: gradients are reduced with its "
                "reduce-scatter, whose sums with three or more ranks may differ in the last bit from "
                "averaging the per-rank gradients in rank order", RuntimeWarning, stacklevel=4)

    def _own_average(self, r: _Reduction) -> torch.Tensor:
        """The own shard of a finished all-to-all (or reduce-scatter), summed in rank order and averaged."""
        self.comm.wait(r.work, f"gradient reduction of chunk {r.chunk.index}")
        w = self.world
        with torch.no_grad():
            if r.summed:
                own = r.recv
            else:  # [Note: sums in rank order]: rank 0's part, then rank 1's added, ...
                parts = r.recv.view(w, -1)
                own = parts[0]
                for k in range(1, w):
                    own.add_(parts[k])
            return own.div_(w)

    def _gather_reduced(self) -> None:
        """Stages 1, and 0 above two ranks: every launched reduction whose all-gather is not launched yet gets
        it now (waiting for its all-to-all first), in launch order: into the chunk's gradient buffer, or into
        the padded copy (stage 0), copied into the buffer at :meth:`_finalize`."""
        w = self.world
        for r in self._pending:
            if r.gathering:
                continue
            own = self._own_average(r)
            out = r.chunk.grad if r.padded is None else r.padded  # the padded copy is sent: free again
            what = f"gradient reduction of chunk {r.chunk.index} (all-gather)"
            r.work = self.comm.all_gather(out, own, what=what, async_op=True)
            r.gathering = True
            self.reduce_bytes += (w - 1) * out.numel() * out.element_size() // w

    def _finalize(self, r: _Reduction) -> None:
        c = r.chunk
        if self._gathers:
            self.comm.wait(r.work, f"gradient reduction of chunk {c.index} (all-gather)")
            if r.padded is not None:
                with torch.no_grad():
                    c.grad.copy_(r.padded[: c.grad.numel()])
                r.padded = None
        elif self.stage == 0:
            self.comm.wait(r.work, f"gradient reduction of chunk {c.index}")
            with torch.no_grad():
                c.grad.div_(self.world)
        else:
            self.store.grads.keep_shard(c, self._own_average(r))

    def _poll(self) -> None:
        """Finish the reductions that are complete, in launch order; none that needs another collective."""
        while self._pending:
            r = self._pending[0]
            if (self._gathers and not r.gathering) or (r.work is not None and not r.work.is_completed()):
                return
            self._pending.pop(0)
            self._finalize(r)

    def _finish_round(self) -> None:
        order = self._order()
        for i in order[self._next :]:
            self._launch(self.store.chunks[i])
        if self._gathers:
            self._gather_reduced()
        for r in self._pending:
            self._finalize(r)
        self._reset_round()

    def before_update(self) -> bool:
        """Before the update (and before clipping): reduce whatever backward did not (in order) and wait for
        every reduction; True when it did. A second flush with no backward in between reduces nothing again
        (the gradients are averaged already; reducing them twice would scale them)."""
        if self.store is not None and self._flushed_at == self.store.backward.grad_events:
            return False
        self._finish_round()
        self._flushed_at = self.store.backward.grad_events if self.store is not None else None
        return True

    def before_zero_grad(self) -> None:
        """Hook, before the gradient buffers are zeroed: no reduction may still be writing into them."""
        if self._launched or self._pending:
            self._finish_round()
        self._reset_round()
        self._flushed_at = None
