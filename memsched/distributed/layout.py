"""Sharding layout of chunks over data-parallel ranks: pure integer arithmetic, no torch.distributed.

Every chunk is split evenly: with ``world`` ranks the chunk size is padded up to a multiple of ``world`` and
rank ``r`` owns ``[r * s, (r + 1) * s)`` with ``s = chunk_numel / world`` of EVERY chunk. So when the
optimizer state lives in host memory every rank moves one equal shard of each chunk between host and device
at the same moment and no rank waits on another. (The uneven alternative, one rank owning whole chunks, made
the first ZeRO of ColossalAI slow for exactly that reason; the even split follows PatrickStar, arXiv
2108.05818, section 6, and ZeRO's flat partitions, arXiv 1910.02054.)

All sizes are element counts (numel), never bytes.
"""

from __future__ import annotations

from memsched.chunks import ParamShard, param_shards  # one parameter's part of a shard: pure chunk arithmetic

__all__ = ["ParamShard", "padded_chunk_numel", "param_shards", "shard_range", "shard_state_numel"]


def _check_world(world: int) -> int:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world!r}")
    return world


def padded_chunk_numel(chunk_numel: int, world: int) -> int:
    """``chunk_numel`` rounded up to a multiple of ``world`` (elements), so every rank owns an equal part.

    Raises:
        ValueError: ``chunk_numel`` < 1 or ``world`` < 1 (names the value).
    """
    _check_world(world)
    if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
        raise ValueError(f"chunk_numel must be an integer >= 1, got {chunk_numel!r}")
    return -(-chunk_numel // world) * world


def shard_range(chunk_numel: int, rank: int, world: int) -> tuple[int, int]:
    """The shard ``[lo, hi)`` (elements) of a chunk that ``rank`` owns.

    Raises:
        ValueError: ``chunk_numel`` is not a multiple of ``world`` (pad it with
            :func:`padded_chunk_numel`), or ``rank`` is not in ``[0, world)``.
    """
    _check_world(world)
    if chunk_numel % world:
        raise ValueError(
            f"chunk_numel {chunk_numel} is not a multiple of the world size {world}; "
            "pad it with padded_chunk_numel()"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an integer in [0, {world}), got {rank!r}")
    s = chunk_numel // world
    return rank * s, (rank + 1) * s


def shard_state_numel(chunk_numel: int, n_chunks: int, world: int) -> int:
    """Elements of optimizer state (per state tensor: master, ``exp_avg``, ``exp_avg_sq``) one rank holds:
    ``n_chunks * padded_chunk_numel(chunk_numel, world) / world``."""
    return n_chunks * padded_chunk_numel(chunk_numel, world) // world
