"""The backward stage of a step: the gradient hooks on the parameters and where the store is in a backward.

:class:`BackwardTracker` owns the parameters' gradient hooks (:meth:`BackwardTracker.install` at attach,
:meth:`BackwardTracker.remove` at ``close()``), each chunk's readiness announcements (to the data parallelism,
then to the observers: the gradient offload, the optimizer's updates during backward), the end of every
backward (observers told, then the host chunks host-bound), and the :class:`BackwardPhase`, changed only by
its named transitions ([Note: the backward phase]). Its lifecycle per backward: a gradient reaches a hook
(``IN_BACKWARD``, the end queued), chunks complete and are announced after the user's hooks, the outermost
end runs (``IDLE``); a backward that raised is ended in its place (``ABORTED``) until ``zero_grad`` (the
gradient buffers' :meth:`memsched.chunks.gradients.GradBuffers.zero_grad`) or a backward that ends whole.

The tracker belongs to one :class:`memsched.chunks.store.ChunkStore` (``store.backward``) and reads its
chunks, bindings and gradient buffers (``store.grads``); nothing else changes its state.
"""

from __future__ import annotations

import enum
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from memsched.chunks.chunk import Chunk
from memsched.chunks.sharded_grad import is_sharded
from tracer.hook_handles import Detachable
from tracer.ops import graph_task_id


class BackwardPhase(enum.Enum):
    """Where a store is in a backward: one state, changed only by the tracker's named transitions
    (see [Note: the backward phase]), as FSDP2's ``FSDPParamGroup`` owns its ``TrainingState``.

    * ``IDLE``: no backward is running, and the last one ended whole (or ``zero_grad`` came since).
    * ``IN_BACKWARD``: a backward is running: a gradient reached a hook and its end is queued
      (:meth:`BackwardTracker.note_backward`; one rank and ZeRO-2). Backwards nested in it
      (``checkpoint(use_reentrant=True)``) keep it until the outermost one ends.
    * ``ABORTED``: a backward raised and was ended in its place (:meth:`BackwardTracker.end_aborted`): its
      partial gradients stay, and :meth:`memsched.chunks.store.ChunkStore.settle` refuses a step until
      ``zero_grad`` or a backward that ends whole.
    """

    IDLE = "idle"
    IN_BACKWARD = "in backward"
    ABORTED = "aborted"


