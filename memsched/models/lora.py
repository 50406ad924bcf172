"""LoRA adapters on a frozen model: the fine-tuning whose frozen base is most of the model data (issue 31).

LoRA (Hu et al. 2021, arXiv 2106.09685): a frozen linear layer ``W`` gets a trainable low-rank update,
``y = x W^T + b + scale * (x A^T) B^T`` with ``A`` of shape ``[rank, in_features]`` (random) and ``B`` of
shape ``[out_features, rank]`` (zeros, so the adapted model starts as the base), ``scale = alpha / rank``.
PEFT's ``LoraConfig`` does the same; this one needs no extra package, so ``memsched plan --lora`` and the
tests can build it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` (``base``) plus a trainable rank-``rank`` update.

    Shapes: input ``[..., in_features]``, output ``[..., out_features]``, in the base's dtype. Parameters:
    ``lora_a`` ``[rank, in_features]`` (Kaiming-uniform, as PEFT), ``lora_b`` ``[out_features, rank]``
    (zeros), both in the base weight's dtype and on its device.

    Raises:
        ValueError: ``rank`` is not a positive integer.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None) -> None:
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
        self.base = base.requires_grad_(False)
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = (alpha if alpha is not None else rank) / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


def add_lora(model: nn.Module, rank: int, *, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Freeze every parameter of ``model`` and put a :class:`LoRALinear` of ``rank`` around each plain
    ``nn.Linear`` it calls (not subclasses such as ``nn.MultiheadAttention``'s output projection, whose weight
    the attention reads directly), except the children named in ``skip``. In place; returns ``model``.

    Raises:
        ValueError: a bad ``rank``, or no ``nn.Linear`` to adapt.
    """
    model.requires_grad_(False)
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and name not in skip]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no nn.Linear to put a LoRA adapter on")
    for parent, name, child in targets:
        setattr(parent, name, LoRALinear(child, rank))
    return model
