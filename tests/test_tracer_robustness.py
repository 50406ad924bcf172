"""MemoryTracer on awkward models and misuse: checkpointing, repeated calls, odd outputs, frozen and tied
parameters, in-place ops, hook removal, bad input, JSON round trip."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

from tracer import MemoryTimeline, MemoryTracer

F32 = 4
B, D0, D1, D2 = 8, 16, 32, 24


def _train(model: nn.Module, x: torch.Tensor, steps: int = 2, opt: torch.optim.Optimizer | None = None,
           **kw) -> MemoryTimeline:
    opt = opt or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
    with MemoryTracer(model, optimizer=opt, **kw) as t:
        for _ in range(steps):
            out = model(x)
            loss = out.sum() if isinstance(out, torch.Tensor) else sum(o.sum() for o in _tensors(out))
            loss.backward()
            opt.step()
            opt.zero_grad()
    return t.timeline


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return list(out.values())
    if dataclasses.is_dataclass(out):
        return [getattr(out, f.name) for f in dataclasses.fields(out)]
    return list(out)


def _events(tl: MemoryTimeline, step: int = 0) -> Counter:
    return Counter((s.phase, s.module, s.event) for s in tl.samples if s.step == step)


def _assert_balanced(tl: MemoryTimeline) -> None:
    """Every forward/backward pre has its post, per module and step."""
    for step in tl.steps():
        ev = _events(tl, step)
        for (phase, module, event), n in ev.items():
            if event == "pre" and phase in ("forward", "backward"):
                assert ev[(phase, module, "post")] == n, (step, phase, module)


def _assert_no_hooks(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, m
        assert not getattr(m, "_forward_hooks_always_called", {}), m
        assert not m._forward_hooks_with_kwargs and not m._forward_pre_hooks_with_kwargs, m
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None), p.shape
    if opt is not None:
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    from torch.optim import optimizer as optim_module

    assert not optim_module._global_optimizer_pre_hooks and not optim_module._global_optimizer_post_hooks
    assert torch._C._len_torch_dispatch_stack() == 0


class _Block(nn.Module):
    def __init__(self, mode: str | None) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(D1, D2), nn.ReLU(), nn.Linear(D2, D1))
        self.mode = mode

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            return self.inner(h)
        return ckpt.checkpoint(self.inner, h, use_reentrant=self.mode == "reentrant")


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_activation_checkpointing(mode):
    def model(m):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(D0, D1), _Block(m), nn.ReLU())

    x = torch.randn(B, D0)
    plain, checkpointed = _train(model(None), x), _train(model(mode), x)
    _assert_balanced(checkpointed)
    root_post = [s for s in checkpointed.samples if (s.phase, s.module, s.event) == ("forward", "", "post")]
    plain_post = [s for s in plain.samples if (s.phase, s.module, s.event) == ("forward", "", "post")]
    # Inside the checkpointed block only the ReLU output (B x D2) was kept for backward; with checkpointing
    # it is recomputed in backward instead.
    assert plain_post[0].bytes["activation"] - root_post[0].bytes["activation"] == F32 * B * D2
    # Recomputation happens in backward and is reported as such (no forward samples during it).
    assert _events(checkpointed)[("forward", "1.inner.0", "pre")] == 1
    assert max(s.bytes["temporary"] for s in checkpointed.samples if s.phase == "backward") > 0
    assert checkpointed.model_data_bytes() == plain.model_data_bytes()
    assert checkpointed.peak_non_model_bytes() > 0


def test_module_called_several_times_per_step():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(D1, D1)
            self.inp = nn.Linear(D0, D1)

        def forward(self, x):
            return self.shared(torch.relu(self.shared(self.inp(x))))

    tl = _train(Twice(), torch.randn(B, D0))
    _assert_balanced(tl)
    ev = _events(tl, step=1)
    assert ev[("forward", "shared", "pre")] == 2
    assert ev[("backward", "shared", "pre")] == 2 and ev[("backward", "shared", "post")] == 2
    stats = {m.name: m for m in tl.module_stats()}
    assert stats["shared"].calls == 4  # 2 calls x 2 steps
    # The shared weight is counted once; its gradient accumulates from both calls into one buffer.
    p = F32 * (D1 * D1 + D1 + D0 * D1 + D1)
    assert tl.model_data_bytes()["parameter"] == p and tl.model_data_bytes()["gradient"] == p


@dataclasses.dataclass
class _Out:
    a: torch.Tensor
    b: torch.Tensor


class _Odd(nn.Module):
    """Submodules return a tuple, a dict and a dataclass; the first input needs no grad."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(D0, D1)
        self.lin2 = nn.Linear(D0, D1)

    def forward(self, x):
        a, b = self.lin(x), self.lin2(x)
        if self.kind == "tuple":
            return a, b
        if self.kind == "dict":
            return {"a": a, "b": b}
        return _Out(a, b)


