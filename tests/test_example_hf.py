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
    losses = _load().main(steps=16, accum=2, device="sim:64MiB")  # the stand-in also on a GPU machine
    assert len(losses) == 16
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert first > 5.0  # about ln(256) = 5.55 at initialisation
    assert last < first - 0.8, losses


ACCELERATE_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "accelerate_train.py"


@pytest.mark.slow
def test_accelerate_example_trains() -> None:
    """examples/accelerate_train.py: Accelerate's loop (prepare, accumulate, backward, clip_grad_norm_, LR
    scheduler) around memsched's optimizer, with some optimizer state on the host of the stand-in."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    spec = importlib.util.spec_from_file_location("accelerate_train_example", ACCELERATE_EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        losses = module.main(steps=8, accum=2, device="sim:64MiB")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert len(losses) == 8  # one per optimizer step: Accelerate stepped memsched once per 2 micro-batches
    assert losses[0] > 5.0  # about ln(256) = 5.55 at initialisation
    assert sum(losses[-2:]) / 2 < losses[0] - 0.5, losses
