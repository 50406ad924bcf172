"""A :class:`memsched.models.gpt.GPT` cut into pipeline stages (``torch.distributed.pipelining``'s manual
split: each rank builds the whole model from one seed and keeps its stage).

Stage ``0`` holds the token and position embeddings and the first blocks; the last stage holds the last
blocks, the final ``LayerNorm`` and the output projection. The GPT ties its output projection to the token
embedding; two stages cannot share a tensor, so the last stage's projection is an untied copy of the
embedding's initial values (as pipeline-parallel GPT trainings untie them, or sum their gradients between the
two stages).

Shapes: stage 0 takes token ids ``[B, T]`` int64; the others take hidden states ``[B, T, n_embd]``; the last
returns logits ``[B, T, vocab_size]``, the others hidden states.
"""

from __future__ import annotations

import torch
from torch import nn

from memsched.models.gpt import GPT


class GPTStage(nn.Module):
    """Blocks ``[first, last)`` of ``gpt`` (sharing its modules), with the embeddings on the first stage and
    the head on the last (see the module docstring).

    Args:
        gpt: the whole model.
        first, last: the blocks this stage runs, ``0 <= first < last <= n_layer``.
        is_first, is_last: whether this stage embeds tokens / projects to the vocabulary.

    Raises:
        ValueError: an empty or out-of-range block range.
    """

    def __init__(self, gpt: GPT, first: int, last: int, *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        if not 0 <= first < last <= len(gpt.blocks):
            raise ValueError(f"blocks [{first}, {last}) out of the model's {len(gpt.blocks)}")
        self.config = gpt.config
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[first:last])
        if is_last:
            self.ln_f = gpt.ln_f
            self.lm_head = nn.Linear(self.config.n_embd, self.config.vocab_size, bias=False)
            with torch.no_grad():  # untied: a copy of the embedding's initial values
                self.lm_head.weight.copy_(gpt.wte.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, T]`` (first stage) or hidden states ``[B, T, n_embd]``; returns hidden states, or
        logits on the last stage."""
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(pos)
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.lm_head(self.ln_f(x)) if self.is_last else x


def split_gpt(gpt: GPT, n_stages: int) -> list[GPTStage]:
    """``gpt``'s blocks in ``n_stages`` consecutive stages, as even as the block count allows (the first
    stages take one block more).

    Raises:
        ValueError: ``n_stages`` below 1 or above the number of blocks.
    """
    n = len(gpt.blocks)
    if not 1 <= n_stages <= n:
        raise ValueError(f"n_stages must be in [1, {n}] for a GPT of {n} blocks, got {n_stages}")
    bounds, lo = [], 0
    for s in range(n_stages):
        hi = lo + n // n_stages + (1 if s < n % n_stages else 0)
        bounds.append((lo, hi))
        lo = hi
    return [GPTStage(gpt, a, b, is_first=s == 0, is_last=s == n_stages - 1)
            for s, (a, b) in enumerate(bounds)]


def stage_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of the last stage's ``logits`` ``[B, T, V]`` against ``targets``
    ``[B, T]``: the pipeline schedule's ``loss_fn``."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
