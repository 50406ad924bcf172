"""examples/zero_train.py at 2 gloo ranks: a Hugging Face GPT-2 trained at ZeRO-3 under ``torchrun`` computes
what ZeRO-2 computes (losses and logged weight norms equal), with a lower per-rank peak, and saves a
checkpoint. The ZeRO-2 run calls the example's ``main`` in ranks of tests/_dist_utils.py (the environment
``torchrun`` gives, forked from a process that imported torch already): a second ``torchrun`` would start
three more interpreters (issue 43).
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist_utils import run_ranks

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


def _example_rank(rank: int, world: int, argv: list[str]) -> dict:
    """The example's ``main(argv)`` in this rank (it initialises the process group from the environment)."""
    spec = importlib.util.spec_from_file_location("zero_train", ROOT / "examples" / "zero_train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(argv)


def test_zero_train_example_at_stage_3_equals_stage_2_with_less_memory(tmp_path: Path) -> None:
    three = _torchrun(3, tmp_path / "ckpt3")
    two, two_on_rank_1 = run_ranks(_example_rank, 2, ["--zero-stage", "2", "--steps", "6"], timeout=300,
                                   pg_timeout_s=None)
    assert two == two_on_rank_1 and two["zero_stage"] == 2
    assert len(three["losses"]) == 6 and three["losses"][-1] < three["losses"][0]
    assert three["losses"] == two["losses"] and three["wte_norms"] == two["wte_norms"]
    assert max(three["peak_bytes_per_rank"]) < min(two["peak_bytes_per_rank"])
    assert any((tmp_path / "ckpt3").iterdir())  # the sharded checkpoint was written
