"""One AdamW update over flat chunk tensors, on whichever device they live.

memsched updates whole chunks (one flat fp32 tensor each) with torch's own fused AdamW kernel
(``torch._fused_adamw_``, CPU since torch 2.4, CUDA since 2.0): one call per device per step, not one per
parameter. The semantics are those of ``torch.optim.AdamW`` (decoupled weight decay, bias correction),
which the parity tests check. Idea: DeepSpeed ZeRO-Offload's CPU Adam, here without a custom extension.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def fused_adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    increment_steps: bool = True,
) -> None:
    """AdamW step in place over lists of same-device fp32 tensors (flat chunks or shards of them).

    Args:
        params, grads, exp_avgs, exp_avg_sqs: equal-length lists; tensor ``i`` of each has the same shape and
            device, dtype float32 (params may be bf16/fp16 only if their grads match).
        steps: one float32 scalar tensor per param (same device), incremented here before the update, as
            ``torch.optim.AdamW`` does (unless ``increment_steps`` is False: the caller did it, e.g. because
            several tensors share one step count).
        grad_scale, found_inf: optional fp16 loss-scaling inputs of the fused kernel (unscale, skip on inf).

    Raises:
        RuntimeError: from torch when the tensors are on different devices or of unsupported dtypes.
    """
    if not params:
        return
    if increment_steps:
        torch._foreach_add_(list(steps), 1)
    torch._fused_adamw_(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], list(steps),
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=False, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf,
    )


def fp32_grad(g: torch.Tensor, out: torch.Tensor | None, inv_scale: torch.Tensor | None,
              coefs: list[torch.Tensor]) -> torch.Tensor:
    """``g`` as fp32 (into ``out`` when given), unscaled then clipped: the same IEEE operations, in the same
    order, as GradScaler's unscale and ``clip_grad_norm_`` on fp32 master gradients.

    Args:
        g: a gradient (any float dtype; shape kept).
        out: an fp32 tensor of ``g``'s shape to write into, ``g`` itself (fp32, in place), or ``None`` (a new
            fp32 copy when ``g`` is not fp32, else ``g`` in place).
        inv_scale: the fp16 loss scale's inverse (0-d fp32, on ``out``'s device), or ``None``.
        coefs: clip coefficients (0-d fp32), applied in order.
    """
    if out is None:
        out = g.float() if g.dtype != torch.float32 else g
    elif out is not g:
        out.copy_(g)
    # a host chunk's gradients are on the host and the scale and coefficients on the device: torch refuses a
    # device scalar in a host op (a CPU scalar in a device op is fine), so they come to the gradients' side
    if inv_scale is not None:
        out.mul_(inv_scale if inv_scale.device == out.device else inv_scale.to(out.device))
    for k in coefs:
        out.mul_(k if k.device == out.device else k.to(out.device))
    return out
