"""Issue 30 at runtime: the step the plan predicts is the roofline of ``memsched plan`` (not the traced
warmup) on a known GPU, shown beside the measured step; and the runtime plan is checked against
``memsched plan``'s (``attach(expected_plan=...)``)."""

from __future__ import annotations

import contextlib
import io
import json
import warnings

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import memsched
from memsched.cli.main import main
from memsched.devices.gpus import get_gpu
from memsched.devices.spec import parse_device
from memsched.planning.plan_check import check_plan, load_expected_plan
from memsched.planning.prediction import gpt_workload
from memsched.planning.step_model import EFFICIENCY
from memsched.report.text import render_report
from tests._numerics import SIM
from tracer import MemoryTracer

PRESET, BATCH, SEQ = "tiny", 2, 64
CAPACITY = "3584KiB"  # auto keeps 4 of the 10 chunks' optimizer state on the device, 6 on the host


def test_the_tracer_counts_flops_as_torch_counts_them() -> None:
    """``meta["flops"]``: torch's FLOP formulas over every traced op (here 3 matrix products of 2·16·8·4)."""
    lin = nn.Linear(8, 4, bias=False)
    x = torch.randn(16, 8, requires_grad=True)
    with MemoryTracer(lin) as t:
        lin(x).sum().backward()
    assert t.timeline.meta["flops"] == 3 * 2 * 16 * 8 * 4
    model, loss_fn = _workload(torch.device("cpu"))
    with MemoryTracer(model) as t:
        loss_fn(model).backward()
    with FlopCounterMode(display=False) as counted:
        loss_fn(model).backward()
    assert t.timeline.meta["flops"] == counted.get_total_flops() > 0


def test_the_stand_in_names_the_gpu_it_stands_for() -> None:
    assert parse_device("sim:8MiB,gpu=H200").gpu == "h200"
    assert parse_device("sim:8MiB").gpu is None
    with pytest.raises(ValueError, match=r"unknown GPU 'b300'.*h200"):
        parse_device("sim:8MiB,gpu=b300")


def _workload(device: torch.device):
    w = gpt_workload(PRESET, BATCH, SEQ)(device)
    return w.model, w.loss_fn


def _train(device: str, steps: int = 3, **kw) -> memsched.Scheduler:
    model, loss_fn = _workload(SIM)
    sched = memsched.attach(model, device=device, **kw)
    for _ in range(steps):
        sched.backward(loss_fn(model))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
    return sched


@pytest.mark.parametrize("overlap", [False, True])
def test_on_a_known_gpu_the_predicted_step_is_the_roofline_beside_the_measured_in_the_report(overlap):
    with _train(f"sim:{CAPACITY},gpu=h200", policy="cpu", overlap=overlap) as sched:
        p = sched.predicted_step
        assert p["model"] == "roofline" and p["gpu"] == "h200" and p["overlap"] is overlap
        model, loss_fn = _workload(SIM)  # the stand-in's kernels (attention: the math path)
        with FlopCounterMode(display=False) as counted:
            loss_fn(model).backward()
        assert p["flops"] == counted.get_total_flops()  # one step's, not the warmup's sum
        gpu = get_gpu("h200")
        assert p["compute_s"] == pytest.approx(p["flops"] / (gpu.fp32_flops * EFFICIENCY[torch.float32]))
        elements = sum(c.hi - c.lo for c in sched.store.chunks)  # policy cpu: every chunk on the host
        assert p["host_elements"] == elements
        assert p["cpu_update_s"] == pytest.approx(elements / sched.warmup_costs.cpu_elements_per_s)
        hidden = p["compute_s"] / 3 if overlap else 0.0
        assert p["step_s"] == pytest.approx(p["compute_s"] + max(0.0, p["cpu_update_s"] - hidden))
        assert any("on h200" in r and "TFLOP" in r for r in sched.plan.reasons)
        out = io.StringIO()
        from rich.console import Console

        render_report(sched.timeline, console=Console(file=out, width=140), **_report_kwargs(sched))
        text = out.getvalue()
        assert "predicted step (roofline on h200)" in text and "measured / predicted step" in text


def _report_kwargs(sched: memsched.Scheduler) -> dict:
    return {"plan": sched.plan, "step_summary": sched.step_timeline.mean_summary(),
            "predicted_step": sched.predicted_step, "plan_check": sched.plan_check}


def test_without_a_known_gpu_the_prediction_says_it_comes_from_the_warmup() -> None:
    with _train(f"sim:{CAPACITY}", policy="cpu") as sched:
        assert sched.predicted_step["model"] == "warmup"
        out = io.StringIO()
        from rich.console import Console

        sched.report(console=Console(file=out, width=140))
        assert "predicted step (from the traced warmup step)" in out.getvalue()


def _cli_plan(*extra: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "--model", PRESET, "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--capacity",
                   CAPACITY, "--attention", "math", "--no-largest-preset", "--json", *extra])
    assert rc == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def cli_plan() -> dict:
    return _cli_plan()


