"""Chunks: trainable parameters packed into flat buffers of one size, with their optimizer state.

Idea: PatrickStar's chunk-based memory management (arXiv 2108.05818, section 4) and ColossalAI Gemini's chunk
manager. Parameters are packed in first-use order into flat buffers of ONE chunk size (numel), separately per
param group; each parameter becomes a view into its chunk's flat compute buffer and its ``.grad`` a view into
the chunk's flat gradient buffer. The optimizer state of a chunk (fp32 master weights, ``exp_avg``,
``exp_avg_sq``, a step count) lives either on the device or in (pinned) host memory and moves as a whole.

This module has three layers:

* pure byte arithmetic (:func:`chunk_bytes`, the ONE place that says how many bytes a chunk weighs),
* pure layout (:func:`search_chunk_size`, :func:`build_layout`) from numels only, so it runs on meta tensors,
* runtime objects (:class:`Chunk`, :class:`ChunkStore`) that own the tensors.

Data parallelism: a chunk's optimizer state covers a shard ``[lo, hi)`` of the chunk (one rank: the whole
chunk). The store tells its :class:`memsched.parallel.DataParallel` when a chunk's gradients are ready (a
reduce-scatter goes there) and after its update (an all-gather goes there); re-packing
(:meth:`ChunkStore.repack`) assumes whole-chunk shards, so it runs between unsharding and sharding.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from memsched.parallel import DataParallel
from policies.types import DEVICE, HOST

DEFAULT_MIN_CHUNKS = 8
DEFAULT_MAX_CANDIDATES = 512
STEP_BYTES = 4  # the fp32 step count of a chunk lives next to its moments
# Elements (64 bytes of fp32: the widest CPU vector torch uses) at which ZeRO aligns parameters in chunks and
# shard boundaries: torch's CPU fused AdamW computes the last ``numel % vector width`` elements of each tensor
# on a scalar path with different rounding, so a parameter piece must start on a vector boundary.
SHARD_ALIGN = 16


# ---- bytes per parameter: the one place -------------------------------------------------------------------
def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ChunkBytes:
    """What one chunk weighs, bytes.

    Attributes:
        compute_bytes: the flat compute buffer on the device (compute dtype, whole chunk).
        grad_bytes: the flat gradient buffer on the device (compute dtype, whole chunk).
        device_state_bytes: optimizer state on the device when placed there: fp32 ``exp_avg`` + ``exp_avg_sq``
            of the shard, plus an fp32 master copy of the shard under mixed precision (in fp32 the compute
            buffer is the master), plus the fp32 step count.
        host_state_bytes: pinned host memory when placed on the host: fp32 master, ``exp_avg``, ``exp_avg_sq``
            and gradient buffer of the shard, plus a compute-dtype staging buffer for the H2D copy under mixed
            precision, plus the fp32 step count.
    """

    compute_bytes: int
    grad_bytes: int
    device_state_bytes: int
    host_state_bytes: int

    @property
    def resident_bytes(self) -> int:
        """Bytes that stay on the device whatever the placement (compute + gradient buffers)."""
        return self.compute_bytes + self.grad_bytes


def chunk_bytes(chunk_numel: int, *, compute_dtype: torch.dtype = torch.float32,
                shard_numel: int | None = None, master_weights: bool | None = None) -> ChunkBytes:
    """Bytes of one chunk of ``chunk_numel`` elements whose optimizer state covers ``shard_numel`` of them.

    Mixed precision (``master_weights``; default: the compute dtype is not float32) adds an fp32 master copy
    on the device and a compute-dtype H2D staging buffer on the host. Used by :mod:`memsched.planning` and
    checked against the real tensors of :class:`Chunk` in the tests.
    """
    shard = chunk_numel if shard_numel is None else shard_numel
    cb = dtype_bytes(compute_dtype)
    mixed = compute_dtype != torch.float32 if master_weights is None else master_weights
    return ChunkBytes(
        compute_bytes=chunk_numel * cb,
        grad_bytes=chunk_numel * cb,
        device_state_bytes=shard * 4 * (3 if mixed else 2) + STEP_BYTES,
        host_state_bytes=shard * 4 * 4 + (shard * cb if mixed else 0) + STEP_BYTES,
    )


# ---- layout (pure) ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """Where one parameter lives: ``group`` and ``index`` name it (position in its group's input sequence);
    ``chunk`` is the chunk index, ``offset``/``numel`` its range in the chunk's flat buffers (elements)."""

    group: int
    index: int
    chunk: int
    offset: int
    numel: int


@dataclass(frozen=True)
class ChunkLayout:
    """A packing of parameters into chunks of one size.

    Attributes:
        chunk_numel: elements per chunk (capacity, including the padding at the end).
        chunk_groups: param group of each chunk.
        chunks: the slots of each chunk, in packing order.
    """

    chunk_numel: int
    chunk_groups: tuple[int, ...]
    chunks: tuple[tuple[Slot, ...], ...]

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def used_numel(self, chunk: int) -> int:
        return sum(s.numel for s in self.chunks[chunk])

    @property
    def total_numel(self) -> int:
        """Elements of all chunks, padding included."""
        return self.chunk_numel * self.n_chunks

    @property
    def waste_numel(self) -> int:
        """Padding elements summed over chunks."""
        return self.total_numel - sum(self.used_numel(i) for i in range(self.n_chunks))

    def slots(self) -> dict[tuple[int, int], Slot]:
        """``(group, index) -> Slot`` for every parameter."""
        return {(s.group, s.index): s for c in self.chunks for s in c}


def _as_groups(numels: Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    groups = [list(g) for g in numels] if numels and not isinstance(numels[0], int) else [list(numels)]  # type: ignore[arg-type]
    for gi, g in enumerate(groups):
        for i, n in enumerate(g):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"parameter numels must be positive integers; group {gi} item {i} is {n!r}")
    if not any(groups):
        raise ValueError("no parameters to pack: every group is empty")
    return groups


def _aligned(offset: int, align: int) -> int:
    return -(-offset // align) * align


def _greedy_waste(groups: list[list[int]], c: int, align: int = 1) -> int:
    """Padding elements of the greedy packing into chunks of ``c`` elements (alignment gaps included)."""
    chunks = total = 0
    for g in groups:
        used = 0
        for n in g:
            start = _aligned(used, align)
            if start + n > c and used:
                chunks += 1
                start = 0
            used = start + n
            total += n
        if g:
            chunks += 1
    return chunks * c - total


def search_chunk_size(numels: Sequence[int] | Sequence[Sequence[int]], *,
                      min_chunks: int = DEFAULT_MIN_CHUNKS,
                      max_candidates: int = DEFAULT_MAX_CANDIDATES, align: int = 1) -> int:
    """Choose the chunk size (elements) that minimises padding, PatrickStar-style (arXiv 2108.05818, 4.1).

    Method: parameters are packed greedily in the given order (a new chunk starts when the next parameter does
    not fit; groups are packed separately), so the wasted elements of a candidate size ``c`` are computed
    exactly in O(n). Candidates lie on a grid over ``[lo, hi]`` with ``lo`` = the largest parameter (a
    parameter is never split) and ``hi = max(lo, ceil(total / min_chunks))`` (a lower bound of ``min_chunks``
    chunks, so that placement has granularity when the model allows it). The grid step is
    ``ceil((hi - lo) / max_candidates)``, so the cost is O(n * max_candidates) and the search is exact when
    ``hi - lo <= max_candidates``. Ties go to the smaller size.

    Args:
        numels: parameter sizes (elements) in packing order, one flat sequence or one sequence per group.
        align: every parameter starts at a multiple of ``align`` elements in its chunk (see
            :func:`build_layout`).

    Raises:
        ValueError: a size is not a positive integer, there are no parameters, or ``min_chunks`` /
            ``max_candidates`` is < 1.
    """
    if min_chunks < 1 or max_candidates < 1:
        raise ValueError(f"min_chunks and max_candidates must be >= 1, got {min_chunks}, {max_candidates}")
    groups = _as_groups(numels)
    lo = max(n for g in groups for n in g)
    total = sum(n for g in groups for n in g)
    hi = max(lo, math.ceil(total / min_chunks))
    step = max(1, math.ceil((hi - lo) / max_candidates))
    candidates = list(range(lo, hi + 1, step))
    if candidates[-1] != hi:
        candidates.append(hi)
    return min(candidates, key=lambda c: (_greedy_waste(groups, c, align), c))


def build_layout(numels: Sequence[int] | Sequence[Sequence[int]], *, chunk_numel: int | None = None,
                 min_chunks: int = DEFAULT_MIN_CHUNKS, align: int = 1) -> ChunkLayout:
    """Pack parameters (given by their numels, in order, per group) greedily into chunks of one size.

    Args:
        numels: parameter sizes (elements), one flat sequence or one sequence per param group.
        chunk_numel: the chunk size (elements); ``None`` = :func:`search_chunk_size`.
        align: every parameter starts at a multiple of ``align`` elements (ZeRO uses
            :data:`SHARD_ALIGN`, so that shard boundaries cut parameters where torch's CPU AdamW kernel
            would also start a vector: bit-exact updates of parameter pieces).

    Raises:
        ValueError: bad numels, or ``chunk_numel`` smaller than the largest parameter (names both).
    """
    groups = _as_groups(numels)
    largest = max(n for g in groups for n in g)
    if chunk_numel is None:
        chunk_numel = search_chunk_size(groups, min_chunks=min_chunks, align=align)
    elif isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < largest:
        raise ValueError(f"chunk_numel must be an integer >= the largest parameter ({largest} elements), "
                         f"got {chunk_numel!r}")
    chunks: list[tuple[Slot, ...]] = []
    chunk_groups: list[int] = []
    for gi, g in enumerate(groups):
        cur: list[Slot] = []
        used = 0
        for i, n in enumerate(g):
            start = _aligned(used, align)
            if start + n > chunk_numel and cur:
                chunks.append(tuple(cur))
                chunk_groups.append(gi)
                cur, start = [], 0
            cur.append(Slot(gi, i, len(chunks), start, n))
            used = start + n
        if cur:
            chunks.append(tuple(cur))
            chunk_groups.append(gi)
    return ChunkLayout(chunk_numel, tuple(chunk_groups), tuple(chunks))


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one rank's piece of a chunk.

    Attributes:
        param_start: first element of the part, counted in the flattened parameter.
        chunk_start: the same element's index in the chunk's flat buffers.
        shard_start: the same element's index in the rank's piece (``chunk_start - lo``).
        numel: elements of the part (> 0).
    """

    param_start: int
    chunk_start: int
    shard_start: int
    numel: int


def param_pieces(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> list[Piece | None]:
    """For each parameter ``(offset, numel)`` of a chunk, its intersection with the piece ``[lo, hi)``
    (``None`` when it has none). A parameter may straddle two ranks' pieces; it then has a part on each.

    Raises:
        ValueError: ``lo > hi`` or a range has a negative offset / numel < 1.
    """
    if lo > hi or lo < 0:
        raise ValueError(f"bad piece [{lo}, {hi})")
    out: list[Piece | None] = []
    for off, n in ranges:
        if off < 0 or n < 1:
            raise ValueError(f"bad parameter range (offset {off}, numel {n})")
        a, b = max(off, lo), min(off + n, hi)
        out.append(Piece(a - off, a, a - lo, b - a) if a < b else None)
    return out


def ordered_groups(groups: Sequence[Sequence[torch.Tensor]], order: Sequence[torch.Tensor] | None,
                   ) -> list[list[torch.Tensor]]:
    """Each group's parameters sorted by their position in ``order`` (first-use order); parameters absent from
    ``order`` keep their relative order after the others. ``None`` keeps the groups as they are."""
    if order is None:
        return [list(g) for g in groups]
    rank = {id(p): i for i, p in enumerate(order)}
    base = len(rank)
    out = []
    for g in groups:
        pos = {id(p): i for i, p in enumerate(g)}
        out.append(sorted(g, key=lambda p: (rank.get(id(p), base), pos[id(p)])))
    return out


# ---- runtime ----------------------------------------------------------------------------------------------
def _graph_task_id() -> int | None:
    """The id of the autograd graph task (backward pass) running now, where this torch exposes it."""
    get = getattr(torch._C, "_current_graph_task_id", None)
    return get() if get is not None else None


class Allocator:
    """Where chunk tensors come from: the compute device, and host memory (pinned when CUDA is present).

    ``host_context`` wraps host allocations (the stand-in device pauses its accounting there, so host-placed
    buffers are not counted as device memory).
    """

    def __init__(self, device: torch.device, *, pin: bool | None = None,
                 host_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        self.device = device
        # Pinning needs a CUDA runtime; CPU-only torch cannot pin, so skip it cleanly.
        self.pin = (device.type == "cuda" and torch.cuda.is_available()) if pin is None else pin
        self.host_context = host_context or contextlib.nullcontext

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def device_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self.host_context():
            return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin)

    def host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = self.host_empty(numel, dtype)
        with self.host_context():
            t.zero_()
        return t

    def context(self, placement: str) -> contextlib.AbstractContextManager:
        """Where work on ``placement``'s tensors runs: host work inside ``host_context``."""
        return contextlib.nullcontext() if placement == DEVICE else self.host_context()

    def arena(self, placement: str, parts: Sequence[tuple[str, torch.dtype, int]]) -> dict[str, torch.Tensor]:
        """One allocation holding several flat tensors (``(name, dtype, numel)``; a numel of 0 gives a 0-d
        scalar of one element), returned as views by name.

        One allocation per chunk, not one per tensor: PyTorch's pinned-memory cache rounds every allocation up
        to a power of two, so four or five separate pinned tensors per chunk could cost up to twice the bytes
        the plan counts (:func:`pinned_bytes` gives the rounded size of the one arena).
        """
        sizes = [max(n, 1) * dtype_bytes(dt) for _, dt, n in parts]
        total = sum(sizes)
        if placement == DEVICE:
            raw = torch.empty(total, dtype=torch.uint8, device=self.device)
        else:
            with self.host_context():
                raw = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
        out, off = {}, 0
        with self.context(placement):
            for (name, dt, n), size in zip(parts, sizes, strict=True):
                # Parts are ordered by decreasing element size, so every view is aligned to its dtype.
                v = raw[off:off + size].view(dt)
                out[name] = v.reshape(()) if n == 0 else v
                off += size
        return out


def pinned_bytes(nbytes: int, *, pinned: bool = True) -> int:
    """Host bytes an allocation of ``nbytes`` really takes: PyTorch's caching host allocator rounds pinned
    allocations up to the next power of two (unpinned ones are taken as they are), bytes."""
    if not pinned or nbytes <= 0:
        return max(0, nbytes)
    return 1 << (nbytes - 1).bit_length()


class Chunk:
    """One chunk: flat compute and gradient buffers on the device, optimizer state of the shard ``[lo, hi)``.

    Tensors (all 1-D):
        ``data``: ``[numel]`` compute dtype, device: the parameters are views into it.
        ``grad``: ``[numel]`` compute dtype, device: the parameters' ``.grad`` are views into it.
        ``master``: ``[hi - lo]`` fp32 on the state's side; ``None`` in fp32 on the device (``data`` is
            the master).
        ``exp_avg``, ``exp_avg_sq``: ``[hi - lo]`` fp32, on the state's side.
        ``step``: fp32 scalar, on the state's side (one step count per chunk).
        ``host_grad``: ``[hi - lo]`` fp32 host buffer the CPU update reads its gradients from (host placement
            only; in fp32 the D2H copy lands there directly).
        ``staging``: ``[hi - lo]`` compute-dtype host buffer (host placement, mixed precision): the D2H copy
        of
            the gradients lands there in the compute dtype and is upcast on the CPU (a D2H that converts dtype
            would first make an fp32 temporary on the device), and the updated parameters are cast there on
            the CPU for the H2D copy.

    The optimizer state of one placement is one allocation (:meth:`Allocator.arena`).
    """

    def __init__(self, index: int, group: int, numel: int, params: list[torch.nn.Parameter],
                 ranges: list[tuple[int, int]], data: torch.Tensor, grad: torch.Tensor) -> None:
        self.index = index
        self.group = group
        self.numel = numel
        self.params = params
        self.ranges = ranges  # (offset, numel) per parameter
        self.data = data
        self.grad = grad
        self.lo, self.hi = 0, numel
        self.placement: str | None = None
        self.master: torch.Tensor | None = None
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.step: torch.Tensor | None = None
        self.host_grad: torch.Tensor | None = None
        self.staging: torch.Tensor | None = None
        # Parameters whose gradient is complete in the backward pass ``ready_task`` (autograd graph task id):
        # readiness is per backward pass, so accumulation with a parameter unused in one micro-batch never
        # declares a chunk ready while that backward still writes into it.
        self.ready: set[int] = set()
        self.ready_task: int | None = None
        self.d2h_event = None  # CUDA event of the in-flight D2H copy of the gradients (at step)
        self.h2d_event = None  # CUDA event of the in-flight H2D copy of the updated parameters
        self.initial_master: torch.Tensor | None = None  # fp32 host values before the first init_state

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def mixed(self) -> bool:
        return self.data.dtype != torch.float32

    @property
    def shard_numel(self) -> int:
        return self.hi - self.lo

    def master_view(self) -> torch.Tensor:
        """The fp32 master of the shard wherever it lives (``data[lo:hi]`` in fp32 on the device)."""
        return self.master if self.master is not None else self.data[self.lo:self.hi]

    def state_tensors(self) -> list[torch.Tensor]:
        ts = (self.master, self.exp_avg, self.exp_avg_sq, self.step, self.host_grad, self.staging)
        return [t for t in ts if t is not None]

    def state_nbytes(self) -> int:
        """Bytes held by the optimizer state (incl. host gradient and staging buffers), bytes."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    # -- placement: whole-chunk copies; everything new is allocated before anything is swapped --------------
    def init_state(self, placement: str, alloc: Allocator, *, master: torch.Tensor | None = None,
                   exp_avg: torch.Tensor | None = None, exp_avg_sq: torch.Tensor | None = None,
                   step: float = 0.0) -> None:
        """Allocate the optimizer state at ``placement`` (``DEVICE``/``HOST``); zeros unless given (fp32
        ``[hi-lo]``). Under mixed precision the master starts from the full-precision parameter values."""
        new = self._alloc_state(placement, alloc)
        if master is None and self.initial_master is not None:
            master = self.initial_master[self.lo:self.hi]
        self.initial_master = None
        src_master = master if master is not None else self.data[self.lo:self.hi]
        ctx = alloc.host_context() if placement == HOST else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            if new["master"] is not None:
                new["master"].copy_(src_master)
            elif master is not None:
                self.data[self.lo:self.hi].copy_(master)
            for k, src in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                if src is None:
                    new[k].zero_()
                else:
                    new[k].copy_(src)
            new["step"].fill_(step)
        self._install(placement, new)

    def _alloc_state(self, placement: str, alloc: Allocator) -> dict[str, torch.Tensor | None]:
        n = self.shard_numel
        host = placement == HOST
        f32 = torch.float32
        parts = [("exp_avg", f32, n), ("exp_avg_sq", f32, n)]
        if host or self.mixed:
            parts.append(("master", f32, n))
        if host:
            parts.append(("host_grad", f32, n))
        parts.append(("step", f32, 0))
        if host and self.mixed:
            parts.append(("staging", self.compute_dtype, n))
        views = alloc.arena(placement, parts)
        return {k: views.get(k) for k in ("master", "exp_avg", "exp_avg_sq", "step", "host_grad", "staging")}

    def _install(self, placement: str, new: dict[str, torch.Tensor | None]) -> None:
        self.placement = placement
        self.master = new["master"]
        self.exp_avg = new["exp_avg"]
        self.exp_avg_sq = new["exp_avg_sq"]
        self.step = new["step"]
        self.host_grad = new["host_grad"]
        self.staging = new["staging"]
        self.d2h_event = None

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
        new = self._alloc_state(placement, alloc)
        ctx = alloc.host_context() if placement == HOST else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            src_master = self.master_view()
            if new["master"] is not None:
                new["master"].copy_(src_master)
            else:  # fp32 to the device: the compute buffer becomes the master (it already holds its value)
                self.data[self.lo:self.hi].copy_(src_master)
            new["exp_avg"].copy_(self.exp_avg)
            new["exp_avg_sq"].copy_(self.exp_avg_sq)
            new["step"].copy_(self.step)
        self._install(placement, new)
        return 3 * self.shard_numel * 4

    # -- H2D / D2H helpers --------------------------------------------------------------------------------
    def wait_h2d(self) -> None:
        """Block the host until the chunk's last H2D copy is done (its buffers may then be rewritten)."""
        if self.h2d_event is not None:
            self.h2d_event.synchronize()
            self.h2d_event = None

    def wait_d2h(self) -> None:
        """Block the host until the chunk's gradient D2H copy is done (``host_grad``/``staging`` hold it)."""
        if self.d2h_event is not None:
            self.d2h_event.synchronize()
            self.d2h_event = None


class ChunkStore:
    """The chunks of a model: builds them from param groups and a layout, binds parameters as views, counts
    gradient readiness with post-accumulate-grad hooks and re-packs on request.

    Args:
        groups: trainable parameters per param group (tied parameters once; no frozen ones).
        alloc: where buffers come from.
        compute_dtype: dtype of the compute and gradient buffers (fp32 masters are kept when it is not fp32).
        chunk_numel: chunk size override (elements); ``None`` = searched.
        on_grads_ready: ``f(chunk)`` called when all of a chunk's gradients are complete in a backward.
        dp: the data parallelism (:class:`memsched.parallel.DataParallel`; default one rank): told when a
            chunk's gradients are ready, after its update and before gradients are zeroed; its ``align``
            aligns the parameters in the chunks (:func:`build_layout`).

    Raises:
        ValueError: a parameter is on the meta device or the groups are empty.
    """

    def __init__(self, groups: Sequence[Sequence[torch.nn.Parameter]], alloc: Allocator, *,
                 compute_dtype: torch.dtype = torch.float32, chunk_numel: int | None = None,
                 on_grads_ready: Callable[[Chunk], None] | None = None,
                 dp: DataParallel | None = None) -> None:
        self.groups = [list(g) for g in groups]
        self.alloc = alloc
        self.compute_dtype = compute_dtype
        self.dp = dp if dp is not None else DataParallel()
        self.on_grads_ready_cb = on_grads_ready  # an observer (tests, reports); data parallelism is ``dp``
        self.grad_events = 0  # gradients accumulated by backward so far (any parameter)
        for gi, g in enumerate(self.groups):
            for p in g:
                if p.device.type == "meta":
                    raise ValueError(f"parameter of shape {tuple(p.shape)} in group {gi} is on the meta "
                                     "device: materialise the model (e.g. model.to_empty(device=...)) "
                                     "before attach")
        self.align = self.dp.align
        self.layout = build_layout([[p.numel() for p in g] for g in self.groups], chunk_numel=chunk_numel,
                                   align=self.align)
        self.chunks: list[Chunk] = []
        self.param_chunk: dict[int, Chunk] = {}
        self._hooks: list = []
        self._build(self.layout, self.groups)
        self.dp.install(self)
        for g in self.groups:
            for p in g:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook))

    # -- building / re-packing ---------------------------------------------------------------------------
    def _build(self, layout: ChunkLayout, groups: list[list[torch.nn.Parameter]], *,
               keep_initial: bool = True, staged: dict[int, tuple[torch.Tensor, ...]] | None = None) -> None:
        """Allocate chunk buffers for ``layout`` one chunk at a time, copy parameters (and gradients) in and
        bind them as views at once, so the storage they had is freed before the next chunk is allocated (a
        model already on the device peaks near its final size plus one chunk, not at three times its
        parameters).

        On failure (e.g. out of memory) every parameter bound so far gets standalone tensors back, with its
        values (its ``staged`` host copies when given, else fresh copies), and the error is re-raised: the
        model is as it was, only its storages are new.
        """
        new_chunks: list[Chunk] = []
        try:
            with torch.no_grad():
                for ci, slots in enumerate(layout.chunks):
                    new_chunks.append(self._build_chunk(ci, layout, slots, groups, keep_initial))
        except BaseException:
            if staged is not None:
                self._point_at(staged, [p for c in new_chunks for p in c.params])
            else:
                self._unbind(new_chunks)
            raise
        self.chunks = new_chunks
        self.layout = layout
        self.param_chunk = {id(p): c for c in new_chunks for p in c.params}
        self.param_range = {id(p): r for c in new_chunks for p, r in zip(c.params, c.ranges, strict=True)}

    def _build_chunk(self, ci: int, layout: ChunkLayout, slots: Sequence[Slot],
                     groups: list[list[torch.nn.Parameter]], keep_initial: bool) -> Chunk:
        data = self.alloc.device_zeros(layout.chunk_numel, self.compute_dtype)
        grad = self.alloc.device_zeros(layout.chunk_numel, self.compute_dtype)
        params = [groups[s.group][s.index] for s in slots]
        ranges = [(s.offset, s.numel) for s in slots]
        # Mixed precision: the fp32 master starts from the parameters' full-precision values, not from their
        # compute-dtype rounding (kept on the host until the optimizer state is made).
        initial = None
        if self.compute_dtype != torch.float32 and keep_initial:
            initial = self.alloc.host_zeros(layout.chunk_numel, torch.float32)
        for p, (off, n) in zip(params, ranges, strict=True):
            src = p.data
            data[off:off + n].copy_(src.reshape(-1))
            if initial is not None:
                with self.alloc.host_context():
                    initial[off:off + n].copy_(src.reshape(-1))
            if p.grad is not None and p.grad.shape == p.shape:
                grad[off:off + n].copy_(p.grad.reshape(-1))
        for p, (off, n) in zip(params, ranges, strict=True):
            p.data = data[off:off + n].view(p.shape)
            p.grad = grad[off:off + n].view(p.shape)
        c = Chunk(ci, layout.chunk_groups[ci], layout.chunk_numel, params, ranges, data, grad)
        c.initial_master = initial
        return c

    def _unbind(self, chunks: Sequence[Chunk]) -> None:
        """Give the parameters of ``chunks`` standalone copies of their values (newest chunk first, so each
        chunk's buffers can be freed before the next chunk's copies are made)."""
        with torch.no_grad():
            for c in reversed(chunks):
                for p in c.params:
                    p.data = p.data.clone()
                    p.grad = p.grad.clone() if p.grad is not None else None
                c.data = c.grad = None  # type: ignore[assignment]

    def params(self) -> Iterator[torch.nn.Parameter]:
        for g in self.groups:
            yield from g

    def repack(self, order: Sequence[torch.nn.Parameter], *, chunk_numel: int | None = None) -> bool:
        """Re-pack the chunks so parameters follow ``order`` (first-use order; parameters not in it keep their
        relative order after those that are), moving each parameter's optimizer state with it (bit-exact).

        Returns ``False`` (and changes nothing) when the layout would be the same, or when parameters with
        different step counts would share a chunk (one step count per chunk).

        Raises:
            torch.OutOfMemoryError (or the stand-in's): the new chunks do not fit; the old packing is restored
                first, with every value and optimizer state as it was.
        """
        new_groups = ordered_groups(self.groups, order)
        layout = build_layout([[p.numel() for p in g] for g in new_groups], chunk_numel=chunk_numel,
                              align=self.align)
        same = (layout.chunk_numel == self.layout.chunk_numel
                and all(a is b for ga, gb in zip(new_groups, self.groups, strict=True)
                        for a, b in zip(ga, gb, strict=True)))
        if same:
            return False
        # One step count per chunk: refuse a packing that would merge different counts.
        steps = {id(p): float(self.param_chunk[id(p)].step) for p in self.params()}
        for slots in layout.chunks:
            if len({steps[id(new_groups[s.group][s.index])] for s in slots}) > 1:
                return False
        # Stage everything through host memory and drop every reference to the old chunks before allocating
        # the new ones, so re-packing needs the device memory of the new chunks only (built one at a time).
        staged: dict[int, tuple[torch.Tensor, ...]] = {}
        side: dict[int, str | None] = {}
        old_layout, old_groups = self.layout, self.groups
        with torch.no_grad(), self.alloc.host_context():
            for c in self.chunks:
                c.wait_h2d()
                c.wait_d2h()
                tensors = (c.data, c.grad, c.master_view(), c.exp_avg, c.exp_avg_sq)
                flat = [t.to("cpu", copy=True) for t in tensors]
                for p, (off, n) in zip(c.params, c.ranges, strict=True):
                    staged[id(p)] = tuple(t[off:off + n] for t in flat)
                    side[id(p)] = c.placement
        self._release(staged)
        try:
            self._build(layout, new_groups, keep_initial=False, staged=staged)
            self.groups = new_groups
            self._restore_state(staged, side, steps)
        except BaseException:
            # Put the old packing back from the staged copies (it fitted before), then re-raise.
            self._release(staged)
            self._build(old_layout, old_groups, keep_initial=False, staged=staged)
            self.groups = old_groups
            self._restore_state(staged, side, steps)
            raise
        return True

    @staticmethod
    def _point_at(staged: dict[int, tuple[torch.Tensor, ...]], params: Iterable[torch.nn.Parameter]) -> None:
        for p in params:
            data, grad = staged[id(p)][:2]
            p.data = data.view(p.shape)
            p.grad = grad.view(p.shape)

    def _release(self, staged: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """Point every parameter at its staged host copy and forget the chunks (their buffers are freed)."""
        self._point_at(staged, self.params())
        for c in self.chunks:
            c.data = c.grad = None  # type: ignore[assignment]
            c.master = c.exp_avg = c.exp_avg_sq = c.step = c.host_grad = c.staging = None
        self.chunks, self.param_chunk, self.param_range = [], {}, {}

    def _restore_state(self, staged: dict[int, tuple[torch.Tensor, ...]], side: dict[int, str | None],
                       steps: dict[int, float]) -> None:
        """Optimizer state: each parameter's slice goes into its chunk, on the old side when the whole chunk
        came from one side, else on the host (the plan moves it afterwards)."""
        with torch.no_grad():
            for c in self.chunks:
                sides = {side[id(p)] for p in c.params}
                where = DEVICE if sides == {DEVICE} else HOST
                with self.alloc.host_context():
                    master, exp_avg, exp_avg_sq = (torch.zeros(c.numel) for _ in range(3))  # fp32
                    for p, (off, n) in zip(c.params, c.ranges, strict=True):
                        _, _, m, ea, eas = staged[id(p)]
                        master[off:off + n].copy_(m)
                        exp_avg[off:off + n].copy_(ea)
                        exp_avg_sq[off:off + n].copy_(eas)
                c.init_state(where, self.alloc, master=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                             step=steps[id(c.params[0])])

    # -- gradients -----------------------------------------------------------------------------------------
    def _grad_hook(self, p: torch.nn.Parameter) -> None:
        c = self.param_chunk.get(id(p))
        if c is None:
            return
        self.rebind_grad(p, c)
        self.grad_events += 1
        task = _graph_task_id()
        if task != c.ready_task:  # a new backward pass
            c.ready_task, c.ready = task, set()
        if id(p) in c.ready:
            return
        c.ready.add(id(p))
        if len(c.ready) == len(c.params):
            self.on_grads_ready(c)

    def grad_view(self, p: torch.nn.Parameter, c: Chunk | None = None) -> torch.Tensor:
        c = c or self.param_chunk[id(p)]
        off, n = self.param_range[id(p)]
        return c.grad[off:off + n].view(p.shape)

    def rebind_grad(self, p: torch.nn.Parameter, c: Chunk | None = None) -> None:
        """Put ``p.grad`` back into its chunk view if autograd or the user produced a separate tensor."""
        g = p.grad
        view = self.grad_view(p, c)
        if g is None:
            return
        if g.data_ptr() != view.data_ptr() or g.shape != view.shape or g.dtype != view.dtype:
            with torch.no_grad():
                view.copy_(g)
            p.grad = view

    def on_grads_ready(self, chunk: Chunk) -> None:
        """All of ``chunk``'s gradients are complete in this backward (a reduce-scatter goes there)."""
        self.dp.grads_ready(chunk)
        if self.on_grads_ready_cb is not None:
            self.on_grads_ready_cb(chunk)

    def after_update(self, chunk: Chunk) -> None:
        """``chunk``'s shard was updated and copied into ``data[lo:hi]`` (an all-gather goes there)."""
        self.dp.after_update(chunk)

    def zero_grad(self) -> None:
        """Zero the flat gradient buffers, keep the views, reset readiness."""
        self.dp.before_zero_grad()  # pending gradient reductions finish first
        with torch.no_grad():
            for c in self.chunks:
                c.grad.zero_()
                c.ready, c.ready_task = set(), None
            for p in self.params():
                c = self.param_chunk[id(p)]
                view = self.grad_view(p, c)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view

    def close(self) -> None:
        """Remove the gradient hooks (parameters stay views into the chunks)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
