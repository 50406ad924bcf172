"""examples/hf_gpt2.py: a Hugging Face GPT-2 trained under memsched (LR schedule, gradient accumulation)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_gpt2.py"


def _load():
    spec = importlib.util.spec_from_file_location("hf_gpt2_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_hf_gpt2_example_loss_goes_down() -> None:
    losses = _load().main(steps=16, accum=2)
    assert len(losses) == 16
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert first > 5.0  # about ln(256) = 5.55 at initialisation
    assert last < first - 0.8, losses
