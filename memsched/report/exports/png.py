"""The picture of the trace and of the decision (needs matplotlib: ``pip install 'memsched[plot]'``).

On one y axis (bytes, ticks in one binary unit named in the axis label): the stacked area of live bytes by
category over time, the non-model peak marked; with a placement plan also the device capacity, the resident
model data, the peak non-model data on top of it, the GPU margin above that (``capacity - peak non-model -
resident model``, shaded), the budget inside the margin (hatched) and the optimizer state placed on the
device; a column beside the plot stacks the same figures and shows the optimizer state left on the host. Every
artist is named in the legend and labelled in words, and carries a ``gid`` (``capacity``, ``margin``,
``budget``, ...) that tests and tools can find it by.
"""

from __future__ import annotations

import io
import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from memsched.report.exports._common import META_DECISION, device_label, label
from policies.types import PlacementPlan, PlacementProblem
from policies.units import format_bytes
from tracer.timeline import MemoryTimeline, atomic_write_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from memsched.report.plan import DecisionFigures

PNG_HINT = "the PNG export needs matplotlib: pip install 'memsched[plot]'"
# The decision's colours; the optimizer state keeps its category colour (memsched.report.category_bars).
CAPACITY_COLOR = "#222222"
LEGEND_WIDTH = 58  # characters per line of a legend entry (three columns on a 12-inch figure)
MARGIN_COLOR = "#9ecae1"
BUDGET_COLOR = "#2b6ca3"
RESIDENT_COLOR = "#4e79a7"
PEAK_COLOR = "#b07aa1"
HOST_HATCH = "xx"
BUDGET_HATCH = "///"


