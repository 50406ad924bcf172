"""Host chunks' gradients leave the device as backward completes them (one rank).

A chunk whose optimizer state lives on the host is updated on the CPU, so its gradients are needed on the
host, not on the device. With one rank, when backward completes a host chunk's gradients (the store's
gradients-ready signal) they start their D2H copy into the chunk's pinned ``grad_host`` and the chunk's device
gradient buffer is released: only the chunks whose gradients are still being produced hold device gradient
memory (the *working set*, measured here as :attr:`GradOffload.live_max`). At backward's end every copy is
waited for and the host chunks become host-bound
(:meth:`memsched.chunks.binding.ChunkBindings.to_host`): ``p.grad`` is
then the host gradient itself, so whatever reads or writes it before the step (torch's ``clip_grad_norm_``,
``p.grad.mul_()``, a user's check) sees and changes what the CPU update will read. Nothing needs to be copied
again at the step.

[Note: accumulation on the host]
A second micro-batch's gradients meet the first's on the host: the D2H copy of the new ones lands in the
chunk's ``landing`` buffer and, once it is complete, each parameter that got a gradient in this backward has
it added to its host gradient (``grad_host += landing``, in the gradients' dtype, as torch's
``p.grad = p.grad + new`` adds them: one exactly rounded IEEE addition, the same on either side). A parameter
without a gradient in this backward keeps its host gradient untouched; one with no earlier gradient takes the
new one as it is. The first micro-batch after ``zero_grad`` lands straight in ``grad_host``.

The ideas: DeepSpeed ZeRO-Offload moves gradients to the CPU during backward (arXiv 2101.06840, section 4.2);
ColossalAI's "optimize grad offload" moves the gradient payload in place instead of cloning it; FSDP2's
``CPUOffloadPolicy`` leaves sharded gradients on the host, where ``clip_grad_norm_`` finds them. torchao's
``offload_gradients`` overwrites the host gradient at every backward; here micro-batches add up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from memsched.chunks.chunk import Chunk
from memsched.chunks.store import ChunkStore


@dataclass
class _Offload:
    """One chunk's gradients on their way to the host: the parameters that got a gradient in this backward
    (``fresh``) and where the copy lands (``landing``: ``None`` when it lands in ``grad_host`` itself)."""

    chunk: Chunk
    fresh: list[torch.nn.Parameter]
    landing: torch.Tensor | None


class GradOffload:
    """The gradient offload of one store (see the module docstring).

    Args:
        store: the chunks; this registers itself as its first gradients-ready observer, a backward-end
            observer and a zero_grad observer.
        start_d2h: ``f(chunk, dst) -> bytes``: start the D2H copy of ``chunk``'s device gradients of its shard
            into ``dst`` (a host tensor of ``[hi - lo]``), after the work queued so far.
        wait_worker: ``f(chunk)``: block until no CPU update reads ``chunk``'s host buffers
            (``overlap=True``).

    Attributes:
        live_max: the most host chunks that held device gradients at once (the gradient working set, for
            planning), since :meth:`reset_live_max`.
        offloaded_bytes: gradient bytes copied to the host so far.
    """

    def __init__(self, store: ChunkStore, start_d2h: Callable[[Chunk, torch.Tensor], int],
                 wait_worker: Callable[[Chunk], None] | None = None) -> None:
        self.store = store
        self._start_d2h = start_d2h
        self._wait_worker = wait_worker or (lambda c: None)
        self._pending: list[_Offload] = []
        self._observers: list[Callable[[Chunk, list[torch.nn.Parameter], bool], None]] = []
        self.live_max = 0
        self.offloaded_bytes = 0
        store.backward.observe_grads_ready(self.grads_ready)
        store.backward.observe_end(self.finish)
        store.grads.observe_zero_grad(self.discard)
        store.install_offloader(self)

    def in_flight(self, c: Chunk) -> tuple[torch.Tensor | None, list[tuple[int, int, bool]]] | None:
        """Where the gradients of ``c`` that this backward offloaded land, and how they join the host
        gradients: ``(landing, parts)`` with ``landing`` ``None`` when they land in ``grad_host`` itself, else
        ``parts`` lists ``(offset in the shard, numel, add)`` per parameter that got a gradient (``add``:
        added to its host gradient, else copied). ``None`` when nothing of ``c`` is in flight."""
        store = self.store
        for off in reversed(self._pending):
            if off.chunk is c:
                parts = [(store.param_range[id(p)][0] - c.lo, store.param_range[id(p)][1],
                          id(p) in store.grads.host_grads) for p in off.fresh]
                return off.landing, parts
        return None

    def observe_offload(self, observer: Callable[[Chunk, list[torch.nn.Parameter], bool], None]) -> None:
        """Call ``observer(chunk, fresh, accumulating)`` as each chunk's gradients leave the device, while its
        device gradient buffer ``chunk.grad`` still holds them (after their D2H copy was issued, on the
        device's queue before the buffer is released): ``fresh`` are the parameters that got a gradient in
        this backward, ``accumulating`` whether they are to be added to earlier ones on the host."""
        self._observers.append(observer)

    @property
    def pending(self) -> bool:
        """Copies started in a backward that has not ended yet (or that failed)."""
        return bool(self._pending)

    def reset_live_max(self) -> None:
        """Start measuring the working set anew."""
        self.live_max = 0

    def grads_ready(self, c: Chunk) -> None:
        """All of ``c``'s gradients are complete in this backward: a host chunk's go to the host now."""
        if self.store.offloads(c) and c.grad is not None:
            self._offload(c)

    def _offload(self, c: Chunk) -> None:
        store = self.store
        live = sum(1 for x in store.chunks if x.grad is not None and store.offloads(x))
        self.live_max = max(self.live_max, live)
        fresh = [p for p in c.params if id(p) in c.ready]
        self._wait_worker(c)  # the CPU update of the last step no longer reads the host gradients
        held = any(id(p) in store.grads.host_grads for p in c.params)
        landing = c.landing_buffer(store.alloc) if held else None
        dst = landing if landing is not None else c.grad_host
        self.offloaded_bytes += self._start_d2h(c, dst)
        self._pending.append(_Offload(c, fresh, landing))
        for observer in self._observers:
            observer(c, fresh, landing is not None)
        store.grads.free(c)  # the copy holds the buffer until it is done (CUDA: its stream is recorded)

    def finish(self) -> None:
        """Backward's end: chunks whose gradients backward did not complete (a parameter without a gradient)
        go to the host too, every copy is waited for, and later micro-batches' gradients are added on the
        host (see [Note: accumulation on the host])."""
        store = self.store
        for c in store.chunks:
            if store.offloads(c) and c.grad is not None:
                c.set_ready({id(p) for p in c.params if p.grad is not None})
                self._offload(c)
        pending, self._pending = self._pending, []
        with torch.no_grad(), store.alloc.host_context():
            for off in pending:
                c = off.chunk
                c.wait_d2h()
                for p in off.fresh:
                    if off.landing is not None:
                        r0, n = store.param_range[id(p)]
                        new = off.landing[r0 - c.lo:r0 - c.lo + n]
                        host = c.grad_host[r0 - c.lo:r0 - c.lo + n]
                        if id(p) in store.grads.host_grads:
                            host.add_(new)
                        else:
                            host.copy_(new)
                    store.grads.host_grads.add(id(p))

    def discard(self) -> None:
        """``zero_grad`` (also after a backward that failed): copies in flight are waited for and dropped."""
        pending, self._pending = self._pending, []
        for off in pending:
            off.chunk.wait_d2h()
