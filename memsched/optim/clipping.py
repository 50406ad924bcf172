"""Gradient-norm arithmetic of ``torch.nn.utils.clip_grad_norm_``, for gradients that are not one list of
tensors.

memsched clips fp16 gradients as GradScaler users do (``scaler.unscale_(opt)`` then ``clip_grad_norm_`` on
fp32 master gradients) without holding fp32 copies of all gradients at once: the per-tensor norms are computed
one chunk at a time and combined here. To be bit-identical to torch, each step is torch's own: per-tensor
norms with ``torch._foreach_norm`` where torch would use the foreach path on that device, else
``torch.linalg.vector_norm`` per tensor; the total is ``vector_norm`` of the stacked per-tensor norms; the
coefficient is ``max_norm / (total + 1e-6)`` clamped to 1 (see ``torch/nn/utils/clip_grad.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._foreach_utils import _has_foreach_support


def total_norm(tensors: Sequence[torch.Tensor], norm_type: float = 2.0, *, per_tensor: bool = False,
               of_norms: bool = False) -> torch.Tensor | list[torch.Tensor]:
    """Norms as ``clip_grad_norm_`` computes them.

    Args:
        tensors: gradients on one device and of one dtype (as torch groups them), or, with ``of_norms``,
            per-tensor norms (0-d) to combine.
        per_tensor: return the list of per-tensor norms (0-d tensors) instead of their total.
        of_norms: ``tensors`` are per-tensor norms already: return their total.

    Returns:
        the total norm (0-d, on the first tensor's device), or the per-tensor norms.
    """
    norm_type = float(norm_type)
    if of_norms:
        norms = list(tensors)
    else:
        ts = list(tensors)
        if not ts:
            norms = []
        elif _has_foreach_support(ts, ts[0].device):
            norms = list(torch._foreach_norm(ts, norm_type))
        else:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in ts]
        if per_tensor:
            return norms
    if not norms:
        return torch.tensor(0.0)
    first = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total + 1e-6))`` as a tensor on ``total``'s device (no host synchronisation)."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
