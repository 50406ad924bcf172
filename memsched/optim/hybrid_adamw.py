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

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memsched.chunks import Chunk, ChunkStore, param_shards
from memsched.chunks.fingerprint import Fingerprinter
from memsched.devices.transfers import Streams, TransferStats
from memsched.distributed.base import DataParallel
from memsched.optim import state_dict as optim_state
from memsched.optim.adam import fused_adamw_
from memsched.optim.early_update import EarlyUpdates
from memsched.optim.grads import GradientChecksMixin
from memsched.optim.host_offload import OverlapMixin
from memsched.optim.host_updates import HostUpdates
from memsched.optim.hyperparams import (  # noqa: F401 (re-exported: memsched.optim.hybrid_adamw.check_hyperparameters etc.)
    adamw_default_keys,
    check_hyperparameters,
    hyperparameter_groups,
    indexed_param_groups,
)
from memsched.optim.precision import LossScaler
from memsched.telemetry.step_timeline import CPU_UPDATE, StepTimeline
from policies.types import DEVICE, HOST


class HybridAdamW(GradientChecksMixin, OverlapMixin, torch.optim.Optimizer):
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
    """

    def __init__(self, store: ChunkStore, groups: Sequence[dict[str, Any]], *, defaults: dict[str, Any],
                 streams: Streams, transfers: TransferStats, scaler: LossScaler | None = None,
                 capacity_check: Callable[[int, str], None] | None = None,
                 names: dict[int, str] | None = None, dp: DataParallel | None = None) -> None:
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
        self._clip_coefs: list[torch.Tensor] = []  # fp16: clip coefficients applied at the next step
        self._active: set[int] = set()  # ids of the parameters updated by the step in progress
        self.owner_thread: int | None = None  # set by the scheduler: steps must run on the attaching thread
        # overlap=True (set by the scheduler after warmup): host chunks are updated on a worker thread
        # (memsched.optim.host_updates); the step timeline records where each step's time went
        # (memsched.telemetry.step_timeline).
        self.overlap = False
        self.host_updates = HostUpdates(store.alloc.device)
        self.timeline = StepTimeline()
        # early_d2h (set by the scheduler after warmup, one rank, CUDA): a host chunk's gradients start their
        # D2H in backward, as soon as they are complete; the step uses that copy if a fingerprint says the
        # gradients did not change since (memsched.chunks.fingerprint), else copies again.
        self.early_d2h = False
        self._early: dict[int, torch.Tensor] = {}  # chunk index -> fingerprint of the gradients it copied
        self._fingerprints = Fingerprinter()
        self._param_versions: dict[int, int] = {}
        self.record_param_versions()
        # set by the scheduler (memsched.planning.elastic)
        self.on_zero_grad: Callable[[], None] | None = None
        # overlap="backward" (enabled by the scheduler after warmup): host chunks are updated during backward
        # into spare state, committed at the step when exact (memsched.optim.early_update).
        self.early_updates = EarlyUpdates(self.host_updates.run, self._adamw_all, self._fp32_grad,
                                          self.timeline.span, store.alloc)
        self._spec_inv: torch.Tensor | None = None  # fp16: the next backward's inverse scale, on the host
        self._scaled_versions: list[int] | None = None  # fp16: grad versions after sched.backward

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def _name(self, p: torch.Tensor) -> str:
        return self.names.get(id(p), f"of shape {tuple(p.shape)}")

    def record_param_versions(self) -> None:
        """Remember each parameter's version counter: a later in-place write by the user (``load_state_dict``
        on the model, ``nn.init``) shows as a change and refreshes the master weights at the next step."""
        self._param_versions = {id(p): p._version for p in self.store.params()}

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
                attach; :meth:`memsched.chunks.ChunkStore.check_bound`).
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
        if self.scaler is not None:
            self._check_scaled_grads()
        self.store.check_bound(self.names)
        fixes = self._validate_grads()
        chunks = self.store.chunks
        device_chunks = [c for c in chunks if c.placement == DEVICE]
        host_chunks = [c for c in chunks if c.placement == HOST]
        if self.capacity_check is not None:
            self.capacity_check(self._step_temporary_bytes(device_chunks), "optimizer step temporaries")
        # ---- no failure expected below this line: in-place writes start ------------------------------------
        with_grad = self.store.with_grad
        for p, g in fixes:
            view = self.store.grad_view(p)
            if g is None:  # p.grad = None (e.g. model.zero_grad()): no gradient, not updated (torch's rule)
                view.zero_()  # a later backward writes its gradient into the view from zero
                with_grad.discard(id(p))
            else:
                view.copy_(g)
                p.grad = view
                with_grad.add(id(p))
        self._sync_user_param_writes()
        self.dp.before_update()  # gradient reductions are complete
        self._active = self.dp.agree_with_grad(self.store, with_grad)
        coefs, self._clip_coefs = self._clip_coefs, []
        early, self._early = self._early, {}
        inv_scale = None
        if self.scaler is not None:
            inv_scale = self.scaler.inv_scale(self.store.alloc.device)  # before the scale updates
            if self._found_inf(chunks):
                self.scaler.skipped_steps += 1
                self.early_updates.discard()
                self._finish_step()
                return loss
        with self.store.alloc.host_context():
            inv_host = inv_scale.cpu() if inv_scale is not None and host_chunks else None
            coefs_host = [k.cpu() for k in coefs] if host_chunks else []
        copied = self._early_copies_valid(host_chunks, early)
        committed = self._commit_early(host_chunks, hps, inv_host, coefs, copied)
        for c in host_chunks:
            if c.index not in copied and c.index not in committed:  # not copied in backward, or written since
                self._start_d2h(c)
        # Device chunks first (the device works while the CPU updates the host chunks).
        for gi, hp in enumerate(hps):
            self._update_device(gi, hp, [c for c in device_chunks if c.group == gi], inv_scale, coefs)
        if host_chunks:
            if self.overlap:
                self._submit_host(host_chunks, hps, inv_host, coefs_host, committed)
            else:
                for c in host_chunks:
                    with self.store.alloc.host_context():
                        self._update_host(c, hps[c.group], inv_host, coefs_host, updated=c.index in committed)
                    self.store.after_update(c)
        self._finish_step()
        return loss

    def _finish_step(self) -> None:
        self.record_param_versions()
        self.transfers.end_step()
        self.dp.end_step()

    @staticmethod
    def _fp32_grad(g: torch.Tensor, out: torch.Tensor | None, inv_scale: torch.Tensor | None,
                   coefs: list[torch.Tensor]) -> torch.Tensor:
        """``g`` as fp32 (into ``out`` when given), unscaled then clipped: the same IEEE operations, in the
        same order, as GradScaler's unscale and ``clip_grad_norm_`` on fp32 master gradients."""
        if out is None:
            out = g.float() if g.dtype != torch.float32 else g
        elif out is not g:
            out.copy_(g)
        if inv_scale is not None:
            out.mul_(inv_scale)
        for k in coefs:
            out.mul_(k)
        return out

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
            self._adamw(fp32, [c.data[c.lo:c.hi] for c in fp32], [c.grad[c.lo:c.hi] for c in fp32], hp)
            for c in fp32:
                self.store.after_update(c)
        for c in chunks:
            if not c.mixed:
                continue
            # One chunk at a time: the fp32 gradient copy is a temporary of one chunk, not of all of them.
            g = self._fp32_grad(c.grad[c.lo:c.hi], None, inv_scale, coefs)
            self._adamw([c], [c.master], [g], hp)
            del g
            c.data[c.lo:c.hi].copy_(c.master)
            self.store.after_update(c)

    def _update_host(self, c: Chunk, hp: dict[str, Any], inv_scale: torch.Tensor | None,
                     coefs: list[torch.Tensor], after: Any = None, updated: bool = False) -> None:
        """Update host chunk ``c`` on the CPU and start the H2D copy of its parameters (on the training
        thread, or on the overlap worker, which never enters the stand-in's accounting contexts).
        ``updated``: the update was made during backward and committed (:mod:`memsched.optim.early_update`):
        only the H2D copy is left."""
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
        src = c.staging if c.staging is not None else c.host_grad
        self._fp32_grad(src, c.host_grad, inv_scale, coefs)  # upcast on the CPU
        self._adamw([c], [c.master], [c.host_grad], hp)
        src = c.master
        if c.staging is not None:  # cast on the CPU, so the H2D copy is a plain pinned copy
            c.staging.copy_(c.master)
            src = c.staging
        t2 = time.perf_counter()
        self.transfers.add_h2d(c.start_h2d(self.streams, src, after=after))
        t3 = time.perf_counter()
        span(CPU_UPDATE, "d2h wait", t0, t1, chunk=c.index)
        span(CPU_UPDATE, "update", t1, t2, chunk=c.index)
        span(CPU_UPDATE, "h2d", t2, t3, chunk=c.index)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers and drop a pending fp16 clip coefficient. The ``.grad`` views stay
        bound (no new gradient tensors in the next backward), but with ``set_to_none`` (torch's default) the
        parameters count as having no gradient: one that gets none in the next backward is not updated, as
        ``torch.optim.AdamW`` skips parameters whose ``.grad`` is None."""
        if self.on_zero_grad is not None:
            self.on_zero_grad()
        self._clip_coefs = []
        self._early = {}  # copies of gradients that are now zeroed: the next backward copies again
        # The gradient buffers may still be read by D2H copies of an overlapped step (CUDA): zero after them.
        self.streams.wait([c.d2h_event for c in self.store.chunks])
        self.store.zero_grad(set_to_none)

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
            raise RuntimeError("HybridAdamW cannot take new param groups after attach; pass all groups to "
                               "memsched.attach(params=[...])")
        super().add_param_group(param_group)
