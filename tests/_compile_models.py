"""A transformer none of this project's models resembles, for compiled training as a new user would write it
(issue 41, item 5): tied embeddings, a block under non-reentrant activation checkpointing, a block applied
twice, a frozen block, and ``nn.MultiheadAttention``. Used by ``tests/test_compile_inductor.py`` and
``bench/compile_step.py --model unfamiliar``."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    """Pre-norm causal self-attention (``nn.MultiheadAttention``) and an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class UnfamiliarTransformer(nn.Module):
    """Token and learned position embeddings; block 0 checkpointed, block 1 applied twice, block 2 frozen;
    the head's weight is the embedding's (tied).

    Args:
        vocab: vocabulary size (tokens).
        d: model width (elements).
        heads: attention heads.
        seq_len: the longest sequence (tokens).
    """

    def __init__(self, vocab: int = 96, d: int = 32, heads: int = 2, seq_len: int = 16) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        self.b0, self.b1, self.b2 = Block(d, heads), Block(d, heads), Block(d, heads)
        self.b2.requires_grad_(False)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        x = checkpoint(self.b0, x, use_reentrant=False)
        x = self.b1(self.b1(x))
        x = self.b2(x)
        return self.head(self.ln(x))


def unfamiliar_transformer(seed: int = 0, **kwargs: int) -> UnfamiliarTransformer:
    """The model with seeded initial values (``kwargs``: :class:`UnfamiliarTransformer`'s sizes)."""
    torch.manual_seed(seed)
    return UnfamiliarTransformer(**kwargs)


def batches(model: UnfamiliarTransformer, n: int, batch: int = 4, seq_len: int = 16,
            device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """``n`` seeded token batches of ``batch`` x (``seq_len`` + 1): inputs and their next tokens."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, model.vocab, (batch, seq_len + 1), generator=gen).to(device) for _ in range(n)]


def loss(model: nn.Module, batch: torch.Tensor, vocab: int) -> torch.Tensor:
    """Next-token cross-entropy of ``model`` (maybe its compiled wrapper) on ``batch``."""
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
