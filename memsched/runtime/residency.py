"""Which offloaded parameter chunks are on the device, and the moves that change it: fetch, ready, evict.

:class:`Residency` owns the offloaded chunks on the device (least recently read first), the chunk read last,
the chunks read together now (pinned: none of them leaves to make room for another), the counters of its
moves and the fewest resident bytes since a measurement began (for the elastic peak probe). A chunk's
lifecycle here: away; fetched (:meth:`Residency.fetch`: its compute buffer allocated and the H2D copy of its
host values, asynchronous on CUDA and on the stand-in's link, or at ZeRO-3 its all-gather, started; resident
from then on); ready (:meth:`Residency.ready`: its update and copy done, its parameters bound to their
views; the most recently read); evicted (:meth:`Residency.evict`: the buffer dropped, its parameters absent
views while computing ([Note: absent parameters] in :mod:`memsched.chunks.store`) and host views between
steps, or at ZeRO-3 this rank's shard). It decides nothing: the parameter fetcher
(:class:`memsched.runtime.param_fetch.ParamFetcher`) says what to fetch and evict, on the schedule ([Note:
parameter fetches] in :mod:`memsched.runtime.fetch_schedule`).

Nothing holds an evicted buffer afterwards but an op still reading it or a copy in flight, which free it
when done. The read guard watches an evicted chunk's parameters again (a later read fetches it) and the
saved-tensor hooks the buffers fetched ([Note: saved tensors across a re-plan] in
:mod:`memsched.runtime.saved_params`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

import torch

from memsched.chunks import Chunk, ChunkStore
from memsched.devices.simdevice import OUT_OF_MEMORY
from memsched.devices.transfers import Streams, TransferStats
from memsched.distributed.sharded_params import ParamShards
from memsched.runtime.read_guard import ReadGuard
from memsched.runtime.saved_params import SavedParams


class Residency:
    """The offloaded chunks on the device and their moves (see the module docstring).

    Args:
        store: the chunks.
        streams: the H2D copies' streams.
        transfers: byte counters (fetches count as H2D).
        wait_update: ``f(chunk_index)`` blocking until the CPU update of a chunk is done.
        shards: ZeRO-3: a chunk away keeps this rank's shard and is all-gathered back.
        saved: the saved-tensor hooks, told of the buffers fetched and evicted.
        guard: the read guard, which watches the parameters of an evicted chunk again.
        on_move: ``f(nbytes)``: the stand-in leaves fetched buffers out of its fixed peak
            (:meth:`memsched.devices.simdevice.SimDevice.move`).

    Attributes:
        stats: ``fetches``, ``prefetches``, ``demand_fetches``, ``misses`` (reads off the schedule),
            ``evictions``, ``fetched_bytes`` since the last :meth:`take_stats`.
        last: ``(chunk, phase)`` read last and ready: its repeated reads cost nothing (a read in the other
            phase is another access of the schedule).
    """

    def __init__(self, store: ChunkStore, streams: Streams, transfers: TransferStats,
                 wait_update: Callable[[int], None], shards: ParamShards | None, saved: SavedParams,
                 guard: ReadGuard, *, on_move: Callable[[int], None] | None = None) -> None:
        self._store, self._streams, self._transfers = store, streams, transfers
        self._wait_update, self._shards, self._saved, self._guard = wait_update, shards, saved, guard
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident offloaded chunks, least recent first
        self.last: tuple[int, str] | None = None
        self._pinned: frozenset[int] = frozenset()  # chunks read together now: none of them leaves
        self.stats = self._zero_stats()
        self._res_begin = self._res_min = 0
        self._classify: Callable[[torch.Tensor], None] | None = None  # warmup: the tracer's (classify_with)
        self.on_move: Callable[[int], None] = on_move if on_move is not None else lambda nbytes: None

    # ---- what is resident ---------------------------------------------------------------------------------
    def order(self) -> list[int]:
        """The offloaded chunks on the device (or on their way), least recently read first."""
        return list(self._lru)

    def holds(self, i: int) -> bool:
        """Whether offloaded chunk ``i`` is on the device (or on its way)."""
        return i in self._lru

    @property
    def pinned(self) -> frozenset[int]:
        """The chunks read together now."""
        return self._pinned

    @contextlib.contextmanager
    def pin(self, indices: Iterable[int]) -> Iterator[None]:
        """Chunks ``indices`` are read together: none of them leaves to make room for another meanwhile."""
        self._pinned = frozenset(indices)
        try:
            yield
        finally:
            self._pinned = frozenset()

    def mark_read(self, i: int, phase: str) -> None:
        """Chunk ``i`` was read (in ``phase``) and is ready: its repeated reads cost nothing."""
        self.last = (i, phase)

    def forget_last(self) -> None:
        """No chunk counts as read last (a forward begins, the chunks settle between steps)."""
        self.last = None

    def classify_with(self, classify: Callable[[torch.Tensor], None] | None) -> None:
        """Warmup: ``classify(buffer)`` (the tracer's) is told of each buffer fetched from now on (``None``:
        none is)."""
        self._classify = classify

    def adopt(self, c: Chunk) -> None:
        """``c`` is offloaded from now on: resident until now, it is model data that moves."""
        if self._store.resident(c) and c.index not in self._lru:
            self._lru[c.index] = None
            self.on_move(c.data_bytes)

    def keep_on_device(self, c: Chunk) -> None:
        """``c`` stays on the device from now on (no longer offloaded): fetched if away (and waited for), it
        no longer moves.

        Raises:
            torch.OutOfMemoryError (or the stand-in's): it does not fit.
        """
        if not self._store.resident(c):
            self.fetch(c, wait=True)
        if self._lru.pop(c.index, "away") is None:  # fetched: from now on it is not model data that moves
            self.on_move(-c.data_bytes)

    def forget(self) -> None:
        """The chunks were re-packed: none is counted resident (their indices are new)."""
        self._lru.clear()
        self.forget_last()

    # ---- the resident parameters over a step, for the elastic peak probe --------------------------------
    def begin(self) -> None:
        """A measurement begins: remember the host-placed chunks on the device now and start tracking the
        fewest of them on the device at once ([Note: parameters in the measured peak] in
        :mod:`memsched.planning.elastic`)."""
        self._res_begin = self._res_min = self._resident_bytes()

    def correction(self) -> int:
        """Bytes of host-placed parameter chunks on the device at the measurement's begin less the fewest on
        it at once since."""
        return self._res_begin - min(self._res_min, self._resident_bytes())

    def _resident_bytes(self) -> int:
        return sum(self._store.chunks[i].data_bytes for i in self._lru)

    @staticmethod
    def _zero_stats() -> dict[str, int]:
        return dict.fromkeys(("fetches", "prefetches", "demand_fetches", "misses", "evictions",
                              "fetched_bytes"), 0)

    def take_stats(self) -> dict[str, int]:
        """The counters since the last call (which restarts them)."""
        out, self.stats = self.stats, self._zero_stats()
        return out

    # ---- the moves ----------------------------------------------------------------------------------------
    def ready(self, c: Chunk) -> None:
        """``c`` on the device, its update and H2D copy done, its parameters bound to their views."""
        self._wait_update(c.index)
        if not self._store.resident(c):
            self.stats["demand_fetches"] += 1
            self.fetch(c, wait=False)
        if self._shards is not None:
            self._shards.wait(c)
        elif c.h2d_event is not None:  # a wait that blocks is a span of the step timeline (Streams.wait)
            self._streams.wait([c.h2d_event], f"fetch <- chunk {c.index}")
            if not self._streams.cuda:
                c.forget_h2d()
        self._lru.pop(c.index, None)
        self._lru[c.index] = None
        self._res_min = min(self._res_min, self._resident_bytes())
        if self._store.bindings.computing:  # host-bound since the forward's end, or absent: its device views
            self._store.bindings.to_device(c)
        # the read guard keeps watching its parameters: the schedule follows every read of them, as the
        # recording saw them all

    def fetch(self, c: Chunk, *, wait: bool) -> None:
        """Allocate ``c``'s compute buffer and start the H2D copy of its host values (after its CPU update).

        Raises:
            torch.OutOfMemoryError (or the stand-in's): no room even after the other offloaded chunks left.
        """
        store = self._store
        self._wait_update(c.index)
        self.on_move(c.data_bytes)
        try:
            try:
                data = store.alloc.device_empty(c.numel, c.dtype)
            except OUT_OF_MEMORY:
                # make room: every other offloaded chunk leaves (not those read now)
                for j in list(self._lru):
                    if j != c.index and j not in self._pinned:
                        self.evict(store.chunks[j])
                data = store.alloc.device_empty(c.numel, c.dtype)
        except BaseException:
            self.on_move(-c.data_bytes)
            raise
        if self._classify is not None:
            self._classify(data)
        if self._shards is not None:  # ZeRO-3: every rank's shard, all-gathered
            store.bindings.data_arrived(c, data)
            self._lru[c.index] = None
            if c.param_shard is None and c.param_host is not None:  # this rank's part is on the host
                with store.alloc.host_context():
                    self._transfers.add_h2d(c.start_h2d(self._streams, c.param_host))
            self._shards.gather(c, data)
            self.stats["fetches"] += 1
            self.stats["fetched_bytes"] += c.data_bytes
            self._saved.watch_buffer(c, data)
            if wait:
                self._shards.wait(c)
            return
        if c.hi - c.lo < c.numel:  # the padding beyond the shard is never read; zero it for determinism
            data[c.hi:].zero_()
            data[:c.lo].zero_()
        store.bindings.data_arrived(c, data)
        self._lru[c.index] = None  # on the device (a prefetch too, until it is read or leaves)
        with store.alloc.host_context():
            nbytes = c.start_h2d(self._streams, c.param_host)
        self._transfers.add_h2d(nbytes)
        self.stats["fetches"] += 1
        self.stats["fetched_bytes"] += nbytes
        self._saved.watch_buffer(c, data)
        if wait:
            c.wait_h2d()

    def evict(self, c: Chunk) -> None:
        """``c``'s compute buffer leaves the device (at ZeRO-3 this rank's shard stays)."""
        if not self._store.resident(c):
            return
        self._saved.unwatch(c)
        if self._shards is not None:  # ZeRO-3: this rank's shard stays on the device
            self._wait_update(c.index)
            self._shards.release(c)
            self._store.bindings.to_sharded(c)
        else:
            self._store.bindings.data_leaves(c)
        if self._lru.pop(c.index, "away") is None:  # fetched (counted as moving); not: resident until now
            self.on_move(-c.data_bytes)
        self._res_min = min(self._res_min, self._resident_bytes())
        self.stats["evictions"] += 1
        if self.last is not None and self.last[0] == c.index:
            self.last = None
        self._guard.watch(c.params, c.index)  # a later read of its parameters fetches it again

    def read_with(self, i: int) -> set[int]:
        """Chunk ``i``, those read together with it now and the one read last."""
        return {i, *self._pinned, *([] if self.last is None else [self.last[0]])}

    def evict_on_demand(self, i: int, budget: int | None) -> None:
        """Chunk ``i`` is read on demand: the least recently read leave until ``budget`` chunks are on the
        device with it (``None``: only :meth:`read_with`), but none of those read with it."""
        keep = self.read_with(i)
        budget = len(keep) if budget is None else budget
        for j in list(self._lru)[:max(0, len(self._lru) + 1 - budget)]:
            if j not in keep:
                self.evict(self._store.chunks[j])

    def evict_all(self) -> None:
        """Every resident offloaded chunk leaves; none was read last."""
        self.evict_except(())
        self.forget_last()

    def evict_except(self, keep: Iterable[int]) -> None:
        """Every resident offloaded chunk not in ``keep`` leaves."""
        keep = set(keep)
        for j in list(self._lru):
            if j not in keep:
                self.evict(self._store.chunks[j])

    def bind_whole(self) -> None:
        """ZeRO-3: every chunk on the device, gathered ahead or not, is whole and its parameters are its
        views (between steps and at a forward's begin: the binding check expects them there)."""
        assert self._shards is not None
        with torch._C.DisableTorchFunction(), torch.inference_mode(False):
            for i in list(self._lru):
                c = self._store.chunks[i]
                self._shards.wait(c)
                self._store.bindings.to_device(c)
