"""How much host memory the host-placed optimizer state may take: the plan's ``host_capacity_bytes``.

The placement problem carries a host budget so that a plan whose host part cannot be allocated is refused
with the numbers (:func:`policies.plans.check_plan`) before the chunks move, instead of dying in the middle
of an allocation (or being killed by the kernel's out-of-memory killer). The budget is the smallest of:

* **available host memory**: ``psutil.virtual_memory().available``, or less under a cgroup memory limit
  (:func:`cgroup_free_bytes`), shared evenly by the data-parallel ranks
  of this machine (``LOCAL_WORLD_SIZE``, set by ``torchrun``), plus the host bytes memsched's chunks already
  hold (they start on the host at attach; moving them to the device frees them, so they count as available
  to the plan);
* **the locked-memory limit** ``RLIMIT_MEMLOCK`` (soft limit; ``RLIM_INFINITY`` = none), where pinning is
  charged against it (see :data:`PINNING_COUNTS_AGAINST_MEMLOCK`). Only pinned memory can be: the CPU and
  the stand-in do not pin;
* **the stand-in's host memory**, ``sim:8GiB,host=2GiB`` (:mod:`memsched.devices.spec`): a simulated machine,
  so the check runs the same on any machine, whatever its RAM;
* **the user's limit**, ``host_memory=`` at attach (``--host-memory`` in ``memsched plan``): memory to leave
  to the data loader, other processes or a second job.

Every source is an argument of :func:`host_budget` (a number or a reader function), so tests inject them.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psutil

from policies.units import format_bytes as fb

__all__ = [
    "PINNING_COUNTS_AGAINST_MEMLOCK", "HostBudget", "available_bytes", "cgroup_free_bytes", "host_budget",
    "local_world_size", "memlock_limit_bytes",
]

#: Whether pinned allocations count against ``RLIMIT_MEMLOCK``. Measured, not assumed: on an H100 machine
#: (driver 580.159.04, torch 2.11.0+cu130), as an unprivileged user (uid 65534, no CAP_IPC_LOCK) with
#: ``ulimit -l 64`` (64 KiB), ``torch.empty(512 MiB, pin_memory=True)`` and ``Tensor.pin_memory()`` both
#: succeeded: torch's caching host allocator pins through the CUDA driver (``cudaHostAlloc``), which does not
#: charge the process's mlock limit. Applying the limit would refuse every offload plan on the many machines
#: whose default is 64 KiB or 8 MiB. Pass ``memlock_applies=True`` to :func:`host_budget` where it does apply.
PINNING_COUNTS_AGAINST_MEMLOCK = False


@dataclass(frozen=True)
class HostBudget:
    """The host memory a plan may use.

    Attributes:
        capacity_bytes: the smallest of the limits, bytes.
        source: the limit that sets it, with its numbers, in words (for the error of a plan over it).
    """

    capacity_bytes: int
    source: str


def available_bytes() -> int:
    """Host memory this process can take without swapping or being killed now, bytes: the machine's
    (``psutil.virtual_memory().available``), or less where a cgroup limits the process (a container, a
    Slurm job: :func:`cgroup_free_bytes`)."""
    free = int(psutil.virtual_memory().available)
    limit = cgroup_free_bytes()
    return free if limit is None else min(free, limit)


#: cgroup v2, then v1: (limit file, usage file) under /sys/fs/cgroup.
_CGROUP_FILES = (("memory.max", "memory.current"),
                 ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))


def cgroup_free_bytes(root: str = "/sys/fs/cgroup") -> int | None:
    """The room left under this process's cgroup memory limit (limit minus usage), bytes; ``None`` without a
    limit ("max", or v1's huge sentinel) or where the files cannot be read."""
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(os.path.join(root, limit_file)) as f:
                limit_text = f.read().strip()
            with open(os.path.join(root, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:
            return None
        return max(0, int(limit_text) - usage)
    return None


def memlock_limit_bytes() -> int | None:
    """This process's soft ``RLIMIT_MEMLOCK`` (the one the kernel enforces), bytes; ``None`` when unlimited
    (``RLIM_INFINITY``)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """Data-parallel ranks on this machine, which share its memory: ``LOCAL_WORLD_SIZE`` (set by ``torchrun``)
    when it holds an integer >= 1, else 1 (ranks started another way are each taken to be alone)."""
    text = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    return int(text) if text.strip().isdigit() and int(text) >= 1 else 1


def _check_bytes(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a whole number of bytes >= 0{' or None' if optional else ''}, "
                         f"got {value!r}")


def host_budget(*, pinned: bool, held_bytes: int = 0, local_ranks: int = 1,
                stand_in_bytes: int | None = None, user_bytes: int | None = None,
                read_available: Callable[[], int] = available_bytes,
                read_memlock: Callable[[], int | None] = memlock_limit_bytes,
                memlock_applies: bool = PINNING_COUNTS_AGAINST_MEMLOCK) -> HostBudget:
    """The host budget of a plan: the smallest of the limits in the module docstring.

    Args:
        pinned: host-placed state is pinned (a CUDA device); only then can the locked-memory limit apply.
        held_bytes: host bytes memsched's chunks hold now (the plan may reuse them), bytes.
        local_ranks: data-parallel ranks on this machine sharing its available memory (>= 1).
        stand_in_bytes: the stand-in machine's host memory (``sim:SIZE,host=SIZE``), bytes; ``None`` = none.
        user_bytes: the user's limit (``host_memory=`` at attach, ``--host-memory`` in ``memsched plan``),
            bytes; ``None`` = none.
        read_available: returns the machine's available memory, bytes (default :func:`available_bytes`).
        read_memlock: returns the locked-memory limit, bytes, ``None`` when unlimited (default
            :func:`memlock_limit_bytes`); read only when ``pinned`` and ``memlock_applies``.
        memlock_applies: pinned memory counts against ``RLIMIT_MEMLOCK`` (default
            :data:`PINNING_COUNTS_AGAINST_MEMLOCK`).

    Returns:
        the :class:`HostBudget`; its ``source`` names the binding limit and its numbers.

    Raises:
        ValueError: a negative or non-integer byte count, ``local_ranks < 1``, or a reader returning one.
    """
    _check_bytes("held_bytes", held_bytes)
    _check_bytes("stand_in_bytes", stand_in_bytes, optional=True)
    _check_bytes("user_bytes", user_bytes, optional=True)
    if isinstance(local_ranks, bool) or not isinstance(local_ranks, int) or local_ranks < 1:
        raise ValueError(f"local_ranks must be an integer >= 1, got {local_ranks!r}")
    free = read_available()
    _check_bytes("the available host memory", free)
    share = free // local_ranks
    text = f"available host memory: {fb(free)} free (psutil.virtual_memory().available, cgroup-limited)"
    if local_ranks > 1:
        text += f" shared by {local_ranks} ranks on this machine ({fb(share)} each)"
    if held_bytes:
        text += f", plus {fb(held_bytes)} memsched already holds on the host"
    limits = [(share + held_bytes, text)]
    if pinned and memlock_applies:
        lock = read_memlock()
        _check_bytes("the locked-memory limit", lock, optional=True)
        if lock is not None:
            # The limit covers everything locked, memsched's own pinned chunks included: nothing is added.
            limits.append((lock, f"the locked-memory limit RLIMIT_MEMLOCK (ulimit -l) of {fb(lock)}, which "
                                 "pinned memory counts against"))
    if stand_in_bytes is not None:
        limits.append((stand_in_bytes, f"the stand-in's host memory, host={fb(stand_in_bytes)} in the device "
                                       "string"))
    if user_bytes is not None:
        limits.append((user_bytes, f"host_memory={fb(user_bytes)} given to memsched"))
    cap, source = min(limits, key=lambda limit: limit[0])
    return HostBudget(cap, source)


def check_initial_host_state(need_bytes: int, budget: HostBudget) -> None:
    """At attach, on CUDA and the stand-in, all optimizer state is pinned on the host until warmup ends:
    refuse before pinning it when ``budget`` cannot hold ``need_bytes`` (bytes, pinned sizes).

    Raises:
        policies.PlacementError: the bytes needed and the budget, with the limit that sets it.
    """
    from policies import PlacementError

    if need_bytes > budget.capacity_bytes:
        raise PlacementError(
            f"memsched.attach: does not fit host memory: the optimizer state starts in pinned host memory "
            f"until warmup ends and needs {need_bytes:,} bytes ({fb(need_bytes)}); the host budget is "
            f"{budget.capacity_bytes:,} bytes ({fb(budget.capacity_bytes)}): {budget.source}. Nothing was "
            f"pinned. Give the process more host memory (or a larger host_memory=), train fewer parameters "
            f"per rank (more data-parallel ranks with zero_stage >= 1), or use a host with more memory")
