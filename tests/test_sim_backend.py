"""The stand-in as a PyTorch device (``tests/sim_backend_cases.py``), run in a process of its own.

Loading the backend registers torch's PrivateUse1 device for the whole process: autograd then starts a device
thread for it (after which fork-based multiprocessing refuses autograd, as the ZeRO tests use), and code that
asks for the current accelerator (``torch.distributed.checkpoint``) finds ``sim``. So its cases run in a child
pytest, and this suite's other tests see a process without it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_the_sim_backend_cases_pass_in_a_process_of_their_own():
    cases = Path(__file__).with_name("sim_backend_cases.py")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                          capture_output=True, text=True, timeout=900, cwd=cases.parent.parent)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
