"""The gradient reductions of :class:`memsched.distributed.engine.ZeroEngine` (see that module's docstring
for the stages and the collective order): each chunk's gradients are all-reduced (stages 0, 1) or
reduce-scattered into the owning shard (stage 2) as soon as backward completes them, launched in a fixed chunk
order (last chunk first, DistributedDataParallel's in-order bucket launch), averaged, and finished before the
update; ``no_sync`` accumulates without reducing. A mixin: the engine's state is its state."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from memsched.chunks import Chunk, ChunkStore


class ZeroAccumulationWarning(UserWarning):
    """ZeRO-2 with gradient accumulation: gradient sharding saves nothing there."""


class GradientReduction:
    """The gradient half of :class:`memsched.distributed.engine.ZeroEngine` (see the module docstring)."""

    # The engine's attributes this mixin reads and writes (set in ZeroEngine.__init__).
    comm: Any
    stage: int
    world: int
    store: ChunkStore | None
    stats: dict[str, int]
    _sync: bool
    _warned_accumulation: bool
    _reduced: set[int]
    _flushed_at: int | None

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
                self.stats["reduce_bytes"] += 2 * (w - 1) * c.grad.numel() * c.grad.element_size() // w
            else:
                # NCCL reduces in place when the output is the own shard of the input; elsewhere a temporary.
                out = (
                    c.grad[c.lo : c.hi]
                    if self.comm.nccl
                    else torch.empty(c.shard_numel, dtype=c.grad.dtype, device=c.grad.device)
                )
                work = self.comm.reduce_scatter(out, c.grad, what=what, async_op=True)
                self.stats["reduce_bytes"] += (w - 1) * c.grad.numel() * c.grad.element_size() // w
        self.stats["reductions"] += 1
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

    def agree_with_grad(self, store: ChunkStore, with_grad: set[int]) -> set[int]:
        """The parameters with a gradient on any rank (one small MAX all-reduce): their averaged gradient
        exists on every rank, and every rank must update the same parameters."""
        params = list(store.params())
        flags = torch.tensor([id(p) in with_grad for p in params], dtype=torch.int32, device=self.comm.device)
        self.comm.all_reduce(flags, op=torch.distributed.ReduceOp.MAX,
                             what="agreeing on the parameters with gradients")
        return {id(p) for p, f in zip(params, flags.tolist(), strict=True) if f}
