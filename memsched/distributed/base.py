"""Data parallelism as an object that always exists: one rank is the ordinary case of one code path.

:class:`DataParallel` is the interface the chunks (:class:`memsched.chunks.ChunkStore`), the optimizer
(:class:`memsched.optim.hybrid_adamw.HybridAdamW`) and the scheduler call at the moments data parallelism acts
on: gradients ready, before and after each chunk's update, end of step, zero_grad, agreeing on the plan's
inputs, the fp16 overflow check, clipping, gathering whole optimizer state, re-packing. This base class is ONE
rank: every shard is the whole chunk and every hook does nothing, so a single process runs exactly the code a
data-parallel run runs. :class:`memsched.distributed.ZeroEngine` implements it over ``torch.distributed``
(ZeRO stages 0/1/2). The idea of a base class that means "do nothing" is FSDP2's (``OffloadPolicy`` vs
``CPUOffloadPolicy`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_api.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from memsched.chunks.sizing import PARAM_ALIGN

if TYPE_CHECKING:
    from memsched.chunks import Chunk, ChunkStore


class DataParallel:
    """One rank (see the module docstring). Attributes: ``rank`` (0), ``world`` (1), ``sharded`` (False: each
    rank holds the whole optimizer state), ``align`` (:data:`memsched.chunks.PARAM_ALIGN`: parameters start
    at multiples of it in chunks, elements), ``group`` (None: no process group)."""

    rank = 0
    world = 1
    sharded = False
    shards_grads = False
    align = PARAM_ALIGN
    group: Any = None

    store: ChunkStore | None = None

    def install(self, store: ChunkStore) -> None:
        """Know the chunks (the store calls this when it is built)."""
        self.store = store

    # ---- layout and building ------------------------------------------------------------------------------
    def chunk_numel_for(self, groups: Sequence[Sequence[torch.nn.Parameter]],
                        order: Sequence[torch.nn.Parameter] | None, chunk_numel: int | None) -> int | None:
        """The chunk size (elements) to build with; ``None`` lets the store search it."""
        return chunk_numel

    def prepare_build(self, groups: Sequence[Sequence[torch.nn.Parameter]], chunk_numel: int | None,
                      device: Any, alloc: Any, compute_dtype: torch.dtype) -> None:
        """Before the chunks are built (ZeRO: decide where each chunk is built). One rank: nothing."""

    def watch_model(self, model: torch.nn.Module) -> list[Any]:
        """Hook what data parallelism must see of ``model``'s forwards (ZeRO: whether it is a pipeline stage,
        :mod:`memsched.distributed.pipeline`); returns the hook handles. One rank: nothing to see."""
        return []

    def broadcast_model(self, model: torch.nn.Module, store: ChunkStore) -> None:
        """Start every rank from the same parameters and buffers. One rank: nothing."""

    def shard_of(self, chunk: Chunk) -> tuple[int, int]:
        """``[lo, hi)`` of ``chunk`` this rank owns. One rank: the whole chunk."""
        return 0, chunk.numel

    def shard(self, store: ChunkStore) -> None:
        """Set each chunk's shard before its optimizer state exists. One rank: the whole chunk already."""

    def repack(self, store: ChunkStore, order: Sequence[torch.nn.Parameter], chunk_numel: int | None, *,
               after_chunk: Callable[[ChunkStore, Chunk], None] | None = None) -> None:
        """Re-pack the chunks in first-use ``order`` (:meth:`ChunkStore.repack`)."""
        store.repack(order, chunk_numel=chunk_numel, after_chunk=after_chunk)

    # ---- gradients and the step ---------------------------------------------------------------------------
    def grads_ready(self, chunk: Chunk) -> None:
        """All of ``chunk``'s gradients are complete in this backward (ZeRO: reduce them now)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradient accumulation without reducing (like DDP's ``no_sync``). One rank: nothing to skip."""
        return contextlib.nullcontext()

    def before_update(self) -> None:
        """Before the update (and before clipping): every gradient reduction is complete."""

    def clip_grad_norm_(self, clip: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``clip`` (per-parameter norms over the averaged gradients, then the coefficient: see
        :meth:`memsched.optim.hybrid_adamw.HybridAdamW.clip_grad_norm_`) once every gradient reduction is
        complete; returns its total norm. ZeRO-2's shards are gathered one chunk at a time by the clipper
        (:class:`memsched.optim.clipping.Clipper`)."""
        self.before_update()
        return clip()

    def gather_grad(self, chunk: Chunk) -> torch.Tensor:
        """``chunk``'s whole averaged gradients (``[numel]``). One rank: its gradient buffer."""
        return chunk.grad

    def agree_with_grad(self, store: ChunkStore, with_grad: set[int]) -> set[int]:
        """The parameters (ids) the step updates: those with a gradient on this rank (ZeRO: on any rank, since
        their gradients are averaged over the ranks)."""
        return set(with_grad)

    def after_update(self, chunk: Chunk) -> None:
        """``chunk``'s shard was updated into ``chunk.data[lo:hi]`` (ZeRO: fetch the other shards)."""

    def end_step(self) -> None:
        """End of a step: every fetch is complete before anything reads the parameters."""

    def before_zero_grad(self) -> None:
        """Before the gradient buffers are zeroed: nothing may still be writing into them."""

    # ---- agreement between ranks --------------------------------------------------------------------------
    def agree_margin_inputs(self, capacity_bytes: int, peak_non_model_bytes: int) -> tuple[int, int]:
        """The capacity and peak non-model data every rank plans with, bytes."""
        return capacity_bytes, peak_non_model_bytes

    def agree_max(self, values: list[int]) -> list[int]:
        """Element-wise maximum of ``values`` over the ranks (elastic placement: every rank re-plans at the
        same step to the same plan). One rank: ``values``."""
        return values

    def check_same(self, what: str, value: Any) -> None:
        """Raise when ``value`` (a layout, a plan) differs between ranks. One rank: it cannot."""

    def reduce_found_inf(self, found: torch.Tensor) -> torch.Tensor:
        """fp16: a step is skipped on every rank when any rank saw inf/NaN (a CPU float tensor ``[1]``)."""
        return found

    # ---- whole optimizer state ----------------------------------------------------------------------------
    def full_state(self, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fp32 master, ``exp_avg`` and ``exp_avg_sq`` of the WHOLE chunk (``[numel]``), as new CPU
        tensors (ZeRO: gathered from the ranks, a collective)."""
        return tuple(t.detach().to("cpu", copy=True)  # type: ignore[return-value]
                     for t in (chunk.master_view(), chunk.exp_avg, chunk.exp_avg_sq))
