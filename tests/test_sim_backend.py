"""The stand-in as a PyTorch device (``tests/sim_backend_cases.py``), run in a process of its own.

The cases count the stand-in's device and pinned bytes exactly (before and after an allocation): in a child
pytest no other test's leftovers (freed whenever a garbage collection runs) can move those counts. One
process (``-n0``), not pytest-xdist's controller and workers, each of which would import torch again.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_the_sim_backend_cases_pass_in_a_process_of_their_own():
    cases = Path(__file__).with_name("sim_backend_cases.py")
    # -n0: one process, not pytest-xdist's three (addopts' -n auto): each imports torch (issue 43)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", str(cases)],
                          capture_output=True, text=True, timeout=900, cwd=cases.parent.parent)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