class BackwardTracker:
    """The gradient hooks of one store's parameters and the backward they follow (see the module docstring).

    Args:
        store: the :class:`memsched.chunks.store.ChunkStore` that owns this tracker.
        on_grads_ready: an observer (:meth:`observe_grads_ready`), or ``None``.

    Attributes:
        grad_events: gradients accumulated by backward so far (any parameter).
    """

    def __init__(self, store: Any, on_grads_ready: Callable[[Chunk], None] | None = None) -> None:
        self._store = store  # memsched.chunks.store.ChunkStore (its owner; a type would be an import cycle)
        self._phase = BackwardPhase.IDLE
        self._end_observers: list[Callable[[], None]] = []
        self._ready_observers: list[Callable[[Chunk], None]] = []  # after the data parallelism's (optimizer)
        if on_grads_ready is not None:
            self._ready_observers.append(on_grads_ready)
        self.grad_events = 0
        self._open_tasks: set[int | None] = set()  # backward passes whose end is queued (_backward_end)
        self._running: set[int] = set()  # backward passes that read a saved parameter, until their end
        self._ready_pending: list[Chunk] = []  # complete chunks not announced yet (_flush_ready)
        self._flush_task: int | None = None  # the backward whose flush is queued (more ranks, ZeRO-0/1)
        self._hooks: list = []
        self._n_params = 0  # the trainable parameters, hooked

    # -- the hooks ------------------------------------------------------------------------------------------
    def install(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Register the gradient hooks on ``params`` (the trainable parameters, at attach)."""
        params = list(params)
        self._n_params = len(params)
        for p in params:
            self._hooks.append(p.register_hook(Detachable(self._pre_grad_hook(p))))
            self._hooks.append(p.register_post_accumulate_grad_hook(Detachable(self._grad_hook)))

    def remove(self) -> None:
        """Remove the gradient hooks (``close()``)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _pre_grad_hook(self, p: torch.nn.Parameter) -> Callable[[torch.Tensor], None]:
        """[Note: gradients land in the chunk]
        One rank: before autograd accumulates a gradient into ``p`` that has none, ``p.grad`` becomes its
        zeroed chunk view (the chunk's buffer is allocated at its first gradient), so that autograd adds the
        gradient into the chunk in place instead of allocating a tensor memsched would copy. ``0 + g == g``
        for every ``g`` (only the sign of an exact zero may differ, which AdamW's moments and updates never
        see). A host chunk's earlier gradients stay on the host: the new ones are added to them there when
        they are offloaded (:mod:`memsched.chunks.grad_offload`).
        A parameter that gets no gradient keeps ``p.grad is None``, as in torch."""
        store = self._store

        def hook(_grad: torch.Tensor) -> None:
            self._flush_ready()
            if not store.lazy_grads:
                return
            c = store.param_chunk.get(id(p))
            if c is None:
                return
            bindings, grads = store.bindings, store.grads
            if not bindings.computing:  # a backward with no forward since the last one ended (retain_graph)
                bindings.enter_compute()
            elif bindings.host_bound(c):  # away from the device since the forward's end
                bindings.to_absent(c) if c.data is None else bindings.to_device(c)
            g = p.grad
            if is_sharded(g):  # ZeRO-2: reduced already; this backward's gradients go to a new buffer
                p.grad = g = None
            if g is not None and store.offloads(c) and (c.grad is None
                                                        or g.data_ptr() != grads.view(p, c).data_ptr()):
                # The host gradients of earlier micro-batches stay on the host; a gradient set by hand since
                # the forward replaces them there. Either way the new gradient is added on the host.
                host = store.host_view("grad", p, c)
                if g.data_ptr() != host.data_ptr() or id(p) not in grads.host_grads:
                    with torch.no_grad(), store.alloc.host_context():
                        host.copy_(g)
                    grads.host_grads.add(id(p))
                p.grad = None
            if p.grad is not None:
                return
            with torch.no_grad():
                view = grads.view(p, c)
                view.zero_()  # may hold the gradient of an earlier backward that model.zero_grad() dropped
            p.grad = view

        return hook

    def _grad_hook(self, p: torch.nn.Parameter) -> None:
        self._flush_ready()
        store = self._store
        c = store.param_chunk.get(id(p))
        if c is None:
            return
        store.grads.rebind(p, c)  # allocates the chunk's gradient buffer at its first gradient
        store.grads.with_grad.add(id(p))
        self.grad_events += 1
        task = self.note_backward()
        if c.mark_grad_ready(id(p), task):
            # See [Note: readiness after the user's hooks]
            self._ready_pending.append(c)
            if not store.lazy_grads and task != self._flush_task:  # no _backward_end queued to flush it
                self._flush_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._flush_ready)

    def _flush_ready(self) -> None:
        """[Note: readiness after the user's hooks]
        A chunk whose last gradient just accumulated is complete, but the post-accumulate-grad hooks the
        user registered on that parameter (after attach's) have not run yet: they must see ``p.grad`` and may
        change it in place (clamp, log, scale), as with torch. So the chunk is announced complete (offload to
        the host, reduction, an update during backward) at the next gradient hook of any parameter, or at
        backward's end, after those hooks ran."""
        grads = self._store.grads
        while self._ready_pending:
            c = self._ready_pending.pop(0)
            for p in c.params:  # a user hook may have replaced p.grad
                if p.grad is not None and not is_sharded(p.grad) and id(p) in grads.with_grad:
                    grads.rebind(p, c)
            self.grads_ready(c)

    def grads_ready(self, chunk: Chunk) -> None:
        """All of ``chunk``'s gradients are complete in this backward (a reduce-scatter goes there, or their
        offload to the host)."""
        self._store.dp.grads_ready(chunk)
        for observer in self._ready_observers:
            observer(chunk)

    def observe_grads_ready(self, observer: Callable[[Chunk], None]) -> None:
        """Call ``observer(chunk)`` whenever all of a chunk's gradients are complete in a backward, after the
        data parallelism was told (its reduction is launched first)."""
        self._ready_observers.append(observer)

    def observe_end(self, observer: Callable[[], None]) -> None:
        """Call ``observer()`` at the end of every backward (one rank), before the host chunks are
        host-bound."""
        self._end_observers.append(observer)

    def tell_end(self) -> None:
        """Tell the end observers that a backward ended (or that its gradients are settled as at its end)."""
        for observer in self._end_observers:
            observer()

    # -- a backward's end ---------------------------------------------------------------------------------
    def _backward_end(self, task: int | None = None) -> None:
        """At the end of a backward (one rank): a parameter of a device chunk that has no gradient (none since
        ``zero_grad``) gets ``p.grad = None``, as in torch, instead of its zeroed chunk view: code that tests
        for None (fill missing gradients with zeros, skip unused parameters) then behaves as with
        ``torch.optim.AdamW``. The view comes back before the next forward
        (:meth:`memsched.chunks.gradients.GradBuffers.bind_dropped`) or at the step. Then the observers finish
        the gradients' offload, and the host chunks become host-bound
        (:meth:`memsched.chunks.binding.ChunkBindings.leave_compute`).

        A backward nested in another (``torch.utils.checkpoint(use_reentrant=True)`` runs one per block inside
        the outer backward) announces its complete chunks and lets the observers finish their offload, but
        the parameters stay bound to the device until the outermost backward ends, since the outer one
        recomputes more blocks that read them."""
        store = self._store
        self._open_tasks.discard(task)
        self._flush_ready()
        if self._open_tasks:  # nested: the offloads it began finish, the parameters stay on the device
            self.tell_end()
            return
        grads = store.grads
        if len(grads.with_grad) < self._n_params:
            for p in store.params():
                if id(p) not in grads.with_grad and p.grad is not None and not is_sharded(p.grad) \
                        and store.param_chunk[id(p)].grad is not None \
                        and p.grad.data_ptr() == grads.view(p).data_ptr():
                    p.grad = None
        self.tell_end()
        self._end_backward()  # after the observers, before the host binding ([Note: the backward phase])
        store.bindings.leave_compute()

    def watch_begin(self, output: Any) -> None:
        """[Note: a backward with no forward before it]
        A retained graph's second backward (``loss.backward(retain_graph=True)`` then ``loss.backward()``)
        starts after the first one's end made the host chunks host-bound:
        its nodes read the parameters autograd saved (the leaves themselves) as host tensors, torch's device
        error, before any gradient reaches a memsched hook. So at the end of a root forward that records a
        graph, every tensor in its output (pytree leaves: tuples, dicts, Hugging Face ``ModelOutput``) gets
        a pre-hook on its ``grad_fn`` that binds the parameters to the device again
        (:meth:`memsched.chunks.binding.ChunkBindings.enter_compute`) where a backward reaches it between
        steps. Every node of the model's graph lies behind one of them, so the pre-hook runs before any node
        that reads a parameter. In a backward that follows its forward the parameters are bound already and
        it does nothing; after ``close()`` it does nothing either (the hooks go with the graph)."""
        store = self._store
        if not store.lazy_grads or not any(store.offloads(c) for c in store.chunks):
            return
        ref = weakref.ref(store)

        def begin(_grad_outputs: Any) -> None:
            store = ref()
            if store is not None and not store.closed and not store.bindings.computing:
                with torch._C.DisableTorchFunction():
                    store.bindings.enter_compute()

        seen: set[int] = set()
        for t in pytree.tree_leaves(output):
            fn = t.grad_fn if isinstance(t, torch.Tensor) else None
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                fn.register_prehook(begin)

    def note_running(self) -> None:
        """A backward (or ``torch.autograd.grad``) runs on this thread and read a saved parameter: it is known
        to be running until its end, so that one that raises is known ([Note: a backward that raised])."""
        task = graph_task_id()
        if task in (None, -1) or task in self._running:
            return
        self._running.add(task)
        done = functools.partial(self._running.discard, task)
        torch.autograd.Variable._execution_engine.queue_callback(done)

    def note_backward(self) -> int | None:
        """A gradient arrived in a backward on this thread: its end is queued once (:meth:`_backward_end`; one
        rank), which also tells a backward that raised before it ([Note: a backward that raised]). Returns
        the graph task's id."""
        task = graph_task_id()
        if self._store.lazy_grads and task != -1 and task not in self._open_tasks:
            self._open_tasks.add(task)
            self._begin_backward()
            end = functools.partial(self._backward_end, task)
            torch.autograd.Variable._execution_engine.queue_callback(end)
        return task

    def end_aborted(self) -> bool:
        """[Note: a backward that raised]
        A backward that raises (an error in a hook, in a checkpointed block's re-forward, out of memory) never
        reaches :meth:`_backward_end`: the parameters stay bound as while computing, those of chunks whose
        buffer is away as NaN views ([Note: absent parameters]), and fetched chunks stay on the device. The
        next use of the model between steps (``zero_grad()``, ``state_dict()``, the next forward) ends that
        backward as a completed one would: the observers settle the fetched chunks and finish the gradients'
        offload, and the host chunks become host-bound, so every parameter reads its value again. Its partial
        gradients stay for the step to refuse (:meth:`memsched.optim.hybrid_adamw.HybridAdamW.step`). Returns
        whether there was one to end; never inside a backward running on this thread."""
        if not (self._open_tasks or self._running) or graph_task_id() not in (-1, None):
            return False
        self._open_tasks.clear()
        self._running.clear()
        self._flush_ready()
        self.tell_end()
        self._abort_backward()  # settle() refuses the partial gradients until zero_grad or a whole backward
        self._store.bindings.leave_compute()
        return True

    def drop_pending(self) -> None:
        """``zero_grad()`` begins: a backward that raised is ended, and what it left unannounced goes."""
        self.end_aborted()
        self._ready_pending.clear()  # of a backward that raised
        self._open_tasks.clear()

    # -- the backward phase -------------------------------------------------------------------------------
    @property
    def phase(self) -> BackwardPhase:
        """Where the store is in a backward (:class:`BackwardPhase`; read-only: the transitions below change
        it)."""
        return self._phase

    @property
    def in_backward(self) -> bool:
        """A backward is running (its end callback is queued): the phase is ``IN_BACKWARD``."""
        return self._phase is BackwardPhase.IN_BACKWARD

    def _begin_backward(self) -> None:
        """[Note: the backward phase]
        The tracker's :class:`BackwardPhase` changes at four points, each a named transition, and where each
        sits against the observers and the bindings matters:

        * ``_begin_backward`` (any phase -> ``IN_BACKWARD``): :meth:`note_backward`, when a gradient opens a
          graph task's end (a nested backward's too, which keeps the phase). From ``ABORTED`` too: a backward
          after one that raised runs, and if it ends whole its gradients are whole again. So
          ``IN_BACKWARD`` goes with a queued end in ``_open_tasks``.
        * ``_end_backward`` (-> ``IDLE``): :meth:`_backward_end`, once the outermost backward's end ran its
          observers, which still see ``IN_BACKWARD``, and before
          :meth:`memsched.chunks.binding.ChunkBindings.leave_compute` makes the host chunks host-bound.
          Nested ends change nothing. It may find ``IDLE`` or ``ABORTED``: a ``zero_grad()`` inside the
          backward (a hook) reset the phase, or a backward running on another thread was ended in its place
          from this one; it ends whole all the same.
        * ``_abort_backward`` (-> ``ABORTED``): :meth:`end_aborted`, after the observers settled what the
          raised backward left, before the host binding. From ``IDLE`` too: a backward that read a saved
          parameter (:meth:`note_running`) but raised before any gradient reached a hook never began the
          phase.
        * ``reset`` (-> ``IDLE``): :meth:`memsched.chunks.gradients.GradBuffers.zero_grad`, after
          :meth:`drop_pending` (whose :meth:`end_aborted` may pass through ``ABORTED`` first) and after the
          zero_grad observers dropped the pending offloads (they see the phase as it was), before the
          gradients are released.

        Every phase can thus follow every other, so the transitions check nothing but are named for the
        event that makes them. :meth:`memsched.chunks.store.ChunkStore.settle` refuses a step in any phase
        but ``IDLE``. The phase is apart from ``ChunkBindings.computing`` (the bindings' phase, from a
        forward's start to its backward's end): a forward after a backward that raised computes while
        ``ABORTED``, and ``settle()`` inside a backward leaves computing while ``IN_BACKWARD``."""
        self._phase = BackwardPhase.IN_BACKWARD

    def _end_backward(self) -> None:
        """The outermost backward ended whole ([Note: the backward phase])."""
        self._phase = BackwardPhase.IDLE

    def _abort_backward(self) -> None:
        """A backward that raised was ended in its place ([Note: the backward phase])."""
        self._phase = BackwardPhase.ABORTED

    def reset(self) -> None:
        """``zero_grad()``: no gradient of any backward stays ([Note: the backward phase])."""
        self._phase = BackwardPhase.IDLE
