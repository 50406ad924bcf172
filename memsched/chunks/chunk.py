"""One chunk: flat compute and gradient buffers, and the optimizer state of its shard, on one side."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from memsched.chunks.buffers import Allocator
from policies.types import DEVICE, HOST


class Chunk:
    """One chunk: flat compute and gradient buffers on the device, optimizer state of the shard ``[lo, hi)``.

    Tensors (all 1-D):
        ``data``: ``[numel]`` compute dtype, device: the parameters are views into it.
        ``grad``: ``[numel]`` compute dtype, device: the parameters' ``.grad`` are views into it; ``None``
            while no gradient exists (one rank: allocated by the first gradient of a backward, freed by
            ``zero_grad()``; see :mod:`memsched.chunks.store`).
        ``master``: ``[hi - lo]`` fp32 on the state's side; ``None`` in fp32 on the device (``data`` is
            the master).
        ``exp_avg``, ``exp_avg_sq``: ``[hi - lo]`` fp32, on the state's side.
        ``steps``: ``[len(params)]`` fp32, on the state's side: each parameter's own step count (a parameter
            that gets no gradient in a step is not updated and its count does not move, as in
            ``torch.optim.AdamW``).
        ``host_grad``: ``[hi - lo]`` fp32 host buffer the CPU update reads its gradients from (host placement
            only; in fp32 the D2H copy lands there directly). ``None`` under mixed precision without
            ``private_grads``: the update upcasts into a scratch buffer shared by the chunks
            (:meth:`memsched.optim.hybrid_adamw.HybridAdamW.grad_scratch`; [Note: one fp32 gradient scratch]).
        ``staging``: ``[hi - lo]`` compute-dtype host buffer (host placement, mixed precision): the
            parameters' values in the compute dtype, cast from the master on the CPU after each update (the
            H2D copy's source; between steps the parameters are views into it, :mod:`memsched.chunks.store`).
            With more ranks the D2H copy of the gradients lands there too. A ``lean`` chunk has one only
            once its parameters leave the device ([Note: lean host chunks]).
        ``grad_host``: ``[hi - lo]`` compute-dtype host gradients (host placement): where the gradients go
            when backward completes them and what ``p.grad`` shows between steps (one rank,
            :mod:`memsched.chunks.grad_offload`); the same tensor as ``host_grad`` in fp32, its own buffer
            under mixed precision (upcast into ``host_grad`` for the update).
        ``param_host``: the parameters' values on the host in the compute dtype (host placement): ``master``
            in fp32, ``staging`` under mixed precision.
        ``landing``: ``[hi - lo]`` compute-dtype host buffer for a second micro-batch's gradients, added into
            ``grad_host`` on the CPU (allocated at the first accumulation, :meth:`landing_buffer`).

    A chunk of frozen parameters (``frozen``, issue 31: ``requires_grad=False`` at attach, one rank) has no
    gradient buffer and no optimizer state: placed on the host it keeps its parameters' values in ``staging``
    (compute dtype, ``[hi - lo]``: its ``param_host``), on the device nothing besides ``data``. It is placed,
    fetched for its reads and kept cached like any chunk, and never updated.

    The optimizer state of one placement is one allocation (:meth:`Allocator.arena`). The chunk owns its
    transitions: its shard (:meth:`set_shard`, :meth:`reshard`), its copies and their events
    (:meth:`start_d2h`, :meth:`start_h2d`, :meth:`wait_d2h`, :meth:`wait_h2d`), its placement
    (:meth:`init_state`, :meth:`move_to`), its compute buffer (:meth:`set_data`, :meth:`drop_data`), its
    gradients (:meth:`alloc_grad`, :meth:`free_grad`, :meth:`keep_grad_shard`, :meth:`drop_grad_shard`,
    :meth:`take_whole_grad`), ZeRO-3's kept shard (:meth:`keep_param_shard`, :meth:`drop_param_shard`), its
    spare state (:meth:`alloc_spare`, :meth:`swap_spare`, :meth:`drop_spare`), its gradient readiness
    (:meth:`mark_grad_ready`, :meth:`set_ready`, :meth:`reset_ready`) and its release (:meth:`release`);
    other classes call these, never assign its fields (``tests/test_layout.py`` checks it).
    """

    def __init__(self, index: int, group: int, numel: int, params: list[torch.nn.Parameter],
                 ranges: list[tuple[int, int]], data: torch.Tensor, grad: torch.Tensor | None, *,
                 initial_master: torch.Tensor | None = None, frozen: bool = False,
                 offload_grads: bool = False, private_grads: bool = False, lean: bool = False) -> None:
        self.index = index
        self.frozen = frozen
        self.group = group
        self.numel = numel
        self.params = params
        self.ranges = ranges  # (offset, numel) per parameter
        self.data: torch.Tensor | None = data  # None while its parameters are away (runtime.param_fetch)
        self.dtype, self.device = data.dtype, data.device  # the compute buffer's, present or not
        self.grad = grad
        # ZeRO-2: this rank's shard of the averaged gradients once reduced (``[hi - lo]``, compute dtype, on
        # the device; ``grad`` is then freed): see memsched.chunks.sharded_grad
        self.grad_shard: torch.Tensor | None = None
        # ZeRO-3: this rank's shard of the parameters (``[hi - lo]``, compute dtype, on the device) while
        # ``data`` is away, all-gathered back for the chunk's reads (memsched.distributed.sharded_params)
        self.param_shard: torch.Tensor | None = None
        self.grad_generation = 0  # moves at every allocation of ``grad`` (its version restarts then)
        self.lo, self.hi = 0, numel
        self.placement: str | None = None
        self.master: torch.Tensor | None = None
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.steps: torch.Tensor | None = None
        self.host_grad: torch.Tensor | None = None
        self.staging: torch.Tensor | None = None
        self.grad_host: torch.Tensor | None = None
        self.landing: torch.Tensor | None = None
        # One rank: the optimizer state of a host chunk comes with host gradients (``grad_host``) and the
        # parameters' host values; given by the store at construction. ``private_grads`` (overlap=True):
        # the CPU update reads its own fp32 copy (``host_grad``) even in fp32, so that writes to ``p.grad``
        # after the step cannot reach an update still running on the worker.
        self.offload_grads = offload_grads
        self.private_grads = private_grads
        # [Note: lean host chunks]
        # Under mixed precision a host chunk's parameters need a copy in the compute dtype on the host only
        # where something reads them there: the H2D copy after the CPU update, and the parameters themselves
        # between steps where the device cannot read host memory in place (a host gradient beside a device
        # parameter would be a device error) or while their buffer is off the device (parameter offload).
        # One rank, gradients offloaded, no private gradients, a device that reads pinned memory in place
        # (``lean``, given by the store): the chunk keeps no such copy while its buffer is on the device. The
        # update casts its master into a staging buffer the host chunks share (HybridAdamW.h2d_staging)
        # for the H2D copy, and between steps its parameters stay views of the device buffer while their
        # gradients are views of the host's (both read as the device). The copy is made when the buffer
        # leaves (ChunkBindings.data_leaves), so parameter offload costs its bytes and nothing else does:
        # 14 bytes per parameter in bf16 (master, moments, bf16 gradients) instead of 16.
        self.lean = lean
        # Parameters whose gradient is complete in the backward pass ``ready_task`` (autograd graph task id):
        # readiness is per backward pass, so accumulation with a parameter unused in one micro-batch never
        # declares a chunk ready while that backward still writes into it.
        self.ready: set[int] = set()
        self.ready_task: int | None = None
        self.d2h_event = None  # CUDA event of the in-flight D2H copy of the gradients (at step)
        self.h2d_event = None  # CUDA event of the in-flight H2D copy of the updated parameters
        self.initial_master = initial_master  # fp32 host values until the first init_state (mixed precision)
        # A second host state of the same layout (overlap="backward", memsched.optim.early_update): the update
        # made during backward is written there and swapped in at the step (swap_spare), or dropped.
        self.spare: dict[str, torch.Tensor | None] | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def mixed(self) -> bool:
        return self.dtype != torch.float32

    @property
    def data_bytes(self) -> int:
        """Bytes of the compute buffer (and of the gradient buffer): ``numel`` elements of the compute
        dtype."""
        return self.numel * self.dtype.itemsize

    @property
    def shard_numel(self) -> int:
        return self.hi - self.lo

    def param_part(self) -> torch.Tensor:
        """This rank's part of the parameters on the device (``[hi - lo]``, compute dtype): ``data[lo:hi]``,
        or while ZeRO-3 has the chunk away, the shard kept for it (``param_shard``)."""
        return self.data[self.lo:self.hi] if self.data is not None else self.param_shard

    def master_view(self) -> torch.Tensor:
        """The fp32 master of the shard wherever it lives (the device part of the parameters in fp32:
        :meth:`param_part`)."""
        return self.master if self.master is not None else self.param_part()

    @property
    def param_host(self) -> torch.Tensor | None:
        """The parameters' values on the host in the compute dtype (``[hi - lo]``, host placement): the
        master in fp32, ``staging`` under mixed precision; ``None`` on the device, and for a ``lean`` chunk
        whose parameters are on the device ([Note: lean host chunks])."""
        if self.staging is not None:
            return self.staging
        return self.master if self.placement == HOST and not self.mixed else None

    def add_param_host(self, alloc: Allocator) -> torch.Tensor:
        """The parameters' host copy of a ``lean`` host chunk whose buffer leaves the device (compute dtype,
        ``[hi - lo]``, pinned like the state), allocated now if missing; the caller fills it.

        Raises:
            RuntimeError: the chunk is not on the host, or the allocation failed (out of host memory).
        """
        if self.placement != HOST:
            raise RuntimeError(f"chunk {self.index} is not on the host: its parameters have no host copy")
        if self.param_host is None:
            self.staging = alloc.arena(HOST, [("staging", self.compute_dtype, self.shard_numel)])["staging"]
        return self.param_host

    def drop_param_host(self) -> bool:
        """A ``lean`` chunk whose parameters stay on the device from now on lets its host copy go (freed
        once nothing holds it); returns whether it had one. The caller has re-bound the parameters."""
        had = self.lean and self.staging is not None and self.data is not None
        if had:
            self.staging = None
        return had

    def state_tensors(self) -> list[torch.Tensor]:
        ts = (self.master, self.exp_avg, self.exp_avg_sq, self.steps, self.host_grad, self.staging,
              self.grad_host if self.grad_host is not self.host_grad else None, self.landing)
        return [t for t in ts if t is not None]

    def state_nbytes(self) -> int:
        """Bytes held by the optimizer state (incl. host gradient and staging buffers), bytes."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    # -- placement: whole-chunk copies; everything new is allocated before anything is swapped --------------
    def init_state(self, placement: str, alloc: Allocator, *, master: torch.Tensor | None = None,
                   exp_avg: torch.Tensor | None = None, exp_avg_sq: torch.Tensor | None = None,
                   steps: torch.Tensor | Sequence[float] | None = None,
                   pieces: Sequence[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = ()) -> None:
        """Allocate the optimizer state at ``placement`` (``DEVICE``/``HOST``); zeros unless given (fp32
        ``[hi-lo]``; ``steps``: one step count per parameter, ``[len(params)]``). Under mixed precision the
        master starts from the full-precision parameter values. ``pieces``: ``(offset, master, exp_avg,
        exp_avg_sq)`` slices (fp32, any device) copied into the new state at ``offset`` after the rest, so a
        caller assembling the state from parts needs no whole-chunk temporaries."""
        new = self._alloc_state(placement, alloc)
        if self.frozen:
            self.initial_master = None
            if new["staging"] is not None:
                ctx = alloc.host_context() if placement == HOST else contextlib.nullcontext()
                with torch.no_grad(), ctx:
                    new["staging"].copy_(self.param_part())
            self._install(placement, new)
            return
        if master is None and self.initial_master is not None:
            master = self.initial_master[self.lo:self.hi]
        self.initial_master = None
        src_master = master if master is not None else self.param_part()
        ctx = alloc.host_context() if placement == HOST else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            if new["master"] is not None:
                new["master"].copy_(src_master)
            elif master is not None:
                self.param_part().copy_(master)
            if new["staging"] is not None:  # the parameters' compute-dtype values, as the model has them
                new["staging"].copy_(self.param_part())
            for k, src in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                if src is None:
                    new[k].zero_()
                else:
                    new[k].copy_(src)
            if steps is None:
                new["steps"].zero_()
            else:
                new["steps"].copy_(torch.as_tensor(steps, dtype=torch.float32))
            dst_master = new["master"] if new["master"] is not None else self.param_part()
            for off, m, ea, eas in pieces:
                n = m.numel()
                dst_master[off:off + n].copy_(m)
                new["exp_avg"][off:off + n].copy_(ea)
                new["exp_avg_sq"][off:off + n].copy_(eas)
        self._install(placement, new)
        self.spare = None

    def _alloc_state(self, placement: str, alloc: Allocator) -> dict[str, torch.Tensor | None]:
        n = self.shard_numel
        host = placement == HOST
        keys = ("master", "exp_avg", "exp_avg_sq", "steps", "host_grad", "staging", "grad_host")
        if self.frozen:  # the parameters' host values only, on the host
            out: dict[str, torch.Tensor | None] = dict.fromkeys(keys)
            if host:
                out["staging"] = alloc.arena(HOST, [("staging", self.compute_dtype, n)])["staging"]
            return out
        f32 = torch.float32
        parts = [("exp_avg", f32, n), ("exp_avg_sq", f32, n)]
        if host or self.mixed:
            parts.append(("master", f32, n))
        if host and not (self.mixed and not self.private_grads):  # [Note: one fp32 gradient scratch]
            parts.append(("host_grad", f32, n))
        parts.append(("steps", f32, len(self.params)))
        if host and self.mixed and not self.lean:  # [Note: lean host chunks]
            parts.append(("staging", self.compute_dtype, n))
        if host and self.offload_grads and (self.mixed or self.private_grads):
            parts.append(("grad_host", self.compute_dtype, n))
        views = alloc.arena(placement, parts)
        out = {k: views.get(k) for k in keys}
        for k in ("host_grad", "grad_host"):  # gradients are not state: their own version counters
            if out[k] is not None:
                out[k] = out[k].data
        if host and out["grad_host"] is None and self.offload_grads:
            out["grad_host"] = out["host_grad"]  # fp32: the update reads the gradients where they land
        return out

    def _install(self, placement: str, new: dict[str, torch.Tensor | None]) -> None:
        self.placement = placement
        self.master = new["master"]
        self.exp_avg = new["exp_avg"]
        self.exp_avg_sq = new["exp_avg_sq"]
        self.steps = new["steps"]
        self.host_grad = new["host_grad"]
        self.staging = new["staging"]
        self.grad_host = new.get("grad_host")
        self.landing = None  # made for the old placement's shard
        self.d2h_event = None

    def landing_buffer(self, alloc: Allocator) -> torch.Tensor:
        """``landing``, allocated (compute dtype, ``[hi - lo]``, pinned like the state) at its first use: a
        later micro-batch's gradients land there and are added into ``grad_host`` on the CPU.

        Raises:
            RuntimeError: the chunk is not on the host, or the allocation failed (out of host memory).
        """
        if self.placement != HOST:
            raise RuntimeError(f"chunk {self.index} is not on the host: it has no host gradients")
        if self.landing is None:
            self.landing = alloc.host_empty(self.shard_numel, self.compute_dtype)
        return self.landing

    # -- spare host state (memsched.optim.early_update)
    # -----------------------------------------------------------
    def alloc_spare(self, alloc: Allocator) -> None:
        """Allocate the spare host state (the layout of the host state; pinned like it) if missing.

        Raises:
            RuntimeError: the chunk is not on the host, or the allocation failed (out of host memory).
        """
        if self.placement != HOST:
            raise RuntimeError(f"chunk {self.index} is not on the host: it has no spare host state")
        if self.spare is None:
            self.spare = self._alloc_state(HOST, alloc)

    def spare_nbytes(self) -> int:
        """Bytes held by the spare host state (0 without one), bytes."""
        distinct = {id(t): t for t in (self.spare or {}).values() if t is not None}  # fp32: grad_host aliases
        return sum(t.numel() * t.element_size() for t in distinct.values())

    def swap_spare(self) -> None:
        """The spare host state becomes the chunk's state, and the state in force becomes the spare.

        Raises:
            RuntimeError: there is no spare state.
        """
        if self.spare is None or self.placement != HOST:
            raise RuntimeError(f"chunk {self.index} has no spare host state to swap in")
        # The gradients stay (``p.grad`` shows them between steps); the state and the parameters' host values
        # swap (the store points the parameters at the new ones: ChunkBindings.refresh_host).
        keep = {"host_grad": self.host_grad, "grad_host": self.grad_host}
        current = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                   "steps": self.steps, "staging": self.staging, **{k: self.spare[k] for k in keep}}
        landing = self.landing
        self._install(HOST, {**self.spare, **keep})
        self.landing = landing
        self.spare = current

    def drop_spare(self) -> None:
        """Let the spare host state go (freed once nothing holds it): the plan no longer speculates this
        chunk."""
        self.spare = None

    def state_version(self) -> int:
        """The version counter of the state's allocation (all its parts but the gradients are views of one
        arena sharing it, so any in-place write to any of them moves it); a frozen chunk's host values'."""
        if self.frozen:
            return self.staging._version if self.staging is not None else 0
        assert self.exp_avg is not None
        return self.exp_avg._version

    def move_to(self, placement: str, alloc: Allocator) -> int:
        """Move the optimizer state to ``placement`` by whole-chunk copies; returns the bytes copied.

        Bit-exact: fp32 tensors are copied as they are. Allocation happens first, so a failure (e.g. out of
        memory) leaves the chunk as it was.
        """
        if placement not in (DEVICE, HOST):
            raise ValueError(f"placement must be {DEVICE!r} or {HOST!r}, got {placement!r}")
        if placement == self.placement:
            return 0
        self.wait_h2d()
        self.wait_d2h()  # a gradient copy into the host buffers being replaced (e.g. of a skipped step)
        if placement == DEVICE and self.data is None and self.param_shard is None \
                and self.param_host is not None:
            # ZeRO-3, the chunk away with its part on the host: the part comes to the device with the state
            shard = alloc.device_empty(self.hi - self.lo, self.dtype)
            with torch.no_grad():
                shard.copy_(self.param_host)
            self.param_shard = shard
        new = self._alloc_state(placement, alloc)
        ctx = alloc.host_context() if placement == HOST else contextlib.nullcontext()
        if self.frozen:  # its values: to the host copy, or (the buffer present) nothing to copy
            with torch.no_grad(), ctx:
                if new["staging"] is not None:
                    new["staging"].copy_(self.param_part())
                elif self.data is not None and self.staging is not None:
                    self.param_part().copy_(self.staging)
            self._install(placement, new)
            return self.shard_numel * self.dtype.itemsize
        with torch.no_grad(), ctx:
            src_master = self.master_view()
            if new["master"] is not None:
                new["master"].copy_(src_master)
            else:  # fp32 to the device: the compute buffer becomes the master (it already holds its value)
                self.param_part().copy_(src_master)
            if new["staging"] is not None:
                src = self.staging if self.staging is not None else self.param_part()
                new["staging"].copy_(src)
            new["exp_avg"].copy_(self.exp_avg)
            new["exp_avg_sq"].copy_(self.exp_avg_sq)
            new["steps"].copy_(self.steps)
        self._install(placement, new)
        self.spare = None  # made for the old placement
        return 3 * self.shard_numel * 4

    # -- shard -----------------------------------------------------------------------------------------------
    def set_shard(self, lo: int, hi: int) -> None:
        """Cover ``[lo, hi)`` of the chunk with this rank's optimizer state (before the state exists).

        Raises:
            RuntimeError: the chunk already has optimizer state (use :meth:`reshard`).
            ValueError: not ``0 <= lo <= hi <= numel``.
        """
        if self.exp_avg is not None:
            raise RuntimeError(f"chunk {self.index} already has optimizer state; reshard() moves it")
        if not 0 <= lo <= hi <= self.numel:
            raise ValueError(f"shard [{lo}, {hi}) is not inside chunk {self.index} of {self.numel} elements")
        self.lo, self.hi = lo, hi

    def reshard(self, lo: int, hi: int, alloc: Allocator, *, master: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor) -> None:
        """Cover ``[lo, hi)`` with the given fp32 state (``[hi - lo]`` each), on the same side, same steps."""
        steps = self.steps.detach().to("cpu", copy=True) if self.steps is not None else None
        if not 0 <= lo <= hi <= self.numel:
            raise ValueError(f"shard [{lo}, {hi}) is not inside chunk {self.index} of {self.numel} elements")
        self.wait_h2d()
        self.lo, self.hi = lo, hi
        self.spare = None
        self.init_state(self.placement, alloc, master=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                        steps=steps)

    # -- the gradient buffer -------------------------------------------------------------------------------
    def alloc_grad(self, alloc: Allocator) -> torch.Tensor:
        """The gradient buffer, allocated (zeros, compute dtype, on the device) if there is none.

        Raises:
            torch.OutOfMemoryError (or the stand-in's): the device cannot hold it; nothing changed.
        """
        if self.frozen:
            raise RuntimeError(f"memsched internal error: chunk {self.index} holds frozen parameters: it has "
                               "no gradient buffer")
        if self.grad is None:
            self.grad = alloc.device_zeros(self.numel, self.dtype)
            self.grad_generation += 1
        return self.grad

    def free_grad(self) -> None:
        """Drop the gradient buffer (freed once no ``.grad`` view and no copy in flight holds it: on CUDA the
        D2H stream that reads it was recorded on it, :class:`memsched.devices.transfers.Streams`)."""
        self.grad = None

    def keep_grad_shard(self, shard: torch.Tensor) -> None:
        """ZeRO-2: ``shard`` (``[hi - lo]``, compute dtype, this rank's part of the averaged gradients)
        becomes the reduced shard (a copy of its own when it is a view of a larger receive buffer), or is
        added to an earlier micro-batch's."""
        with torch.no_grad():
            if self.grad_shard is None:
                own = shard.untyped_storage().nbytes() == shard.numel() * shard.element_size()
                self.grad_shard = shard if own else shard.clone()
            else:
                self.grad_shard.add_(shard)

    def drop_grad_shard(self) -> None:
        """ZeRO-2: the reduced shard goes (no parameter has a gradient any more)."""
        self.grad_shard = None

    def take_whole_grad(self, whole: torch.Tensor) -> None:
        """ZeRO-2: the whole averaged gradients ``whole`` (``[numel]``, gathered from the reduced shards of
        every rank) become the gradient buffer, and the reduced shard goes."""
        self.grad = whole
        self.grad_generation += 1
        self.grad_shard = None

    def grad_signature(self) -> tuple[Any, ...] | None:
        """What changes whenever the gradient buffer (or the reduced shard) is written or replaced:
        ``(allocation, version, shard version)``, or ``None`` without either."""
        if self.grad is None and self.grad_shard is None:
            return None
        return (self.grad_generation, None if self.grad is None else self.grad._version,
                None if self.grad_shard is None else (id(self.grad_shard), self.grad_shard._version))

    def reduced_grad(self) -> torch.Tensor:
        """The gradients of the shard the update reads (``[hi - lo]``): the reduced shard at ZeRO-2, else
        ``grad[lo:hi]``."""
        return self.grad_shard if self.grad_shard is not None else self.grad[self.lo:self.hi]

    # -- gradient readiness ---------------------------------------------------------------------------------
    def mark_grad_ready(self, param_id: int, task: int | None) -> bool:
        """Parameter ``param_id``'s gradient is complete in the backward pass ``task`` (autograd graph task
        id); True when that completes the chunk in this backward."""
        if task != self.ready_task:  # a new backward pass
            self.ready_task, self.ready = task, set()
        if param_id in self.ready:
            return False
        self.ready.add(param_id)
        return len(self.ready) == len(self.params)

    def set_ready(self, param_ids: set[int]) -> None:
        """The parameters ``param_ids`` are those whose gradients are complete in this backward (its end: the
        others got none)."""
        self.ready = set(param_ids)

    def reset_ready(self) -> None:
        self.ready, self.ready_task = set(), None

    # -- the compute buffer, and ZeRO-3's kept shard --------------------------------------------------------
    def set_data(self, data: torch.Tensor) -> None:
        """The compute buffer is ``data`` again (a fetch allocated it; the caller copies the values in)."""
        self.data = data

    def drop_data(self) -> None:
        """The compute buffer leaves the device (freed once nothing else holds it): the parameters are away
        (:mod:`memsched.runtime.param_fetch`; ZeRO-3, :mod:`memsched.distributed.sharded_params`)."""
        self.data = None

    def keep_param_shard(self, shard: torch.Tensor) -> None:
        """ZeRO-3: ``shard`` (``[hi - lo]``, compute dtype, on the device) holds this rank's part of the
        parameters while the compute buffer is away."""
        self.param_shard = shard

    def drop_param_shard(self) -> None:
        """ZeRO-3: the kept shard goes (the whole buffer is back, or the part lives in ``param_host``)."""
        self.param_shard = None

    def release(self) -> None:
        """Drop every tensor (the buffers are freed when nothing else holds them)."""
        self.data = self.grad = self.grad_shard = self.param_shard = None  # type: ignore[assignment]
        self.master = self.exp_avg = self.exp_avg_sq = self.steps = self.host_grad = self.staging = None
        self.grad_host = self.landing = None
        self.initial_master = None
        self.spare = None

    # -- H2D / D2H ------------------------------------------------------------------------------------------
    def start_d2h(self, streams: Any, after: Any = None, dst: torch.Tensor | None = None) -> int:
        """Copy the gradients of the shard to host memory after the work queued so far on the compute stream
        (or after the CUDA event ``after``) into ``dst`` (default: ``staging`` in the compute dtype under
        mixed precision, else ``host_grad``); returns the bytes."""
        if dst is None:
            dst = self.staging if self.staging is not None else self.host_grad
        self.wait_h2d()  # the previous step's H2D may still read ``staging``
        self.wait_d2h()
        src = self.reduced_grad()
        self.d2h_event = streams.copy_d2h(dst, src, after)
        return self.shard_numel * src.element_size()

    def start_h2d(self, streams: Any, src: torch.Tensor, after: Any = None, lo: int = 0) -> int:
        """Copy the updated shard ``src`` (host) into :meth:`param_part` (after the CUDA event ``after`` when
        given, else after the current stream's work), or ``src`` into its elements from ``lo`` (a piece);
        returns the bytes."""
        if self.data is None and self.param_shard is None:  # away on the host: its next fetch copies them
            return 0
        dst = self.param_part()  # ZeRO-3 with the chunk away: its kept shard
        if lo or src.numel() != dst.numel():
            dst = dst[lo:lo + src.numel()]
        self.h2d_event = streams.copy_h2d(dst, src, after)
        return self.shard_numel * dst.element_size()

    # -- H2D / D2H helpers ----------------------------------------------------------------------------------
    def wait_h2d(self) -> None:
        """Block the host until the chunk's last H2D copy is done (its buffers may then be rewritten)."""
        if self.h2d_event is not None:
            self.h2d_event.synchronize()
            self.h2d_event = None

    def forget_h2d(self) -> None:
        """The H2D copy in flight was waited for elsewhere, or its destination is gone: its event goes."""
        self.h2d_event = None

    def wait_d2h(self) -> None:
        """Block the host until the chunk's gradient D2H copy is done (``host_grad``/``staging`` hold it)."""
        if self.d2h_event is not None:
            self.d2h_event.synchronize()
            self.d2h_event = None
