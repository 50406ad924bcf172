"""When parameter chunks kept on the host come to the device and when they leave it: one schedule, made from
the warmup trace, for fetching ahead and evicting. Pure Python: no torch.

A step reads the chunks in an order the warmup trace recorded (:class:`ChunkAccess`: forward reads, then the
reads of backward, re-forwards of checkpointed blocks included), and at each point the device has some room
left beside the non-model data and the model data that stays. For the chunks whose parameters live on the host
(*offloaded*), :func:`schedule_params` decides after each access which of them are on the device (or on their
way there): the chunk read is; when room runs out, the chunk read farthest ahead leaves first (Belady's OPT,
as PatrickStar and ColossalAI Gemini evict from the warmup's compute list); a chunk is fetched ahead of its
read as far as the room at every point in between allows and at most ``max_prefetch`` reads ahead (Gemini's
prefetch has a fixed depth and no memory bound; DeepSpeed ZeRO-3 prefetches a fixed number of bytes and frees
by reuse distance without a memory budget). Steps repeat, so the schedule is cyclic: what is on the device
when one step ends is what the next one starts with, and chunks that fit stay cached across steps.

Room is counted in chunks: every chunk has the same size (:mod:`memsched.chunks.layout`), so a point's room is
the number of offloaded chunks that fit there (``slots``).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.types import ChunkAccess, ParamSchedule
from policies.units import format_bytes

__all__ = ["ParamSchedule", "ScheduleError", "schedule_params", "schedule_sharded"]


class ScheduleError(ValueError):
    """No schedule exists: at some access there is no room even for the chunk being read."""


def _merged(accesses: Sequence[ChunkAccess], slots: Sequence[int],
            offloaded: frozenset[int]) -> tuple[list[ChunkAccess], list[int], list[bool]]:
    """The offloaded chunks' accesses (consecutive reads of one chunk in one phase merged); for each, the
    least room from it to the next one (the resident set must fit all the way; the last one's span wraps
    to the step's first), and whether the access right before it in the step reads another offloaded
    chunk."""
    picks = [i for i, a in enumerate(accesses) if a.chunk in offloaded]
    merged: list[int] = []
    for i in picks:
        last = accesses[merged[-1]] if merged else None
        if last is None or (last.chunk, last.phase) != (accesses[i].chunk, accesses[i].phase):
            merged.append(i)
    n = len(accesses)
    out_slots = []
    for k, i in enumerate(merged):
        end = merged[k + 1] if k + 1 < len(merged) else merged[0] + n
        out_slots.append(min(slots[j % n] for j in range(i, max(end, i + 1))))
    adjacent = [accesses[i - 1].chunk in offloaded and accesses[i - 1].chunk != accesses[i].chunk
                for i in merged]  # accesses[-1]: the step's last access comes right before its first
    return [accesses[i] for i in merged], out_slots, adjacent


def _next_use(seq: Sequence[int]) -> list[dict[int, int]]:
    """For each position j, the distance (in accesses, cyclic) to the next read of every chunk after j."""
    m = len(seq)
    out: list[dict[int, int]] = [{} for _ in range(m)]
    last: dict[int, int] = {}
    for j in range(2 * m - 1, -1, -1):  # two laps: every chunk's next read is found, across the boundary
        if j < m:
            out[j] = {c: k - j for c, k in last.items()}
        last[seq[j % m]] = j
    return out


def schedule_params(accesses: Sequence[ChunkAccess], offloaded: Sequence[int], slots: Sequence[int], *,
                    max_prefetch: int = 2) -> ParamSchedule:
    """The cyclic fetch and eviction schedule of the ``offloaded`` chunks (see the module docstring).

    Args:
        accesses: the step's chunk reads, in order (every chunk's, offloaded or not).
        offloaded: the chunks whose parameters live on the host.
        slots: per access, how many offloaded chunks fit on the device from it to the next access (>= 0).
        max_prefetch: how many reads ahead a fetch may be issued (>= 0; 0: every fetch at its read).

    Returns:
        the :class:`ParamSchedule` (an empty one when no offloaded chunk is read).

    Raises:
        ScheduleError: some read of an offloaded chunk has no room for it and the chunk read before it
            (``slots`` < 2 there): names the access, its phase and chunk.
        ValueError: ``slots`` and ``accesses`` differ in length, or ``max_prefetch`` < 0.
    """
    if len(slots) != len(accesses):
        raise ValueError(f"slots has {len(slots)} entries, accesses {len(accesses)}: one per access")
    if max_prefetch < 0:
        raise ValueError(f"max_prefetch must be >= 0, got {max_prefetch}")
    off = frozenset(offloaded)
    seq_acc, room, adjacent = _merged(accesses, slots, off)
    if not seq_acc:
        return ParamSchedule(tuple(sorted(off)), (), (), (), 0, 0, 0)
    seq = [a.chunk for a in seq_acc]
    m = len(seq)
    # A read needs its chunk, and when the access right before it read another offloaded chunk, that one
    # stays too: an op may read both (a module that reads two chunks, nn.MultiheadAttention's in_proj and
    # out_proj) or still be reading the previous one. (After a read of a resident chunk in between, the
    # previous offloaded chunk's readers were queued before it: its buffer is free in stream order.)
    stays = [seq[j - 1] if adjacent[j] and m > 1 and seq[j - 1] != seq[j] else None for j in range(m)]
    need = [1 if x is None else 2 for x in stays]
    for a, r, k in zip(seq_acc, room, need, strict=True):
        if r < k:
            raise ScheduleError(
                f"no room on the device for offloaded chunk {a.chunk} at its {a.phase} read (peak non-model "
                f"data {format_bytes(a.non_model_bytes)} there): {k} chunks' parameters (it"
                f"{' and the one read right before' if k == 2 else ''}) must fit beside the non-model data "
                f"and the resident model data, {r} do")
    nxt = _next_use(seq)
    # 1. Demand fetches with OPT eviction, two laps: the second starts from where the first ended (cyclic).
    resident: set[int] = set()
    targets: list[set[int]] = [set() for _ in range(m)]
    for lap in range(2):
        for j, c in enumerate(seq):
            resident.add(c)
            keep = {c} if stays[j] is None else {c, stays[j]}
            while len(resident) > room[j]:
                far = max((x for x in resident if x not in keep), key=lambda x: (nxt[j].get(x, 2 * m), x))
                resident.discard(far)
            if lap == 1:
                targets[j] = set(resident)
    # 2. Prefetch: a chunk read at j that was not on the device after j - 1 is fetched as early as the room
    # at every access in between allows, at most max_prefetch accesses ahead (earlier reads first). Where the
    # room is full, a chunk that leaves at j anyway and is not read in between leaves earlier to make room:
    # the fetches stay those of step 1, only earlier.
    prefetched = 0
    for j, c in enumerate(seq):
        prev = (j - 1) % m
        if c in targets[prev]:
            continue
        leaving = [x for x in sorted(targets[prev]) if x not in targets[j]]
        t, victim = j, None
        read_since: set[int] = set()  # the chunks read from the access before u up to j - 1
        for back in range(1, min(max_prefetch, m - 1) + 1):
            u = (j - back) % m
            read_since |= {seq[u], seq[(u - 1) % m]}
            if c in targets[u] or seq[u] == c or (victim is not None and victim in read_since):
                break
            if len(targets[u] - ({victim} if victim is not None else set())) >= room[u]:
                if victim is not None:
                    break
                candidates = [x for x in leaving if x in targets[u] and x not in read_since]
                if not candidates:
                    break
                victim = candidates[0]
            t = u
        if t != j:
            prefetched += 1
            u = t
            while u != j:
                targets[u].add(c)
                if victim is not None:
                    targets[u].discard(victim)
                u = (u + 1) % m
    fetches = sum(1 for j, c in enumerate(seq) for x in targets[j] if x not in targets[(j - 1) % m])
    # a chunk resident across the whole step is fetched once, not per lap (it never re-enters a target)
    return ParamSchedule(
        offloaded=tuple(sorted(off)),
        accesses=tuple(seq_acc),
        targets=tuple(tuple(sorted(t)) for t in targets),
        keep=tuple(sorted(targets[m - 1])),
        fetches=fetches,
        prefetched=prefetched,
        max_resident=max(len(t) for t in targets),
        slots=tuple(room),
    )


def schedule_sharded(accesses: Sequence[ChunkAccess], n_chunks: int, *, prefetch: int = 2) -> ParamSchedule:
    """The schedule of ZeRO-3's parameter chunks: each rank holds ``1 / world`` of every chunk, and a chunk is
    whole only around its reads.

    A chunk is all-gathered ``prefetch`` accesses ahead of its read (forward, a checkpointed block's
    re-forward, backward) and sharded again once read, unless it is read again within ``prefetch`` accesses
    (the last blocks of the forward, which backward reads first) or was read by the access right before (an
    op may still read it). Cyclic: the chunks the step's first reads need stay whole from the end of one
    step to the next (``keep``). DeepSpeed ZeRO-3's prefetch and release by reuse distance and FSDP2's
    ``fully_shard`` (reshard after forward and after backward) work the same way; the window here is
    counted in the traced accesses.

    Args:
        accesses: one micro-batch's chunk reads, in order (:class:`ChunkAccess`, first-use chunk indices).
        n_chunks: the number of chunks (every one is sharded).
        prefetch: how many accesses ahead a chunk is gathered (>= 0).

    Returns:
        the :class:`ParamSchedule`: every chunk ``offloaded``; ``fetches``: the all-gathers of a step.

    Raises:
        ValueError: ``prefetch`` < 0, ``n_chunks`` < 1, or an access names a chunk >= ``n_chunks``.
    """
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if n_chunks < 1:
        raise ValueError(f"n_chunks must be >= 1, got {n_chunks}")
    bad = [a.chunk for a in accesses if a.chunk >= n_chunks]
    if bad:
        raise ValueError(f"accesses name chunks {sorted(set(bad))}, beyond the {n_chunks} chunks")
    everything = tuple(range(n_chunks))
    seq = _merged(accesses, [n_chunks] * len(accesses), frozenset(everything))[0]
    m = len(seq)
    if not m:
        return ParamSchedule(everything, (), (), (), 0, 0, 0)
    targets = []
    for j in range(m):
        window = {seq[(j + k) % m].chunk for k in range(min(prefetch, m - 1) + 1)}
        window.add(seq[(j - 1) % m].chunk)  # the access right before (cyclic: the step's last, for its first)
        targets.append(tuple(sorted(window)))
    fetches = sum(1 for j in range(m) for c in targets[j] if c not in targets[(j - 1) % m])
    return ParamSchedule(offloaded=everything, accesses=tuple(seq), targets=tuple(targets),
                         keep=targets[m - 1], fetches=fetches, prefetched=fetches if prefetch else 0,
                         max_resident=max(len(t) for t in targets), slots=())
