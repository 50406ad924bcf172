"""The stand-in in any load order ([Note: a backward on the stand-in, in any load order] in
``memsched/devices/sim_backend.py``): torch's autograd makes its device queues at the process's first
backward, so each case runs in a fresh process of its own.

- a plain CPU backward before memsched is imported, then ``memsched.attach(..., device="sim:...")``: the
  stand-in's backward runs on the calling thread, and training equals a CPU torch reference bit for bit;
- ``import memsched``, then torch and a backward, then attach: the same;
- torch, then ``import memsched``, then a backward: memsched reserved the stand-in's queue at import, the
  accelerator stays unnamed until the stand-in loads, and its backward runs on autograd's device thread;
- plain CPU training (fused AdamW, clipping, autocast to bf16, a pinning DataLoader) after the stand-in is
  loaded equals the same training in a process that never loaded it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a process of its own per test: started first (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent

_PLAIN_BACKWARD = """
import torch
_x = torch.ones(3, requires_grad=True)
(_x * 2).sum().backward()
assert _x.grad.tolist() == [2.0, 2.0, 2.0]
"""

_PRELUDES = {
    "backward-then-import-memsched": "import torch\n" + _PLAIN_BACKWARD + "import memsched\n",
    "import-memsched-then-backward": "import memsched\n" + _PLAIN_BACKWARD,
    "torch-memsched-then-backward": "import torch\nimport memsched\n" + _PLAIN_BACKWARD,
}

# Trains a model with memsched on the stand-in (bit for bit against plain fused AdamW on the CPU), on the
# thread given, then runs a plain backward on the stand-in from the main thread too. (No attention: the
# stand-in runs scaled_dot_product_attention's math path, not the CPU's flash kernel.)
_TRAIN = """
import threading
import torch
from torch import nn
from memsched.devices import sim_backend
from tests._numerics import LR, WD, Reference, assert_same

reserved = sim_backend._reserved
accelerator_before = (torch.accelerator.current_accelerator()
                      if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "current_accelerator")
                      else None)
errors = []

def loss_fn(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()

def train():
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(32, 16), nn.Flatten(), nn.Linear(64, 64), nn.GELU(),
                              nn.LayerNorm(64), nn.Linear(64, 4))
        ref = Reference(model, device="cpu")
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, 32, (8, 4), generator=g), torch.randn(8, 4, generator=g))
                   for _ in range(5)]
        with memsched.attach(model, lr=LR, weight_decay=WD, device="sim:64MiB") as sched:
            for i, (x, y) in enumerate(batches):
                sched.backward(loss_fn(model, (x.to("sim"), y.to("sim"))))
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                sched.optimizer.step()
                sched.optimizer.zero_grad()
                with sched.sim.paused():
                    ref.step((x, y), loss_fn, 0.05)
                    assert_same(model, ref, f"step {i}")
        assert model[0].weight.device.type == "sim"
    except BaseException as e:  # reported by the main thread
        errors.append(e)

if THREAD:
    t = threading.Thread(target=train)
    t.start()
    t.join()
else:
    train()
if errors:
    raise errors[0]
y = torch.ones(2, device="sim", requires_grad=True)
(y * 3).sum().backward()
assert y.grad.cpu().tolist() == [3.0, 3.0]
print("RESULT", reserved, accelerator_before, sim_backend.backward_on_caller_threads())
"""


def _run(code: str, *args: str) -> str:
    """Run ``code`` in a fresh Python process (``args`` its ``sys.argv[1:]``); its stdout."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return done.stdout


def _result(out: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return line.split()[1:]


@pytest.mark.parametrize("thread", [False, True], ids=["main-thread", "training-thread"])
@pytest.mark.parametrize("order", ["backward-then-import-memsched", "import-memsched-then-backward"])
def test_a_backward_before_the_stand_in_loads_then_training_on_it_is_exact(order, thread):
    """The first backward ran before memsched could reserve the stand-in's queue: its backward runs on the
    thread that calls it, the loading thread or a training thread of the user's."""
    out = _run(textwrap.dedent(_PRELUDES[order]) + f"THREAD = {thread}\n" + _TRAIN)
    _reserved, _accelerator, on_caller = _result(out)
    assert on_caller == "True"


def test_memsched_imported_with_torch_reserves_the_stand_ins_autograd_queue():
    import torch

    if not hasattr(getattr(torch._C, "_acc", None), "register_python_privateuseone_device_guard"):
        pytest.skip("this torch cannot register a placeholder device guard (torch._C._acc)")
    if torch.cuda.device_count() > 0:
        pytest.skip("CUDA's device guard makes the queue for device index 0 already")
    out = _run(_PRELUDES["torch-memsched-then-backward"] + "THREAD = False\n" + _TRAIN)
    reserved, accelerator, on_caller = _result(out)
    # the placeholder named no accelerator, and the stand-in's backward ran on autograd's device thread
    assert (reserved, accelerator, on_caller) == ("True", "None", "False")


_PLAIN_CPU_TRAINING = """
import hashlib
import sys
import warnings
import torch
from torch import nn

if sys.argv[1] == "load":
    from memsched.devices import sim_backend
    sim_backend.load()
    assert torch.accelerator.current_accelerator().type == "sim"
warnings.simplefilter("ignore")  # the DataLoader's warning that nothing pins without an accelerator
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
pinned = []
for x, y in torch.utils.data.DataLoader(data, batch_size=8, pin_memory=True):
    pinned.append(x.is_pinned())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = (model(x).float() - y).pow(2).mean()
    loss.backward()
    assert model[0].weight.grad.device.type == "cpu"
    nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    opt.zero_grad()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print("RESULT", digest, all(pinned), any(pinned))
"""


def test_plain_cpu_training_after_the_stand_in_is_loaded_is_unchanged():
    """With the stand-in loaded torch names it the accelerator, so the DataLoader pins through its pinned
    memory; the CPU training itself is what it is in a process without the stand-in, bit for bit."""
    import torch

    with_sim = _result(_run(_PLAIN_CPU_TRAINING, "load"))
    without = _result(_run(_PLAIN_CPU_TRAINING, "plain"))
    assert with_sim[0] == without[0]
    assert with_sim[1:] == ["True", "True"]  # every batch pinned (the stand-in's pinned host memory)
    if not torch.cuda.is_available():
        assert without[1:] == ["False", "False"]  # no accelerator: nothing pinned

