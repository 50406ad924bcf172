"""Per-rank reports of a ZeRO run: every rank's warmup timeline merged into one Perfetto trace
(``pid`` = rank) and a summary table with one row per rank.

The timelines and summaries are gathered to one rank with ``torch.distributed.gather_object`` (as plain
dicts); the merge itself is :func:`memsched.report.exports.to_perfetto`, the table is a ``rich`` table.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from policies.types import DEVICE, HOST
from policies.units import format_bytes
from tracer.timeline import MemoryTimeline


@dataclass(frozen=True)
class RankSummary:
    """One rank's numbers (bytes unless named otherwise).

    Attributes:
        rank, world: this rank in the data-parallel group and the group's size.
        device: the compute device (``"cuda:0"``, ``"cpu"``, ``"sim"``).
        peak_bytes, peak_non_model_bytes: peaks of the warmup trace on the compute device (0 before the
            warmup ends).
        optimizer_state_bytes: optimizer state this rank holds (its shards of every chunk; host buffers
            included).
        device_chunks, host_chunks: chunks whose state is on the device / in host memory.
        h2d_bytes, d2h_bytes: bytes copied between device and host so far.
        reduce_bytes, fetch_bytes: bytes this rank sent into gradient reductions / parameter fetches (ring
            estimates: ``2 (w-1)/w`` of the buffer for an all-reduce, ``(w-1)/w`` for a reduce-scatter or an
            all-gather).
        steps: optimizer steps taken.
    """

    rank: int
    world: int
    device: str
    peak_bytes: int
    peak_non_model_bytes: int
    optimizer_state_bytes: int
    device_chunks: int
    host_chunks: int
    h2d_bytes: int
    d2h_bytes: int
    reduce_bytes: int
    fetch_bytes: int
    steps: int


def rank_summary(sched: Any) -> RankSummary:
    """This rank's :class:`RankSummary` (no communication)."""
    zero = sched.zero
    tl = sched.timeline
    chunks = sched.store.chunks
    t = sched.transfers
    return RankSummary(
        rank=zero.rank if zero is not None else 0,
        world=zero.world if zero is not None else 1,
        device=sched.device.name,
        peak_bytes=int(tl.peak_bytes()) if tl is not None else 0,
        peak_non_model_bytes=int(tl.peak_non_model_bytes()) if tl is not None else 0,
        optimizer_state_bytes=sum(c.state_nbytes() for c in chunks),
        device_chunks=sum(c.placement == DEVICE for c in chunks),
        host_chunks=sum(c.placement == HOST for c in chunks),
        h2d_bytes=t.h2d_bytes,
        d2h_bytes=t.d2h_bytes,
        reduce_bytes=zero.stats["reduce_bytes"] if zero is not None else 0,
        fetch_bytes=zero.stats["fetch_bytes"] if zero is not None else 0,
        steps=t.steps,
    )


def gather_rank_reports(
    sched: Any,
    *,
    dst_rank: int = 0,
) -> tuple[list[MemoryTimeline], list[RankSummary]] | None:
    """Every rank's warmup timeline (``meta["rank"]`` set to the rank in the group) and summary, on group
    rank ``dst_rank`` (``None`` on the others). A collective: call it on every rank.

    Raises:
        ValueError: there is no timeline yet (the warmup steps have not ended).
    """
    if sched.timeline is None:
        raise ValueError("no timeline yet: per-rank reports are available after the warmup steps")
    summary = rank_summary(sched)
    tl = sched.timeline.to_dict()
    tl["meta"] = {**tl.get("meta", {}), "rank": summary.rank, "world_size": summary.world}
    payload = {"timeline": tl, "summary": asdict(summary)}
    if sched.zero is None:
        got: list[Any] | None = [payload]
    else:
        got = sched.zero.comm.gather_object(payload, dst_rank=dst_rank, what="gathering per-rank reports")
    if got is None:
        return None
    return (
        [MemoryTimeline.from_dict(g["timeline"]) for g in got],
        [RankSummary(**g["summary"]) for g in got],
    )


def rank_table(rows: list[RankSummary]) -> Table:
    """A ``rich`` table with one row per rank (bytes as KiB/MiB/GiB, powers of 2)."""
    table = Table(title="memsched: per-rank summary")
    for col in (
        "rank",
        "device",
        "peak",
        "peak non-model",
        "optimizer state",
        "chunks dev/host",
        "H2D",
        "D2H",
        "reduce sent",
        "fetch sent",
        "steps",
    ):
        table.add_column(col, justify="left" if col == "device" else "right")
    for r in sorted(rows, key=lambda r: r.rank):
        table.add_row(
            str(r.rank),
            r.device,
            format_bytes(r.peak_bytes),
            format_bytes(r.peak_non_model_bytes),
            format_bytes(r.optimizer_state_bytes),
            f"{r.device_chunks}/{r.host_chunks}",
            format_bytes(r.h2d_bytes),
            format_bytes(r.d2h_bytes),
            format_bytes(r.reduce_bytes),
            format_bytes(r.fetch_bytes),
            str(r.steps),
        )
    return table


def write_rank_reports(
    sched: Any,
    perfetto_path: str | os.PathLike[str],
    *,
    dst_rank: int = 0,
) -> tuple[Path, Table] | None:
    """Gather (:func:`gather_rank_reports`) and, on ``dst_rank``, write the merged Perfetto trace to
    ``perfetto_path``; returns ``(path, table)`` there and ``None`` elsewhere. A collective."""
    from memsched.report.exports import write_perfetto

    got = gather_rank_reports(sched, dst_rank=dst_rank)
    if got is None:
        return None
    timelines, rows = got
    return write_perfetto(timelines, perfetto_path), rank_table(rows)
