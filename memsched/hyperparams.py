"""AdamW hyper-parameters and param groups: validated here, once, for attach, the optimizer and state dicts.

The group format is ``torch.optim.AdamW``'s (``lr``, ``betas``, ``eps``, ``weight_decay`` per group, plus this
torch's other AdamW keys so that memsched's state dicts load into torch's AdamW and back).
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
    """The keys of ``torch.optim.AdamW`` groups in this torch (so our state_dict loads there)."""
    d = dict(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults)
    for k in ("lr", "betas", "eps", "weight_decay"):
        d.pop(k, None)
    return d


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


def indexed_param_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups as ``torch.optim.Optimizer.state_dict()`` writes them: hyper-parameters plus the
    parameters' indices, numbered across groups in order."""
    groups, idx = [], 0
    for g in param_groups:
        d = {k: v for k, v in g.items() if k != "params"}
        d["params"] = list(range(idx, idx + len(g["params"])))
        idx += len(g["params"])
        groups.append(d)
    return groups


def hyperparameter_groups(params: Iterable[Any] | None, model: torch.nn.Module) -> list[dict[str, Any]]:
    """Normalise ``params`` (None, an iterable of parameters, or of group dicts) into group dicts with
    trainable parameters only (frozen ones dropped; tied ones once).

    Raises:
        ValueError: a group has no ``"params"``, a parameter appears in two groups, or nothing is trainable.
    """
    if params is None:
        raw: list[dict[str, Any]] = [{"params": list(model.parameters())}]
    else:
        items = list(params)
        if items and all(isinstance(x, dict) for x in items):
            raw = [dict(x) for x in items]
        elif any(isinstance(x, dict) for x in items):
            raise ValueError("params must be all parameters or all param-group dicts, not a mix")
        else:
            raw = [{"params": items}]
    seen: set[int] = set()
    groups = []
    for i, g in enumerate(raw):
        if "params" not in g:
            raise ValueError(f"param group {i} has no 'params' key")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        kept = []
        for p in ps:
            if not isinstance(p, torch.nn.Parameter):
                raise ValueError(f"param group {i} holds a {type(p).__name__}, expected nn.Parameter")
            if id(p) in seen:
                if any(p is q for q in kept):
                    continue  # tied twice in one group: once is enough
                raise ValueError(f"a parameter of shape {tuple(p.shape)} appears in two param groups")
            if p.requires_grad:
                seen.add(id(p))
                kept.append(p)
        if kept:
            groups.append({**g, "params": kept})
    if not groups:
        raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to optimize")
    return groups