@pytest.mark.parametrize("policy", ["auto", "cpu"])
def test_the_runtime_plan_agrees_with_memsched_plan(cli_plan, policy, tmp_path) -> None:
    """The same workload: ``memsched plan``'s fake trace and the stand-in's warmup make the same plan."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(cli_plan))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "differs" warning
        with _train(f"sim:{CAPACITY}", steps=2, policy=policy, expected_plan=str(path)) as sched:
            check = sched.plan_check
            assert check is not None and check.agrees, check.summary()
            on_host, n = len(sched.plan.host_chunks), len(sched.store.chunks)
            assert 0 < on_host < n if policy == "auto" else on_host == n
            assert {r[0] for r in check.rows} >= {"device capacity", "peak non-model data", "chunks",
                                                  "optimizer state and gradients", "parameters"}
            out = io.StringIO()
            from rich.console import Console

            sched.report(console=Console(file=out, width=160))
            assert "Plan check" in out.getvalue() and "they agree" in out.getvalue()


def test_a_plan_for_another_capacity_and_batch_differs_and_says_why(tmp_path) -> None:
    other = _cli_plan()
    other["capacity_bytes"] *= 2
    other["trace"]["peak_non_model_bytes"] = int(other["trace"]["peak_non_model_bytes"] * 0.8)
    with pytest.warns(RuntimeWarning, match="differs from memsched plan's"):
        sched = _train(f"sim:{CAPACITY}", steps=2, policy="cpu", expected_plan=other)
    with sched:
        text = " | ".join(sched.plan_check.differences)
        assert "made for a capacity of 7.0 MiB, this device has 3.5 MiB" in text
        predicted = other["trace"]["peak_non_model_bytes"]
        rel = (sched.peak_non_model_bytes() - predicted) / predicted
        assert rel > 0.2 and f"is {rel:+.2%} off the prediction" in text


def test_a_bad_expected_plan_is_refused_at_attach(tmp_path) -> None:
    model, _ = _workload(SIM)
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        memsched.attach(model, device=f"sim:{CAPACITY}", expected_plan=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="schema 'memsched.plan'.*got 'memsched.plan_sweep'"):
        memsched.attach(model, device=f"sim:{CAPACITY}", expected_plan={"schema": "memsched.plan_sweep"})
    assert not any(type(p.data) is not torch.Tensor for p in model.parameters())


def test_check_plan_names_a_placement_difference(cli_plan) -> None:
    """The comparison itself: a runtime plan with one chunk more on the host than the CLI's."""
    from policies.types import HOST, PlacementPlan

    cli = cli_plan["plans"]["auto"]
    placement = list(cli["placement"])
    placement[0] = HOST if placement[0] != HOST else "device"
    plan = PlacementPlan("auto", tuple(placement), 0, 0, cli["margin_bytes"], 0)
    check = check_plan(load_expected_plan(cli_plan), plan, capacity_bytes=cli_plan["capacity_bytes"],
                       peak_non_model_bytes=cli_plan["trace"]["peak_non_model_bytes"],
                       chunk_numel=cli_plan["chunks"]["numel"], chunk_count=cli_plan["chunks"]["count"],
                       total_numel=cli_plan["chunks"]["total_numel"])
    assert not check.agrees
    assert len(check.differences) == 1 and check.differences[0].startswith("optimizer state and gradients")


def test_the_fake_trace_predicts_the_peak_where_a_tied_embedding_sums_its_gradients() -> None:
    """[Note: gradients land in chunks] (:mod:`memsched.planning.prediction`): a GPT whose tied embedding is
    most of it peaks at the end of backward, where autograd sums the head's and the embedding's gradients
    into a third tensor. memsched adds that sum into the chunk's gradient buffer, so it is non-model data
    there; a plain backward keeps it as ``.grad``. The prediction (fake tensors, as ``memsched plan``) equals
    the stand-in's measured warmup peak; a plain trace misses one embedding-sized tensor."""
    from memsched.planning.prediction import trace_step
    from memsched.target import Workload

    def build(device: torch.device) -> Workload:
        torch.manual_seed(0)
        from memsched.models import build_gpt, lm_loss

        model = build_gpt("tiny", device=device, vocab_size=8192)

        def loss_fn(m: nn.Module) -> torch.Tensor:
            tokens = torch.randint(0, 8192, (1, 17), device=device)
            return lm_loss(m, tokens[:, :-1], tokens[:, 1:])
        return Workload(model, loss_fn)

    predicted = trace_step(build, fake=True, device=SIM)
    assert predicted.timeline.peak_non_model_sample().module == "wte"
    work = build(SIM)
    with memsched.attach(work.model, policy="cpu", device="sim:64MiB") as sched:
        sched.backward(work.loss_fn(work.model))
        sched.optimizer.step()
        measured = sched.peak_non_model_bytes()
    assert predicted.peak_non_model_bytes == measured
    plain = build(SIM)
    with MemoryTracer(plain.model, device=str(SIM)) as t:
        plain.loss_fn(plain.model).backward()
    wte = 8192 * 64 * 4  # a plain trace counts the sum as a gradient (and small ones stored beside it)
    assert wte - 8 * 1024 <= measured - t.timeline.peak_non_model_bytes() <= wte