def png_available() -> bool:
    """Whether matplotlib (the ``plot`` extra) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_png(
    timeline: MemoryTimeline,
    path: str | os.PathLike[str],
    *,
    plan: PlacementPlan | None = None,
    problem: PlacementProblem | None = None,
    device: str | None = None,
) -> Path:
    """Write :func:`render_figure` as a PNG, atomically; returns the path.

    Raises:
        ImportError: matplotlib is missing (the message says to ``pip install 'memsched[plot]'``).
        ValueError: a ``plan`` without the ``problem`` it was made for, or one that does not match it.
    """
    atomic_write_bytes(path, _png_bytes(timeline, plan=plan, problem=problem, device=device))
    return Path(path)


def decision_of(
    timeline: MemoryTimeline, plan: PlacementPlan | None, problem: PlacementProblem | None
) -> DecisionFigures | None:
    """The decision to draw: from ``plan`` and ``problem`` (``sched.plan``, ``sched.problem``) when given,
    else the figures saved in ``timeline.meta["decision"]`` (by :func:`memsched.report.exports.write_all`),
    else ``None`` (a plain trace).

    Raises:
        ValueError: a ``plan`` without its ``problem``, or a plan not made for that problem.
    """
    from memsched.report.plan import DecisionFigures

    if plan is None:
        return DecisionFigures.from_dict(timeline.meta.get(META_DECISION))
    if problem is None:
        raise ValueError("the PNG needs the placement problem the plan was made for (sched.problem) to draw "
                         "the capacity, peak non-model and resident model data")
    return DecisionFigures.of(plan, problem)


def render_figure(
    timeline: MemoryTimeline,
    *,
    plan: PlacementPlan | None = None,
    problem: PlacementProblem | None = None,
    device: str | None = None,
) -> Figure:
    """The matplotlib ``Figure`` (Agg canvas: no display, no pyplot global state) of the trace and, with a
    ``plan`` and its ``problem`` (or figures saved in ``timeline.meta``), of the decision.

    Args:
        timeline: the warmup trace.
        plan: the placement plan in force (``sched.plan``); ``None`` draws the trace alone.
        problem: the problem ``plan`` solved (``sched.problem``): capacity, peak non-model and resident model
            data, bytes.
        device: the device as the user gave it (``"sim:8GiB"``, ``"cuda:0"``), named in the title; default:
            :func:`memsched.report.exports._common.device_label` of the timeline.

    Raises:
        ImportError: matplotlib is missing (the message says to ``pip install 'memsched[plot]'``).
        ValueError: a ``plan`` without its ``problem``, or a plan not made for that problem.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(PNG_HINT) from e
    # Shared with the terminal report: the colours, and the step count.
    from memsched.report.category_bars import CATEGORY_COLORS, CATEGORY_ORDER
    from memsched.report.text import traced_steps

    decision = decision_of(timeline, plan, problem)
    samples = timeline.for_device()
    fig = Figure(figsize=(12, 7) if decision else (10, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    if decision is not None:
        grid = fig.add_gridspec(1, 2, width_ratios=(4.2, 1.0), wspace=0.05)
        ax = fig.add_subplot(grid[0, 0])
        side = fig.add_subplot(grid[0, 1], sharey=ax)
    else:
        ax, side = fig.add_subplot(1, 1, 1), None
    steps = traced_steps(timeline)
    plural = "s" if steps != 1 else ""
    title = f"{device_label(timeline, device)}: live memory over {steps} traced step{plural}"
    if decision is not None:
        title += f" and the placement plan (policy {decision.policy})"
    ax.set_title(title, loc="left", fontsize=10)
    ax.set_xlabel("time since the tracer started (ms)")
    ymax = max([s.total_bytes for s in samples] + _decision_levels(decision))
    unit_name, unit = _axis_unit(ymax)
    ax.set_ylabel(f"bytes on the device ({unit_name})")
    if samples:
        t0 = samples[0].t_ns
        xs = [(s.t_ns - t0) / 1e6 for s in samples]
        cats = [c for c in CATEGORY_ORDER if any(s.bytes.get(c, 0) for s in samples)]
        if cats:
            ax.stackplot(
                xs,
                [[s.bytes.get(c, 0) for s in samples] for c in cats],
                labels=[f"{c} (traced)" for c in cats],
                colors=[CATEGORY_COLORS[c] for c in cats],
                step="post",
                alpha=0.9,
            )
        peak = timeline.peak_non_model_sample()
        if peak is not None and peak.peak_non_model_bytes > 0:
            x = (peak.t_ns - t0) / 1e6
            ax.axvline(x, color="black", linestyle="--", linewidth=1)
            ax.annotate(
                f"peak non-model {format_bytes(peak.peak_non_model_bytes)}\n"
                f"{peak.phase} of {label(peak.module)}",
                xy=(x, 0.97),
                xycoords=("data", "axes fraction"),
                # Label on the side with room: right of the line, or left of it near the right edge.
                xytext=(4, 0) if x <= 0.7 * xs[-1] else (-4, 0),
                ha="left" if x <= 0.7 * xs[-1] else "right",
                textcoords="offset points",
                va="top",
                fontsize=8,
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1},
            )
        for i in range(1, len(samples)):  # faint line where each new step begins
            if samples[i].step != samples[i - 1].step:
                ax.axvline(xs[i], color="grey", linewidth=0.6, alpha=0.6)
        ax.set_xlim(xs[0], max(xs[-1], xs[0] + 1e-3))
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    if decision is not None and side is not None:
        room = 0.05 * ymax  # bytes: a label needs about this much height to stay clear of its neighbours
        _draw_levels(ax, decision, CATEGORY_COLORS["optimizer_state"], room)
        _draw_column(side, decision, CATEGORY_COLORS["optimizer_state"], room)
    if ymax > 0:
        from matplotlib.ticker import FuncFormatter, MultipleLocator

        ax.set_ylim(0, ymax * (1.15 if decision else 1.08))  # room for the peak's label over the capacity
        ax.yaxis.set_major_locator(MultipleLocator(_tick_step(ymax)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v / unit:g}"))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        if decision is None:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
            fig.tight_layout()
        else:
            if side is not None:
                more, more_labels = side.get_legend_handles_labels()
                handles, labels = handles + more, labels + more_labels
            # wrapped, so that three columns fit the figure's width
            wrapped = [textwrap.fill(text, LEGEND_WIDTH) for text in labels]
            fig.legend(handles, wrapped, loc="lower center", ncol=3, fontsize=8, frameon=False)
            fig.subplots_adjust(left=0.07, right=0.98, top=0.94, bottom=0.3)
    else:
        fig.tight_layout()
    return fig


def _png_bytes(
    timeline: MemoryTimeline,
    *,
    plan: PlacementPlan | None = None,
    problem: PlacementProblem | None = None,
    device: str | None = None,
) -> bytes:
    fig = render_figure(timeline, plan=plan, problem=problem, device=device)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _decision_levels(decision: DecisionFigures | None) -> list[int]:
    """The byte levels the decision draws (the y axis must reach them)."""
    if decision is None:
        return [0]
    return [decision.capacity_bytes, decision.margin_floor_bytes,
            decision.host_state_bytes + decision.params_on_host_bytes,
            decision.margin_floor_bytes + decision.budget_bytes,
            decision.margin_floor_bytes + decision.device_state_bytes + decision.grad_working_bytes]


def _draw_levels(ax: Axes, d: DecisionFigures, state_color: str, room: float) -> None:
    """The decision across the timeline: lines at the capacity, the resident model data and the margin's
    floor (resident + peak non-model), the margin shaded, the budget hatched, the device's optimizer state.
    Labels on the plot are left out where a level is within ``room`` bytes of the one it would overlap (the
    legend names every level)."""
    floor = d.margin_floor_bytes
    at_right = ax.get_yaxis_transform()  # x in axes fraction, y in bytes

    def tag(x: float, y: float, text: str, va: str) -> None:
        ax.text(x, y, text, transform=at_right, ha="right", va=va, fontsize=8,
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1})

    fmt = format_bytes
    if d.margin_bytes > 0:
        ax.axhspan(floor, d.capacity_bytes, facecolor=MARGIN_COLOR, alpha=0.35, edgecolor="none",
                   gid="margin", label=f"GPU margin {fmt(d.margin_bytes)} = capacity - peak non-model "
                                        "- resident model")
    else:
        ax.axhspan(d.capacity_bytes, floor, facecolor="#e15759", alpha=0.25, hatch="..", edgecolor="#e15759",
                   gid="margin", label=f"no GPU margin: resident + peak non-model exceed the capacity by "
                                        f"{fmt(-d.margin_bytes)}")
    if d.budget_bytes > 0:
        ax.axhspan(floor, floor + d.budget_bytes, facecolor="none", edgecolor=BUDGET_COLOR,
                   hatch=BUDGET_HATCH, linewidth=0.8, gid="budget",
                   label=f"budget {fmt(d.budget_bytes)} (gpu_margin_mem_ratio {d.gpu_margin_mem_ratio:g})")
    if d.device_state_bytes > 0:
        ax.axhspan(floor, floor + d.device_state_bytes, facecolor=state_color, alpha=0.55, edgecolor="none",
                   gid="optimizer-device", label=f"optimizer state and gradients on the device "
                                                 f"{fmt(d.device_state_bytes)} ({d.device_chunks} chunks)")
    if d.grad_working_bytes > 0:
        top = floor + d.device_state_bytes
        ax.axhspan(top, top + d.grad_working_bytes, facecolor="none", edgecolor=state_color, hatch="//",
                   linewidth=0.6, gid="grad-working",
                   label=f"host chunks' gradients on their way to the host {fmt(d.grad_working_bytes)}")
    ax.axhline(d.capacity_bytes, color=CAPACITY_COLOR, linewidth=1.6, gid="capacity",
               label=f"capacity {fmt(d.capacity_bytes)}")
    ax.axhline(floor, color=PEAK_COLOR, linestyle="--", linewidth=1.1, gid="peak-non-model",
               label=f"peak non-model data {fmt(d.peak_non_model_bytes)}, above the resident model data")
    ax.axhline(d.resident_model_bytes, color=RESIDENT_COLOR, linestyle=":", linewidth=1.4, gid="resident",
               label=f"resident model data {fmt(d.resident_model_bytes)}")
    # Words on the plot itself, at different x so that coinciding levels (budget = margin) stay readable.
    tag(0.995, d.capacity_bytes, f"capacity {fmt(d.capacity_bytes)}", "bottom")
    if d.margin_bytes > 0:
        tag(0.995, d.capacity_bytes, f"GPU margin {fmt(d.margin_bytes)}", "top")
        if d.budget_bytes > 0:
            tag(0.80, floor + d.budget_bytes, f"budget {fmt(d.budget_bytes)}", "top")
        if d.device_state_bytes >= room / 2:
            tag(0.60, floor + d.device_state_bytes / 2, f"optimizer state and gradients on the device "
                f"{fmt(d.device_state_bytes)}", "center")
    tag(0.995, floor, f"resident + peak non-model {fmt(floor)}", "top")
    if d.peak_non_model_bytes >= room:
        tag(0.995, d.resident_model_bytes, f"resident model data {fmt(d.resident_model_bytes)}", "top")


def _draw_column(side: Axes, d: DecisionFigures, state_color: str, room: float) -> None:
    """Beside the plot, on the same y axis: the device's bytes stacked as the plan sees them (resident
    model data, peak non-model data, optimizer state, the rest of the margin), and the host's optimizer
    state."""
    fmt = format_bytes
    floor = d.margin_floor_bytes
    x_dev, x_host, width = 0.0, 1.0, 0.7
    side.bar(x_dev, d.resident_model_bytes, width, color=RESIDENT_COLOR, alpha=0.8, hatch="..",
             edgecolor="white")
    side.bar(x_dev, d.peak_non_model_bytes, width, bottom=d.resident_model_bytes, color=PEAK_COLOR,
             alpha=0.8, edgecolor="white")
    side.bar(x_dev, d.device_state_bytes, width, bottom=floor, color=state_color, alpha=0.8,
             edgecolor="white")
    side.bar(x_dev, max(0, d.capacity_bytes - floor - d.device_state_bytes), width,
             bottom=floor + d.device_state_bytes, color=MARGIN_COLOR, alpha=0.5, edgecolor="white")
    side.bar(x_host, d.host_state_bytes, width, color="white", hatch=HOST_HATCH, edgecolor=state_color,
             gid="optimizer-host",
             label=f"optimizer state and gradients on the host {fmt(d.host_state_bytes)} ({d.host_chunks} "
                   f"chunks; {fmt(d.host_pinned_bytes)} of pinned CPU memory)")
    if d.params_on_host_bytes > 0:
        side.bar(x_host, d.params_on_host_bytes, width, bottom=d.host_state_bytes, color="white",
                 hatch="oo", edgecolor=RESIDENT_COLOR, gid="params-host",
                 label=f"parameters on the host {fmt(d.params_on_host_bytes)} ({d.param_host_chunks} "
                       f"chunks, fetched for their reads; at most {fmt(d.fetched_param_bytes)} on the device "
                       "at once)")
    side.axhline(d.capacity_bytes, color=CAPACITY_COLOR, linewidth=1.6)
    if d.budget_bytes > 0:
        side.bar(x_dev, d.budget_bytes, width, bottom=floor, fill=False, edgecolor=BUDGET_COLOR,
                 hatch=BUDGET_HATCH, linewidth=0.8)

    def inside(x: float, bottom: int, height: int, text: str) -> None:
        if height >= room:  # else the legend alone names it
            side.text(x, bottom + height / 2, text, ha="center", va="center", fontsize=7,
                      bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 1})

    inside(x_dev, 0, d.resident_model_bytes, f"resident model\n{fmt(d.resident_model_bytes)}")
    inside(x_dev, d.resident_model_bytes, d.peak_non_model_bytes,
           f"peak non-model\n{fmt(d.peak_non_model_bytes)}")
    inside(x_dev, floor, d.device_state_bytes, f"optimizer state\n{fmt(d.device_state_bytes)}")
    inside(x_host, 0, d.host_state_bytes, f"optimizer state\n{fmt(d.host_state_bytes)}")
    inside(x_host, d.host_state_bytes, d.params_on_host_bytes, f"parameters\n{fmt(d.params_on_host_bytes)}")
    side.set_xticks([x_dev, x_host], ["device", "host\n(pinned CPU)"], fontsize=8)
    side.set_xlim(-0.5, 1.5)
    side.set_title("where the bytes go", fontsize=9)
    side.tick_params(axis="y", labelleft=False)
    side.grid(axis="y", alpha=0.3)


def _axis_unit(ymax: int) -> tuple[str, int]:
    """The binary unit the y ticks are written in: the largest one with at least two of it below ``ymax``."""
    for name, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if ymax >= 2 * size:
            return name, size
    return "B", 1


def _tick_step(ymax: int) -> int:
    """A y tick step of 1, 2 or 5 times a power of ten of the axis unit (ticks read 10, not 9.5)."""
    unit = _axis_unit(ymax)[1]
    for mult in (1, 2, 5, 10, 20, 50, 100, 200, 500):
        if ymax / (mult * unit) <= 6:
            return mult * unit
    return 1000 * unit
