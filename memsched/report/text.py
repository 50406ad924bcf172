"""Terminal report of a memory timeline (and optionally a placement plan and transfer volumes), with rich.

Sections: a summary (traced device, peak non-model data and where it occurs, model data by category, CUDA
allocator figures), the modules keeping the most activations for backward, the timeline as stacked bars by
category, the placement plan and the H2D/D2H volumes. The model / non-model data split and the GPU margin
follow PatrickStar (arXiv 2108.05818) and ColossalAI Gemini. Sizes are formatted with
:func:`policies.units.format_bytes` (MiB/GiB = 2**20/2**30 bytes).

One "peak total" (:func:`peak_total`) is used everywhere: the summary's figure, the timeline's full width and
the figure of the timeline row that holds it. Without colour (a log, CI, ``NO_COLOR``) categories are told
apart by letters (:data:`memsched.report.category_bars.CATEGORY_SYMBOLS`), and the plan's chunk strip by
filled and hollow squares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from memsched.report.category_bars import ABOVE, CATEGORY_ORDER, CategoryLegend, StackedBar
from memsched.report.console import make_console
from memsched.report.plan import host_memory_table, plan_check_table, plan_panel, transfer_table
from policies.types import PlacementPlan
from policies.units import format_bytes
from tracer.timeline import MemoryTimeline, Sample

TIMELINE_ROWS = 40
_PEAK_NON_MODEL = "◀"
_PEAK_TOTAL = "▲"
_PHASE_ABBREV = {"forward": "fwd", "backward": "bwd", "optimizer": "opt", "other": "oth"}


def module_label(name: str) -> str:
    """Display name of a module: ``""`` (the root module) becomes ``(root)``."""
    return name if name else "(root)"


def traced_steps(timeline: MemoryTimeline) -> int:
    """Training steps traced: ``meta["steps"]`` (set by the tracer), else the distinct step indices sampled.

    The tracer's closing mark sample carries the index of the step after the last one, so counting indices
    alone would over-count by one.
    """
    steps = timeline.meta.get("steps")
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0:
        return steps
    return len(timeline.steps())


def high_water(sample: Sample) -> int:
    """The most bytes live at once in the interval ``sample`` closes, all categories (``peak_bytes`` covers
    the ops between the hooks; the live bytes at the hook are part of the interval too)."""
    return max(sample.peak_bytes, sample.total_bytes)


def peak_total(timeline: MemoryTimeline) -> tuple[int, Sample | None]:
    """The report's one "peak total": the most bytes of all categories live at once on the traced device,
    between hooks included (bytes), and the sample closing the interval that holds it (``None`` without
    samples). The summary shows it, the timeline is scaled to it, and its row shows it."""
    top = max(timeline.for_device(), key=high_water, default=None)
    return (high_water(top) if top is not None else 0), top


def report_renderables(
    timeline: MemoryTimeline,
    *,
    plan: PlacementPlan | None = None,
    transfers: Mapping[str, int] | None = None,
    top: int = 10,
    rows: int = TIMELINE_ROWS,
    step_summary: Mapping[str, Any] | None = None,
    plan_history: Sequence[Any] | None = None,
    problem: Any = None,
    host_usage: Any = None,
    plan_check: Any = None,
    predicted_step: Mapping[str, Any] | None = None,
) -> list[RenderableType]:
    """The report's sections as rich renderables, for :func:`render_report` or to embed elsewhere.

    Args:
        timeline: the trace to describe (figures are taken on its traced device, ``timeline.device``).
        plan: a placement plan to describe (policy, GPU margin, budget, chunks on device vs host, reasons).
        transfers: ``{"h2d_bytes": int, "d2h_bytes": int, "steps": int}``: H2D/D2H bytes in total over
            ``steps`` training steps; the report shows them per step.
        top: how many modules the per-module table lists (>= 1).
        rows: at most this many timeline bars (>= 1); samples are bucketed, each bar shows the bucket's
            sample with the most live bytes and, beyond it, the bucket's highest point (see
            :func:`timeline_bars`).
        step_summary: the mean step of the step timeline
            (:meth:`memsched.telemetry.step_timeline.StepTimeline.mean_summary`), shown as a step-time table.
        plan_history: the plans in force since warmup (:class:`memsched.planning.elastic.PlanChange`), shown
        when
            there was more than one.
        problem: the :class:`policies.PlacementProblem` the plan was made for: the plan panel then shows the
            capacity, peak non-model data, resident model data, GPU margin and budget, as the PNG does.
        host_usage: host memory beside the plan (:meth:`memsched.Scheduler.host_usage`), shown as a table.
        plan_check: the plan against ``memsched plan``'s (:class:`memsched.planning.plan_check.PlanCheck`),
            shown as a table.
        predicted_step: the plan's predicted step (:attr:`memsched.Scheduler.predicted_step`), shown in the
            step-time table beside the measured one.

    Raises:
        ValueError: ``top`` or ``rows`` is not an integer >= 1, or ``transfers`` lacks a key / holds a
            negative or non-integer value (the message names it).
    """
    _check_positive_int("top", top)
    _check_positive_int("rows", rows)
    out: list[RenderableType] = [
        summary_panel(timeline),
        module_table(timeline, top=top),
        timeline_bars(timeline, rows=rows),
    ]
    if plan is not None:
        out.append(plan_panel(plan, problem))
    if plan_check is not None:
        out.append(plan_check_table(plan_check))
    if transfers is not None:
        out.append(transfer_table(transfers))
    if host_usage is not None:
        out.append(host_memory_table(host_usage))
    if plan_history is not None and len(plan_history) > 1:
        from memsched.report.history import plan_history_table

        out.append(plan_history_table(plan_history))
    if step_summary is not None:
        from memsched.report.steps import step_table

        out.append(step_table(step_summary, predicted_step))
    return out


def render_report(
    timeline: MemoryTimeline,
    *,
    plan: PlacementPlan | None = None,
    transfers: Mapping[str, int] | None = None,
    top: int = 10,
    console: Console | None = None,
    step_summary: Mapping[str, Any] | None = None,
    plan_history: Sequence[Any] | None = None,
    problem: Any = None,
    host_usage: Any = None,
    plan_check: Any = None,
    predicted_step: Mapping[str, Any] | None = None,
) -> None:
    """Print the report (see :func:`report_renderables`) to ``console`` (default: a new stdout console).

    Raises:
        ValueError: as :func:`report_renderables`.
    """
    parts = report_renderables(timeline, plan=plan, transfers=transfers, top=top, step_summary=step_summary,
                               plan_history=plan_history, problem=problem, host_usage=host_usage,
                               plan_check=plan_check, predicted_step=predicted_step)
    console = console or make_console()
    for part in parts:
        console.print(part)


# ---- sections --------------------------------------------------------------------------------------------
def summary_panel(timeline: MemoryTimeline) -> Panel:
    """Traced device, backend, steps, the non-model peak and where it occurs, model data, CUDA figures."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    meta = timeline.meta
    samples = timeline.for_device()
    backend = meta.get("backend", "?")
    stand_in = timeline.meta.get("stand_in")
    where = f"{stand_in} (stand-in; tensors on {timeline.device})" if stand_in else timeline.device
    grid.add_row("traced device", f"{where} (backend: {backend})")
    grid.add_row("steps", f"{traced_steps(timeline)} traced, {len(samples)} samples on {timeline.device}")
    if not samples:
        grid.add_row("samples", Text("none on the traced device: nothing to report", style="yellow"))
        return Panel(grid, title="memsched trace", title_align="left", box=box.ROUNDED)

    peak = _non_model_peak(timeline)
    if peak is None:
        where = Text("0 B (no non-model data measured)")
    else:
        where = Text(format_bytes(peak.peak_non_model_bytes), style="bold red")
        where.append(f"  at {peak.phase} {peak.event} of {module_label(peak.module)} (step {peak.step})")
    grid.add_row("peak non-model data", where)
    model = timeline.model_data_bytes()
    grid.add_row("model data (largest)",
                 CategoryLegend([(c, f"{c} {format_bytes(v)}") for c, v in model.items()]))
    total, top = peak_total(timeline)
    where = Text(format_bytes(total))
    if top is not None:
        where.append(f"  at {top.phase} {top.event} of {module_label(top.module)} (step {top.step}); "
                     "all categories, between hooks included")
    grid.add_row("peak total", where)
    capacity = meta.get("capacity_bytes")
    if isinstance(capacity, int) and capacity > 0:
        grid.add_row("device capacity", format_bytes(capacity))

    cuda = [s.cuda for s in samples if s.cuda]
    if cuda:

        def get(c: Mapping[str, int | None], key: str) -> int:
            return int(c.get(key) or 0)  # a figure may be missing or None (e.g. NVML unavailable)

        top_reserved = max(cuda, key=lambda c: get(c, "reserved"))
        reserved, allocated = get(top_reserved, "reserved"), get(top_reserved, "allocated")
        grid.add_row("CUDA peak allocated", format_bytes(max(get(c, "peak_allocated") for c in cuda)))
        # Fragmentation: reserved by the caching allocator but not handed out, at the largest reservation.
        frag = reserved - allocated
        share = f" ({100 * frag / reserved:.1f}% of reserved)" if reserved else ""
        grid.add_row(
            "CUDA reserved (max)", f"{format_bytes(reserved)}; unallocated in it: {format_bytes(frag)}{share}"
        )
        nvml = [get(c, "nvml_used") for c in cuda if c.get("nvml_used")]
        if nvml:
            grid.add_row("NVML used (max)", f"{format_bytes(max(nvml))} (device-wide, all processes)")
        else:
            nvml_status = meta.get("nvml")
            grid.add_row(
                "NVML used", "not measured" + (f": {nvml_status}" if nvml_status not in (None, "ok") else "")
            )

    others = [d for d in timeline.devices() if d != timeline.device]
    if others:
        grid.add_row(
            "other devices", ", ".join(f"{d} (peak {format_bytes(timeline.peak_bytes(d))})" for d in others)
        )
    extra = [f"{k} {meta[k]}" for k in ("rank", "world_size", "torch_version") if k in meta]
    if extra:
        grid.add_row("run", ", ".join(extra))
    return Panel(grid, title="memsched trace", title_align="left", box=box.ROUNDED)


