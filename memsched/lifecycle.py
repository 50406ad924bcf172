"""Where a :class:`memsched.Scheduler` is in its life (the story is in :mod:`memsched.scheduler`)."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """A scheduler's phase; it only moves forward: WARMUP -> (PLAN_FAILED | PLANNED) -> CLOSED."""

    WARMUP = "warmup"  # traced steps; all optimizer state on the host
    PLANNED = "planned"  # the plan is applied; no tracing cost
    PLAN_FAILED = "plan failed"  # the policy found no plan; the state stays on the host, training goes on
    CLOSED = "closed"  # hooks, modes and accounting removed
