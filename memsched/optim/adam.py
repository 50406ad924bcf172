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
