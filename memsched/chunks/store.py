"""The chunks of a model: building them, binding parameters as views, gradient readiness, re-packing."""

from __future__ import annotations

import enum
import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from memsched.chunks.binding import Binding, ChunkBindings, present
from memsched.chunks.buffers import Allocator
from memsched.chunks.chunk import Chunk
from memsched.chunks.events import ChunkEvents, OneProcess
from memsched.chunks.layout import ChunkLayout, Slot, build_layout, ordered_groups
from memsched.chunks.sharded_grad import ShardedGrad, is_sharded
from memsched.devices.host_alias import host_alias_of, reads_host_memory, settle
from memsched.devices.simdevice import OUT_OF_MEMORY
from policies.types import DEVICE, HOST
from tracer.hook_handles import Detachable
from tracer.ops import graph_task_id

# The parameter dtypes memsched trains (memsched.config refuses others at attach).
TRAINABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class BackwardPhase(enum.Enum):
    """Where a :class:`ChunkStore` is in a backward: one state, changed only by the store's named transitions
    (see [Note: the backward phase]), as FSDP2's ``FSDPParamGroup`` owns its ``TrainingState``.

    * ``IDLE``: no backward is running, and the last one ended whole (or ``zero_grad`` came since).
    * ``IN_BACKWARD``: a backward is running: a gradient reached a hook and its end is queued
      (:meth:`ChunkStore.note_backward`; one rank and ZeRO-2). Backwards nested in it
      (``checkpoint(use_reentrant=True)``) keep it until the outermost one ends.
    * ``ABORTED``: a backward raised and was ended in its place (:meth:`ChunkStore.end_aborted_backward`): its
      partial gradients stay, and :meth:`ChunkStore.settle` refuses a step until ``zero_grad`` or a backward
      that ends whole.
    """

    IDLE = "idle"
    IN_BACKWARD = "in backward"
    ABORTED = "aborted"


