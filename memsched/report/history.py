"""The plan-history section of the report: every placement plan in force since warmup and why
(:attr:`memsched.Scheduler.plan_history`, :mod:`memsched.planning.elastic`)."""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.table import Table

from memsched.planning.elastic import PlanChange
from policies.types import DEVICE
from policies.units import format_bytes


def plan_history_table(history: Sequence[PlanChange]) -> Table:
    """One row per plan: the optimizer step it took effect at, chunks on the device, the peak non-model data
    it was made for (bytes; "-" for a measured all-host step), the optimizer state it moved, the reason."""
    table = Table(title=f"Plan history ({len(history)} plans)", title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (("step", "right"), ("chunks on device", "right"), ("planned peak", "right"),
                          ("moved", "right"), ("reason", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for h in history:
        on_device = sum(p == DEVICE for p in h.plan.placement)
        peak = h.predicted_peak_non_model_bytes
        table.add_row(str(h.step), f"{on_device} of {len(h.plan.placement)}",
                      format_bytes(peak) if peak is not None else "-", format_bytes(h.moved_bytes), h.reason)
    return table
