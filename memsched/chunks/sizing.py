"""What a chunk weighs, bytes: the ONE place that says it (planning and the real tensors both use it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# The parameter dtypes memsched trains (memsched.config refuses others at attach).
TRAINABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

STEP_BYTES = 4  # each parameter's fp32 step count lives next to its chunk's moments
# A lean host chunk's updated values go to the device in pieces of at most this many elements, through one
# pinned staging buffer of that size ([Note: lean host chunks] in memsched.chunks.chunk): 8 MiB in bf16
H2D_PIECE_NUMEL = 1 << 22
# A host chunk updated on the device (attach(host_update=...), memsched.optim.streamed_update) streams its
# state in pieces of at most this many elements, two pieces in flight: 2 x 16 Mi x (16 + 2) bytes = 576 MiB of
# device memory at the step in bf16 (Megatron-LM's chunked optimizer-state offload uses 256 MB pieces)
STREAM_PIECE_NUMEL = 1 << 24
BUFFER_SETS = 2  # streamed pieces in flight: one computing while the other's copies run
STREAM_ALIGN = 64  # memsched.optim.adam.KERNEL_ALIGN: a piece is at least one aligned cut long


def stream_piece_numel(shard_numels: Sequence[int]) -> int:
    """Elements per streamed piece for chunks of these shard sizes: ``STREAM_PIECE_NUMEL``, or the largest
    shard when smaller (at least ``STREAM_ALIGN``)."""
    return max(STREAM_ALIGN, min(STREAM_PIECE_NUMEL, max(shard_numels, default=0)))


def stream_staging_bytes(piece: int, grad_dtype: torch.dtype) -> int:
    """Device bytes the streamed update holds at the step: ``BUFFER_SETS`` sets of a piece's fp32 master,
    moments and upcast gradients, and its gradients as they come from the host (``grad_dtype``), bytes."""
    return BUFFER_SETS * piece * (4 * 4 + torch.empty((), dtype=grad_dtype).element_size())
# [Note: parameter alignment in chunks]
# Every parameter starts at a multiple of PARAM_ALIGN elements in its chunk (512 bytes in fp32, 256 in
# fp16/bf16), so on the device its address, and its gradient's, is aligned as a tensor of its own would be:
# CUDA's caching allocator starts every allocation on a 512-byte boundary. Kernels choose their code by the
# address: torch's vectorised loads (16 or 32 bytes), its reductions and ``_foreach_norm`` (a vectorised path
# that sums in another order: ``clip_grad_norm_`` would round differently from torch's), cuBLASLt's
# algorithms (torch passes the address's alignment, up to 256 bytes) and inductor, which compiles an
# unaligned input to slower code. Packed densely, a parameter after one of odd size would sit at any
# 4-byte offset. ZeRO cuts shards at multiples of PARAM_ALIGN too (torch's CPU fused AdamW computes the last
# ``numel % 16`` elements of each tensor on a scalar path with other rounding, so a parameter's part in a
# shard must start on a vector boundary). One rank's exact chunks end on a multiple of PARAM_ALIGN too
# ([Note: exact chunks]), so each buffer of a chunk's optimizer state, one allocation
# (``memsched.chunks.buffers.Allocator.arena``), starts aligned: torch's fused AdamW takes its vectorised path
# only where every tensor it updates is. Cost: under PARAM_ALIGN elements per parameter and per chunk.
PARAM_ALIGN = 128


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
            buffer is the master), plus one fp32 step count per parameter (``n_params``).
        host_state_bytes: pinned host memory when placed on the host: fp32 master, ``exp_avg``, ``exp_avg_sq``
            and gradient buffer of the shard, plus under mixed precision a compute-dtype staging buffer (the
            parameters' host values, the H2D copy's source; not with ``lean_params``) and, with the
            gradients offloaded, the host gradients in the compute dtype, plus one fp32 step count per
            parameter (``n_params``).
        param_host_bytes: pinned host memory added when a plan keeps the chunk's parameters on the host: their
            compute-dtype copy where ``host_state_bytes`` has none (``lean_params``), else 0 (the fp32 master,
            or the staging buffer, is that copy).

    A chunk of frozen parameters (``frozen``: no gradient, no optimizer state) has no gradient buffer and no
    state on the device; on the host it keeps its parameters' values in the compute dtype, nothing else.
    """

    compute_bytes: int
    grad_bytes: int
    device_state_bytes: int
    host_state_bytes: int
    param_host_bytes: int = 0

    @property
    def resident_bytes(self) -> int:
        """Bytes that stay on the device whatever the placement (compute + gradient buffers)."""
        return self.compute_bytes + self.grad_bytes


def chunk_bytes(chunk_numel: int, *, compute_dtype: torch.dtype = torch.float32,
                shard_numel: int | None = None, master_weights: bool | None = None,
                n_params: int = 1, offload_grads: bool | None = None,
                private_grads: bool = False, frozen: bool = False, host_views: bool = True) -> ChunkBytes:
    """Bytes of one chunk of ``chunk_numel`` elements whose optimizer state covers ``shard_numel`` of them.

    Mixed precision (``master_weights``; default: the compute dtype is not float32) adds an fp32 master copy
    on the device and a compute-dtype H2D staging buffer on the host, and keeps no fp32 host gradients per
    chunk unless ``private_grads`` ([Note: one fp32 gradient scratch]); with ``offload_grads`` (one rank: a
    host chunk's gradients go to the host in backward, :mod:`memsched.chunks.grad_offload`; default: the
    state covers the whole chunk) its host gradients in the compute dtype, a buffer of their own in fp32 too
    with ``private_grads`` (``overlap=True``: the CPU update reads its own copy). ``frozen``: a chunk of
    frozen parameters (no gradients, no optimizer state). ``host_views``: the device reads pinned host memory
    in place (:func:`memsched.devices.host_alias.reads_host_memory`); then under mixed precision, one rank,
    gradients offloaded and no ``private_grads``, a host chunk keeps no copy of its parameters beside the
    master while they are on the device ([Note: lean host chunks] in :mod:`memsched.chunks.chunk`). Used by
    :mod:`memsched.planning.problem` and checked against the real tensors of :class:`Chunk` in the tests.
    """
    shard = chunk_numel if shard_numel is None else shard_numel
    cb = dtype_bytes(compute_dtype)
    if frozen:  # parameters only (issue 31): a compute buffer, and their host copy when they live there
        return ChunkBytes(compute_bytes=chunk_numel * cb, grad_bytes=0, device_state_bytes=0,
                          host_state_bytes=shard * cb)
    mixed = compute_dtype != torch.float32 if master_weights is None else master_weights
    offload = shard == chunk_numel if offload_grads is None else offload_grads
    lean = mixed and offload and not private_grads and host_views
    return ChunkBytes(
        compute_bytes=chunk_numel * cb,
        grad_bytes=chunk_numel * cb,
        device_state_bytes=shard * 4 * (3 if mixed else 2) + STEP_BYTES * n_params,
        # master and moments, the fp32 gradients the update reads (under mixed precision without
        # private_grads a scratch the chunks share: [Note: one fp32 gradient scratch]), the staging
        host_state_bytes=(shard * 4 * (3 if mixed and not private_grads else 4)
                          + (shard * cb if mixed and not lean else 0)
                          + (shard * cb if offload and (mixed or private_grads) else 0)
                          + STEP_BYTES * n_params),
        param_host_bytes=shard * cb if lean else 0,
    )
