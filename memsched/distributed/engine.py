"""ZeRO-1/2/3 data parallelism over memsched's chunks: every rank owns an equal shard of every chunk.

Layout (:mod:`memsched.distributed.layout`): the chunk size is padded to a multiple of the world size and
rank ``r`` owns elements ``[r * s, (r + 1) * s)``, ``s = chunk_numel / world``, of every chunk. A chunk's
optimizer state (fp32 master, ``exp_avg``, ``exp_avg_sq``) covers only that part, so each rank holds
``1 / world`` of the optimizer state, and when the state lives in host memory all ranks copy their shards
between host and device at the same moment.

Stages (ZeRO, arXiv 1910.02054; ``memsched.attach(zero_stage=...)``):

* ``0``: plain data parallelism. Gradients are averaged whole (all-reduced at two ranks; above, summed in
  rank order as at stage 1); every rank keeps the whole optimizer state and updates whole chunks; nothing is
  fetched after the step.
* ``1``: optimizer state sharded. Gradients are all-reduced (averaged) whole; each rank updates its part.
* ``2``: gradients sharded too. A chunk's whole gradient buffer exists from its first gradient in backward
  to its reduction: as soon as backward completes the chunk's gradients they are reduce-scattered
  (overlapping the rest of backward), this rank keeps only its averaged shard (``Chunk.grad_shard``,
  ``[numel / world]`` on the device) and the whole buffer is freed. The parameters' ``.grad`` are then
  :class:`memsched.chunks.sharded_grad.ShardedGrad`: torch's ``clip_grad_norm_(model.parameters())`` is
  refused loudly, ``sched.clip_grad_norm_`` is exact. Only the shard is copied device-to-host for
  host-placed chunks, at the step.
* ``3``: parameters sharded too. Gradients as at stage 2. A chunk's parameters are whole only around their
  reads: all-gathered a few traced accesses ahead of them in forward and backward and sharded again once
  read (:mod:`memsched.distributed.sharded_params`, through the parameter fetcher,
  :mod:`memsched.runtime.param_fetch`); the update writes this rank's part in place, whether the chunk is
  whole or not, and the step gathers only the chunks the schedule keeps whole for the next step's first
  reads. Between steps the others are sharded: reading one raises, ``sched.gathered_params()`` makes them
  whole.

Reductions at every stage add the ranks' gradients in rank order, so they are bit-identical to plain torch
averaging the per-rank gradients at any world size (:mod:`memsched.distributed.grad_reduction`).

After the update (stages 1 and 2; at 3 the chunks whole then) the updated shards are fetched into the flat
chunk, whose views the parameters already are: ``fetch="all_gather"`` gathers them with
``all_gather_into_tensor`` (no concatenation, no slicing); ``fetch="all_reduce"`` zeroes the rest of the
chunk and all-reduces it (adding zeros is exact). ``bench/zero_fetch.py`` compares the two.

Collective order: every rank must issue the same collectives in the same order. Gradient reductions are
launched in a fixed chunk order (last chunk first, the order in which backward completes them), a chunk that
is ready early waiting for its predecessors (DistributedDataParallel's in-order bucket launch); whatever
backward did not complete is reduced before the update. Fetches follow the optimizer's update order, which
depends only on the placement plan, and the plan is the same on every rank (planning uses the smallest GPU
margin over all ranks: an all-reduce MIN of the capacity and MAX of the peak non-model data; the plans are
compared).

Gradient accumulation: ``with sched.no_sync(): ...`` (as in DDP) runs backward without reducing; the next
backward outside it (or the step) reduces once per accumulation boundary, not per micro-batch. Cost: the whole
gradient buffer of every chunk is kept across the micro-batches (``chunk_numel * n_chunks`` elements of the
compute dtype per rank), so at stage 2 it warns once that sharding saves nothing until the last micro-batch.
Without ``no_sync``, stage 2 reduce-scatters every micro-batch and adds the averaged shards (one
reduce-scatter per micro-batch, ``1 / world`` of the gradient memory between micro-batches); stages 0 and 1
then all-reduce every micro-batch as DistributedDataParallel does.

Re-packing at the end of warmup: the optimizer state of every chunk is gathered whole (temporarily, one-off:
full fp32 state per rank on the state's side), the chunks are re-packed as in a single process, and the shards
are cut again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memsched.chunks import PARAM_ALIGN, Chunk, ChunkStore, ordered_groups, search_chunk_size
from memsched.chunks.sharded_grad import is_sharded
from memsched.distributed.base import DataParallel
from memsched.distributed.comm import Comm, ZeroCommError
from memsched.distributed.grad_reduction import GradientReducer
from memsched.distributed.layout import padded_chunk_numel, shard_range
from memsched.distributed.options import FETCH_MODES, ZERO_STAGES, check_zero_options  # noqa: F401
from memsched.distributed.pipeline import DeferredGradients, MicroBatchesInFlight


class ZeroEngine(DataParallel):
    """The ZeRO machinery of one rank: :class:`memsched.distributed.base.DataParallel` over
    ``torch.distributed``. The chunks and the optimizer call it at the moments the interface names; built by
    :func:`memsched.attach` when the world size is above 1.

    Args:
        comm: the process group (:class:`Comm`).
        stage: 0, 1, 2 or 3 (see the module docstring).
        fetch: ``"all_gather"`` or ``"all_reduce"``.
        chunk_build: where chunks are built at attach (:mod:`memsched.distributed.build`).

    Attributes:
        stats: bytes sent into collectives by this rank (``reduce_bytes``: gradient reductions,
            ``fetch_bytes``: parameter fetches), and their counts.
    """

    def __init__(self, comm: Comm, stage: int = 1, fetch: str = "all_gather",
                 chunk_build: str = "auto") -> None:
        self.stage, self.fetch = check_zero_options(stage, fetch)
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world
        self.group = comm.group
        self.store: ChunkStore | None = None
        self.reducer = GradientReducer(comm, self.stage)
        # a pipeline stage reduces once per step ([Note: micro-batches in flight])
        self.pipeline = MicroBatchesInFlight(on_detect=self._pipeline_stage)
        # [Note: gradients read before their reduction]
        self.deferred = DeferredGradients(self.before_update, sharded=bool(self.shards_grads))
        self._fetches: list[Any] = []
        self._fetch_bytes = 0
        self._fetch_count = 0
        self.build_stats: dict[str, Any] = {}
        self.chunk_build = chunk_build  # where chunks are built at attach (memsched.distributed.build)

    @property
    def stats(self) -> dict[str, int]:
        """Bytes this rank sent into collectives (``reduce_bytes``: gradient reductions, ``fetch_bytes``:
        parameter fetches), and their counts (``reductions``, ``fetches``)."""
        return {"reduce_bytes": self.reducer.reduce_bytes, "fetch_bytes": self._fetch_bytes,
                "reductions": self.reducer.reductions, "fetches": self._fetch_count}

    # ---- gradients: the reducer's (memsched.distributed.grad_reduction) -----------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward inside only accumulates local gradients (:meth:`GradientReducer.no_sync`)."""
        return self.reducer.no_sync()

    def grads_ready(self, chunk: Chunk) -> None:
        """All of ``chunk``'s gradients are complete in this backward: launch reductions in the fixed
        order; a pipeline stage's, which wait for the step, are marked ([Note: gradients read before their
        reduction])."""
        self.reducer.grads_ready(chunk)
        if self.reducer.defer_to_step:
            self.deferred.arm([p.grad for p in chunk.params if p.grad is not None and not is_sharded(p.grad)])

    def before_update(self) -> None:
        """Reduce whatever backward did not and wait for every reduction
        (:meth:`GradientReducer.before_update`). Stage 2: the parameters with a gradient on any rank then show
        one here too (a ShardedGrad over the averaged shards)."""
        self.deferred.disarm()
        if self.reducer.before_update() and self.shards_grads and self.store is not None:
            self.store.grads.guard(self.agree_with_grad(self.store, self.store.grads.with_grad))

    def backward_end(self) -> None:
        """Stage 2, the end of a backward outside ``no_sync``: every chunk not reduced yet is reduced now (its
        whole buffer freed), as DistributedDataParallel reduces every bucket in every backward; the
        micro-batches' averages then add up in the shards. Every parameter with a gradient on any rank shows
        one from here on, so torch's ``clip_grad_norm_`` on any rank meets a ShardedGrad and refuses."""
        if self.shards_grads and self.reducer.synchronizing:
            self.before_update()

    def before_zero_grad(self) -> None:
        """No reduction may still be writing into the gradient buffers."""
        self.deferred.disarm()
        self.reducer.before_zero_grad()

    def agree_with_grad(self, store: ChunkStore, with_grad: set[int]) -> set[int]:
        """The parameters with a gradient on any rank (one small MAX all-reduce): their averaged gradient
        exists on every rank, and every rank must update the same parameters."""
        params = list(store.params())
        flags = torch.tensor([id(p) in with_grad for p in params], dtype=torch.int32, device=self.comm.device)
        self.comm.all_reduce(flags, op=torch.distributed.ReduceOp.MAX,
                             what="agreeing on the parameters with gradients")
        return {id(p) for p, f in zip(params, flags.tolist(), strict=True) if f}

    @property
    def sharded(self) -> bool:
        """Optimizer state split over ranks (stages 1 and 2)."""
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:
        """Gradients reduce-scattered into shards and the whole buffers freed (stages 2 and 3)."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        """Parameters sharded while a step computes, all-gathered for their reads (stage 3:
        :mod:`memsched.distributed.sharded_params`)."""
        return self.stage >= 3

    def gather_grad(self, c: Chunk) -> torch.Tensor:
        """``c``'s whole averaged gradients (``[numel]``, compute dtype, on its device), all-gathered from the
        ranks' reduced shards into a new tensor: a collective every rank makes for the same chunks."""
        whole = torch.empty(c.numel, dtype=c.grad_shard.dtype, device=c.grad_shard.device)
        what = f"gradient gather of chunk {c.index}"
        self.comm.wait(self.comm.all_gather(whole, c.grad_shard, what=what), what)
        self.reducer.add_reduce_bytes((self.world - 1) * whole.numel() * whole.element_size() // self.world)
        return whole

    # ---- layout -------------------------------------------------------------------------------------------
    @property
    def align(self) -> int:
        """Alignment of parameters in chunks, and of shard boundaries when the state is sharded (elements):
        :data:`memsched.chunks.PARAM_ALIGN` ([Note: parameter alignment in chunks])."""
        return PARAM_ALIGN

    def chunk_numel(self, numel: int) -> int:
        """The chunk size (elements) to use for a wanted ``numel``: padded to a multiple of the world size
        times :attr:`align` when the state is sharded."""
        return padded_chunk_numel(numel, self.world * self.align) if self.sharded else numel

    def chunk_numel_for(
        self,
        groups: Sequence[Sequence[torch.nn.Parameter]],
        order: Sequence[torch.nn.Parameter] | None,
        chunk_numel: int | None,
    ) -> int:
        """Chunk size for packing ``groups`` in ``order``: ``chunk_numel`` or the searched size, padded."""
        if chunk_numel is None:
            chunk_numel = search_chunk_size([[p.numel() for p in g] for g in ordered_groups(groups, order)],
                                            align=self.align)
        return self.chunk_numel(chunk_numel)

    def shard_of(self, chunk: Chunk) -> tuple[int, int]:
        """``[lo, hi)`` of ``chunk`` this rank owns (the whole chunk at stage 0)."""
        return shard_range(chunk.numel, self.rank, self.world) if self.sharded else (0, chunk.numel)

    def shard(self, store: ChunkStore) -> None:
        """Set each chunk's shard before its optimizer state is allocated (``Chunk.init_state``)."""
        for c in store.chunks:
            c.set_shard(*self.shard_of(c))

    # ---- building the chunks ------------------------------------------------------------------------------
    def prepare_build(self, groups: Sequence[Sequence[torch.nn.Parameter]], chunk_numel: int, device: Any,
                      alloc: Any, compute_dtype: torch.dtype, mode: str | None = None,
                      free_bytes: int | None = None) -> dict[str, Any]:
        """Before the chunks are built: decide per chunk whether it is built on the device or on the CPU and
        put its parameters there (:func:`memsched.distributed.build.prepare`); records ``build_stats``."""
        from memsched.distributed.build import prepare

        self.build_stats = prepare(groups, chunk_numel, device, alloc, compute_dtype,
                                   mode or self.chunk_build, free_bytes=free_bytes, align=self.align)
        return self.build_stats

    # ---- wiring -------------------------------------------------------------------------------------------
    def install(self, store: ChunkStore) -> None:
        """Know the chunks (the store calls this engine at its moments; see :class:`DataParallel`)."""
        self.store = store
        self.reducer.install(store)
        if self.shards_grads:
            store.backward.observe_end(self.backward_end)

    def watch_model(self, model: torch.nn.Module) -> list[Any]:
        """Watch ``model``'s forwards for micro-batches in flight (:mod:`memsched.distributed.pipeline`);
        returns the hook handles."""
        return self.pipeline.install(model)

    def _pipeline_stage(self, reason: str) -> None:
        """The model is a pipeline stage: from now on every gradient reduction waits for the step, and the
        gradients are marked after each backward until then ([Note: gradients read before their
        reduction])."""
        self.reducer.defer_to_step = True

    def broadcast_model(self, model: torch.nn.Module, store: ChunkStore) -> None:
        """Start every rank from group rank 0's parameters and buffers (as DistributedDataParallel does)."""
        with torch.no_grad():
            for c in store.chunks:
                self.comm.broadcast(c.data, what=f"broadcast of chunk {c.index}")
            chunked = {id(p) for p in store.params()}
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if id(t) not in chunked:
                    self.comm.broadcast(t.data, what=f"broadcast of {name!r}")

    def check_same(self, what: str, value: Any) -> None:
        """Raise :class:`ZeroCommError` when ``value`` differs between ranks (layout, plan)."""
        values = self.comm.all_gather_object(value, what=f"comparing the {what}")
        if any(v != values[0] for v in values):
            bad = [r for r, v in enumerate(values) if v != values[0]]
            raise ZeroCommError(
                f"the {what} differs between ranks (ranks {bad} differ from rank 0): every rank "
                "must attach the same model with the same options"
            )

    # ---- parameters after the update ----------------------------------------------------------------------
    def after_update(self, c: Chunk) -> None:
        """Hook: ``c.data[lo:hi]`` holds this rank's updated shard; fetch the others' into ``c.data``."""
        if not self.sharded or c.data is None:  # ZeRO-3, the chunk away: its next gather sends the part
            return
        if c.h2d_event is not None:  # the shard's H2D comes first
            if c.data.device.type == "cuda":
                torch.cuda.current_stream(c.data.device).wait_event(c.h2d_event)
            else:  # the stand-in's link (memsched.devices.transfers): the host waits
                c.h2d_event.synchronize()
        what = f"parameter fetch ({self.fetch}) of chunk {c.index}"
        nbytes = c.data.numel() * c.data.element_size()
        with torch.no_grad():
            if self.fetch == "all_gather":
                work = self.comm.all_gather(c.data, c.data[c.lo : c.hi], what=what, async_op=True)
                self._fetch_bytes += (self.world - 1) * nbytes // self.world
            else:
                c.data[: c.lo].zero_()
                c.data[c.hi :].zero_()
                work = self.comm.all_reduce(c.data, what=what, async_op=True)
                self._fetch_bytes += 2 * (self.world - 1) * nbytes // self.world
        self._fetch_count += 1
        self._fetches.append((c.index, work))

    def end_step(self) -> None:
        """End of step: every fetch is complete before the next forward reads the parameters."""
        fetches, self._fetches = self._fetches, []
        for i, work in fetches:
            self.comm.wait(work, f"parameter fetch ({self.fetch}) of chunk {i}")

    # ---- global quantities --------------------------------------------------------------------------------
    def agree_margin_inputs(self, capacity_bytes: int, peak_non_model_bytes: int) -> tuple[int, int]:
        """The smallest capacity and the largest peak non-model data over all ranks (bytes), so that every
        rank plans with the smallest GPU margin and follows the same plan."""
        cap, neg_peak = self.comm.reduce_ints(
            [capacity_bytes, -peak_non_model_bytes], "min", what="agreeing on the GPU margin"
        )
        return cap, -neg_peak

    def agree_max(self, values: list[int]) -> list[int]:
        """Element-wise maximum of ``values`` over the ranks (one small all-reduce)."""
        return self.comm.reduce_ints(values, "max", what="agreeing on the inputs' peak (elastic placement)")

    def reduce_found_inf(self, found: torch.Tensor) -> torch.Tensor:
        """fp16: a step is skipped on every rank when any rank saw inf/NaN (a CPU float tensor ``[1]``)."""
        t = found.to(self.comm.device)
        self.comm.all_reduce(t, op=torch.distributed.ReduceOp.MAX, what="fp16 overflow check")
        return t.to(found.device)

    # ---- re-packing at the end of warmup ------------------------------------------------------------------
    def repack(self, store: ChunkStore, order: Sequence[torch.nn.Parameter], chunk_numel: int | None, *,
               after_chunk: Callable[[ChunkStore, Chunk], None] | None = None) -> None:
        """``store.repack`` across ranks: gather the state whole, re-pack with a padded chunk size, check that
        every rank got the same layout, cut the shards again. (``after_chunk``: parameters stay on the device
        with more ranks; it is not called.)"""
        from memsched.distributed.reshard import reshard, unshard

        unshard(self, store)
        if self.shards_grads:  # gradients not zeroed since the step move with their parameters, whole
            store.grads.make_whole(self.gather_grad)
        store.repack(order, chunk_numel=self.chunk_numel_for(store.groups, order, chunk_numel))
        lay = store.layout
        self.check_same("chunk layout", (lay.chunk_numel, lay.chunk_groups,
                                         tuple((s.group, s.index, s.numel) for c in lay.chunks for s in c)))
        reshard(self, store)
        if self.shards_grads:
            store.grads.shard_whole()
        self.reducer.reset()

    def full_state(self, c: Chunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole chunk's fp32 master, ``exp_avg``, ``exp_avg_sq`` on every rank (all-gathered; a
        collective), as new CPU tensors."""
        if not self.sharded:
            return super().full_state(c)
        g = self.comm.all_gather_shard_to
        return (
            g(c.master_view(), c.numel, what=f"gathering the master of chunk {c.index}"),
            g(c.exp_avg, c.numel, what=f"gathering exp_avg of chunk {c.index}"),
            g(c.exp_avg_sq, c.numel, what=f"gathering exp_avg_sq of chunk {c.index}"),
        )
