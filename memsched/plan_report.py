"""The report's sections on the decision and its traffic: the placement plan (policy, GPU margin, budget,
chunks on each side, the reasons) and the H2D/D2H transfer volumes. Part of :mod:`memsched.report`."""

from __future__ import annotations

from collections.abc import Mapping

from rich import box
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from policies.types import PlacementPlan
from policies.units import format_bytes

_DEVICE_CHUNK, _HOST_CHUNK = "■", "□"
_TRANSFERS_EXPECTED = "{'h2d_bytes': int, 'd2h_bytes': int, 'steps': int}"


def _chunks(n: int) -> str:
    return f"{n} chunk" if n == 1 else f"{n} chunks"


def plan_panel(plan: PlacementPlan) -> Panel:
    """Policy, GPU margin, budget, chunks on device vs host (with bytes) and the policy's reasons."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("policy", plan.policy)
    grid.add_row("GPU margin", format_bytes(plan.margin_bytes))
    grid.add_row("budget", format_bytes(plan.budget_bytes))
    dev, host = plan.device_chunks, plan.host_chunks
    grid.add_row("on device", f"{_chunks(len(dev))}, {format_bytes(plan.device_bytes)} of optimizer states")
    grid.add_row("on host", f"{_chunks(len(host))}, {format_bytes(plan.host_bytes)} of pinned memory")
    strip = Text()
    for p in plan.placement:  # a filled or hollow square, so the strip reads without colour too
        on_device = p == "device"
        strip.append(_DEVICE_CHUNK if on_device else _HOST_CHUNK, style="green" if on_device else "blue")
    if plan.placement:
        strip.append(f"  ({_DEVICE_CHUNK} device, {_HOST_CHUNK} host; in first-use order)", style="dim")
        grid.add_row("chunks", strip)
    if plan.options:
        grid.add_row("options", ", ".join(f"{k}={v}" for k, v in plan.options.items()))
    for i, reason in enumerate(plan.reasons):
        grid.add_row("why" if i == 0 else "", f"• {reason}")
    return Panel(grid, title="Placement plan", title_align="left", box=box.ROUNDED)


def transfer_table(transfers: Mapping[str, int]) -> Table:
    """H2D and D2H bytes per step from ``{"h2d_bytes", "d2h_bytes", "steps"}`` (totals over ``steps``).

    The optional keys of ``memsched.transfers.TransferStats.as_dict()`` are shown when present:
    ``last_h2d_bytes`` / ``last_d2h_bytes`` (the last step) and ``chunk_moves_bytes`` (one-off moves).
    """
    if not isinstance(transfers, Mapping):
        raise ValueError(f"transfers must be a dict like {_TRANSFERS_EXPECTED}, got {transfers!r}")
    optional = ("last_h2d_bytes", "last_d2h_bytes", "chunk_moves_bytes")
    for key in ("h2d_bytes", "d2h_bytes", "steps", *optional):
        value = transfers.get(key)
        if value is None and key in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"transfers[{key!r}] must be an integer >= 0, got {value!r}; expected {_TRANSFERS_EXPECTED}"
            )
    steps = transfers["steps"]
    last = "last_h2d_bytes" in transfers and "last_d2h_bytes" in transfers
    table = Table(title=f"Transfers over {steps} steps", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("direction")
    table.add_column("per step (mean)", justify="right")
    if last:
        table.add_column("last step", justify="right")
    table.add_column("total", justify="right")
    for name, key in (("H2D (host to device)", "h2d_bytes"), ("D2H (device to host)", "d2h_bytes")):
        total = transfers[key]
        cells = [name, format_bytes(total / steps) if steps else "-"]
        if last:
            cells.append(format_bytes(transfers[f"last_{key}"]))
        table.add_row(*cells, format_bytes(total))
    if transfers.get("chunk_moves_bytes"):
        table.caption = f"plus {format_bytes(transfers['chunk_moves_bytes'])} moved once to apply the plan"
    return table
