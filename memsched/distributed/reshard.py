"""Re-packing across ranks: every chunk's optimizer state gathered whole (so the store re-packs as one
process would), then cut back to this rank's shard. One-off, at the end of warmup: full fp32 state per rank on
the state's side, temporarily."""

from __future__ import annotations

from memsched.chunks import ChunkStore
from memsched.distributed.base import DataParallel


def unshard(engine: DataParallel, store: ChunkStore) -> None:
    """Give every chunk its whole optimizer state (all-gathered; a collective)."""
    engine.end_step()
    for c in store.chunks:
        if (c.lo, c.hi) == (0, c.numel):
            continue
        with store.alloc.host_context():  # temporary host copies, not device memory
            master, m, v = engine.full_state(c)
        c.reshard(0, c.numel, store.alloc, master=master, exp_avg=m, exp_avg_sq=v)


def reshard(engine: DataParallel, store: ChunkStore) -> None:
    """Cut each (whole-state) chunk back to this rank's shard.

    Raises:
        RuntimeError: a chunk is neither whole nor this rank's shard (names it).
    """
    for c in store.chunks:
        lo, hi = engine.shard_of(c)
        if (c.lo, c.hi) == (lo, hi):
            continue
        if (c.lo, c.hi) != (0, c.numel):
            raise RuntimeError(f"chunk {c.index} is neither whole nor this rank's shard: [{c.lo}, {c.hi})")
        with store.alloc.host_context():
            master = c.master_view()[lo:hi].detach().cpu().clone()
            m = c.exp_avg[lo:hi].detach().cpu().clone()
            v = c.exp_avg_sq[lo:hi].detach().cpu().clone()
        c.reshard(lo, hi, store.alloc, master=master, exp_avg=m, exp_avg_sq=v)
