"""Models built on the meta device ([Note: models built on meta] in memsched/runtime/meta_init.py): attach
makes their parameters in the chunks, the values come after attach, and a parameter never given values is
refused, never trained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import memsched
from memsched.models.gpt import GPT, GPTConfig
from tests._numerics import LR, WD, Reference, assert_same, gpt_batches, gpt_loss, tiny_gpt

ROOT = Path(__file__).resolve().parents[1]


def _meta_tiny_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))


def test_values_loaded_after_attach_train_bit_exact_with_parameters_on_the_host() -> None:
    """Before any values, the forward and the step refuse, naming the parameters; a partial load still names
    the one left; after ``load_state_dict`` the run is torch's fused AdamW's, bit for bit, with a clip that
    triggers and half the chunks' parameters on the host."""
    real = tiny_gpt(0)
    ref = Reference(real)
    model = _meta_tiny_gpt()
    batches = gpt_batches(3)
    with memsched.attach(model, device="sim:64MiB", policy="static", lr=LR, weight_decay=WD,
                         policy_options={"offload_param_frac": 0.5}) as sched:
        assert all(p.device.type != "meta" for p in model.parameters())
        with pytest.raises(ValueError, match=r"never given values \('wte.weight'"):
            gpt_loss(model, batches[0])
        with pytest.raises(ValueError, match="the optimizer step"):
            sched.optimizer.step()
        partial = {k: v for k, v in real.state_dict().items() if k != "ln_f.bias"}
        model.load_state_dict(partial, strict=False)
        with pytest.raises(ValueError, match=r"1 parameter\(s\) .*\('ln_f.bias'\)"):
            gpt_loss(model, batches[0])
        model.load_state_dict(real.state_dict())
        for i, b in enumerate(batches):
            sched.backward(gpt_loss(model, b))
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05) > 0.05
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused():
                ref.step(b, gpt_loss, 0.05)
                assert_same(model, ref, f"step {i}")
        assert sched.plan.param_host_chunks


def test_the_model_s_own_initialisation_gives_values() -> None:
    """``reset_parameters()`` of each module after attach (FSDP2's way) writes through the chunk views; the
    step's masters follow (bf16 compute with fp32 masters)."""
    model = _meta_tiny_gpt()
    with memsched.attach(model, device="sim:64MiB", dtype=torch.bfloat16) as sched:
        torch.manual_seed(0)
        for m in model.modules():
            init = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if init is not None:  # nn.MultiheadAttention's is private
                init()
        b = gpt_batches(1)[0]
        for _ in range(2):
            sched.backward(gpt_loss(model, b))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        masters = [s["master_weight"] for s in sched.optimizer.state_dict()["state"].values()]
        assert all(bool(torch.isfinite(m).all()) for m in masters)
        assert all(bool(torch.isfinite(p.detach().cpu()).all()) for p in model.parameters())


def test_a_meta_buffer_is_refused_and_the_model_left_as_it_was() -> None:
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("inv_freq", torch.ones(4), persistent=False)

        def forward(self, x):
            return self.lin(x) * self.inv_freq.sum()

    with torch.device("meta"):
        model = WithBuffer()
    with pytest.raises(ValueError, match="buffer 'inv_freq' is on the meta device"):
        memsched.attach(model, device="sim:8MiB")
    assert all(p.device.type == "meta" for p in model.parameters())
    model.inv_freq = torch.ones(4)  # made for real, as accelerate.init_empty_weights() does
    with memsched.attach(model, device="sim:8MiB") as sched:
        assert all(p.device.type == "sim" for p in model.parameters())
        with pytest.raises(ValueError, match="'lin.weight', 'lin.bias'"):
            model(torch.ones(2, 8, device="sim"))
        assert sched.store.chunks


_RSS = r"""
import json, sys
import tests._sim_preload  # noqa: F401
import psutil, torch, memsched
from memsched.models.gpt import GPT, GPTConfig

def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))

with memsched.attach(torch.nn.Linear(64, 64), device="sim:1MiB"):  # the runtime's own first-use memory
    pass
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS counts from here
base = psutil.Process().memory_info().rss
with torch.device(sys.argv[1]):
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=512, block_size=64))
sched = memsched.attach(model, device="sim:96MiB", policy="auto", chunk_numel=1 << 22)
print(json.dumps({"peak": hwm() - base, "pinned": sched.host_usage().pinned_bytes,
                  "device": sched.sim.peak_bytes, "chunk": (1 << 22) * 4}))
sched.close()
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak RSS reset")
def test_a_meta_model_is_attached_within_one_chunk_of_its_chunks() -> None:
    """A GPT of 12.8M parameters (51 MB in fp32) built on meta: the process's peak RSS through attach (after
    the runtime's own first-use memory) stays within one chunk of what the chunks hold: pinned host state and
    the stand-in's device buffers, both host memory here. The chunks are built one at a time."""
    out = subprocess.run([sys.executable, "-c", _RSS, "meta"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["peak"] <= r["pinned"] + r["device"] + r["chunk"], r
