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


#: Where a parameter's update may be cut into pieces without changing a bit: at multiples of this many
#: elements from the parameter's start. torch's CPU kernel splits its work between threads at 16-element
#: (cache line) units and runs each range vectorised, with a scalar path only for the last
#: ``numel % vector width`` elements of the tensor, whose rounding differs
#: (:meth:`memsched.optim.hybrid_adamw.HybridAdamW._adamw`); a piece that ends at a multiple of 64 has no such
#: tail, so the pieces compute what the whole does. The CUDA kernel is elementwise.
KERNEL_ALIGN = 64


def kernel_spans(parts: Sequence[tuple[int, int]], piece: int, align: int = KERNEL_ALIGN
                 ) -> list[tuple[int, int]]:
    """Cut the flat range of ``parts`` into spans ``[lo, hi)`` of about ``piece`` elements each, for an update
    made piece by piece that is bit for bit the update of the whole (see :data:`KERNEL_ALIGN`).

    Args:
        parts: ``(start, numel)`` of each parameter in the flat buffer, in increasing ``start``, disjoint.
        piece: the span length to aim for, elements (>= ``align``).
        align: cuts inside a parameter fall at multiples of it from the parameter's start.

    Returns:
        Consecutive spans of at most ``piece`` elements covering every parameter; a span may cover the padding
        between two parameters.

    Raises:
        ValueError: ``piece < align`` or ``align < 1``, or ``parts`` overlap or are out of order.
    """
    if align < 1 or piece < align:
        raise ValueError(f"piece ({piece}) must be >= align ({align}) >= 1")
    spans: list[tuple[int, int]] = []
    lo: int | None = None
    end = 0
    for s, n in parts:
        if s < end or n < 1:
            raise ValueError(f"parameter range (start {s}, numel {n}) overlaps the previous one or is empty")
        if lo is not None and piece - (s - lo) < align:  # the padding before it fills the span: close it
            spans.append((lo, end))
            lo = None
        a, end = s, s + n
        while a < end:
            if lo is None:
                lo = a
            room = piece - (a - lo)  # >= align here
            a = end if end - a <= room else a + room // align * align
            if piece - (a - lo) < align:  # no room for another aligned cut: close the span
                spans.append((lo, a))
                lo = None
    if lo is not None:
        spans.append((lo, end))
    return spans
