"""Run a function on N local ranks (CPU, gloo) for the ZeRO tests, with a hard time limit.

``run_ranks(fn, world, *args)`` starts ``world`` processes (forked from a fork server where available, which
imported torch once, so a launch costs well under a second; ``spawn`` elsewhere), initialises a
gloo process group with a short timeout in each, calls ``fn(rank, world, *args)`` and returns the list of the
ranks' return values (passed back through ``torch.save`` files). A rank that raises fails the call with its
traceback; a launch that outlives ``timeout`` seconds is killed and raises ``TimeoutError``, so a hung
collective cannot hang the test suite.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# memsched.scheduler too (and with it torch._dynamo, ~1.5 s to import): ``memsched`` imports it lazily, so
# without it every rank would import it again (issue 43: ~1.5 s of CPU per rank, about a hundred a run)
mp.set_forkserver_preload(["torch", "memsched", "memsched.scheduler", "tests._sim_preload"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, outdir: str, pg_timeout_s: float | None, fn: Callable[..., Any],
    args: tuple
) -> None:
    import tests._sim_preload  # noqa: F401  (a spawned rank: the stand-in first, as the fork server loads it)

    torch.set_num_threads(1)  # 2 cores shared by all ranks and other test runs
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if pg_timeout_s is None:  # fn initialises the group itself, from the environment torchrun gives
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(world))
        else:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout_s)
            )
        result = fn(rank, world, *args)
        torch.save(result, Path(outdir) / f"rank{rank}.pt")
    except BaseException:
        (Path(outdir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group (a peer died on purpose) may fail to tear down
                pass


def _start_method() -> str:
    # Not fork: a backward over device tensors (the stand-in's, CUDA's, even fake CUDA ones) starts autograd's
    # device threads, and autograd refuses to run in a process forked after that. A fork server is started
    # fresh once (torch and memsched imported there) and forks the ranks from itself, so launches stay quick.
    # Where CUDA is available, loading memsched and the stand-in there initialises CUDA's driver, and ranks
    # forked after that die at their first backward (autograd's CUDA thread: "CUDA error: initialization
    # error", the H200 on 2026-11-27): spawn there.
    if "forkserver" in mp.get_all_start_methods() and not torch.cuda.is_available():
        return "forkserver"
    return "spawn"


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout_s: float | None = 30.0,
    allow_exit: tuple[int, ...] = (),
) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each run in its own process.

    Args:
        timeout: seconds for the whole launch before every rank is killed (``TimeoutError``).
        pg_timeout_s: the process group's collective timeout, seconds; ``None``: no group is initialised,
            ``fn`` initialises it (``env://``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
            ``MASTER_ADDR`` and ``MASTER_PORT`` are set as ``torchrun`` sets them).
        allow_exit: ranks that may end without a result (they exit early on purpose); ``None`` in their slot.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message).
        TimeoutError: the launch outlived ``timeout``.
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry,
            args=(world, free_port(), outdir, pg_timeout_s, fn, args),
            nprocs=world,
            join=False,
            start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout} s")
        except mp.ProcessRaisedException as e:
            errs = sorted(Path(outdir).glob("rank*.err"))
            detail = "\n".join(f"{p.name}:\n{p.read_text()}" for p in errs)
            raise RuntimeError(f"a rank failed: {e}\n{detail}") from None
        except mp.ProcessExitedException as e:
            if e.error_index not in allow_exit:
                raise
            for p in ctx.processes:  # the others go on; wait for them
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        out = []
        for r in range(world):
            f = Path(outdir) / f"rank{r}.pt"
            if f.exists():
                out.append(torch.load(f, weights_only=False))
            elif r in allow_exit:
                out.append(None)
            else:
                err = Path(outdir) / f"rank{r}.err"
                raise RuntimeError(
                    f"rank {r} left no result" + (f":\n{err.read_text()}" if err.exists() else "")
                )
        return out
