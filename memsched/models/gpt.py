"""A GPT-style decoder-only transformer built from torch's own layers, with named size presets
(:mod:`memsched.models.presets`, re-exported here).

Architecture (GPT-2, Radford et al. 2019; sizes from GPT-3, Brown et al. 2020, arXiv 2005.14165):
token + learned position embeddings (``nn.Embedding``), ``n_layer`` pre-norm blocks
(``nn.TransformerEncoderLayer(norm_first=True, activation="gelu")`` run with a causal mask), a final
``nn.LayerNorm`` and an output projection tied to the token embedding. Attention goes through
``nn.MultiheadAttention``, which calls ``F.scaled_dot_product_attention(is_causal=True)`` (flash /
memory-efficient kernels where the device has them, the CPU flash kernel on CPU).

Shapes: input token ids ``[batch, seq]`` int64 with ``seq <= block_size``; logits ``[batch, seq, vocab_size]``
in the parameters' dtype.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from memsched.models.presets import (  # noqa: F401 (re-exported: the presets need no torch)
    BYTE_VOCAB,
    GPT2_VOCAB,
    PRESETS,
    GPTConfig,
    config_for,
    sizes,
)


class GPT(nn.Module):
    """GPT-style decoder (see the module docstring). ``forward(idx [B, T] int64) -> logits [B, T, vocab]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        d = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, d)
        self.wpe = nn.Embedding(config.block_size, d)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, config.n_head, 4 * d, dropout=config.dropout, activation="gelu",
                batch_first=True, norm_first=True,
            )
            for _ in range(config.n_layer)
        )
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embeddings (GPT-2)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # GPT-2 initialisation: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2 n_layer).
        # normal_/zero_/fill_ only, which also run on fake and meta tensors.
        std = 0.02
        for name, p in self.named_parameters():
            is_norm = ".norm" in name or name.startswith("ln_f.")
            if p.dim() == 1:
                if is_norm and name.endswith(".weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()
            elif name.endswith(("out_proj.weight", "linear2.weight")):
                p.normal_(0.0, std / math.sqrt(2 * self.config.n_layer))
            else:
                p.normal_(0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for token ids ``idx`` ``[B, T]`` (int64, ``T <= block_size``).

        Raises:
            ValueError: ``idx`` is not 2-D or longer than ``block_size``.
        """
        if idx.dim() != 2:
            raise ValueError(f"GPT input must be [batch, seq] token ids, got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds the model's block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        # The mask is required by nn.MultiheadAttention with is_causal=True; with need_weights=False it is
        # then dropped in favour of SDPA's is_causal flag, so no [T, T] mask is applied per head.
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.lm_head(self.ln_f(x))


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ``model(inputs)`` against ``targets`` (``[B, T]`` int64)."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_gpt(size: str = "demo", *, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None, **overrides: int | float) -> GPT:
    """A :class:`GPT` of preset ``size`` on ``device`` (default: torch's default device), parameters in
    ``dtype``.

    Raises:
        ValueError: unknown size (lists the known ones) or a bad override.
    """
    config = config_for(size, **overrides)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = GPT(config)
    return model.to(dtype=dtype) if dtype is not None else model


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Parameters of ``model``, each shared (tied) tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