@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass"])
def test_tuple_dict_dataclass_outputs_and_inputs_without_grad(kind):
    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.odd = _Odd(kind)
            self.head = nn.Linear(D1, 1)

        def forward(self, x):
            out = self.odd(x)
            a, b = _tensors(out)
            return self.head(a * b)

    tl = _train(Wrap(), torch.randn(B, D0))
    _assert_balanced(tl)
    ev = _events(tl)
    for name in ("", "odd", "odd.lin", "odd.lin2", "head"):
        assert ev[("backward", name, "pre")] == 1, name
    # Backward of "odd" begins before that of its submodules and ends after them.
    bw = [(s.module, s.event) for s in tl.samples if s.phase == "backward" and s.step == 0]
    assert bw.index(("odd", "pre")) < bw.index(("odd.lin", "pre"))
    assert bw.index(("odd", "post")) > bw.index(("odd.lin", "post"))


def test_frozen_parameters_have_no_gradients_or_states():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D0, D1), nn.ReLU(), nn.Linear(D1, D2))
    model[0].requires_grad_(False)
    tl = _train(model, torch.randn(B, D0))
    _assert_balanced(tl)
    trainable = F32 * (D1 * D2 + D2)
    md = tl.model_data_bytes()
    assert md["parameter"] == F32 * (D0 * D1 + D1) + trainable
    assert md["gradient"] == trainable
    assert md["optimizer_state"] == 2 * trainable + F32 * 2  # exp_avg, exp_avg_sq and a step per tensor


def test_tied_parameters_are_counted_once():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, D1)
            self.out = nn.Linear(D1, 50, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, ids):
            return self.out(torch.relu(self.emb(ids)))

    ids = torch.randint(0, 50, (B, 4))
    tl = _train(Tied(), ids)
    _assert_balanced(tl)
    md = tl.model_data_bytes()
    assert md["parameter"] == F32 * 50 * D1
    assert md["gradient"] == F32 * 50 * D1
    assert md["optimizer_state"] == 2 * F32 * 50 * D1 + F32


def test_in_place_ops_and_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D0, D1), nn.ReLU(inplace=True), nn.BatchNorm1d(D1), nn.Linear(D1, D2))
    tl = _train(model, torch.randn(B, D0), steps=1)
    _assert_balanced(tl)
    ev = {(s.module, s.event): s for s in tl.samples if s.phase == "forward"}
    # ReLU(inplace=True) writes into the Linear output: no new storage.
    assert ev[("1", "post")].bytes["activation"] == ev[("1", "pre")].bytes["activation"] == F32 * B * D1
    # BatchNorm buffers: running_mean, running_var (float32), num_batches_tracked (int64), updated in place.
    assert tl.model_data_bytes()["buffer"] == 2 * F32 * D1 + 8


def test_hooks_removed_on_exit_and_on_exception_and_training_is_untraced_afterwards():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D0, D1), nn.ReLU(), nn.Linear(D1, D2))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(B, D0)
    tracer = MemoryTracer(model, optimizer=opt)
    with tracer:
        model(x).sum().backward()
        opt.step()
    n = len(tracer.timeline.samples)
    _assert_no_hooks(model, opt)
    model(x).sum().backward()
    opt.step()
    assert len(tracer.timeline.samples) == n  # nothing recorded after exit

    with pytest.raises(RuntimeError, match="boom"), MemoryTracer(model) as t2:
        model(x).sum().backward()
        raise RuntimeError("boom")
    _assert_no_hooks(model)
    assert t2.timeline.samples  # what was recorded before the error is kept
    # The model can be traced again after an exception.
    with MemoryTracer(model) as t3:
        model(x).sum().backward()
    assert t3.timeline.peak_non_model_bytes() > 0


