"""Sharded checkpoints of a memsched-trained model with ``torch.distributed.checkpoint`` (DCP).

What is saved (keys of the DCP state dict):

* ``model.<name>``: every parameter and buffer of the model, whole (plain tensors: the same on every rank, so
  DCP writes them once).
* ``optim.<param>.exp_avg``, ``optim.<param>.exp_avg_sq`` and, under mixed precision, ``optim.<param>.master``
  (fp32): 1-D tensors of the flattened parameter's numel. With ZeRO-1/2 each rank holds only its part of each
  parameter (the part inside its shard of the chunk; a parameter may straddle two ranks), so these are
  ``ShardedTensor`` s whose local shard is that part, with its global offset in the flattened parameter.
  Saving per parameter rather than per chunk makes a checkpoint independent of the chunk layout: DCP
  re-shards on load, so a checkpoint written by 2 ranks loads on 3 ranks, or in one process, whatever the
  chunk size.
* ``optim.<param>.step`` (fp32 scalar, the parameter's step count) and ``optim.param_groups``
  (hyper-parameters per group).

Idea: ZeRO's partitioned optimizer checkpoints (DeepSpeed's universal checkpoint re-shards flat partitions via
per-parameter fragments); the machinery is PyTorch's DCP. Loading reads into fresh tensors first and writes
the model and optimizer state only after DCP succeeded, so a failed load leaves them unchanged.

A whole (unsharded) ``torch.optim.AdamW``-format state dict is ``sched.optimizer.state_dict()`` (gathered from
the ranks' shards under ZeRO).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from memsched.distributed.layout import param_shards
from memsched.optim.hyperparams import FROZEN_KEY

OPT_KEYS = ("exp_avg", "exp_avg_sq", "master")


def _no_dist(fn: Any) -> dict[str, bool]:
    """``no_dist=True`` in one process, where this torch's DCP takes it (it would otherwise warn)."""
    single = not (dist.is_available() and dist.is_initialized())
    return {"no_dist": True} if single and "no_dist" in inspect.signature(fn).parameters else {}


def _local_parts(sched: Any) -> dict[str, list[tuple[int, int, Any, int]]]:
    """``param name -> [(param_start, numel, chunk, shard_start)]`` of the parts this rank holds."""
    store, names = sched.store, sched.names
    out: dict[str, list[tuple[int, int, Any, int]]] = {}
    for c in store.trainable_chunks:
        for p, part in zip(c.params, param_shards(c.ranges, c.lo, c.hi), strict=True):
            parts = out.setdefault(names[id(p)], [])
            if part is not None:
                parts.append((part.param_start, part.numel, c, part.shard_start))
    return out


