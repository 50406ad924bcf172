"""Inputs and outputs of a placement policy. Pure data: no torch.

A policy turns a :class:`PlacementProblem` (what the tracer measured, what the chunks weigh, how big the
device is) into a :class:`PlacementPlan` (which optimizer-state chunk lives where). The GPU margin follows
PatrickStar (arXiv 2108.05818, section 5) and ColossalAI Gemini:
``margin = capacity - peak non-model data - resident model data``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEVICE = "device"  # placement on the accelerator (CUDA or the stand-in)
HOST = "host"  # placement in (pinned) CPU memory


def check_ratio(value: object, name: str = "gpu_margin_mem_ratio") -> float:
    """``value`` as a float in [0, 1] (the one place this is checked: the problem, attach and the CLI).

    Raises:
        ValueError: not a real number in [0, 1] (NaN and bools included); the message names ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _check_bytes(
    owner: object, name: str, value: Any, *, optional: bool = False, unit: str = "bytes"
) -> None:
    """Check that ``owner.name`` is a whole number (of bytes) >= 0 (``None`` allowed when ``optional``), and
    store it back as a plain ``int`` (numpy integers and the like are normalised).

    Raises:
        ValueError: the value is not an integer (bools included) or is negative; the message names both.
    """
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = f"a whole number of {unit}" if unit else "a whole number"
        raise ValueError(f"{type(owner).__name__}.{name} must be {what}, got {value!r}")
    if value < 0:
        at_least = f">= 0 {unit}" if unit else ">= 0"
        raise ValueError(f"{type(owner).__name__}.{name} must be {at_least}, got {value}")
    object.__setattr__(owner, name, int(value))


@dataclass(frozen=True)
class ChunkSpec:
    """One optimizer-state chunk as a policy sees it.

    Attributes:
        index: position in first-use order (0 = used first in forward).
        device_bytes: bytes it adds on the device when placed there (fp32 ``exp_avg`` + ``exp_avg_sq``, plus
            the fp32 master copy under mixed precision), bytes.
        host_bytes: bytes of pinned CPU memory it needs when placed on the host (master copy, ``exp_avg``,
            ``exp_avg_sq`` and a gradient buffer), bytes.
        numel: parameters in the chunk (capacity, including padding).
    """

    index: int
    device_bytes: int
    host_bytes: int
    numel: int = 0

    def __post_init__(self) -> None:
        # Raises ValueError naming the field: a negative or fractional size would silently corrupt every sum.
        _check_bytes(self, "index", self.index, unit="")
        _check_bytes(self, "device_bytes", self.device_bytes)
        _check_bytes(self, "host_bytes", self.host_bytes)
        _check_bytes(self, "numel", self.numel, unit="")


