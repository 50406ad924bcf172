"""ZeRO-3: a chunk's parameters sharded over the ranks while a step computes, all-gathered for their reads.

[Note: sharded parameters]
At ZeRO stage 3 the parameter fetcher (:class:`memsched.runtime.param_fetch.ParamFetcher`) treats every
chunk as one whose parameters may leave the device, and this class is where they go and how they come back:

* **Release.** When the fetcher lets a chunk go (once read, on the schedule of
  :func:`policies.schedule.schedule_sharded`), this rank's part of it, ``data[lo:hi]``, is copied into a
  buffer of its own (``Chunk.param_shard``, ``[hi - lo]``, compute dtype, on the device) and the whole
  buffer is freed: ``1 / world`` of the chunk stays. Copying the part each time (a device-to-device copy of
  ``1 / world`` of the chunk) follows any write made to the parameters since they were gathered (the same
  write on every rank, as data parallelism requires). A chunk whose optimizer state the plan keeps on the
  host keeps its part there instead, in the values its CPU update writes (``param_host``): nothing of it
  stays on the device (written back first if the parameters were written since the gather).
* **Gather.** A read (or the schedule, a few accesses ahead) allocates the whole buffer again and
  all-gathers every rank's part into it with one ``all_gather_into_tensor`` (asynchronous; the read waits
  for it); a host chunk's part is copied H2D into its place first and gathered in place. Once it completes
  the part's own device buffer is freed.
* **Collective order.** Every rank must gather the same chunks in the same order: the schedule is made from
  the warmup's reads and compared between ranks, and a read off the schedule gathers on demand, which every
  rank running the same modules does at the same point. A rank that runs other modules than its peers
  (a data-dependent branch taken on one rank only) makes the collectives mismatch: FSDP and DeepSpeed ZeRO-3
  require the same, as this does. Chunks are all the same size, so two ranks gathering different chunks
  would mix their parts without any error from the backend: each rank keeps a running hash of the chunks it
  gathered, and at each backward's end (before any update) the ranks compare it (:meth:`check_order`, one
  small all-reduce); a difference raises instead of stepping with mixed parameters.

The idea is ZeRO-3's parameter partitioning (arXiv 1910.02054) and FSDP2's sharded parameters
(``fully_shard``), over memsched's chunks: one flat all-gather per chunk, as ColossalAI Gemini's chunk
all-gather (ColossalAI #1623: every chunk split evenly over every rank).
"""

from __future__ import annotations

from typing import Any

import torch

from memsched.chunks import Chunk, ChunkStore
from memsched.distributed.comm import Comm

_PRIME = 2**61 - 1


class ShardedParamError(RuntimeError):
    """A read of a parameter that ZeRO-3 holds sharded over the ranks between steps (see
    [Note: reads of sharded parameters] in :mod:`memsched.runtime.param_fetch`)."""


