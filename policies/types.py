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
        param_bytes: its parameters' compute buffer on the device, bytes (part of the problem's resident model
            data unless a plan keeps the parameters on the host).
        frozen: a chunk of frozen parameters (issue 31): no gradients and no optimizer state
            (``device_bytes`` 0), ``host_bytes`` the pinned copy of its parameters. Its placement is where
            its parameters live (:func:`policies.plans.make_plan` makes it so).
        param_host_bytes: pinned CPU memory it adds when a plan keeps its parameters on the host (their copy
            in the compute dtype where ``host_bytes`` holds none), bytes.
    """

    index: int
    device_bytes: int
    host_bytes: int
    numel: int = 0
    param_bytes: int = 0
    frozen: bool = False
    param_host_bytes: int = 0

    def __post_init__(self) -> None:
        # Raises ValueError naming the field: a negative or fractional size would silently corrupt every sum.
        _check_bytes(self, "index", self.index, unit="")
        _check_bytes(self, "device_bytes", self.device_bytes)
        _check_bytes(self, "host_bytes", self.host_bytes)
        _check_bytes(self, "numel", self.numel, unit="")
        _check_bytes(self, "param_bytes", self.param_bytes)
        _check_bytes(self, "param_host_bytes", self.param_host_bytes)


FORWARD, BACKWARD = "forward", "backward"  # the phases of a chunk access


@dataclass(frozen=True)
class ChunkAccess:
    """One read of a chunk's parameters in a traced step: a module's forward (a re-forward of a checkpointed
    block in backward included), a read outside any module's own, or backward reading what forward saved.

    Attributes:
        chunk: the chunk read (its index in first-use order).
        phase: ``"forward"`` or ``"backward"``.
        non_model_bytes: the most non-model data (and gradients on their way to the host) held on the device
            from this access to the next, bytes (from the trace's samples around them).
    """

    chunk: int
    phase: str
    non_model_bytes: int = 0

    def __post_init__(self) -> None:
        _check_bytes(self, "chunk", self.chunk, unit="")
        _check_bytes(self, "non_model_bytes", self.non_model_bytes)
        if self.phase not in (FORWARD, BACKWARD):
            raise ValueError(f"ChunkAccess.phase must be {FORWARD!r} or {BACKWARD!r}, got {self.phase!r}")


@dataclass(frozen=True)
class ParamSchedule:
    """The fetch and eviction schedule of the offloaded parameter chunks over one step.

    Attributes:
        offloaded: the chunks whose parameters live on the host (first-use indices), sorted.
        accesses: the step's accesses of offloaded chunks, in order (consecutive reads of one chunk in one
            phase merged).
        targets: per access, the offloaded chunks on the device or on their way there once it is served
            (sorted): the chunk read, the ones kept for a later read, the ones fetched ahead.
        keep: the offloaded chunks that stay on the device from one step to the next (the targets of the
            step's last access).
        fetches: H2D copies of offloaded chunks per step.
        prefetched: those of them issued ahead of the read that needs them (the others are fetched at the
            read: the read waits for the whole copy).
        max_resident: the most offloaded chunks on the device at once.
        slots: the room at each access, in chunks (what the targets were fitted to).

    Each step copies every offloaded chunk H2D once more than it fetches it: the kept ones receive the step's
    update (:attr:`h2d_copies`).
    """

    offloaded: tuple[int, ...]
    accesses: tuple[ChunkAccess, ...]
    targets: tuple[tuple[int, ...], ...]
    keep: tuple[int, ...]
    fetches: int
    prefetched: int
    max_resident: int
    slots: tuple[int, ...] = ()

    @property
    def demand_fetches(self) -> int:
        """Fetches issued at the read that needs them."""
        return self.fetches - self.prefetched

    @property
    def h2d_copies(self) -> int:
        """H2D copies of offloaded chunks per step: the fetches, and the step's update of the kept ones."""
        return self.fetches + len(self.keep)

    def to_dict(self) -> dict[str, object]:
        return {"offloaded": list(self.offloaded), "fetches": self.fetches, "prefetched": self.prefetched,
                "max_resident": self.max_resident, "keep": list(self.keep),
                "accesses": [[a.chunk, a.phase] for a in self.accesses],
                "targets": [list(t) for t in self.targets]}



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
        accesses: the chunk reads of one traced step, in order (:class:`ChunkAccess`); empty when unknown.
            A plan that keeps some chunks' parameters on the host schedules their fetches from them
            (:func:`policies.schedule.schedule_params`).
        device_anchor: the chunk holding the model's first parameter (what ``model.device`` reads), or
            ``None``; ``auto`` keeps its parameters on the host last
            (:func:`policies.builtin.param_offload_order`).
        h2d_staging_bytes: pinned CPU memory of the one buffer from which the host chunks that keep no copy of
            their parameters (``ChunkSpec.param_host_bytes`` > 0) send their updated values to the device,
            bytes; a plan with such a chunk on the host, its parameters on the device, counts it once.
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
    accesses: tuple[ChunkAccess, ...] = ()
    device_anchor: int | None = None
    h2d_staging_bytes: int = 0

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
        accesses = tuple(self.accesses)
        for i, a in enumerate(accesses):
            if not isinstance(a, ChunkAccess) or a.chunk >= len(chunks):
                raise ValueError(f"PlacementProblem.accesses[{i}] must be a ChunkAccess of one of the "
                                 f"{len(chunks)} chunks, got {a!r}")
        object.__setattr__(self, "accesses", accesses)
        anchor = self.device_anchor
        if anchor is not None and (isinstance(anchor, bool) or not isinstance(anchor, int)
                                   or not 0 <= anchor < len(chunks)):
            raise ValueError(f"PlacementProblem.device_anchor must be None or the index of one of the "
                             f"{len(chunks)} chunks, got {anchor!r}")

    @property
    def margin_bytes(self) -> int:
        """The GPU margin, bytes (may be negative when even non-model + resident data do not fit)."""
        return self.capacity_bytes - self.peak_non_model_bytes - self.resident_model_bytes

    def device_bytes_of(self, placement: Sequence[str]) -> int:
        """What a placement (one ``DEVICE``/``HOST`` per chunk) adds on the device, bytes: the device-placed
        chunks' ``device_bytes``, plus :attr:`host_grad_working_bytes` when any chunk of trainable parameters
        is on the host."""
        pairs = list(zip(self.chunks, placement, strict=True))
        dev = sum(c.device_bytes for c, where in pairs if where == DEVICE)
        offloading = any(where == HOST and not c.frozen for c, where in pairs)
        return dev + (self.host_grad_working_bytes if offloading else 0)


@dataclass(frozen=True)
class PlacementPlan:
    """Where each chunk's model data lives: its optimizer state (and, with one rank, its gradients: a host
    chunk's leave the device as backward completes them) and its parameters.

    Attributes:
        policy: name of the policy that made the plan.
        placement: ``DEVICE`` or ``HOST`` per chunk, indexed like ``PlacementProblem.chunks``: where its
            optimizer state (and gradients) live.
        device_bytes: optimizer-state bytes placed on the device (with the gradients the placement keeps
            there: :meth:`PlacementProblem.device_bytes_of`), bytes.
        host_bytes: pinned CPU bytes the host-placed chunks need, bytes.
        margin_bytes: the GPU margin the plan was made against, bytes.
        budget_bytes: the part of the margin the policy allowed itself to fill, bytes.
        reasons: human-readable sentences explaining the decision, for reports.
        options: the policy options in force.
        param_placement: ``DEVICE`` or ``HOST`` per chunk: where its parameters live between their uses
            (empty: all on the device). A chunk whose parameters are on the host has its optimizer state
            there too.
        schedule: when the host-placed parameter chunks come to the device and leave it
            (:class:`ParamSchedule`), or ``None`` when every parameter stays on the device.
        peak_bytes: the most the plan's step holds on the device, bytes, when the plan computed it (with
            parameters on the host: non-model data, resident model data and the fetched chunks at each read);
            ``None`` otherwise.
        speculative: the host chunks whose CPU update starts during backward (``overlap="backward"``,
            :func:`policies.speculation.speculate`), sorted; each holds a second (spare) host state of its
            ``ChunkSpec.host_bytes``, counted in ``host_bytes``.
        streamed: the host chunks whose update runs on the device, their state streamed over the link in
            pieces (``attach(host_update=...)``, :func:`policies.update_paths.choose_update_paths`), sorted.
        staging_bytes: the device bytes the streamed updates hold during the step (their piece buffers, freed
            after it), bytes; 0 without ``streamed`` chunks. They are not in ``device_bytes`` (held between
            steps) and were checked to fit beside it.
    """

    policy: str
    placement: tuple[str, ...]
    device_bytes: int
    host_bytes: int
    margin_bytes: int
    budget_bytes: int
    reasons: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    param_placement: tuple[str, ...] = ()
    schedule: ParamSchedule | None = None
    peak_bytes: int | None = None
    speculative: tuple[int, ...] = ()
    streamed: tuple[int, ...] = ()
    staging_bytes: int = 0

    @property
    def device_chunks(self) -> list[int]:
        return [i for i, p in enumerate(self.placement) if p == DEVICE]

    @property
    def host_chunks(self) -> list[int]:
        return [i for i, p in enumerate(self.placement) if p == HOST]

    @property
    def param_host_chunks(self) -> list[int]:
        """The chunks whose parameters live on the host."""
        return [i for i, p in enumerate(self.param_placement) if p == HOST]

    def params_on_host(self, index: int) -> bool:
        """Whether chunk ``index``'s parameters live on the host."""
        return bool(self.param_placement) and self.param_placement[index] == HOST

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "placement": list(self.placement), "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes, "margin_bytes": self.margin_bytes,
                "budget_bytes": self.budget_bytes, "reasons": list(self.reasons),
                "options": dict(self.options),
                "param_placement": list(self.param_placement) or [DEVICE] * len(self.placement),
                "schedule": self.schedule.to_dict() if self.schedule is not None else None,
                "peak_bytes": self.peak_bytes, "speculative": list(self.speculative),
                "streamed": list(self.streamed), "staging_bytes": self.staging_bytes}
