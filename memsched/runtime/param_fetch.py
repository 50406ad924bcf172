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
* **Saved tensors.** While a forward runs, ``torch.autograd.graph.saved_tensors_hooks`` replace a saved
  parameter, or a saved view of one, by a token naming its chunk and its place in it; unpacking fetches the
  chunk and rebuilds the view. So autograd never holds a chunk's device buffer between forward and backward,
  and a parameter swapped meanwhile cannot break a saved tensor (the failure of in-place parameter swaps in
  transformers #47254 and DeepSpeed #8148). A saved tensor that modified its parameter in place since is
  refused, as autograd refuses it.
* **Fetch and evict.** A fetch allocates the chunk's compute buffer, copies the host values into it on the H2D
  stream (asynchronous on CUDA and on the stand-in's link) and, at the read, binds the parameters to their
  views once the copy is done. An eviction drops the buffer: its parameters become absent views while
  computing ([Note: absent parameters] in :mod:`memsched.chunks.store`) and host views between steps. Nothing
  holds the buffer afterwards but an op still reading it or a copy in flight, which free it when done.

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
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from memsched.chunks import Chunk, ChunkStore
from memsched.devices.simdevice import OUT_OF_MEMORY
from memsched.devices.transfers import Streams, TransferStats
from memsched.distributed.sharded_params import ParamShards
from memsched.runtime.hook_order import add_forward_pre_hook
from memsched.runtime.read_guard import ReadGuard
from memsched.teardown import weak_method
from policies.types import BACKWARD, ParamSchedule
from tracer.hook_handles import Detachable
from tracer.param_reads import END, GRAD, Read, phase_now

#: How many scheduled reads ahead a read that is not the next one may be found (a skipped branch).
LOOKAHEAD = 8


@dataclass
class _Saved:
    """What a saved tensor in a chunk's buffer is replaced by while backward has not read it yet: resolved at
    the unpack through the parameter (its chunk then, which a re-plan or a re-pack since may have changed)."""

    param: torch.nn.Parameter  # the parameter itself (``view`` None), or the one whose slot the view is in
    version: int  # the parameter's version counter when it was saved
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None  # size, stride, offset in the parameter's slot
    values: torch.Tensor | None = None  # saved between steps from the chunk's host buffer: those values


@dataclass
class _Plain:
    """A saved tensor outside the chunks, with its version counter when saved (checked at the unpack).
    Detached (its storage and version counter shared): an output saved by its own node would otherwise hold
    that node, a reference cycle only the garbage collector frees; autograd gives an unpacked output its node
    back."""

    tensor: torch.Tensor
    version: int


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

    Attributes:
        offloaded: the chunks whose parameters live on the host.
        schedule: the plan's schedule, or ``None`` (every read on demand).
        demand_resident: offloaded chunks kept on the device without a schedule.
        stats: ``fetches``, ``prefetches``, ``demand_fetches``, ``misses`` (reads off the schedule),
            ``evictions``, ``fetched_bytes`` since the last :meth:`take_stats`.
        misses: reads off the schedule since it was set (the scheduler revises the plan after a step with
            some: :meth:`memsched.planning.planner.Planner.revise`).
    """

    def __init__(self, model: torch.nn.Module, store: ChunkStore, streams: Streams, transfers: TransferStats,
                 wait_update: Callable[[int], None], update_ready: Callable[[int], bool], *,
                 shards: ParamShards | None = None) -> None:
        self.model, self.store, self.streams, self.transfers = model, store, streams, transfers
        # ZeRO-3: chunks away keep only this rank's part and are all-gathered back, instead of living on the
        # host ([Note: sharded parameters] in memsched.distributed.sharded_params)
        self.shards = shards
        self._wait_update, self._update_ready = wait_update, update_ready
        self.offloaded: frozenset[int] = frozenset()
        self.schedule: ParamSchedule | None = None
        self.demand_resident = 2
        self._cursor = 0
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident offloaded chunks, least recent first
        # (chunk, phase) read last and ready: its repeated reads cost nothing (a read in the other phase is
        # another access of the schedule)
        self._last: tuple[int, str] | None = None
        self._handles: list[Any] = []
        self._module_handles: list[Any] = []
        self._saved_hooks: Any = None  # the forward's saved-tensor hooks
        self._between: Any = None  # the same hooks from a forward's end to the next one's begin
        self._removed = False
        self._storage: dict[int, Chunk] = {}  # id(untyped storage) of a watched chunk's buffer -> chunk
        # The read guard (memsched.runtime.read_guard) of the root's forward: the H2D waits enter and leave it
        # (one mode for both); reads of chunks not fetched here go back to them (delegate_reads).
        self.guard = ReadGuard(self._guarded_read, grouped=True)
        self._other_reads: Callable[[int, str], None] = lambda i, what: None
        # the read guard's push (the H2D waits' root pre-hook, which the fetcher's stands in for when only
        # this fetcher's chunks need it)
        self.on_forward_begin: Callable[[], None] = lambda: None
        self._pinned: frozenset[int] = frozenset()  # chunks read together now: none of them leaves
        self.recording: list[Read] | None = None  # warmup: every read, for the trace
        self._stack: list[str] = []  # the modules whose forward is running (recording)
        self._names = {m: n for n, m in model.named_modules()}
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self._sample: Callable[[], int] = lambda: 0
        self.on_alloc: Callable[[torch.Tensor], None] | None = None  # warmup: the tracer classifies fetches
        # the stand-in leaves fetched buffers out of its fixed peak (memsched.devices.simdevice.SimDevice)
        self.on_move: Callable[[int], None] = lambda nbytes: None
        self.stats = self._zero_stats()
        self.misses = 0  # reads off the schedule since it was set (use())
        self.off_schedule = False  # a read was off it: every read on demand until the schedule is revised
        self._installed = False
        self._res_begin = self._res_min = 0
        self._packing = [id(c) for c in store.chunks]  # the chunks the indices above refer to
        self.holding = 0  # ZeRO-3: gathered_params() contexts open (every chunk whole, none leaves)

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
        return sum(self.store.chunks[i].data_bytes for i in self._lru)

    @staticmethod
    def _zero_stats() -> dict[str, int]:
        return dict.fromkeys(("fetches", "prefetches", "demand_fetches", "misses", "evictions",
                              "fetched_bytes"), 0)

    def take_stats(self) -> dict[str, int]:
        """The counters since the last call (which restarts them)."""
        out, self.stats = self.stats, self._zero_stats()
        return out

    @property
    def active(self) -> bool:
        """Some chunk's parameters live on the host, or reads are recorded."""
        return bool(self.offloaded) or self.recording is not None

    def owns(self, i: int) -> bool:
        """Whether reads of chunk ``i`` are this fetcher's to handle (it is offloaded, or reads are
        recorded)."""
        return self.recording is not None or i in self.offloaded

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
        for i in sorted(self.offloaded - new):  # their parameters stay on the device from now on
            c = self.store.chunks[i]
            if not self.store.resident(c):
                self._fetch(c, wait=True)
            if self._lru.pop(i, "away") is None:  # fetched: from now on it is not model data that moves
                self.on_move(-c.data_bytes)
            self.store.bindings.drop_param_host(c)  # a lean chunk needs no host copy of its parameters now
        self.offloaded, self.schedule = new, schedule
        self.misses, self.off_schedule = 0, False
        keep = set(schedule.keep) if schedule is not None else set()
        for i in sorted(new):
            c = self.store.chunks[i]
            if self.store.resident(c) and i not in self._lru:  # resident until now: it moves from now on
                self._lru[i] = None
                self.on_move(c.data_bytes)
            if i not in keep:
                self._evict(c)
        self._watch()
        self._install_module_hooks()
        if self.shards is not None and new:  # chunks away between steps: their reads are refused from now
            self.on_forward_begin()

    def evict_all(self) -> None:
        """Every offloaded chunk on the device leaves it (before the chunks are re-packed: the new packing
        starts with none fetched, and the fetched bytes counted for the stand-in go with them)."""
        for i in list(self._lru):
            self._evict(self.store.chunks[i])
        self._last = None

    def resume_schedule(self) -> None:
        """The plan was revised (:meth:`memsched.planning.planner.Planner.revise`) and kept this schedule:
        follow it again."""
        self.misses, self.off_schedule = 0, False

    def repacked(self) -> None:
        """The store's chunks were re-packed (:meth:`memsched.chunks.ChunkStore.repack`): the chunk indices
        are new. The offloaded chunks are now those whose parameters are not on the device; none is kept
        (no schedule until the next :meth:`use`). A re-pack that kept the old chunks changes nothing."""
        if [id(c) for c in self.store.chunks] == self._packing:
            return
        self._packing = [id(c) for c in self.store.chunks]
        self.offloaded = frozenset(c.index for c in self.store.chunks if not self.store.resident(c))
        self.schedule, self._cursor, self._last = None, 0, None
        self._lru.clear()
        self._watch()
        self._install_module_hooks()

    def record(self, sample: Callable[[], int]) -> None:
        """Warmup: record every read of every chunk (:attr:`recording`), with ``sample()`` (the tracer's
        sample count) and the innermost module."""
        self.recording = []
        self._sample = sample
        self._watch()
        self._install_module_hooks()

    def stop_recording(self) -> list[Read]:
        """The reads recorded; recording stops."""
        reads, self.recording = self.recording or [], None
        self._watch()
        self._install_module_hooks()
        return reads

    def _watch(self) -> None:
        """The storages the saved-tensor hooks replace: every chunk's device buffer ([Note: saved tensors
        across a re-plan])."""
        self._storage = {id(c.data.untyped_storage()): c for c in self.store.chunks if c.data is not None}

    # ---- hooks --------------------------------------------------------------------------------------------
    def install(self) -> None:
        """Observe the end of backward (once); the root's forward hooks come and go with :attr:`active`."""
        if self._installed:
            return
        self._installed = True
        self.store.backward.observe_end(weak_method(self.backward_end))
        self._install_module_hooks()

    def _install_root_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if not (self._installed and self.active):
            return
        # before any read of the forward (its module reads are hooked after it, the root's appended)
        begin = Detachable(lambda *_a: self._forward_begin())
        self._handles.append(add_forward_pre_hook(self.model, begin, prepend=True))
        end = Detachable(lambda *_a: self._forward_end())
        self._handles.append(self.model.register_forward_hook(end, always_call=True))

    def _install_module_hooks(self) -> None:
        for h in self._module_handles:
            h.remove()
        self._module_handles.clear()
        self._install_root_hooks()
        if not (self._installed and self.active):
            self._pop_between()  # nothing on the host, nothing recorded: no saved tensor to replace
            return
        if not self.store.bindings.computing:  # between steps: from here to the next forward
            self._push_between()
        store = self.store
        if self.recording is not None:  # when each gradient is made, for the gradients in flight
            for p in store.params():
                made = Detachable(self._grad_made)
                self._module_handles.append(p.register_post_accumulate_grad_hook(made))
        for name, m in self.model.named_modules():
            root = m is self.model  # the root's read comes after the forward's start (_forward_begin)
            if self.recording is not None:  # every module: the innermost one is recorded with each read
                own = [p for p in m.parameters(recurse=False) if id(p) in store.param_chunk]
                pre = Detachable(self._recording_pre(name, own))
                self._module_handles.append(add_forward_pre_hook(m, pre, prepend=not root))
                post = Detachable(lambda *_a: self._pop_module())
                self._module_handles.append(m.register_forward_hook(post, always_call=True))
                continue
            # a module's forward reads its own parameters, as the recording saw it (_recording_pre); what it
            # reads of other chunks the read guard sees, as it did then
            reads = tuple(sorted({store.param_chunk[id(p)].index for p in m.parameters(recurse=False)
                                  if id(p) in store.param_chunk and store.param_chunk[id(p)].index
                                  in self.offloaded}))
            if reads:
                hook = Detachable(self._module_pre(name, reads))
                self._module_handles.append(add_forward_pre_hook(m, hook, prepend=not root))

    def _recording_pre(self, name: str, own: list[torch.nn.Parameter]) -> Callable[..., None]:
        def pre(*_a: Any) -> None:
            self._stack.append(name)
            if own and not torch.compiler.is_compiling():
                self._check_rootless(name, {self.store.param_chunk[id(p)].index for p in own})
                self._read_params(own, "module")
        return pre

    def _check_rootless(self, name: str, chunks: Iterable[int]) -> None:
        """[Note: a forward that never runs the root] (:mod:`memsched.planning.planner`): module ``name``
        runs while parameters of ``chunks`` are host views between steps. The attached model's forward binds
        them (its hooks begin a step's reads), so none ran: the training code calls submodules directly.
        Their parameters would be read as host tensors on the device (torch's device error on a GPU):
        refused here, naming the module and the fix."""
        if self.store.backward.in_backward:
            return
        bindings = self.store.bindings
        away = sorted(i for i in chunks if bindings.host_bound(self.store.chunks[i]))
        if away:
            chunks_text = f"chunk{'s' if len(away) > 1 else ''} {', '.join(map(str, away))}"
            raise RuntimeError(
                f"memsched: module {name!r} runs outside a forward of the attached "
                f"{type(self.model).__name__}, and the parameters it reads ({chunks_text}) are on the host: "
                "memsched fetches parameters from the attached model's forward. Call the attached model (a "
                "forward that calls its parts), or attach the module you call")

    def _grad_made(self, p: torch.nn.Parameter) -> None:
        if self.recording is not None:
            self.recording.append(Read(p, GRAD, self._sample(), ""))

    def _pop_module(self) -> None:  # a forward hook: returning anything would replace the module's output
        if self._stack:
            self._stack.pop()

    def _module_pre(self, name: str, reads: tuple[int, ...]) -> Callable[..., None]:
        def pre(*_a: Any) -> None:
            if torch.compiler.is_compiling():
                _refuse_compiled(reads)  # a graph break: it runs, and raises, eagerly
                return
            self._check_rootless(name, reads)
            self.read_group(reads, phase_now())
        return pre

    def _forward_begin(self) -> None:
        if torch.compiler.is_compiling() or not self.active:
            return
        if threading.get_ident() != self.store.bindings.owner and torch._C._current_graph_task_id() == -1:
            raise RuntimeError(
                "memsched: the attached model's forward ran on another thread than memsched.attach, with "
                "parameters kept on the host or sharded: their fetches and read guards belong to the "
                "attaching thread, where training must stay until sched.close(). Run forwards there (another "
                "thread may read a copy of the model made there)")
        if self.shards is None or torch.is_grad_enabled():  # ZeRO-3: an evaluation is off the schedule
            self._cursor = 0
        self._last = None
        if self.shards is not None:  # chunks gathered ahead for reads that did not come (a second forward)
            self._bind_whole()
        self._stack.clear()
        if self.recording is not None and torch.is_grad_enabled():
            self.recording.append(Read(None, "begin", self._sample(), ""))  # type: ignore[arg-type]
        self._pop_between()
        if torch.is_grad_enabled():  # chunks fetched during the forward are saved through these too
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
        self.on_forward_begin()

    def _forward_end(self) -> None:
        """The root's forward ends. Where the read guard stays on ([Note: reads outside the forward]), the
        parameters of chunks away from the device stay absent views, and a read of one outside the forward
        (a loss term, MAML's ``p - lr * g`` after ``torch.autograd.grad``) fetches it, as a read inside the
        forward would. Where it cannot stay, the guard is left here (by the H2D waits) and those parameters
        become host views until backward fetches them: a read outside the forward sees their values (on
        CUDA: refuses them, being on the host). With no backward to follow (an evaluation under
        ``no_grad``), the model is between steps again (:meth:`memsched.chunks.ChunkStore.settle`)."""
        if torch.compiler.is_compiling():
            return
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)
        self._push_between()
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
        chunks = store.chunks if self.recording is not None else [store.chunks[i] for i in self.offloaded]
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
        if self.recording is not None:
            self._read_params([p for _, p in mine], what)  # type: ignore[misc]
        else:
            self.read_group(sorted({i for i, _ in mine}), phase_now())

    def backward_end(self) -> None:
        """Backward's end (before the host chunks become host-bound): the reads of the step are over."""
        if self.recording is not None:  # its gradients leave for the host: none is in flight any more
            self.recording.append(Read(None, END, self._sample(), ""))  # type: ignore[arg-type]
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
                    self._fetch(c, wait=False)
        self._bind_whole()
        self._last = None

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
        if self.schedule is not None:
            keep = set(self.schedule.keep)
        else:
            keep = set(list(self._lru)[-self.demand_resident:])
        for i in list(self._lru):
            if i not in keep:
                self._evict(self.store.chunks[i])
        if self.shards is not None:  # ZeRO-3: those gathered ahead and kept are whole: their views
            self._bind_whole()
        self._last = None

    def _bind_whole(self) -> None:
        """ZeRO-3: every chunk on the device, gathered ahead or not, is whole and its parameters are its
        views (between steps and at a forward's begin: the binding check expects them there)."""
        assert self.shards is not None
        with torch._C.DisableTorchFunction(), torch.inference_mode(False):
            for i in list(self._lru):
                c = self.store.chunks[i]
                self.shards.wait(c)
                self.store.bindings.to_device(c)

    def _push_between(self) -> None:
        """[Note: saved tensors between steps]
        A loss term computed outside the forward (an L2 penalty before or after ``model(x)``) reads the
        parameters between steps, where those of host chunks are host views; autograd saves the parameter
        itself, and by backward the forward has bound it to its device buffer or, its chunk being away, to
        its absent view. So from a forward's end (and from attach) to the next forward's begin the same
        saved-tensor hooks are on this thread's stack: such a parameter is saved as a token of its host
        values, which nothing changes before the step. Pushed and popped in stack order: the hooks come off at
        the next forward's begin only when they are on top (a user's own hooks pushed since stay above
        them, and ours wait)."""
        if self._between is None and self.active and not self._removed:
            self._between = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._between.__enter__()

    def _pop_between(self) -> None:
        if self._between is None:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] == self._pack:  # ours on top: leaving them keeps the stack in order
            hooks, self._between = self._between, None
            hooks.__exit__(None, None, None)
            _drain_removed()

    def remove(self) -> None:
        """Remove every hook (``close()``; at ZeRO-3 every chunk is all-gathered first: a collective).
        Saved-tensor hooks that another context (a scheduler attached later, a user's ``saved_tensors_hooks``)
        pushed over cannot come off in stack order: they are left inert (they pass every tensor through) and
        come off as soon as they are on top again (:func:`_drain_removed`)."""
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)
        self._pop_between()
        if self.shards is not None and not self._removed:  # ZeRO-3: a plain model again, whole on every rank
            try:
                self._gather_away()
            except Exception as e:  # a peer is gone (close() after a failure): say so, the model is not whole
                warnings.warn(f"memsched: close(): the ZeRO-3 parameters could not be all-gathered ({e}); "
                              "the parameters of chunks sharded at that point read as NaN", RuntimeWarning,
                              stacklevel=2)
        self._removed = True  # hooks left under another's pass every tensor through until they come off
        _drain_removed()
        for h in (*self._handles, *self._module_handles):
            h.remove()
        self._handles.clear()
        self._module_handles.clear()

    # ---- reads --------------------------------------------------------------------------------------------
    def _read_params(self, params: list[torch.nn.Parameter], what: str) -> None:
        """Recording: ``params`` are read now (by a module's forward, a torch function ``what``, backward);
        a training step's reads are recorded (an evaluation's forward is not)."""
        phase = phase_now()
        if self.recording is not None and (torch.is_grad_enabled() or phase == BACKWARD):
            module = self._stack[-1] if self._stack else ""
            sample = self._sample()
            for p in params:
                self.recording.append(Read(p, phase, sample, module))
        self.read_group(sorted({self.store.param_chunk[id(p)].index for p in params}), phase)

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
        self._pinned = frozenset(indices)  # read together: none leaves to make room for another
        try:
            with torch._C.DisableTorchFunction(), torch.inference_mode(False):
                for i in indices:
                    self._ready(self.store.chunks[i])
        except OUT_OF_MEMORY as e:
            if hasattr(e, "add_note"):  # Python >= 3.11
                e.add_note(f"memsched: while fetching chunks {indices} for a term that reads them with "
                           "gradients between steps, before the forward; computed after the attached model's "
                           "forward, its reads follow the plan")
            raise
        finally:
            self._pinned = frozenset()

    def read_group(self, indices: Iterable[int], phase: str) -> None:
        """Chunks read together (a module's forward, one torch function): each is made ready and none of them
        leaves the device while the others are."""
        indices = [i for i in indices if i in self.offloaded]
        if not indices:
            return
        if len(indices) == 1:
            self.read(indices[0], phase)
            return
        self._pinned = frozenset(indices)
        try:
            for i in indices:
                self.read(i, phase)
        finally:
            self._pinned = frozenset()

    def read(self, i: int, phase: str) -> None:
        """Chunk ``i``'s parameters are about to be read (in ``phase``): when they live on the host, make
        them ready on the device (see [Note: parameter fetches])."""
        if (i, phase) == self._last or i not in self.offloaded:
            return
        c = self.store.chunks[i]
        if self.shards is not None and (self.holding or (not torch.is_grad_enabled() and phase != BACKWARD)):
            # ZeRO-3 inside gathered_params (every chunk stays), or an evaluation: off the training step's
            # schedule, each chunk gathered at its read and, in an evaluation, only those read together and
            # the one read last kept
            with torch._C.DisableTorchFunction(), torch.inference_mode(False):
                if not self.holding:
                    keep = {i, *self._pinned, *([] if self._last is None else [self._last[0]])}
                    for j in list(self._lru):
                        if j not in keep:
                            self._evict(self.store.chunks[j])
                self._ready(c)
            self._last = (i, phase)
            return
        # Fetching binds parameters: bookkeeping, not reads. Under torch.inference_mode (an evaluation) the
        # buffers and views made here would be inference tensors, which a later training step cannot save
        # for backward: they are made as outside it, as the parameters of a plain model are.
        with torch._C.DisableTorchFunction(), torch.inference_mode(False):
            self._advance(i, phase)
            self._ready(c)
        self._last = (i, phase)

    def _advance(self, i: int, phase: str) -> None:
        """Apply the schedule at this read (see [Note: parameter fetches])."""
        sched = self.schedule
        pos = None
        if sched is not None and not self.off_schedule:
            acc = sched.accesses
            now = acc[self._cursor - 1] if self._cursor > 0 else None
            if now is not None and (now.chunk, now.phase) == (i, phase):  # the access in progress, read again
                return
            end = min(len(acc), self._cursor + LOOKAHEAD)
            pos = next((k for k in range(self._cursor, end) if acc[k].chunk == i and acc[k].phase == phase),
                       None)
            if pos is None and phase == BACKWARD:  # backward begins: its reads follow forward's
                start = next((k for k, a in enumerate(acc) if a.phase == BACKWARD), len(acc))
                if self._cursor <= start:
                    pos = next((k for k in range(start, min(len(acc), start + LOOKAHEAD))
                                if acc[k].chunk == i), None)
        if pos is None:
            if sched is not None and not self.off_schedule:
                # Off the schedule until it is revised: what is on the device beside the non-model data at
                # each point is no longer known (the gradients in flight, say, differ), so as little as
                # possible stays: the chunk read, those read with it and the one read last.
                self.stats["misses"] += 1
                self.misses += 1
                self.off_schedule = True
            keep = {i, *self._pinned, *([] if self._last is None else [self._last[0]])}
            budget = len(keep) if sched is not None else self.demand_resident
            for j in list(self._lru)[:max(0, len(self._lru) + 1 - budget)]:
                if j not in keep:
                    self._evict(self.store.chunks[j])
            return
        self._cursor = pos + 1
        targets = sched.targets[pos]
        for j in list(self._lru):
            if j != i and j not in targets and j not in self._pinned:
                self._evict(self.store.chunks[j])
        for j in targets:
            c = self.store.chunks[j]
            if j != i and not self.store.resident(c) and self._update_ready(j):
                try:
                    self._fetch(c, wait=False)
                    self.stats["prefetches"] += 1
                except OUT_OF_MEMORY:  # no room now: it comes at its read
                    pass

    def _ready(self, c: Chunk) -> None:
        """``c`` on the device, its update and H2D copy done, its parameters bound to their views."""
        self._wait_update(c.index)
        if not self.store.resident(c):
            self.stats["demand_fetches"] += 1
            self._fetch(c, wait=False)
        if self.shards is not None:
            self.shards.wait(c)
        elif c.h2d_event is not None:  # a wait that blocks is a span of the step timeline (Streams.wait)
            self.streams.wait([c.h2d_event], f"fetch <- chunk {c.index}")
            if not self.streams.cuda:
                c.forget_h2d()
        self._lru.pop(c.index, None)
        self._lru[c.index] = None
        self._res_min = min(self._res_min, self._resident_bytes())
        if self.store.bindings.computing:  # host-bound since the forward's end, or absent: its device views
            self.store.bindings.to_device(c)
        # the read guard keeps watching its parameters: the schedule follows every read of them, as the
        # recording saw them all

    def _fetch(self, c: Chunk, *, wait: bool) -> None:
        """Allocate ``c``'s compute buffer and start the H2D copy of its host values (after its CPU update).

        Raises:
            torch.OutOfMemoryError (or the stand-in's): no room even after the other offloaded chunks left.
        """
        self._wait_update(c.index)
        self.on_move(c.data_bytes)
        try:
            try:
                data = self.store.alloc.device_empty(c.numel, c.dtype)
            except OUT_OF_MEMORY:
                # make room: every other offloaded chunk leaves (not those read now)
                for j in list(self._lru):
                    if j != c.index and j not in self._pinned:
                        self._evict(self.store.chunks[j])
                data = self.store.alloc.device_empty(c.numel, c.dtype)
        except BaseException:
            self.on_move(-c.data_bytes)
            raise
        if self.on_alloc is not None:
            self.on_alloc(data)
        if self.shards is not None:  # ZeRO-3: every rank's shard, all-gathered
            self.store.bindings.data_arrived(c, data)
            self._lru[c.index] = None
            if c.param_shard is None and c.param_host is not None:  # this rank's part is on the host
                with self.store.alloc.host_context():
                    self.transfers.add_h2d(c.start_h2d(self.streams, c.param_host))
            self.shards.gather(c, data)
            self.stats["fetches"] += 1
            self.stats["fetched_bytes"] += c.data_bytes
            self._storage[id(data.untyped_storage())] = c
            if wait:
                self.shards.wait(c)
            return
        if c.hi - c.lo < c.numel:  # the padding beyond the shard is never read; zero it for determinism
            data[c.hi:].zero_()
            data[:c.lo].zero_()
        self.store.bindings.data_arrived(c, data)
        self._lru[c.index] = None  # on the device (a prefetch too, until it is read or leaves)
        with self.store.alloc.host_context():
            nbytes = c.start_h2d(self.streams, c.param_host)
        self.transfers.add_h2d(nbytes)
        self.stats["fetches"] += 1
        self.stats["fetched_bytes"] += nbytes
        self._storage[id(data.untyped_storage())] = c
        if wait:
            c.wait_h2d()

    def _evict(self, c: Chunk) -> None:
        if not self.store.resident(c):
            return
        self._storage.pop(id(c.data.untyped_storage()), None)
        if self.shards is not None:  # ZeRO-3: this rank's shard stays on the device
            self._wait_update(c.index)
            self.shards.release(c)
            self.store.bindings.to_sharded(c)
        else:
            self.store.bindings.data_leaves(c)
        if self._lru.pop(c.index, "away") is None:  # fetched (counted as moving); not: resident until now
            self.on_move(-c.data_bytes)
        self._res_min = min(self._res_min, self._resident_bytes())
        self.stats["evictions"] += 1
        if self._last is not None and self._last[0] == c.index:
            self._last = None
        self.guard.watch(c.params, c.index)  # a later read of its parameters fetches it again

    # ---- saved tensors ------------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        """[Note: saved tensors across a re-plan]
        Autograd saves a parameter (or a view of it) as the tensor itself, and reads it back in backward. By
        then the parameter may be bound elsewhere: its chunk left the device (an offloaded chunk, evicted
        after its forward reads), or a re-plan at a forward's begin (an input that grew, an out-of-memory
        retry) moved it to the host after a loss term read it on the device, or a re-pack changed its chunk.
        So a saved tensor in any chunk's device buffer is replaced by a token resolved at the unpack through
        the parameter: its chunk then is fetched if away, and the slot read where it is now. Between steps a
        host-bound parameter is saved as its host values ([Note: saved tensors between steps]), which no
        re-plan changes (a buffer freed by one stays alive through the token). Any other tensor is saved with
        its version: under saved-tensor hooks autograd no longer checks that nothing modified it in place
        before backward, so the unpack does, as torch would."""
        if self._removed or not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor,
                                                                               torch.nn.Parameter):
            return t
        store = self.store
        sid = id(t.untyped_storage())
        c, host = self._storage.get(sid), False
        if c is not None and (c.data is None or id(c.data.untyped_storage()) != sid):
            c = None  # a buffer that has left since: not a chunk's any more
        if c is None:  # between steps: a host view ([Note: saved tensors between steps]), read as the device
            ptr = t.untyped_storage().data_ptr()  # its user view: another storage object over the same bytes
            c = next((h for h in store.bindings.host_chunks() if h.param_host is not None
                      and h.param_host.untyped_storage().data_ptr() == ptr), None)
            host = c is not None
        if c is None:
            return _Plain(t.detach(), t._version)
        if id(t) in store.param_chunk and store.param_chunk[id(t)] is c:
            return _Saved(t, t._version, None, t.detach() if host else None)
        if t.dtype != c.dtype:
            # a reinterpreting view: kept as it is (its buffer stays alive until backward reads it)
            return _Plain(t.detach(), t._version)
        off = t.storage_offset() + (c.lo if host else 0)  # an offset in the chunk
        found = next(((q, o) for q, (o, n) in zip(c.params, c.ranges, strict=True) if o <= off < o + n), None)
        if found is None:
            return _Plain(t.detach(), t._version)
        p, start = found
        return _Saved(p, p._version, (tuple(t.shape), tuple(t.stride()), off - start),
                      t.detach() if host else None)

    def _unpack(self, saved: Any) -> Any:
        if isinstance(saved, _Plain):
            t = saved.tensor
            if t._version != saved.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: tensor of shape {tuple(t.shape)} is at version {t._version}; expected "
                    f"version {saved.version} instead")
            return t
        if not isinstance(saved, _Saved):
            return saved
        p = saved.param
        if p._version != saved.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: parameter of shape {tuple(p.shape)} is at version {p._version}; expected "
                f"version {saved.version} instead (memsched saved it for backward while its chunk's "
                "parameters live on the host)")
        if saved.values is not None:  # its host values when saved (nothing writes them before the step)
            return saved.values
        if not self.store.bindings.computing:  # a backward with no forward since the last one ended
            self.store.bindings.enter_compute()  # (retain_graph)
        self.store.backward.note_running()  # should it raise before its end ([Note: a backward that raised])
        c = self.store.param_chunk[id(p)]
        if self.recording is not None:
            self._read_params([p], "backward")
        else:
            self.read(c.index, BACKWARD)
        if saved.view is None:
            return p
        size, stride, off = saved.view
        return c.data.as_strided(size, stride, self.store.param_range[id(p)][0] + off)


def _drain_removed() -> None:
    """Take off the top of this thread's saved-tensor hooks those of removed fetchers (left under another
    context's when their scheduler closed), down to the first that is not."""
    while True:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        owner = getattr(top[0], "__self__", None) if top is not None else None
        if not isinstance(owner, ParamFetcher) or not owner._removed or owner._between is None:
            return
        hooks, owner._between = owner._between, None
        hooks.__exit__(None, None, None)


@torch.compiler.disable
def _refuse_compiled(chunks: tuple[int, ...]) -> None:
    """Compiled code would read parameters kept on the host without fetching them (the fetcher's hooks
    compile to nothing, and the read guard does not see inside a graph): refused rather than read as the
    absent views' NaN.

    Raises:
        RuntimeError: always; names the chunks and what to do.
    """
    raise RuntimeError(
        f"memsched: compiled code reads parameters the plan keeps on the host or ZeRO-3 shards over the "
        f"ranks (chunks {list(chunks)}), which torch.compile does not fetch yet. Run the model eagerly, or "
        "give it room to keep every parameter on the device (a larger device, a smaller batch, or policy "
        "'cpu' if the parameters fit; zero_stage=2 keeps whole parameters on every rank)")
