"""A GPT-style decoder-only transformer built from torch's own layers, with named size presets.

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
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

BYTE_VOCAB = 256  # byte-level text (memsched.data)
GPT2_VOCAB = 50257  # the GPT-2 BPE vocabulary


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Attributes:
        n_layer: transformer blocks.
        n_head: attention heads per block (must divide ``n_embd``).
        n_embd: model width.
        vocab_size: token ids are in ``[0, vocab_size)``.
        block_size: longest sequence (size of the position embedding).
        dropout: dropout probability in the blocks (0 for deterministic memory and tests).
    """

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = BYTE_VOCAB
    block_size: int = 1024
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    def num_params(self) -> int:
        """Parameters of the model (tied output projection counted once), from the shapes alone.

        Per block: attention ``4 d^2 + 4 d`` (packed q/k/v + output projection with biases), MLP ``8 d^2 + 5
        d``, two LayerNorms ``4 d``; plus embeddings ``(vocab + block_size) d`` and the final LayerNorm ``2
        d``.
        """
        d = self.n_embd
        return (self.vocab_size + self.block_size) * d + self.n_layer * (12 * d * d + 13 * d) + 2 * d


# Byte-level presets for the demo; the GPT-2 and GPT-3 shapes use the GPT-2 vocabulary. GPT-3's table gives
# 24 heads for the 1.3B model with d_head 128, which does not divide 2048; like most reproductions we use 16.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=256),
    "demo": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=512),
    "small": GPTConfig(n_layer=8, n_head=8, n_embd=512, block_size=1024),
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=GPT2_VOCAB, block_size=1024),
    "gpt2-355m": GPTConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=GPT2_VOCAB, block_size=1024),
    "gpt2-774m": GPTConfig(n_layer=36, n_head=20, n_embd=1280, vocab_size=GPT2_VOCAB, block_size=1024),
    "gpt2-1.5b": GPTConfig(n_layer=48, n_head=25, n_embd=1600, vocab_size=GPT2_VOCAB, block_size=1024),
    "125m": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=GPT2_VOCAB, block_size=2048),
    "350m": GPTConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=GPT2_VOCAB, block_size=2048),
    "760m": GPTConfig(n_layer=24, n_head=16, n_embd=1536, vocab_size=GPT2_VOCAB, block_size=2048),
    "1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, vocab_size=GPT2_VOCAB, block_size=2048),
    "2.7b": GPTConfig(n_layer=32, n_head=32, n_embd=2560, vocab_size=GPT2_VOCAB, block_size=2048),
    "6.7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, vocab_size=GPT2_VOCAB, block_size=2048),
    "13b": GPTConfig(n_layer=40, n_head=40, n_embd=5120, vocab_size=GPT2_VOCAB, block_size=2048),
    "175b": GPTConfig(n_layer=96, n_head=96, n_embd=12288, vocab_size=GPT2_VOCAB, block_size=2048),
}


def sizes() -> list[str]:
    """Names of the size presets, smallest first."""
    return sorted(PRESETS, key=lambda name: PRESETS[name].num_params())


def config_for(size: str, **overrides: int | float) -> GPTConfig:
    """The :class:`GPTConfig` of preset ``size``, with optional field overrides (e.g. ``block_size=2048``).

    Raises:
        ValueError: unknown size (the message lists the known ones) or a bad override value.
        TypeError: an override that is not a GPTConfig field.
    """
    if size not in PRESETS:
        raise ValueError(f"unknown model size {size!r}: known sizes are {', '.join(sizes())}")
    return replace(PRESETS[size], **overrides) if overrides else PRESETS[size]


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