class ChunkStore:
    """The chunks of a model: builds them from param groups and a layout, binds parameters as views, counts
    gradient readiness with post-accumulate-grad hooks and re-packs on request.

    Args:
        groups: trainable parameters per param group (tied parameters once; no frozen ones).
        alloc: where buffers come from.
        compute_dtype: dtype of the compute and gradient buffers (fp32 masters are kept when it is not fp32).
        chunk_numel: chunk size override (elements); ``None`` = searched.
        on_grads_ready: an observer (:meth:`observe_grads_ready`), or ``None``.
        dp: the data parallelism (:class:`memsched.chunks.events.ChunkEvents`, implemented by
            :class:`memsched.distributed.base.DataParallel`; default one process): told when a chunk's
            gradients are ready, after its update and before gradients are zeroed; its ``align`` aligns the
            parameters in the chunks (:func:`build_layout`).
        private_grads: host chunks' CPU updates read a copy of their gradients of their own (``overlap=True``:
            :class:`Chunk`'s ``private_grads``).
        after_chunk: called as ``after_chunk(store, chunk)`` once each chunk is built, before the next one
            is (its optimizer state may be made there and its parameters leave the device: :meth:`_build`).
        frozen: frozen parameters (``requires_grad=False``; one rank) packed into chunks of their own, after
            the trainable ones: no gradients, no optimizer state, placed and fetched like the others
            (:class:`Chunk`'s ``frozen``; issue 31).

    Raises:
        ValueError: the groups are empty.

    A model built on meta comes with placeholders of NaN for its parameters, copied in as any values
    ([Note: models built on meta] in :mod:`memsched.runtime.meta_init`).
    """

    def __init__(self, groups: Sequence[Sequence[torch.nn.Parameter]], alloc: Allocator, *,
                 compute_dtype: torch.dtype = torch.float32, chunk_numel: int | None = None,
                 on_grads_ready: Callable[[Chunk], None] | None = None,
                 dp: ChunkEvents | None = None, private_grads: bool = False,
                 after_chunk: Callable[[ChunkStore, Chunk], None] | None = None,
                 frozen: Sequence[torch.nn.Parameter] = ()) -> None:
        self.groups = [list(g) for g in groups]
        self.frozen = list(frozen)
        self.alloc = alloc
        self.private_grads = private_grads
        self.compute_dtype = compute_dtype
        self.dp: ChunkEvents = dp if dp is not None else OneProcess()
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        # id(host buffer) -> (the buffer, its device-typed alias): the base of the user views (user_view)
        self._host_aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._alias_versions: list[int] = []  # their version counters when last settled
        self._grads_ready_observers: list[Callable[[Chunk], None]] = []  # after ``dp`` (the optimizer)
        if on_grads_ready is not None:
            self._grads_ready_observers.append(on_grads_ready)
        self.grad_events = 0  # gradients accumulated by backward so far (any parameter)
        self.closed = False
        # Where each chunk's parameters point, and the phase (computing or between steps) they follow
        self.bindings = ChunkBindings(self)
        self.host_grads: set[int] = set()  # parameters whose gradient is in their chunk's ``grad_host``
        # Whether some chunk offloads (a plain flag: compiled hooks read it, see memsched.runtime.waits)
        self.offloading = False
        # Where the store is in a backward: changed only by the _*_backward transitions below
        self._backward_phase = BackwardPhase.IDLE
        self._backward_end_observers: list[Callable[[], None]] = []
        self._zero_grad_observers: list[Callable[[], None]] = []
        # The gradient offload (memsched.chunks.grad_offload) once installed; without it host chunks keep
        # their gradients on the device until the step, as with more ranks.
        self.offloader: object | None = None
        # Called before memsched writes a host chunk's host buffers (the CPU worker must be done reading them)
        self.before_host_write: Callable[[Chunk], None] = lambda c: None
        # Called before a chunk's parameters become device views between steps: reads of them from here on
        # (outside any forward, so no module hook waits for them) must come after its H2D copy in flight
        self.before_device_read: Callable[[Chunk], None] = lambda c: None
        # fetches chunks whose parameters live on the host only, for a read between steps (ParamFetcher)
        self.fetch_between: Callable[[list[int]], None] | None = None
        # Parameters that have a gradient in torch's sense (``p.grad is not None``) although every ``.grad``
        # stays bound to its chunk view: filled by backward, emptied by ``zero_grad(set_to_none=True)``.
        self.with_grad: set[int] = {id(p) for g in self.groups for p in g if p.grad is not None}
        self._open_tasks: set[int | None] = set()  # backward passes whose end is queued (_backward_end)
        self._running: set[int] = set()  # backward passes that read a saved parameter, until their end
        self._ready_pending: list[Chunk] = []  # complete chunks not announced yet (_flush_ready)
        self._flush_task: int | None = None  # the backward whose flush is queued (more ranks, ZeRO-0/1)
        self._n_params = sum(len(g) for g in self.groups)
        self.align = self.dp.align
        # One rank and ZeRO-2: a chunk's gradient buffer exists only while some gradient does (from the
        # first gradient a backward gives one of its parameters to zero_grad; at ZeRO-2 to its
        # reduce-scatter), so it is not alive through the forward's peak. ZeRO-0/1: the buffers stay (the
        # all-reduce writes every chunk's buffer on every rank).
        self.shards_grads = bool(self.dp.shards_grads)
        self.lazy_grads = self.dp.world == 1 or self.shards_grads
        # One rank: host chunks' gradients go to the host as backward completes them ([Note: host binding]);
        # with more ranks they are reduced first and copied at the step.
        self.backward_offload = self.dp.world == 1
        # Host chunks keep no copy of their parameters beside the master while these are on the device
        # ([Note: lean host chunks] in memsched.chunks.chunk)
        self.lean_params = (self.backward_offload and compute_dtype != torch.float32 and not private_grads
                            and reads_host_memory(alloc.device, pinned=alloc.pin))
        # [Note: memory formats]
        # One rank: a parameter's slot in its chunk holds its elements in the parameter's memory order
        # (contiguous, channels_last, channels_last_3d), and the parameter, its gradient and every state
        # tensor's slot are views with the parameter's strides. AdamW is elementwise, so only the element
        # correspondence matters, and torch's fused kernel walks a dense tensor in memory order, as the
        # update of a flat slot does. More ranks: contiguous (shards cut parameters in logical order).
        self._strides: dict[int, tuple[int, ...]] = {}
        # One rank: chunks as long as what they hold ([Note: exact chunks] in memsched.chunks.layout)
        self.exact = self.dp.world == 1
        self.layout = build_layout([[p.numel() for p in g] for g in self._packing()], chunk_numel=chunk_numel,
                                   align=self.align, exact=self.exact)
        self.chunks: list[Chunk] = []
        self.param_chunk: dict[int, Chunk] = {}
        self._hooks: list = []
        self._build(self.layout, self._packing(), after_chunk=after_chunk)
        self.dp.install(self)
        for g in self.groups:
            for p in g:
                self._hooks.append(p.register_hook(Detachable(self._pre_grad_hook(p))))
                self._hooks.append(p.register_post_accumulate_grad_hook(Detachable(self._grad_hook)))

    def _packing(self) -> list[list[torch.nn.Parameter]]:
        """The groups packed into chunks: the param groups, then the frozen parameters (a group of their own,
        so that no chunk mixes them)."""
        return [*self.groups, self.frozen] if self.frozen else self.groups

    @property
    def trainable_chunks(self) -> list[Chunk]:
        """The chunks of trainable parameters (those with gradients and optimizer state), in order."""
        return self._trainable

    # -- building / re-packing ------------------------------------------------------------------------------
    def _build(self, layout: ChunkLayout, groups: list[list[torch.nn.Parameter]], *,
               keep_initial: bool = True, staged: dict[int, tuple[torch.Tensor, ...]] | None = None,
               grads: bool = True, after_chunk: Callable[[ChunkStore, Chunk], None] | None = None) -> None:
        """Allocate chunk buffers for ``layout`` one chunk at a time, copy parameters (and gradients) in and
        bind them as views at once, so the storage they had is freed before the next chunk is allocated (a
        model already on the device peaks near its final size plus one chunk, not at three times its
        parameters).

        On failure (e.g. out of memory) every parameter bound so far gets standalone tensors back, with its
        values (its ``staged`` host copies when given, else fresh copies), and the error is re-raised: the
        model is as it was, only its storages are new. ``grads=False``: gradients are not bound (the caller
        puts them where their chunk's placement wants them, :meth:`_place_staged_grads`).
        ``after_chunk(store, c)`` runs after each chunk is built, before the next one is allocated (its
        state is made there and its buffer may leave the device: a model whose parameters do not all fit is
        built a chunk at a time).
        """
        new_chunks: list[Chunk] = []
        try:
            with torch.no_grad():
                for ci, slots in enumerate(layout.chunks):
                    new_chunks.append(self._build_chunk(ci, layout, slots, groups, keep_initial, grads))
                    if after_chunk is not None:
                        self.chunks = new_chunks  # the callback sees the chunks built so far
                        self._index(new_chunks)
                        after_chunk(self, new_chunks[-1])
        except BaseException:
            if staged is not None:
                self._point_at(staged, [p for c in new_chunks for p in c.params])
            else:
                self._unbind(new_chunks)
            raise
        self.chunks = new_chunks
        self.layout = layout
        self._index(new_chunks)

    def _index(self, chunks: list[Chunk]) -> None:
        """Where each parameter is: its chunk, its range and its position in it; views made anew."""
        self.param_chunk = {id(p): c for c in chunks for p in c.params}
        self.param_range = {id(p): r for c in chunks for p, r in zip(c.params, c.ranges, strict=True)}
        self.param_pos = {id(p): k for c in chunks for k, p in enumerate(c.params)}
        self._trainable = [c for c in chunks if not c.frozen]
        self._views: dict[tuple[str, int], Any] = {}  # (kind, id(p)) -> chunk view, made once
        self._host_aliases = {}  # the user views' bases (user_view), made anew too

    def _build_chunk(self, ci: int, layout: ChunkLayout, slots: Sequence[Slot],
                     groups: list[list[torch.nn.Parameter]], keep_initial: bool, grads: bool = True) -> Chunk:
        numel = layout.numels[ci]
        frozen = bool(self.frozen) and layout.chunk_groups[ci] == len(self.groups)
        data = self.alloc.device_zeros(numel, self.compute_dtype)
        params = [groups[s.group][s.index] for s in slots]
        has_grad = [grads and not frozen and p.grad is not None and p.grad.shape == p.shape for p in params]
        grad = (self.alloc.device_zeros(numel, self.compute_dtype)
                if any(has_grad) or not (self.lazy_grads or frozen) else None)
        ranges = [(s.offset, s.numel) for s in slots]
        # Mixed precision: the fp32 master starts from the parameters' full-precision values, not from their
        # compute-dtype rounding (kept on the host until the optimizer state is made).
        initial = None
        if self.compute_dtype != torch.float32 and keep_initial and not frozen:
            initial = self.alloc.host_zeros(numel, torch.float32)
        for p, (off, _n) in zip(params, ranges, strict=True):
            src = p.data
            if self.dp.world == 1:
                self._strides[id(p)] = dense_strides(src)
            self.slot(data, off, p).copy_(src)
            if initial is not None:
                with self.alloc.host_context():
                    self.slot(initial, off, p).copy_(src)
            if grad is not None and p.grad is not None and p.grad.shape == p.shape:
                self.slot(grad, off, p).copy_(p.grad)
        for p, (off, _n), had in zip(params, ranges, has_grad, strict=True):
            present(p)
            p.data = self.slot(data, off, p)
            if frozen:  # a gradient of its own (torch's, e.g. for another optimizer) is not memsched's
                continue
            if grad is not None and (had or not self.lazy_grads):
                p.grad = self.slot(grad, off, p)
            else:
                p.grad = None
        chunk = Chunk(ci, layout.chunk_groups[ci], numel, params, ranges, data, grad,
                      initial_master=initial, frozen=frozen)
        chunk.offload_grads = self.backward_offload
        chunk.private_grads = self.private_grads
        chunk.lean = self.lean_params and not frozen
        return chunk

    def _unbind(self, chunks: Sequence[Chunk]) -> None:
        """Give the parameters of ``chunks`` standalone copies of their values (newest chunk first, so each
        chunk's buffers can be freed before the next chunk's copies are made)."""
        with torch.no_grad():
            for c in reversed(chunks):
                for p in c.params:
                    present(p)
                    p.data = p.data.clone()
                    p.grad = p.grad.clone() if p.grad is not None else None
                c.release()

    def params(self) -> Iterator[torch.nn.Parameter]:
        """The trainable parameters, group by group."""
        for g in self.groups:
            yield from g

    def all_params(self) -> Iterator[torch.nn.Parameter]:
        """Every parameter in a chunk: the trainable ones, then the frozen ones."""
        for g in self._packing():
            yield from g

    def repack(self, order: Sequence[torch.nn.Parameter], *, chunk_numel: int | None = None,
               after_chunk: Callable[[ChunkStore, Chunk], None] | None = None) -> bool:
        """Re-pack the chunks so parameters follow ``order`` (first-use order; parameters not in it keep their
        relative order after those that are), moving each parameter's optimizer state with it (bit-exact).
        ``after_chunk(store, c)`` runs once each new chunk has its state and gradients (its buffer may
        leave the device there: the new chunks are then built a chunk at a time).

        Returns ``False`` (and changes nothing) when the layout would be the same. Each parameter keeps its
        own step count.

        Raises:
            torch.OutOfMemoryError (or the stand-in's): the new chunks do not fit; the old packing is restored
                first, with every value and optimizer state as it was.
        """
        new_groups = ordered_groups(self._packing(), order)
        layout = build_layout([[p.numel() for p in g] for g in new_groups], chunk_numel=chunk_numel,
                              align=self.align, exact=self.exact)
        same = (layout.numels == self.layout.numels
                and all(a is b for ga, gb in zip(new_groups, self._packing(), strict=True)
                        for a, b in zip(ga, gb, strict=True)))
        if same:
            return False
        steps = {id(p): float(c.steps[k]) for c in self.trainable_chunks for k, p in enumerate(c.params)}
        # Stage everything through host memory and drop every reference to the old chunks before allocating
        # the new ones, so re-packing needs the device memory of the new chunks only (built one at a time).
        staged: dict[int, tuple[torch.Tensor, ...]] = {}
        side: dict[int, str | None] = {}
        old_layout, old_groups = self.layout, self._packing()
        bindings = self.bindings
        for c in bindings.host_chunks():  # host-bound gradients are staged from the host
            settle(c.device)
            self.before_host_write(c)
        with torch.no_grad(), self.alloc.host_context():
            for c in self.chunks:
                c.wait_h2d()
                c.wait_d2h()
                host_bound = bindings.host_bound(c)
                data = c.param_host if host_bound and c.param_host is not None else c.data
                grad = c.grad_host if host_bound else c.grad
                lo = c.lo if host_bound else 0
                tensors = ((data, None, None, None, None) if c.frozen else
                           (data, grad, c.master_view(), c.exp_avg, c.exp_avg_sq))
                # Host tensors are staged by reference: the old chunks' host memory is the staging (no second
                # copy); each old buffer is freed once every new chunk holding its values is built
                # (_restage). Device tensors go to the host, so re-packing needs no old device memory.
                flat = [t if t is None or t.device.type == "cpu" else t.to("cpu", copy=True) for t in tensors]
                for p, (off, n) in zip(c.params, c.ranges, strict=True):
                    # a parameter with no gradient keeps none (``p.grad`` is None, not a zeroed view)
                    no_grad = flat[1] is None or (self.lazy_grads and p.grad is None)
                    staged[id(p)] = tuple(
                        None if (t is None or (k == 1 and no_grad))
                        else t[off - (lo if k < 2 else 0):off - (lo if k < 2 else 0) + n]
                        for k, t in enumerate(flat))
                    side[id(p)] = c.placement
        self.host_grads.clear()
        self._release(staged)

        def restore(store: ChunkStore, c: Chunk) -> None:  # as each new chunk is built
            self._restore_state(c, staged, side, steps)
            if not c.frozen:
                self._place_staged_grads(c, staged)
            if after_chunk is not None:
                after_chunk(store, c)
            self._restage(c, staged)

        try:
            self._build(layout, new_groups, keep_initial=False, staged=staged, grads=not self.lazy_grads,
                        after_chunk=restore)
            self._set_packing(new_groups)
        except BaseException:
            # Put the old packing back from the staged copies (it fitted before), then re-raise.
            self._release(staged)
            self._build(old_layout, old_groups, keep_initial=False, staged=staged, grads=not self.lazy_grads,
                        after_chunk=restore)
            self._set_packing(old_groups)
            self.rebind_hosts()
            raise
        self.rebind_hosts()
        return True

    def _set_packing(self, groups: list[list[torch.nn.Parameter]]) -> None:
        if self.frozen:
            *groups, self.frozen = groups
        self.groups = groups

    def _restage(self, c: Chunk, staged: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """Re-packing, one rank: the values of ``c``'s parameters now live in ``c``; their staged entries
        point there (values, gradients, master, moments), so the old buffers they came from are freed as soon
        as no entry needs them, and the process holds one packing plus the chunk being built, not two.
        Should a later chunk fail, the old packing is rebuilt from these entries as from any other."""
        values = c.data if c.data is not None else c.param_host  # the host copy once sent away
        if c.lo != 0 or c.hi != c.numel or values is None:
            return
        if c.frozen:
            for p, (off, n) in zip(c.params, c.ranges, strict=True):
                staged[id(p)] = (values[off:off + n], None, None, None, None)
            return
        master = c.master_view() if c.master is not None or c.data is not None else values
        for p, (off, n) in zip(c.params, c.ranges, strict=True):
            old = staged[id(p)]
            grad = old[1]
            if grad is not None:
                if c.grad is not None and p.grad is not None:
                    grad = c.grad[off:off + n]
                elif c.grad_host is not None and id(p) in self.host_grads:
                    grad = c.grad_host[off:off + n]
            staged[id(p)] = (values[off:off + n], grad, master[off:off + n], c.exp_avg[off:off + n],
                             c.exp_avg_sq[off:off + n])

    def _place_staged_grads(self, c: Chunk, staged: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """One rank, re-packing: each staged gradient of ``c`` goes where its chunk keeps gradients (a host
        chunk's host gradients, or a device chunk's buffer, allocated then), so a host chunk's never takes
        device memory."""
        if not self.lazy_grads:
            return
        with torch.no_grad():
            for p in c.params:
                g = staged[id(p)][1]
                if g is None:
                    p.grad = None
                    continue
                g = self.slot(g, 0, p)
                if self.offloads(c):
                    with self.alloc.host_context():
                        self.host_view("grad", p, c).copy_(g)
                    self.host_grads.add(id(p))
                    p.grad = None  # host-bound next (rebind_hosts)
                else:
                    view = self.grad_view(p, c)
                    view.copy_(g)
                    p.grad = view

    def rebind_hosts(self) -> None:
        """After (re)building the chunks: host chunks' gradients go to the host and, between steps, their
        parameters are host-bound again (see [Note: host binding])."""
        self.note_placements()
        for c in self.chunks:
            if self.offloads(c):
                self._grads_to_host(c)
                if not self.bindings.computing:
                    self.bindings.to_host(c)

    def _point_at(self, staged: dict[int, tuple[torch.Tensor, ...]],
                  params: Iterable[torch.nn.Parameter]) -> None:
        frozen = {id(p) for p in self.frozen}
        for p in params:
            present(p)
            data, grad = staged[id(p)][:2]
            if id(p) in frozen:  # its .grad is not memsched's (Chunk's ``frozen``)
                p.data = self.slot(data, 0, p)
                continue
            p.grad = None
            p.data = self.slot(data, 0, p)
            # A re-staged entry (_restage) may keep the values on the device and the gradient on the host:
            # the rebuild reads the gradient from ``staged``, so the parameter goes without one meanwhile.
            if grad is not None and grad.device == data.device:
                p.grad = self.slot(grad, 0, p)

    def stride_of(self, p: torch.nn.Parameter) -> tuple[int, ...]:
        """The strides of ``p``'s views (its memory format; see [Note: memory formats])."""
        s = self._strides.get(id(p))
        return s if s is not None else _contiguous_strides(p.shape)

    def slot(self, flat: torch.Tensor, off: int, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s slot ``flat[off:off + numel]`` as a tensor of its shape and memory format."""
        return flat[off:off + p.numel()].as_strided(p.shape, self.stride_of(p))

    def memory_order(self, p: torch.nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        """``t`` (``p``'s shape, any layout) flattened in ``p``'s memory order, the order of its slots."""
        out = torch.empty_strided(p.shape, self.stride_of(p), dtype=t.dtype, device=t.device)
        out.copy_(t)
        return out.as_strided((out.numel(),), (1,))

    def follow_memory_format(self) -> list[torch.nn.Parameter]:
        """Parameters whose memory format changed since attach (``model.to(memory_format=...)``: new
        storage of the same shape, dtype and device, dense) are bound again: their slots' elements are put
        in the new memory order (values, optimizer state, the fp32 master, the gradient), and the parameter
        and its gradient become views with the new strides. Returns them. One rank only; anything else stays
        for :meth:`check_bound` to refuse. The caller waits for updates and copies in flight first."""
        done = []
        if self.dp.world != 1:
            return done
        for p in self.params():
            view = self.bindings.expected_view(p)
            if p.data_ptr() == view.data_ptr() or p.dtype != view.dtype or p.device != view.device \
                    or p.shape != view.shape or p.stride() == view.stride() \
                    or dense_strides(p.data) != p.stride():
                continue
            c = self.param_chunk[id(p)]
            off, _n = self.param_range[id(p)]
            old, new = self.stride_of(p), tuple(p.stride())
            host_bound = self.bindings.host_bound(c)
            if host_bound:
                self.before_host_write(c)
            c.wait_h2d()
            c.wait_d2h()
            with torch.no_grad():
                spare = [t for k, t in (c.spare or {}).items() if k in ("master", "exp_avg", "exp_avg_sq")]
                for t in (c.master, c.exp_avg, c.exp_avg_sq, *spare):
                    if t is None:
                        continue
                    with self.alloc.host_context():
                        seg = t[off - c.lo:off - c.lo + p.numel()]
                        logical = seg.as_strided(p.shape, old).clone()
                        seg.as_strided(p.shape, new).copy_(logical)
                self._strides[id(p)] = new
                for key in ("data", "grad", "data@host", "grad@host", "data@user", "grad@user"):
                    self._views.pop((key, id(p)), None)
                values = p.data
                grad = p.grad.clone() if p.grad is not None else None  # it may alias the slot it goes to
                slot = self.data_view(p)
                slot.copy_(values)
                if host_bound:  # the host values and gradients in the new order too
                    with self.alloc.host_context():
                        if c.param_host is not None:
                            hslot = self.host_view("data", p, c)
                            hslot.copy_(values)
                            p.data = self.user_view("data", p, c)
                        else:  # lean: the parameters stay device views ([Note: lean host chunks])
                            p.data = slot
                        if grad is not None:
                            gview = self.host_view("grad", p, c)
                            gview.copy_(grad)
                            p.grad = self.user_view("grad", p, c)
                    self.bindings.note_bound(p)
                    done.append(p)
                    continue
                p.data = slot
                if grad is not None:
                    gview = self.grad_view(p, c)
                    gview.copy_(grad)
                    p.grad = gview
            done.append(p)
        return done

    def _release(self, staged: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """Point every parameter at its staged host copy and forget the chunks (their buffers are freed)."""
        self._point_at(staged, self.all_params())
        for c in self.chunks:
            c.release()
        self.chunks, self.param_chunk, self.param_range = [], {}, {}
        self._views = {}
        self._host_aliases = {}
        self.bindings.reset()

    def _restore_state(self, c: Chunk, staged: dict[int, tuple[torch.Tensor, ...]],
                       side: dict[int, str | None], steps: dict[int, float]) -> None:
        """``c``'s optimizer state: each parameter's slice goes into it, on the old side when the whole chunk
        came from one side, else on the host (the plan moves it afterwards)."""
        with torch.no_grad():
            sides = {side[id(p)] for p in c.params}
            where = DEVICE if sides == {DEVICE} else HOST
            if c.frozen:  # values only: they are in the new buffer already
                c.init_state(where, self.alloc)
                self.note_placements()
                return
            pieces = [(off, *staged[id(p)][2:]) for p, (off, _n) in zip(c.params, c.ranges, strict=True)]
            # the padding's state is zeros, as in a new chunk; the master of the padding is not read
            c.init_state(where, self.alloc, master=None, steps=[steps[id(p)] for p in c.params],
                         pieces=pieces)
        self.note_placements()

    # -- where the parameters point: the device while computing, the host between steps ---------------------
    def install_offloader(self, offloader: object) -> None:
        """From now on host chunks' gradients go to the host in backward, through ``offloader``
        (:class:`memsched.chunks.grad_offload.GradOffload`, which observes the store)."""
        self.offloader = offloader
        self.note_placements()

    def note_placements(self) -> None:
        """The chunks' placements changed (state made, moved or re-packed): refresh :attr:`offloading`."""
        self.offloading = any(self.offloads(c) for c in self.chunks)

    def offloads(self, c: Chunk) -> bool:
        """Whether ``c``'s gradients leave the device as backward completes them and its parameters are host
        views between steps (see [Note: host binding]): one rank, optimizer state on the host. Not a chunk of
        frozen parameters: host views between steps only while its buffer is away."""
        return (self.offloader is not None and self.backward_offload and not self.closed
                and c.placement == HOST and not c.frozen)

    def host_view(self, kind: str, p: torch.nn.Parameter, c: Chunk | None = None) -> torch.Tensor:
        """``p``'s slot in its chunk's host values (``kind="data"``: ``param_host``) or host gradients
        (``"grad"``: ``grad_host``), shaped and strided like ``p``."""
        c = c or self.param_chunk[id(p)]
        buf = c.param_host if kind == "data" else c.grad_host
        hit = self._views.get((kind + "@host", id(p)))
        if hit is not None and hit[0] is buf:
            return hit[1]
        off, _n = self.param_range[id(p)]
        v = self.slot(buf, off - c.lo, p)
        self._views[kind + "@host", id(p)] = (buf, v)
        return v

    def user_view(self, kind: str, p: torch.nn.Parameter, c: Chunk | None = None) -> torch.Tensor:
        """:meth:`host_view` typed as the compute device (no copy): what a host-bound parameter
        (``kind="data"``) and its gradient (``"grad"``) are, so that they read where they compute ([Note:
        parameters read where they compute] in :mod:`memsched.devices.host_alias`). memsched's own host-side
        work uses :meth:`host_view`. Every user view of one host buffer is a view of one alias of that
        buffer: they share its storage, as the host views share the buffer's (``torch.save`` writes it
        once)."""
        c = c or self.param_chunk[id(p)]
        buf = c.param_host if kind == "data" else c.grad_host
        hit = self._views.get((kind + "@user", id(p)))
        if hit is not None and hit[0] is buf:
            return hit[1]
        host = self.host_view(kind, p, c)
        base = self._host_aliases.get(id(buf))
        if base is None or base[0] is not buf:
            alias = host_alias_of(buf, c.device, pinned=self.alloc.pin)
            if alias is None:  # no device view of this memory (pageable, or a GPU that cannot map it)
                return host
            base = self._host_aliases[id(buf)] = (buf, alias)
        off, _n = self.param_range[id(p)]
        v = self.slot(base[1], off - c.lo, p)
        self._views[kind + "@user", id(p)] = (buf, v)
        return v

    def settle_user_writes(self) -> None:
        """Before the step reads host buffers on the CPU: wait for the device kernels that wrote them through
        the user views since the last time (a user's ``clip_grad_norm_`` on host gradients), only if any
        did (the aliases' version counters moved; on CUDA they are their own, so memsched's host-side writes
        do not move them): a step with no such write keeps the CPU running ahead of the device."""
        versions = [a._version for _b, a in self._host_aliases.values()]
        if versions != self._alias_versions:
            self._alias_versions = versions
            if self.chunks:
                settle(self.chunks[0].device)

    def user_grad_version(self, c: Chunk) -> int | None:
        """The version counter of the alias under ``c``'s gradients' user views (writes through any of them
        move it: they are views of one alias, whose counter is not the host buffer's), or ``None``."""
        base = self._host_aliases.get(id(c.grad_host)) if c.grad_host is not None else None
        return base[1]._version if base is not None and base[0] is c.grad_host else None

    def forget_host_views(self, c: Chunk) -> None:
        """``c``'s host buffers are replaced or freed: its cached host and user views go (they would keep the
        old pinned buffers alive), after the device's work that may read them through the user views."""
        settle(c.device)
        for p in c.params:
            for key in ("data@host", "grad@host", "data@user", "grad@user"):
                self._views.pop((key, id(p)), None)
        live = {id(b) for ch in self.chunks for b in (ch.param_host, ch.grad_host) if b is not None}
        self._host_aliases = {k: v for k, v in self._host_aliases.items() if k in live}

    def in_host_memory(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view into a chunk's host buffers (a host-bound parameter or gradient)."""
        if is_sharded(t):  # ZeRO-2's ShardedGrad holds no memory
            return False
        ptr = t.untyped_storage().data_ptr()
        return any(ptr == b.untyped_storage().data_ptr() for c in self.chunks if c.placement == HOST
                   for b in (c.param_host, c.grad_host) if b is not None)

    def resident(self, c: Chunk) -> bool:
        """Whether ``c``'s compute buffer (its parameters' device copy) is on the device."""
        return c.data is not None

    def _grads_to_device(self, c: Chunk) -> None:
        """``c``'s host gradients go into its device gradient buffer (a chunk placed on the device, or
        ``close()``): ``p.grad`` becomes the device view. ``c`` must be device-bound."""
        mine = [p for p in c.params if id(p) in self.host_grads]
        if not mine:
            return
        self.before_host_write(c)
        c.wait_d2h()
        with torch.no_grad():
            for p in mine:
                view = self.grad_view(p, c)
                view.copy_(self.host_view("grad", p, c))
                p.grad = view
                self.host_grads.discard(id(p))

    def _grads_to_host(self, c: Chunk) -> None:
        """``c``'s device gradients go into its host gradients (a chunk placed on the host between steps, or
        re-packed): its device gradient buffer is freed; ``p.grad`` follows at host binding."""
        if c.grad is None:
            return
        mine = [p for p in c.params
                if p.grad is not None and p.grad.data_ptr() == self.grad_view(p, c).data_ptr()]
        with torch.no_grad(), self.alloc.host_context():
            for p in mine:
                self.host_view("grad", p, c).copy_(self.grad_view(p, c))
                self.host_grads.add(id(p))
        self.free_grad(c)

    def place(self, c: Chunk, placement: str) -> int:
        """Move ``c``'s optimizer state to ``placement`` (:meth:`Chunk.move_to`), with its gradients and, one
        rank, its binding: a chunk moved to the host while nothing computes is host-bound, one moved to the
        device device-bound. Returns the bytes copied.

        Raises:
            torch.OutOfMemoryError (or the stand-in's): the state does not fit; the chunk is as it was.
        """
        if placement == c.placement:
            return 0
        if placement == DEVICE and c.data is None and not getattr(self.dp, "shards_params", False):
            raise RuntimeError(f"chunk {c.index}'s parameters are off the device: fetch them before its "
                               "optimizer state moves there")
        if self.bindings.host_bound(c):  # to the device: device-bound first, with any host writes taken in
            self.bindings.to_device(c)
        if placement != HOST:
            self._grads_to_device(c)  # while its host gradients still exist
        moved = c.move_to(placement, self.alloc)
        # The cached host and user views would keep the old host buffers (pinned memory) alive after the move.
        self.forget_host_views(c)
        self.note_placements()
        if self.offloads(c):
            self._grads_to_host(c)
            if not self.bindings.computing:
                self.bindings.to_host(c)
        return moved

    def values(self, c: Chunk) -> torch.Tensor:
        """The values ``c``'s parameters show now, flat over its shard (``[hi - lo]``, compute dtype): the
        host copy while host-bound (written there by ``load_state_dict`` between steps), else the device
        buffer."""
        away = c.data is None and c.param_shard is None
        if (self.bindings.host_bound(c) and c.param_host is not None) or away:
            return c.param_host  # host-bound (not lean), or (ZeRO-3) away with its part on the host
        return c.param_part()

    def has_grads(self, c: Chunk) -> bool:
        """Whether any parameter of ``c`` holds a gradient memsched keeps: in its device buffer, or on the
        host."""
        return (c.grad is not None or c.grad_shard is not None
                or any(id(p) in self.host_grads for p in c.params))

    def settle(self) -> None:
        """Before a step: gradients still on the device of host chunks go to the host and the host chunks
        become host-bound, as at backward's end (a forward with no backward, gradients set by hand).

        Raises:
            RuntimeError: a backward began and did not end (it raised): part of its gradients are on the host
                and part are not, so anything reading them now (torch's ``clip_grad_norm_``, the step) would
                see only part of them. ``zero_grad()`` drops them.
        """
        if self._backward_phase is not BackwardPhase.IDLE:
            # between steps again: parameters whose buffer is away read their host values, not the absent
            # views' NaN (the refusal stands until zero_grad())
            self.bindings.leave_compute()
            raise RuntimeError(
                "memsched: the last backward did not finish (it raised, or this runs inside it): its "
                "gradients are partly on the host and partly on the device, so a clip_grad_norm_ over "
                "model.parameters() or this step would see only part of them. Nothing was updated; call "
                "optimizer.zero_grad() (or model.zero_grad()) and run the backward again")
        # a host chunk bound to the device between steps while it holds host gradients (a graph read after
        # backward, [Note: graph reads between steps]) is host-bound again, as at backward's end
        if self.bindings.computing or any(self.offloads(c) and (c.grad is not None or (
                not self.bindings.host_bound(c) and any(id(p) in self.host_grads for p in c.params)))
                for c in self.chunks):
            for observer in self._backward_end_observers:
                observer()
            self.bindings.computing = True
            self.bindings.leave_compute()

    # -- gradients ------------------------------------------------------------------------------------------
    def _pre_grad_hook(self, p: torch.nn.Parameter) -> Callable[[torch.Tensor], None]:
        """[Note: gradients land in the chunk]
        One rank: before autograd accumulates a gradient into ``p`` that has none, ``p.grad`` becomes its
        zeroed chunk view (the chunk's buffer is allocated at its first gradient), so that autograd adds the
        gradient into the chunk in place instead of allocating a tensor memsched would copy. ``0 + g == g``
        for every ``g`` (only the sign of an exact zero may differ, which AdamW's moments and updates never
        see). A host chunk's earlier gradients stay on the host: the new ones are added to them there when
        they are offloaded (:mod:`memsched.chunks.grad_offload`).
        A parameter that gets no gradient keeps ``p.grad is None``, as in torch."""

        def hook(_grad: torch.Tensor) -> None:
            self._flush_ready()
            if not self.lazy_grads:
                return
            c = self.param_chunk.get(id(p))
            if c is None:
                return
            bindings = self.bindings
            if not bindings.computing:  # a backward with no forward since the last one ended (retain_graph)
                bindings.enter_compute()
            elif bindings.host_bound(c):  # away from the device since the forward's end
                bindings.to_absent(c) if c.data is None else bindings.to_device(c)
            g = p.grad
            if is_sharded(g):  # ZeRO-2: reduced already; this backward's gradients go to a new buffer
                p.grad = g = None
            if g is not None and self.offloads(c) and (c.grad is None
                                                       or g.data_ptr() != self.grad_view(p, c).data_ptr()):
                # The host gradients of earlier micro-batches stay on the host; a gradient set by hand since
                # the forward replaces them there. Either way the new gradient is added on the host.
                host = self.host_view("grad", p, c)
                if g.data_ptr() != host.data_ptr() or id(p) not in self.host_grads:
                    with torch.no_grad(), self.alloc.host_context():
                        host.copy_(g)
                    self.host_grads.add(id(p))
                p.grad = None
            if p.grad is not None:
                return
            with torch.no_grad():
                view = self.grad_view(p, c)
                view.zero_()  # may hold the gradient of an earlier backward that model.zero_grad() dropped
            p.grad = view

        return hook

    def _grad_hook(self, p: torch.nn.Parameter) -> None:
        self._flush_ready()
        c = self.param_chunk.get(id(p))
        if c is None:
            return
        self.rebind_grad(p, c)  # allocates the chunk's gradient buffer at its first gradient
        self.with_grad.add(id(p))
        self.grad_events += 1
        task = self.note_backward()
        if c.mark_grad_ready(id(p), task):
            # See [Note: readiness after the user's hooks]
            self._ready_pending.append(c)
            if not self.lazy_grads and task != self._flush_task:  # no _backward_end queued to flush it
                self._flush_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._flush_ready)

    def _flush_ready(self) -> None:
        """[Note: readiness after the user's hooks]
        A chunk whose last gradient just accumulated is complete, but the post-accumulate-grad hooks the
        user registered on that parameter (after attach's) have not run yet: they must see ``p.grad`` and may
        change it in place (clamp, log, scale), as with torch. So the chunk is announced complete (offload to
        the host, reduction, an update during backward) at the next gradient hook of any parameter, or at
        backward's end, after those hooks ran."""
        while self._ready_pending:
            c = self._ready_pending.pop(0)
            for p in c.params:  # a user hook may have replaced p.grad
                if p.grad is not None and not is_sharded(p.grad) and id(p) in self.with_grad:
                    self.rebind_grad(p, c)
            self.on_grads_ready(c)

    def _backward_end(self, task: int | None = None) -> None:
        """At the end of a backward (one rank): a parameter of a device chunk that has no gradient (none since
        ``zero_grad``) gets ``p.grad = None``, as in torch, instead of its zeroed chunk view: code that tests
        for None (fill missing gradients with zeros, skip unused parameters) then behaves as with
        ``torch.optim.AdamW``. The view comes back before the next forward (:meth:`bind_dropped_grads`) or at
        the step. Then the observers finish the gradients' offload, and the host chunks become host-bound
        (:meth:`ChunkBindings.leave_compute`).

        A backward nested in another (``torch.utils.checkpoint(use_reentrant=True)`` runs one per block inside
        the outer backward) announces its complete chunks and lets the observers finish their offload, but
        the parameters stay bound to the device until the outermost backward ends, since the outer one
        recomputes more blocks that read them."""
        self._open_tasks.discard(task)
        self._flush_ready()
        if self._open_tasks:  # nested: the offloads it began finish, the parameters stay on the device
            for observer in self._backward_end_observers:
                observer()
            return
        if len(self.with_grad) < self._n_params:
            for p in self.params():
                if id(p) not in self.with_grad and p.grad is not None and not is_sharded(p.grad) \
                        and self.param_chunk[id(p)].grad is not None \
                        and p.grad.data_ptr() == self.grad_view(p).data_ptr():
                    p.grad = None
        for observer in self._backward_end_observers:
            observer()
        self._end_backward()  # after the observers, before the host binding ([Note: the backward phase])
        self.bindings.leave_compute()

    def watch_backward_begin(self, output: Any) -> None:
        """[Note: a backward with no forward before it]
        A retained graph's second backward (``loss.backward(retain_graph=True)`` then ``loss.backward()``)
        starts after the first one's end made the host chunks host-bound:
        its nodes read the parameters autograd saved (the leaves themselves) as host tensors, torch's device
        error, before any gradient reaches a memsched hook. So at the end of a root forward that records a
        graph, every tensor in its output (pytree leaves: tuples, dicts, Hugging Face ``ModelOutput``) gets
        a pre-hook on its ``grad_fn`` that binds the parameters to the device again
        (:meth:`ChunkBindings.enter_compute`) where a backward reaches it between steps. Every node of the
        model's graph lies behind one of them, so the pre-hook runs before any node that reads a parameter.
        In a backward that follows its forward the parameters are bound already and it does nothing; after
        ``close()`` it does nothing either (the hooks go with the graph)."""
        if not self.lazy_grads or not any(self.offloads(c) for c in self.chunks):
            return
        ref = weakref.ref(self)

        def begin(_grad_outputs: Any) -> None:
            store = ref()
            if store is not None and not store.closed and not store.bindings.computing:
                with torch._C.DisableTorchFunction():
                    store.bindings.enter_compute()

        seen: set[int] = set()
        for t in pytree.tree_leaves(output):
            fn = t.grad_fn if isinstance(t, torch.Tensor) else None
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                fn.register_prehook(begin)

    def note_running(self) -> None:
        """A backward (or ``torch.autograd.grad``) runs on this thread and read a saved parameter: it is known
        to be running until its end, so that one that raises is known ([Note: a backward that raised])."""
        task = graph_task_id()
        if task in (None, -1) or task in self._running:
            return
        self._running.add(task)
        done = functools.partial(self._running.discard, task)
        torch.autograd.Variable._execution_engine.queue_callback(done)

    def note_backward(self) -> int | None:
        """A gradient arrived in a backward on this thread: its end is queued once (:meth:`_backward_end`; one
        rank), which also tells a backward that raised before it ([Note: a backward that raised]). Returns
        the graph task's id."""
        task = graph_task_id()
        if self.lazy_grads and task != -1 and task not in self._open_tasks:
            self._open_tasks.add(task)
            self._begin_backward()
            end = functools.partial(self._backward_end, task)
            torch.autograd.Variable._execution_engine.queue_callback(end)
        return task

    def end_aborted_backward(self) -> bool:
        """[Note: a backward that raised]
        A backward that raises (an error in a hook, in a checkpointed block's re-forward, out of memory) never
        reaches :meth:`_backward_end`: the parameters stay bound as while computing, those of chunks whose
        buffer is away as NaN views ([Note: absent parameters]), and fetched chunks stay on the device. The
        next use of the model between steps (``zero_grad()``, ``state_dict()``, the next forward) ends that
        backward as a completed one would: the observers settle the fetched chunks and finish the gradients'
        offload, and the host chunks become host-bound, so every parameter reads its value again. Its partial
        gradients stay for the step to refuse (:meth:`memsched.optim.hybrid_adamw.HybridAdamW.step`). Returns
        whether there was one to end; never inside a backward running on this thread."""
        if not (self._open_tasks or self._running) or graph_task_id() not in (-1, None):
            return False
        self._open_tasks.clear()
        self._running.clear()
        self._flush_ready()
        for observer in self._backward_end_observers:
            observer()
        self._abort_backward()  # settle() refuses the partial gradients until zero_grad or a whole backward
        self.bindings.leave_compute()
        return True

    # -- the backward phase -------------------------------------------------------------------------------
    @property
    def backward_phase(self) -> BackwardPhase:
        """Where the store is in a backward (:class:`BackwardPhase`; read-only: the transitions below change
        it)."""
        return self._backward_phase

    @property
    def in_backward(self) -> bool:
        """A backward is running (its end callback is queued): the phase is ``IN_BACKWARD``."""
        return self._backward_phase is BackwardPhase.IN_BACKWARD

    def _begin_backward(self) -> None:
        """[Note: the backward phase]
        The store's :class:`BackwardPhase` changes at four points, each a named transition, and where each
        sits against the observers and the bindings matters:

        * ``_begin_backward`` (any phase -> ``IN_BACKWARD``): :meth:`note_backward`, when a gradient opens a
          graph task's end (a nested backward's too, which keeps the phase). From ``ABORTED`` too: a backward
          after one that raised runs, and if it ends whole its gradients are whole again. So
          ``IN_BACKWARD`` goes with a queued end in ``_open_tasks``.
        * ``_end_backward`` (-> ``IDLE``): :meth:`_backward_end`, once the outermost backward's end ran its
          observers, which still see ``IN_BACKWARD``, and before :meth:`ChunkBindings.leave_compute` makes
          the host chunks host-bound. Nested ends change nothing. It may find ``IDLE`` or ``ABORTED``: a
          ``zero_grad()`` inside the backward (a hook) reset the phase, or a backward running on another
          thread was ended in its place from this one; it ends whole all the same.
        * ``_abort_backward`` (-> ``ABORTED``): :meth:`end_aborted_backward`, after the observers settled
          what the raised backward left, before the host binding. From ``IDLE`` too: a backward that read
          a saved parameter (:meth:`note_running`) but raised before any gradient reached a hook never
          began the phase.
        * ``_reset_backward`` (-> ``IDLE``): :meth:`zero_grad`, after :meth:`end_aborted_backward` (which
          may pass through ``ABORTED`` first) and after the zero_grad observers dropped the pending offloads
          (they see the phase as it was), before the gradients are released.

        Every phase can thus follow every other, so the transitions check nothing but are named for the
        event that makes them. :meth:`settle` refuses a step in any phase but ``IDLE``. The phase is apart
        from :attr:`ChunkBindings.computing` (the bindings' phase, from a forward's start to its
        backward's end): a forward after a backward that raised computes while ``ABORTED``, and
        :meth:`settle` inside a backward leaves computing while ``IN_BACKWARD``."""
        self._backward_phase = BackwardPhase.IN_BACKWARD

    def _end_backward(self) -> None:
        """The outermost backward ended whole ([Note: the backward phase])."""
        self._backward_phase = BackwardPhase.IDLE

    def _abort_backward(self) -> None:
        """A backward that raised was ended in its place ([Note: the backward phase])."""
        self._backward_phase = BackwardPhase.ABORTED

    def _reset_backward(self) -> None:
        """``zero_grad()``: no gradient of any backward stays ([Note: the backward phase])."""
        self._backward_phase = BackwardPhase.IDLE

    def observe_backward_end(self, observer: Callable[[], None]) -> None:
        """Call ``observer()`` at the end of every backward (one rank), before the host chunks are
        host-bound."""
        self._backward_end_observers.append(observer)

    def step_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s step count: a 0-d fp32 view into its chunk's ``steps``."""
        return self.param_chunk[id(p)].steps[self.param_pos[id(p)]]

    def data_view(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The chunk view ``p`` must be (its compute values)."""
        v = self._views.get(("data", id(p)))
        if v is None:  # cached: the chunks' buffers change only when they are built again
            c = self.param_chunk[id(p)]
            off, n = self.param_range[id(p)]
            v = self._views["data", id(p)] = self.slot(c.data, off, p)
        return v

    def forget_views(self, c: Chunk, kind: str) -> None:
        """Drop the cached ``kind`` views (``"data"``, ``"grad"``) of ``c``'s parameters (a new buffer)."""
        for p in c.params:
            self._views.pop((kind, id(p)), None)

    def unbound(self, *, quick: bool = False) -> torch.nn.Parameter | None:
        """The first parameter that is no longer the view into its chunk that attach made it (new storage,
        dtype, device or memory format), or ``None`` when every parameter still is. ``quick``: compare the
        storage address and the dtype only (a conversion changes one of them; strides changed in place on the
        same storage are left to the full check), about three times cheaper: the check before each forward."""
        for p in self.all_params():
            view = self.bindings.expected_view(p)
            if p.data_ptr() != view.data_ptr() or p.dtype != view.dtype:
                return p
            if not quick and (p.stride() != view.stride() or p.device != view.device):
                return p
        return None

    def check_bound(self, names: dict[int, str]) -> None:
        """Every parameter is still the view into its chunk that attach made it.

        Raises:
            RuntimeError: a parameter got new storage, dtype, device, shape or memory format after attach
                (``model.double()``, ``model.half()``, ``model.to(...)``, ``p.data = ...``); the message names
                it, what changed and what to do. Updates would otherwise go to the chunk and never reach the
                model (a dtype change would first fail inside autograd with torch's ``grad_dtype`` error).
        """
        p = self.unbound()
        if p is None:
            return
        view = self.bindings.expected_view(p)
        name = names.get(id(p), f"of shape {tuple(p.shape)}")
        if p.dtype != view.dtype:
            unsupported = "" if p.dtype in TRAINABLE_DTYPES else (
                f"; {str(p.dtype).removeprefix('torch.')} is not supported: memsched trains float32, "
                "bfloat16 and float16 parameters")
            raise RuntimeError(
                f"parameter {name!r} is no longer memsched's view into its chunk: its dtype changed from "
                f"{view.dtype} to {p.dtype} after memsched.attach (model.double(), .half(), .bfloat16(), "
                ".to(dtype)); memsched cannot follow a conversion. To compute in bfloat16 or float16 with "
                "fp32 master weights, pass dtype= to memsched.attach instead; to convert the model, convert "
                f"it before memsched.attach: close() the scheduler, convert, and attach again{unsupported}")
        if p.device != view.device:
            what = f"it moved from {view.device} to {p.device}"
        elif p.stride() != view.stride():
            what = f"its memory format changed (strides {view.stride()} -> {p.stride()})"
        else:
            what = "it got new storage (p.data = ..., or a module conversion)"
        raise RuntimeError(
            f"parameter {name!r} is no longer memsched's view into its chunk: {what} after attach. "
            "memsched cannot follow that; convert the model (dtype, device, memory format) before "
            "memsched.attach (close() the scheduler, convert, and attach again), or load values in place "
            "(model.load_state_dict, or `with torch.no_grad(): param.copy_(...)`)")

    def grad_view(self, p: torch.nn.Parameter, c: Chunk | None = None) -> torch.Tensor:
        """The chunk view ``p.grad`` must be; allocates the chunk's gradient buffer if it has none.

        Raises:
            torch.OutOfMemoryError (or the stand-in's): the buffer does not fit; nothing changed.
        """
        c = c or self.param_chunk[id(p)]
        if c.grad is None:
            self.alloc_grad(c)
        v = self._views.get(("grad", id(p)))
        if v is None:
            off, n = self.param_range[id(p)]
            v = self._views["grad", id(p)] = self.slot(c.grad, off, p)
        return v

    def alloc_grad(self, c: Chunk) -> torch.Tensor:
        """``c``'s gradient buffer, allocated (zeros) if it has none.

        Raises:
            torch.OutOfMemoryError (or the stand-in's): the buffer does not fit; nothing changed. Its
                ``memsched_gradient_buffer`` attribute says the failed request was this buffer (bytes),
                for the explanation of the error (:mod:`memsched.runtime.warmup_oom`).
        """
        if c.grad is None:
            try:
                c.alloc_grad(self.alloc)
            except OUT_OF_MEMORY as e:
                e.memsched_gradient_buffer = c.data_bytes
                raise
            for p in c.params:  # views of a freed buffer
                self._views.pop(("grad", id(p)), None)
        return c.grad

    def absent_grad_bytes(self) -> int:
        """Bytes of the gradient buffers the plan counts as resident that do not exist now: the device chunks'
        buffers between ``zero_grad`` and the backward that makes them (one rank), bytes. A host chunk's
        gradients are not resident (they are in the measured peak on their way to the host)."""
        return sum(c.data_bytes for c in self.trainable_chunks
                   if c.grad is None and not self.offloads(c))

    def free_grad(self, c: Chunk) -> None:
        """Free ``c``'s gradient buffer: its parameters' ``.grad`` become None (one rank; see ``lazy_grads``).
        Gradient reductions and D2H copies still reading it were waited for or recorded by the caller."""
        if c.grad is None:
            return
        for p in c.params:
            self._views.pop(("grad", id(p)), None)
            if p.grad is not None and not is_sharded(p.grad) and p.grad.data_ptr() >= c.grad.data_ptr() \
                    and p.grad.data_ptr() < c.grad.data_ptr() + c.grad.numel() * c.grad.element_size():
                p.grad = None
        c.free_grad()

    # -- ZeRO-2: the reduced shard of each chunk's gradients (see [Note: sharded gradients]) ---------------
    def keep_grad_shard(self, c: Chunk, shard: torch.Tensor) -> None:
        """ZeRO-2: ``shard`` (``[hi - lo]``, compute dtype) is this rank's part of ``c``'s gradients of this
        round, averaged over the ranks. It becomes the reduced shard, or is added to an earlier micro-batch's;
        the whole gradient buffer is freed and every parameter that had a gradient shows a
        :class:`memsched.chunks.sharded_grad.ShardedGrad`. Reductions reading the buffer are complete."""
        with torch.no_grad():
            if c.grad_shard is None:
                own = shard.untyped_storage().nbytes() == shard.numel() * shard.element_size()
                c.grad_shard = shard if own else shard.clone()  # not a view of a larger receive buffer
            else:
                c.grad_shard.add_(shard)
        had = [p for p in c.params if p.grad is not None]
        self.free_grad(c)
        for p in had:
            p.grad = self.sharded_grad(p, c)

    def sharded_grad(self, p: torch.nn.Parameter, c: Chunk) -> ShardedGrad:
        """The :class:`memsched.chunks.sharded_grad.ShardedGrad` ``p.grad`` shows once ``c`` is reduced (its
        ``zero_()`` zeroes ``p``'s part of the shard; it holds the store weakly)."""
        store = weakref.ref(self)

        def on_zero() -> None:
            s = store()
            if s is not None and c.grad_shard is not None:
                s.zero_shard_part(p, c)

        return ShardedGrad(p, f"a parameter of shape {tuple(p.shape)} in chunk {c.index}", self.dp.world,
                           on_zero)

    def zero_shard_part(self, p: torch.nn.Parameter, c: Chunk) -> None:
        """Zero ``p``'s elements in ``c``'s reduced shard (those this rank holds)."""
        off, n = self.param_range[id(p)]
        a, b = max(off, c.lo), min(off + n, c.hi)
        if a < b:
            with torch.no_grad():
                c.grad_shard[a - c.lo:b - c.lo].zero_()

    def guard_grads(self, params: set[int]) -> None:
        """ZeRO-2, every reduction complete: the parameters (ids) with a gradient on some rank have one here
        too (their averaged gradient is in the shards), shown as ShardedGrads."""
        for c in self.chunks:
            if c.grad_shard is None:
                continue
            for p in c.params:
                if id(p) in params:
                    self.with_grad.add(id(p))
                    if p.grad is None:
                        p.grad = self.sharded_grad(p, c)

    def whole_grads(self, gather: Callable[[Chunk], torch.Tensor]) -> None:
        """ZeRO-2: every reduced shard becomes a whole gradient buffer again (``gather(c)``: the chunk's whole
        averaged gradients, ``[numel]``, a collective over the ranks), and the parameters' ShardedGrads its
        views (before re-packing, and at ``close()``)."""
        for c in self.chunks:
            if c.grad_shard is None:
                continue
            whole = gather(c)
            self.free_grad(c)
            c.grad = whole
            c.grad_generation += 1
            for p in c.params:
                self._views.pop(("grad", id(p)), None)
                if is_sharded(p.grad):
                    p.grad = self.grad_view(p, c)
            c.grad_shard = None

    def shard_whole_grads(self) -> None:
        """ZeRO-2: the inverse of :meth:`whole_grads` (after re-packing): each whole gradient buffer (averaged
        already) keeps this rank's shard only."""
        for c in self.chunks:
            if c.grad is not None:
                self.keep_grad_shard(c, c.grad[c.lo:c.hi])

    def rebind_grad(self, p: torch.nn.Parameter, c: Chunk | None = None) -> None:
        """Put ``p.grad`` back into its chunk view if autograd or the user produced a separate tensor."""
        g = p.grad
        if g is None or is_sharded(g):
            return
        view = self.grad_view(p, c)
        if g.data_ptr() != view.data_ptr() or g.shape != view.shape or g.dtype != view.dtype:
            with torch.no_grad():
                view.copy_(g)
            p.grad = view

    def bind_dropped_grads(self) -> None:
        """Before a forward: parameters whose ``.grad`` was set to None (``model.zero_grad()``, Hugging Face
        Trainer) get their zeroed chunk view back, so backward accumulates into the chunk instead of
        allocating a gradient that :meth:`rebind_grad` then copies. They count as having no gradient until
        backward gives them one (``torch.optim.AdamW`` does not update them).

        One rank (``lazy_grads``): nothing is bound; backward gives such a parameter a new gradient, which
        :meth:`rebind_grad` copies into the chunk. A chunk none of whose parameters has a gradient any more
        (``model.zero_grad()``) frees its buffer here, before the forward's peak."""
        if self.lazy_grads:
            for c in self.chunks:
                if self.bindings.host_bound(c):  # enter_compute takes care of host-bound gradients
                    continue
                for p in c.params:
                    if p.grad is None:
                        self.with_grad.discard(id(p))
                        if c.grad_shard is not None:  # ZeRO-2: its part of the reduced shard is dropped
                            self.zero_shard_part(p, c)
                if c.grad is not None and all(p.grad is None for p in c.params):
                    self.free_grad(c)
                if c.grad_shard is not None and all(p.grad is None for p in c.params):
                    c.grad_shard = None
            return
        with torch.no_grad():
            for p in self.params():
                if p.grad is None:
                    view = self.grad_view(p)
                    view.zero_()
                    p.grad = view
                    self.with_grad.discard(id(p))

    def on_grads_ready(self, chunk: Chunk) -> None:
        """All of ``chunk``'s gradients are complete in this backward (a reduce-scatter goes there, or their
        offload to the host)."""
        self.dp.grads_ready(chunk)
        for observer in self._grads_ready_observers:
            observer(chunk)

    def observe_grads_ready(self, observer: Callable[[Chunk], None]) -> None:
        """Call ``observer(chunk)`` whenever all of a chunk's gradients are complete in a backward, after the
        data parallelism was told (its reduction is launched first)."""
        self._grads_ready_observers.append(observer)

    def after_update(self, chunk: Chunk) -> None:
        """``chunk``'s shard was updated and copied into ``data[lo:hi]`` (an all-gather goes there)."""
        self.dp.after_update(chunk)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset readiness and the gradients. ``set_to_none`` (torch's default): the parameters have no
        gradient until backward gives them one (they are then not updated); with one rank the gradient buffers
        are freed and every ``.grad`` is None. Otherwise the buffers that exist are zeroed and the views
        kept."""
        self.end_aborted_backward()
        self._ready_pending.clear()  # of a backward that raised
        self._open_tasks.clear()
        self.dp.before_zero_grad()  # pending gradient reductions finish first
        for observer in self._zero_grad_observers:  # pending offloads are dropped
            observer()
        self._reset_backward()
        if set_to_none and self.lazy_grads and not self.closed:
            self._release_kept_grads()
        if set_to_none and not self.closed:
            self.with_grad.clear()
            self.host_grads.clear()
        if set_to_none and self.lazy_grads and not self.closed:  # the buffers go: every .grad is None
            for c in self.trainable_chunks:
                c.reset_ready()
                self.free_grad(c)
                c.grad_shard = None
                for p in c.params:
                    p.grad = None
                # See [Note: host binding]: with no gradient left on the host, parameters whose values are on
                # the device read as device tensors again, as they would on plain torch, once the updated
                # values' H2D copy has landed (a read right after zero_grad() must not see the old ones)
                if self.bindings.host_bound(c) and c.data is not None and not self.bindings.computing:
                    self.before_device_read(c)
                    self.bindings.leave_host(c)
            return
        with torch.no_grad():
            for c in self.trainable_chunks:
                c.reset_ready()
                held = [p for p in c.params if id(p) in self.host_grads]
                if held:  # host gradients: zeroed where they are, as torch zeroes p.grad
                    settle(c.device)  # after kernels that wrote them through the user views
                    self.before_host_write(c)
                    with self.alloc.host_context():
                        for p in held:
                            self.host_view("grad", p, c).zero_()
                if c.grad_shard is not None:  # ZeRO-2: the reduced shard, zeroed; p.grad stay ShardedGrads
                    c.grad_shard.zero_()
                if c.grad is None:  # no gradient since the last zero_grad: p.grad stays None, as in torch
                    continue
                c.grad.zero_()
                for p in c.params:
                    if self.lazy_grads and (p.grad is None or is_sharded(p.grad)):  # as torch leaves it
                        continue
                    if id(p) in self.host_grads:
                        continue
                    view = self.grad_view(p, c)
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view

    def _release_kept_grads(self) -> None:
        """``zero_grad(set_to_none=True)``: a host gradient the user still holds (``g = p.grad``, for a
        gradient-noise estimate) keeps its values, as in torch, where the next backward makes a new tensor:
        it gets storage of its own before the next backward writes the chunk's host gradients again. Held is
        told by the reference count: the only other references are this loop's and the view cache's."""
        for c in self.bindings.host_chunks():
            for p in c.params:
                g = p.grad
                if g is None or id(p) not in self.host_grads:
                    continue
                # p.grad is its user view (a device alias, cached under "grad@user") or, on the CPU device,
                # the host view itself
                key = ("grad@user", id(p)) if ("grad@user", id(p)) in self._views else ("grad@host", id(p))
                hit = self._views.get(key)
                cached = hit is not None and hit[1] is g
                if sys.getrefcount(g) > _unheld_grad_refs() - (not cached):
                    with torch.no_grad(), self.alloc.host_context():
                        # a host copy of its own (pinned like the buffer), read as the device as before: the
                        # held gradient takes no device memory
                        settle(c.device)
                        host = self.host_view("grad", p, c)
                        own = self.alloc.host_empty(host.numel(), host.dtype)
                        own = own.as_strided(host.shape, dense_strides(host)).copy_(host)
                        alias = (host_alias_of(own, c.device, pinned=self.alloc.pin)
                                 if g.device != own.device else None)
                        g.data = alias if alias is not None else own
                    if cached:
                        del self._views[key]
                del g

    def observe_zero_grad(self, observer: Callable[[], None]) -> None:
        """Call ``observer()`` at the start of every :meth:`zero_grad` (gradients in flight are dropped)."""
        self._zero_grad_observers.append(observer)

    def _back_to_device(self) -> None:
        """``close()``: without the hooks nothing fetches or offloads, so every parameter and gradient comes
        back to the device, a plain model as before attach: the chunks whose parameters live on the host are
        copied H2D, host gradients too. What does not fit stays on the host (host views, with their
        gradients), with a warning naming the bytes: the model is then split between host and device, as it
        was on the device before the step that needed the offload."""
        self.closed = True  # from here enter_compute leaves host-bound chunks without a buffer as they are
        stayed = 0
        for c in self.chunks:
            if c.data is not None:
                continue
            if self.bindings.state(c) is Binding.SHARDED:
                # ZeRO-3 after a failed collective (close() gathers every chunk first, and warned that
                # it could not): the other ranks' parts cannot come; its parameters stay absent views
                # (NaN), never a buffer whose other parts hold garbage
                continue
            if not self.bindings.host_bound(c):
                self.bindings.to_host(c)
            try:
                data = self.alloc.device_empty(c.numel, c.dtype)
            except OUT_OF_MEMORY:
                stayed += c.data_bytes
                continue
            with torch.no_grad():
                data[c.lo:c.hi].copy_(c.param_host)
            self.bindings.data_arrived(c, data)
        self.bindings.enter_compute()
        for c in self.chunks:
            if c.data is None:
                continue
            try:
                self._grads_to_device(c)
            except OUT_OF_MEMORY:  # its parameters and gradients do not fit together: both stay on the host
                self.bindings.computing = False
                self.bindings.to_host(c)
                self.bindings.data_leaves(c)
                self.bindings.computing = True
                stayed += c.data_bytes
        if stayed:
            warnings.warn(f"memsched: close(): {stayed} bytes of parameters stay on the host with their "
                          "gradients: they do not fit on the device beside the rest of the model",
                          RuntimeWarning, stacklevel=4)


    def close(self) -> None:
        """Remove the gradient hooks (parameters stay views into the chunks). Without them nothing tells which
        parameters got a gradient: from here on every parameter counts as having one (as after
        ``zero_grad(set_to_none=False)``)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.chunks:
            settle(self.chunks[0].device)  # no kernel reads a host buffer through a user view any more
        for p in self.all_params():  # memsched lets them go: their own class back ([Note: foreign reads])
            present(p)
        if not self.closed:
            self._back_to_device()
        self.closed = True
        self.with_grad.update(id(p) for p in self.params())


def frozen_params(model: torch.nn.Module, trainable: Sequence[torch.nn.Parameter],
                  dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """The frozen parameters memsched packs into chunks of their own (issue 31): each parameter of ``model``
    (tied ones once) that is not in ``trainable``, has ``requires_grad=False`` and is a plain tensor of the
    compute ``dtype`` (a frozen parameter of another dtype, or a tensor subclass such as a quantized weight,
    keeps its own storage on the device: memsched never converts a frozen value)."""
    given = {id(p) for p in trainable}
    out, seen = [], set()
    for p in model.parameters():
        if id(p) in seen or id(p) in given:
            continue
        seen.add(id(p))
        plain = type(p.data) is torch.Tensor or isinstance(p.data, FakeTensor)  # fake: memsched plan's trace
        if not p.requires_grad and p.dtype == dtype and plain and p.numel() > 0:
            out.append(p)
    return out


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


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides when it is dense in a memory format memsched keeps (contiguous, channels_last,
    channels_last_3d), else the contiguous strides of its shape."""
    if not t.is_contiguous():
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
        if fmt is not None and t.is_contiguous(memory_format=fmt):
            return tuple(t.stride())
    return _contiguous_strides(t.shape)
