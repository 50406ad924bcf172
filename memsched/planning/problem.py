"""From a model and a trace summary to a :class:`policies.PlacementProblem` (shared by ``memsched.attach`` and
``memsched plan``).

Works from parameter numels and element sizes only, so the model may live on the meta device or under
``FakeTensorMode``. The bytes per chunk come from :func:`memsched.chunks.chunk_bytes`, the same arithmetic the
chunks use, and the GPU margin follows PatrickStar (arXiv 2108.05818, section 5):
``margin = capacity - peak non-model data - resident model data``.

:func:`machine_inputs` adds what ``attach`` knows of the machine and ``memsched plan`` does not: the host
memory budget (:mod:`memsched.devices.host_memory`) and the allocator fragmentation measured in warmup
(:func:`measured_fragmentation_bytes`), agreed over the data-parallel ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from memsched.chunks import PARAM_ALIGN, ChunkLayout, build_layout, chunk_bytes, ordered_groups, pinned_bytes
from memsched.chunks.sizing import H2D_PIECE_NUMEL
from memsched.chunks.store import frozen_params
from memsched.devices.host_memory import HostBudget, host_budget, local_world_size
from memsched.optim.hyperparams import hyperparameter_groups
from policies.types import HOST, ChunkAccess, ChunkSpec, PlacementProblem

if TYPE_CHECKING:
    from memsched.chunks import ChunkStore
    from memsched.devices.spec import DeviceSpec
    from memsched.distributed.base import DataParallel
    from tracer.timeline import MemoryTimeline


#: Host chunks assumed to hold device gradients at once when nothing was measured (a chunk being completed
#: and one whose parameters are used far apart, such as tied embeddings).
DEFAULT_GRAD_WORKING_CHUNKS = 2
#: ZeRO-3: the chunks whole at once at most (the one read, the one read before it and two gathered ahead:
#: :func:`policies.schedule.schedule_sharded` with its default prefetch of 2).
SHARDED_PARAM_WORKING_CHUNKS = 4


def trainable_groups(model: torch.nn.Module,
                     param_groups: Sequence[Sequence[torch.nn.Parameter]] | None = None,
                     ) -> list[list[torch.nn.Parameter]]:
    """Trainable parameters per group (default: one group, ``model.parameters()``, which lists tied parameters
    once); frozen ones dropped, a group without trainable parameters kept empty (chunk group indices are the
    optimizer's): :func:`memsched.optim.hyperparams.hyperparameter_groups`, the one normalisation of param
    groups.

    Raises:
        ValueError: there is no trainable parameter.
    """
    raw = None if param_groups is None else [{"params": list(g)} for g in param_groups]
    return [g["params"] for g in hyperparameter_groups(raw, model)]


def resident_extra_bytes(model: torch.nn.Module, packed: Sequence[Sequence[torch.nn.Parameter]]) -> int:
    """Model data outside the chunks (``packed``: the parameters in chunks) that stays on the device (frozen
    parameters memsched keeps out of chunks, buffers), bytes."""
    ids = {id(p) for g in packed for p in g}
    seen: set[int] = set()
    frozen = 0
    for p in model.parameters():
        if id(p) not in ids and id(p) not in seen:
            seen.add(id(p))
            frozen += p.numel() * p.element_size()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return frozen + buffers


def packed_groups(model: torch.nn.Module, param_groups: Sequence[Sequence[torch.nn.Parameter]] | None,
                  param_order: Sequence[torch.nn.Parameter] | None, compute_dtype: torch.dtype,
                  world_size: int = 1) -> tuple[list[list[torch.nn.Parameter]], list[torch.nn.Parameter]]:
    """The parameters as the store packs them: ``(trainable groups, frozen)``, each in ``param_order``. One
    rank: the frozen parameters of the compute dtype (:func:`memsched.chunks.store.frozen_params`) are
    packed too, in chunks of their own after the trainable ones; more ranks: none."""
    groups = ordered_groups(trainable_groups(model, param_groups), param_order)
    frozen: list[torch.nn.Parameter] = []
    if world_size == 1:
        frozen = frozen_params(model, [p for g in groups for p in g], compute_dtype)
        frozen = ordered_groups([frozen], param_order)[0]
    return groups, frozen


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
    align: int = PARAM_ALIGN,
    pinned: bool = False,
    host_capacity_source: str | None = None,
    fragmentation_bytes: int | None = None,
    grad_working_chunks: int = DEFAULT_GRAD_WORKING_CHUNKS,
    private_grads: bool = False,
    offload_grads: bool | None = None,
    accesses: Sequence[ChunkAccess] = (),
    zero_stage: int | None = None,
    host_views: bool = True,
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
        host_capacity_bytes: host memory the host-placed chunks may take, bytes (``None`` = unknown); see
            :func:`machine_inputs`.
        align: parameters start at multiples of ``align`` elements in their chunk, as the store packs them
            (:data:`memsched.chunks.PARAM_ALIGN`).
        pinned: host-placed state lives in pinned memory (a CUDA device): each chunk's host bytes are those
            of its one pinned allocation as PyTorch's caching host allocator rounds it
            (:func:`memsched.chunks.pinned_bytes`), not the bytes of its tensors.
        host_capacity_source: what sets ``host_capacity_bytes``, in words (named when a plan exceeds it).
        fragmentation_bytes: allocator fragmentation measured in warmup, bytes (``None`` = not measured);
            ``auto`` sizes its reserve from it.
        grad_working_chunks: with one rank, the host chunks whose gradients are on the device at once before
            their offload (:mod:`memsched.chunks.grad_offload`; measured in warmup): the problem's
            ``host_grad_working_bytes``, while a chunk placed on the device keeps its own gradients.
        private_grads: ``overlap=True``: a host chunk's CPU update reads a copy of its gradients of its own
            (:func:`memsched.chunks.chunk_bytes`).
        host_views: the device reads pinned host memory in place (default; ``False`` where a GPU cannot):
            under mixed precision a host chunk then keeps a copy of its parameters only while a plan keeps
            them on the host (:func:`memsched.chunks.chunk_bytes`, ``ChunkSpec.param_host_bytes``).
        offload_grads: host chunks' gradients go to the host in backward (one rank; default: ``world_size``
            is 1).
        accesses: the chunk reads of a traced step in this layout (:mod:`memsched.planning.reads`), from which
            a policy schedules parameter fetches; empty: parameters cannot leave the device.
        zero_stage: one of ``world_size`` ranks at this ZeRO stage (:mod:`memsched.distributed.engine`; the
            scheduler's planner and ``memsched plan --world-size``): 0 keeps the whole optimizer state per
            rank, 1 a ``1 / world`` shard of it, 2 also keeps only a shard of each chunk's averaged
            gradients, plus whole gradient buffers for the ``grad_working_chunks`` chunks backward fills at
            once (each lives from a chunk's first gradient to its reduce-scatter; counted beside its shard,
            as in an accumulation's later micro-batches); 3 also keeps only a shard of each chunk's
            parameters, plus :data:`SHARDED_PARAM_WORKING_CHUNKS` whole chunks around the reads (one rank's
            peak in forward and backward; between steps fewer). The chunk size is then padded as the engine
            pads it (a multiple of ``world_size`` times ``align``) and ``offload_grads`` must be left unset.
            ``None``: ``world_size`` ranks shard the optimizer state, gradients as ``offload_grads`` says.

    Returns:
        ``(problem, layout)``: chunk ``i`` of the problem is chunk ``i`` of the layout.

    Raises:
        ValueError: no trainable parameters, a bad ``chunk_numel``/``world_size``, a ``zero_stage`` memsched
            does not run (names the allowed ones) or one given with ``offload_grads``, or a bad ratio / byte
            count (the latter from :class:`PlacementProblem`).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    trainable = ordered_groups(trainable_groups(model, param_groups), param_order)
    if compute_dtype is None:
        compute_dtype = next(p for g in trainable for p in g).dtype  # a group may be empty (all frozen)
        if master_weights and compute_dtype == torch.float32:
            compute_dtype = torch.bfloat16
    groups, frozen = packed_groups(model, param_groups, param_order, compute_dtype, world_size)
    sizes = [[p.numel() for p in g] for g in groups] + ([[p.numel() for p in frozen]] if frozen else [])
    exact = world_size == 1  # as the store packs: [Note: exact chunks] in memsched.chunks.layout
    grad_shards = param_shards = False
    if zero_stage is not None:
        from memsched.distributed.options import check_zero_options

        check_zero_options(zero_stage, "all_gather")
        if offload_grads is not None:
            raise ValueError("give zero_stage or offload_grads, not both: at a ZeRO stage the gradients' "
                             "place follows from the stage")
        if world_size > 1:
            from memsched.chunks import search_chunk_size
            from memsched.distributed.layout import padded_chunk_numel

            wanted = chunk_numel if chunk_numel is not None else search_chunk_size(sizes, align=align)
            chunk_numel = padded_chunk_numel(wanted, world_size * align) if zero_stage >= 1 else wanted
            grad_shards, param_shards = zero_stage >= 2, zero_stage >= 3
            if zero_stage == 0:
                world_size = 1  # every rank keeps and updates the whole optimizer state
            offload_grads = False
    layout = build_layout(sizes, chunk_numel=chunk_numel, align=align, exact=exact)
    # One rank: a host chunk's gradients go to the host as backward completes them, so only a working set of
    # gradient buffers is resident; a chunk whose optimizer state is on the device keeps its gradients there.
    offload = world_size == 1 if offload_grads is None else offload_grads
    specs, per_chunk = [], []
    for i, (slots, numel, gi) in enumerate(zip(layout.chunks, layout.numels, layout.chunk_groups,
                                               strict=True)):
        # the step counts make chunks differ by 4 bytes per parameter, and exact chunks by their lengths
        shard = math.ceil(numel / world_size)
        frozen_chunk = bool(frozen) and gi == len(groups)
        cb = chunk_bytes(numel, compute_dtype=compute_dtype, shard_numel=shard,
                         master_weights=master_weights or None, n_params=len(slots), offload_grads=offload,
                         private_grads=private_grads, frozen=frozen_chunk, host_views=host_views)
        per_chunk.append((cb, shard))
        grads = cb.grad_bytes if offload else 0  # a device chunk keeps its gradients on the device
        specs.append(ChunkSpec(index=i, device_bytes=cb.device_state_bytes + grads,
                               host_bytes=pinned_bytes(cb.host_state_bytes, pinned=pinned),
                               numel=numel, param_bytes=cb.compute_bytes, frozen=frozen_chunk,
                               param_host_bytes=pinned_bytes(cb.param_host_bytes, pinned=pinned)
                               if cb.param_host_bytes else 0))
    params = sum(cb.compute_bytes for cb, _ in per_chunk)
    grad_bufs = sum(cb.grad_bytes for cb, _ in per_chunk)
    # the largest chunks' buffers bound any working set of whole buffers
    largest_grads = sorted((cb.grad_bytes for cb, _ in per_chunk), reverse=True)
    largest_params = sorted((cb.compute_bytes for cb, _ in per_chunk), reverse=True)
    resident = params + resident_extra_bytes(model, [*groups, frozen])
    if param_shards:  # ZeRO-3: each chunk's part of the parameters, and the chunks whole around their reads
        resident -= params
        resident += sum(cb.compute_bytes // n * shard for (cb, shard), n in zip(per_chunk, layout.numels,
                                                                               strict=True))
        resident += sum(largest_params[:SHARDED_PARAM_WORKING_CHUNKS])
    working = sum(largest_grads[:grad_working_chunks]) if offload else 0
    if grad_shards:  # ZeRO-2: each chunk's gradient shard, and the whole buffers backward is filling
        resident += sum(cb.grad_bytes // n * shard for (cb, shard), n in zip(per_chunk, layout.numels,
                                                                            strict=True))
        resident += sum(largest_grads[:grad_working_chunks])
    elif not offload:  # more ranks: every chunk's gradient buffer stays on the device
        resident += grad_bufs
    problem = PlacementProblem(
        capacity_bytes=int(capacity_bytes),
        peak_non_model_bytes=int(peak_non_model_bytes),
        resident_model_bytes=int(resident),
        chunks=tuple(specs),
        gpu_margin_mem_ratio=gpu_margin_mem_ratio,
        host_capacity_bytes=host_capacity_bytes,
        host_capacity_source=host_capacity_source,
        fragmentation_bytes=fragmentation_bytes,
        host_grad_working_bytes=working,
        accesses=tuple(accesses),
        device_anchor=_chunk_of_first_parameter(model, layout, [*groups, frozen]),
        # the largest piece a lean chunk sends in the compute dtype (HybridAdamW.h2d_staging)
        h2d_staging_bytes=pinned_bytes(max((min(cb.param_host_bytes, H2D_PIECE_NUMEL * cb.compute_bytes // n)
                                            for (cb, _s), n in zip(per_chunk, layout.numels, strict=True)
                                            if n), default=0), pinned=pinned),
    )
    return problem, layout


def _chunk_of_first_parameter(model: torch.nn.Module, layout: ChunkLayout,
                              packed: Sequence[Sequence[torch.nn.Parameter]]) -> int | None:
    """The chunk holding ``model``'s first parameter (what ``model.device`` reads), ``None`` when that
    parameter is in no chunk."""
    first = next(iter(model.parameters()), None)
    for i, slots in enumerate(layout.chunks):
        if any(packed[s.group][s.index] is first for s in slots):
            return i
    return None


def layout_param_chunks(model: torch.nn.Module, layout: ChunkLayout,
                        param_order: Sequence[torch.nn.Parameter] | None = None,
                        param_groups: Sequence[Sequence[torch.nn.Parameter]] | None = None, *,
                        compute_dtype: torch.dtype | None = None, world_size: int = 1) -> dict[int, int]:
    """``id(parameter) -> chunk index`` of a layout :func:`build_problem` made with the same ``model``,
    ``param_order``, ``param_groups``, ``compute_dtype`` (default: the trainable parameters') and
    ``world_size``."""
    if compute_dtype is None:
        compute_dtype = next(p for g in trainable_groups(model, param_groups) for p in g).dtype
    groups, frozen = packed_groups(model, param_groups, param_order, compute_dtype, world_size)
    packed = [*groups, frozen]
    return {id(packed[s.group][s.index]): i for i, slots in enumerate(layout.chunks) for s in slots}


def measured_fragmentation_bytes(timeline: MemoryTimeline | None, device: str | None = None) -> int | None:
    """The caching allocator's fragmentation at the peak of non-model data of ``timeline`` on ``device``
    (default: the traced device), bytes; ``None`` when the samples carry no CUDA figures (CPU, stand-in, a
    fake trace) or there is no timeline.

    It is ``reserved - peak_allocated`` of the sample that closes the interval holding the peak, at least 0:
    ``reserved`` never shrinks by itself (only ``empty_cache`` or an out-of-memory retry release blocks), so
    there it is at least what the allocator held at the peak, and ``peak_allocated`` is the most it had in
    use, the peak itself. The sample's own ``allocated`` would not do: it is read after the interval, once the
    peak's temporaries are freed, and would count reusable cached blocks as fragmentation. When the process
    had a higher peak before the trace (the allocator's high-water mark is never reset), the figure is low;
    ``auto`` never reserves less than its ``reserve_frac`` share of the capacity anyway.
    """
    if timeline is None:
        return None
    sample = timeline.peak_non_model_sample(device)
    cuda = sample.cuda if sample is not None else None
    if not cuda or cuda.get("reserved") is None or cuda.get("peak_allocated") is None:
        return None
    return max(0, int(cuda["reserved"]) - int(cuda["peak_allocated"]))


_NO_BUDGET = 2**62  # "no host budget" in the integer reduction over ranks (larger than any real one)


def _agree(dp: DataParallel, values: list[int], op: str, what: str) -> list[int]:
    """``values`` reduced over the data-parallel ranks with ``op`` (``"min"``/``"max"``), so that every rank
    plans the same problem (the plans are checked equal, and a rank refusing alone would leave the others
    waiting in a collective). One rank: unchanged."""
    comm = getattr(dp, "comm", None)  # ZeroEngine's communicator; the one-rank base class has none
    if dp.world <= 1 or comm is None:
        return values
    return comm.reduce_ints(values, op, what=what)


def machine_inputs(timeline: MemoryTimeline | None, device: DeviceSpec, store: ChunkStore,
                   dp: DataParallel, *, budget: Callable[..., HostBudget] = host_budget,
                   host_memory_bytes: int | None = None) -> dict[str, Any]:
    """The :func:`build_problem` arguments that come from this machine and this warmup:
    ``host_capacity_bytes`` and ``host_capacity_source`` (:func:`memsched.devices.host_memory.host_budget`;
    none on the CPU device, where nothing is placed on the host) and ``fragmentation_bytes``
    (:func:`measured_fragmentation_bytes`), agreed over the ranks: the smallest budget, the largest
    fragmentation.

    Args:
        timeline: the warmup trace (``None``: no fragmentation figure).
        device: the compute device; a stand-in's ``host=SIZE`` caps the budget.
        store: the chunks; those on the host now count as available to the plan (moving them frees them).
        dp: the data parallelism (its ranks agree; ranks on one machine share its available memory).
        budget: the host-budget function (injectable for tests), called with :func:`host_budget`'s arguments.
        host_memory_bytes: the user's limit (``host_memory=`` at attach), bytes; ``None``: none.
    """
    b = None
    if device.kind != "cpu":
        pin = store.alloc.pin
        held = sum(pinned_bytes(c.state_nbytes(), pinned=pin) for c in store.chunks if c.placement == HOST)
        b = budget(pinned=pin, held_bytes=held, local_ranks=local_world_size() if dp.world > 1 else 1,
                   stand_in_bytes=device.host_capacity_bytes, user_bytes=host_memory_bytes)
    frag = measured_fragmentation_bytes(timeline)
    # One collective: the smallest budget and the largest fragmentation (negated, so "min" finds it). In the
    # integers, _NO_BUDGET and +1 stand for "none" (every rank has the same kind of device, so all or none).
    mine = [_NO_BUDGET if b is None else b.capacity_bytes, 1 if frag is None else -frag]
    cap, neg_frag = _agree(dp, mine, "min", "agreeing on the host budget and the allocator fragmentation")
    source = None
    if b is not None:
        source = b.source if cap == b.capacity_bytes else f"the smallest host budget over {dp.world} ranks"
    return {"host_capacity_bytes": None if b is None else cap, "host_capacity_source": source,
            "fragmentation_bytes": None if neg_frag > 0 else -neg_frag}
