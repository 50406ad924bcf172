"""The next forward waits for the parameters it may read: for the overlapped CPU update of their chunk
(``overlap=True``, :mod:`memsched.optim.host_updates`; the host blocks) and for its H2D copy (CUDA: the
compute stream waits, the host does not; the stand-in's modelled link, ``sim:SIZE,link=...``: the host blocks,
a ``waits`` span of the step timeline). Without either, copies are synchronous and nothing is installed.

Forward pre-hooks make the compute stream wait for a chunk's H2D copy at the first traced module that may read
its parameters (:mod:`memsched.planning.first_use`). Before the trace exists (warmup) every module holding
chunk parameters, and the root, waits for all chunks. A parameter read earlier in the root's forward than its
module's wait waits at the read (:mod:`memsched.runtime.read_guard`). ``model.state_dict()`` and
``model.load_state_dict()`` wait for all chunks too. Between an overlapped step and the next forward, reads
of chunks still being updated wait at the read ([Note: reads between steps wait]); reads from another thread
call :meth:`H2DWaits.synchronize` (``sched.synchronize()``) first.

After warmup the waits stay only where a copy can be in flight ([Note: waits only where a copy can be in
flight]: every chunk on the device and no overlap installs none). Under ``torch.compile`` these hooks are
traced into the model's graph. Where waits are needed (host chunks on CUDA, or ``overlap=True``) the
per-module waits compile to nothing and the root waits for every chunk, eagerly, before the forward (one graph
break at its start); without them nothing of this module is in the graph. Where only part of the forward is
compiled (``model.blocks[0].compile()``, a submodule replaced by ``torch.compile(...)`` after warmup, a
compiled function that calls submodules) and the root runs eagerly, a module whose wait is in compiled code
waits for every chunk, eagerly, at its start (one graph break there per compiled region).

Before each forward, a parameter converted since attach (``model.double()``, ``model.to(...)``) is refused
(:meth:`H2DWaits._check_bound`), and gradients set to None since the last step (``model.zero_grad()``) go back
into their chunk views (:meth:`memsched.chunks.gradients.GradBuffers.bind_dropped`). The root module's forward
hooks also mark the forward phase of the step timeline (:mod:`memsched.telemetry.step_timeline`), and with
data parallelism finish the follow-ups of the overlapped update (ZeRO all-gathers) before backward, so every
rank issues its collectives in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memsched.chunks import ChunkStore
from memsched.devices.transfers import Streams
from memsched.optim.host_updates import HostUpdates
from memsched.planning.first_use import first_use_owners
from memsched.runtime.device_errors import device_error_hook
from memsched.runtime.hook_order import add_forward_pre_hook
from memsched.runtime.read_guard import ReadGuard
from memsched.teardown import weak_method
from memsched.telemetry.step_timeline import WAITS, StepTimeline
from policies.types import HOST
from tracer.hook_handles import Detachable


class H2DWaits:
    """The wait hooks of one scheduler (see the module docstring); removed by :meth:`remove`."""

    def __init__(self, model: torch.nn.Module, store: ChunkStore, streams: Streams,
                 updates: HostUpdates | None = None, timeline: StepTimeline | None = None,
                 drain_after_forward: bool = False, needed: bool = True, fetcher: Any = None) -> None:
        self.model, self.store, self.streams = model, store, streams
        self.needed = needed  # False: synchronous copies, no overlap: only the step timeline's hooks
        self.updates = updates if updates is not None else HostUpdates(store.alloc.device)
        self.timeline = timeline if timeline is not None else StepTimeline()
        self.drain_after_forward = drain_after_forward
        self._handles: list[Any] = []
        # True from the root's compiled wait (every chunk waited for) to the end of the root's compiled
        # forward: a module wait traced inside it has nothing left to wait for. False while the root runs
        # eagerly: a module wait traced there (a compiled submodule or function) is the only wait its
        # parameters get, so it must wait eagerly (see _hook). Dynamo guards on it; it is constant at each
        # point of a step, so it causes no recompilation.
        self._root_compiled = False
        # reads before their module's wait (memsched.runtime.read_guard). With parameters that live on the
        # host (memsched.runtime.param_fetch) one guard serves both: the fetcher's, which hands back the
        # reads of chunks it does not fetch (one mode on the stack, entered and left in order).
        self.fetcher = fetcher
        if fetcher is not None:
            self.guard = fetcher.guard
            fetcher.delegate_reads(self._wait_read)
            fetcher.on_forward_begin = self._guard_begin
        else:
            self.guard = ReadGuard(self._wait_read)
        self._guarded = False  # the guard is entered (a plain flag: Dynamo reads it in the root's hooks)
        self._between: ReadGuard | None = None  # reads between an overlapped step and the next forward
        self._compiled_forwards = False  # a compiled root forward ran (it waits for every chunk at its start)

    def install(self, traced: Sequence[str], *, needed: bool | None = None) -> None:
        """(Re)install the hooks for the modules ``traced`` saw run, in first-call order (empty: warmup).
        ``needed``: whether module waits are needed at all from now on (``None``: as before)."""
        if needed is not None:
            self.needed = needed
        self.remove()
        begin = Detachable(lambda *_a: self.timeline.forward_begin())
        self._handles.append(add_forward_pre_hook(self.model, begin, prepend=True))
        end = Detachable(lambda _m, _a, output: self._forward_end(output))
        self._handles.append(self.model.register_forward_hook(end, always_call=True))
        if self.store.alloc.device.type != "cpu":  # an input on another device: memsched's explanation
            explain = Detachable(device_error_hook(self.store.alloc.device))
            self._handles.append(self.model.register_forward_hook(explain, always_call=True))
        check = Detachable(lambda *_a: self._check_bound())
        self._handles.append(self.model.register_forward_pre_hook(check))
        bind = Detachable(lambda *_a: self._bind_dropped_grads())
        self._handles.append(self.model.register_forward_pre_hook(bind))
        sync = Detachable(lambda *_a, **_k: self._between_steps())
        self._handles.append(self.model.register_state_dict_pre_hook(sync))
        self._handles.append(self.model.register_load_state_dict_pre_hook(sync))
        if not self.needed:
            return
        store = self.store
        by_module: dict[str, set[int]] = {}
        if traced:
            owners = first_use_owners(self.model, traced, list(store.params()))
            for p in store.params():
                by_module.setdefault(owners[id(p)], set()).add(store.param_chunk[id(p)].index)
        else:
            every = set(range(len(store.chunks)))
            for name, m in self.model.named_modules():
                if name == "" or any(id(p) in store.param_chunk for p in m.parameters(recurse=False)):
                    by_module[name] = every
        modules = dict(self.model.named_modules())
        for name, indices in by_module.items():
            hook = Detachable(self._hook(name, sorted(indices)))
            self._handles.append(add_forward_pre_hook(modules[name], hook, prepend=True))
        # steady state (in warmup the root waits for every chunk); with parameters offloaded, the fetcher's
        # forward pre-hook also pushes the guard (ParamFetcher.on_forward_begin; the second push is a no-op)
        if traced:
            guard = Detachable(lambda *_a: self._guard_begin())
            self._handles.append(add_forward_pre_hook(self.model, guard, prepend=True))
        compiled = Detachable(self._compiled_wait)
        self._handles.append(add_forward_pre_hook(self.model, compiled, prepend=True))

    def refresh(self, traced: Callable[[], Sequence[str]], *, needed: bool) -> None:
        """[Note: waits only where a copy can be in flight]
        After warmup the plan decides whether a forward can ever meet a chunk whose H2D copy or CPU update is
        still running: with every chunk on the device and no overlap (CUDA, or the stand-in's link) nothing
        is copied to the device between steps, so no module waits and no read is guarded. The hooks then come
        off, and so does the root's graph break under ``torch.compile``: the compiled forward is torch's own
        graph, guarded by Dynamo as a model without memsched's hooks (the same compilation as torch's).
        Called where no forward runs (the end of warmup, each step's end), so a plan that moves a chunk to the
        host installs the waits before the forward after the step that first copies it back; turning them
        off, the current stream first waits for every copy still in flight. Reinstalls only on a change
        (each reinstall makes Dynamo recompile the forward once); ``traced`` gives the modules the trace saw
        run (:meth:`install`), asked for only then."""
        if needed == self.needed:
            return
        if not needed:
            self.synchronize()
        self.install(traced(), needed=needed)

    def _hook(self, name: str, indices: list[int]) -> Callable[[torch.nn.Module, Any], None]:
        label = f"{name or 'model'} <- chunk{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"

        def wait(_module: torch.nn.Module, _args: Any) -> None:
            if torch.compiler.is_compiling():
                # Inside a compiled root forward the root waited for everything (_compiled_wait). Otherwise
                # this module runs compiled inside an eager root forward: compiling the wait to nothing would
                # let it read parameters whose CPU update or H2D copy is still in flight.
                if not self._root_compiled:
                    _synchronize_eager(self)
                return
            if self.updates.pending:
                t0 = time.perf_counter()
                if self.updates.wait(indices) > 0:
                    self.timeline.span(WAITS, label, t0, time.perf_counter(), chunks=indices)
            chunks = self.store.chunks
            self.streams.wait([chunks[i].h2d_event for i in indices], label)
            if self._guarded:
                self._mark_waited(indices)
                if not self.guard.guarding and self.guard.on_top():  # nothing left to guard: calls run bare
                    self._guarded = False
                    self.guard.pop()
        return wait

    def guard_between_steps(self) -> None:
        """[Note: reads between steps wait]
        ``optimizer.step()`` with ``overlap=True`` returns while the CPU worker still updates the host chunks,
        and code between steps reads parameters (an EMA or ``AveragedModel`` right after the step, a norm
        for logging, a clone, ``p.copy_(...)``): a read of a chunk not yet updated would see, or write, the
        old values. So from the step's end a :class:`memsched.runtime.read_guard.ReadGuard` of this thread
        guards the parameters of the chunks still being updated: a torch function that receives one waits for
        that chunk's update first (a ``waits`` span of the step timeline), and code that reads nothing keeps
        the overlap. Once every guarded chunk was waited for the guard only forwards calls; it is left at the
        next forward's start (or ``synchronize()``, ``state_dict()``, the next step, ``close()``), where it
        is not inside one of its own calls. Reads from other threads are not seen (they call
        ``sched.synchronize()`` first)."""
        self._leave_between()
        if torch.compiler.is_compiling() or not self.updates.pending:
            return
        pending = set(self.updates.unfinished())
        unwaited = {id(p): c.index for c in self.store.chunks if c.index in pending for p in c.params}
        if not unwaited:
            return
        if torch._C._len_torch_function_stack() > 0 or self._compiled_forwards:
            # A mode of the caller's is active around the step (``with torch.device(...)``): a mode pushed
            # now would outlive the step under it, and its exit would pop ours instead. Compiled forwards: a
            # mode on the stack at a compiled frame's entry changes what Dynamo traces, and they wait for
            # every chunk at their start anyway (no overlap with them). Correct first: the step waits for its
            # update, as the serial step does.
            t0 = time.perf_counter()
            if self.updates.wait_all() > 0:
                why = "compiled forwards" if self._compiled_forwards else "a torch function mode is active"
                self.timeline.span(WAITS, f"step end <- all chunks ({why})", t0, time.perf_counter())
            return
        self._between = ReadGuard(weak_method(self._wait_between))  # an inert guard keeps nothing alive
        self._between.push(unwaited)

    def release_kept_guard(self) -> None:
        """The step's end: the read guard a forward left on for reads outside it ([Note: reads outside the
        forward] in :mod:`memsched.runtime.param_fetch`) comes off, where it is on top."""
        if self._guarded and self.fetcher is not None and self.fetcher.shards is None and self.guard.on_top():
            self._guarded = False
            self.guard.pop()

    def _wait_between(self, i: int, what: str) -> None:
        """Between steps a torch function (``what``) reads a parameter of chunk ``i``, still being updated."""
        t0 = time.perf_counter()
        if self.updates.wait([i]) > 0:
            self.timeline.span(WAITS, f"{what} (read between steps) <- chunk {i}", t0, time.perf_counter(),
                               chunks=[i])
        if self._between is not None:
            self._between.waited(self.store.chunks[i].params)

    def _leave_between(self) -> None:
        """Leave the guard of reads between steps. A mode entered on top of it since stays on top: the guard
        then only forwards calls, and comes off once it is on top again (:func:`_drain_stale`)."""
        guard, self._between = self._between, None
        if guard is not None:
            guard.waited_all()
            if guard.on_top():
                guard.__exit__(None, None, None)
            else:
                _STALE.append(guard)
        _drain_stale()

    def _guard_begin(self) -> None:
        """The root's forward starts: the host chunks with an update or H2D copy still to wait for are guarded
        against reads before their module's wait (:mod:`memsched.runtime.read_guard`)."""
        if torch.compiler.is_compiling():
            return
        self._leave_between()
        if self._guarded:
            return
        pending = set(self.updates.unfinished())
        unwaited = {id(p): c.index for c in self.store.chunks
                    if c.placement == HOST and (c.index in pending or _in_flight(c.h2d_event))
                    for p in c.params}
        if self.fetcher is not None and self.fetcher.active:  # the chunks whose parameters are fetched
            unwaited.update(self.fetcher.watched_params())
        if unwaited:
            self.guard.push(unwaited)
            self._guarded = True

    def _wait_read(self, i: int, what: str) -> None:
        """A torch function (``what``) reads a parameter of chunk ``i`` before its module waited for it."""
        if self.updates.pending:
            t0 = time.perf_counter()
            if self.updates.wait([i]) > 0:
                self.timeline.span(WAITS, f"{what} (read) <- chunk {i}", t0, time.perf_counter(), chunks=[i])
        self.streams.wait([self.store.chunks[i].h2d_event], f"{what} (read) <- chunk {i}")
        self._mark_waited([i])

    def _mark_waited(self, indices: Sequence[int]) -> None:
        chunks = self.store.chunks
        for i in indices:
            if self.fetcher is None or not self.fetcher.owns(i):  # the fetcher says when those are ready
                self.guard.waited(chunks[i].params)

    def _compiled_wait(self, *_args: Any) -> None:
        """In compiled code only: the per-module waits compile to nothing (they would split the forward's
        graph at every module that waits); the root waits for every chunk once, eagerly, before the forward,
        and binds the parameters to their device views (what :meth:`_bind_dropped_grads` does in eager code):
        one graph break at its start. Correct, but a compiled forward does not overlap the CPU update."""
        if torch.compiler.is_compiling():
            _compiled_root_eager(self)
        else:  # an eager root forward: module waits in compiled code wait for themselves (see _hook)
            self._root_compiled = False

    def _check_bound(self) -> None:
        """A model converted since attach (``model.double()``, ``.half()``, ``.to(...)``, ``p.data = ...``) is
        refused before its forward runs (:meth:`memsched.chunks.binding.ChunkBindings.check_bound`:
        RuntimeError naming the parameter and the fix). A dtype change would otherwise fail inside autograd
        with torch's ``grad_dtype`` error, naming neither memsched nor what to do. Not in compiled code: the
        conversion makes Dynamo recompile, and ``optimizer.step()`` checks anyway."""
        if torch.compiler.is_compiling():
            return
        with torch._C.DisableTorchFunction():  # bookkeeping, not reads of the parameters
            if self.store.bindings.unbound(quick=True) is not None:
                # A new memory format is followed (after the update in flight); anything else is refused.
                self.updates.wait_all()
                self.store.follow_memory_format()
                self.store.bindings.check_bound({id(p): n for n, p in self.model.named_parameters()})

    def _bind_dropped_grads(self) -> None:
        """The parameters become device views again ([Note: host binding] in :mod:`memsched.chunks.store`),
        and gradients set to None since the last step go back into their chunk views (after any D2H copy that
        still reads the buffers). In compiled code the binding runs eagerly (one graph break at the forward's
        start, with one rank); the gradients are not rebound there (backward allocates the gradient and the
        store's post-accumulate hook copies it into the chunk view)."""
        if torch.compiler.is_compiling():  # done by _compiled_wait, in the same graph break
            # No waits (every chunk was on the device), but a plan moved chunks to the host since: they are
            # bound here until the step's end installs the waits ([Note: waits only where a copy can be in
            # flight]).
            if not self.needed and self.store.offloading:
                _compiled_root_eager(self)
            return
        with torch._C.DisableTorchFunction():  # ``p.grad`` is bookkeeping here, not a read of the parameter
            self.store.backward.end_aborted()  # the last backward raised: end it before this forward
            if self.store.lazy_grads:  # frees unused gradient buffers; a copy in flight keeps its own alive
                self.store.bindings.enter_compute()
                self.store.grads.bind_dropped()
                return
            dropped = any(p.grad is None for p in self.store.params())
            if dropped:  # the views are zeroed: after the D2H copies that still read them
                self.streams.wait([c.d2h_event for c in self.store.chunks], "forward (p.grad was None)")
                self.store.grads.bind_dropped()

    def _forward_end(self, output: Any = None) -> None:
        # ZeRO-3: the guard stays on ([Note: reads of sharded parameters] in memsched.runtime.param_fetch)
        if self._guarded and not (self.fetcher is not None and self.fetcher.keeps_guard()):
            self._guarded = False
            self.guard.pop()
        if torch.compiler.is_compiling():  # a compiled submodule called after this forward waits again
            self._root_compiled = False
        if self.drain_after_forward and self.updates.pending:
            t0 = time.perf_counter()
            if self.updates.wait_all() > 0:
                self.timeline.span(WAITS, "end of forward <- all chunks", t0, time.perf_counter())
        self.timeline.forward_end()
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self.store.backward.watch_begin(output)  # [Note: a backward with no forward before it]

    def _between_steps(self) -> None:
        """``state_dict()`` / ``load_state_dict()``: a backward that raised is ended first ([Note: a backward
        that raised] in :mod:`memsched.chunks.store`), then the copies in flight are waited for."""
        with torch._C.DisableTorchFunction():
            self.store.backward.end_aborted()
        self.synchronize()

    def synchronize(self) -> None:
        """Block until the overlapped CPU update (if any) is done, then make the current stream wait for every
        pending H2D copy (the stand-in's link: the host blocks; nothing to wait for otherwise)."""
        if self.updates.pending:
            t0 = time.perf_counter()
            if self.updates.wait_all() > 0:
                self.timeline.span(WAITS, "synchronize() <- all chunks", t0, time.perf_counter())
        self.streams.wait([c.h2d_event for c in self.store.chunks], "synchronize() <- all chunks")
        self._mark_waited(range(len(self.store.chunks)))
        if not torch.compiler.is_compiling():
            self._leave_between()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._leave_between()
        if self._guarded:  # removed during a forward (close() in it, a failed forward)
            self._guarded = False
            self.guard.pop()


