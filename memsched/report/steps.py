"""The step-time section of the report: where a steady-state step's time went
(:meth:`memsched.telemetry.step_timeline.StepTimeline.mean_summary`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich import box
from rich.table import Table

from memsched.telemetry.step_timeline import PHASES


def step_table(summary: Mapping[str, Any], predicted: Mapping[str, Any] | None = None) -> Table:
    """A table of the mean step: its phases, the CPU update (total and exposed), the waits, the ideal step
    and the overlap efficiency (ideal / measured); on the stand-in's modelled link, the copies and the waits
    for them; with ``predicted`` (:attr:`memsched.Scheduler.predicted_step`), the plan's predicted step
    beside it and measured / predicted. Times in milliseconds."""
    step = summary["step_s"]
    mode = "overlapped" if summary.get("overlap") else "serial"
    title = f"Step time (mean of {summary.get('steps', 1)} steps after warmup, {mode} CPU update)"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("part")
    table.add_column("ms", justify="right")
    table.add_column("of the step", justify="right")

    def row(name: str, seconds: float) -> None:
        table.add_row(name, f"{seconds * 1e3:.1f}", f"{100 * seconds / step:.0f} %" if step > 0 else "-")

    row("step", step)
    for phase in PHASES:
        row(f"  {phase}", summary["phases_s"][phase])
    row("CPU update of host chunks", summary["cpu_update_s"])
    row("  exposed (the training thread waited or ran it)", summary["exposed_cpu_s"])
    row("ideal step (max of the overlapped parts)", summary["ideal_s"])
    if summary.get("h2d_s") or summary.get("d2h_s"):  # the stand-in's modelled link (sim:SIZE,link=...)
        row("H2D copies on the modelled link", summary["h2d_s"])
        row("D2H copies on the modelled link", summary["d2h_s"])
        row("  the training thread waited for copies", summary["copy_wait_s"])
    caption = (f"overlap efficiency {summary['overlap_efficiency']:.2f} (ideal / measured); host clocks: on "
               "CUDA, GPU work not yet reached is not in them")
    if predicted is not None and predicted.get("step_s"):
        how = (f"roofline on {predicted['gpu']}" if predicted.get("model") == "roofline"
               else "from the traced warmup step")
        row(f"predicted step ({how})", predicted["step_s"])
        caption += f"; measured / predicted step {step / predicted['step_s']:.2f}"
    table.caption = caption
    return table
