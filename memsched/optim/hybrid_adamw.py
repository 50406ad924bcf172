"""HybridAdamW: AdamW over chunks whose optimizer state lives on the device or in (pinned) host memory.

Idea: DeepSpeed ZeRO-Offload (arXiv 2101.06840: CPU Adam on offloaded state, D2H of gradients, H2D of updated
parameters) with PatrickStar's chunk-wise placement (arXiv 2108.05818): a placement plan decides per chunk
whether its update runs on the device or on the CPU. Every update is :func:`memsched.optim.adam.fused_adamw_`,
one tensor per parameter as in ``torch.optim.AdamW(fused=True)``, whose results it matches bit for bit.

Host chunks' gradients are copied D2H at :meth:`HybridAdamW.step`, not during backward: between backward and
the step anything may write the gradients (``clip_grad_norm_``, ``p.grad.data.mul_()``, an unscale), and no
signal says so reliably (version counters do not move under a dispatch mode or through ``.data``). Copying
once, after all of it, is exact and moves the same bytes with or without clipping; the copies of later chunks
overlap the CPU update of earlier ones.

Parameters without a gradient follow ``torch.optim.AdamW``: the ``.grad`` stay bound to the chunks' gradient
buffers (so backward never allocates new gradient tensors), but after ``zero_grad()`` (``set_to_none=True``,
torch's default) or ``model.zero_grad()`` a parameter that gets no gradient is not updated and its step count
does not move; each parameter has its own step count.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memsched.chunks import Chunk, ChunkStore, param_shards
from memsched.chunks.sizing import H2D_PIECE_NUMEL
from memsched.devices.transfers import Streams, TransferStats
from memsched.distributed.base import DataParallel
from memsched.optim import state_dict as optim_state
from memsched.optim.adam import fp32_grad, fused_adamw_
from memsched.optim.clipping import Clipper
from memsched.optim.early_update import EarlyUpdates
from memsched.optim.grads import GradChecks
from memsched.optim.host_updates import HostUpdates
from memsched.optim.hyperparams import (  # noqa: F401 (re-exported: hybrid_adamw.check_hyperparameters etc.)
    adamw_default_keys,
    check_hyperparameters,
    hyperparameter_groups,
    indexed_param_groups,
)
from memsched.optim.precision import LossScaler
from memsched.optim.streamed_update import StreamedUpdates
from memsched.telemetry.step_timeline import CPU_UPDATE, WAITS, StepTimeline
from policies.types import DEVICE, HOST


class HybridAdamW(torch.optim.Optimizer):
    """AdamW whose state lives in chunks placed on the device or the host (see the module docstring).

    ``param_groups`` mirror the user's groups (``lr``, ``betas``, ``eps``, ``weight_decay`` per group, read at
    every step, so LR schedulers work). ``state_dict()`` has the format of ``torch.optim.AdamW``.

    Not built directly: :func:`memsched.attach` builds it (it needs the chunks the scheduler made).

    Args:
        store: the chunks.
        groups: the user's param groups (dicts with ``"params"`` and optional hyper-parameters).
        defaults: ``lr``, ``betas``, ``eps``, ``weight_decay``.
        streams: side streams for H2D/D2H (CUDA) or synchronous copies.
        transfers: byte counters updated by every copy.
        scaler: fp16 loss scaler, or ``None``.
        capacity_check: ``f(extra_bytes, what)`` raising when the device cannot hold ``extra_bytes`` more
            (the stand-in device's capacity check), or ``None``.
        names: ``id(param) -> qualified name`` for error messages.
        dp: the data parallelism (:class:`memsched.distributed.base.DataParallel`); default one rank.
        owner_thread: the thread steps must run on (``None``: any).
        grad_offload: the store's :class:`memsched.chunks.grad_offload.GradOffload` (where a host chunk's
            gradients land, for the updates during backward), or ``None``.
    """

    def __init__(self, store: ChunkStore, groups: Sequence[dict[str, Any]], *, defaults: dict[str, Any],
                 streams: Streams, transfers: TransferStats, scaler: LossScaler | None = None,
                 capacity_check: Callable[[int, str], None] | None = None,
                 names: dict[int, str] | None = None, dp: DataParallel | None = None,
                 owner_thread: int | None = None, grad_offload: Any = None,
                 update_threads: int | None = None) -> None:
        full = {**adamw_default_keys(), **defaults}
        super().__init__([dict(g) for g in groups], full)
        for i, g in enumerate(self.param_groups):
            check_hyperparameters(g, f"param group {i}")
        self.store = store
        self.streams = streams
        self.transfers = transfers
        self.scaler = scaler
        self.capacity_check = capacity_check
        self.names = names or {}
        self.dp = dp if dp is not None else DataParallel()  # one rank, or ZeRO
        self.owner_thread = owner_thread  # steps must run on the attaching thread (None: any)
        self.grad_offload = grad_offload  # memsched.chunks.grad_offload.GradOffload (one rank), or None
        self._active: set[int] = set()  # ids of the parameters updated by the step in progress
        self.checks = GradChecks(store, self.dp, scaler, self._name)
        self.clipper = Clipper(store, scaler, transfers, grad_offload=grad_offload)
        # overlap=True (after warmup: enter_steady_state): host chunks are updated on a worker thread
        # (memsched.optim.host_updates); the step timeline records where each step's time went
        # (memsched.telemetry.step_timeline).
        self.overlap = False
        self.host_updates = HostUpdates(store.alloc.device, update_threads)
        self._grad_scratch: torch.Tensor | None = None  # [Note: one fp32 gradient scratch]
        # lean host chunks' H2D source, and the chunk whose copy may still read it ([Note: lean host chunks])
        self._h2d_staging: torch.Tensor | None = None
        self._h2d_staging_user: Chunk | None = None
        self.timeline = StepTimeline()
        self._zero_grad_observers: list[Callable[[], None]] = []  # memsched.runtime.elastic_hooks
        # overlap="backward" (after warmup): host chunks are updated during backward into spare state,
        # committed at the step when exact (memsched.optim.early_update).
        self.early_updates = EarlyUpdates(self.host_updates.run, self._adamw_all, fp32_grad,
                                          self.timeline.span, store.alloc)
        # host_update="device"/"auto": the plan's streamed host chunks are updated on the device, their state
        # streamed over the link (memsched.optim.streamed_update).
        self.streamed = StreamedUpdates(store, streams, transfers, self.timeline.span)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def enter_steady_state(self, *, overlap: bool, early_update: bool,
                           speculative: Sequence[int] = (), streamed: Sequence[int] = ()) -> None:
        """The end of warmup (the plan is applied): host chunks update on the worker (``overlap``), the
        updates of the plan's ``speculative`` chunks start during backward (``early_update``:
        ``overlap="backward"``) and its ``streamed`` chunks are updated on the device; the step timeline
        starts recording."""
        self.overlap = overlap
        self.streamed.chunks = frozenset(streamed)
        if early_update:
            self.early_updates.enable(self.dp.world, self.store.trainable_chunks, speculative)
        self.timeline.start(overlap=overlap)

    def detach(self) -> None:
        """``close()``: the overlapped update in flight finishes and none starts later, the step timeline
        stops, and steps may run on any thread. The optimizer keeps working."""
        try:
            self.overlap = False
            self.timeline.stop()
            self.early_updates.wait()  # a refill in flight; none starts later
            self.early_updates.refills.clear()  # each holds its chunk's host state
            self.streamed.wait()  # the streamed updates' copies into the host state
            self.early_updates.enabled = False
            self.host_updates.close()
        finally:
            self.owner_thread = None

    def observe_zero_grad(self, observer: Callable[[], None]) -> None:
        """Call ``observer()`` at the start of every :meth:`zero_grad` (the retry loop's ``zero_grad`` in its
        ``except`` tells elastic placement of an out-of-memory error:
        :mod:`memsched.runtime.elastic_hooks`)."""
        self._zero_grad_observers.append(observer)

    @property
    def _clip_coefs(self) -> list[torch.Tensor]:
        """fp16: the clip coefficients pending for the next step
        (:class:`memsched.optim.clipping.Clipper`)."""
        return self.clipper.pending

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def _name(self, p: torch.Tensor) -> str:
        return self.names.get(id(p), f"of shape {tuple(p.shape)}")

    def record_param_versions(self) -> None:
        """Remember each parameter's version counter
        (:meth:`memsched.optim.grads.GradChecks.record_param_versions`)."""
        self.checks.record_param_versions()

    def note_scaled_backward(self) -> None:
        """fp16: :meth:`memsched.Scheduler.backward` ran a backward of the scaled loss
        (:meth:`memsched.optim.grads.GradChecks.note_scaled_backward`)."""
        self.checks.note_scaled_backward()

    def scaled_grads_unchanged(self) -> bool:
        """fp16: nothing wrote the gradient buffers since the last scaled backward."""
        return self.checks.scaled_grads_unchanged()

    def _start_d2h(self, c: Chunk) -> None:
        """D2H of host chunk ``c``'s gradients after everything that may have written them (backward, gradient
        reductions, clipping) was queued."""
        with self.store.alloc.host_context():
            self.transfers.add_d2h(c.start_d2h(self.streams))

    def _step_temporary_bytes(self, device_chunks: list[Chunk]) -> int:
        # Mixed precision updates each device chunk from an fp32 copy of its gradients, one chunk at a time.
        mixed = [c for c in device_chunks if c.mixed]
        return max((c.shard_numel * 4 for c in mixed), default=0)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One AdamW step over all chunks.

        Order (each host chunk's gradients are read once, after everything that may write them):
        gradient reductions finish (data parallel); fp16 only: one inf/NaN check over the gradients on the
        device (the loss scale updates, a step with inf/NaN is skipped); the D2H copies of the host chunks'
        gradients start on the side stream; the device chunks are updated; each host chunk is updated on the
        CPU as soon as its gradients arrived, and its parameters go back H2D. fp16 gradients are unscaled with
        the scale of the backward that made them (captured before the scale updates, as
        ``torch.amp.GradScaler`` does), then clipped by the coefficient of :meth:`clip_grad_norm_`, in fp32,
        on whichever side updates them.

        Everything that can fail is checked before the first in-place write, so a step that raises leaves
        parameters and optimizer state exactly as before it.

        Raises:
            ValueError: a group's hyper-parameter is invalid (names the group and value), or a gradient
                has the wrong shape/dtype/device (names the parameter).
            RuntimeError: a parameter is no longer a view into its chunk (the model was converted after
                attach; :meth:`memsched.chunks.binding.ChunkBindings.check_bound`).
            memsched.devices.simdevice.SimOutOfMemoryError: the stand-in device cannot hold the step's
            temporaries.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.owner_thread is not None and threading.get_ident() != self.owner_thread:
            raise RuntimeError(
                "memsched: optimizer.step() ran on another thread than memsched.attach; the warmup tracer "
                "and the stand-in's accounting are dispatch modes of the attaching thread, so training must "
                "stay on that thread until sched.close()")
        self.timeline.step_begin()
        self.wait_updates("step()")  # the previous step's overlapped CPU update
        hps = [check_hyperparameters(g, f"param group {i}") for i, g in enumerate(self.param_groups)]
        self.store.settle_user_writes()  # device kernels that wrote host buffers through the user views
        self.store.settle()  # host chunks' gradients on the host (refuses after a backward that failed)
        if self.scaler is not None:
            self.checks.check_scaled_grads()
        self.store.follow_memory_format()  # model.to(memory_format=...) since the last forward
        self.store.bindings.check_bound(self.names)
        fixes = self.checks.validate_grads()  # allocates the buffers that gradients set by hand go into
        store = self.store
        # the others have no gradient (ZeRO-2: every chunk is reduced below, and has its shard then)
        chunks = [c for c in store.trainable_chunks if store.shards_grads or store.grads.has(c) or any(
            g is not None for p, g in fixes if store.param_chunk[id(p)] is c)]
        device_chunks = [c for c in chunks if c.placement == DEVICE]
        streamed = [c for c in chunks if c.placement == HOST and self.streamed.takes(c)]
        host_chunks = [c for c in chunks if c.placement == HOST and not self.streamed.takes(c)]
        if self.capacity_check is not None:
            self.capacity_check(self._step_temporary_bytes(device_chunks) + self.streamed.temporary_bytes(
                streamed), "optimizer step temporaries")
        self.streamed.prepare(streamed)  # its device buffers: out of memory raises here, before any write
        # ---- no failure expected below this line: in-place writes start ------------------------------------
        with_grad = store.grads.with_grad
        for p, g in fixes:
            host_bound = store.bindings.param_host_bound(p)
            if g is None:  # p.grad = None (e.g. model.zero_grad()): no gradient, not updated (torch's rule)
                if not host_bound and store.param_chunk[id(p)].grad is not None:
                    store.grads.view(p).zero_()  # a later backward writes its gradient from zero
                with_grad.discard(id(p))
                store.grads.host_grads.discard(id(p))
            else:
                view = store.host_view("grad", p) if host_bound else store.grads.view(p)
                with store.alloc.host_context() if host_bound else contextlib.nullcontext():
                    view.copy_(g)
                p.grad = store.user_view("grad", p) if host_bound else view
                with_grad.add(id(p))
                if host_bound:
                    store.grads.host_grads.add(id(p))
        self.checks.sync_user_param_writes()
        self.dp.before_update()  # gradient reductions are complete
        self._active = self.dp.agree_with_grad(self.store, with_grad)
        coefs = self.clipper.take()
        inv_scale = None
        if self.scaler is not None:
            inv_scale = self.scaler.inv_scale(self.store.alloc.device)  # before the scale updates
            if self.checks.found_inf(chunks):
                self.scaler.skip_step()
                self.early_updates.discard()
                self.streamed.release()
                self._refill(host_chunks)
                self._finish_step()
                return loss
        with self.store.alloc.host_context():
            inv_host = inv_scale.cpu() if inv_scale is not None and host_chunks else None
            coefs_host = [k.cpu() for k in coefs] if host_chunks else []
        committed = self._commit_early(host_chunks, hps, inv_host, coefs)
        for c in host_chunks:
            # One rank: the gradients reached the host in backward (memsched.chunks.grad_offload); with more
            # ranks they are copied now, after their reduction.
            if not store.offloads(c) and c.index not in committed:
                self._start_d2h(c)
        # Device chunks first (the device works while the CPU updates the host chunks), then streamed ones.
        for gi, hp in enumerate(hps):
            self._update_device(gi, hp, [c for c in device_chunks if c.group == gi], inv_scale, coefs)
        self.streamed.update(streamed, hps, self._active, inv_scale, coefs)
        if host_chunks:
            if self.overlap:
                self._submit_host(host_chunks, hps, inv_host, coefs_host, committed)
            else:
                for c in host_chunks:
                    with self.store.alloc.host_context():
                        self._update_host(c, hps[c.group], inv_host, coefs_host, updated=c.index in committed)
                    self.store.after_update(c)
        # the streamed updates ran beside the CPU path's; the host state and the parameters' host values (read
        # between steps, where parameters are host views) are the step's once their D2H copies are done
        self.streamed.wait()
        self._refill(host_chunks)
        self._finish_step()
        return loss

    def _refill(self, host_chunks: list[Chunk]) -> None:
        """The speculating host chunks' spare states take their state for the next step, on the worker after
        this step's host updates (:meth:`EarlyUpdates.refill`)."""
        early = self.early_updates
        if early.enabled:
            for c in host_chunks:
                if c.index in early.speculative:
                    early.refill(c)

    def _finish_step(self) -> None:
        self.checks.record_param_versions()
        self.transfers.end_step()
        self.dp.end_step()

    def _adamw(self, chunks: list[Chunk], masters: list[torch.Tensor], grads: list[torch.Tensor],
               hp: dict[str, Any], states: list[tuple[torch.Tensor, ...]] | None = None,
               active: set[int] | None = None) -> None:
        """One fused AdamW call over ``chunks``, given each chunk's fp32 master and gradient of its shard
        (``[hi - lo]``), and optionally other state tensors (``(exp_avg, exp_avg_sq, steps)`` per chunk; the
        spare state of :mod:`memsched.optim.early_update`) and set of parameters with a gradient. The kernel
        gets one tensor per parameter (its part in this rank's shard), as ``torch.optim.AdamW`` does: torch's
        CPU kernel computes the last ``numel % vector width`` elements of each tensor on a scalar path whose
        rounding differs, so flat chunk-sized tensors would not be bit-exact. Only parameters that have a
        gradient this step are updated, and only their step counts move (``torch.optim.AdamW`` skips
        parameters whose ``.grad`` is None)."""
        active = self._active if active is None else active
        if states is None:
            states = [(c.exp_avg, c.exp_avg_sq, c.steps) for c in chunks]
        ps, gs, ms, vs, steps, elsewhere = [], [], [], [], [], []
        for c, master, grad, (m, v, st) in zip(chunks, masters, grads, states, strict=True):
            for k, (p, part) in enumerate(zip(c.params, param_shards(c.ranges, c.lo, c.hi), strict=True)):
                if id(p) not in active:
                    continue
                if part is None:  # updated by the ranks whose shards hold it: its count moves here too
                    elsewhere.append(st[k])
                    continue
                sl = slice(part.shard_start, part.shard_start + part.numel)
                ps.append(master[sl])
                gs.append(grad[sl])
                ms.append(m[sl])
                vs.append(v[sl])
                steps.append(st[k])
        if elsewhere:
            torch._foreach_add_(elsewhere, 1)
        if not ps:
            return
        fused_adamw_(ps, gs, ms, vs, steps, lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                     weight_decay=hp["weight_decay"], maximize=hp["maximize"])

    def _adamw_all(self, c: Chunk, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, steps: torch.Tensor, hp: dict[str, Any]) -> None:
        """:meth:`_adamw` of every parameter of ``c`` on the given state (the update during backward)."""
        self._adamw([c], [master], [grad], hp, states=[(exp_avg, exp_avg_sq, steps)],
                    active={id(p) for p in c.params})

    def _update_device(self, gi: int, hp: dict[str, Any], chunks: list[Chunk],
                       inv_scale: torch.Tensor | None, coefs: list[torch.Tensor]) -> None:
        if not chunks:
            return
        fp32 = [c for c in chunks if not c.mixed]
        if fp32:  # one fused call over all fp32 device chunks of the group
            self._adamw(fp32, [c.param_part() for c in fp32], [c.reduced_grad() for c in fp32], hp)
            for c in fp32:
                self.store.after_update(c)
        for c in chunks:
            if not c.mixed:
                continue
            # One chunk at a time: the fp32 gradient copy is a temporary of one chunk, not of all of them.
            g = fp32_grad(c.reduced_grad(), None, inv_scale, coefs)
            self._adamw([c], [c.master], [g], hp)
            del g
            c.param_part().copy_(c.master)
            self.store.after_update(c)

    def _update_host(self, c: Chunk, hp: dict[str, Any], inv_scale: torch.Tensor | None,
                     coefs: list[torch.Tensor], after: Any = None, updated: bool = False,
                     prepared: bool = False) -> None:
        """Update host chunk ``c`` on the CPU and start the H2D copy of its parameters (on the training
        thread, or on the overlap worker, which never enters the stand-in's accounting contexts).
        ``updated``: the update was made during backward and committed (:mod:`memsched.optim.early_update`):
        only the H2D copy is left. ``prepared``: ``c.host_grad`` holds the unscaled, clipped fp32 gradients
        already (the overlapped step made that copy on the training thread)."""
        span = self.timeline.span
        if updated:
            t0 = time.perf_counter()
            src = c.staging if c.staging is not None else c.master
            self.transfers.add_h2d(c.start_h2d(self.streams, src, after=after))
            span(CPU_UPDATE, "h2d", t0, time.perf_counter(), chunk=c.index)
            return
        t0 = time.perf_counter()
        c.wait_d2h()
        t1 = time.perf_counter()
        grads = c.host_grad
        if not prepared:
            grads = self._update_grads(c, inv_scale, coefs)
        self._adamw([c], [c.master], [grads], hp)
        src = c.master
        if c.staging is not None:  # cast on the CPU, so the H2D copy is a plain pinned copy
            c.staging.copy_(c.master)
            src = c.staging
        t2 = time.perf_counter()
        if c.staging is None and c.mixed:  # a lean chunk: cast and sent in pieces through the staging buffer
            self.transfers.add_h2d(self._h2d_in_pieces(c, after))
        else:
            self.transfers.add_h2d(c.start_h2d(self.streams, src, after=after))
        t3 = time.perf_counter()
        span(CPU_UPDATE, "d2h wait", t0, t1, chunk=c.index)
        span(CPU_UPDATE, "update", t1, t2, chunk=c.index)
        span(CPU_UPDATE, "h2d", t2, t3, chunk=c.index)

    def _update_grads(self, c: Chunk, inv_scale: torch.Tensor | None, coefs: list[torch.Tensor]
                      ) -> torch.Tensor:
        """The fp32 gradients ``c``'s CPU update reads (``c.host_grad``, or the shared scratch), upcast,
        unscaled and clipped from where they are (the host gradients backward offloaded, or the D2H copy of
        the step)."""
        if self.store.offloads(c):
            src = c.grad_host  # where backward's gradients went (and what p.grad shows)
        else:
            src = c.staging if c.staging is not None else c.host_grad
        out = c.host_grad if c.host_grad is not None else self.grad_scratch(c.shard_numel)
        return fp32_grad(src, out, inv_scale, coefs)  # upcast on the CPU

    def _h2d_in_pieces(self, c: Chunk, after: Any) -> int:
        """A lean host chunk's updated values to the device ([Note: lean host chunks] in
        :mod:`memsched.chunks.chunk`): cast from the master on the CPU, piece by piece (at most
        ``H2D_PIECE_NUMEL`` elements), into the staging buffer, each piece's copy started before the next is
        cast; returns the bytes."""
        n, sent = c.shard_numel, 0
        if c.data is None and c.param_shard is None:
            return 0
        for lo in range(0, n, H2D_PIECE_NUMEL):
            piece = min(H2D_PIECE_NUMEL, n - lo)
            buf = self.h2d_staging(c, piece)
            buf.copy_(c.master[lo:lo + piece])
            sent += c.start_h2d(self.streams, buf, after=after, lo=lo)
        return sent

    def h2d_staging(self, c: Chunk, numel: int) -> torch.Tensor:
        """``numel`` elements of the one pinned staging buffer the lean host chunks send their values from
        (compute dtype; the largest piece any of them sends, as the plan counts it), once the copy that last
        read it is done: at most one piece is in flight."""
        prev, self._h2d_staging_user = self._h2d_staging_user, c
        if prev is not None:
            prev.wait_h2d()  # its copy may still read the buffer
        buf = self._h2d_staging
        if buf is None or buf.numel() < numel or buf.dtype != c.dtype:
            size = max([numel, *(min(x.shard_numel, H2D_PIECE_NUMEL) for x in self.store.trainable_chunks
                                 if x.lean)])
            buf = self._h2d_staging = self.store.alloc.host_empty(size, c.dtype)
        return buf[:numel]

    def grad_scratch(self, numel: int) -> torch.Tensor:
        """[Note: one fp32 gradient scratch]
        Under mixed precision the CPU update of a host chunk reads fp32 gradients, upcast from the chunk's
        compute-dtype host gradients. Serial steps update one host chunk at a time on the training thread,
        so one fp32 buffer of the largest chunk's shard serves them all, instead of 4 bytes per parameter kept
        for every host chunk (the plan counts those bytes as saved:
        :func:`memsched.chunks.sizing.chunk_bytes`).
        With ``overlap`` each host chunk keeps its own (``private_grads``): the step prepares every chunk's
        gradients before the worker updates them. ``numel`` elements of it, fp32 (host memory, not pinned:
        it never crosses the link)."""
        if self._grad_scratch is None or self._grad_scratch.numel() < numel:
            self._grad_scratch = torch.empty(numel, dtype=torch.float32)
        return self._grad_scratch[:numel]

    def clip_grad_norm_(self, params: Sequence[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0, *, norms_from_backward: bool = True) -> torch.Tensor:
        """Clip the gradients of ``params`` to a total norm of ``max_norm``; returns the total norm before
        clipping (:meth:`memsched.optim.clipping.Clipper.clip_grad_norm_`: torch's own clip, or under fp16 the
        norm of the unscaled fp32 gradients with the coefficient applied at the step). Call it after backward
        and before :meth:`step`. ``norms_from_backward``: see :meth:`Clipper.clip_grad_norm_`."""
        return self.clipper.clip_grad_norm_(params, max_norm, norm_type,
                                            norms_from_backward=norms_from_backward)

    # ---- the host chunks: updates during backward, the overlapped update ---------------------------------
    def grads_ready(self, c: Chunk) -> None:
        """The store's observer, after the gradients' offload began (:mod:`memsched.chunks.grad_offload`): all
        of ``c``'s gradients are complete in this backward. With ``overlap="backward"`` a host chunk's update
        starts now from the gradients its D2H copy brings (:mod:`memsched.optim.early_update`), unless they
        are to be added to an earlier micro-batch's."""
        if c.placement != HOST or not self.store.offloads(c) or self.grad_offload is None:
            return
        hp = self._early_hyperparameters(c)
        flight = self.grad_offload.in_flight(c)
        if hp is None or flight is None:
            return
        landing, parts = flight
        self.early_updates.start(c, hp, self.checks.next_inv_scale if self.scaler is not None else None,
                                 c.d2h_event, landing=landing, parts=parts)

    def _early_hyperparameters(self, c: Chunk) -> dict[str, Any] | None:
        """The hyper-parameters for an update of ``c`` during backward, or ``None`` when it is not made: not
        enabled, more than one rank, fp16 before its first inverse scale, a clip coefficient already pending,
        or a group the step would refuse."""
        if not self.early_updates.enabled or self.dp.world != 1 or self.clipper.pending:
            return None
        if self.scaler is not None and self.checks.next_inv_scale is None:
            return None
        try:
            return check_hyperparameters(self.param_groups[c.group], f"param group {c.group}")
        except ValueError:  # the step raises it
            return None

    def _commit_early(self, host_chunks: list[Chunk], hps: list[dict[str, Any]],
                      inv_host: torch.Tensor | None, coefs: list[torch.Tensor]) -> set[int]:
        """Swap in the updates made during backward that equal the step's (:meth:`EarlyUpdates.commit`): the
        host gradients the step reads are compared bit for bit with the ones the update read. A chunk whose
        update is swapped in has new host buffers: its host-bound parameters follow."""
        if not self.early_updates.tickets:
            return set()

        def grads_equal(c: Chunk, ticket: Any) -> bool:
            with self.store.alloc.host_context():
                return torch.equal(_bits(c.grad_host), _bits(ticket.snapshot))

        done = self.early_updates.commit(host_chunks, hps, inv_host, coefs, self._active, grads_equal)
        for c in host_chunks:
            if c.index in done:
                self.store.bindings.refresh_host(c)
        return done

    def _submit_host(self, host_chunks: list[Chunk], hps: list[dict[str, Any]],
                     inv_scale: torch.Tensor | None, coefs: list[torch.Tensor], committed: set[int]) -> None:
        """Hand the host chunks to the worker (:mod:`memsched.optim.host_updates`), in chunk (first-use)
        order. Their H2D copies wait for the work queued so far (this step's backward), not for the next
        forward. The ``committed`` ones were updated during backward: only their H2D copies are left."""
        after = self.streams.record()
        by_index = {c.index: c for c in host_chunks}
        # The worker reads its own copy of the host gradients, made here: p.grad (the host gradients) may be
        # written after step() returns (model.zero_grad(set_to_none=False), p.grad.zero_()).
        prepared = {c.index for c in host_chunks if self.store.offloads(c) and c.index not in committed}
        with self.store.alloc.host_context():
            for i in prepared:
                self._update_grads(by_index[i], inv_scale, coefs)

        def update(i: int) -> None:
            c = by_index[i]
            self._update_host(c, hps[c.group], inv_scale, coefs, after=after, updated=i in committed,
                              prepared=i in prepared)

        def follow_up(i: int) -> None:  # on the training thread: collectives, version bookkeeping
            c = by_index[i]
            self.store.after_update(c)
            self.dp.end_step()  # its fetch (ZeRO all-gather) completes before the forward reads the chunk
            self.checks.record_param_versions(c.params)  # the H2D copy moved their version counters

        self.host_updates.submit(sorted(by_index), update, follow_up)
        # CUDA: what the compute stream runs next comes after the D2H copies that still read the gradients, so
        # an in-place write memsched cannot see (``model.zero_grad(set_to_none=False)``, ``p.grad.zero_()``)
        # cannot change them under a copy. The host does not wait (the worker waits for each copy itself).
        self.streams.wait([c.d2h_event for c in host_chunks])

    def wait_updates(self, what: str = "synchronize()") -> None:
        """Block until the last step's overlapped CPU update is done and followed up (nothing pending without
        ``overlap=True``); the time blocked is a span of the step timeline named after ``what``.

        Raises:
            memsched.optim.host_updates.OverlapError: the overlapped update failed.
        """
        t0 = time.perf_counter()
        blocked = self.host_updates.wait_all()
        self.streamed.wait()  # the streamed updates' D2H copies into the host state
        if self.early_updates.busy:  # anything that reads or writes the state waits for the worker's reads
            self.early_updates.wait()
            blocked = time.perf_counter() - t0
        if blocked > 0:
            self.timeline.span(WAITS, f"{what} <- all chunks", t0, time.perf_counter())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients and a pending fp16 clip coefficient (``GradBuffers.zero_grad``): with
        ``set_to_none`` (torch's default) and one rank the gradient buffers are freed and every ``.grad`` is
        None; otherwise the buffers are zeroed in place and the views stay. A parameter that gets no
        gradient in the next backward is not updated, as ``torch.optim.AdamW`` skips ``.grad`` None."""
        for observer in self._zero_grad_observers:
            observer()
        self.clipper.clear()
        if not (set_to_none and self.store.lazy_grads):
            # Zeroed in place: after the D2H copies of an overlapped step that may still read them. A freed
            # buffer needs no wait (CUDA: its copy's stream was recorded on it; the stand-in's link: the copy
            # holds it).
            self.streams.wait([c.d2h_event for c in self.store.chunks], "zero_grad()")
            self.streamed.wait()  # its H2D copies of host gradients are done once its D2H copies are
        self.store.grads.zero_grad(set_to_none)

    # ---- state_dict (one path for any world size: memsched.optim.state_dict)
    # -----------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The format of ``torch.optim.AdamW.state_dict()`` (:func:`memsched.optim.state_dict.state_dict`);
        with data parallelism a collective: call it on every rank."""
        self.wait_updates("optimizer.state_dict()")
        return optim_state.state_dict(self)

    def validate_state_dict(
        self, state_dict: dict[str, Any]
    ) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, float]]:
        """Check a state dict against this optimizer without writing anything
        (:func:`memsched.optim.state_dict.validate_state_dict`)."""
        return optim_state.validate_state_dict(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of :meth:`state_dict` or ``torch.optim.AdamW`` (same parameter order); with data
        parallelism every rank loads the same dict and keeps its shards
        (:func:`memsched.optim.state_dict.load`).

        Raises:
            ValueError: the group count differs, a group's size matches neither numbering (every parameter
                given, or the trainable ones only), a tensor has the wrong shape, or a state lacks a key.
        """
        self.wait_updates("optimizer.load_state_dict()")
        optim_state.load_state_dict(self, state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: chunks are built once for the parameters given to
        :func:`memsched.attach`.

        Raises:
            RuntimeError: called after construction.
        """
        if getattr(self, "store", None) is not None:
            raise RuntimeError(
                "HybridAdamW cannot take new param groups after attach: the chunks are built once, for the "
                "parameters given to memsched.attach. For progressive unfreezing, pass every group to "
                "memsched.attach(params=[...]) from the start (frozen parameters included: no chunk and no "
                "state until trainable), "
                "then to unfreeze: state = sched.optimizer.state_dict(); sched.close(); "
                "p.requires_grad_(True); sched = memsched.attach(model, params=<the same groups>); "
                "sched.optimizer.load_state_dict(state)")
        super().add_param_group(param_group)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (an integer view): equal bits, not equal values (-0.0 == 0.0 and NaN != NaN as
    values, and AdamW may round either differently)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])