def test_exception_inside_forward_removes_everything():
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D0, D1)

        def forward(self, x):
            self.lin(x)
            raise ValueError("bad forward")

    model = Bad()
    with pytest.raises(ValueError, match="bad forward"), MemoryTracer(model):
        model(torch.randn(B, D0))
    _assert_no_hooks(model)


def test_bad_input():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="expected torch.nn.Module, got int"):
        MemoryTracer(3)
    with pytest.raises(ValueError, match="unknown backend 'gpu': expected one of 'auto', 'tensor', 'cuda'"):
        MemoryTracer(model, backend="gpu")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None, got list"):
        MemoryTracer(model, optimizer=[])
    with pytest.raises(ValueError, match="invalid device 'gpu0'"):
        MemoryTracer(model, device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend 'cuda' needs a real CUDA device.*cpu"):
            MemoryTracer(model, backend="cuda")
    with MemoryTracer(model) as t:
        nested = MemoryTracer(model)
        with pytest.raises(RuntimeError, match="already attached to this model \\(Linear\\)"), nested:
            pass
        with pytest.raises(RuntimeError, match="already active"), t:
            pass
        with pytest.raises(TypeError, match="mark name must be a str"):
            t.mark(1)
    with pytest.raises(RuntimeError, match="inside the with block"):
        t.mark("late")
    _assert_no_hooks(model)


def test_mark_global_optimizer_discovery_and_other_models():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D0, D1), nn.ReLU(), nn.Linear(D1, D2))
    other = nn.Linear(D0, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    x = torch.randn(B, D0)
    with MemoryTracer(model) as t:  # no optimizer given: discovered through the global hooks
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            other(x).sum().backward()  # another model: its modules and optimizer are not recorded
            other_opt.step()
            t.mark("after other")
    tl = t.timeline
    assert {s.module for s in tl.samples} == {"", "0", "1", "2", "SGD", "after other", "exit"}
    assert [s.step for s in tl.samples if s.phase == "optimizer"] == [0, 0, 1, 1]
    assert tl.meta["steps"] == tl.meta["optimizer_steps"] == 2
    assert tl.meta["optimizer_discovery"] == "global hooks"
    _assert_no_hooks(model, opt)


def test_steps_without_an_optimizer_end_at_the_next_forward_after_a_backward():
    model = nn.Linear(D0, D1)
    x = torch.randn(B, D0)
    with MemoryTracer(model) as t:
        for _ in range(3):
            model(x).sum().backward()
    assert t.timeline.steps() == [0, 1, 2]
    assert t.timeline.meta["steps"] == 3 and t.timeline.meta["optimizer_steps"] == 0


def test_json_round_trip_of_a_real_trace(tmp_path):
    torch.manual_seed(0)
    tl = _train(nn.Sequential(nn.Linear(D0, D1), nn.ReLU(), nn.Linear(D1, D2)), torch.randn(B, D0))
    assert tl.meta["device"] == "cpu" and tl.meta["backend"] == "tensor" and tl.meta["fake"] is False
    assert tl.meta["torch_version"] == torch.__version__ and tl.meta["steps"] == 2
    path = tmp_path / "trace.json"
    tl.save(path)
    back = MemoryTimeline.load(path)
    assert back == tl
    assert back.summary() == tl.summary()
    assert back.module_stats() == tl.module_stats()


def test_one_sample_per_device_per_hook_with_the_traced_device_first():
    class TwoDevices(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D0, D1)

        def forward(self, x):
            self.scratch = torch.empty(1000, device="meta")  # 4000 B on another device (4096 in blocks), kept
            return self.lin(x)

    model = TwoDevices()
    with MemoryTracer(model) as t:
        model(torch.randn(B, D0)).sum().backward()
    tl = t.timeline
    assert tl.devices() == ["cpu", "meta"]
    assert [s.device for s in tl.samples[:2]] == ["cpu", "cpu"]  # nothing on meta yet
    pairs = {(s.phase, s.module, s.event): [] for s in tl.samples}
    for s in tl.samples:
        pairs[(s.phase, s.module, s.event)].append(s.device)
    assert pairs[("forward", "lin", "post")] == ["cpu", "meta"]
    assert tl.peak_non_model_bytes("meta") == 4096  # 512 B blocks off the CPU, as on CUDA
    assert tl.peak_non_model_bytes() == tl.peak_non_model_bytes("cpu") > 0
