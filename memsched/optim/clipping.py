"""Gradient-norm arithmetic of ``torch.nn.utils.clip_grad_norm_``, for gradients that are not one list of
tensors.

memsched clips fp16 gradients as GradScaler users do (``scaler.unscale_(opt)`` then ``clip_grad_norm_`` on
fp32 master gradients) without holding fp32 copies of all gradients at once: the per-tensor norms are computed
one chunk at a time and combined here. To be bit-identical to torch, each step is torch's own: per-tensor
norms with ``torch._foreach_norm`` where torch would use the foreach path on that device, else
``torch.linalg.vector_norm`` per tensor; the total is ``vector_norm`` of the stacked per-tensor norms; the
coefficient is ``max_norm / (total + 1e-6)`` clamped to 1 (see ``torch/nn/utils/clip_grad.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._foreach_utils import _has_foreach_support

from memsched.devices.simdevice import OUT_OF_MEMORY
from memsched.optim.adam import fp32_grad


def total_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0, *, per_tensor: bool = False,
               of_norms: bool = False) -> torch.Tensor | list[torch.Tensor]:
    """Norms as ``clip_grad_norm_`` computes them.

    Args:
        tensors: gradients on one device and of one dtype (as torch groups them), or, with ``of_norms``,
            per-tensor norms (0-d) to combine.
        per_tensor: return the list of per-tensor norms (0-d tensors) instead of their total.
        of_norms: ``tensors`` are per-tensor norms already: return their total.

    Returns:
        the total norm (0-d, on the first tensor's device), or the per-tensor norms.
    """
    norm_type = float(norm_type)
    if of_norms:
        norms = list(tensors)
    else:
        ts = list(tensors)
        if not ts:
            norms = []
        elif _has_foreach_support(ts, ts[0].device):
            norms = list(torch._foreach_norm(ts, norm_type))
        else:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in ts]
        if per_tensor:
            return norms
    if not norms:
        return torch.tensor(0.0)
    first = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)


def _extent(t: torch.Tensor) -> int:
    """Elements of its storage that ``t`` spans from its offset (1 + the last element's offset)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total + 1e-6))`` as a tensor on ``total``'s device (no host synchronisation)."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)


# [Note: norms on the device]
# A reduction's last bit depends on the kernel: the CPU's `vector_norm` and CUDA's `_foreach_norm` round the
# same gradient's norm differently. On an H200, with the host chunks' norms taken on the CPU, the total norm,
# and so every clipped parameter, differed from a torch run's by an ulp
# (bench/results/gpu_numerics_host_norms_nvidia-h200.json). A user's torch run keeps every gradient on the
# GPU, so memsched computes each per-tensor norm there: a host chunk's gradients come to the device one chunk
# at a time (a temporary of one chunk, H2D, counted in the transfers) for the norm only. The scaling by the
# coefficient stays where each gradient is: an elementwise product is correctly rounded on every device.
# (torch's own clip over `model.parameters()` finds host chunks' gradients on the host and computes their
# norms there, as it would for any gradient on the host.)
#
# [Note: norms taken in backward]
# Bringing a host chunk's gradients back for their norms doubles the link's H2D bytes of a step that clips.
# But backward had them on the device, complete, just before their D2H copy. So once `sched.clip_grad_norm_`
# has run, each host chunk's per-tensor norms are taken there and then (same kernel, same values, same
# alignment: the same bits), in the norm type of the last clip, and kept. The clip uses them only if the host
# gradients are still exactly what landed: the same host buffer with the same version counters (its own and
# its device alias's, which writes through `p.grad` move), the same parameters with a gradient, each `p.grad`
# still the chunk's view, and the same norm type. Otherwise (a second micro-batch added on the host, a user's
# write, another norm type, a new placement) it copies them back as before; so does every step after
# `zero_grad(set_to_none=False)`, whose kept (zero) host gradients the next backward's are added to on the
# host. fp16 (the norms are of unscaled gradients) and ZeRO (gathered gradients) keep their own paths.
# The check sees what torch's version counters see: every in-place torch op on `p.grad` or the host buffer.
# A write torch does not count (through `p.grad.data`, DLPack, a raw pointer) is not seen, as autograd does
# not see it either; DeepSpeed's ZeRO-Offload, whose norms are taken in backward too, ignores every write
# made between backward and its step. Code that writes gradients that way passes
# `norms_from_backward=False` to the clip (tests/test_clip_norms_in_backward.py pins both).
# Taking the norms costs a few device bytes per parameter (0-d tensors) that no plan counts: if the device is
# out of memory for them, they are not taken and the clip copies the gradients back.


@dataclass
class _BackwardNorms:
    """One host chunk's per-tensor gradient norms, taken on the device as backward completed them
    ([Note: norms taken in backward])."""

    chunk: Any  # memsched.chunks.Chunk
    norm_type: float
    norms: dict[int, torch.Tensor]  # id(param) -> 0-d norm on the device
    host: torch.Tensor | None = None  # the host gradients they landed in, and their version counters then
    versions: tuple[int, int | None] | None = None  # memsched.chunks.gradients.GradBuffers.host_versions


class Clipper:
    """The clipping of one optimizer: under fp16 the coefficients of :meth:`clip_grad_norm_` wait here for the
    step that applies them (in fp32, after unscaling); without a loss scale it is torch's own clip, in place.

    Args:
        store: the chunks (:class:`memsched.chunks.ChunkStore`; the parameters' chunks group the norms).
        scaler: the fp16 loss scaler (:class:`memsched.optim.precision.LossScaler`), or ``None``.
        transfers: where the H2D bytes of host gradients brought to the device for their norms are counted
            (:class:`memsched.devices.transfers.TransferStats`), or ``None``.
        grad_offload: the store's :class:`memsched.chunks.grad_offload.GradOffload` (one rank), whose
            offloads give the host chunks' norms taken in backward ([Note: norms taken in backward]), or
            ``None``.

    Attributes:
        backward_norm_hits: host chunks whose norms a clip took from backward instead of copying their
            gradients back, so far.
    """

    def __init__(self, store: Any, scaler: Any, transfers: Any = None, *, grad_offload: Any = None) -> None:
        self._store = store
        self._scaler = scaler
        self._transfers = transfers
        self.pending: list[torch.Tensor] = []  # fp16: coefficients (0-d fp32) for the next step
        self._norm_type: float | None = None  # the last clip's, once one ran: backward then takes norms
        self._in_backward: dict[int, _BackwardNorms] = {}  # chunk index -> its norms
        self.backward_norm_hits = 0
        if grad_offload is not None and scaler is None and store.alloc.device.type != "cpu":
            grad_offload.observe_offload(self._take_norms)
            # registered after the offload's own end observer (it was built first): the copies are done
            store.backward.observe_end(self._note_landed)
            store.grads.observe_zero_grad(self._in_backward.clear)

    def take(self) -> list[torch.Tensor]:
        """The pending coefficients, which the step applies; none are left pending."""
        coefs, self.pending = self.pending, []
        return coefs

    def clear(self) -> None:
        """Drop the pending coefficients (``zero_grad``: the gradients they were for are gone)."""
        self.pending = []

    @torch.no_grad()
    def clip_grad_norm_(self, params: Sequence[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0, *, norms_from_backward: bool = True) -> torch.Tensor:
        """Clip the gradients of ``params`` (the model's trainable parameters, in the model's order) to a
        total norm of ``max_norm``; returns the total norm before clipping (a float32 scalar on the device).

        Without a loss scale this is ``torch.nn.utils.clip_grad_norm_`` on the gradients in place; the host
        chunks' norms come from backward where their gradients are still what landed ([Note: norms taken in
        backward]; ``norms_from_backward=False``: copied back, and no longer taken, for code that writes
        gradients in ways torch's version counters do not see, such as ``p.grad.data``). With fp16
        loss scaling it is what GradScaler users get from ``scaler.unscale_(opt); clip_grad_norm_(...)`` on
        fp32 master gradients: the norms are those of the fp32 unscaled gradients (one chunk at a time, never
        in fp16, so a scaled norm above 65504 is no overflow), and the coefficient waits in :attr:`pending`
        for the step (``p.grad`` keeps the scaled fp16 values).
        """
        if self._store.shards_grads:
            return self._clip_sharded(params, max_norm, norm_type)
        if self._scaler is None:
            return self._clip_in_order(params, max_norm, norm_type, norms_from_backward)
        inv = self._scaler.inv_scale(self._store.alloc.device)
        by_chunk: dict[int, list[torch.nn.Parameter]] = {}
        for p in params:
            by_chunk.setdefault(self._chunk_key(p), []).append(p)
        norms: dict[int, torch.Tensor] = {}
        for ps in by_chunk.values():  # fp32 temporaries of one chunk at a time, on the device
            grads = [fp32_grad(g, None, inv, self.pending) for g in self._on_device([p.grad for p in ps])]
            norms.update(zip((id(p) for p in ps), total_norm(grads, norm_type, per_tensor=True), strict=True))
        total = total_norm([norms[id(p)] for p in params], norm_type, of_norms=True)
        self.pending.append(clip_coefficient(total, max_norm))
        return total

    def _on_device(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``grads`` (one chunk's), those off the device replaced by temporary device copies ([Note: norms on
        the device]): one copy per host buffer they view (a chunk's host gradients: one H2D copy of the span
        they cover, not one per parameter), each gradient then a view of it with its own shape and strides.
        Host gradients that read as the device ([Note: parameters read where they compute] in
        :mod:`memsched.devices.host_alias`) are read in place; their span counts as H2D bytes all the same
        (the link carries them)."""
        device = self._store.alloc.device
        by_storage: dict[int, list[int]] = {}
        for i, g in enumerate(grads):
            if g.device != device or device.type != "cpu" and self._store.in_host_memory(g):
                by_storage.setdefault(g.untyped_storage().data_ptr(), []).append(i)
        out = list(grads)
        for idx in by_storage.values():
            first = grads[idx[0]]
            lo = min(grads[i].storage_offset() for i in idx)
            hi = max(grads[i].storage_offset() + _extent(grads[i]) for i in idx)
            if self._transfers is not None:  # copied, or read in place over the link (a device-typed view)
                self._transfers.add_h2d((hi - lo) * first.element_size())
            if first.device == device:  # host memory the device reads in place: no copy
                continue
            span = first.new_empty(0).set_(first.untyped_storage(), lo, (hi - lo,), (1,)).to(device)
            for i in idx:
                g = grads[i]
                out[i] = span.as_strided(g.shape, g.stride(), g.storage_offset() - lo)
        return out

    @torch.no_grad()
    def _take_norms(self, c: Any, fresh: list[torch.nn.Parameter], accumulating: bool) -> None:
        """The offload's observer: ``c``'s gradients leave the device; take their per-tensor norms there
        ([Note: norms taken in backward]) once a clip ran, unless they are to be added to earlier ones."""
        self._in_backward.pop(c.index, None)
        if self._norm_type is None or accumulating or not fresh or c.grad is None:
            return
        store = self._store
        grads = [store.slot(c.grad, store.param_range[id(p)][0], p) for p in fresh]
        try:
            norms = total_norm(grads, self._norm_type, per_tensor=True)
        except OUT_OF_MEMORY:  # not taken: the clip copies them back ([Note: norms taken in backward])
            return
        self._in_backward[c.index] = _BackwardNorms(c, self._norm_type, dict(zip(map(id, fresh), norms,
                                                                                  strict=True)))

    def _note_landed(self) -> None:
        """Backward's end (the D2H copies waited for): the host gradients the norms are of, as they are."""
        for entry in list(self._in_backward.values()):  # an autograd device thread may add one meanwhile
            if entry.host is None:
                c = entry.chunk
                entry.host, entry.versions = c.grad_host, self._store.grads.host_versions(c)

    def _backward_norms(self, ps: list[torch.nn.Parameter], norm_type: float) -> list[torch.Tensor] | None:
        """The norms taken in backward of ``ps`` (one chunk's parameters with a gradient), if the host
        gradients are still what they were of ([Note: norms taken in backward]); else ``None``."""
        store = self._store
        c = store.param_chunk.get(id(ps[0]))
        entry = self._in_backward.get(c.index) if c is not None else None
        if (entry is None or entry.chunk is not c or entry.norm_type != norm_type or entry.host is None
                or c.grad_host is not entry.host or entry.versions != store.grads.host_versions(c)
                or {id(p) for p in ps} != entry.norms.keys()):
            return None
        for p in ps:  # each p.grad still the chunk's (cached) view of these host gradients
            _key, view = store.cached_host_grad(p)
            if view is None or view[0] is not c.grad_host or p.grad is not view[1]:
                return None
        self.backward_norm_hits += 1
        return [entry.norms[id(p)] for p in ps]

    def _chunk_key(self, p: torch.nn.Parameter) -> int:
        c = self._store.param_chunk.get(id(p))
        return -1 if c is None else c.index

    def _clip_in_order(self, params: Sequence[torch.nn.Parameter], max_norm: float,
                       norm_type: float, norms_from_backward: bool = True) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` as it runs with every gradient on the device, wherever they are now
        ([Note: norms on the device]): per-tensor norms by the device's kernel, a chunk at a time, stacked in
        the parameters' order; each gradient is scaled where it is by the same coefficient (an elementwise
        product rounds alike on every device)."""
        with_grad = [p for p in params if p.grad is not None]
        # from now on backward takes the host chunks' norms in this norm type (or none)
        self._norm_type = float(norm_type) if norms_from_backward else None
        if not with_grad:
            return torch.tensor(0.0)
        by_chunk: dict[int, list[int]] = {}
        for k, p in enumerate(with_grad):
            by_chunk.setdefault(self._chunk_key(p), []).append(k)
        norms: list[torch.Tensor | None] = [None] * len(with_grad)
        for key, ks in by_chunk.items():
            taken = (self._backward_norms([with_grad[k] for k in ks], float(norm_type))
                     if key >= 0 and norms_from_backward else None)
            if taken is not None:
                for k, n in zip(ks, taken, strict=True):
                    norms[k] = n
                continue
            grads = self._on_device([with_grad[k].grad for k in ks])
            for k, n in zip(ks, total_norm(grads, norm_type, per_tensor=True), strict=True):
                norms[k] = n
            del grads
        total = total_norm(norms, norm_type, of_norms=True)  # type: ignore[arg-type]
        coef = clip_coefficient(total, max_norm)
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in with_grad:
            by_device.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for (dev, _), grads in by_device.items():
            torch._foreach_mul_(grads, coef.to(dev))
        return total

    def _clip_sharded(self, params: Sequence[torch.nn.Parameter], max_norm: float,
                      norm_type: float) -> torch.Tensor:
        """ZeRO-2 (see [Note: sharded gradients] in :mod:`memsched.chunks.sharded_grad`): every rank gathers
        the whole averaged gradients one chunk at a time (a temporary of one chunk, in chunk order: the same
        collectives on every rank), computes the per-parameter norms as torch would, and scales its shards by
        the coefficient (elementwise, so the same values as torch scaling whole gradients); under fp16 the
        coefficient waits for the step."""
        store = self._store
        inv = self._scaler.inv_scale(store.alloc.device) if self._scaler is not None else None
        with_grad = [p for p in params if p.grad is not None]  # the reduced ones, the same on every rank
        by_chunk: dict[int, list[torch.nn.Parameter]] = {}
        for p in with_grad:
            by_chunk.setdefault(store.param_chunk[id(p)].index, []).append(p)
        norms: dict[int, torch.Tensor] = {}
        for c in store.chunks:
            ps = by_chunk.get(c.index)
            if not ps:
                continue
            whole = store.dp.gather_grad(c)
            grads = [store.slot(whole, store.param_range[id(p)][0], p) for p in ps]
            if inv is not None:
                grads = [fp32_grad(g, None, inv, self.pending) for g in grads]
            norms.update(zip((id(p) for p in ps), total_norm(grads, norm_type, per_tensor=True), strict=True))
            del whole, grads
        total = total_norm([norms[id(p)] for p in with_grad], norm_type, of_norms=True)
        if not with_grad:
            return total
        coef = clip_coefficient(total, max_norm)
        if self._scaler is not None:
            self.pending.append(coef)
        else:
            for c in store.chunks:
                if c.index in by_chunk:
                    c.grad_shard.mul_(coef.to(c.grad_shard.device))
        return total
