"""Where the flat chunks are built at attach: on the device when it has room for a full copy, else on the CPU,
chunk by chunk.

Building a chunk means packing its parameters into one flat buffer on the compute device. Two ways:

* ``"device"``: the parameters are moved to the device first (if they are not there yet) and packed there
  (device-to-device copies). Needs room for the parameters AND the chunk's buffers at once (a full copy).
* ``"cpu"``: the parameters are packed into one flat host buffer (pinned when CUDA is present), and their
  device copies, if any, are released before the chunk's device buffers are allocated; the chunk is then
  filled from pinned memory. Needs no extra device memory.

``"auto"`` builds each chunk on the device while the free device memory (less a reserve) holds its full copy,
and falls back to the CPU for the chunks that do not fit (PatrickStar-style per-chunk decisions). Packing the
whole model on the CPU was a known initialisation bottleneck of DeepSpeed ZeRO-1/2, hence device first.

On the CPU and the stand-in device (``sim:``) the parameters already live in the memory the "device" uses:
:func:`plan_build` still decides, :func:`stage_params` only re-homes parameters for ``"cpu"`` chunks into
flat host buffers (so both paths run and are tested here), and a GPU run measures the difference.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memsched.chunks import PARAM_ALIGN, ChunkLayout, dtype_bytes
from memsched.devices.pinned import can_pin, pin_empty
from memsched.distributed.options import BUILD_MODES, check_build_mode  # noqa: F401


def plan_build(
    param_bytes: Sequence[int], buffer_bytes: int, free_bytes: int, mode: str = "auto"
) -> list[str]:
    """Per chunk, ``"device"`` or ``"cpu"``.

    Args:
        param_bytes: bytes of each chunk's parameters not yet on the device (their device copy), bytes.
        buffer_bytes: bytes of one chunk's device buffers (compute + gradient), bytes.
        free_bytes: device memory available for building, bytes.
        mode: ``"auto"`` (device while ``param_bytes[i] + buffer_bytes`` fits what is left, else cpu; every
            chunk's buffers and the device chunks' parameter copies are counted until all chunks are built,
            as the parameters are re-bound only then), ``"device"`` or ``"cpu"`` (all chunks).

    Raises:
        ValueError: a bad mode or a negative byte count.
    """
    check_build_mode(mode)
    if buffer_bytes < 0 or free_bytes < 0 or any(b < 0 for b in param_bytes):
        raise ValueError("byte counts must be >= 0")
    if mode != "auto":
        return [mode] * len(param_bytes)
    out, left = [], free_bytes
    for b in param_bytes:
        on_device = b + buffer_bytes <= left
        out.append("device" if on_device else "cpu")
        left = max(0, left - buffer_bytes - (b if on_device else 0))
    return out


def stage_params(
    groups: Sequence[Sequence[torch.nn.Parameter]],
    layout: ChunkLayout,
    device: torch.device,
    decisions: Sequence[str],
    *,
    pin: bool | None = None,
    host_context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> dict[str, int]:
    """Put each chunk's parameters where its chunk is built (before :class:`memsched.chunks.ChunkStore`).

    ``"device"`` chunks: parameters moved to ``device`` (no-op when there already). ``"cpu"`` chunks:
    parameters copied into one flat host buffer per chunk (dtype of the parameters; pinned for CUDA and the
    stand-in (:mod:`memsched.devices.pinned`) unless ``pin`` says otherwise; allocated inside
    ``host_context``, e.g. the stand-in's pause) and
    re-bound as views of it, releasing their device storage.

    Returns:
        ``{"device_chunks", "cpu_chunks", "moved_bytes"}`` (bytes copied here).

    Raises:
        ValueError: ``decisions`` does not have one entry per chunk.
    """
    if len(decisions) != layout.n_chunks:
        raise ValueError(f"{len(decisions)} decisions for {layout.n_chunks} chunks")
    pin = can_pin(device) if pin is None else pin
    moved = 0
    with torch.no_grad():
        for slots, where in zip(layout.chunks, decisions, strict=True):
            params = [groups[s.group][s.index] for s in slots]
            if where == "device":
                for p in params:
                    if p.device != device:
                        moved += p.numel() * p.element_size()
                        p.data = p.data.to(device)
                continue
            by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
            for p in params:
                by_dtype.setdefault(p.dtype, []).append(p)
            for dt, ps in by_dtype.items():
                with (host_context or contextlib.nullcontext)():
                    numel = sum(p.numel() for p in ps)
                    flat = (pin_empty(numel * dtype_bytes(dt), device).view(dt) if pin
                            else torch.empty(numel, dtype=dt, device="cpu"))
                off = 0
                for p in ps:
                    n = p.numel()
                    flat[off : off + n].copy_(p.data.reshape(-1))
                    p.data = flat[off : off + n].view(p.shape)
                    off += n
                moved += off * dtype_bytes(dt)
    return {
        "device_chunks": sum(d == "device" for d in decisions),
        "cpu_chunks": sum(d == "cpu" for d in decisions),
        "moved_bytes": moved,
    }


def prepare(groups: Sequence[Sequence[torch.nn.Parameter]], chunk_numel: int, device: Any, alloc: Any,
            compute_dtype: torch.dtype, mode: str, *, free_bytes: int | None = None,
            align: int = PARAM_ALIGN) -> dict[str, Any]:
    """Before the chunks are built: decide per chunk whether it is built on the device or on the CPU
    (:func:`plan_build`) and put its parameters there (:func:`stage_params`).

    Args:
        device: the :class:`memsched.devices.spec.DeviceSpec` of attach.
        free_bytes: the free device memory (bytes); default 90 % of what CUDA reports free (the rest kept for
            the allocator), or the capacity of another device.
        align: parameter alignment in chunks (elements), as the store will use.

    Returns:
        build statistics: :func:`stage_params`'s, plus ``mode``, ``decisions`` and ``seconds``.
    """
    from memsched.chunks import build_layout, chunk_bytes

    t0 = time.perf_counter()
    layout = build_layout([[p.numel() for p in g] for g in groups], chunk_numel=chunk_numel, align=align)
    tdev = device.torch_device
    param_bytes = [
        sum(groups[s.group][s.index].numel() * groups[s.group][s.index].element_size()
            for s in slots if groups[s.group][s.index].device != tdev)
        for slots in layout.chunks
    ]
    if free_bytes is None:
        if device.kind == "cuda":
            free_bytes = int(torch.cuda.mem_get_info(tdev)[0] * 0.9)  # 10 % kept for the allocator
        else:
            free_bytes = int(device.capacity_bytes)
    buffers = chunk_bytes(layout.chunk_numel, compute_dtype=compute_dtype).resident_bytes
    decisions = plan_build(param_bytes, buffers, free_bytes, mode)
    stats = stage_params(groups, layout, tdev, decisions, host_context=alloc.host_context)
    return {**stats, "mode": mode, "decisions": decisions, "seconds": time.perf_counter() - t0}