@dataclass(frozen=True)
class PlacementProblem:
    """Everything a policy may look at.

    Attributes:
        capacity_bytes: device capacity usable by this process, bytes.
        peak_non_model_bytes: peak non-model data from the warmup trace, bytes.
        resident_model_bytes: model data that stays on the device whatever the plan (compute parameters,
            buffers, gradient buffers, frozen parameters), bytes.
        chunks: the optimizer-state chunks, in first-use order.
        gpu_margin_mem_ratio: share of the GPU margin that policies may fill, in [0, 1].
        host_capacity_bytes: CPU memory available for the host-placed chunks (pinned on CUDA), bytes (``None``
            = unknown / unlimited); ``Policy.plan`` refuses a plan whose host part exceeds it.
        host_capacity_source: what sets ``host_capacity_bytes``, in words (``"available host memory"``,
            ``"the locked-memory limit RLIMIT_MEMLOCK"``, ...); named in the error of a plan over it.
        fragmentation_bytes: allocator fragmentation measured during warmup, bytes (on CUDA: the caching
            allocator's reserved minus allocated bytes at the peak of non-model data); ``None`` = not measured
            (the CPU and the stand-in have no caching allocator). ``auto`` sizes its reserve from it.
        host_grad_working_bytes: the device gradient buffers of host-placed chunks alive at once, bytes: a
            host chunk's gradients leave the device as backward completes them (one rank), so a plan with
            any chunk on the host holds this much more on the device (:meth:`device_bytes_of`), while a chunk
            placed on the device keeps its own gradients (in its ``device_bytes``).
    """

    capacity_bytes: int
    peak_non_model_bytes: int
    resident_model_bytes: int
    chunks: tuple[ChunkSpec, ...]
    gpu_margin_mem_ratio: float = 0.8
    host_capacity_bytes: int | None = None
    host_capacity_source: str | None = None
    fragmentation_bytes: int | None = None
    host_grad_working_bytes: int = 0

    def __post_init__(self) -> None:
        """Validate once, here, so that every policy (built-in or custom) sees a sane problem.

        Raises:
            ValueError: a size is negative or not a whole number of bytes, a chunk is not a
                :class:`ChunkSpec`, ``gpu_margin_mem_ratio`` is not a number in [0, 1] (NaN included), or
                ``host_capacity_source`` is neither text nor ``None``.
        """
        for name in ("capacity_bytes", "peak_non_model_bytes", "resident_model_bytes",
                     "host_grad_working_bytes"):
            _check_bytes(self, name, getattr(self, name))
        _check_bytes(self, "host_capacity_bytes", self.host_capacity_bytes, optional=True)
        _check_bytes(self, "fragmentation_bytes", self.fragmentation_bytes, optional=True)
        if self.host_capacity_source is not None and not isinstance(self.host_capacity_source, str):
            raise ValueError(f"PlacementProblem.host_capacity_source must be text or None, got "
                             f"{self.host_capacity_source!r}")
        if isinstance(self.chunks, (str, bytes)) or not hasattr(self.chunks, "__iter__"):
            raise ValueError(f"PlacementProblem.chunks must be a sequence of ChunkSpec, got {self.chunks!r}")
        chunks = tuple(self.chunks)  # accept any iterable; stored as a tuple so the problem stays hashable
        for i, c in enumerate(chunks):
            if not isinstance(c, ChunkSpec):
                raise ValueError(f"PlacementProblem.chunks[{i}] must be a ChunkSpec, got {c!r}")
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "gpu_margin_mem_ratio", check_ratio(self.gpu_margin_mem_ratio))

    @property
    def margin_bytes(self) -> int:
        """The GPU margin, bytes (may be negative when even non-model + resident data do not fit)."""
        return self.capacity_bytes - self.peak_non_model_bytes - self.resident_model_bytes

    def device_bytes_of(self, placement: Sequence[str]) -> int:
        """What a placement (one ``DEVICE``/``HOST`` per chunk) adds on the device, bytes: the device-placed
        chunks' ``device_bytes``, plus :attr:`host_grad_working_bytes` when any chunk is on the host."""
        dev = sum(c.device_bytes for c, where in zip(self.chunks, placement, strict=True) if where == DEVICE)
        return dev + (self.host_grad_working_bytes if HOST in placement else 0)


@dataclass(frozen=True)
class PlacementPlan:
    """Where each optimizer-state chunk lives.

    Attributes:
        policy: name of the policy that made the plan.
        placement: ``DEVICE`` or ``HOST`` per chunk, indexed like ``PlacementProblem.chunks``.
        device_bytes: optimizer-state bytes placed on the device, bytes.
        host_bytes: pinned CPU bytes the host-placed chunks need, bytes.
        margin_bytes: the GPU margin the plan was made against, bytes.
        budget_bytes: the part of the margin the policy allowed itself to fill, bytes.
        reasons: human-readable sentences explaining the decision, for reports.
        options: the policy options in force.
    """

    policy: str
    placement: tuple[str, ...]
    device_bytes: int
    host_bytes: int
    margin_bytes: int
    budget_bytes: int
    reasons: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def device_chunks(self) -> list[int]:
        return [i for i, p in enumerate(self.placement) if p == DEVICE]

    @property
    def host_chunks(self) -> list[int]:
        return [i for i, p in enumerate(self.placement) if p == HOST]

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "placement": list(self.placement), "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes, "margin_bytes": self.margin_bytes,
                "budget_bytes": self.budget_bytes, "reasons": list(self.reasons),
                "options": dict(self.options)}
