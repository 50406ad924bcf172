"""AdamW hyper-parameters and param groups: validated here, once, for attach, the optimizer and state dicts.

The group format is ``torch.optim.AdamW``'s (``lr``, ``betas``, ``eps``, ``weight_decay`` per group, plus this
torch's other AdamW keys so that memsched's state dicts load into torch's AdamW and back).

A group's ``"params"`` hold its trainable parameters only (the chunks hold nothing else). Frozen parameters
(``requires_grad=False``) given in a group are remembered by their positions in it (:data:`FROZEN_KEY`), and a
group of frozen parameters only is kept, empty: group indices (per-group LR schedulers) and state-dict
parameter indices are then those of a ``torch.optim.AdamW`` given the same ``params``, which lists frozen
parameters in its groups and keeps no state for them.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch


@functools.cache
def adamw_default_keys() -> dict[str, Any]:
    """The keys of ``torch.optim.AdamW`` groups in this torch (so our state_dict loads there), with the
    implementation flags (:data:`IMPLEMENTATION_KEYS`) saying what memsched runs: torch's fused kernel."""
    d = dict(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults)
    for k in ("lr", "betas", "eps", "weight_decay"):
        d.pop(k, None)
    # A torch AdamW that loads our state dict takes these flags: with fused=True it continues bit for bit.
    d.update({"foreach": None, "fused": True, "capturable": False, "differentiable": False})
    return d


# Group keys that describe how the update is computed, not what it is: memsched's are fixed (it always runs
# the fused kernel), so a loaded state dict (e.g. of a foreach torch AdamW) does not overwrite them.
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")


def _real(x: Any) -> float | None:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    return float(x)


def check_hyperparameters(group: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate one group's AdamW hyper-parameters; return them as floats.

    Raises:
        ValueError: lr, eps or weight_decay not a finite number >= 0, betas not two numbers in [0, 1),
            amsgrad set (unsupported), or maximize not a bool; the message names the group and the value.
    """
    out: dict[str, Any] = {}
    for key in ("lr", "eps", "weight_decay"):
        v = _real(group.get(key))
        if v is None or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: {key} must be a finite number >= 0, got {group.get(key)!r}")
        out[key] = v
    betas = group.get("betas")
    try:
        b1, b2 = (_real(b) for b in betas)
    except (TypeError, ValueError):
        b1 = b2 = None
    if b1 is None or b2 is None or not (0 <= b1 < 1) or not (0 <= b2 < 1):
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    out["beta1"], out["beta2"] = b1, b2
    if group.get("amsgrad", False):
        raise ValueError(f"{where}: amsgrad=True is not supported by memsched (allowed: False)")
    maximize = group.get("maximize", False)
    if not isinstance(maximize, bool):
        raise ValueError(f"{where}: maximize must be True or False, got {maximize!r}")
    out["maximize"] = maximize
    return out


# Group key: positions of the frozen parameters in the group as given to attach (absent when there are none).
FROZEN_KEY = "frozen_positions"


def given_size(group: dict[str, Any]) -> int:
    """Parameters the group was given with: trainable and frozen."""
    return len(group["params"]) + len(group.get(FROZEN_KEY, ()))


def trainable_positions(group: dict[str, Any]) -> list[int]:
    """Position of each of ``group["params"]`` in the group as given (frozen parameters skipped)."""
    frozen = set(group.get(FROZEN_KEY, ()))
    return [k for k in range(given_size(group)) if k not in frozen]


def indexed_param_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups as ``torch.optim.Optimizer.state_dict()`` writes them: hyper-parameters plus the
    parameters' indices, numbered across groups in order over every parameter given (frozen ones too, as
    ``torch.optim.AdamW`` numbers them)."""
    groups, idx = [], 0
    for g in param_groups:
        d = {k: v for k, v in g.items() if k not in ("params", FROZEN_KEY)}
        d["params"] = list(range(idx, idx + given_size(g)))
        idx += given_size(g)
        groups.append(d)
    return groups


def param_indices(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """``id(param) -> index`` in :func:`indexed_param_groups`'s numbering, for each trainable parameter."""
    out, idx = {}, 0
    for g in param_groups:
        for p, k in zip(g["params"], trainable_positions(g), strict=True):
            out[id(p)] = idx + k
        idx += given_size(g)
    return out


def _raw_groups(params: Iterable[Any] | None, model: torch.nn.Module) -> list[dict[str, Any]]:
    if params is None:
        return [{"params": list(model.parameters())}]
    items = list(params)
    if items and all(isinstance(x, dict) for x in items):
        return [dict(x) for x in items]
    if any(isinstance(x, dict) for x in items):
        raise ValueError("params must be all parameters or all param-group dicts, not a mix")
    return [{"params": items}]


def frozen_given(params: Iterable[Any] | None, model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The frozen parameters given in ``params`` (as :func:`hyperparameter_groups` takes it): those a
    ``torch.optim.AdamW`` over the same ``params`` would update once they get a gradient."""
    out: dict[int, torch.nn.Parameter] = {}
    for g in _raw_groups(params, model):
        ps = g.get("params", [])
        for p in [ps] if isinstance(ps, torch.Tensor) else ps:
            if isinstance(p, torch.nn.Parameter) and not p.requires_grad:
                out[id(p)] = p
    return list(out.values())


def hyperparameter_groups(params: Iterable[Any] | None, model: torch.nn.Module) -> list[dict[str, Any]]:
    """Normalise ``params`` (None, an iterable of parameters, or of group dicts) into group dicts whose
    ``"params"`` are the trainable parameters (tied ones once), with the positions of the frozen ones under
    :data:`FROZEN_KEY` (replacing any such key given); a group without trainable parameters stays, empty,
    at its index.

    Raises:
        ValueError: a group has no ``"params"``, a parameter appears in two groups, or nothing is trainable.
    """
    raw = _raw_groups(params, model)
    seen: set[int] = set()
    groups = []
    for i, g in enumerate(raw):
        if "params" not in g:
            raise ValueError(f"param group {i} has no 'params' key")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        kept: list[torch.nn.Parameter] = []
        frozen: list[int] = []
        in_group: set[int] = set()
        for p in ps:
            if not isinstance(p, torch.nn.Parameter):
                raise ValueError(f"param group {i} holds a {type(p).__name__}, expected nn.Parameter")
            if id(p) in in_group:
                continue  # tied twice in one group: once is enough
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} appears in two param groups")
            in_group.add(id(p))
            if p.requires_grad:
                seen.add(id(p))
                kept.append(p)
            else:
                frozen.append(len(kept) + len(frozen))
        # Implementation flags of the optimizer the groups came from (``fused=None``, ``foreach``) are not
        # memsched's: its own (the fused kernel) go into its state dicts, so a resume in
        # ``torch.optim.AdamW(fused=True)`` keeps the kernel.
        group = {k: v for k, v in g.items() if k != FROZEN_KEY and k not in IMPLEMENTATION_KEYS}
        group["params"] = kept
        if frozen:
            group[FROZEN_KEY] = tuple(frozen)
        groups.append(group)
    if not any(g["params"] for g in groups):
        raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to optimize")
    return groups
