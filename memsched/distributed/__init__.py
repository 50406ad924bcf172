"""Data-parallel training over ``torch.distributed`` with optimizer-state chunks sharded evenly over the ranks
(ZeRO stages 0/1/2): see :mod:`memsched.distributed.engine` for the layout, the stages, gradient accumulation
and its cost; :mod:`memsched.distributed.layout` for the sharding arithmetic; :mod:`memsched.distributed.comm`
for collectives, errors and timeouts; :mod:`memsched.distributed.build` for where chunks are built at attach;
:mod:`memsched.report.ranks` for per-rank reports; :mod:`memsched.checkpoint` for sharded checkpoints.
"""

from __future__ import annotations

import torch

from memsched.distributed.base import DataParallel
from memsched.distributed.build import plan_build, stage_params
from memsched.distributed.comm import Comm, ZeroCommError
from memsched.distributed.engine import ZeroEngine
from memsched.distributed.grad_reduction import ZeroAccumulationWarning
from memsched.distributed.layout import padded_chunk_numel, param_shards, shard_range, shard_state_numel
from memsched.distributed.options import (
    BUILD_MODES,
    FETCH_MODES,
    ZERO_STAGES,
    DataParallelConfig,
    as_timedelta,
    check_build_mode,
    check_zero_options,
)


def make_engine(config: DataParallelConfig, device: torch.device | None = None) -> DataParallel:
    """The data parallelism :func:`memsched.attach` uses, from its checked options
    (:class:`memsched.distributed.options.DataParallelConfig`): a one-rank
    :class:`memsched.distributed.base.DataParallel` when there is one rank (``torch.distributed`` not
    initialised, or a group of size 1), else a :class:`ZeroEngine`: one code path for every world size. NCCL
    collectives run on ``device`` (the compute device of attach; see :class:`Comm`).

    Waits for every rank of the group (:meth:`Comm.check_peers`, bounded by the timeout or the group's
    timeout) before returning.

    Raises:
        ValueError: a ``process_group`` without an initialised ``torch.distributed``.
        ZeroCommError: a rank did not reach attach in time.
    """
    comm = Comm(config.process_group, timeout=config.timeout, device=device,
                collective_timeout=config.collective_timeout)
    if comm.world == 1:
        return DataParallel()
    comm.check_peers("memsched.attach")
    return ZeroEngine(comm, config.zero_stage, config.fetch, config.chunk_build)


__all__ = [
    "as_timedelta",
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
    "param_shards",
    "plan_build",
    "shard_range",
    "shard_state_numel",
    "stage_params",
]
