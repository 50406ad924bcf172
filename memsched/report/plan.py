"""The report's sections on the decision and its traffic: the placement plan (policy, capacity, peak
non-model data, resident model data, GPU margin, budget, optimizer state and gradients on each side, the
parameters kept on the host, the reasons) and the H2D/D2H transfer volumes. Part of
:mod:`memsched.report.text`; :class:`DecisionFigures` is shared with the PNG export
(:mod:`memsched.report.exports.png`), so both show the same figures."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from rich import box
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from policies.types import DEVICE, HOST, PlacementPlan, PlacementProblem
from policies.units import format_bytes

_DEVICE_CHUNK, _HOST_CHUNK, _PARAMS_HOST_CHUNK = "■", "□", "◌"
_TRANSFERS_EXPECTED = "{'h2d_bytes': int, 'd2h_bytes': int, 'steps': int}"


def _chunks(n: int) -> str:
    return f"{n} chunk" if n == 1 else f"{n} chunks"


@dataclass(frozen=True)
class DecisionFigures:
    """The figures of one placement decision, as the plan panel and the PNG show them.

    Attributes:
        policy: the policy that made the plan.
        capacity_bytes: device capacity the plan was made for, bytes.
        peak_non_model_bytes: peak non-model data the plan was made for, bytes.
        resident_model_bytes: model data on the device whatever the plan (compute parameters, buffers, frozen
            parameters; with more than one rank the gradient buffers too), bytes.
        margin_bytes: the GPU margin, ``capacity - peak non-model - resident model``, bytes (negative when
            even those do not fit).
        gpu_margin_mem_ratio: the share of the margin the policy may fill, in [0, 1].
        budget_bytes: the part of the margin the policy allowed itself to fill, bytes.
        device_state_bytes: optimizer-state bytes of the chunks placed on the device, with their gradients
            (one rank), bytes.
        host_state_bytes: optimizer-state bytes of the chunks placed on the host, with their gradients (one
            rank; measured like ``device_state_bytes``: what they would take on the device), bytes.
        host_pinned_bytes: pinned CPU memory the host chunks take (with their fp32 master copy and gradient
            buffer), bytes.
        device_chunks: chunks on the device.
        host_chunks: chunks on the host.
        grad_working_bytes: the host chunks' gradients on the device at once on their way to the host, bytes.
        params_on_host_bytes: parameters the plan keeps on the host, fetched for their reads, bytes (they are
            in ``resident_model_bytes``, which counts every parameter).
        param_host_chunks: chunks whose parameters are on the host.
        fetched_param_bytes: the most of those parameters on the device at once (the schedule's), bytes.
        frozen_bytes: the frozen parameters in chunks of their own (issue 31; their compute buffers, in
            ``resident_model_bytes``), bytes; ``frozen_chunks`` their chunks, ``frozen_on_host_bytes`` those
            the plan keeps on the host (in ``params_on_host_bytes`` too). ``device_chunks`` and
            ``host_chunks`` count the chunks of trainable parameters only.
    """

    policy: str
    capacity_bytes: int
    peak_non_model_bytes: int
    resident_model_bytes: int
    margin_bytes: int
    gpu_margin_mem_ratio: float
    budget_bytes: int
    device_state_bytes: int
    host_state_bytes: int
    host_pinned_bytes: int
    device_chunks: int
    host_chunks: int
    grad_working_bytes: int = 0
    params_on_host_bytes: int = 0
    param_host_chunks: int = 0
    fetched_param_bytes: int = 0
    frozen_bytes: int = 0
    frozen_chunks: int = 0
    frozen_on_host_bytes: int = 0

    @classmethod
    def of(cls, plan: PlacementPlan, problem: PlacementProblem) -> DecisionFigures:
        """The figures of ``plan``, made for ``problem`` (e.g. ``sched.plan`` and ``sched.problem``).

        Raises:
            ValueError: the plan does not belong to the problem (another number of chunks, or another
                margin); the message gives both.
        """
        if len(plan.placement) != len(problem.chunks) or plan.margin_bytes != problem.margin_bytes:
            raise ValueError(
                f"the plan ({len(plan.placement)} chunks, margin {plan.margin_bytes} bytes) was not made for "
                f"this problem ({len(problem.chunks)} chunks, margin {problem.margin_bytes} bytes)")
        placed = list(zip(problem.chunks, plan.placement, strict=True))
        off = plan.param_host_chunks
        per = max((c.param_bytes for c in problem.chunks), default=0)
        frozen = [c for c in problem.chunks if c.frozen]
        return cls(
            policy=plan.policy, capacity_bytes=problem.capacity_bytes,
            peak_non_model_bytes=problem.peak_non_model_bytes,
            resident_model_bytes=problem.resident_model_bytes, margin_bytes=plan.margin_bytes,
            gpu_margin_mem_ratio=problem.gpu_margin_mem_ratio, budget_bytes=plan.budget_bytes,
            device_state_bytes=sum(c.device_bytes for c, where in placed if where == DEVICE),
            host_state_bytes=sum(c.device_bytes for c, where in placed if where == HOST),
            host_pinned_bytes=plan.host_bytes,
            device_chunks=sum(1 for c, where in placed if where == DEVICE and not c.frozen),
            host_chunks=sum(1 for c, where in placed if where == HOST and not c.frozen),
            grad_working_bytes=(problem.host_grad_working_bytes
                                if any(where == HOST and not c.frozen for c, where in placed) else 0),
            params_on_host_bytes=sum(problem.chunks[i].param_bytes for i in off), param_host_chunks=len(off),
            fetched_param_bytes=plan.schedule.max_resident * per if plan.schedule is not None else 0,
            frozen_bytes=sum(c.param_bytes for c in frozen), frozen_chunks=len(frozen),
            frozen_on_host_bytes=sum(c.param_bytes for c in frozen if plan.params_on_host(c.index)))

    @property
    def margin_floor_bytes(self) -> int:
        """Where the margin starts, counted from zero: resident model + peak non-model data, bytes."""
        return self.resident_model_bytes + self.peak_non_model_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> DecisionFigures | None:
        """The figures saved by :meth:`to_dict` (e.g. in a timeline's ``meta["decision"]``); ``None`` when
        ``data`` is not such a dict (an older file, or another tool's key)."""
        if not isinstance(data, Mapping):
            return None
        # figures added since (parameters and gradients placed) read as 0 from an older file
        values = {k: data.get(k, f.default if isinstance(f.default, int) else None)
                  for k, f in cls.__dataclass_fields__.items()}
        ratio = values["gpu_margin_mem_ratio"]
        sizes = [v for k, v in values.items() if k not in ("policy", "gpu_margin_mem_ratio")]
        if not isinstance(values["policy"], str) or isinstance(ratio, bool) \
                or not isinstance(ratio, (int, float)) \
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
            return None
        return cls(**values)

    def rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` lines in words; the plan panel shows them and the PNG's legend uses the same
        labels and figures."""
        fmt = format_bytes
        rows = [
            ("capacity", fmt(self.capacity_bytes)),
            ("peak non-model data", fmt(self.peak_non_model_bytes)),
            ("resident model data", fmt(self.resident_model_bytes)),
            ("GPU margin", f"{fmt(self.margin_bytes)} = capacity - peak non-model - resident model"),
            ("budget", f"{fmt(self.budget_bytes)}, the policy's share of the margin (gpu_margin_mem_ratio "
                       f"{self.gpu_margin_mem_ratio:g})"),
            ("on device", f"{_chunks(self.device_chunks)}, {fmt(self.device_state_bytes)} of optimizer "
                          "states and gradients"),
            ("on host", f"{_chunks(self.host_chunks)}, {fmt(self.host_state_bytes)} of optimizer states and "
                        f"gradients ({fmt(self.host_pinned_bytes)} of pinned memory)"),
        ]
        if self.grad_working_bytes:
            rows.append(("gradients in flight", f"{fmt(self.grad_working_bytes)} of the host chunks' "
                         "gradients on the device at once, on their way to the host"))
        rows.append(("parameters", "all on the device" if not self.param_host_chunks else
                     f"{_chunks(self.param_host_chunks)} ({fmt(self.params_on_host_bytes)}) on the host, "
                     f"fetched for their reads, at most {fmt(self.fetched_param_bytes)} of them on the "
                     "device at once"))
        if self.frozen_chunks:
            rows.append(("frozen parameters", f"{fmt(self.frozen_bytes)} in {_chunks(self.frozen_chunks)} "
                         f"(no gradients, no optimizer state): {fmt(self.frozen_on_host_bytes)} of them on "
                         "the host"))
        return rows


def plan_panel(plan: PlacementPlan, problem: PlacementProblem | None = None) -> Panel:
    """Policy, GPU margin, budget, chunks on device vs host (with bytes) and the policy's reasons.

    With the ``problem`` the plan was made for (``sched.problem``), also the capacity, peak non-model data,
    resident model data and the optimizer-state bytes on each side (:class:`DecisionFigures`, the figures of
    the PNG export).
    """
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("policy", plan.policy)
    if problem is not None:
        for name, value in DecisionFigures.of(plan, problem).rows():
            grid.add_row(name, value)
    else:
        dev, host = plan.device_chunks, plan.host_chunks
        grid.add_row("GPU margin", format_bytes(plan.margin_bytes))
        grid.add_row("budget", format_bytes(plan.budget_bytes))
        grid.add_row("on device",
                     f"{_chunks(len(dev))}, {format_bytes(plan.device_bytes)} of optimizer states and "
                     "gradients")
        grid.add_row("on host", f"{_chunks(len(host))}, {format_bytes(plan.host_bytes)} of pinned memory")
    strip = Text()
    for i, p in enumerate(plan.placement):  # filled, hollow or dotted, so the strip reads without colour too
        if plan.params_on_host(i):
            strip.append(_PARAMS_HOST_CHUNK, style="magenta")
        else:
            on_device = p == DEVICE
            strip.append(_DEVICE_CHUNK if on_device else _HOST_CHUNK, style="green" if on_device else "blue")
    if plan.placement:
        params = f", {_PARAMS_HOST_CHUNK} parameters too" if plan.param_host_chunks else ""
        strip.append(f"  ({_DEVICE_CHUNK} device, {_HOST_CHUNK} host: optimizer state and gradients{params}; "
                     "in first-use order)", style="dim")
        grid.add_row("chunks", strip)
    if plan.options:
        grid.add_row("options", ", ".join(f"{k}={v}" for k, v in plan.options.items()))
    for i, reason in enumerate(plan.reasons):
        grid.add_row("why" if i == 0 else "", f"• {reason}")
    return Panel(grid, title="Placement plan", title_align="left", box=box.ROUNDED)


def transfer_table(transfers: Mapping[str, int]) -> Table:
    """H2D and D2H bytes per step from ``{"h2d_bytes", "d2h_bytes", "steps"}`` (totals over ``steps``).

    The optional keys of ``memsched.devices.transfers.TransferStats.as_dict()`` are shown when present:
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


def host_memory_table(usage: Any) -> Table:
    """Host memory beside the plan (:class:`memsched.telemetry.host_usage.HostUsage`): pinned bytes planned,
    held now and at their peak, with bytes per trainable parameter; the rest of the process's resident set
    (pageable: the program, data, the CPU copies it makes; on the stand-in its device memory too) and the
    process's peak resident set."""
    fmt = format_bytes
    table = Table(title="Host memory", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("what")
    table.add_column("bytes", justify="right")
    table.add_column("per parameter", justify="right")
    n = usage.parameters

    def per(v: int | None) -> str:
        return f"{v / n:.2f} B" if v is not None and n else "-"

    if usage.planned_pinned_bytes is not None:
        table.add_row("pinned, planned", fmt(usage.planned_pinned_bytes), per(usage.planned_pinned_bytes))
    if usage.pinned_bytes is not None:
        table.add_row("pinned, held now", fmt(usage.pinned_bytes), per(usage.pinned_bytes))
        table.add_row("pinned, peak", fmt(usage.max_pinned_bytes), per(usage.max_pinned_bytes))
    pageable = usage.rss_bytes - (usage.pinned_bytes or 0)
    table.add_row("pageable now (rest of the process)", fmt(max(0, pageable)), "-")
    table.add_row("process peak (resident set)", fmt(usage.max_rss_bytes), "-")
    return table


def plan_check_table(check: Any) -> Table:
    """The runtime plan against ``memsched plan``'s (:class:`memsched.planning.plan_check.PlanCheck`): one row
    per compared figure, then whether they agree, or each difference."""
    verdict = "agree" if check.agrees else "differ"
    table = Table(title=f"Plan check: this run against memsched plan ({check.policy}): they {verdict}",
                  title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("what")
    table.add_column("memsched plan", justify="right")
    table.add_column("this run", justify="right")
    for what, cli, run in check.rows:
        table.add_row(what, cli, run)
    if not check.agrees:
        table.caption = "\n".join(f"- {d}" for d in check.differences)
        table.caption_justify = "left"
    return table
