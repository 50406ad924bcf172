"""The end-of-warmup re-pack needs the device memory of the new chunks only, and puts everything back when it
cannot get it (issue: the repack held the old and new chunk buffers at once, and an out-of-memory error left
parameters in staging tensors and the store empty)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import memsched
from memsched.devices.simdevice import SimOutOfMemoryError
from tests._numerics import LR, WD, Reference, assert_same, gpt_batches, gpt_loss, tiny_gpt, to_dev, uncounted

# small activations: the chunk buffers dominate the device memory; made on the host at import (a CUDA session
# does not load the stand-in, tests/conftest.py) and moved where a test runs
BATCHES = gpt_batches(4, batch=1, seq=4, device="cpu")


def reference_steps(model, dtype: torch.dtype) -> list[Reference]:
    """The reference after each step over BATCHES, computed before the scheduler's run (its backward runs on
    autograd's device thread, which ``uncounted()`` does not reach: it would count against the tight
    capacities here); the copies are not counted."""
    ref, out = Reference(model, dtype), []
    for b in BATCHES:
        ref.step(b, gpt_loss, None)
        with uncounted():
            out.append(copy.deepcopy(ref))
    return out


def train(device: str, dtype: torch.dtype, refs: list[Reference] | None = None, model=None,
          fail_repack: bool = False):
    model = model or tiny_gpt()
    with memsched.attach(model, policy="cpu", device=device, chunk_numel=8192, dtype=dtype, lr=LR,
                         weight_decay=WD) as sched:
        if fail_repack:
            real, calls = sched.store.alloc.device_zeros, []

            def flaky(numel, dt):  # the 3rd device buffer of the re-pack fails
                calls.append(numel)
                if len(calls) == 3:
                    raise SimOutOfMemoryError(numel * dt.itemsize, 0, 1, "a test allocation")
                return real(numel, dt)

        for i, b in enumerate(to_dev(BATCHES)):
            sched.backward(gpt_loss(model, b))
            if fail_repack and i == 0:
                sched.store.alloc.device_zeros = flaky
                with pytest.warns(RuntimeWarning, match="re-packing the chunks .* ran out of memory"):
                    sched.optimizer.step()
                sched.store.alloc.device_zeros = real
                assert len(calls) > 3 and sched.plan is not None  # failed at the 3rd, then the old packing
            else:
                sched.optimizer.step()
            sched.optimizer.zero_grad()
            if i == 0:
                sched.sim.reset_peak()  # steady state from here
            if refs is not None:
                with sched.sim.paused():
                    assert_same(model, refs[i], f"step {i}", sched.optimizer)
        return sched.sim.peak_bytes, sched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repack_fits_just_above_the_steady_state_peak(dtype):
    peak = train("sim:64MiB", dtype)[0]
    gc.collect()  # the first run's model (on the device after close) is gone: not counted in the second
    model = tiny_gpt()
    _, sched = train(f"sim:{int(peak * 1.15)}B", dtype, reference_steps(model, dtype), model)
    assert sched.plan is not None and sched.store.chunks[0].params[0] is model.wte.weight  # re-packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repack_out_of_memory_restores_the_old_packing(dtype):
    model = tiny_gpt()
    refs = reference_steps(model, dtype)
    order = [n for n, _ in model.named_parameters()]
    _, sched = train("sim:64MiB", dtype, refs, model, fail_repack=True)
    names = {id(p): n for n, p in model.named_parameters()}
    packed = [names[id(p)] for c in sched.store.chunks for p in c.params]
    assert packed == order  # the registration-order packing stayed
    for c in sched.store.chunks:  # and the parameters are views into it again
        for p, (off, n) in zip(c.params, c.ranges, strict=True):
            assert p.data_ptr() == c.data[off:off + n].data_ptr()
