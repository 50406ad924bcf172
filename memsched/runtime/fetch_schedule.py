"""Where the step is in the plan's fetch schedule: the schedule followed, its cursor and its misses.

:class:`ScheduleCursor` owns the :class:`policies.types.ParamSchedule` the parameter fetcher follows, the
position of the access in progress, the reads off it (:attr:`ScheduleCursor.misses`) and the
:class:`FetchMode`, changed only by its named transitions: :meth:`ScheduleCursor.follow` (a plan's schedule,
or none), a miss at :meth:`ScheduleCursor.advance`, :meth:`ScheduleCursor.resume` (the plan was revised and
kept the schedule) and :meth:`ScheduleCursor.drop` (a re-pack: the chunk indices are new). Each forward that
records a graph starts it again (:meth:`ScheduleCursor.restart`). It moves no chunk:
:meth:`ScheduleCursor.advance` says which chunks should be on the device after a read, and the fetcher
(:class:`memsched.runtime.param_fetch.ParamFetcher`) fetches and evicts them
(:class:`memsched.runtime.residency.Residency`).

[Note: parameter fetches]
The schedule lists the step's reads of offloaded chunks and, after each, the chunks that should be on the
device (or on their way). A read that is the next one listed (or one a few further: a shorter branch skipped
some) applies its targets: chunks not in them leave, chunks in them that are away are fetched ahead (unless
their CPU update is still running, or the device has no room for them now: then they come at their read).
A read the schedule does not expect (a new branch) is a miss: the chunk is fetched on demand and, until
the plan is revised, every read is: only the chunks read now and the one read last stay on the device
(what else the device holds at each point is no longer known); the next step records its reads and the
plan is made again from them (:meth:`memsched.planning.planner.Planner.revise`). Reads never see stale
values: a chunk is read only after its update and its H2D copy are done. Without a schedule (warmup, or a
plan without one) every read is on demand, with ``demand_resident`` chunks kept. At backward's end the
chunks the schedule keeps for the next step stay; the others leave, so nothing is left in flight into the
step.
"""

from __future__ import annotations

import enum

from policies.types import BACKWARD, ParamSchedule

#: How many scheduled reads ahead a read that is not the next one may be found (a skipped branch).
LOOKAHEAD = 8


class FetchMode(enum.Enum):
    """How the fetcher's reads are served: one state, changed only by the cursor's named transitions.

    * ``ON_DEMAND``: no schedule (warmup, a plan without one, a re-pack): each chunk fetched at its read,
      ``demand_resident`` kept.
    * ``ON_SCHEDULE``: each read applies the schedule's targets ([Note: parameter fetches]).
    * ``OFF_SCHEDULE``: a read missed the schedule: every read on demand, as few chunks kept as possible,
      until the plan is revised (:meth:`ScheduleCursor.resume`, or :meth:`ScheduleCursor.follow` a new one).
    """

    ON_DEMAND = "on demand"
    ON_SCHEDULE = "on schedule"
    OFF_SCHEDULE = "off schedule"


class Unlisted(enum.Enum):
    """What :meth:`ScheduleCursor.advance` answers for a read it has no targets for."""

    AGAIN = "again"  # the access in progress, read again: nothing to do
    MISS = "miss"  # the schedule does not expect it: off the schedule from now on
    ON_DEMAND = "on demand"  # no schedule followed: the read is served on demand


class ScheduleCursor:
    """The schedule followed and the access in progress (see the module docstring).

    Attributes:
        schedule: the plan's schedule, or ``None`` (every read on demand).
        mode: the :class:`FetchMode`.
        misses: reads off the schedule since it was followed (the scheduler revises the plan after a step with
            some: :meth:`memsched.planning.planner.Planner.revise`).
    """

    def __init__(self) -> None:
        self.schedule: ParamSchedule | None = None
        self.mode = FetchMode.ON_DEMAND
        self.misses = 0
        self._cursor = 0  # the next access expected

    def follow(self, schedule: ParamSchedule | None) -> None:
        """Follow ``schedule`` from now on (``None``: every read on demand); no miss yet."""
        self.schedule = schedule
        self.misses = 0
        self.mode = FetchMode.ON_DEMAND if schedule is None else FetchMode.ON_SCHEDULE

    def resume(self) -> None:
        """The plan was revised and kept this schedule: follow it again."""
        self.misses = 0
        self.mode = FetchMode.ON_DEMAND if self.schedule is None else FetchMode.ON_SCHEDULE

    def drop(self) -> None:
        """No schedule (the chunks were re-packed: their indices are new), from the start."""
        self.schedule, self._cursor, self.mode = None, 0, FetchMode.ON_DEMAND

    def restart(self) -> None:
        """A step's forward begins: its reads are the schedule's from the first."""
        self._cursor = 0

    def advance(self, i: int, phase: str) -> tuple[int, ...] | Unlisted:
        """Chunk ``i`` is read in ``phase``: the schedule's targets at this read (the access in progress
        from now on), or why there are none (see [Note: parameter fetches])."""
        if self.mode is not FetchMode.ON_SCHEDULE:
            return Unlisted.ON_DEMAND
        assert self.schedule is not None
        acc = self.schedule.accesses
        now = acc[self._cursor - 1] if self._cursor > 0 else None
        if now is not None and (now.chunk, now.phase) == (i, phase):  # the access in progress, read again
            return Unlisted.AGAIN
        end = min(len(acc), self._cursor + LOOKAHEAD)
        pos = next((k for k in range(self._cursor, end) if acc[k].chunk == i and acc[k].phase == phase), None)
        if pos is None and phase == BACKWARD:  # backward begins: its reads follow forward's
            start = next((k for k, a in enumerate(acc) if a.phase == BACKWARD), len(acc))
            if self._cursor <= start:
                pos = next((k for k in range(start, min(len(acc), start + LOOKAHEAD)) if acc[k].chunk == i),
                           None)
        if pos is None:
            # Off the schedule until it is revised: what is on the device beside the non-model data at each
            # point is no longer known (the gradients in flight, say, differ)
            self.misses += 1
            self.mode = FetchMode.OFF_SCHEDULE
            return Unlisted.MISS
        self._cursor = pos + 1
        return self.schedule.targets[pos]
