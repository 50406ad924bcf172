"""Packing parameters into chunks, from their numels only (runs on meta and fake tensors).

PatrickStar's chunk-size search (arXiv 2108.05818, section 4.1): greedy packing in first-use order, the size
that wastes the fewest elements. Also the shard arithmetic every rank uses: which part of each parameter falls
in a shard ``[lo, hi)`` of a chunk.

[Note: exact chunks]
PatrickStar and Gemini give every chunk the searched size, so each chunk pays for the room its parameters
leave free: up to 69 % more memory than the parameters, on the device, in pinned host memory and over the link
(issue 31). With one rank, memsched's chunks are *exact*: the search picks the size parameters are packed to,
and each chunk is then as long as what it holds (rounded up to the parameters' alignment ``align``, so that
every buffer of the chunk ends, and the next one in its allocation starts, aligned too). A parameter larger
than the searched size (an embedding much larger than a block) gets a chunk of its own, so the size can follow
the model's eighth (``min_chunks``) rather than its largest tensor. Chunks of different lengths cost nothing
at runtime (each buffer is allocated for its own chunk); the plan counts each chunk's own bytes. With more
ranks every chunk keeps the searched size: a rank owns the same share ``[r * s, (r + 1) * s)`` of every chunk
(:mod:`memsched.distributed.layout`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

DEFAULT_MIN_CHUNKS = 8
DEFAULT_MAX_CANDIDATES = 512


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
    """A packing of parameters into chunks.

    Attributes:
        chunk_numel: the size parameters are packed to (elements): every chunk's capacity when the chunks
            are uniform; with exact chunks the longest a chunk of several parameters may be (a parameter
            larger than it has a chunk of its own).
        chunk_groups: param group of each chunk.
        chunks: the slots of each chunk, in packing order.
        numels: each chunk's capacity (elements, padding included); empty = ``chunk_numel`` for every chunk.
    """

    chunk_numel: int
    chunk_groups: tuple[int, ...]
    chunks: tuple[tuple[Slot, ...], ...]
    numels: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.numels:
            object.__setattr__(self, "numels", (self.chunk_numel,) * len(self.chunks))
        elif len(self.numels) != len(self.chunks):
            raise ValueError(f"{len(self.numels)} chunk sizes for {len(self.chunks)} chunks")

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    @property
    def uniform(self) -> bool:
        """Whether every chunk has ``chunk_numel`` elements."""
        return all(n == self.chunk_numel for n in self.numels)

    def used_numel(self, chunk: int) -> int:
        return sum(s.numel for s in self.chunks[chunk])

    @property
    def total_numel(self) -> int:
        """Elements of all chunks, padding included."""
        return sum(self.numels)

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
    """Padding elements of the greedy packing into chunks of ``c`` elements (alignment gaps included); a
    parameter larger than ``c`` has a chunk of its own, without padding ([Note: exact chunks])."""
    chunks = total = 0
    for g in groups:
        used = 0
        for n in g:
            if n > c:
                continue
            start = _aligned(used, align)
            if start + n > c and used:
                chunks += 1
                start = 0
            used = start + n
            total += n
        if used:
            chunks += 1
    return chunks * c - total


def search_chunk_size(numels: Sequence[int] | Sequence[Sequence[int]], *,
                      min_chunks: int = DEFAULT_MIN_CHUNKS,
                      max_candidates: int = DEFAULT_MAX_CANDIDATES, align: int = 1,
                      exact: bool = False) -> int:
    """Choose the chunk size (elements) that minimises padding, PatrickStar-style (arXiv 2108.05818, 4.1).

    Method: parameters are packed greedily in the given order (a new chunk starts when the next parameter does
    not fit; groups are packed separately), so the wasted elements of a candidate size ``c`` are computed
    exactly in O(n). Candidates lie on a grid over ``[lo, hi]`` with ``lo`` = the largest parameter (a
    parameter is never split) and ``hi = max(lo, ceil(total / min_chunks))`` (a lower bound of ``min_chunks``
    chunks, so that placement has granularity when the model allows it). The grid step is
    ``ceil((hi - lo) / max_candidates)``, so the cost is O(n * max_candidates) and the search is exact when
    ``hi - lo <= max_candidates``. Ties go to the smaller size.

    ``exact`` (chunks as long as what they hold, [Note: exact chunks]): when the largest parameter is larger
    than ``ceil(total / min_chunks)``, the candidates lie in ``[ceil(total / (4 * min_chunks)),
    ceil(total / min_chunks)]`` instead and every parameter larger than a candidate has a chunk of its own
    (no padding); ties then go to the larger size (fewer chunks). The padding of the uniform packing measures
    how unevenly the parameters fill their chunks.

    Args:
        numels: parameter sizes (elements) in packing order, one flat sequence or one sequence per group.
        align: every parameter starts at a multiple of ``align`` elements in its chunk (see
            :func:`build_layout`).
        exact: the size is for exact chunks (:func:`build_layout`'s ``exact``).

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
    own = exact and lo > math.ceil(total / min_chunks)
    if own:  # the largest parameters get chunks of their own: the size follows the model, not them
        hi = math.ceil(total / min_chunks)
        lo = max(1, math.ceil(total / (4 * min_chunks)))
    step = max(1, math.ceil((hi - lo) / max_candidates))
    candidates = list(range(lo, hi + 1, step))
    if candidates[-1] != hi:
        candidates.append(hi)
    return min(candidates, key=lambda c: (_greedy_waste(groups, c, align), -c if own else c))


def build_layout(numels: Sequence[int] | Sequence[Sequence[int]], *, chunk_numel: int | None = None,
                 min_chunks: int = DEFAULT_MIN_CHUNKS, align: int = 1, exact: bool = False) -> ChunkLayout:
    """Pack parameters (given by their numels, in order, per group) greedily into chunks.

    Args:
        numels: parameter sizes (elements), one flat sequence or one sequence per param group.
        chunk_numel: the chunk size (elements); ``None`` = :func:`search_chunk_size`.
        align: every parameter starts at a multiple of ``align`` elements (memsched packs with
            :data:`memsched.chunks.PARAM_ALIGN`: [Note: parameter alignment in chunks]).
        exact: each chunk is as long as what it holds (rounded up to ``align``), and a searched size may be
            below the largest parameter, which then has a chunk of its own ([Note: exact chunks]; one rank).
            Otherwise every chunk has ``chunk_numel`` elements.

    Raises:
        ValueError: bad numels, or ``chunk_numel`` smaller than the largest parameter without ``exact``
            (names both).
    """
    groups = _as_groups(numels)
    largest = max(n for g in groups for n in g)
    if chunk_numel is None:
        chunk_numel = search_chunk_size(groups, min_chunks=min_chunks, align=align, exact=exact)
    elif isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1 or (
            chunk_numel < largest and not exact):
        raise ValueError(f"chunk_numel must be an integer >= the largest parameter ({largest} elements), "
                         f"got {chunk_numel!r}")
    # Each chunk in the order of its first parameter (first use): a chunk of its own for a large parameter
    # comes after the chunk open beside it, which holds parameters used before it.
    drafts: list[tuple[int, list[tuple[int, int, int]]]] = []  # (group, [(index, offset, numel)])
    for gi, g in enumerate(groups):
        cur: list[tuple[int, int, int]] | None = None
        used = 0
        for i, n in enumerate(g):
            if n > chunk_numel:  # exact only (uniform chunks are >= every parameter): a chunk of its own
                drafts.append((gi, [(i, 0, n)]))
                continue
            start = _aligned(used, align)
            if cur is None or (start + n > chunk_numel and cur):
                cur, start = [], 0
                drafts.append((gi, cur))
            cur.append((i, start, n))
            used = start + n
    chunks = tuple(tuple(Slot(gi, i, ci, off, n) for i, off, n in slots)
                   for ci, (gi, slots) in enumerate(drafts))
    sizes = tuple(_aligned(slots[-1][1] + slots[-1][2], align) if exact else chunk_numel
                  for _gi, slots in drafts)
    return ChunkLayout(chunk_numel, tuple(gi for gi, _ in drafts), chunks, sizes)


@dataclass(frozen=True)
class ParamShard:
    """The part of one parameter inside one rank's shard of a chunk.

    Attributes:
        param_start: first element of the part, counted in the flattened parameter.
        chunk_start: the same element's index in the chunk's flat buffers.
        shard_start: the same element's index in the rank's shard (``chunk_start - lo``).
        numel: elements of the part (> 0).
    """

    param_start: int
    chunk_start: int
    shard_start: int
    numel: int


def param_shards(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> list[ParamShard | None]:
    """For each parameter ``(offset, numel)`` of a chunk, its intersection with the shard ``[lo, hi)``
    (``None`` when it has none). A parameter may straddle two ranks' shards; it then has a part on each.

    Raises:
        ValueError: ``lo > hi`` or a range has a negative offset / numel < 1.
    """
    if lo > hi or lo < 0:
        raise ValueError(f"bad shard [{lo}, {hi})")
    out: list[ParamShard | None] = []
    for off, n in ranges:
        if off < 0 or n < 1:
            raise ValueError(f"bad parameter range (offset {off}, numel {n})")
        a, b = max(off, lo), min(off + n, hi)
        out.append(ParamShard(a - off, a, a - lo, b - a) if a < b else None)
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
