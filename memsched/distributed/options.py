"""The data-parallel options of :func:`memsched.attach`, checked without torch: the ZeRO stage, how updated
shards are fetched, where chunks are built, the attach barrier's timeout (:class:`DataParallelConfig`)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DataParallelConfig:
    """ZeRO options (ignored with one rank): stage, how updated shards are fetched, the group, the attach
    barrier's timeout, where chunks are built, and the bound on each wait for a collective during training
    (:data:`COLLECTIVE_TIMEOUT_S` by default; ``None``: the process group's timeout)."""

    zero_stage: int
    fetch: str
    process_group: Any
    timeout: datetime.timedelta | None
    chunk_build: str
    collective_timeout: datetime.timedelta | None = datetime.timedelta(seconds=60)



ZERO_STAGES = (0, 1, 2, 3)
#: Default bound, seconds, on each wait for a collective during training (attach's ``collective_timeout``):
#: a rank that runs other modules than its peers (a rank-dependent branch, rank-0-only evaluation) or that
#: died makes the others wait; this bounds the wait and names the likely causes, where the process group's
#: own timeout is 30 minutes by default.
COLLECTIVE_TIMEOUT_S = 60.0
FETCH_MODES = ("all_gather", "all_reduce")


def check_zero_options(zero_stage: Any, fetch: Any) -> tuple[int, str]:
    """Validate ``zero_stage`` and ``fetch`` of :func:`memsched.attach`.

    Raises:
        ValueError: ``zero_stage`` not in (0, 1, 2, 3) or ``fetch`` not in ("all_gather", "all_reduce"); the
            message names the value and the allowed ones.
    """
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(
            f"zero_stage must be one of {ZERO_STAGES} (0 = plain data parallel, 1 = optimizer "
            f"state sharded, 2 = gradients sharded too, 3 = parameters sharded too), got {zero_stage!r}"
        )
    if fetch not in FETCH_MODES:
        raise ValueError(f"fetch must be one of {FETCH_MODES}, got {fetch!r}")
    return int(zero_stage), str(fetch)



BUILD_MODES = ("auto", "device", "cpu")


def check_build_mode(mode: object) -> str:
    """Raises ValueError naming ``mode`` and the allowed values unless it is one of :data:`BUILD_MODES`."""
    if mode not in BUILD_MODES:
        raise ValueError(f"chunk_build must be one of {BUILD_MODES}, got {mode!r}")
    return str(mode)



def as_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    """``timeout`` (seconds or a timedelta; ``None`` = the process group's) as a timedelta.

    Raises:
        ValueError: not a positive number of seconds.
    """
    if timeout is None or isinstance(timeout, datetime.timedelta):
        if timeout is not None and timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0 or a datetime.timedelta, got {timeout!r}")
    return datetime.timedelta(seconds=float(timeout))
