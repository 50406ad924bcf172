"""The chunks of a model: building them, binding parameters as views, their placement, re-packing.

:class:`ChunkStore` owns the chunks, their layout and re-packing, where each parameter is in them and the
views memsched makes of its slots, and the placement of each chunk's optimizer state. It composes the stages
of a step that work on the chunks, each an object that owns its state, in a module of its own:

* ``store.bindings`` (:class:`memsched.chunks.binding.ChunkBindings`): where each chunk's parameters point,
  with its lifecycle per chunk;
* ``store.backward`` (:class:`memsched.chunks.backward.BackwardTracker`): the gradient hooks, each chunk's
  readiness and the backward phase;
* ``store.grads`` (:class:`memsched.chunks.gradients.GradBuffers`): the gradient buffers, the gradients on
  the host, ZeRO-2's reduced shards and ``zero_grad``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memsched.chunks.backward import BackwardPhase, BackwardTracker
from memsched.chunks.binding import Binding, ChunkBindings, present
from memsched.chunks.buffers import Allocator
from memsched.chunks.chunk import Chunk
from memsched.chunks.events import ChunkEvents, OneProcess
from memsched.chunks.gradients import GradBuffers
from memsched.chunks.layout import ChunkLayout, Slot, build_layout, ordered_groups
from memsched.chunks.sharded_grad import is_sharded
from memsched.chunks.strides import contiguous_strides, dense_strides
from memsched.devices.host_alias import host_alias_of, reads_host_memory, settle
from memsched.devices.simdevice import OUT_OF_MEMORY
from policies.types import DEVICE, HOST


def _nothing(_chunk: Chunk) -> None:
    """The default of the store's ``before_host_write`` and ``before_device_read``: nothing to wait for."""


