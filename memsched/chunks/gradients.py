"""The gradient buffers of a store's chunks: which parameters have a gradient, where it is, and its reset.

:class:`GradBuffers` owns what the gradients are between backward and the step: the set of parameters that
have a gradient in torch's sense (``with_grad``), those whose gradient is on the host (``host_grads``), each
chunk's gradient buffer and the parameters' ``.grad`` views of it, ZeRO-2's reduced shards, and
``zero_grad``. Its lifecycle per chunk: no buffer (one rank and ZeRO-2, after ``zero_grad``), a buffer
allocated by the first gradient of a backward (:meth:`GradBuffers.view`), offloaded to the host or reduced
to a shard as backward completes it, and freed or zeroed by :meth:`GradBuffers.zero_grad`. ZeRO-0/1 keep every
buffer (the all-reduce writes every chunk's buffer on every rank).

The buffers belong to one :class:`memsched.chunks.store.ChunkStore` (``store.grads``) and read its chunks,
views and bindings; the backward tracker (``store.backward``) fills them.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from memsched.chunks.chunk import Chunk
from memsched.chunks.sharded_grad import ShardedGrad, is_sharded
from memsched.chunks.strides import dense_strides
from memsched.devices.host_alias import host_alias_of, settle
from memsched.devices.simdevice import OUT_OF_MEMORY


class GradBuffers:
    """The gradients of one store's chunks (see the module docstring).

    Args:
        store: the :class:`memsched.chunks.store.ChunkStore` that owns them.
        with_grad: the parameters (ids) that have a gradient at attach.

    Attributes:
        with_grad: parameters that have a gradient in torch's sense (``p.grad is not None``) although every
            ``.grad`` stays bound to its chunk view: filled by backward, emptied by
            ``zero_grad(set_to_none=True)``.
        host_grads: parameters whose gradient is in their chunk's ``grad_host``.
    """

    def __init__(self, store: Any, with_grad: set[int]) -> None:
        self._store = store  # memsched.chunks.store.ChunkStore (its owner; a type would be an import cycle)
        self.with_grad = with_grad
        self.host_grads: set[int] = set()
        self._zero_grad_observers: list[Callable[[], None]] = []

    # -- the buffers and their views ------------------------------------------------------------------------
    def view(self, p: torch.nn.Parameter, c: Chunk | None = None) -> torch.Tensor:
        """The chunk view ``p.grad`` must be; allocates the chunk's gradient buffer if it has none.

        Raises:
            torch.OutOfMemoryError (or the stand-in's): the buffer does not fit; nothing changed.
        """
        store = self._store
        c = c or store.param_chunk[id(p)]
        if c.grad is None:
            self.alloc(c)
        return store.chunk_view("grad", p, c.grad)

    def alloc(self, c: Chunk) -> torch.Tensor:
        """``c``'s gradient buffer, allocated (zeros) if it has none.

        Raises:
            torch.OutOfMemoryError (or the stand-in's): the buffer does not fit; nothing changed. Its
                ``memsched_gradient_buffer`` attribute says the failed request was this buffer (bytes),
                for the explanation of the error (:mod:`memsched.runtime.warmup_oom`).
        """
        if c.grad is None:
            try:
                c.alloc_grad(self._store.alloc)
            except OUT_OF_MEMORY as e:
                e.memsched_gradient_buffer = c.data_bytes
                raise
            self._store.forget_views(c, "grad")  # views of a freed buffer
        return c.grad

    def absent_bytes(self) -> int:
        """Bytes of the gradient buffers the plan counts as resident that do not exist now: the device chunks'
        buffers between ``zero_grad`` and the backward that makes them (one rank), bytes. A host chunk's
        gradients are not resident (they are in the measured peak on their way to the host)."""
        store = self._store
        return sum(c.data_bytes for c in store.trainable_chunks if c.grad is None and not store.offloads(c))

    def free(self, c: Chunk) -> None:
        """Free ``c``'s gradient buffer: its parameters' ``.grad`` become None (one rank; see ``lazy_grads``).
        Gradient reductions and D2H copies still reading it were waited for or recorded by the caller."""
        if c.grad is None:
            return
        self._store.forget_views(c, "grad")
        for p in c.params:
            if p.grad is not None and not is_sharded(p.grad) and p.grad.data_ptr() >= c.grad.data_ptr() \
                    and p.grad.data_ptr() < c.grad.data_ptr() + c.grad.numel() * c.grad.element_size():
                p.grad = None
        c.free_grad()

    def host_versions(self, c: Chunk) -> tuple[int, int | None] | None:
        """What an in-place torch write to ``c``'s host gradients moves: the version counters of its
        ``grad_host`` and of the device alias its user views are views of (writes through ``p.grad`` move the
        alias's, [Note: parameters read where they compute]); ``None`` for a chunk whose gradients stay on
        the device. Writes torch does not count (through ``.data``, DLPack, raw pointers) move neither."""
        if not self._store.offloads(c) or c.grad_host is None:
            return None
        return c.grad_host._version, self._store.user_grad_version(c)

    def has(self, c: Chunk) -> bool:
        """Whether any parameter of ``c`` holds a gradient memsched keeps: in its device buffer, or on the
        host."""
        return (c.grad is not None or c.grad_shard is not None
                or any(id(p) in self.host_grads for p in c.params))

    def rebind(self, p: torch.nn.Parameter, c: Chunk | None = None) -> None:
        """Put ``p.grad`` back into its chunk view if autograd or the user produced a separate tensor."""
        g = p.grad
        if g is None or is_sharded(g):
            return
        view = self.view(p, c)
        if g.data_ptr() != view.data_ptr() or g.shape != view.shape or g.dtype != view.dtype:
            with torch.no_grad():
                view.copy_(g)
            p.grad = view

    def bind_dropped(self) -> None:
        """Before a forward: parameters whose ``.grad`` was set to None (``model.zero_grad()``, Hugging Face
        Trainer) get their zeroed chunk view back, so backward accumulates into the chunk instead of
        allocating a gradient that :meth:`rebind` then copies. They count as having no gradient until
        backward gives them one (``torch.optim.AdamW`` does not update them).

        One rank (``lazy_grads``): nothing is bound; backward gives such a parameter a new gradient, which
        :meth:`rebind` copies into the chunk. A chunk none of whose parameters has a gradient any more
        (``model.zero_grad()``) frees its buffer here, before the forward's peak."""
        store = self._store
        if store.lazy_grads:
            for c in store.chunks:
                if store.bindings.host_bound(c):  # enter_compute takes care of host-bound gradients
                    continue
                for p in c.params:
                    if p.grad is None:
                        self.with_grad.discard(id(p))
                        if c.grad_shard is not None:  # ZeRO-2: its part of the reduced shard is dropped
                            self.zero_shard_part(p, c)
                if c.grad is not None and all(p.grad is None for p in c.params):
                    self.free(c)
                if c.grad_shard is not None and all(p.grad is None for p in c.params):
                    c.drop_grad_shard()
            return
        with torch.no_grad():
            for p in store.params():
                if p.grad is None:
                    view = self.view(p)
                    view.zero_()
                    p.grad = view
                    self.with_grad.discard(id(p))

    # -- between the device and the host ------------------------------------------------------------------
    def to_device(self, c: Chunk) -> None:
        """``c``'s host gradients go into its device gradient buffer (a chunk placed on the device, or
        ``close()``): ``p.grad`` becomes the device view. ``c`` must be device-bound."""
        mine = [p for p in c.params if id(p) in self.host_grads]
        if not mine:
            return
        store = self._store
        store.before_host_write(c)
        c.wait_d2h()
        with torch.no_grad():
            for p in mine:
                view = self.view(p, c)
                view.copy_(store.host_view("grad", p, c))
                p.grad = view
                self.host_grads.discard(id(p))

    def to_host(self, c: Chunk) -> None:
        """``c``'s device gradients go into its host gradients (a chunk placed on the host between steps, or
        re-packed): its device gradient buffer is freed; ``p.grad`` follows at host binding."""
        if c.grad is None:
            return
        store = self._store
        mine = [p for p in c.params if p.grad is not None and p.grad.data_ptr() == self.view(p, c).data_ptr()]
        with torch.no_grad(), store.alloc.host_context():
            for p in mine:
                store.host_view("grad", p, c).copy_(self.view(p, c))
                self.host_grads.add(id(p))
        self.free(c)

    def place_staged(self, c: Chunk, staged: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """One rank, re-packing: each staged gradient of ``c`` goes where its chunk keeps gradients (a host
        chunk's host gradients, or a device chunk's buffer, allocated then), so a host chunk's never takes
        device memory."""
        store = self._store
        if not store.lazy_grads:
            return
        with torch.no_grad():
            for p in c.params:
                g = staged[id(p)][1]
                if g is None:
                    p.grad = None
                    continue
                g = store.slot(g, 0, p)
                if store.offloads(c):
                    with store.alloc.host_context():
                        store.host_view("grad", p, c).copy_(g)
                    self.host_grads.add(id(p))
                    p.grad = None  # host-bound next (rebind_hosts)
                else:
                    view = self.view(p, c)
                    view.copy_(g)
                    p.grad = view

    # -- ZeRO-2: the reduced shard of each chunk's gradients (see [Note: sharded gradients]) ---------------
    def keep_shard(self, c: Chunk, shard: torch.Tensor) -> None:
        """ZeRO-2: ``shard`` (``[hi - lo]``, compute dtype) is this rank's part of ``c``'s gradients of this
        round, averaged over the ranks. It becomes the reduced shard, or is added to an earlier micro-batch's;
        the whole gradient buffer is freed and every parameter that had a gradient shows a
        :class:`memsched.chunks.sharded_grad.ShardedGrad`. Reductions reading the buffer are complete."""
        c.keep_grad_shard(shard)
        had = [p for p in c.params if p.grad is not None]
        self.free(c)
        for p in had:
            p.grad = self.sharded(p, c)

    def sharded(self, p: torch.nn.Parameter, c: Chunk) -> ShardedGrad:
        """The :class:`memsched.chunks.sharded_grad.ShardedGrad` ``p.grad`` shows once ``c`` is reduced (its
        ``zero_()`` zeroes ``p``'s part of the shard; it holds the buffers weakly)."""
        ref = weakref.ref(self)

        def on_zero() -> None:
            s = ref()
            if s is not None and c.grad_shard is not None:
                s.zero_shard_part(p, c)

        return ShardedGrad(p, f"a parameter of shape {tuple(p.shape)} in chunk {c.index}",
                           self._store.dp.world, on_zero)

    def zero_shard_part(self, p: torch.nn.Parameter, c: Chunk) -> None:
        """Zero ``p``'s elements in ``c``'s reduced shard (those this rank holds)."""
        off, n = self._store.param_range[id(p)]
        a, b = max(off, c.lo), min(off + n, c.hi)
        if a < b:
            with torch.no_grad():
                c.grad_shard[a - c.lo:b - c.lo].zero_()

    def guard(self, params: set[int]) -> None:
        """ZeRO-2, every reduction complete: the parameters (ids) with a gradient on some rank have one here
        too (their averaged gradient is in the shards), shown as ShardedGrads."""
        for c in self._store.chunks:
            if c.grad_shard is None:
                continue
            for p in c.params:
                if id(p) in params:
                    self.with_grad.add(id(p))
                    if p.grad is None:
                        p.grad = self.sharded(p, c)

    def make_whole(self, gather: Callable[[Chunk], torch.Tensor]) -> None:
        """ZeRO-2: every reduced shard becomes a whole gradient buffer again (``gather(c)``: the chunk's whole
        averaged gradients, ``[numel]``, a collective over the ranks), and the parameters' ShardedGrads its
        views (before re-packing, and at ``close()``)."""
        for c in self._store.chunks:
            if c.grad_shard is None:
                continue
            whole = gather(c)
            self.free(c)
            c.take_whole_grad(whole)
            self._store.forget_views(c, "grad")
            for p in c.params:
                if is_sharded(p.grad):
                    p.grad = self.view(p, c)

    def shard_whole(self) -> None:
        """ZeRO-2: the inverse of :meth:`make_whole` (after re-packing): each whole gradient buffer (averaged
        already) keeps this rank's shard only."""
        for c in self._store.chunks:
            if c.grad is not None:
                self.keep_shard(c, c.grad[c.lo:c.hi])

    # -- zero_grad ----------------------------------------------------------------------------------------
    def observe_zero_grad(self, observer: Callable[[], None]) -> None:
        """Call ``observer()`` at the start of every :meth:`zero_grad` (gradients in flight are dropped)."""
        self._zero_grad_observers.append(observer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset readiness and the gradients. ``set_to_none`` (torch's default): the parameters have no
        gradient until backward gives them one (they are then not updated); with one rank the gradient buffers
        are freed and every ``.grad`` is None. Otherwise the buffers that exist are zeroed and the views
        kept."""
        store = self._store
        store.backward.drop_pending()
        store.dp.before_zero_grad()  # pending gradient reductions finish first
        for observer in self._zero_grad_observers:  # pending offloads are dropped
            observer()
        store.backward.reset()
        if set_to_none and store.lazy_grads and not store.closed:
            self._release_kept()
        if set_to_none and not store.closed:
            self.with_grad.clear()
            self.host_grads.clear()
        bindings = store.bindings
        if set_to_none and store.lazy_grads and not store.closed:  # the buffers go: every .grad is None
            for c in store.trainable_chunks:
                c.reset_ready()
                self.free(c)
                c.drop_grad_shard()
                for p in c.params:
                    p.grad = None
                # See [Note: host binding]: with no gradient left on the host, parameters whose values are on
                # the device read as device tensors again, as they would on plain torch, once the updated
                # values' H2D copy has landed (a read right after zero_grad() must not see the old ones)
                if bindings.host_bound(c) and c.data is not None and not bindings.computing:
                    store.before_device_read(c)
                    bindings.leave_host(c)
            return
        with torch.no_grad():
            for c in store.trainable_chunks:
                c.reset_ready()
                held = [p for p in c.params if id(p) in self.host_grads]
                if held:  # host gradients: zeroed where they are, as torch zeroes p.grad
                    settle(c.device)  # after kernels that wrote them through the user views
                    store.before_host_write(c)
                    with store.alloc.host_context():
                        for p in held:
                            store.host_view("grad", p, c).zero_()
                if c.grad_shard is not None:  # ZeRO-2: the reduced shard, zeroed; p.grad stay ShardedGrads
                    c.grad_shard.zero_()
                if c.grad is None:  # no gradient since the last zero_grad: p.grad stays None, as in torch
                    continue
                c.grad.zero_()
                for p in c.params:
                    if store.lazy_grads and (p.grad is None or is_sharded(p.grad)):  # as torch leaves it
                        continue
                    if id(p) in self.host_grads:
                        continue
                    view = self.view(p, c)
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view

    def _release_kept(self) -> None:
        """``zero_grad(set_to_none=True)``: a host gradient the user still holds (``g = p.grad``, for a
        gradient-noise estimate) keeps its values, as in torch, where the next backward makes a new tensor:
        it gets storage of its own before the next backward writes the chunk's host gradients again. Held is
        told by the reference count: the only other references are this loop's and the view cache's."""
        store = self._store
        for c in store.bindings.host_chunks():
            for p in c.params:
                g = p.grad
                if g is None or id(p) not in self.host_grads:
                    continue
                # p.grad is its user view (a device alias, cached under "grad@user") or, on the CPU device,
                # the host view itself
                key, hit = store.cached_host_grad(p)
                cached = hit is not None and hit[1] is g
                del hit
                if sys.getrefcount(g) > _unheld_grad_refs() - (not cached):
                    with torch.no_grad(), store.alloc.host_context():
                        # a host copy of its own (pinned like the buffer), read as the device as before: the
                        # held gradient takes no device memory
                        settle(c.device)
                        host = store.host_view("grad", p, c)
                        own = store.alloc.host_empty(host.numel(), host.dtype)
                        own = own.as_strided(host.shape, dense_strides(host)).copy_(host)
                        alias = (host_alias_of(own, c.device, pinned=store.alloc.pin)
                                 if g.device != own.device else None)
                        g.data = alias if alias is not None else own
                    if cached:
                        store.forget_view(key)
                del g


@functools.cache
def _unheld_grad_refs() -> int:
    """The reference count ``sys.getrefcount`` gives for a parameter's ``.grad``, read into a local, when it
    is a view held by ``.grad`` and a cache entry only (what torch's tensor objects hold varies across
    versions, so it is measured)."""
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(8)[:4]
    cache = {"grad": (None, p.grad)}
    g = p.grad
    n = sys.getrefcount(g)
    del g, cache
    return n
