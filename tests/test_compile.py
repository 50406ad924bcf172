"""torch.compile with memsched, in both orders: warmup runs eagerly (traced), then the model compiles, and
training equals the same compiled model with torch.optim.AdamW(fused=True) whose first step ran eagerly."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import memsched
from tests._numerics import SIM, same, uncounted

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch < 2.6: no stance")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 1))


def _reference_step(ref_compiled, opt, x: torch.Tensor, *, warmup: bool) -> None:
    """The compiled reference's step beside memsched's, uncounted; eager where memsched's warmup step is."""
    with uncounted():
        with torch.compiler.set_stance("force_eager") if warmup else contextlib.nullcontext():
            ref_compiled(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("order", ["attach-then-compile", "compile-then-attach"])
def test_compiles_after_warmup_and_stays_exact(order):
    torch._dynamo.reset()
    counters.clear()
    model = mlp()
    ref = copy.deepcopy(model)
    ref_compiled = torch.compile(ref, backend="aot_eager")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    if order == "compile-then-attach":
        compiled = torch.compile(model, backend="aot_eager")
        sched = memsched.attach(model, device="cpu", lr=1e-3, weight_decay=0.1)
    else:
        sched = memsched.attach(model, device="cpu", lr=1e-3, weight_decay=0.1)
        compiled = torch.compile(model, backend="aot_eager")
    xs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with sched:
        for i, x in enumerate(xs):
            frames_before = counters["frames"]["ok"]
            sched.backward(compiled(x).pow(2).mean())
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            if i == 0:  # the traced warmup step ran eagerly: nothing compiled, nothing given up on
                assert frames_before == counters["frames"]["ok"] == 0
                with torch.compiler.set_stance("force_eager"):
                    ref_compiled(x).pow(2).mean().backward()
            else:
                ref_compiled(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert counters["frames"]["ok"] > 0 and counters["stats"]["unique_graphs"] >= 1
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert same(p, q)
    assert torch._dynamo.eval_frame._stance.stance == "default"  # the stance is restored


def test_close_during_warmup_restores_the_stance():
    sched = memsched.attach(mlp(), device="cpu")
    assert torch._dynamo.eval_frame._stance.stance == "force_eager"
    sched.close()
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_schedulers_whose_warmups_overlap_restore_the_stance_in_any_order():
    """[Note: one stance for every scheduler]: two schedulers in warmup at once, closed in the order they were
    attached (a bench's interleaved runs, bench/link_model.py, left ``force_eager`` for the rest of the
    process), or ending warmup first: the stance from before both comes back once neither holds it."""
    for close_first in ("first", "second"):
        a = memsched.attach(mlp(), device="cpu")
        b = memsched.attach(mlp(), device="cpu")
        assert torch._dynamo.eval_frame._stance.stance == "force_eager"
        first, second = (a, b) if close_first == "first" else (b, a)
        first.close()
        assert torch._dynamo.eval_frame._stance.stance == "force_eager"  # the other is still in warmup
        second.close()
        assert torch._dynamo.eval_frame._stance.stance == "default", close_first
    a = memsched.attach(model := mlp(), device="cpu")
    b = memsched.attach(mlp(), device="cpu")
    with a:  # a's warmup ends in its first step
        a.backward(model(torch.randn(4, 64)).sum())
        a.optimizer.step()
        assert torch._dynamo.eval_frame._stance.stance == "force_eager"  # b is still in warmup
    b.close()
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_steady_state_hooks_cause_no_graph_break():
    """memsched's root hooks (step timeline, dropped-gradient binding) compile to nothing after warmup: no
    graph break, one graph, and the step timeline records the compiled steps as one ``compiled`` phase."""
    torch._dynamo.reset()
    counters.clear()
    model = mlp()
    sched = memsched.attach(model, device="cpu")
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(32, 64)
    with sched:
        for _ in range(4):
            sched.backward(compiled(x).pow(2).mean())
            sched.optimizer.step()
            model.zero_grad()  # set_to_none: the hook that binds dropped gradients is in the graph too
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1
        phases = sched.step_timeline.summaries()[-1]["phases_s"]
        assert phases["compiled"] > 0 and phases["forward"] == phases["backward"] == 0
        explain = torch._dynamo.explain(lambda t: model(t))(x)
        assert explain.graph_break_count == 0 and explain.graph_count == 1


class _Probe:
    base = None

    def begin(self):
        self.base = 0

    def read(self):
        out, self.base = (None if self.base is None else 10), None
        return out


def test_elastic_pre_hook_compiles_to_nothing_when_no_replan_is_needed():
    """The re-planning pre-hook under Dynamo (memsched.planning.elastic): a measured signature within the plan
    in force passes with no graph break and no recompilation; a larger input or a pending out-of-memory error
    runs the eager check (which re-plans) through one graph break."""
    from memsched.planning.elastic import Elastic

    torch._dynamo.reset()
    counters.clear()
    replans = []
    elastic = Elastic(lambda peak, why: replans.append((peak, why)), lambda v: v, _Probe())
    small, big = torch.randn(4, 8), torch.randn(4, 16)
    elastic.before_forward((small,), {})  # warmup: measured only
    elastic.after_step()
    elastic.start(planned_peak=100)
    assert elastic.quiet == (((4, 8),),)

    @torch.compile(backend="eager", fullgraph=True)
    def quiet_step(x):
        elastic.before_forward((x,), {})
        return x * 2

    for _ in range(3):
        quiet_step(small)
        assert elastic._sig == ((4, 8),)  # the hook's bookkeeping ran (replayed after the graph)
        elastic.after_step()
    assert counters["stats"]["unique_graphs"] == 1 and not replans

    @torch.compile(backend="eager")
    def step(x):
        elastic.before_forward((x,), {})
        return x * 2

    step(big)  # exceeds what was seen: the eager check runs, the step goes all-host
    assert replans and replans[-1][0] is None
    assert counters["graph_break"]
    elastic.after_step()  # measured: planned from the measurement
    assert replans[-1][0] == 10 and ((4, 16),) in elastic.quiet


def test_zero_grad_in_the_retry_loop_reports_an_out_of_memory_error():
    """A forward that runs out of memory inside compiled code calls no hook; the retry loop's
    ``optimizer.zero_grad()`` in the ``except`` block tells memsched, so the retry has room."""
    model = mlp()
    sched = memsched.attach(model, device="sim:64MiB")
    x = torch.randn(32, 64).to(SIM)
    with sched:
        for _ in range(2):
            sched.backward(model(x).pow(2).mean())
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        assert not sched.elastic.oom
        try:
            raise torch.OutOfMemoryError("injected, as from a compiled forward")
        except torch.OutOfMemoryError:
            sched.optimizer.zero_grad()
        assert sched.elastic.oom
        sched.backward(model(x).pow(2).mean())  # the retry: a conservative, measured step
        sched.optimizer.step()
    reasons = [h.reason for h in sched.plan_history]
    assert reasons[-2].startswith("out of memory in the last step")
    assert sched.plan_history[-2].plan.placement == ("host", "host")  # the retry ran all-host
    assert reasons[-1].startswith("measured peak")


def _compile_warnings(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, UserWarning) and "torch.compile" in str(w.message)]


@pytest.mark.parametrize("how", ["compiled-module", "model.compile", "compiled-function"])
def test_compiled_code_on_the_stand_in_compiles_after_warmup_and_stays_exact(how):
    """The stand-in is a real device whose capacity its allocator enforces (no dispatch mode after warmup):
    compiled code runs eagerly in the warmup step and compiles from the next, with each scheduler, silently,
    and trains exactly like the same compiled model on the stand-in with torch.optim.AdamW(fused=True)."""
    torch._dynamo.reset()
    counters.clear()
    xs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)).to(SIM) for i in range(4)]
    for _attach in range(2):  # with each scheduler
        model = mlp()
        with uncounted():
            ref = copy.deepcopy(model).to(SIM)
            ref_compiled = torch.compile(ref, backend="aot_eager")
            opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
        sched = memsched.attach(model, device="sim:64MiB", lr=1e-3, weight_decay=0.1)
        if how == "compiled-module":
            compiled = torch.compile(model, backend="aot_eager")
        elif how == "model.compile":
            model.compile(backend="aot_eager")
            compiled = model
        else:
            compiled = torch.compile(lambda t, m=model: m(t), backend="aot_eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with sched:
                for i, x in enumerate(xs):
                    frames_before = counters["frames"]["ok"]
                    sched.backward(compiled(x).pow(2).mean())
                    sched.optimizer.step()
                    sched.optimizer.zero_grad()
                    frames_after = counters["frames"]["ok"]
                    if i == 0:  # the traced warmup step ran eagerly: nothing compiled, nothing given up on
                        assert frames_after == frames_before
                    elif i == 1 and _attach == 0:  # the first step after warmup compiled
                        assert frames_after > frames_before
                    _reference_step(ref_compiled, opt, x, warmup=i == 0)
            compiled(x)  # after close()
        assert not _compile_warnings(caught), [str(w.message) for w in caught]
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert same(p, q)
        assert model[0].weight.device.type == "sim"
    assert counters["frames"]["ok"] > 0 and counters["stats"]["unique_graphs"] >= 1


@pytest.mark.parametrize("device, options", [
    ("cpu", {}), ("sim:64MiB", {}),
    ("sim:64MiB", {"policy": "static", "policy_options": {"offload_param_frac": 0.5}}),  # fetch hooks too
], ids=["cpu", "sim", "sim-params-on-host"])
def test_hooks_iterate_in_their_insertion_order_for_dynamos_guards(device, options):
    """[Note: prepended hooks and Dynamo's guards]: every module's forward pre-hooks, the user's among them,
    iterate in the order they sit in the plain dict (torch 2.11's Dynamo names a hook in its guards by that
    position; compiling on the stand-in failed there with "'H2DWaits' object has no attribute 'oom'")."""
    model = mlp()
    model.register_forward_pre_hook(lambda *_a: None)  # the user's, before attach
    model[0].register_forward_pre_hook(lambda *_a: None)
    sched = memsched.attach(model, device=device, lr=1e-3, **options)
    x = torch.randn(8, 64).to(sched.device.torch_device)
    with sched:
        for _ in range(3):  # warmup's hooks, then the steady state's
            sched.backward(model(x).pow(2).mean())
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            for name, m in model.named_modules():
                assert list(dict.keys(m._forward_pre_hooks)) == list(m._forward_pre_hooks), name
        assert len(model._forward_pre_hooks) > 1  # memsched's hooks went before the user's


@pytest.mark.parametrize("device, compile_it", [("cpu", True), ("sim:64MiB", True), ("sim:64MiB", False)])
def test_no_compile_warning_on_the_cpu_or_the_stand_in(device, compile_it):
    torch._dynamo.reset()
    model = mlp()
    sched = memsched.attach(model, device=device)
    run = torch.compile(model, backend="aot_eager") if compile_it else model
    x = torch.randn(32, 64).to(sched.device.torch_device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sched:
            for _ in range(3):
                sched.backward(run(x).pow(2).mean())
                sched.optimizer.step()
                sched.optimizer.zero_grad()
    assert not _compile_warnings(caught)


@pytest.mark.parametrize("order", ["attach-then-compile", "compile-then-attach"])
def test_the_default_backend_on_the_stand_in_runs_aot_eager_and_says_so_once(order, monkeypatch):
    """[Note: torch.compile's default backend on the stand-in]: ``torch.compile(model)`` (Inductor) on a
    model attached to the stand-in trains past warmup (it died inside Inductor at the first compiled step),
    through ``aot_eager``: exactly like the same model compiled with ``backend="aot_eager"`` beside it, with
    one warning that says so."""
    from memsched.runtime import compile_stance

    monkeypatch.setattr(compile_stance, "_warned", False)  # once per process: this test's process
    torch._dynamo.reset()
    counters.clear()
    model = mlp()
    with uncounted():
        ref = copy.deepcopy(model).to(SIM)
        ref_compiled = torch.compile(ref, backend="aot_eager")
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    if order == "compile-then-attach":
        compiled = torch.compile(model)
        sched = memsched.attach(model, device="sim:64MiB", lr=1e-3, weight_decay=0.1)
    else:
        sched = memsched.attach(model, device="sim:64MiB", lr=1e-3, weight_decay=0.1)
        compiled = torch.compile(model)
    xs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)).to(SIM) for i in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sched:
            for i, x in enumerate(xs):
                frames_before = counters["frames"]["ok"]
                sched.backward(compiled(x).pow(2).mean())
                sched.optimizer.step()
                sched.optimizer.zero_grad()
                if i == 1:  # the first step after warmup compiled
                    assert counters["frames"]["ok"] > frames_before
                _reference_step(ref_compiled, opt, x, warmup=i == 0)
    said = [str(w.message) for w in caught if compile_stance.STAND_IN_COMPILE_WARNING in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert same(p, q)
    assert sched.phase.name != "WARMUP" and model[0].weight.device.type == "sim"


def test_the_default_backend_still_compiles_cpu_graphs_with_inductor(monkeypatch):
    """The stand-in's route leaves graphs on other devices to Inductor."""
    from memsched.runtime import compile_stance

    seen = []
    original = compile_stance._on_the_stand_in
    monkeypatch.setattr(compile_stance, "_on_the_stand_in",
                        lambda inputs, name: seen.append(original(inputs, name)) or seen[-1])
    torch._dynamo.reset()
    fn = torch.compile(lambda t: (t * 2).sum())
    assert fn(torch.ones(3)).item() == 6.0
    assert seen == [False]
