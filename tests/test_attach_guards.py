"""What a user may do to a model after attach is followed or refused with a clear error, never silent:
overlapping attaches, parameters converted after attach (memory format, dtype, device, new storage), and
parameter dtypes memsched cannot train exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memsched
from tests._numerics import SIM, same


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(x).mean(dim=(2, 3)))


def step(sched, model, x):
    sched.backward(model(x).pow(2).mean())
    sched.optimizer.step()
    sched.optimizer.zero_grad()


def test_attaching_a_submodule_of_an_attached_model_is_refused():
    model = ConvNet()
    with memsched.attach(model, device="cpu"):
        with pytest.raises(RuntimeError, match=r"parameter '0.weight' is already managed by memsched"):
            memsched.attach(model.body, device="cpu")
    with memsched.attach(model.body, device="cpu"):  # after close() it is free again
        pass


def test_two_models_sharing_a_parameter_cannot_both_be_attached():
    a, b = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4))
    b[0].weight = a.weight
    with memsched.attach(a, device="cpu"):
        with pytest.raises(RuntimeError, match=r"parameter '0.weight' is already managed"):
            memsched.attach(b, device="cpu")


def test_a_failed_attach_leaves_the_parameters_free():
    model = ConvNet()
    with pytest.raises(ValueError):
        memsched.attach(model, device="cpu", lr=-1.0)
    with memsched.attach(model, device="cpu"):
        pass


# A change of memory format alone is followed (tests/test_memory_format.py), not refused. A module conversion
# is refused at the move itself (memsched.runtime.move_guard); a new storage set by hand at the next step.
@pytest.mark.parametrize("change, match, at_once", [
    (lambda m: m.double(), "from torch.float32 to torch.float64", True),
    (lambda m: setattr(m.head.weight, "data", m.head.weight.data.clone()), "got new storage", False),
], ids=["double", "new-storage"])
def test_a_parameter_converted_after_attach_is_refused(change, match, at_once):
    model = ConvNet()
    x = torch.randn(2, 3, 8, 8).to(SIM)
    with memsched.attach(model, device="sim:64MiB") as sched:
        step(sched, model, x)
        with torch.no_grad(), sched.sim.paused():
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            state = sched.optimizer.state_dict()
        with pytest.raises(RuntimeError, match=match):
            change(model)
            assert not at_once
            sched.optimizer.step()
        with sched.sim.paused():  # refused before any write
            after = sched.optimizer.state_dict()
            for n, p in model.named_parameters():
                assert same(p.detach().float(), before[n].float()), n
        for i, st in state["state"].items():
            for k, v in st.items():
                assert same(v, after["state"][i][k])


@pytest.mark.parametrize("convert, dtype", [
    (lambda m: m.double(), torch.float64),
    (lambda m: m.to(torch.float64), torch.float64),
    (lambda m: m.half(), torch.float16),
    (lambda m: m.bfloat16(), torch.bfloat16),
], ids=["double", "to-float64", "half", "bfloat16"])
@pytest.mark.parametrize("device, steps_before", [("sim:64MiB", 0), ("sim:64MiB", 2), ("cpu", 1)])
def test_a_dtype_conversion_after_attach_is_refused_at_the_move(convert, dtype, device, steps_before):
    """Converting the model's dtype after attach is refused by memsched at the conversion itself, naming
    memsched and the fix, before anything converts (autograd would fail with torch's ``grad_dtype`` error);
    close() and re-attach then works."""
    model = ConvNet()
    x = torch.randn(2, 3, 8, 8).to(SIM if device.startswith("sim") else "cpu")
    with memsched.attach(model, device=device) as sched:
        for _ in range(steps_before):
            step(sched, model, x)
        with pytest.raises(RuntimeError, match=rf"from torch.float32 to {dtype}") as e:
            convert(model)
        assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing converted
        step(sched, model, x)  # and training goes on
        message = str(e.value)
        assert "module 'ConvNet'" in message
        assert "dtype= to memsched.attach" in message and "close() the scheduler" in message
        assert ("float64 is not supported" in message) == (dtype == torch.float64)
    model.float()  # the fix the message gives: close, convert (to a supported dtype), attach again
    with memsched.attach(model, device=device) as sched:
        step(sched, model, x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_unsupported_parameter_dtypes_are_refused_at_attach(dtype):
    model = nn.Linear(3, 3).to(dtype)
    with pytest.raises(ValueError, match=f"parameter 'weight' is {dtype}"):
        memsched.attach(model, device="cpu")
    frozen = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).to(dtype).requires_grad_(False))
    with memsched.attach(frozen, device="cpu"):  # frozen parameters of any dtype are left alone
        pass


def test_the_model_can_be_copied_and_saved_during_warmup_and_the_copy_is_not_hooked():
    import copy
    import io
    import pickle

    model = ConvNet()
    x = torch.randn(2, 3, 8, 8).to(SIM)
    with memsched.attach(model, device="sim:64MiB", warmup_steps=2) as sched:
        step(sched, model, x)  # inside warmup: the tracer's hooks are on the model
        ema = copy.deepcopy(model)  # the usual EMA copy
        buf = io.BytesIO()
        torch.save(model, buf)
        pickle.loads(pickle.dumps(model))
        samples = len(sched._tracer.timeline.samples) if sched._tracer.timeline is not None else None
        with torch.no_grad():
            ema(x)  # the copy's hooks are inert: nothing is traced, no H2D wait, no gradient readiness
        after = len(sched._tracer.timeline.samples) if sched._tracer.timeline is not None else None
        assert samples == after
        step(sched, model, x)
        assert sched.plan is not None
        for (n, p), q in zip(model.named_parameters(), ema.parameters(), strict=True):
            assert not same(p.detach(), q.detach()), n  # the original trained on, the copy did not


def test_training_on_another_thread_is_refused():
    import threading

    model = ConvNet()
    x = torch.randn(2, 3, 8, 8).to(SIM)
    errors = []
    with memsched.attach(model, device="sim:64MiB") as sched:
        sched.backward(model(x).pow(2).mean())

        def other():
            try:
                sched.optimizer.step()
            except RuntimeError as e:
                errors.append(str(e))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert errors and "another thread than memsched.attach" in errors[0]
        sched.optimizer.step()  # the attaching thread goes on


def test_messages_name_what_is_wrong():
    model = ConvNet()
    with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\), got None"):
        memsched.attach(model, device="cpu", betas=None)
    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"parameter of shape \(3,\) that is not a parameter of the model"):
        memsched.attach(model, device="cpu", params=[*model.parameters(), stranger])
    with memsched.attach(model, device="cpu") as sched:
        step(sched, model, torch.randn(2, 3, 8, 8))
        sd = sched.optimizer.state_dict()
        sd["state"][0]["step"] = torch.tensor([1.0, 2.0])
        with pytest.raises(ValueError, match="'step' of parameter .* must be a number >= 0"):
            sched.optimizer.load_state_dict(sd)


def test_checkpoints_on_the_stand_in_are_host_memory_and_errors_are_ordinary(tmp_path):
    import memsched.checkpoint as ckpt

    model = ConvNet()
    x = torch.randn(2, 3, 8, 8).to(SIM)
    with memsched.attach(model, device="sim:1MiB") as sched:  # the state alone would not fit twice
        step(sched, model, x)
        ckpt.save(sched, tmp_path / "c")
        ckpt.load(sched, tmp_path / "c")
        with pytest.raises(ckpt.CheckpointError, match="reading checkpoint .*nowhere.* failed"):
            ckpt.load(sched, tmp_path / "nowhere")


def test_exports_follow_the_umask(tmp_path):
    import os

    from tracer.timeline import atomic_write_bytes

    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "a.json", b"{}")
        assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        atomic_write_bytes(tmp_path / "b.json", b"{}")
        assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
