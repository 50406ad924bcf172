"""The overlap half of :class:`memsched.optim.hybrid_adamw.HybridAdamW`: the early D2H of host chunks'
gradients during backward, checked at the step by a fingerprint (:mod:`memsched.chunks.fingerprint`), and the
hand-off of host chunks to the CPU worker (:mod:`memsched.optim.host_updates`). A mixin: the optimizer's state
is its state."""

from __future__ import annotations

import time
from typing import Any

import torch

from memsched.chunks import Chunk
from memsched.optim.hyperparams import check_hyperparameters
from memsched.telemetry.step_timeline import WAITS
from policies.types import HOST


class OverlapMixin:
    """Early D2H and the overlapped CPU update (see the module docstring)."""

    # The optimizer's attributes this mixin reads and writes (set in HybridAdamW.__init__).
    store: Any
    streams: Any
    dp: Any
    timeline: Any
    host_updates: Any
    early_updates: Any
    scaler: Any
    transfers: Any
    param_groups: list[dict[str, Any]]
    _clip_coefs: list[torch.Tensor]
    _spec_inv: torch.Tensor | None
    _active: set[int]
    early_d2h: bool
    _early: dict[int, torch.Tensor]
    _fingerprints: Any
    _param_versions: dict[int, int]

    def grads_ready(self, c: Chunk) -> None:
        """The store's observer: all of ``c``'s gradients are complete in this backward. With ``early_d2h``, a
        host chunk's D2H starts now, overlapping the rest of backward (ZeRO-Offload's overlap, arXiv
        2101.06840 section 4.2), and its gradients are fingerprinted so that the step can tell whether
        anything wrote them after the copy (clipping, ``p.grad.mul_()``, another backward). With
        ``overlap="backward"`` its update starts too (:mod:`memsched.optim.early_update`)."""
        if c.placement != HOST:
            return
        hp = self._early_hyperparameters(c)
        if not self.early_d2h and hp is None:
            return
        self.host_updates.wait([c.index])  # the worker no longer reads its host buffers
        if self.early_d2h:
            with self.store.alloc.host_context():  # the stand-in does not count the fingerprint's temporaries
                self._early[c.index] = self._fingerprints.of(c.grad[c.lo:c.hi])
            self._start_d2h(c)
        elif hp is not None:  # the worker copies the gradients (synchronous copies: no CUDA)
            self.transfers.add_d2h(c.shard_numel * c.grad.element_size())
        if hp is not None:
            self.early_updates.start(c, hp, self._spec_inv if self.scaler is not None else None,
                                     c.d2h_event if self.early_d2h else None)

    def _early_hyperparameters(self, c: Chunk) -> dict[str, Any] | None:
        """The hyper-parameters for an update of ``c`` during backward, or ``None`` when it is not made: not
        enabled, more than one rank, fp16 before its first inverse scale, a clip coefficient already pending,
        or a group the step would refuse."""
        if not self.early_updates.enabled or self.dp.world != 1 or self._clip_coefs:
            return None
        if self.scaler is not None and self._spec_inv is None:
            return None
        try:
            return check_hyperparameters(self.param_groups[c.group], f"param group {c.group}")
        except ValueError:  # the step raises it
            return None

    def _commit_early(self, host_chunks: list[Chunk], hps: list[dict[str, Any]],
                      inv_host: torch.Tensor | None,
                      coefs: list[torch.Tensor], copied: set[int]) -> set[int]:
        """Swap in the updates made during backward that equal the step's (:meth:`EarlyUpdates.commit`); the
        gradients are compared by fingerprint where they were copied early (CUDA), else bit for bit."""
        if not self.early_updates.tickets:
            return set()

        def grads_equal(c: Chunk, ticket: Any) -> bool:
            if self.early_d2h:
                return c.index in copied
            with self.store.alloc.host_context():
                return torch.equal(_bits(c.grad[c.lo:c.hi]), _bits(ticket.snapshot))

        return self.early_updates.commit(host_chunks, hps, inv_host, coefs, self._active, grads_equal)

    def _early_copies_valid(self, host_chunks: list[Chunk], early: dict[int, torch.Tensor]) -> set[int]:
        """Indices of the host chunks copied in backward whose gradients did not change since: their copy is
        used. The fingerprints are compared now, after everything that may have written the gradients; the
        host waits for that comparison (on CUDA, for backward to finish on the device), so that the copies
        made again instead are ordered before anything that writes the gradients next (``zero_grad``)."""
        chunks = [c for c in host_chunks if c.index in early]
        if not chunks:
            return set()
        with self.store.alloc.host_context():
            now = torch.stack([self._fingerprints.of(c.grad[c.lo:c.hi]) for c in chunks])
            same = (now == torch.stack([early[c.index] for c in chunks])).all(dim=1).tolist()
        return {c.index for c, ok in zip(chunks, same, strict=True) if ok}

    # ---- step ---------------------------------------------------------------------------------------------

    def _submit_host(self, host_chunks: list[Chunk], hps: list[dict[str, Any]],
                     inv_scale: torch.Tensor | None, coefs: list[torch.Tensor], committed: set[int]) -> None:
        """Hand the host chunks to the worker (:mod:`memsched.optim.host_updates`), in chunk (first-use)
        order. Their H2D copies wait for the work queued so far (this step's backward), not for the next
        forward. The ``committed`` ones were updated during backward: only their H2D copies are left."""
        after = self.streams.record()
        by_index = {c.index: c for c in host_chunks}

        def update(i: int) -> None:
            c = by_index[i]
            self._update_host(c, hps[c.group], inv_scale, coefs, after=after, updated=i in committed)

        def follow_up(i: int) -> None:  # on the training thread: collectives, version bookkeeping
            c = by_index[i]
            self.store.after_update(c)
            self.dp.end_step()  # its fetch (ZeRO all-gather) completes before the forward reads the chunk
            for p in c.params:  # the H2D copy moved their version counters
                self._param_versions[id(p)] = p._version

        self.host_updates.submit(sorted(by_index), update, follow_up)
        # CUDA: what the compute stream runs next comes after the D2H copies that still read the gradients, so
        # an in-place write memsched cannot see (``model.zero_grad(set_to_none=False)``, ``p.grad.zero_()``)
        # cannot change them under a copy. The host does not wait (the worker waits for each copy itself).
        self.streams.wait([c.d2h_event for c in host_chunks])

    def wait_updates(self, what: str = "synchronize()") -> None:
        """Block until the last step's overlapped CPU update is done and followed up (nothing pending without
        ``overlap=True``); the time blocked is a span of the step timeline named after ``what``.

        Raises:
            memsched.optim.host_updates.OverlapError: the overlapped update failed.
        """
        t0 = time.perf_counter()
        blocked = self.host_updates.wait_all()
        if self.early_updates.tickets:  # anything that reads or writes the state waits for the worker's reads
            self.early_updates.wait()
            blocked = time.perf_counter() - t0
        if blocked > 0:
            self.timeline.span(WAITS, f"{what} <- all chunks", t0, time.perf_counter())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (an integer view): equal bits, not equal values (-0.0 == 0.0 and NaN != NaN as
    values, and AdamW may round either differently)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])
