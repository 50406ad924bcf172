"""The attention kernel a CUDA GPU runs, chosen inside a fake trace on the CPU.

A fake trace (:mod:`memsched.planning.prediction`) computes memory with the meta kernels of the ops it runs,
so its prediction is that of the device whose kernels torch picks. For every op but attention those are
the same ops on the CPU and on CUDA. For ``scaled_dot_product_attention`` torch picks per device: on a CUDA
GPU of compute capability 8.0 or more, FlashAttention-2 for fp16/bf16 without a mask (head dim at most 256),
else the memory-efficient kernel (xFormers'), and the math kernel only where neither applies; on the CPU its
own flash kernel. They keep different tensors for backward: for GPT-2 355M in fp32 at batch 4 x 1024 the
CPU's choice predicted 8,954,175,528 bytes of peak non-model data, an H200's warmup measured 9,356,862,464
(4.3 % more), and the memory-efficient kernel traced on the CPU predicts 9,356,829,096
(``bench/results/gpu_results_2026-11-26_h200.md``; ``tests/test_gpu_calibration.py`` checks every committed
GPU result). :func:`gpu_attention` routes each call to the op the GPU would run; its fake kernel gives that
op's outputs and, through its derivative, what autograd saves.

The selection rules follow ``sdp_utils`` in PyTorch (``select_sdp_backend``); the flash choice for fp16/bf16
is not yet checked against a GPU measurement (bench/GPU-PENDING.md).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

#: Largest head dimension FlashAttention-2 takes in torch's CUDA build.
FLASH_MAX_HEAD_DIM = 256


def gpu_attention_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None, enable_gqa: bool = False) -> str:
    """Which kernel a CUDA GPU (compute capability >= 8.0) runs for these inputs: ``"flash"``,
    ``"efficient"`` or ``"math"``. Inputs ``[batch, heads, seq, head_dim]``."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or enable_gqa:
        return "math"
    head_dim = query.size(-1)
    if key.size(-1) != head_dim or value.size(-1) != head_dim or query.size(1) != key.size(1):
        return "math"
    half = query.dtype in (torch.float16, torch.bfloat16)
    if half and attn_mask is None and head_dim <= FLASH_MAX_HEAD_DIM and head_dim % 8 == 0:
        return "flash"
    # the memory-efficient kernel reads 16-byte aligned rows
    if query.dtype in (torch.float32, torch.float16, torch.bfloat16) and \
            head_dim % (16 // query.element_size()) == 0:
        return "efficient"
    return "math"


def gpu_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor | None:
    """``F.scaled_dot_product_attention`` through the op a CUDA GPU would run (``None``: the math kernel,
    which the caller runs as usual). Output ``[batch, heads, seq, head_dim]`` in the inputs' dtype."""
    kind = gpu_attention_kernel(query, key, value, attn_mask, enable_gqa)
    if kind == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if kind == "efficient":
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch converts it for this kernel
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                attn_mask.logical_not(), float("-inf"))
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale)[0]
    return None


_lock = threading.Lock()


@contextlib.contextmanager
def gpu_attention() -> Iterator[None]:
    """Inside it, ``torch.nn.functional.scaled_dot_product_attention`` (and what calls it through the
    module: ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``, Hugging Face's SDPA attention) runs
    the kernel a CUDA GPU would pick (:func:`gpu_attention_kernel`). For fake traces: on real CPU tensors
    those CUDA ops have no kernel.

    [Note: why the module attribute] A ``TorchFunctionMode`` would see a direct call only: torch runs a
    mode's handler with the mode popped, so the call that ``F.multi_head_attention_forward`` makes inside
    is not seen. So the function is swapped in ``torch.nn.functional`` for the duration (one trace at a time:
    a lock; restored on exit, whatever happens). Code that imported the function by name before keeps
    torch's choice for the CPU.
    """
    with _lock:
        original = F.scaled_dot_product_attention

        def routed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args,
                   **kwargs) -> torch.Tensor:
            out = gpu_sdpa(query, key, value, *args, **kwargs)
            return original(query, key, value, *args, **kwargs) if out is None else out

        F.scaled_dot_product_attention = routed
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original
