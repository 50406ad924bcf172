"""The built-in placement policies: ``cuda``, ``cpu``, ``static`` and ``auto``.

Ideas: ColossalAI Gemini's ``static``/``auto`` placement policies and its ``gpu_margin_mem_ratio``,
DeepSpeed ZeRO-Offload (all optimizer state in pinned CPU memory), PatrickStar (arXiv 2108.05818: the GPU
margin measured by a warmup trace decides how many optimizer-state chunks the device can hold).

The core placement insight, shared by ``static`` and ``auto``: chunks are listed in *first-use* order (the
order in which forward touches their parameters). Backward runs in reverse, so the gradients of the
first-used chunks arrive *last*. A host-placed chunk needs a D2H copy of its gradients before the CPU
optimizer can step it; for the last-used chunks that copy overlaps the rest of backward, for the first-used
chunks nothing is left to overlap it with and it lands on the critical path. So the device keeps a *prefix*
of the chunk list and the host gets the suffix. A prefix fill also makes plans monotone: more budget (or a
smaller offload fraction) never puts fewer bytes on the device.

Every policy first checks that resident model data + peak non-model data fit the device at all (else
:class:`~policies.registry.PlacementError`: no placement can help), and ``Policy.plan`` checks that the
plan's device part fits the GPU margin and its host part fits ``host_capacity_bytes``. Budgets use exact
rational arithmetic (:class:`fractions.Fraction`), so monotonicity holds to the byte even beyond 2**53 bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from policies.plans import fixed_bytes, schedule_for
from policies.registry import Option, PlacementError, make_plan, register
from policies.types import DEVICE, HOST, ChunkSpec, ParamSchedule, PlacementPlan, PlacementProblem
from policies.units import format_bytes as fb

__all__ = [
    "DEFAULT_RESERVE_FRAC", "DEFAULT_OFFLOAD_OPTIM_FRAC", "DEFAULT_MAX_PREFETCH", "auto_reserve_bytes",
    "auto_budget_bytes", "auto_policy", "warmup_params_on_host", "WARMUP_NON_MODEL_SHARE", "cpu_policy",
    "cuda_policy", "static_policy",
]

#: Default fragmentation reserve of ``auto``, as a share of the device capacity. Filling the margin to the
#: byte leaves the caching allocator no slack (ColossalAI users hit OOMs with ``gpu_margin_mem_ratio=1``).
DEFAULT_RESERVE_FRAC = 0.05

#: Default of ``static``: all optimizer state on the host, safe when nothing is known about the margin.
DEFAULT_OFFLOAD_OPTIM_FRAC = 1.0

#: How many reads ahead a host-placed parameter chunk may be fetched (``max_prefetch``).
DEFAULT_MAX_PREFETCH = 2

#: The share of the device warmup leaves to non-model data before parameters go to the host (ColossalAI
#: Gemini's ``warmup_non_model_data_ratio``).
WARMUP_NON_MODEL_SHARE = 0.8


def warmup_params_on_host(policy: str, options: dict[str, object], capacity_bytes: int,
                          param_bytes: int) -> bool:
    """Whether the warmup steps keep the parameters on the host, each chunk fetched for its reads (nothing is
    traced yet to plan from): ``static`` with ``offload_param_frac`` > 0, and ``auto`` when the parameters'
    compute copies (``param_bytes``) take more than ``1 - warmup_non_model_share`` of the device (an option
    of ``auto``, default :data:`WARMUP_NON_MODEL_SHARE`; Gemini's ``warmup_non_model_data_ratio``: warmup's
    non-model data may take that share). Other policies keep every parameter on the device."""
    if policy == "static":
        return float(options.get("offload_param_frac", 0.0)) > 0  # type: ignore[arg-type]
    if policy == "auto":
        share = float(options.get("warmup_non_model_share", WARMUP_NON_MODEL_SHARE))  # type: ignore[arg-type]
        return param_bytes > (1 - share) * capacity_bytes
    return False


def _params_fit(p: PlacementProblem, reserve: int = 0) -> bool:
    """Whether the parameters can all stay on the device: the margin, less ``reserve`` bytes, holds at least
    what every chunk on the host adds there (the host chunks' gradient working set)."""
    return p.margin_bytes - reserve >= p.device_bytes_of([HOST] * len(p.chunks))


def _no_room_for_params(p: PlacementProblem, name: str) -> PlacementError:
    """The error of a policy that keeps every parameter on the device when they do not fit."""
    fix = ("use policy 'auto' (keeps parameters on the host as far as needed) or 'static' with "
           "offload_param_frac" if p.accesses else "reduce activation memory (smaller batch, activation "
           "checkpointing) or use a larger device")
    if p.margin_bytes < 0:
        what, short = "before any optimizer state is placed", -p.margin_bytes
        gradients = ""
    else:  # what the margin leaves is less than the host chunks' gradients on their way to the host
        working = p.device_bytes_of([HOST] * len(p.chunks))
        what, short = "with every optimizer-state chunk on the host", working - p.margin_bytes
        gradients = f" + the host chunks' gradients on their way to the host ({fb(working)})"
    return PlacementError(
        f"policy {name!r} keeps every parameter on the device, but resident model data "
        f"({fb(p.resident_model_bytes)}) + peak non-model data ({fb(p.peak_non_model_bytes)}){gradients} "
        f"exceed the device capacity ({fb(p.capacity_bytes)}) by {fb(short)} {what}; {fix}")


def param_offload_order(p: PlacementProblem, *, anchored: bool = True) -> list[int]:
    """The order in which ``auto`` keeps chunks' parameters on the host: the chunks of frozen parameters
    first, then the others, each in first-use order; with ``anchored``, the chunk holding the model's first
    parameter (:attr:`PlacementProblem.device_anchor`) last, so that the chunk a forward usually reads first
    (the embedding) needs no fetch there. (Before parameters read as the device wherever they live, this
    also kept ``model.device`` reading the device.) ``auto`` tries the anchored order first, and the plain one
    when no anchored plan fits.

    Frozen parameters first (issue 31): they cost one H2D copy per read and nothing else, while a trainable
    chunk's parameters on the host add the copy of its updated values, and their gradients must leave the
    device anyway; a LoRA's frozen base is 99 % of its model data. First-used first within each kind: forward
    reads them first and backward last, so they are the farthest from the peak of non-model data (at the
    turn from forward to backward), where they can be away."""
    order = [c.index for c in p.chunks if c.frozen] + [c.index for c in p.chunks if not c.frozen]
    if anchored and p.device_anchor is not None:
        order.remove(p.device_anchor)
        order.append(p.device_anchor)
    return order


def _param_plan(p: PlacementProblem, k: int, limit: int, share: float,
                max_prefetch: int, order: Sequence[int]) -> tuple[list[str], ParamSchedule]:
    """Parameters of the first ``k`` chunks of ``order`` (:func:`param_offload_order`) on the host, with
    every chunk's optimizer state there, and their schedule within ``limit`` bytes (``share`` of the room at
    each read)."""
    n = len(p.chunks)
    placement = [HOST] * n
    params = [DEVICE] * n
    for i in order[:k]:
        params[i] = HOST
    return params, schedule_for(p, placement, params, limit, share=share, max_prefetch=max_prefetch)


def _param_reasons(p: PlacementProblem, params: list[str], sched: ParamSchedule,
                   peak: int | None) -> list[str]:
    """The plan's sentences on the parameters kept on the host."""
    k = params.count(HOST)
    per = max(c.param_bytes for c in p.chunks)
    away = sum(c.param_bytes for c, where in zip(p.chunks, params, strict=True) if where == HOST)
    at_peak = max(range(len(sched.accesses)), key=lambda j: sched.accesses[j].non_model_bytes, default=None)
    peak_part = (f", {len(sched.targets[at_peak])} at the read with the most non-model data"
                 if at_peak is not None else "")
    frozen = sum(1 for c, where in zip(p.chunks, params, strict=True) if c.frozen and where == HOST)
    which = (f"the {frozen} chunks of frozen parameters first, then the first-used others" if frozen else
             "the first used")
    out = [
        f"Parameters do not all fit: those of {k} of {len(p.chunks)} chunks ({fb(away)}; {which}) stay on "
        f"the host (with every chunk's optimizer state and gradients); the device keeps "
        f"{fb(fixed_bytes(p, [HOST] * len(p.chunks), params))} of model data and at most "
        f"{sched.max_resident} of those chunks at a time{peak_part}.",
        f"Schedule from the traced step's {len(p.accesses)} chunk reads: {sched.fetches} fetches per step, "
        f"{sched.prefetched} of them ahead of their read (up to the room left at every read), "
        f"{sched.demand_fetches} at it; the chunk read farthest ahead leaves first; {len(sched.keep)} stay "
        f"cached across steps; at most {fb(sched.h2d_copies * per)} H2D per step for these parameters.",
    ]
    if peak is not None:
        out.append(f"Predicted device peak {fb(peak)} of {fb(p.capacity_bytes)}.")
    if p.device_anchor is not None and params[p.device_anchor] == HOST:
        out.append(f"Chunk {p.device_anchor}, which holds the model's first parameter, is on the host too "
                   "(no plan keeping it fits); model.device still reads the device (host chunks' parameters "
                   "are device-typed views of pinned memory).")
    return out


def _margin_reason(p: PlacementProblem) -> str:
    return (
        f"GPU margin {fb(p.margin_bytes)} = capacity {fb(p.capacity_bytes)} - peak non-model data "
        f"{fb(p.peak_non_model_bytes)} - resident model data {fb(p.resident_model_bytes)}."
    )


def _placement(n: int, n_device: int) -> list[str]:
    """The first ``n_device`` chunks (first-use order) on the device, the rest on the host."""
    return [DEVICE] * n_device + [HOST] * (n - n_device)


def _sum(chunks: Sequence[ChunkSpec]) -> int:
    return sum(c.device_bytes for c in chunks)


def _prefix_bytes(p: PlacementProblem, k: int) -> int:
    """What the first ``k`` chunks on the device (the rest on the host) add on the device, bytes."""
    return p.device_bytes_of(_placement(len(p.chunks), k))


def _split_reason(p: PlacementProblem, k: int) -> str:
    chunks = p.chunks
    host = [c for c in chunks[k:] if not c.frozen]  # a frozen chunk stays with its parameters
    working = (f", plus {fb(p.host_grad_working_bytes)} of the host chunks' gradients on their way to the "
               "host" if host and p.host_grad_working_bytes else "")
    return (
        f"{k} of {len(chunks)} chunks ({fb(_sum(chunks[:k]))}) on the device, in first-use order; "
        f"{len(host)} chunks ({fb(sum(c.host_bytes for c in host))} of pinned memory) on the host{working}."
    )


def _prefix_within(p: PlacementProblem, limit: int) -> int:
    """Length of the longest first-use prefix that fits ``limit`` bytes on the device (:func:`_prefix_bytes`:
    the host chunks' gradient working set counts while any chunk stays on the host); 0 when none does."""
    n, used, best = len(p.chunks), 0, 0
    for k in range(n + 1):
        if used + (p.host_grad_working_bytes if k < n else 0) <= limit:
            best = k
        if k < n:
            used += p.chunks[k].device_bytes
    return best


@register("cuda", help="Every optimizer-state chunk on the device; fails if they do not fit the GPU margin.")
def cuda_policy(problem: PlacementProblem) -> PlacementPlan:
    """Keep all optimizer state on the device (no offload; Gemini's ``"cuda"`` placement).
    ``gpu_margin_mem_ratio`` is not applied: the whole margin may be used (a reason warns beyond the ratio).

    Raises:
        PlacementError: resident + peak non-model + all chunks' ``device_bytes`` exceed the capacity; the
            message gives capacity, peak non-model, resident, chunks and shortfall, and suggests auto/cpu.
    """
    p, total = problem, _prefix_bytes(problem, len(problem.chunks))
    if p.margin_bytes < 0:
        raise _no_room_for_params(p, "cuda")
    if total > p.margin_bytes:
        raise PlacementError(
            f"policy 'cuda': the optimizer state does not fit on the device: capacity "
            f"{fb(p.capacity_bytes)}, peak non-model data {fb(p.peak_non_model_bytes)}, resident model data "
            f"{fb(p.resident_model_bytes)}, {len(p.chunks)} optimizer-state chunks {fb(total)}; short by "
            f"{fb(total - p.margin_bytes)}. Use policy 'auto' (offloads what does not fit) or 'cpu'"
        )
    reasons = [
        _margin_reason(p),
        f"All {len(p.chunks)} chunks ({fb(total)}) on the device, leaving "
        f"{fb(p.margin_bytes - total)} of the margin free.",
    ]
    if total > p.gpu_margin_mem_ratio * p.margin_bytes:
        reasons.append(
            f"Warning: that is more than gpu_margin_mem_ratio {p.gpu_margin_mem_ratio:g} of the margin; "
            "allocator fragmentation may still cause an out-of-memory error ('auto' keeps a reserve)."
        )
    n = len(p.chunks)
    return make_plan(p, _placement(n, n), budget_bytes=p.margin_bytes, reasons=reasons)


@register("cpu", help="Every optimizer-state chunk in pinned host memory, like DeepSpeed ZeRO-Offload.")
def cpu_policy(problem: PlacementProblem) -> PlacementPlan:
    """Put all optimizer state in pinned CPU memory, stepped by the CPU optimizer (DeepSpeed ZeRO-Offload).

    Raises:
        PlacementError: the chunks need more pinned memory than ``host_capacity_bytes`` (``Policy.plan``).
    """
    p = problem
    if not _params_fit(p):
        raise _no_room_for_params(p, "cpu")
    reasons = [
        _margin_reason(p),
        f"All {len(p.chunks)} chunks on the host ({fb(sum(c.host_bytes for c in p.chunks))} of pinned "
        "memory); the device keeps the whole margin for non-model data.",
    ]
    return make_plan(p, _placement(len(p.chunks), 0), budget_bytes=0, reasons=reasons)


def _min_offload_frac(p: PlacementProblem, margin_bytes: int) -> float:
    """A short ``offload_optim_frac`` (3 decimals when possible) that makes ``static`` fit ``margin_bytes``.

    Any fraction above ``rest / total`` offloads at least the suffix after the longest prefix that fits the
    margin, where ``rest`` is that suffix's bytes without its first chunk. Needs ``_sum(chunks) >
    margin_bytes >= 0``.
    """
    chunks = p.chunks
    total = _sum(chunks)
    fits = _prefix_within(p, margin_bytes)
    need = total - _sum(chunks[:fits])
    rest = need - chunks[fits].device_bytes  # chunks[fits] has > 0 bytes: it is where the prefix overflowed
    exact = Fraction(need * 1000, total)
    for frac in (math.floor(exact) / 1000, math.ceil(exact) / 1000, 1.0):  # 1.0 always works: rest < total
        if Fraction(frac) * total > rest:
            return frac
    raise AssertionError("unreachable")  # pragma: no cover


@register(
    "static",
    options={
        "offload_optim_frac": Option(
            float, DEFAULT_OFFLOAD_OPTIM_FRAC,
            "share of optimizer-state bytes kept on the host; the last-used chunks go first", min=0, max=1,
        ),
        "offload_param_frac": Option(
            float, 0.0,
            "share of parameter bytes kept on the host, fetched for their reads; the first-used chunks go "
            "first (needs offload_optim_frac 1)", min=0, max=1,
        ),
        "max_prefetch": Option(
            int, DEFAULT_MAX_PREFETCH, "how many reads ahead a host-placed parameter chunk may be fetched",
            min=0,
        ),
    },
    help="A fixed share of the optimizer state (and parameters) on the host (Gemini 'static').",
)
def static_policy(
    problem: PlacementProblem, offload_optim_frac: float = DEFAULT_OFFLOAD_OPTIM_FRAC,
    offload_param_frac: float = 0.0, max_prefetch: int = DEFAULT_MAX_PREFETCH,
) -> PlacementPlan:
    """Offload a fixed share of the optimizer state, whatever the trace says (ColossalAI Gemini ``static``).

    The host gets the shortest suffix of the chunk list (the last-used chunks) whose ``device_bytes`` reach
    ``offload_optim_frac`` x the total, so at most ``1 - offload_optim_frac`` of the optimizer state stays
    on the device; ``offload_optim_frac=1`` puts every chunk on the host, ``0`` none. The default, 1.0, is
    the safe choice (same placement as ``cpu``).

    ``offload_param_frac`` (Gemini's, which also needs all optimizer state on the host) keeps the parameters
    of the shortest prefix of the chunk list (the first-used chunks) whose parameter bytes reach that share on
    the host; they come to the device for their reads on the schedule of
    :func:`policies.schedule.schedule_params` (fetched up to ``max_prefetch`` reads ahead where room allows).

    The margin does not change the split. If the device part exceeds the margin the policy raises rather
    than return a plan certain to run out of memory; if it exceeds ``gpu_margin_mem_ratio`` x margin, a
    reason warns about it.

    Raises:
        PlacementError: the device part exceeds the GPU margin (the message names an
            ``offload_optim_frac`` that fits, and suggests ``auto``), ``offload_param_frac`` > 0 with
            ``offload_optim_frac`` < 1 or without a trace of the step's reads, or its schedule does not fit.
    """
    p, chunks = problem, problem.chunks
    if offload_param_frac > 0:
        if offload_optim_frac < 1:
            raise PlacementError(
                f"policy 'static': offload_param_frac={offload_param_frac:g} needs offload_optim_frac=1 (a "
                f"chunk whose parameters are on the host is updated there), got {offload_optim_frac:g}")
        if not p.accesses:
            raise PlacementError("policy 'static': offload_param_frac needs the chunk reads of a traced step "
                                 "(the problem has none)")
        total_params = sum(c.param_bytes for c in chunks)
        target, k, kept = Fraction(offload_param_frac) * total_params, 0, 0
        while kept < target:
            kept += chunks[k].param_bytes
            k += 1
        params, sched = _param_plan(p, k, p.capacity_bytes, 1.0, max_prefetch, range(len(chunks)))
        plan = make_plan(p, [HOST] * len(chunks), budget_bytes=0, param_placement=params, schedule=sched)
        reasons = [
            _margin_reason(p),
            f"offload_param_frac {offload_param_frac:g}: the first-used chunks' parameters go to the host "
            "first.",
            *_param_reasons(p, params, sched, plan.peak_bytes),
        ]
        return make_plan(p, [HOST] * len(chunks), budget_bytes=0, reasons=reasons, param_placement=params,
                         schedule=sched)
    if not _params_fit(p):
        raise _no_room_for_params(p, "static")
    total = _sum(chunks)
    n_host = len(chunks)
    if offload_optim_frac < 1:
        target, offloaded, n_host = Fraction(offload_optim_frac) * total, 0, 0
        while offloaded < target:
            n_host += 1
            offloaded += chunks[-n_host].device_bytes
    k = len(chunks) - n_host
    dev = _prefix_bytes(p, k)
    if dev > p.margin_bytes:
        raise PlacementError(
            f"policy 'static' with offload_optim_frac={offload_optim_frac:g} keeps {k} chunks ({fb(dev)}) "
            f"on the device, more than the GPU margin {fb(p.margin_bytes)} (capacity "
            f"{fb(p.capacity_bytes)}, peak non-model data {fb(p.peak_non_model_bytes)}, resident model data "
            f"{fb(p.resident_model_bytes)}); use offload_optim_frac >= "
            f"{_min_offload_frac(p, p.margin_bytes):g} or policy 'auto'"
        )
    reasons = [
        _margin_reason(p),
        f"offload_optim_frac {offload_optim_frac:g}: the last-used chunks go to the host first (their "
        "gradients arrive first in backward, so their D2H copies overlap the rest of it).",
        _split_reason(p, k),
    ]
    if dev > p.gpu_margin_mem_ratio * p.margin_bytes:
        reasons.append(
            f"Warning: the device part {fb(dev)} is more than gpu_margin_mem_ratio "
            f"{p.gpu_margin_mem_ratio:g} of the margin ({fb(p.margin_bytes)}); allocator fragmentation may "
            "cause an out-of-memory error."
        )
    return make_plan(p, _placement(len(chunks), k), budget_bytes=p.margin_bytes, reasons=reasons)


def auto_reserve_bytes(capacity_bytes: int, reserve_frac: float, reserve_bytes: int,
                       fragmentation_bytes: int | None = None) -> int:
    """``auto``'s fragmentation reserve, bytes:
    ``max(ceil(reserve_frac x capacity), reserve_bytes, fragmentation_bytes or 0)``.

    A measured fragmentation (CUDA: reserved - allocated at the warmup peak) can only raise the reserve: on an
    H100 capped at 13 GiB, a reserve sized from the measurement alone (with a 1 % floor) let ``auto`` place
    more chunks, and the next step ran out of memory allocating its logits (``bench/results/
    gpu_step_time_early_d2h_nvidia-h100-80gb-hbm3.json``). One moment of warmup does not see everything the
    allocator will need later (chunk moves, the step's temporaries).
    """
    return max(math.ceil(Fraction(reserve_frac) * capacity_bytes), reserve_bytes, fragmentation_bytes or 0)


def _reserve_reason(p: PlacementProblem, reserve: int, reserve_frac: float, reserve_bytes: int) -> str:
    """The plan's sentence on ``auto``'s reserve: where its size came from."""
    base = (f"Fragmentation reserve {fb(reserve)} (the larger of reserve_frac {reserve_frac:g} x capacity "
            f"and reserve_bytes {fb(reserve_bytes)}")
    if p.fragmentation_bytes is None:
        return base + ")."
    return base + (f", and the allocator fragmentation measured in warmup, {fb(p.fragmentation_bytes)}: "
                   "reserved - allocated at the peak).")


def auto_budget_bytes(problem: PlacementProblem, reserve_frac: float, reserve_bytes: int) -> int:
    """``auto``'s budget, bytes: ``floor(gpu_margin_mem_ratio x max(0, margin - reserve))``, the reserve from
    :func:`auto_reserve_bytes` (with ``problem.fragmentation_bytes`` when measured).

    Non-decreasing in the ratio and in the capacity (the reserve grows by at most ``reserve_frac`` <= 1 byte
    per byte of capacity), non-increasing in the measured fragmentation.
    """
    reserve = auto_reserve_bytes(problem.capacity_bytes, reserve_frac, reserve_bytes,
                                 problem.fragmentation_bytes)
    return math.floor(Fraction(problem.gpu_margin_mem_ratio) * max(0, problem.margin_bytes - reserve))


@register(
    "auto",
    options={
        "reserve_frac": Option(
            float, DEFAULT_RESERVE_FRAC,
            "fragmentation reserve as a share of the device capacity, when fragmentation was not measured",
            min=0, max=1,
        ),
        "reserve_bytes": Option(
            int, 0, "minimum fragmentation reserve, bytes (e.g. '512MiB')", min=0, is_bytes=True,
        ),
        "max_prefetch": Option(
            int, DEFAULT_MAX_PREFETCH, "how many reads ahead a host-placed parameter chunk may be fetched",
            min=0,
        ),
        "warmup_non_model_share": Option(
            float, WARMUP_NON_MODEL_SHARE,
            "share of the device the warmup leaves to non-model data: parameters taking more than the rest "
            "are traced on the host (Gemini's warmup_non_model_data_ratio)", min=0, max=1,
        ),
    },
    help="Fill gpu_margin_mem_ratio of the GPU margin (less a reserve) with chunks in first-use order; "
         "parameters go to the host too when they do not fit.",
)
def auto_policy(
    problem: PlacementProblem, reserve_frac: float = DEFAULT_RESERVE_FRAC, reserve_bytes: int = 0,
    max_prefetch: int = DEFAULT_MAX_PREFETCH, warmup_non_model_share: float = WARMUP_NON_MODEL_SHARE,
) -> PlacementPlan:
    """Place as much optimizer state on the device as the traced margin allows (PatrickStar, Gemini auto).

    ``margin = capacity - peak non-model - resident``;
    ``reserve = max(reserve_frac x capacity, reserve_bytes)`` keeps slack for allocator fragmentation; when
    the problem carries a measured ``fragmentation_bytes`` (CUDA), it is a third lower bound of the reserve
    (:func:`auto_reserve_bytes`);
    ``budget = gpu_margin_mem_ratio x max(0, margin - reserve)``. The longest first-use prefix of chunks
    whose ``device_bytes`` fit the budget goes to the device (nothing when the budget is 0, so ratio 0
    places like ``cpu``), the rest to the host.

    When even the parameters do not all fit (the margin less the reserve cannot hold the host chunks'
    gradients on their way to the host), every chunk's optimizer state goes to
    the host and the parameters of the fewest first-used chunks that make a schedule fit stay there too:
    at each read, ``gpu_margin_mem_ratio`` of what the capacity less the reserve leaves beside the non-model
    data and the model data on the device holds the fetched chunks, and never less than the read itself
    needs (:func:`policies.plans.param_slots`; :func:`policies.schedule.schedule_params` fetches up to
    ``max_prefetch`` reads ahead). So ``auto`` offloads optimizer state, then gradients, then parameters,
    and only as far as the device needs. ``warmup_non_model_share`` only decides where the parameters are
    while the warmup traces (:func:`warmup_params_on_host`).

    Raises:
        PlacementError: the common checks (host part over ``host_capacity_bytes``), or even with every
            parameter on the host some read finds no room (names it).
    """
    p, chunks = problem, problem.chunks
    reserve = auto_reserve_bytes(p.capacity_bytes, reserve_frac, reserve_bytes, p.fragmentation_bytes)
    # the reserve holds for the parameters too: a margin that only just holds them is no margin
    if not _params_fit(p, reserve if p.accesses else 0):
        if not p.accesses:
            raise _no_room_for_params(p, "auto")
        limit = p.capacity_bytes - reserve
        share = p.gpu_margin_mem_ratio
        last: PlacementError | None = None
        orders = [param_offload_order(p)] + ([param_offload_order(p, anchored=False)]
                                             if p.device_anchor is not None else [])
        # anchored: every k but the last keeps the model's first parameter on the device
        for order in orders:
            for k in range(1, len(chunks) + (0 if order is not orders[-1] else 1)):
                try:
                    params, sched = _param_plan(p, k, limit, share, max_prefetch, order)
                except PlacementError as e:
                    last = e
                    continue
                plan = make_plan(p, [HOST] * len(chunks), budget_bytes=0, param_placement=params,
                                 schedule=sched)
                if plan.peak_bytes is not None and plan.peak_bytes > p.capacity_bytes:
                    continue
                reasons = [_margin_reason(p), _reserve_reason(p, reserve, reserve_frac, reserve_bytes),
                           *_param_reasons(p, params, sched, plan.peak_bytes)]
                return make_plan(p, [HOST] * len(chunks), budget_bytes=0, reasons=reasons,
                                 param_placement=params, schedule=sched)
        raise PlacementError(
            f"policy 'auto': even with every chunk's parameters on the host the step does not fit: {last}; "
            "reduce activation memory (smaller batch, activation checkpointing) or use a larger device")
    budget = auto_budget_bytes(p, reserve_frac, reserve_bytes)
    k = _prefix_within(p, budget) if budget > 0 else 0
    reasons = [
        _margin_reason(p),
        _reserve_reason(p, reserve, reserve_frac, reserve_bytes),
        f"Budget {fb(budget)} = gpu_margin_mem_ratio {p.gpu_margin_mem_ratio:g} x max(0, margin - reserve).",
        _split_reason(p, k),
    ]
    if k < len(chunks) and budget > 0:
        reasons.append(
            f"Chunk {k} ({fb(chunks[k].device_bytes)}) would exceed the budget by "
            f"{fb(_prefix_bytes(p, k + 1) - budget)}; it and all later chunks stay on the host."
        )
    return make_plan(p, _placement(len(chunks), k), budget_bytes=budget, reasons=reasons)
