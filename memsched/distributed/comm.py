"""Collectives for the ZeRO engine: one process group, this torch's collective names, errors and timeouts.

Every collective goes through :class:`Comm`, which

* picks the flat-tensor collectives of this torch (``all_gather_single`` / ``reduce_scatter_single`` in newer
  torch, ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` since 2.x), with a fallback for backends that
  lack them (``all_gather`` into views of the output; ``all_reduce`` then keep the own part);
* keeps tensors on the backend's side (NCCL: CUDA tensors, others: CPU), staging a copy when needed;
* turns a failed or timed-out collective into a :class:`ZeroCommError` that says which collective, which rank,
  and what to check, instead of a bare backend error or a silent hang. Hangs are bounded by the process
  group's timeout (``torch.distributed.init_process_group(timeout=...)``; gloo honours it for every
  collective) and, at attach, by :meth:`Comm.check_peers` (``monitored_barrier`` on gloo, which names the
  ranks that did not arrive).
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from memsched.distributed.options import as_timedelta


class ZeroCommError(RuntimeError):
    """A collective of the ZeRO engine failed or timed out (a peer rank died, hung or disagrees)."""


def _pick(*names: str) -> Any:
    for n in names:
        f = getattr(dist, n, None)
        if f is not None:
            return f
    return None


class Comm:
    """One data-parallel process group as the ZeRO engine sees it.

    Args:
        group: the process group; ``None`` = the default group (``torch.distributed`` must be initialised for
            a world size above 1).
        timeout: bound of :meth:`check_peers`, seconds or a timedelta; ``None`` = the group's timeout.
        collective_timeout: bound of each wait for a collective (see [Note: bounded waits]); ``None`` = the
            group's timeout.

        device: the compute device given to :func:`memsched.attach`. With NCCL, collectives, staging and
            barriers use it when it is a CUDA device (a rank that did not call ``torch.cuda.set_device`` must
            not fall back to ``cuda:0``: NCCL would see the same GPU twice, or hang); else the current CUDA
            device.

    Attributes: ``rank``, ``world`` (in ``group``), ``backend``, ``device`` (where tensors must be for the
    backend: CUDA for NCCL, else the CPU).
    """

    def __init__(self, group: Any = None, *, timeout: float | datetime.timedelta | None = None,
                 device: torch.device | None = None,
                 collective_timeout: float | datetime.timedelta | None = None) -> None:
        self.group = group
        self.timeout = as_timedelta(timeout)
        self.collective_timeout = as_timedelta(collective_timeout)
        self._waiter: _Waiter | None = None
        self.broken: str | None = None  # why the group cannot be used any more (a collective timed out)
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ValueError("a process_group was given but torch.distributed is not initialised")
            self.rank, self.world, self.backend = 0, 1, "none"
        else:
            self.rank = dist.get_rank(group)
            self.world = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
        self.nccl = self.backend == "nccl"
        self.device = _backend_device(self.nccl, device)
        self._all_gather = _pick("all_gather_single", "all_gather_into_tensor")
        self._reduce_scatter = _pick("reduce_scatter_single", "reduce_scatter_tensor")
        self.reduce_scatter_supported = self._reduce_scatter is not None
        self.all_gather_supported = self._all_gather is not None
        self.all_to_all_supported = getattr(dist, "all_to_all_single", None) is not None

    # ---- errors -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Re-raise a backend failure inside as :class:`ZeroCommError` naming ``what`` and this rank; after a
        collective timed out, refuse at once (the group's pending collectives never complete)."""
        if self.broken is not None:
            raise ZeroCommError(f"{what} on rank {self.rank}: the process group cannot be used since an "
                                f"earlier collective timed out ({self.broken})")
        try:
            with warnings.catch_warnings(), self._on_device():
                # newer torch deprecates the *_tensor collectives; the new names are used where present
                warnings.simplefilter("ignore", FutureWarning)
                yield
        except ZeroCommError:
            raise
        except (RuntimeError, ValueError) as e:  # DistBackendError / DistNetworkError are RuntimeErrors
            raise ZeroCommError(
                f"{what} failed on rank {self.rank} of {self.world} (backend {self.backend}): "
                f"{_first_line(e)}. A peer rank probably died, hung past the process group's timeout "
                "(init_process_group(timeout=...)), or runs a different model/configuration."
            ) from e

    def _on_device(self) -> contextlib.AbstractContextManager:
        """NCCL binds a communicator to the current CUDA device: make it this rank's device."""
        return torch.cuda.device(self.device) if self.nccl else contextlib.nullcontext()

    def wait(self, work: Any, what: str, *, host: bool = False) -> None:
        """Wait for an async collective (NCCL: the current stream waits, or with ``host`` the host until it
        completes; gloo: the host blocks), at most :attr:`collective_timeout` where the host blocks
        ([Note: bounded waits]).

        Raises:
            ZeroCommError: it failed, or did not complete in time (names the likely causes).
        """
        if work is None:
            return
        bound = self.collective_timeout if (host or not self.nccl) else None
        with self.guard(what):
            if bound is None:
                work.wait()
                return
            if self.nccl:  # the host waits for the collective's CUDA event
                if _completes_within(work, bound.total_seconds()):
                    work.wait()
                    return
            else:
                if self._waiter is None:
                    self._waiter = _Waiter()
                if self._waiter.wait(work, bound.total_seconds()):
                    return
                self._waiter = None  # its thread stays blocked in the collective that never completes
        self.broken = f"{what}, collective_timeout={bound.total_seconds():g} s"
        raise ZeroCommError(
            f"{what} on rank {self.rank} of {self.world} did not complete within collective_timeout="
            f"{bound.total_seconds():g} s: a peer rank is not running the same collective. Every rank "
            "must run the same modules in the same order: a branch taken on some ranks only, or a "
            "forward (evaluation, generate()) on one rank only, makes the others wait (run it on every "
            "rank, or inside `with sched.gathered_params():` entered on every rank); the ranks of a pipeline "
            "stage's data-parallel group run different schedules or micro-batch counts; or a peer died or "
            "hung. The process group cannot be used further. Raise attach(collective_timeout=...) if a "
            "collective legitimately takes longer")

    # [Note: bounded waits]
    # The process group's timeout (30 minutes by default) is how long a rank waits in a collective its peers
    # never join. memsched issues its collectives asynchronously and waits with attach's collective_timeout
    # (60 s by default) wherever the host blocks anyway: every wait on gloo, and the waits whose result the
    # host reads (reduce_ints) on NCCL, where other waits only order streams. Both ranks of a mismatch reach
    # such a wait (a rank that ran ahead blocks at the next one, at the latest the gather-order check at its
    # backward's end), so each raises within about that bound, naming the cause. Bounding is not left to
    # `work.wait(timeout)`: gloo's reduce-scatter ignores it, and its `is_completed()` stays false until
    # `wait()` runs. So on gloo a daemon thread runs `wait()` and the training thread waits for it with the
    # bound; NCCL's work is polled (`is_completed()` queries its CUDA event).

    def _sync(self, issue: Any, back: list[tuple[torch.Tensor, torch.Tensor]], async_op: bool, what: str,
              *, host: bool = False) -> Any:
        """Issue ``issue(async_op=True)``; return the work (``async_op``), else wait for it (bounded) and copy
        staged results back."""
        with self.guard(what):
            work = issue(async_op=True)
        if async_op:
            return self._landed(work, back, True)
        self.wait(work, what, host=host)
        for t, s in back:
            t.copy_(s)
        return work

    # ---- collectives --------------------------------------------------------------------------------------
    def all_reduce(
        self, t: torch.Tensor, *, op: Any = None, what: str = "all_reduce", async_op: bool = False,
        host: bool = False,
    ) -> Any:
        """In-place all-reduce (default SUM) of ``t``; returns the work when ``async_op``."""
        (s,), back = self._stage((t,), (t,))
        return self._sync(lambda async_op: dist.all_reduce(s, op=op or dist.ReduceOp.SUM, group=self.group,
                                                           async_op=async_op), back, async_op, what,
                          host=host)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, *, what: str = "reduce_scatter", async_op: bool = False
    ) -> Any:
        """SUM-reduce ``inp`` (``[world * k]``) over ranks into this rank's shard ``out`` (``[k]``).

        Backends without a flat reduce-scatter (older gloo) all-reduce ``inp`` in place and copy the own shard
        (twice the traffic, same result); the work is then already complete and ``None`` is returned.
        """
        if self.reduce_scatter_supported:
            (so, si), back = self._stage((out, inp), (out,))
            try:
                return self._sync(lambda async_op: self._reduce_scatter(so, si, group=self.group,
                                                                        async_op=async_op),
                                  back, async_op, what)
            except ZeroCommError as e:
                if not _unsupported(e.__cause__):
                    raise
                self.reduce_scatter_supported = False
        k = out.numel()
        self.all_reduce(inp, what=what + " (all_reduce fallback)")
        out.copy_(inp[self.rank * k : (self.rank + 1) * k])
        return None

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *, what: str = "all_to_all",
                   async_op: bool = False) -> Any:
        """``out[r * k:(r + 1) * k]`` receives rank ``r``'s ``inp[rank * k:(rank + 1) * k]`` (both ``[world *
        k]``): every rank gets every rank's part of its own shard, to sum in rank order
        (:mod:`memsched.distributed.grad_reduction`). Returns the work, or raises
        :class:`NotImplementedError` when the backend has no all-to-all (the caller falls back to a
        reduce-scatter)."""
        if not self.all_to_all_supported:
            raise NotImplementedError("all_to_all_single is not supported by this backend")
        (so, si), back = self._stage((out, inp), (out,))
        try:
            return self._sync(lambda async_op: dist.all_to_all_single(so, si, group=self.group,
                                                                      async_op=async_op),
                              back, async_op, what)
        except ZeroCommError as e:
            if not _unsupported(e.__cause__):
                raise
            self.all_to_all_supported = False
            raise NotImplementedError(str(e)) from e

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, *, what: str = "all_gather", async_op: bool = False
    ) -> Any:
        """Gather every rank's ``inp`` (``[k]``) into ``out`` (``[world * k]``) without concatenation.

        ``inp`` may be this rank's own view of ``out`` (in place) on NCCL, which supports that form; elsewhere
        it is cloned first. Fallback for backends without a flat all-gather: ``all_gather`` into views of
        ``out``.
        """
        if (
            not self.nccl
            and inp.data_ptr() >= out.data_ptr()
            and inp.data_ptr() < out.data_ptr() + out.numel() * out.element_size()
        ):
            inp = inp.clone()
        (so, si), back = self._stage((out, inp), (out,))
        if self.all_gather_supported:
            try:
                return self._sync(lambda async_op: self._all_gather(so, si, group=self.group,
                                                                    async_op=async_op),
                                  back, async_op, what)
            except ZeroCommError as e:
                if not _unsupported(e.__cause__):
                    raise
                self.all_gather_supported = False
        return self._sync(lambda async_op: dist.all_gather(list(so.chunk(self.world)), si, group=self.group,
                                                           async_op=async_op),
                          back, async_op, what + " (list fallback)")

    # ---- staging through the backend's device ------------------------------------------------------------
    def _stage(self, tensors: Sequence[torch.Tensor], written: Sequence[torch.Tensor],
               ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The tensors a collective takes, on the backend's device: gloo takes CPU tensors only, so a device
        tensor that is not CUDA (the stand-in's, ``sim``) goes through a host copy. Returns the tensors to
        pass and ``(original, staged)`` of the ``written`` ones, copied back when the collective is done."""
        staged, back = [], []
        for t in tensors:
            if t.device.type == self.device.type or (self.nccl or t.device.type == "cuda"):
                staged.append(t)
                continue
            s = t.detach().to(self.device)
            staged.append(s)
            if any(t is w for w in written):
                back.append((t, s))
        return staged, back

    @staticmethod
    def _landed(work: Any, back: list[tuple[torch.Tensor, torch.Tensor]], async_op: bool) -> Any:
        """``work``, with the staged results copied back when it completes (at once when not async)."""
        if not back:
            return work
        if not async_op:
            for t, s in back:
                t.copy_(s)
            return work
        return _StagedWork(work, back)

    def all_gather_shard_to(self, part: torch.Tensor, numel: int, *, what: str) -> torch.Tensor:
        """Every rank's ``part`` (its shard) gathered into one new CPU tensor of ``numel`` elements (``part``
        may live anywhere; it is staged on the backend's device). For checkpoints and re-packing, not the hot
        path."""
        src = part.detach().to(self.device)
        out = torch.empty(numel, dtype=part.dtype, device=self.device)
        self.all_gather(out, src, what=what)
        return out.cpu()

    def broadcast(self, t: torch.Tensor, *, src_rank: int = 0, what: str = "broadcast") -> None:
        """Broadcast ``t`` in place from group rank ``src_rank`` (staged on the backend's device)."""
        staged = t if t.device == self.device else t.detach().to(self.device)
        with self.guard(what):
            dist.broadcast(staged, src=self.global_rank(src_rank), group=self.group)
        if staged is not t:
            t.copy_(staged)

    def all_gather_object(self, obj: Any, *, what: str = "all_gather_object") -> list[Any]:
        out: list[Any] = [None] * self.world
        with self.guard(what):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: Any, *, dst_rank: int = 0, what: str = "gather_object") -> list[Any] | None:
        """``obj`` of every rank, on group rank ``dst_rank`` (``None`` elsewhere)."""
        out: list[Any] | None = [None] * self.world if self.rank == dst_rank else None
        with self.guard(what):
            dist.gather_object(obj, out, dst=self.global_rank(dst_rank), group=self.group)
        return out

    def reduce_ints(self, values: Sequence[int], op: str, *, what: str) -> list[int]:
        """Element-wise ``"min"`` or ``"max"`` of integers over ranks (exact for |v| < 2**63)."""
        t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.device)
        self.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, what=what, host=True)
        return [int(v) for v in t.tolist()]

    def global_rank(self, group_rank: int) -> int:
        if self.group is None or self.world == 1:
            return group_rank
        get = getattr(dist, "get_global_rank", None)
        return (
            get(self.group, group_rank)
            if get is not None
            else dist.distributed_c10d._get_global_rank(self.group, group_rank)
        )

    def check_peers(self, what: str = "attach") -> None:
        """A barrier that fails within the timeout, naming the missing ranks on gloo (``monitored_barrier``),
        instead of hanging when a rank died or never got here.

        Raises:
            ZeroCommError: a rank did not arrive in time, or the group is broken.
        """
        if self.world == 1:
            return
        with self.guard(f"barrier at {what}"):
            if self.backend == "gloo":
                dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
            elif self.nccl:
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)


