"""examples/zero_train.py under ``torchrun`` at 2 gloo ranks: a Hugging Face GPT-2 trained at ZeRO-3
computes what ZeRO-2 computes (losses and logged weight norms equal), with a lower per-rank peak, and saves a
checkpoint."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # several processes per test: started first (tests/conftest.py)

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(stage: int, save: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), str(ROOT / "examples" / "zero_train.py"), "--zero-stage", str(stage),
         "--steps", "6", "--save", str(save)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def test_zero_train_example_at_stage_3_equals_stage_2_with_less_memory(tmp_path: Path) -> None:
    two, three = (_torchrun(stage, tmp_path / f"ckpt{stage}") for stage in (2, 3))
    assert len(three["losses"]) == 6 and three["losses"][-1] < three["losses"][0]
    assert three["losses"] == two["losses"] and three["wte_norms"] == two["wte_norms"]
    assert max(three["peak_bytes_per_rank"]) < min(two["peak_bytes_per_rank"])
    assert any((tmp_path / "ckpt3").iterdir())  # the sharded checkpoint was written
