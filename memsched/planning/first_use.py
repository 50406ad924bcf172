"""First use of each trainable parameter in a step, from the modules a warmup trace saw run.

A parameter is not always read inside its own module's forward: ``nn.MultiheadAttention`` reads
``out_proj.weight``/``out_proj.bias`` without calling ``out_proj``; a loss may read ``lm_head.weight``
directly; a tied weight is read by two modules. Each parameter is therefore given the nearest *traced*
ancestor of each module that owns it (the module itself when its forward ran) and, of those, the one called
first: the parameter cannot be read before that module's forward starts. A parameter no traced module
encloses (read by a functional call outside any traced module) is given the first traced module, the entry
point of every step. The same answer orders chunk packing (first-use order, PatrickStar arXiv 2108.05818
section 5) and decides where the next forward waits for a chunk's H2D copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _ancestors(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b.c", "a.b", "a", ""]``."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def first_use_owners(model: torch.nn.Module, traced: Sequence[str],
                     params: Sequence[torch.nn.Parameter]) -> dict[int, str]:
    """``id(param) -> name`` of the traced module whose forward is the first that may read it.

    Args:
        model: the model.
        traced: qualified names of the modules whose forward ran in the trace, in first-call order (names
            that are not submodules of ``model`` are ignored). Empty: every parameter gets ``""`` (the root).
        params: the parameters to place (others are ignored).

    Returns:
        an owner for every parameter of ``params`` that ``model`` holds.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    rank: dict[str, int] = {}
    for name in traced:
        if name in modules and name not in rank:
            rank[name] = len(rank)
    entry = next(iter(rank), "")
    wanted = {id(p) for p in params}
    owners: dict[int, str] = {}
    for mod_name, module in modules.items():
        for p in module.parameters(recurse=False):
            if id(p) not in wanted:
                continue
            owner = next((a for a in _ancestors(mod_name) if a in rank), entry)
            old = owners.get(id(p))
            if old is None or rank.get(owner, len(rank)) < rank.get(old, len(rank)):
                owners[id(p)] = owner
    return owners


def first_use_order(model: torch.nn.Module, traced: Sequence[str],
                    params: Sequence[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """``params`` sorted by the first-call position of their owner (:func:`first_use_owners`), ties in the
    model's parameter order; parameters ``model`` does not hold come last in their given order."""
    owners = first_use_owners(model, traced, params)
    rank: dict[str, int] = {}
    for name in traced:
        rank.setdefault(name, len(rank))
    position = {id(p): i for i, p in enumerate(model.parameters())}
    far = len(position) + len(params)
    keyed = [(rank.get(owners[id(p)], len(rank)) if id(p) in owners else len(rank) + 1,
              position.get(id(p), far + i), p) for i, p in enumerate(params)]
    return [p for _, _, p in sorted(keyed, key=lambda t: (t[0], t[1]))]