def module_table(timeline: MemoryTimeline, *, top: int = 10) -> Table:
    """Top ``top`` modules by activation bytes one call keeps for backward (ties keep first-call order).

    Every byte figure is per call (the module's largest call, submodules included), so a parent's figure
    covers its children's calls; ``calls`` is per traced step. The headers and the caption say so.
    """
    _check_positive_int("top", top)
    stats = sorted(timeline.module_stats(), key=lambda m: m.activation_bytes, reverse=True)
    steps = max(1, traced_steps(timeline))  # a trace with no finished step still ran its forwards once
    table = Table(
        title=f"Modules: top {min(top, len(stats))} of {len(stats)} by activations kept for backward, per "
              "call",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        expand=False,
    )
    table.add_column("module", overflow="fold", ratio=1, min_width=12)
    # Two-line headers: the unit (per step, per call) stays in the header even at 80 columns.
    table.add_column("calls\nper step", justify="right", no_wrap=True)
    table.add_column("activations kept\nper call", justify="right", no_wrap=True)
    table.add_column("forward peak\nper call", justify="right", no_wrap=True)
    table.add_column("backward peak\nper call", justify="right", no_wrap=True)
    for m in stats[:top]:
        table.add_row(
            module_label(m.name),
            _per_step(m.calls, steps),
            format_bytes(m.activation_bytes),
            format_bytes(m.forward_peak_bytes),
            format_bytes(m.backward_peak_bytes),
        )
    if not stats:
        table.caption = "no module forward hooks were sampled"
        return table
    caption = (f"calls: forward calls per step, over {steps} traced step{'s' if steps != 1 else ''}; "
               "per call: the module's largest call, its submodules included; peaks: of non-model data while "
               "the call ran")
    if len(stats) > top:
        caption += f"\n... and {len(stats) - top} more modules (raise --top to see them)"
    table.caption = caption
    table.caption_justify = "left"
    return table


