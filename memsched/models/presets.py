"""GPT size presets and their shapes, without torch: the CLI lists them in ``--help`` (which must stay quick)
and :mod:`memsched.models.gpt` builds the models from them."""

from __future__ import annotations

from dataclasses import dataclass, replace

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
