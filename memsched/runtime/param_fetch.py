"""Parameters that live on the host (one rank) or on other ranks (ZeRO-3) come to the device for their reads.

A plan may keep some chunks' parameters on the host (:attr:`policies.PlacementPlan.param_placement`): their
optimizer state and gradients are there too, and their values live in the chunk's host buffer
(``param_host``). :class:`ParamFetcher` brings such a chunk to the device before a read needs it and lets it
go after, on the schedule the plan made from the warmup trace (:func:`policies.schedule.schedule_params`):

* **Reads.** A chunk is read by the forward of a module that holds (or, as ``nn.MultiheadAttention`` does with
  its ``out_proj``, reads) its parameters, by a torch function that receives a parameter outside its module's
  forward (the fetcher's read guard, :class:`memsched.runtime.read_guard.ReadGuard`, from the forward's start
  to its backward's end: it sees the re-forward of a checkpointed block too), and by backward when it unpacks
  what forward saved. Each read calls :meth:`ParamFetcher.read`.
* **Rooms.** The fetcher is the stage; each part of it is a room that owns its state, composed here:
  :class:`memsched.runtime.fetch_hooks.FetchHooks` (``hooks``: the model's forward hooks that drive it),
  :class:`memsched.runtime.fetch_schedule.ScheduleCursor` (``cursor``: the schedule followed, the access in
  progress and the :class:`memsched.runtime.fetch_schedule.FetchMode`: [Note: parameter fetches]),
  :class:`memsched.runtime.residency.Residency` (``residency``: the offloaded chunks on the device, their
  fetches, H2D copies and evictions), :class:`memsched.runtime.saved_params.SavedParams` (``saved``: the
  saved-tensor hooks that replace saved parameters by tokens) and
  :class:`memsched.runtime.read_recording.ReadRecorder` (``recorder``: the reads recorded for the plan). The
  fetcher decides at each read what they do, and owns the offloaded chunks, the forward's begin and end, the
  reads the read guard hands it and the between-steps state (ZeRO-3's ``hold``).

[Note: reads of sharded parameters]
At ZeRO stage 3 the same fetcher runs with :class:`memsched.distributed.sharded_params.ParamShards`: a chunk
away keeps this rank's shard on the device and comes back by an all-gather, on the schedule of
:func:`policies.schedule.schedule_sharded` (the window of the traced accesses around each read). Nothing is on
the host to bind the parameters of a chunk away to between steps, so there they stay absent views, and the
read guard stays on from the first forward (or the plan that first shards a chunk) until ``close()``: while
a step computes (a forward, a loss term outside it, backward) a read of a chunk away gathers it, as every
rank makes the same reads; between steps it raises ``ShardedParamError`` (a rank-0-only read, a log line,
would otherwise wait forever in a collective the others never join), and ``sched.gathered_params()`` (every
rank) makes every chunk whole for reads and writes. Setting ``p.grad``, registering hooks and reading
metadata are no reads. An evaluation under ``no_grad`` is off the schedule: each chunk is gathered at its read
and only those read together and the one read last stay. The guard is this thread's: another thread that reads
a chunk away between steps sees its absent view's NaN (train and read from one thread, or read inside
``gathered_params()``). DeepSpeed ZeRO-3 shows such parameters as empty tensors, FSDP2 as sharded DTensors.

The idea is ZeRO-Infinity's parameter offload (DeepSpeed ``offload_param``), ColossalAI Gemini's and
PatrickStar's chunk eviction and FSDP2's ``CPUOffloadPolicy``; here one schedule from the measured timeline
decides both what is fetched ahead (bounded by the room at every read) and what leaves (OPT).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable

import torch

from memsched.chunks import ChunkStore
from memsched.devices.simdevice import OUT_OF_MEMORY
from memsched.devices.transfers import Streams, TransferStats
from memsched.distributed.sharded_params import ParamShards
from memsched.runtime.fetch_hooks import FetchHooks
from memsched.runtime.fetch_schedule import ScheduleCursor, Unlisted
from memsched.runtime.read_guard import ReadGuard
from memsched.runtime.read_recording import ReadRecorder
from memsched.runtime.residency import Residency
from memsched.runtime.saved_params import SavedParams
from memsched.teardown import weak_method
from policies.types import BACKWARD, ParamSchedule
from tracer.param_reads import Read, phase_now


class ParamFetcher:
    """The reads of host-placed parameter chunks, their fetches and evictions (see the module docstring).

    Args:
        model: the model (hooks on its modules).
        store: the chunks.
        streams: the H2D copies' streams.
        transfers: byte counters (fetches count as H2D).
        wait_update: ``f(chunk_index)`` blocking until the CPU update of a chunk is done (``overlap=True``).
        update_ready: ``f(chunk_index) -> bool``: its CPU update is done, without waiting.
        shards: ZeRO-3 (:class:`memsched.distributed.sharded_params.ParamShards`): a chunk away keeps only
            this rank's part and is all-gathered for its reads ([Note: reads of sharded parameters]).
        on_move: ``f(nbytes)``: the stand-in leaves fetched buffers out of its fixed peak
            (:meth:`memsched.devices.simdevice.SimDevice.move`).

    Attributes:
        offloaded: the chunks whose parameters live on the host.
        demand_resident: offloaded chunks kept on the device without a schedule.
        guard: the read guard of the root's forward (:mod:`memsched.runtime.read_guard`): the H2D waits enter
            and leave it (one mode for both); reads of chunks not fetched here go back to them
            (:meth:`delegate_reads`).
        on_forward_begin: the read guard's push (the H2D waits' root pre-hook, which the fetcher's stands in
            for when only this fetcher's chunks need it).
        holding: ZeRO-3: ``gathered_params()`` contexts open (every chunk whole, none leaves).
        cursor, residency, saved, recorder, hooks: its rooms (see the module docstring).
    """

    def __init__(self, model: torch.nn.Module, store: ChunkStore, streams: Streams, transfers: TransferStats,
                 wait_update: Callable[[int], None], update_ready: Callable[[int], bool], *,
                 shards: ParamShards | None = None, on_move: Callable[[int], None] | None = None) -> None:
        self.model, self.store = model, store
        self.shards = shards  # [Note: sharded parameters] in memsched.distributed.sharded_params
        self._update_ready = update_ready
        self.offloaded: frozenset[int] = frozenset()
        self.demand_resident = 2
        self.guard = ReadGuard(self._guarded_read, grouped=True)
        self._other_reads: Callable[[int, str], None] = lambda i, what: None
        self.on_forward_begin: Callable[[], None] = lambda: None
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self._packing = [id(c) for c in store.chunks]  # the chunks the indices above refer to
        self.holding = 0
        self.cursor = ScheduleCursor()
        self.saved = SavedParams(store, self._read_saved)
        self.residency = Residency(store, streams, transfers, wait_update, shards, self.saved, self.guard,
                                   on_move=on_move)
        self.recorder = ReadRecorder()
        self.hooks = FetchHooks(model, store, self)

    # ---- what the rooms own, read here --------------------------------------------------------------------
    @property
    def misses(self) -> int:
        """Reads off the schedule since it was set (:meth:`use`; the scheduler revises the plan after a step
        with some: :meth:`memsched.planning.planner.Planner.revise`)."""
        return self.cursor.misses

    @property
    def stats(self) -> dict[str, int]:
        """The counters of the fetches and evictions (:attr:`Residency.stats`)."""
        return self.residency.stats

    def take_stats(self) -> dict[str, int]:
        """The counters since the last call (which restarts them)."""
        return self.residency.take_stats()

    @property
    def active(self) -> bool:
        """Some chunk's parameters live on the host, or reads are recorded."""
        return bool(self.offloaded) or self.recorder.on

    def owns(self, i: int) -> bool:
        """Whether reads of chunk ``i`` are this fetcher's to handle (it is offloaded, or reads are
        recorded)."""
        return self.recorder.on or i in self.offloaded

    def delegate_reads(self, wait: Callable[[int, str], None]) -> None:
        """Reads the guard sees of chunks this fetcher does not own go to ``wait(chunk, what)`` (the H2D
        waits of resident host chunks, :mod:`memsched.runtime.waits`)."""
        self._other_reads = wait

    # ---- configuration ------------------------------------------------------------------------------------
    def use(self, offloaded: Iterable[int], schedule: ParamSchedule | None) -> None:
        """From now on the chunks ``offloaded`` keep their parameters on the host, fetched on ``schedule``
        (``None``: on demand). Between steps only: chunks no longer offloaded are fetched to stay (the caller
        then moves their state), newly offloaded ones leave the device unless the schedule keeps them.

        Raises:
            torch.OutOfMemoryError (or the stand-in's): a chunk that stays on the device does not fit.
        """
        new = frozenset(offloaded)
        res = self.residency
        for i in sorted(self.offloaded - new):  # their parameters stay on the device from now on
            c = self.store.chunks[i]
            res.keep_on_device(c)
            self.store.bindings.drop_param_host(c)  # a lean chunk needs no host copy of its parameters now
        self.offloaded = new
        self.cursor.follow(schedule)
        keep = set(schedule.keep) if schedule is not None else set()
        for i in sorted(new):
            c = self.store.chunks[i]
            res.adopt(c)
            if i not in keep:
                res.evict(c)
        self._rehook()
        if self.shards is not None and new:  # chunks away between steps: their reads are refused from now
            self.on_forward_begin()

    def evict_all(self) -> None:
        """Every offloaded chunk on the device leaves it (before the chunks are re-packed: the new packing
        starts with none fetched, and the fetched bytes counted for the stand-in go with them)."""
        self.residency.evict_all()

    def resume_schedule(self) -> None:
        """The plan was revised (:meth:`memsched.planning.planner.Planner.revise`) and kept this schedule:
        follow it again."""
        self.cursor.resume()

    def repacked(self) -> None:
        """The store's chunks were re-packed (:meth:`memsched.chunks.ChunkStore.repack`): the chunk indices
        are new. The offloaded chunks are now those whose parameters are not on the device; none is kept
        (no schedule until the next :meth:`use`). A re-pack that kept the old chunks changes nothing."""
        if [id(c) for c in self.store.chunks] == self._packing:
            return
        self._packing = [id(c) for c in self.store.chunks]
        self.offloaded = frozenset(c.index for c in self.store.chunks if not self.store.resident(c))
        self.cursor.drop()
        self.residency.forget()
        self._rehook()

    def record(self, sample: Callable[[], int],
               classify: Callable[[torch.Tensor], None] | None = None) -> None:
        """Warmup: record every read of every chunk (:attr:`ReadRecorder.reads`), with ``sample()`` (the
        tracer's sample count) and the innermost module; ``classify(buffer)``: the tracer's, told of each
        buffer fetched until :meth:`stop_recording`."""
        self.recorder.start(sample)
        self.residency.classify_with(classify)
        self._rehook()

    def stop_recording(self) -> list[Read]:
        """The reads recorded; recording stops."""
        reads = self.recorder.stop()
        self.residency.classify_with(None)
        self._rehook()
        return reads

    # ---- hooks --------------------------------------------------------------------------------------------
    def install(self) -> None:
        """Observe the end of backward (once); the root's forward hooks come and go with :attr:`active`."""
        if self.hooks.installed:
            return
        self.hooks.install()
        self.store.backward.observe_end(weak_method(self.backward_end))
        self._rehook(watch=False)

    def _rehook(self, *, watch: bool = True) -> None:
        """The hooks for what is fetched and recorded now (``watch``: the buffers saved tensors replace)."""
        if watch:
            self.saved.watch()
        if not self.hooks.reinstall():
            self.saved.pop_between()  # nothing on the host, nothing recorded: no saved tensor to replace
            return
        if not self.store.bindings.computing:  # between steps: from here to the next forward
            self.saved.push_between()

    def forward_begin(self) -> None:
        """The root's forward begins (its prepended pre-hook)."""
        if torch.compiler.is_compiling() or not self.active:
            return
        if threading.get_ident() != self.store.bindings.owner and torch._C._current_graph_task_id() == -1:
            raise RuntimeError(
                "memsched: the attached model's forward ran on another thread than memsched.attach, with "
                "parameters kept on the host or sharded: their fetches and read guards belong to the "
                "attaching thread, where training must stay until sched.close(). Run forwards there (another "
                "thread may read a copy of the model made there)")
        if self.shards is None or torch.is_grad_enabled():  # ZeRO-3: an evaluation is off the schedule
            self.cursor.restart()
        self.residency.forget_last()
        if self.shards is not None:  # chunks gathered ahead for reads that did not come (a second forward)
            self.residency.bind_whole()
        self.recorder.forward_begins()
        self.saved.pop_between()
        if torch.is_grad_enabled():  # chunks fetched during the forward are saved through these too
            self.saved.enter_forward()
        self.on_forward_begin()

    def forward_end(self) -> None:
        """The root's forward ends. Where the read guard stays on ([Note: reads outside the forward]), the
        parameters of chunks away from the device stay absent views, and a read of one outside the forward
        (a loss term, MAML's ``p - lr * g`` after ``torch.autograd.grad``) fetches it, as a read inside the
        forward would. Where it cannot stay, the guard is left here (by the H2D waits) and those parameters
        become host views until backward fetches them: a read outside the forward sees their values (on
        CUDA: refuses them, being on the host). With no backward to follow (an evaluation under
        ``no_grad``), the model is between steps again (:meth:`memsched.chunks.ChunkStore.settle`)."""
        if torch.compiler.is_compiling():
            return
        self.saved.exit_forward()
        if self.active:
            self.saved.push_between()
        if not self.offloaded:
            return
        if self.shards is not None:
            # ZeRO-3: until backward gathers them, a read of a chunk away (a loss term outside the forward)
            # is gathered on demand by the read guard, which stays (keeps_guard). With no backward to follow
            # (an evaluation), the model is between steps again.
            if not torch.is_grad_enabled() and not self.store.backward.in_backward:
                if self.holding:
                    # Inside gathered_params() every chunk is whole and stays so: an evaluation has nothing
                    # to settle, and may run on some ranks only (rank 0's), so it issues no collective
                    self.store.bindings.leave_compute()
                    return
                with torch.inference_mode(False):
                    self.store.settle()
            return
        if torch.is_grad_enabled():
            if self.keeps_guard():
                return
            for i in self.offloaded:
                c = self.store.chunks[i]
                if not self.store.resident(c):
                    self.store.bindings.to_host(c)
        elif not self.store.backward.in_backward:
            # An evaluation: no backward follows, so the model is between steps again: the chunks the
            # schedule keeps stay, the parameters of the others are host views (not their absent views' NaN)
            with torch.inference_mode(False):
                self.store.settle()

    def watched_params(self) -> dict[int, int]:
        """``id(parameter) -> chunk`` the read guard watches for this fetcher: every chunk's while recording,
        else the offloaded chunks' (all along the forward: the schedule follows every read)."""
        store = self.store
        chunks = store.chunks if self.recorder.on else [store.chunks[i] for i in self.offloaded]
        return {id(p): c.index for c in chunks for p in c.params}

    def _guarded_read(self, found: list[tuple[int, torch.Tensor]], what: str) -> None:
        """The read guard saw a torch function (``what``) receive the parameters ``found`` (chunk,
        parameter): they are read together; those of chunks this fetcher does not own wait as the H2D
        waits say."""
        mine = [(i, p) for i, p in found if self.owns(i)]
        if self.shards is None and not self.store.bindings.computing:
            mine = []  # one rank, between steps: a chunk away is host-bound, read where its values are
        if self.shards is not None and not self.store.bindings.computing and not self.holding:
            away = [(i, p) for i, p in mine if not self.store.resident(self.store.chunks[i])]
            if away:
                i, p = away[0]
                raise self.shards.refusal(what, self._param_names.get(id(p), "?"), i)
            return  # whole chunks between steps: off the step's schedule, nothing to do
        # chunks whose parameters stay on the device wait as the H2D waits say (recorded too, if recording)
        for i in sorted({i for i, _ in found if i not in self.offloaded}):
            if any(self.guard.unwaited.get(id(p)) == i for j, p in found if j == i):
                self._other_reads(i, what)
        if not mine:
            return
        if self.recorder.on:
            self.read_params([p for _, p in mine], what)  # type: ignore[misc]
        else:
            self.read_group(sorted({i for i, _ in mine}), phase_now())

    def backward_end(self) -> None:
        """Backward's end (before the host chunks become host-bound): the reads of the step are over."""
        self.recorder.backward_ends()
        if self.shards is not None:
            self.shards.check_order()  # before anything is updated with parameters mixed across ranks
        if self.offloaded and not self.holding:
            self._settle()

    def keeps_guard(self) -> bool:
        """ZeRO-3: the read guard stays on from the forward's begin (and from :meth:`use`) to ``close()``:
        until backward, a read of a chunk away is gathered on demand; between steps it is refused
        ([Note: reads of sharded parameters]).

        [Note: reads outside the forward]
        One rank, at the end of a forward that records a graph: the guard stays on through the loss and
        backward to the step (:meth:`memsched.runtime.waits.H2DWaits.release_kept_guard`), so that a read of
        a chunk away made outside the forward (a loss term, ``p - lr * g`` from ``torch.autograd.grad`` in
        MAML, a submodule called directly) fetches it, as reads inside the forward do: a read the schedule
        did not expect is a miss, fetched on demand, and the plan is revised from the next step's reads. It
        stays only when it is this thread's only torch function mode: a mode the caller entered before the
        forward would otherwise be left under it, and the caller's exit would pop ours."""
        if self.shards is not None:
            return bool(self.offloaded)
        return (bool(self.offloaded) and torch.is_grad_enabled() and self.active
                and torch._C._len_torch_function_stack() == 1
                and torch._C._get_function_stack_at(0) is self.guard)

    # ---- between steps ------------------------------------------------------------------------------------
    def hold(self) -> None:
        """ZeRO-3 (:meth:`memsched.Scheduler.gathered_params`): every chunk whole, and kept so, until as many
        :meth:`unhold`. A collective: all-gathers in chunk order, issued together, then waited for."""
        assert self.shards is not None
        self.holding += 1
        self._gather_away()

    def _gather_away(self) -> None:
        """ZeRO-3: every chunk away is all-gathered (issued together, in chunk order) and bound whole."""
        with torch._C.DisableTorchFunction(), torch.inference_mode(False):
            for c in self.store.chunks:
                if not self.store.resident(c):
                    self.residency.fetch(c, wait=False)
        self.residency.bind_whole()
        self.residency.forget_last()

    def unhold(self) -> None:
        """The end of a :meth:`hold`: between steps, the chunks the schedule does not keep leave again (this
        rank's part of what was written to them meanwhile stays in its shard)."""
        self.holding -= 1
        if not self.holding and self.offloaded and not self.store.bindings.computing:
            with torch._C.DisableTorchFunction():
                self._settle()

    def _settle(self) -> None:
        """Only the chunks the schedule keeps for the next step stay on the device (all of them without a
        schedule: ``demand_resident`` most recently read)."""
        res = self.residency
        schedule = self.cursor.schedule
        res.evict_except(schedule.keep if schedule is not None else res.order()[-self.demand_resident:])
        if self.shards is not None:  # ZeRO-3: those gathered ahead and kept are whole: their views
            res.bind_whole()
        res.forget_last()

    def fetch_between(self, indices: Iterable[int]) -> None:
        """[Note: graph reads between steps] (:mod:`memsched.chunks.binding`): one rank, between steps, a read
        that records a graph needs chunks ``indices``, whose parameters live on the host only: each is fetched
        now (after its update), off the schedule (no miss: the step's schedule starts at its forward) and
        kept like a prefetch, so the forward's reads find it and the schedule evicts it at its first read
        that does not target it. The caller binds the parameters to the device views.

        Raises:
            torch.OutOfMemoryError (or the stand-in's): no room even after the other offloaded chunks left.
        """
        indices = [i for i in indices if i in self.offloaded]
        try:
            with self.residency.pin(indices), torch._C.DisableTorchFunction(), torch.inference_mode(False):
                for i in indices:  # read together: none leaves to make room for another
                    self.residency.ready(self.store.chunks[i])
        except OUT_OF_MEMORY as e:
            if hasattr(e, "add_note"):  # Python >= 3.11
                e.add_note(f"memsched: while fetching chunks {indices} for a term that reads them with "
                           "gradients between steps, before the forward; computed after the attached model's "
                           "forward, its reads follow the plan")
            raise

    def remove(self) -> None:
        """Remove every hook (``close()``; at ZeRO-3 every chunk is all-gathered first: a collective).
        Saved-tensor hooks that another context (a scheduler attached later, a user's ``saved_tensors_hooks``)
        pushed over cannot come off in stack order: they are left inert (they pass every tensor through) and
        come off as soon as they are on top again (:meth:`SavedParams.remove`)."""
        self.saved.exit_forward()
        self.saved.pop_between()
        if self.shards is not None and not self.saved.removed:  # ZeRO-3: a plain model, whole on every rank
            try:
                self._gather_away()
            except Exception as e:  # a peer is gone (close() after a failure): say so, the model is not whole
                warnings.warn(f"memsched: close(): the ZeRO-3 parameters could not be all-gathered ({e}); "
                              "the parameters of chunks sharded at that point read as NaN", RuntimeWarning,
                              stacklevel=2)
        self.saved.remove()  # hooks left under another's pass every tensor through until they come off
        self.hooks.remove()

    # ---- reads --------------------------------------------------------------------------------------------
    def read_params(self, params: list[torch.nn.Parameter], what: str) -> None:
        """Recording: ``params`` are read now (by a module's forward, a torch function ``what``, backward);
        a training step's reads are recorded (an evaluation's forward is not)."""
        phase = phase_now()
        self.recorder.record(params, phase)
        self.read_group(sorted({self.store.param_chunk[id(p)].index for p in params}), phase)

    def _read_saved(self, p: torch.nn.Parameter) -> None:
        """Backward unpacks a saved parameter ``p`` (:meth:`SavedParams.unpack`): its chunk is read."""
        if self.recorder.on:
            self.read_params([p], "backward")
        else:
            self.read(self.store.param_chunk[id(p)].index, BACKWARD)

    def read_group(self, indices: Iterable[int], phase: str) -> None:
        """Chunks read together (a module's forward, one torch function): each is made ready and none of them
        leaves the device while the others are."""
        indices = [i for i in indices if i in self.offloaded]
        if not indices:
            return
        if len(indices) == 1:
            self.read(indices[0], phase)
            return
        with self.residency.pin(indices):
            for i in indices:
                self.read(i, phase)

    def read(self, i: int, phase: str) -> None:
        """Chunk ``i``'s parameters are about to be read (in ``phase``): when they live on the host, make
        them ready on the device (see [Note: parameter fetches])."""
        res = self.residency
        if (i, phase) == res.last or i not in self.offloaded:
            return
        c = self.store.chunks[i]
        if self.shards is not None and (self.holding or (not torch.is_grad_enabled() and phase != BACKWARD)):
            # ZeRO-3 inside gathered_params (every chunk stays), or an evaluation: off the training step's
            # schedule, each chunk gathered at its read and, in an evaluation, only those read together and
            # the one read last kept
            with torch._C.DisableTorchFunction(), torch.inference_mode(False):
                if not self.holding:
                    res.evict_except(res.read_with(i))
                res.ready(c)
            res.mark_read(i, phase)
            return
        # Fetching binds parameters: bookkeeping, not reads. Under torch.inference_mode (an evaluation) the
        # buffers and views made here would be inference tensors, which a later training step cannot save
        # for backward: they are made as outside it, as the parameters of a plain model are.
        with torch._C.DisableTorchFunction(), torch.inference_mode(False):
            self._advance(i, phase)
            res.ready(c)
        res.mark_read(i, phase)

    def _advance(self, i: int, phase: str) -> None:
        """Apply the schedule at this read (see [Note: parameter fetches] in
        :mod:`memsched.runtime.fetch_schedule`)."""
        res = self.residency
        targets = self.cursor.advance(i, phase)
        if targets is Unlisted.AGAIN:
            return
        if isinstance(targets, Unlisted):
            if targets is Unlisted.MISS:
                res.stats["misses"] += 1
            # off the schedule, as little as possible stays: the chunk read, those read with it and the one
            # read last; without one, the demand_resident most recently read
            res.evict_on_demand(i, None if self.cursor.schedule is not None else self.demand_resident)
            return
        res.evict_except({i, *targets, *res.pinned})
        for j in targets:
            c = self.store.chunks[j]
            if j != i and not self.store.resident(c) and self._update_ready(j):
                try:
                    res.fetch(c, wait=False)
                    res.stats["prefetches"] += 1
                except OUT_OF_MEMORY:  # no room now: it comes at its read
                    pass