class ParamShards:
    """Where a ZeRO-3 chunk's parameters go when the fetcher releases them, and the all-gather that brings
    them back (see [Note: sharded parameters]).

    Args:
        comm: the process group.
        store: the chunks (their ``lo``, ``hi`` are this rank's shard).

    Attributes:
        gathered_bytes: bytes this rank received from the others in parameter all-gathers (``(world - 1) /
            world`` of each chunk gathered).
        gathers: the number of all-gathers issued.
    """

    def __init__(self, comm: Comm, store: ChunkStore) -> None:
        self.comm, self.store = comm, store
        self.world = comm.world
        self._pending: dict[int, Any] = {}  # chunk index -> its all-gather in flight
        self._order = [0, 0]  # running hash of the chunks gathered since check_order(), and their count
        self.gathered_bytes = 0
        self.gathers = 0

    def gather(self, c: Chunk, data: torch.Tensor) -> None:
        """Start the all-gather of ``c``'s parts into ``data`` (``[numel]``, compute dtype, on the device;
        attached to ``c`` already): asynchronous, :meth:`wait` completes it.

        Raises:
            RuntimeError: ``c`` has no part of its own to send (it was never released).
        """
        if c.param_shard is None and c.param_host is None:
            raise RuntimeError(f"memsched ZeRO-3: chunk {c.index} is gathered but this rank holds no shard "
                               "of it (it was never released)")
        # a host chunk's part was copied into data[lo:hi] (H2D, c.h2d_event) and is gathered in place
        src = c.param_shard if c.param_shard is not None else data[c.lo:c.hi]
        what = f"ZeRO-3 parameter gather of chunk {c.index}"
        if c.h2d_event is not None:  # the updated part's H2D copy (a host chunk) comes first
            if data.device.type == "cuda":
                torch.cuda.current_stream(data.device).wait_event(c.h2d_event)
            else:  # the stand-in's link: the host waits
                c.wait_h2d()
        with torch.no_grad():
            self._pending[c.index] = self.comm.all_gather(data, src, what=what, async_op=True)
        self.gathers += 1
        self._order = [(self._order[0] * 1_000_003 + c.index + 1) % _PRIME, self._order[1] + 1]
        self.gathered_bytes += (self.world - 1) * data.numel() * data.element_size() // self.world

    def wait(self, c: Chunk) -> None:
        """Complete ``c``'s all-gather (if one is in flight): its whole buffer holds every rank's part, and
        its own part's buffer is freed."""
        work = self._pending.pop(c.index, None)
        if work is None:
            return
        self.comm.wait(work, f"ZeRO-3 parameter gather of chunk {c.index}")
        c.drop_param_shard()

    def release(self, c: Chunk) -> None:
        """Keep this rank's part of ``c``'s parameters (before the fetcher frees the whole buffer): in a
        device buffer of its own, or for a chunk whose optimizer state is on the host, in its host values
        (``param_host``, which the CPU update writes), copied there only when the parameters were written
        since they were gathered."""
        self.wait(c)
        store = self.store
        if c.param_host is not None:
            if store.bindings.written(c):
                store.before_host_write(c)
                c.wait_h2d()
                with torch.no_grad(), store.alloc.host_context():
                    c.param_host.copy_(c.data[c.lo:c.hi])
            c.drop_param_shard()
            return
        with torch.no_grad():
            shard = self.store.alloc.device_empty(c.hi - c.lo, c.dtype)
            shard.copy_(c.data[c.lo:c.hi])
        c.keep_param_shard(shard)

    def refusal(self, what: str, name: str, index: int) -> ShardedParamError:
        """The error for ``what`` reading parameter ``name`` of chunk ``index`` while it is sharded between
        steps: names the ways to read it."""
        return ShardedParamError(
            f"memsched ZeRO-3: {what} reads parameter {name!r} (chunk {index}) between steps, where it is "
            f"sharded over {self.world} ranks (each holds 1/{self.world} of it; the whole exists nowhere). "
            "Read or write parameters between steps inside `with sched.gathered_params():`, entered on every "
            "rank (a collective), save and load with memsched.checkpoint.save / load, or attach with "
            "zero_stage=2 to keep whole parameters on every rank")

    def check_order(self) -> None:
        """Compare the chunks every rank gathered since the last check (one small all-reduce; every rank calls
        it at the same point: a backward's end).

        Raises:
            ShardedParamError: the ranks gathered different chunks (names the counts); nothing was updated.
        """
        h, n = self._order
        self._order = [0, 0]
        hi_h, hi_n, neg_lo_h, neg_lo_n = self.comm.reduce_ints(
            [h, n, -h, -n], "max", what="comparing the ZeRO-3 parameter gathers")
        if hi_h != -neg_lo_h or hi_n != -neg_lo_n:
            raise ShardedParamError(
                f"memsched ZeRO-3: the ranks all-gathered different parameter chunks in this forward and "
                f"backward (this rank {n} gathers; between {-neg_lo_n} and {hi_n} over the ranks), so some "
                "ranks computed with parameters mixed from different chunks. Every rank must run the same "
                "modules in the same order (a branch taken on some ranks only breaks that); nothing was "
                "updated: call optimizer.zero_grad() and run the step again on every rank, or attach with "
                "zero_stage=2")