class ChunkStore:
    """The chunks of a model: builds them from param groups and a layout, binds parameters as views, places
    their optimizer state and re-packs on request; its stages (``bindings``, ``backward``, ``grads``) are
    described in the module docstring.

    Args:
        groups: trainable parameters per param group (tied parameters once; no frozen ones).
        alloc: where buffers come from.
        compute_dtype: dtype of the compute and gradient buffers (fp32 masters are kept when it is not fp32).
        chunk_numel: chunk size override (elements); ``None`` = searched.
        on_grads_ready: an observer of complete chunks
            (:meth:`memsched.chunks.backward.BackwardTracker.observe_grads_ready`), or ``None``.
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
        before_host_write: called as ``before_host_write(chunk)`` before memsched writes a host chunk's host
            buffers (the CPU update must be done reading them); default nothing.
        before_device_read: called as ``before_device_read(chunk)`` before a chunk's parameters become
            device views between steps (its H2D copy in flight must land first); default nothing.

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
                 frozen: Sequence[torch.nn.Parameter] = (),
                 before_host_write: Callable[[Chunk], None] | None = None,
                 before_device_read: Callable[[Chunk], None] | None = None) -> None:
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
        self.closed = False
        # Where each chunk's parameters point, and the phase (computing or between steps) they follow
        self.bindings = ChunkBindings(self)
        # The gradient buffers, and the backward stage that fills them (hooks, readiness, the phase)
        self.grads = GradBuffers(self, {id(p) for g in self.groups for p in g if p.grad is not None})
        self.backward = BackwardTracker(self, on_grads_ready)
        # Whether some chunk offloads (a plain flag: compiled hooks read it, see memsched.runtime.waits)
        self.offloading = False
        # The gradient offload (memsched.chunks.grad_offload) once installed; without it host chunks keep
        # their gradients on the device until the step, as with more ranks.
        self.offloader: object | None = None
        # Called before memsched writes a host chunk's host buffers (the CPU worker must be done reading them)
        self.before_host_write: Callable[[Chunk], None] = before_host_write or _nothing
        # Called before a chunk's parameters become device views between steps: reads of them from here on
        # (outside any forward, so no module hook waits for them) must come after its H2D copy in flight
        self.before_device_read: Callable[[Chunk], None] = before_device_read or _nothing
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
        self._build(self.layout, self._packing(), after_chunk=after_chunk)
        self.dp.install(self)
        self.backward.install(list(self.params()))

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
        puts them where their chunk's placement wants them, :meth:`GradBuffers.place_staged`).
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
        return Chunk(ci, layout.chunk_groups[ci], numel, params, ranges, data, grad, initial_master=initial,
                     frozen=frozen, offload_grads=self.backward_offload, private_grads=self.private_grads,
                     lean=self.lean_params and not frozen)

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
        self.grads.host_grads.clear()
        self._release(staged)

        def restore(store: ChunkStore, c: Chunk) -> None:  # as each new chunk is built
            self._restore_state(c, staged, side, steps)
            if not c.frozen:
                self.grads.place_staged(c, staged)
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
                elif c.grad_host is not None and id(p) in self.grads.host_grads:
                    grad = c.grad_host[off:off + n]
            staged[id(p)] = (values[off:off + n], grad, master[off:off + n], c.exp_avg[off:off + n],
                             c.exp_avg_sq[off:off + n])

    def rebind_hosts(self) -> None:
        """After (re)building the chunks: host chunks' gradients go to the host and, between steps, their
        parameters are host-bound again (see [Note: host binding])."""
        self.note_placements()
        for c in self.chunks:
            if self.offloads(c):
                self.grads.to_host(c)
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
        return s if s is not None else contiguous_strides(p.shape)

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
                    gview = self.grads.view(p, c)
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
            self.grads.to_device(c)  # while its host gradients still exist
        moved = c.move_to(placement, self.alloc)
        # The cached host and user views would keep the old host buffers (pinned memory) alive after the move.
        self.forget_host_views(c)
        self.note_placements()
        if self.offloads(c):
            self.grads.to_host(c)
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

    def after_update(self, chunk: Chunk) -> None:
        """``chunk``'s shard was updated and copied into ``data[lo:hi]`` (an all-gather goes there)."""
        self.dp.after_update(chunk)

    def settle(self) -> None:
        """Before a step: gradients still on the device of host chunks go to the host and the host chunks
        become host-bound, as at backward's end (a forward with no backward, gradients set by hand).

        Raises:
            RuntimeError: a backward began and did not end (it raised): part of its gradients are on the host
                and part are not, so anything reading them now (torch's ``clip_grad_norm_``, the step) would
                see only part of them. ``zero_grad()`` drops them.
        """
        if self.backward.phase is not BackwardPhase.IDLE:
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
                not self.bindings.host_bound(c) and any(id(p) in self.grads.host_grads for p in c.params)))
                for c in self.chunks):
            self.backward.tell_end()
            self.bindings.computing = True
            self.bindings.leave_compute()

    def step_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s step count: a 0-d fp32 view into its chunk's ``steps``."""
        return self.param_chunk[id(p)].steps[self.param_pos[id(p)]]

    def data_view(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The chunk view ``p`` must be (its compute values)."""
        v = self._views.get(("data", id(p)))
        if v is None:  # cached: the chunks' buffers change only when they are built again
            v = self.chunk_view("data", p, self.param_chunk[id(p)].data)
        return v

    def chunk_view(self, kind: str, p: torch.nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
        """``p``'s slot in ``flat``, its chunk's ``kind`` buffer (``"data"``, ``"grad"``), made once until
        :meth:`forget_views` (a new buffer)."""
        v = self._views.get((kind, id(p)))
        if v is None:
            off, _n = self.param_range[id(p)]
            v = self._views[kind, id(p)] = self.slot(flat, off, p)
        return v

    def cached_host_grad(self, p: torch.nn.Parameter) -> tuple[tuple[str, int], Any]:
        """The cache key of the view ``p.grad`` is while host-bound (its user view, else its host view) and
        the cached ``(buffer, view)`` entry under it, or ``None``."""
        key = ("grad@user", id(p)) if ("grad@user", id(p)) in self._views else ("grad@host", id(p))
        return key, self._views.get(key)

    def forget_view(self, key: tuple[str, int]) -> None:
        """Drop the cached view under ``key`` (:meth:`cached_host_grad`)."""
        self._views.pop(key, None)

    def forget_views(self, c: Chunk, kind: str) -> None:
        """Drop the cached ``kind`` views (``"data"``, ``"grad"``) of ``c``'s parameters (a new buffer)."""
        for p in c.params:
            self._views.pop((kind, id(p)), None)

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
                self.grads.to_device(c)
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
        self.backward.remove()
        if self.chunks:
            settle(self.chunks[0].device)  # no kernel reads a host buffer through a user view any more
        for p in self.all_params():  # memsched lets them go: their own class back ([Note: foreign reads])
            present(p)
        if not self.closed:
            self._back_to_device()
        self.closed = True
        self.grads.with_grad.update(id(p) for p in self.params())


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
