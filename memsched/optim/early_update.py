"""The CPU update of host chunks during backward (``memsched.attach(..., overlap="backward")``), exact.

With ``overlap=True`` the CPU update of the host chunks overlaps the *next forward*
(:mod:`memsched.optim.host_updates`). The placement keeps the first-used chunks on the device, so the host
chunks are the last used: their gradients are complete first in backward. ``overlap="backward"`` starts each
host chunk's update as soon as its gradients are complete, on the same CPU worker, while backward goes on, and
the step only commits it:

0. **Refill** (:meth:`EarlyUpdates.refill`, at the end of ``step()``): once a chunk's state for the next step
   is final, the worker copies it into the chunk's *spare* host state of the same layout
   (:meth:`Chunk.alloc_spare`), recording the state allocation's version counter around its reads. The copy
   runs after the step's own host updates, while the next forward computes, not during backward.
1. **Speculate** (:meth:`EarlyUpdates.start`, from the store's gradients-ready signal, training thread): the
   chunk's gradients are on their way to its host gradients (:mod:`memsched.chunks.grad_offload`). The worker
   waits for that copy, snapshots them and runs the very same fused AdamW on the spare state, with the
   hyper-parameters and the fp16 inverse scale in force. If the state was written since its refill (or
   there was none), it is copied again first. A micro-batch whose gradients are added to an earlier one's
   speculates nothing.
2. **Commit** (:meth:`EarlyUpdates.commit`, in ``optimizer.step()``): the update is swapped in
   (:meth:`Chunk.swap_spare`, no copy) only if it is the update ``step()`` would make now: the host gradients
   are bit for bit the ones it used (``torch.equal``: clipping, ``p.grad.mul_()``, another backward,
   ``zero_grad()`` all show), no clip coefficient is pending (fp16
   clipping), the group's hyper-parameters and the inverse scale are equal, every parameter of the chunk has a
   gradient, and nothing wrote the chunk's state since (its version counter: ``load_state_dict``, a
   checkpoint, a user's write to a parameter). Otherwise the spare result is dropped and the chunk is updated
   at the step as without it. The state in force is never written before the step, so anything that reads it
   between backward and step (``state_dict()``, a checkpoint) reads the state before the step.

The price is host memory: a spare state per speculating chunk (master, moments, host gradient buffer). The
plan chooses which host chunks speculate (:func:`policies.speculation.speculate`: within the host memory
left, and no more than backward can hide) and counts their spare states; the others are updated at the step.
If a spare cannot be allocated, a warning says so and host chunks are updated at the step.
Not under data parallelism (the gradients are reduced first) and not during warmup.

The idea of updating offloaded state during backward comes from ZeRO-Offload's one-step delayed parameter
update (arXiv 2101.06840, section 5), which is not exact; here the update is exact because it is only kept
when it equals the one the step would make.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from memsched.chunks import Chunk
from memsched.telemetry.step_timeline import CPU_UPDATE
from policies.types import HOST

OVERLAP_MODES = (False, True, "backward")


def check_overlap(overlap: Any) -> tuple[bool, bool]:
    """``(overlap with the next forward, update during backward)`` for an ``overlap`` argument.

    Raises:
        ValueError: ``overlap`` is not ``False``, ``True`` or ``"backward"``.
    """
    if overlap is False or overlap is True:
        return overlap, False
    if overlap == "backward":
        return True, True
    raise ValueError(f"overlap must be False, True or 'backward', got {overlap!r}")


@dataclass
class Ticket:
    """One speculative update of a chunk: what it was computed with, and what the worker recorded."""

    hp: dict[str, Any]
    inv_scale: torch.Tensor | None
    snapshot: torch.Tensor  # the host copy of the gradients the update read
    state: torch.Tensor  # the chunk's exp_avg when it started: the same allocation at the commit, or none
    future: Future | None = None
    version: int | None = None  # the state's version counter after the worker read it (None: changed)
    error: BaseException | None = None
    # Held by the worker while it runs; a later ticket of the chunk cancels this one (it then never starts)
    # and takes the lock before touching the spare's buffers, which the two share.
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False


@dataclass
class Refill:
    """The copy of a chunk's state into its spare state (``ok``: it is the state whose allocation is
    ``state`` at version ``version``: nothing wrote it while the worker read it)."""

    state: torch.Tensor
    version: int
    future: Future | None = None
    ok: bool = False
    error: BaseException | None = None  # what stopped the copy (the speculation then copies itself)


@dataclass
class EarlyUpdates:
    """The speculative host-chunk updates of the backward in progress (see the module docstring).

    Args:
        submit: runs a function on the CPU-update worker (after what it already has), returns its future.
        adamw: ``adamw(chunk, master, grad, exp_avg, exp_avg_sq, steps, hp)``: the optimizer's fused AdamW
            over every parameter of ``chunk`` with the given fp32 state tensors (``[hi - lo]``, ``steps``
            ``[len(params)]``).
        fp32_grad: ``fp32_grad(g, out, inv_scale, coefs)``: the optimizer's upcast and unscale.
        span: the step timeline's ``span``.
        alloc: the chunks' allocator (the spare state is allocated like the host state).
    """

    submit: Callable[[Callable[[], None]], Future]
    adamw: Callable[..., None]
    fp32_grad: Callable[..., torch.Tensor]
    span: Callable[..., None]
    alloc: Any
    enabled: bool = False
    speculative: frozenset[int] = frozenset()  # the chunks the plan lets speculate (plan.speculative)
    tickets: dict[int, Ticket] = field(default_factory=dict)
    refills: dict[int, Refill] = field(default_factory=dict)
    committed: int = 0  # updates committed (statistics)
    committed_bytes: int = 0  # their fp32 state elements x 4, bytes (statistics)
    dropped: int = 0  # updates made during backward and not committed (statistics)

    def enable(self, world: int, chunks: list[Chunk], speculative: Sequence[int]) -> None:
        """Start (at the end of warmup): with one rank, :meth:`choose` the plan's ``speculative`` chunks
        among ``chunks``; with more, warn that the updates wait for the step (the gradients are reduced
        first)."""
        if world > 1:
            warnings.warn(f"memsched: overlap='backward' needs one rank; with {world} ranks host chunks are "
                          "updated after the gradient reduction, overlapping the next forward",
                          RuntimeWarning, stacklevel=3)
            return
        self.enabled = True
        self.choose(chunks, speculative)

    def choose(self, chunks: list[Chunk], speculative: Sequence[int]) -> None:
        """The plan in force lets the host chunks ``speculative`` (indices) speculate: their spare host
        states are allocated and refilled now rather than at their first update in backward (a pinned
        allocation synchronises the device); the other chunks' spare states are freed."""
        if not self.enabled:
            return
        self.wait()
        self.speculative = frozenset(speculative)
        for c in chunks:
            if c.index in self.speculative and c.placement == HOST:
                if self._alloc_spare(c):
                    self.refill(c)
            else:
                c.drop_spare()
            if c.index not in self.speculative or c.placement != HOST:  # a refill holds the old host state
                self.refills.pop(c.index, None)

    def refill(self, c: Chunk) -> None:
        """Copy ``c``'s state into its spare state on the worker, after what it already has (the step's own
        host updates): the next speculation of ``c`` starts from it unless the state is written meanwhile."""
        if not self.enabled or c.spare is None or c.placement != HOST or c.exp_avg is None:
            return
        r = Refill(c.exp_avg, -1)
        self.refills[c.index] = r
        r.future = self.submit(lambda: self._refill(c, r))

    def _refill(self, c: Chunk, r: Refill) -> None:
        # The version is read here, on the worker, after the step's own update of the chunk (queued before
        # this): read on the training thread it would be the one before that update, and never match.
        t0 = time.perf_counter()
        try:
            spare = c.spare
            if spare is None or c.exp_avg is not r.state:
                return
            r.version = c.state_version()
            with torch.no_grad():
                for k in ("master", "exp_avg", "exp_avg_sq", "steps"):
                    spare[k].copy_(getattr(c, k))  # type: ignore[union-attr]
            r.ok = c.state_version() == r.version and c.exp_avg is r.state
        except BaseException as e:  # the speculation copies inline instead
            r.ok, r.error = False, e
        finally:
            self.span(CPU_UPDATE, "refill spare", t0, time.perf_counter(), chunk=c.index)

    def wait_refill(self, index: int) -> None:
        """Block until the worker no longer reads chunk ``index``'s state for its refill."""
        r = self.refills.get(index)
        if r is not None and r.future is not None:
            r.future.result()

    @property
    def busy(self) -> bool:
        """Whether the worker may still read some chunk's state (a speculation or a refill)."""
        return bool(self.tickets) or any(r.future is not None and not r.future.done()
                                         for r in self.refills.values())

    def _alloc_spare(self, c: Chunk) -> bool:
        try:
            with self.alloc.host_context():
                c.alloc_spare(self.alloc)
            return True
        except RuntimeError as e:  # out of (pinned) host memory: update at the step instead
            self.enabled = False
            warnings.warn(f"memsched: overlap='backward' could not allocate the spare host state of chunk "
                          f"{c.index} ({c.state_nbytes()} bytes; {e}); host chunks are updated after "
                          "backward from now on", RuntimeWarning, stacklevel=3)
            return False

    def start(self, c: Chunk, hp: dict[str, Any], inv_scale: torch.Tensor | None, copy_event: Any = None,
              landing: torch.Tensor | None = None, parts: Sequence[tuple[int, int, bool]] = ()) -> None:
        """Speculate the update of host chunk ``c`` whose gradients are complete (training thread).
        ``copy_event``: the event of their D2H copy (a CUDA event, the stand-in link's), or ``None`` when it
        is done already. ``landing``: where a later micro-batch's copy lands (``None``: in ``c.grad_host``);
        then ``parts`` says how each parameter's joins its host gradient (``(offset, numel, add)``, as
        :meth:`memsched.chunks.grad_offload.GradOffload.in_flight`), which the update does on its snapshot
        exactly as the offload will on the host gradients at backward's end."""
        if c.index not in self.speculative or not self._alloc_spare(c):
            return
        assert c.spare is not None
        prev = self.tickets.get(c.index)
        if prev is not None:  # an earlier micro-batch's: replaced (if it is running, it finishes first)
            prev.cancelled = True
            with prev.lock:
                pass
        snapshot = c.spare["grad_host"]  # the spare's own host gradients: a private copy
        if landing is not None:  # the earlier micro-batches' host gradients, before backward's end adds
            with torch.no_grad(), self.alloc.host_context():
                snapshot.copy_(c.grad_host)
        ticket = Ticket(hp, inv_scale, snapshot, c.exp_avg)
        self.tickets[c.index] = ticket  # a later backward (accumulation) replaces it; the worker keeps order
        ticket.future = self.submit(lambda: self._run(c, ticket, copy_event, landing, list(parts)))

    def _run(self, c: Chunk, ticket: Ticket, copy_event: Any, landing: torch.Tensor | None,
             parts: list[tuple[int, int, bool]]) -> None:
        """The worker: wait for the gradients' copy and snapshot them, copy the state into the spare, then
        update the spare."""
        with ticket.lock:
            if not ticket.cancelled:
                self._speculate(c, ticket, copy_event, landing, parts)

    def _speculate(self, c: Chunk, ticket: Ticket, copy_event: Any, landing: torch.Tensor | None,
                   parts: list[tuple[int, int, bool]]) -> None:
        t0 = t1 = t2 = time.perf_counter()
        try:
            with torch.no_grad():
                if copy_event is not None:
                    copy_event.synchronize()
                if landing is None:
                    ticket.snapshot.copy_(c.grad_host)
                else:  # what the offload makes of the host gradients at backward's end
                    for a, n, add in parts:
                        if add:
                            ticket.snapshot[a:a + n].add_(landing[a:a + n])
                        else:
                            ticket.snapshot[a:a + n].copy_(landing[a:a + n])
                spare = c.spare
                assert spare is not None and c.master is not None
                t1 = t2 = time.perf_counter()
                r = self.refills.pop(c.index, None)  # the speculation writes the spare: a refill is used once
                if r is not None and r.ok and r.state is c.exp_avg and r.version == c.state_version():
                    before = r.version
                else:  # no refill, or the state changed since: copy it now
                    before = c.state_version()
                    for k in ("master", "exp_avg", "exp_avg_sq", "steps"):
                        spare[k].copy_(getattr(c, k))
                    t2 = time.perf_counter()
                    if c.state_version() != before:  # written while being read: not the state of the step
                        return
                g = ticket.snapshot  # fp32 and unscaled: read as it is (the kernel does not write it)
                if g.dtype != torch.float32 or ticket.inv_scale is not None:
                    g = self.fp32_grad(g, spare["host_grad"], ticket.inv_scale, [])
                self.adamw(c, spare["master"], g, spare["exp_avg"], spare["exp_avg_sq"], spare["steps"],
                           ticket.hp)
                if spare["staging"] is not None:  # cast on the CPU, so the H2D copy is a plain pinned copy
                    spare["staging"].copy_(spare["master"])
                ticket.version = before
        except BaseException as e:  # the step updates the chunk as without it
            ticket.error = e
        finally:  # the gradients' wait and snapshot, a state copy if the refill missed, the update
            t3 = time.perf_counter()
            t1, t2 = min(t1, t3), min(max(t1, t2), t3)
            self.span(CPU_UPDATE, "gradients in backward", t0, t1, chunk=c.index)
            if t2 > t1:
                self.span(CPU_UPDATE, "copy in backward", t1, t2, chunk=c.index)
            self.span(CPU_UPDATE, "update in backward", t2, t3, chunk=c.index)

    def wait(self) -> None:
        """Block until the worker is done with every speculative update and refill (nothing is committed)."""
        for t in list(self.tickets.values()):
            if t.future is not None:
                t.future.result()
        for r in list(self.refills.values()):
            if r.future is not None:
                r.future.result()

    def commit(self, chunks: list[Chunk], hps: list[dict[str, Any]], inv_scale: torch.Tensor | None,
               coefs: list[torch.Tensor], active: set[int],
               grads_equal: Callable[[Chunk, Ticket], bool]) -> set[int]:
        """At ``step()``, after everything that may change the update was applied: swap in each speculative
        update that equals the one the step would make now (see the module docstring); returns the indices of
        the chunks committed. Every ticket is consumed."""
        self.wait()
        tickets, self.tickets = self.tickets, {}
        done: set[int] = set()
        for c in chunks:
            t = tickets.get(c.index)
            if t is None:
                continue
            same_scale = (t.inv_scale is None) == (inv_scale is None) and (
                inv_scale is None or torch.equal(t.inv_scale, inv_scale))
            if (t.error is None and t.version is not None and t.state is c.exp_avg and c.spare is not None
                    and t.version == c.state_version() and not coefs
                    and same_scale and t.hp == hps[c.group] and all(id(p) in active for p in c.params)
                    and grads_equal(c, t)):
                c.swap_spare()
                done.add(c.index)
                self.committed += 1
                self.committed_bytes += 4 * (c.hi - c.lo)
            else:
                self.dropped += 1
        return done

    def discard(self) -> None:
        """Drop every speculative update (after the worker is done with them)."""
        self.wait()
        # A skipped step (fp16 overflow) drops them: they count as dropped, as in commit(), so that
        # committed + dropped accounts for every update the step consumed (bench/overlap_step.py reports it).
        self.dropped += len(self.tickets)
        self.tickets = {}