def _make_sharded(local: list[tuple[int, torch.Tensor]], numel: int, rank: int, group: Any) -> Any:
    """A 1-D ``ShardedTensor`` of ``numel`` elements whose local shards are ``(global offset, tensor)``."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    shards = [Shard(t, ShardMetadata([start], [t.numel()], f"rank:{rank}/cpu")) for start, t in local]
    return init_from_local_shards(shards, [numel], process_group=group)


def _opt_keys(sched: Any) -> tuple[str, ...]:
    mixed = any(c.mixed for c in sched.store.trainable_chunks)
    return OPT_KEYS if mixed else OPT_KEYS[:2]


def _state_tensor(c: Any, key: str) -> torch.Tensor:
    return {"exp_avg": c.exp_avg, "exp_avg_sq": c.exp_avg_sq, "master": c.master_view()}[key]


def _build(sched: Any, *, fill: bool) -> tuple[dict[str, Any], dict[tuple[str, str], list]]:
    """The DCP state dict; ``fill`` copies the current values (save), else fresh zero tensors (load). Also
    returns ``(param, key) -> [(local tensor, chunk, shard_start, numel)]`` to write loaded values back."""
    sched.synchronize()
    # Like the optimizer's state_dict()/load_state_dict(): the worker is done reading the state for updates
    # made during backward (overlap="backward"), so a load drops them all rather than racing with their reads.
    sched.optimizer.wait_updates("checkpoint")
    sched.dp.end_step()
    sd: dict[str, Any] = {}
    for name, t in [*sched.model.named_parameters(), *sched.model.named_buffers()]:
        sd[f"model.{name}"] = t.detach().to("cpu", copy=True) if fill else torch.empty_like(t, device="cpu")
    parts = _local_parts(sched)
    back: dict[tuple[str, str], list] = {}
    params = {sched.names[id(p)]: p for p in sched.store.params()}
    for name, plist in parts.items():
        numel = params[name].numel()
        step = sched.store.step_of(params[name])
        sd[f"optim.{name}.step"] = step.detach().to("cpu", copy=True).reshape(()) if fill else torch.zeros(())
        for key in _opt_keys(sched):
            local = []
            for start, n, c, ss in plist:
                src = _state_tensor(c, key)[ss : ss + n]
                t = src.detach().to("cpu", copy=True) if fill else torch.zeros(n, dtype=torch.float32)
                local.append((start, t))
                back.setdefault((name, key), []).append((t, c, ss, n))
            if sched.dp.sharded:
                sd[f"optim.{name}.{key}"] = _make_sharded(local, numel, dist.get_rank(), sched.dp.group)
            else:
                sd[f"optim.{name}.{key}"] = local[0][1]
    # One JSON string: DCP would flatten a list of dicts into keys of its own.
    sd["optim.param_groups"] = _groups_json(sched) if fill else ""
    if sched.scaler is not None:  # fp16: the loss scale continues where it was
        sd["optim.loss_scaler"] = json.dumps(sched.scaler.state_dict()) if fill else ""
    return sd, back


def _groups_json(sched: Any) -> str:
    groups = []
    for g in sched.optimizer.param_groups:
        # The frozen layout describes the groups given to attach, not hyper-parameters: never loaded over.
        d = {k: v for k, v in g.items() if k not in ("params", FROZEN_KEY) and _jsonable(v)}
        d["params"] = [sched.names[id(p)] for p in g["params"]]
        groups.append(d)
    return json.dumps(groups)


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return True


class CheckpointError(RuntimeError):
    """Reading or writing a checkpoint failed (DCP's ``CheckpointException``, a ``BaseException`` that
    ``except Exception`` would not catch, re-raised as an ordinary error naming the checkpoint)."""


@contextlib.contextmanager
def _dcp_errors(what: str, checkpoint_id: str | os.PathLike[str]) -> Iterator[None]:
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{what} checkpoint {os.fspath(checkpoint_id)!r} failed: {first}") from e


def _on_host(sched: Any) -> contextlib.AbstractContextManager:
    """Checkpoint copies are host memory: on the stand-in they must not count as device memory."""
    return sched.sim.paused() if sched.sim is not None else contextlib.nullcontext()


def save(sched: Any, checkpoint_id: str | os.PathLike[str]) -> None:
    """Write the model and the (sharded) optimizer state of ``sched`` to the directory ``checkpoint_id``.

    A collective under ZeRO: every rank calls it with the same directory.

    Raises:
        CheckpointError: DCP failed on some rank.
    """
    # ZeRO-3: the model's parameters whole (a collective, as DCP is; device memory, outside _on_host)
    with sched.gathered_params():
        with _on_host(sched):
            sd, _ = _build(sched, fill=True)
    with _on_host(sched), _dcp_errors("writing", checkpoint_id), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        dcp.save(
            sd, checkpoint_id=os.fspath(checkpoint_id), process_group=sched.dp.group, **_no_dist(dcp.save)
        )


def load(sched: Any, checkpoint_id: str | os.PathLike[str]) -> None:
    """Load a checkpoint of :func:`save` (any world size, any chunk layout) into ``sched``'s model and
    optimizer; each rank reads only its parts. Nothing is written before DCP has read everything.

    Raises:
        ValueError: the param-group count differs, or the loss-scaler state is malformed.
        CheckpointError: DCP failed (e.g. a key is missing, or there is no checkpoint there).
    """
    with sched.gathered_params(), _on_host(sched):  # ZeRO-3: written whole, then sharded again
        _load(sched, checkpoint_id)


def _load(sched: Any, checkpoint_id: str | os.PathLike[str]) -> None:
    sd, back = _build(sched, fill=False)
    with _dcp_errors("reading", checkpoint_id), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        dcp.load(
            sd, checkpoint_id=os.fspath(checkpoint_id), process_group=sched.dp.group, **_no_dist(dcp.load)
        )
    opt, store = sched.optimizer, sched.store
    saved_groups = json.loads(sd["optim.param_groups"])
    scaler_state = json.loads(sd["optim.loss_scaler"]) if sched.scaler is not None else None
    if scaler_state is not None:
        sched.scaler.check_state_dict(scaler_state)
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"checkpoint has {len(saved_groups)} param groups, the optimizer has {len(opt.param_groups)}"
        )
    steps = {id(p): float(sd[f"optim.{sched.names[id(p)]}.step"]) for p in store.params()}
    # ---- write: everything was read ------------------------------------------------------------------------
    with torch.no_grad():
        for name, t in [*sched.model.named_parameters(), *sched.model.named_buffers()]:
            t.copy_(sd[f"model.{name}"])
        with store.alloc.host_context():
            for c in store.trainable_chunks:
                c.wait_h2d()
                for k, p in enumerate(c.params):
                    c.steps[k].fill_(steps[id(p)])
            for (_name, key), items in back.items():
                for t, c, ss, n in items:
                    _state_tensor(c, key)[ss : ss + n].copy_(t)
            for c in store.trainable_chunks:
                if not c.mixed and c.master is not None:  # fp32 on the host: the master is the parameter
                    values = store.values(c)  # host-bound: the master itself, written above
                    if values.data_ptr() != c.master.data_ptr():
                        c.master.copy_(values)
    for g, saved in zip(opt.param_groups, saved_groups, strict=True):
        for k, v in saved.items():
            if k not in ("params", FROZEN_KEY):
                g[k] = tuple(v) if k == "betas" else v
    if scaler_state is not None:
        sched.scaler.load_state_dict(scaler_state)
    opt.record_param_versions()
