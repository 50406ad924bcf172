"""The overlapped hybrid step: host chunks are updated on a CPU worker thread while the next forward runs.

With ``memsched.attach(..., overlap=True)``, :meth:`memsched.optim.hybrid_adamw.HybridAdamW.step` checks
everything, starts the D2H copies of the host chunks' gradients, updates the device chunks and hands the host
chunks to one worker thread (torch's CPU kernels release the GIL), then returns. The worker updates them in
chunk order, which is first-use order (:mod:`memsched.planning.first_use`): the placement keeps the first-used
chunks on the device, so the offloaded ones are needed last in the next forward and their update has the most
slack. After each chunk's update the worker issues its H2D copy (a side stream on CUDA, ordered after the
step's backward with an event, not after the next forward's kernels) and signals the chunk. A module's forward
pre-hook waits only for its own chunks (:mod:`memsched.runtime.waits`).

What needs the whole update waits for it (:meth:`HostUpdates.wait_all`): the next ``step()``,
``optimizer.state_dict()`` / ``load_state_dict()``, ``model.state_dict()``, ``sched.synchronize()`` and
``close()``. Work that follows an update on every rank (the ZeRO all-gather of an updated shard, a
collective) runs on the calling thread, in chunk order, when a wait reaches the chunk: collectives are issued
by one thread, in the same order on every rank.

The idea: ZeRO-Offload's delayed parameter update (arXiv 2101.06840, section 5) overlaps the CPU step with
the next forward-backward at the cost of one stale step; here the update is exact (the forward waits for the
chunk it reads) and only the slack of the last-used chunks is used.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class OverlapError(RuntimeError):
    """An overlapped CPU update failed; raised at the next wait (forward, ``step``, ``synchronize``)."""


def default_update_threads(device: torch.device, compute_threads: int | None = None) -> int:
    """The worker's intra-op threads when ``attach(update_threads=None)``: on CUDA all of torch's but two (the
    training thread, which launches kernels and runs memsched's host-side work, and autograd's device
    thread); where the compute itself runs on the CPU (the stand-in, ``device="cpu"``) half of them, so that
    the backward the update overlaps keeps the other half. ``compute_threads``: torch's intra-op threads of
    the training thread (default: ``torch.get_num_threads()``)."""
    n = compute_threads if compute_threads is not None else torch.get_num_threads()
    return max(1, n - 2) if device.type == "cuda" else max(1, n // 2)


class HostUpdates:
    """The host-chunk updates of the last step, run on one worker thread (see the module docstring).

    [Note: the update worker's threads]
    torch's CPU kernels split each op over an OpenMP team of ``torch.get_num_threads()`` threads, and a thread
    that starts its own team keeps its own count. The training thread's team and a worker whose team is as
    large oversubscribe the cores while they overlap: spinning team members steal each other's cores, and on
    the H200 host (16 cores) the worker's update took 2 to 3x its serial time beside the forward or backward
    (``bench/results/gpu_step_time_nvidia-h200_2026-11-27.json``). So the worker runs its updates with a team
    of ``threads`` of its own (:func:`default_update_threads`), set once on the worker thread; the training
    thread's count, and the process's default for threads started later, stay as they were.

    Args:
        device: the compute device (the worker makes it current, for the H2D side stream).
        threads: the worker's intra-op threads (>= 1); ``None``: :func:`default_update_threads`.

    Raises:
        ValueError: ``threads`` is not an integer >= 1.
    """

    def __init__(self, device: torch.device, threads: int | None = None) -> None:
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"update_threads must be an integer >= 1 or None, got {threads!r}")
        self.device = device
        self.threads = threads if threads is not None else default_update_threads(device)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._future: Future | None = None
        self._done: dict[int, threading.Event] = {}  # chunk index -> updated, its H2D issued
        self._order: list[int] = []  # chunk indices of the batch in flight, in update order
        self._next = 0  # position in _order of the first chunk whose follow-up has not run yet
        self._follow_up: Callable[[int], None] | None = None
        self._error: tuple[int, BaseException] | None = None  # (chunk index, what it raised)

    @property
    def pending(self) -> bool:
        """True while a batch has chunks whose follow-up has not run (the update may be done already)."""
        return self._next < len(self._order)

    def submit(self, indices: Sequence[int], update: Callable[[int], None],
               follow_up: Callable[[int], None] | None = None) -> None:
        """Run ``update(i)`` for each chunk index in ``indices`` (in that order) on the worker;
        ``follow_up(i)`` runs later on the thread that waits for chunk ``i`` (collectives), in the same order.

        Raises:
            RuntimeError: the previous batch is still pending (call :meth:`wait_all` first).
        """
        if self.pending:
            raise RuntimeError("memsched: the previous overlapped update is still pending")
        self._order, self._next, self._follow_up, self._error = list(indices), 0, follow_up, None
        self._done = {i: threading.Event() for i in self._order}
        if not self._order:
            return
        self._future = self._executor().submit(self._run, list(self._order), update, self._done)

    def run(self, fn: Callable[[], None]) -> Future:
        """Run ``fn()`` on the worker after everything submitted before it (the updates during backward of
        :mod:`memsched.optim.early_update`); its errors are its own (``fn`` records them)."""
        return self._executor().submit(self._run_one, fn)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:  # one worker, whichever thread asks first (its submissions stay in order)
            return self._start_pool()

    def _start_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            default = torch.get_num_threads()
            ready = threading.Event()

            def own_threads() -> None:  # [Note: the update worker's threads]
                torch.get_num_threads()  # torch initialises this thread's count first (it would reset it)
                torch.set_num_threads(self.threads)
                ready.set()

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memsched-host-update",
                                            initializer=own_threads)
            self._pool.submit(lambda: None).result()  # the worker exists, with its count
            ready.wait()
            # set_num_threads also moved the default of threads started later: back to the training
            # thread's (this thread keeps its own count either way)
            torch.set_num_threads(default)
        return self._pool

    def worker_threads(self) -> int:
        """The worker's intra-op thread count, as the worker reads it (starts the worker)."""
        return self._executor().submit(torch.get_num_threads).result()

    def _run_one(self, fn: Callable[[], None]) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        with torch.no_grad():
            fn()

    def _run(self, order: list[int], update: Callable[[int], None], done: dict[int, threading.Event]) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        i = -1
        try:
            with torch.no_grad():
                for i in order:
                    update(i)
                    done[i].set()
        except BaseException as e:  # surfaces at the wait for this chunk, on the training thread
            self._error = (i, e)
        finally:
            for ev in done.values():  # nobody waits forever on a failed batch
                ev.set()

    def ready(self, index: int) -> bool:
        """Whether chunk ``index`` has no update pending on the worker (done, or none in the batch), without
        waiting."""
        ev = self._done.get(index) if self.pending else None
        return ev is None or ev.is_set()

    def unfinished(self) -> list[int]:
        """The chunks of the batch whose update is not yet waited for and followed up, in update order."""
        return self._order[self._next:] if self.pending else []

    def wait(self, indices: Sequence[int]) -> float:
        """Block until the chunks ``indices`` are updated and their H2D copies issued; the follow-ups of every
        chunk up to the last of them (in update order) run here. Returns the seconds blocked.

        Raises:
            OverlapError: the worker failed (the chunk's parameters may be partly updated).
        """
        if not self.pending:
            return 0.0
        positions = [self._order.index(i) for i in indices if i in self._done]
        if not positions:
            return 0.0
        return self._advance(max(positions) + 1)

    def wait_all(self) -> float:
        """Block until the whole batch is updated and followed up; returns the seconds blocked.

        Raises:
            OverlapError: the worker failed.
        """
        if not self.pending:
            return 0.0
        blocked = self._advance(len(self._order))
        self._future = None
        return blocked

    def _advance(self, upto: int) -> float:
        blocked = 0.0
        while self._next < upto:
            i = self._order[self._next]
            ev = self._done[i]
            if not ev.is_set():
                t0 = time.perf_counter()
                ev.wait()
                blocked += time.perf_counter() - t0
            if self._error is not None and self._error[0] == i:  # the chunks before it were updated
                error = self._error[1]
                self._error, self._order, self._next = None, [], 0  # the batch is over
                raise OverlapError(f"memsched: the overlapped CPU update of chunk {i} failed "
                                   f"({type(error).__name__}: {error}); its parameters and optimizer state "
                                   "may be partly updated, and the chunks after it were not") from error
            self._next += 1
            if self._follow_up is not None:
                self._follow_up(i)
        return blocked

    def close(self) -> None:
        """Finish the batch in flight (errors are raised) and stop the worker thread."""
        try:
            self.wait_all()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
