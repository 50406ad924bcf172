"""examples/llama_bf16.py: the 8B workload's script (built on meta, bf16 with fp32 masters, auto placement,
overlap, host_update="auto", activation checkpointing, a clip), run on a 2-layer Llama on the stand-in."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama_bf16.py"


@pytest.mark.slow
def test_llama_bf16_example_trains_with_chunks_on_the_host(capsys) -> None:
    spec = importlib.util.spec_from_file_location("llama_bf16_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.main(["--steps", "3", "--lr", "1e-3"])
    out = capsys.readouterr().out
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert re.search(r"\d+ chunks \([\d.]+ [KMG]iB of pinned memory\) on the host", out), out
    assert "host_update='auto'" in out  # the plan says where the host chunks are updated, and why
    held, planned = re.search(r"\(([\d.]+) B/param; planned ([\d.]+)\)", out).groups()
    assert held == planned and float(held) > 0
