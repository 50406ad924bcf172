"""The optimizer state dict of :class:`memsched.optim.hybrid_adamw.HybridAdamW`, one path for any world size.

Format: ``torch.optim.AdamW.state_dict()``'s. ``state`` maps the parameter index (in param-group order) to
``step`` (float32 scalar), ``exp_avg`` and ``exp_avg_sq`` (fp32, shaped like the parameter), all CPU tensors;
under mixed precision also ``master_weight`` (fp32, shaped like the parameter). ``param_groups`` hold the
hyper-parameters and the parameter indices. Under fp16 ``loss_scaler`` holds the dynamic loss scale's state
(:meth:`memsched.optim.precision.LossScaler.state_dict`). It loads into ``torch.optim.AdamW`` and back.

Indices count every parameter given to :func:`memsched.attach` in its groups, frozen ones too, and a group of
frozen parameters only keeps its place (:mod:`memsched.optim.hyperparams`), as ``torch.optim.AdamW`` given the
same ``params`` numbers them. Like torch, there is no state for a frozen parameter nor for one never updated.
Loading accepts, per group, that numbering or one that counts the trainable parameters only (a
``torch.optim.AdamW`` built over ``requires_grad`` parameters); saved state of a frozen parameter is ignored.

Saving reads each chunk's WHOLE state through the data parallelism (:meth:`DataParallel.full_state`: a copy on
one rank, an all-gather of the shards under ZeRO), one chunk at a time. Loading writes, on every rank, the
part of each parameter that falls in the rank's shard (:func:`memsched.chunks.param_shards`; one rank: all of
it), in place. Everything is checked before anything is written.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from memsched.chunks import param_shards
from memsched.optim.hyperparams import (
    FROZEN_KEY,
    IMPLEMENTATION_KEYS,
    check_hyperparameters,
    given_size,
    indexed_param_groups,
    param_indices,
    trainable_positions,
)


class ChunkedOptimizer(Protocol):
    """What the state dict reads of :class:`memsched.optim.hybrid_adamw.HybridAdamW` (a protocol, so this
    module does not import the optimizer that imports it)."""

    store: Any  # memsched.chunks.ChunkStore
    dp: Any  # memsched.distributed.base.DataParallel
    scaler: Any  # memsched.optim.precision.LossScaler or None
    param_groups: list[dict[str, Any]]

    def _name(self, p: torch.Tensor) -> str: ...

    def record_param_versions(self) -> None: ...


def state_dict(opt: ChunkedOptimizer) -> dict[str, Any]:
    """The whole optimizer state (see the module docstring); a collective under ZeRO."""
    store = opt.store
    opt.dp.end_step()  # every fetch of the last step is complete
    index = param_indices(opt.param_groups)
    state: dict[int, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for c in store.trainable_chunks:
            c.wait_h2d()
            with store.alloc.host_context():  # host copies: never device memory
                master, m, v = opt.dp.full_state(c)
                steps = c.steps.detach().to("cpu", copy=True)
                for k, (p, (off, _n)) in enumerate(zip(c.params, c.ranges, strict=True)):
                    if float(steps[k]) == 0:
                        continue  # never updated: torch.optim.AdamW has no state for it either
                    # in the parameter's memory format, as torch.optim.AdamW's state (zeros_like(p))
                    st = {"step": steps[k].clone(), "exp_avg": store.slot(m, off, p).clone(),
                          "exp_avg_sq": store.slot(v, off, p).clone()}
                    if c.mixed:
                        st["master_weight"] = store.slot(master, off, p).clone()
                    state[index[id(p)]] = st
    out = {"state": dict(sorted(state.items())), "param_groups": indexed_param_groups(opt.param_groups)}
    if opt.scaler is not None:  # fp16: a resumed run continues the same loss scale (torch.optim ignores it)
        out["loss_scaler"] = opt.scaler.state_dict()
    return out


def validate_state_dict(
    opt: ChunkedOptimizer, sd: dict[str, Any]
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, float]]:
    """Check ``sd`` against ``opt`` without writing anything.

    Returns:
        the saved state per parameter (keyed by ``id(param)``; parameters without state are absent) and the
        step count per parameter (keyed by ``id(param)``; 0 without state).

    Raises:
        ValueError: not a state dict, the group count or sizes differ, a hyper-parameter is invalid, a tensor
            has the wrong shape, a state lacks a key, or a step is not a number.
    """
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("optimizer state dict must be a dict with 'state' and 'param_groups'")
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        frozen_only = [i for i, g in enumerate(opt.param_groups) if not g["params"]]
        hint = (f" (groups {frozen_only} hold only frozen parameters: they keep their index, as in "
                "torch.optim.AdamW)" if frozen_only else "")
        raise ValueError(f"state dict has {len(saved_groups)} param groups, this optimizer has "
                         f"{len(opt.param_groups)}{hint}")
    saved_keys = []
    for i, (sg, g) in enumerate(zip(saved_groups, opt.param_groups, strict=True)):
        saved_keys.append(_saved_keys(sg["params"], g, i))
        check_hyperparameters({**g, **_hyperparameters(sg)}, f"param group {i}")
    saved_state = sd["state"]
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for keys, g in zip(saved_keys, opt.param_groups, strict=True):
        for key, p in zip(keys, g["params"], strict=True):
            st = saved_state.get(key)
            if st is None or len(st) == 0:
                continue
            for k in ("step", "exp_avg", "exp_avg_sq"):
                if k not in st:
                    raise ValueError(f"state of parameter {opt._name(p)} lacks {k!r}")
            for k in ("exp_avg", "exp_avg_sq", "master_weight"):
                if k in st and tuple(st[k].shape) != tuple(p.shape):
                    raise ValueError(f"state {k!r} of parameter {opt._name(p)} has shape "
                                     f"{tuple(st[k].shape)}, expected {tuple(p.shape)}")
            per_param[id(p)] = st
    steps: dict[int, float] = {}
    for p in opt.store.params():
        st = per_param.get(id(p))
        step = st["step"] if st is not None else 0.0
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = step.item()
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not step >= 0:
            raise ValueError(f"state 'step' of parameter {opt._name(p)} must be a number >= 0, got {step!r}")
        steps[id(p)] = float(step)
    return per_param, steps


def _hyperparameters(saved_group: dict[str, Any]) -> dict[str, Any]:
    """A saved group's hyper-parameters: not its indices, its frozen layout (the optimizer's describes the
    groups given to attach) nor its implementation flags (memsched always runs the fused kernel)."""
    return {k: v for k, v in saved_group.items() if k not in ("params", FROZEN_KEY, *IMPLEMENTATION_KEYS)}


def _saved_keys(saved: list[Any], group: dict[str, Any], i: int) -> list[Any]:
    """The state-dict key of each of ``group["params"]``: the saved group numbers every parameter given
    (frozen ones too, as ``torch.optim.AdamW`` does) or the trainable ones only."""
    n_given, n_trainable = given_size(group), len(group["params"])
    if len(saved) == n_given:
        return [saved[k] for k in trainable_positions(group)]
    if len(saved) == n_trainable:
        return list(saved)
    frozen = n_given - n_trainable
    expected = (f"{n_given} (every parameter given to attach) or {n_trainable} (the trainable ones; "
                f"{frozen} are frozen)" if frozen else str(n_given))
    raise ValueError(f"param group {i} of the state dict has {len(saved)} parameters, this optimizer's "
                     f"expects {expected}")


def load_state_dict(opt: ChunkedOptimizer, sd: dict[str, Any]) -> None:
    """Load ``sd`` (see :func:`validate_state_dict` for the errors). Parameters without state get zero moments
    and step 0; without a saved ``master_weight`` the master takes the parameter's current value where it
    differs from the master rounded to the compute dtype, and keeps its full precision elsewhere (so loading a
    state dict saved before the first step, as Accelerate's ``prepare`` does, changes nothing)."""
    per_param, steps = validate_state_dict(opt, sd)
    scaler_state = sd.get("loss_scaler")
    if opt.scaler is not None and scaler_state is not None:
        opt.scaler.check_state_dict(scaler_state)
    store = opt.store
    opt.dp.end_step()
    with torch.no_grad():
        for c in store.trainable_chunks:
            c.wait_h2d()
            with store.alloc.host_context():
                for p, part in zip(c.params, param_shards(c.ranges, c.lo, c.hi), strict=True):
                    if part is None:
                        continue  # none of this parameter is in this rank's shard
                    st = per_param.get(id(p))
                    ps, ss, n = part.param_start, part.shard_start, part.numel
                    for k, dst in (("exp_avg", c.exp_avg), ("exp_avg_sq", c.exp_avg_sq)):
                        if st is None:
                            dst[ss:ss + n].zero_()
                        else:
                            dst[ss:ss + n].copy_(store.memory_order(p, st[k])[ps:ps + n])
                    if c.master is None:
                        continue  # fp32 on the device: the compute buffer is the master
                    src = st.get("master_weight") if st is not None else None
                    if src is not None:
                        c.master[ss:ss + n].copy_(store.memory_order(p, src)[ps:ps + n])
                    else:  # the parameter's value, but the master's where it rounds to the parameter
                        master = c.master[ss:ss + n]
                        new = store.values(c)[ss:ss + n].to(master.device)
                        master.copy_(torch.where(new != master.to(new.dtype), new.float(), master))
                for k, p in enumerate(c.params):
                    c.steps[k].fill_(steps[id(p)])
    for sg, g in zip(sd["param_groups"], opt.param_groups, strict=True):
        g.update(_hyperparameters(sg))
    if opt.scaler is not None and scaler_state is not None:
        opt.scaler.load_state_dict(scaler_state)
    opt.record_param_versions()
