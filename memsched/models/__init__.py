"""Built-in models: a GPT-style decoder with named size presets (see :mod:`memsched.models.gpt`)."""

from memsched.models.gpt import (
    BYTE_VOCAB,
    GPT,
    GPT2_VOCAB,
    PRESETS,
    GPTConfig,
    build_gpt,
    config_for,
    count_parameters,
    lm_loss,
    sizes,
)

__all__ = ["BYTE_VOCAB", "GPT", "GPT2_VOCAB", "PRESETS", "GPTConfig", "build_gpt", "config_for",
           "count_parameters", "lm_loss", "sizes"]
