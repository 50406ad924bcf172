"""A stacked area plot by category (needs matplotlib: ``pip install 'memsched[plot]'``)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from memsched.exports._common import label
from policies.units import format_bytes
from tracer.timeline import MemoryTimeline, atomic_write_bytes

PNG_HINT = "the PNG export needs matplotlib: pip install 'memsched[plot]'"


def png_available() -> bool:
    """Whether matplotlib (the ``plot`` extra) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_png(timeline: MemoryTimeline, path: str | os.PathLike[str]) -> Path:
    """Stacked area plot of live bytes by category over time, the non-model peak marked; returns the path.

    Rendered with matplotlib's Agg canvas (no display, no pyplot global state) and written atomically.

    Raises:
        ImportError: matplotlib is missing (the message says to ``pip install 'memsched[plot]'``).
    """
    atomic_write_bytes(path, _png_bytes(timeline))
    return Path(path)


def _png_bytes(timeline: MemoryTimeline) -> bytes:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, MultipleLocator
    except ImportError as e:
        raise ImportError(PNG_HINT) from e
    # Shared with the terminal report: the colours, and the step count.
    from memsched.report import CATEGORY_COLORS, CATEGORY_ORDER, traced_steps

    samples = timeline.for_device()
    fig = Figure(figsize=(10, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    steps = traced_steps(timeline)
    ax.set_title(
        f"memsched trace: {timeline.device} ({timeline.meta.get('backend', '?')}), "
        f"{steps} step{'s' if steps != 1 else ''}"
    )
    ax.set_xlabel("time since the tracer started (ms)")
    ax.set_ylabel("live bytes")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_bytes(v)))
    if samples:
        t0 = samples[0].t_ns
        xs = [(s.t_ns - t0) / 1e6 for s in samples]
        cats = [c for c in CATEGORY_ORDER if any(s.bytes.get(c, 0) for s in samples)]
        if cats:
            ax.stackplot(
                xs,
                [[s.bytes.get(c, 0) for s in samples] for c in cats],
                labels=cats,
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
            )
        for i in range(1, len(samples)):  # faint line where each new step begins
            if samples[i].step != samples[i - 1].step:
                ax.axvline(xs[i], color="grey", linewidth=0.6, alpha=0.6)
        ax.set_xlim(xs[0], max(xs[-1], xs[0] + 1e-3))
        ymax = max(s.total_bytes for s in samples)
        if ymax > 0:
            ax.set_ylim(0, ymax * 1.08)
            ax.yaxis.set_major_locator(MultipleLocator(_tick_step(ymax)))
        if cats:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _tick_step(ymax: int) -> int:
    """A y tick step of 1, 2 or 5 times a power of ten of a binary unit (ticks read 10.0 MiB, not 9.5 MiB)."""
    unit = next((u for u in (2**40, 2**30, 2**20, 2**10) if ymax >= u), 1)
    for mult in (1, 2, 5, 10, 20, 50, 100, 200, 500):
        if ymax / (mult * unit) <= 6:
            return mult * unit
    return 1000 * unit
