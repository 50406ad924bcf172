"""The event log of :class:`tracer.accounting.StorageAccountant`, and how it folds into per-device counters.

The accountant's hot path (every aten op) only appends events; the counters and exact peaks are computed when
someone asks (:func:`fold`). An allocation and a free are logged as the storage's :class:`Entry` itself (its
first appearance is the allocation, a later one its free); the rare ones as ``(kind, entry, arg)``: ``MOVE``
(reclassified to category index ``arg``) and ``GROW`` (``arg`` more bytes, a resize)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from tracer.categories import ALL_CATEGORIES, NON_MODEL_DATA, Category

MOVE, GROW = 1, 2
_IS_NON_MODEL: tuple[bool, ...] = tuple(c in NON_MODEL_DATA for c in ALL_CATEGORIES)
_GRADIENT = ALL_CATEGORIES.index(Category.GRADIENT)


class Entry(weakref.ref):
    """A weak reference to a storage that carries its accounting record (no closure per storage)."""

    __slots__ = ("key", "nbytes", "cur", "cat", "dev", "counted", "cbytes")


class DeviceState:
    """One device's folded counters (bytes): per category, total, non-model data, and their peaks, plus the
    peak of non-model data and gradients together (``peak_non_model_grad``: what the device holds besides
    parameters, buffers and optimizer state, where gradients come and go)."""

    __slots__ = ("counts", "total", "non_model", "peak_total", "peak_non_model", "peak_non_model_grad")

    def __init__(self) -> None:
        self.counts = [0] * len(ALL_CATEGORIES)
        self.total = 0
        self.non_model = 0
        self.peak_total = 0
        self.peak_non_model = 0
        self.peak_non_model_grad = 0

    def add(self, c: int, n: int, non_model: bool) -> None:
        """``n`` bytes more in category index ``c`` (an allocation, or a storage that grew)."""
        self.counts[c] += n
        self.total += n
        if self.total > self.peak_total:
            self.peak_total = self.total
        if non_model:
            self.non_model += n
            if self.non_model > self.peak_non_model:
                self.peak_non_model = self.non_model
        if non_model or c == _GRADIENT:
            self.bump_non_model_grad()

    def bump_non_model_grad(self) -> None:
        now = self.non_model + self.counts[_GRADIENT]
        if now > self.peak_non_model_grad:
            self.peak_non_model_grad = now

    def restart_peaks(self) -> tuple[int, int, int]:
        """The three peaks since the last restart (total, non-model, non-model and gradients), then start a
        new interval at the current values."""
        peaks = self.peak_total, self.peak_non_model, self.peak_non_model_grad
        self.peak_total, self.peak_non_model = self.total, self.non_model
        self.peak_non_model_grad = self.non_model + self.counts[_GRADIENT]
        return peaks


def fold(log: list, state_of: Callable[[str], DeviceState]) -> None:
    """Apply the events of ``log`` (oldest first) to the device states ``state_of(device name)``: live bytes
    per category, total and non-model data, and their peaks (bytes)."""
    nm_flag = _IS_NON_MODEL
    last_dev, s = None, None
    for ev in log:
        if type(ev) is Entry:
            e = ev
            if e.dev is not last_dev:
                last_dev, s = e.dev, state_of(e.dev)
            c = e.counted
            if c < 0:  # allocation
                c = e.cat
                e.counted, e.cbytes = c, e.nbytes
                s.add(c, e.nbytes, nm_flag[c])
            else:  # free
                n = e.cbytes
                s.counts[c] -= n
                s.total -= n
                if nm_flag[c]:
                    s.non_model -= n
            continue
        kind, e, arg = ev
        if e.dev is not last_dev:
            last_dev, s = e.dev, state_of(e.dev)
        c = e.counted
        if kind == MOVE:
            if arg == c:
                continue
            n = e.cbytes
            s.counts[c] -= n
            s.counts[arg] += n
            e.counted = arg
            if nm_flag[c]:
                s.non_model -= n
            if nm_flag[arg]:
                s.non_model += n
                if s.non_model > s.peak_non_model:
                    s.peak_non_model = s.non_model
            s.bump_non_model_grad()
        else:  # GROW
            e.cbytes += arg
            s.add(c, arg, nm_flag[c])
