"""From a model and a trace summary to a :class:`policies.PlacementProblem` (shared by ``memsched.attach`` and
``memsched plan``).

Works from parameter numels and element sizes only, so the model may live on the meta device or under
``FakeTensorMode``. The bytes per chunk come from :func:`memsched.chunks.chunk_bytes`, the same arithmetic the
chunks use, and the GPU margin follows PatrickStar (arXiv 2108.05818, section 5):
``margin = capacity - peak non-model data - resident model data``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from memsched.chunks import ChunkLayout, build_layout, chunk_bytes, ordered_groups, pinned_bytes
from memsched.hyperparams import hyperparameter_groups
from policies.types import ChunkSpec, PlacementProblem


def trainable_groups(model: torch.nn.Module,
                     param_groups: Sequence[Sequence[torch.nn.Parameter]] | None = None,
                     ) -> list[list[torch.nn.Parameter]]:
    """Trainable parameters per group (default: one group, ``model.parameters()``, which lists tied parameters
    once); frozen ones dropped, a group without trainable parameters kept empty (chunk group indices are the
    optimizer's): :func:`memsched.hyperparams.hyperparameter_groups`, the one normalisation of param groups.

    Raises:
        ValueError: there is no trainable parameter.
    """
    raw = None if param_groups is None else [{"params": list(g)} for g in param_groups]
    return [g["params"] for g in hyperparameter_groups(raw, model)]


def resident_extra_bytes(model: torch.nn.Module, trainable: Sequence[Sequence[torch.nn.Parameter]]) -> int:
    """Model data outside the chunks that stays on the device (frozen parameters, buffers), bytes."""
    ids = {id(p) for g in trainable for p in g}
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in ids)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return frozen + buffers


def build_problem(
    model: torch.nn.Module,
    peak_non_model_bytes: int,
    capacity_bytes: int,
    *,
    gpu_margin_mem_ratio: float = 0.8,
    master_weights: bool = False,
    param_order: Sequence[torch.nn.Parameter] | None = None,
    chunk_numel: int | None = None,
    world_size: int = 1,
    param_groups: Sequence[Sequence[torch.nn.Parameter]] | None = None,
    compute_dtype: torch.dtype | None = None,
    host_capacity_bytes: int | None = None,
    align: int = 1,
    pinned: bool = False,
) -> tuple[PlacementProblem, ChunkLayout]:
    """The placement problem memsched solves for ``model``, and the chunk layout it assumes.

    Args:
        model: the model (real, meta or fake parameters: only ``numel``/``element_size``/``dtype`` are read).
        peak_non_model_bytes: peak non-model data on the device from a trace, bytes.
        capacity_bytes: device capacity, bytes.
        gpu_margin_mem_ratio: share of the GPU margin policies may fill, in [0, 1].
        master_weights: mixed precision (fp32 master weights next to the compute parameters). Implied when the
            compute dtype is not float32.
        param_order: parameters in first-use order (from the trace); ``None`` = registration order.
        chunk_numel: chunk size override (elements); ``None`` = :func:`memsched.chunks.search_chunk_size`.
        world_size: ZeRO data-parallel ranks; each rank holds the optimizer state of ``ceil(chunk / world)``.
        param_groups: trainable parameters per param group (a chunk belongs to one group); default one group.
        compute_dtype: dtype of the compute parameters; default the parameters' dtype, or bfloat16 when
            ``master_weights`` is set and the parameters are float32.
        host_capacity_bytes: pinned host memory available, bytes (``None`` = unknown).
        align: parameters start at multiples of ``align`` elements in their chunk (ZeRO:
            :data:`memsched.chunks.SHARD_ALIGN`).
        pinned: host-placed state lives in pinned memory (a CUDA device): each chunk's host bytes are those
            of its one pinned allocation as PyTorch's caching host allocator rounds it
            (:func:`memsched.chunks.pinned_bytes`), not the bytes of its tensors.

    Returns:
        ``(problem, layout)``: chunk ``i`` of the problem is chunk ``i`` of the layout.

    Raises:
        ValueError: no trainable parameters, a bad ``chunk_numel``/``world_size``, or a bad ratio / byte count
            (the latter from :class:`PlacementProblem`).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    groups = ordered_groups(trainable_groups(model, param_groups), param_order)
    layout = build_layout([[p.numel() for p in g] for g in groups], chunk_numel=chunk_numel, align=align)
    if compute_dtype is None:
        compute_dtype = next(p for g in groups for p in g).dtype  # a group may be empty (all frozen)
        if master_weights and compute_dtype == torch.float32:
            compute_dtype = torch.bfloat16
    shard = math.ceil(layout.chunk_numel / world_size)
    specs = []
    for i, slots in enumerate(layout.chunks):  # the step counts make chunks differ by 4 bytes per parameter
        cb = chunk_bytes(layout.chunk_numel, compute_dtype=compute_dtype, shard_numel=shard,
                         master_weights=master_weights or None, n_params=len(slots))
        specs.append(ChunkSpec(index=i, device_bytes=cb.device_state_bytes,
                               host_bytes=pinned_bytes(cb.host_state_bytes, pinned=pinned),
                               numel=layout.chunk_numel))
    resident = layout.n_chunks * cb.resident_bytes + resident_extra_bytes(model, groups)
    problem = PlacementProblem(
        capacity_bytes=int(capacity_bytes),
        peak_non_model_bytes=int(peak_non_model_bytes),
        resident_model_bytes=int(resident),
        chunks=tuple(specs),
        gpu_margin_mem_ratio=gpu_margin_mem_ratio,
        host_capacity_bytes=host_capacity_bytes,
    )
    return problem, layout
