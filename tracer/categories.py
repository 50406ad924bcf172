"""Memory categories used by every sample of a trace.

Model data (parameters, buffers, gradients, optimizer states) is what a placement policy can move;
non-model data (activations, temporaries, everything else) is what the device must hold at its peak.
The split follows PatrickStar (arXiv 2108.05818, section 4) and ColossalAI Gemini.
"""

from __future__ import annotations

from enum import Enum


class Category(str, Enum):
    """What a block of memory holds. The string value is the name used in JSON and reports."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"
    TEMPORARY = "temporary"
    OTHER = "other"

    @property
    def is_model_data(self) -> bool:
        return self in MODEL_DATA


MODEL_DATA: frozenset[Category] = frozenset(
    {Category.PARAMETER, Category.BUFFER, Category.GRADIENT, Category.OPTIMIZER_STATE}
)
NON_MODEL_DATA: frozenset[Category] = frozenset({Category.ACTIVATION, Category.TEMPORARY, Category.OTHER})
ALL_CATEGORIES: tuple[Category, ...] = tuple(Category)
