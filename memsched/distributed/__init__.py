"""Data-parallel training over ``torch.distributed`` with optimizer-state chunks sharded evenly over the ranks
(ZeRO stages 0/1/2): see :mod:`memsched.distributed.engine` for the layout, the stages, gradient accumulation
and its cost; :mod:`memsched.distributed.layout` for the sharding arithmetic; :mod:`memsched.distributed.comm`
for collectives, errors and timeouts; :mod:`memsched.distributed.build` for where chunks are built at attach;
:mod:`memsched.distributed.report` for per-rank reports; :mod:`memsched.checkpoint` for sharded checkpoints.
"""

from __future__ import annotations

import datetime
from typing import Any

from memsched.distributed.build import BUILD_MODES, check_build_mode, plan_build, stage_params
from memsched.distributed.comm import Comm, ZeroCommError
from memsched.distributed.engine import (
    FETCH_MODES,
    ZERO_STAGES,
    ZeroAccumulationWarning,
    ZeroEngine,
    check_zero_options,
)
from memsched.distributed.layout import padded_chunk_numel, param_pieces, shard_range, shard_state_numel
from memsched.parallel import DataParallel


def make_engine(
    zero_stage: Any = 1,
    fetch: Any = "all_gather",
    process_group: Any = None,
    *,
    timeout: float | datetime.timedelta | None = None,
    chunk_build: Any = "auto",
    device: Any = None,
) -> DataParallel:
    """The data parallelism :func:`memsched.attach` uses: a one-rank :class:`memsched.parallel.DataParallel`
    when there is one rank (``torch.distributed`` not initialised, or a group of size 1), else a
    :class:`ZeroEngine`: one code path for every world size.

    Waits for every rank of the group (:meth:`Comm.check_peers`, bounded by ``timeout`` seconds or the group's
    timeout) before returning. ``chunk_build`` (``"auto"``, ``"device"``, ``"cpu"``) says where the chunks are
    built at attach (:mod:`memsched.distributed.build`); it is kept as ``engine.chunk_build``. ``device`` (a
    ``torch.device``) is the compute device of attach: NCCL collectives run there (see :class:`Comm`).

    Raises:
        ValueError: a bad ``zero_stage``/``fetch``/``chunk_build`` (lists the allowed values), a
            ``process_group`` without an initialised ``torch.distributed``, a bad ``timeout``.
        ZeroCommError: a rank did not reach attach in time.
    """
    stage, fetch = check_zero_options(zero_stage, fetch)
    build = check_build_mode(chunk_build)
    comm = Comm(process_group, timeout=timeout, device=device)
    if comm.world == 1:
        return DataParallel()
    comm.check_peers("memsched.attach")
    engine = ZeroEngine(comm, stage, fetch)
    engine.chunk_build = build
    return engine


__all__ = [
    "BUILD_MODES",
    "FETCH_MODES",
    "ZERO_STAGES",
    "Comm",
    "ZeroAccumulationWarning",
    "ZeroCommError",
    "ZeroEngine",
    "check_build_mode",
    "check_zero_options",
    "make_engine",
    "padded_chunk_numel",
    "param_pieces",
    "plan_build",
    "shard_range",
    "shard_state_numel",
    "stage_params",
]