#: Guards of reads between steps left while a mode entered after them was on top (see _leave_between).
_STALE: list[ReadGuard] = []


def _drain_stale() -> None:
    """Take off the top of this thread's torch function modes the stale guards of reads between steps."""
    while _STALE:
        n = torch._C._len_torch_function_stack()
        top = torch._C._get_function_stack_at(n - 1) if n else None
        if top is None or not any(top is g for g in _STALE):
            return
        _STALE.remove(top)
        top.__exit__(None, None, None)


def _in_flight(event: Any) -> bool:
    """A chunk's H2D copy (a CUDA event, a stand-in link's event, or ``None``) may still be running."""
    return event is not None and not event.query()


@torch.compiler.disable
def _synchronize_eager(waits: H2DWaits) -> None:
    waits.synchronize()


@torch.compiler.disable
def _compiled_root_eager(waits: H2DWaits) -> None:
    # Set here, eagerly, before the graph break's resume function runs the rest of the root's forward:
    # Dynamo reads the real value when it traces that function.
    waits._root_compiled = True
    waits._compiled_forwards = True
    waits.synchronize()
    if waits.store.offloading:
        with torch._C.DisableTorchFunction():
            waits.store.bindings.enter_compute()


# [Note: the root hook's graph break]
# The break in _compiled_wait is hit when Dynamo traces the compiled module's frame; the frames under it
# then run one by one, and Dynamo compiles each on its own. The shared Detachable.__call__ would be compiled
# once per hook it wraps (its guard is the wrapped function's code), up to the recompile limit, each time
# meeting the break again: it runs eagerly as a top-level frame instead (still inlined into compiled code).
# _compiled_wait itself must stay compiled: run eagerly it would take its eager branch.
_skip_code = getattr(getattr(torch._dynamo, "eval_frame", None), "skip_code", None)
if _skip_code is not None:
    _skip_code(Detachable.__call__.__code__)
