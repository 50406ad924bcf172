"""Chunks: trainable parameters packed into flat buffers of one size, with their optimizer state.

Idea: PatrickStar's chunk-based memory management (arXiv 2108.05818, section 4) and ColossalAI Gemini's chunk
manager. Parameters are packed in first-use order into flat buffers of ONE chunk size (numel), separately per
param group; each parameter becomes a view into its chunk's flat compute buffer and its ``.grad`` a view into
the chunk's flat gradient buffer. The optimizer state of a chunk (fp32 master weights, ``exp_avg``,
``exp_avg_sq``, a step count) lives either on the device or in (pinned) host memory and moves as a whole.

The package has these layers:

* :mod:`.sizing`: pure byte arithmetic (:func:`chunk_bytes`, the ONE place that says what a chunk weighs),
* :mod:`.layout`: pure packing (:func:`search_chunk_size`, :func:`build_layout`) and shard arithmetic from
  numels only, so it runs on meta tensors,
* :mod:`.buffers`: where tensors come from (:class:`Allocator`, one arena per chunk's state),
* :mod:`.chunk` and :mod:`.store`: the runtime objects (:class:`Chunk`, :class:`ChunkStore`) that own them,
* the stages of a step the store composes, each owning its state: :mod:`.binding` (where the parameters
  point), :mod:`.backward` (the gradient hooks and the backward phase) and :mod:`.gradients` (the gradient
  buffers and ``zero_grad``).

Data parallelism: a chunk's optimizer state covers a shard ``[lo, hi)`` of the chunk (one rank: the whole
chunk). The store tells its :class:`memsched.distributed.base.DataParallel` when a chunk's gradients are ready
(a reduce-scatter goes there) and after its update (an all-gather goes there); re-packing
(:meth:`ChunkStore.repack`) assumes whole-chunk shards, so it runs between unsharding and sharding.
"""

from memsched.chunks.buffers import Allocator, pinned_bytes
from memsched.chunks.chunk import Chunk
from memsched.chunks.layout import (
    DEFAULT_MAX_CANDIDATES,
    DEFAULT_MIN_CHUNKS,
    ChunkLayout,
    ParamShard,
    Slot,
    build_layout,
    ordered_groups,
    param_shards,
    search_chunk_size,
)
from memsched.chunks.sizing import PARAM_ALIGN, STEP_BYTES, ChunkBytes, chunk_bytes, dtype_bytes
from memsched.chunks.store import ChunkStore

__all__ = [
    "DEFAULT_MAX_CANDIDATES",
    "DEFAULT_MIN_CHUNKS",
    "PARAM_ALIGN",
    "STEP_BYTES",
    "Allocator",
    "Chunk",
    "ChunkBytes",
    "ChunkLayout",
    "ChunkStore",
    "ParamShard",
    "Slot",
    "build_layout",
    "chunk_bytes",
    "dtype_bytes",
    "ordered_groups",
    "param_shards",
    "pinned_bytes",
    "search_chunk_size",
]