class _StagedWork:
    """An async collective over host copies of device tensors: waiting copies the results back."""

    def __init__(self, work: Any, back: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._work, self._back = work, back

    def wait(self) -> bool:
        self._work.wait()
        back, self._back = self._back, []
        for t, s in back:
            t.copy_(s)
        return True

    def is_completed(self) -> bool:
        return not self._back or (self._work.is_completed() and self.wait())


def _backend_device(nccl: bool, device: torch.device | None) -> torch.device:
    """Where the backend's tensors live: this rank's CUDA device for NCCL (the given one when it is CUDA, else
    the current one), the CPU otherwise."""
    if not nccl:
        return torch.device("cpu")
    if device is not None and device.type == "cuda":
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return torch.device("cuda", torch.cuda.current_device())


class _Waiter:
    """A daemon thread that runs ``work.wait()`` for the training thread, which waits for it at most a bound
    ([Note: bounded waits]). Daemon: one left blocked in a collective that never completes does not keep the
    process from exiting."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="memsched-collective-wait", daemon=True).start()

    def _run(self) -> None:
        while True:
            work, done, box = self._jobs.get()
            try:
                work.wait()
            except BaseException as e:  # handed to the training thread, which re-raises it
                box.append(e)
            done.set()

    def wait(self, work: Any, seconds: float) -> bool:
        """``work.wait()`` within ``seconds``: ``True`` once it returned, ``False`` when the time ran out;
        re-raises what ``wait()`` raised."""
        done, box = threading.Event(), []
        self._jobs.put((work, done, box))
        if not done.wait(seconds):
            return False
        if box:
            raise box[0]
        return True


def _completes_within(work: Any, seconds: float) -> bool:
    """Whether ``work`` (an NCCL collective) completes or fails within ``seconds``, polled."""
    deadline = time.monotonic() + seconds
    pause = 1e-4
    while not work.is_completed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 1.5, 0.01)
    return True


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _unsupported(e: BaseException | None) -> bool:
    text = str(e).lower()
    return isinstance(e, (RuntimeError, NotImplementedError)) and (
        "not support" in text or "unsupported" in text or "not implemented" in text
    )
