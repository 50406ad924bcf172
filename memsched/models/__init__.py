"""Built-in models: a GPT-style decoder with named size presets (see :mod:`memsched.models.gpt`).

The presets (:mod:`memsched.models.presets`) import without torch, so the CLI can list the sizes in ``--help``
quickly; the model itself (:mod:`memsched.models.gpt`) is imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from memsched.models.presets import BYTE_VOCAB, GPT2_VOCAB, PRESETS, GPTConfig, config_for, sizes

if TYPE_CHECKING:
    from memsched.models.gpt import GPT, build_gpt, count_parameters, lm_loss

_FROM_GPT = ("GPT", "build_gpt", "count_parameters", "lm_loss")  # these need torch

__all__ = ["BYTE_VOCAB", "GPT", "GPT2_VOCAB", "PRESETS", "GPTConfig", "build_gpt", "config_for",
           "count_parameters", "lm_loss", "sizes"]


def __getattr__(name: str) -> Any:
    if name not in _FROM_GPT:
        raise AttributeError(f"module 'memsched.models' has no attribute {name!r}")
    value = getattr(importlib.import_module("memsched.models.gpt"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FROM_GPT))