def timeline_bars(timeline: MemoryTimeline, *, rows: int = TIMELINE_ROWS) -> Group:
    """Live bytes per category over the trace as stacked bars: a legend and one bar per bucket of samples.

    Each bar shows its sample's live bytes by category, then ``░`` up to the highest point of its bucket
    (between hooks included), whose size is printed on the right. The full width is :func:`peak_total`,
    reached by the row marked ``▲``; ``◀`` marks the non-model peak.
    """
    _check_positive_int("rows", rows)
    samples = timeline.for_device()
    present = [c for c in CATEGORY_ORDER if any(s.bytes.get(c, 0) for s in samples)]
    legend = CategoryLegend([(c, c) for c in present or CATEGORY_ORDER],
                            prefix=Text("Timeline (live bytes, stacked)  ", style="bold"), key_extra=True)
    if not samples:
        return Group(legend, Text("no samples", style="yellow"))
    total, top = peak_total(timeline)
    scale = total or 1
    peak = _non_model_peak(timeline)
    t0 = samples[0].t_ns
    table = Table.grid(padding=(0, 1), expand=True)
    table.add_column(justify="right", no_wrap=True)  # time
    table.add_column(no_wrap=True, overflow="ellipsis", max_width=30)  # step / phase / module
    table.add_column(ratio=1)  # the bar takes the rest of the line
    table.add_column(justify="right", no_wrap=True)  # the bucket's highest point
    table.add_column(no_wrap=True, width=2)  # the peak markers
    for bucket in _buckets(samples, rows):
        has_peak = peak is not None and any(x is peak for x in bucket)
        has_top = any(x is top for x in bucket)
        # The non-model peak's sample stands for its bucket, then the peak total's, else the fullest sample.
        if has_peak and peak is not None:
            s = peak
        elif has_top and top is not None:
            s = top
        else:
            s = max(bucket, key=lambda x: x.total_bytes)
        label = Text(
            f"s{s.step} {_PHASE_ABBREV.get(s.phase, s.phase)} {module_label(s.module)}",
            style="bold red" if has_peak else "",
        )
        marks = Text()
        if has_peak:
            marks.append(_PEAK_NON_MODEL, style="bold red")
        if has_top:
            marks.append(_PEAK_TOTAL, style="bold")
        high = max(high_water(x) for x in bucket)
        table.add_row(
            f"{(s.t_ns - t0) / 1e6:.1f} ms",
            label,
            StackedBar(s.bytes, scale, high_bytes=high),
            format_bytes(high),
            marks,
        )
    note = Text(f"full width = peak total {format_bytes(total)} ({_PEAK_TOTAL}); each bar: live bytes at its "
                f"sample, {ABOVE} up to its bucket's highest point (printed on the right); ", style="dim")
    note.append(_PEAK_NON_MODEL, style="bold red")
    note.append(" marks the non-model peak; other bars show the fullest sample of their bucket", style="dim")
    return Group(legend, table, note)


def _non_model_peak(timeline: MemoryTimeline) -> Sample | None:
    """The sample closing the interval of the non-model peak, or ``None`` when there is no non-model data."""
    peak = timeline.peak_non_model_sample()
    return peak if peak is not None and peak.peak_non_model_bytes > 0 else None


def _per_step(count: int, steps: int) -> str:
    """``count`` over ``steps`` (>= 1) traced steps, as a whole number when it is one."""
    per = count / steps
    return str(int(per)) if per == int(per) else f"{per:.1f}"


def _buckets(samples: Sequence[Sample], rows: int) -> list[Sequence[Sample]]:
    """Split ``samples`` into at most ``rows`` contiguous, nearly equal buckets."""
    n = len(samples)
    if n <= rows:
        return [samples[i : i + 1] for i in range(n)]
    edges = [round(i * n / rows) for i in range(rows + 1)]
    return [samples[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
