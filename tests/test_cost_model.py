"""memsched.planning.cost_model: the predicted step of a plan from the warmup step's record."""

from __future__ import annotations

import pytest

import memsched
from memsched.planning.cost_model import WarmupCosts
from memsched.telemetry.step_timeline import CPU_UPDATE, MAIN, Span, StepRecord
from tests._numerics import LR, WD, gpt_batches, gpt_loss, tiny_gpt


def test_prediction_from_a_record():
    spans = (Span(MAIN, "forward", 0.0, 0.010), Span(MAIN, "backward", 0.010, 0.040),
             Span(CPU_UPDATE, "update", 0.041, 0.051), Span(CPU_UPDATE, "h2d", 0.051, 0.052))
    costs = WarmupCosts.from_record(StepRecord(1, 0.0, 0.06, spans, False), host_elements=1_000_000)
    assert costs.cpu_elements_per_s == pytest.approx(1e8)
    serial = costs.predict(500_000, overlap=False)
    assert serial["cpu_update_s"] == pytest.approx(0.005) and serial["step_s"] == pytest.approx(0.045)
    overlapped = costs.predict(2_000_000, overlap=True)  # 20 ms of update, 10 ms of it hidden by the forward
    assert overlapped["exposed_cpu_s"] == pytest.approx(0.010) and overlapped["step_s"] == pytest.approx(0.05)
    assert costs.predict(0, overlap=False)["step_s"] == pytest.approx(0.040)
    text = costs.reason(500_000, 3, overlap=False)
    assert "Predicted step 45.0 ms (serial CPU update)" in text and "3 host chunks 5.0 ms at 100 M" in text


@pytest.mark.parametrize("overlap", [False, True])
def test_the_plan_carries_its_predicted_step(overlap):
    model = tiny_gpt()
    with memsched.attach(model, policy="static", policy_options={"offload_optim_frac": 0.5},
                         device="sim:64MiB", lr=LR, weight_decay=WD, chunk_numel=8192,
                         overlap=overlap) as sched:
        sched.backward(gpt_loss(model, gpt_batches(1)[0]))
        sched.optimizer.step()
        assert sched.warmup_costs is not None and sched.warmup_costs.cpu_elements_per_s > 0
        assert sched.predicted_step["overlap"] is overlap and sched.predicted_step["cpu_update_s"] > 0
        assert sched.plan.reasons[-2].startswith("Predicted step")
        modes = sched.plan.reasons[-1]
        assert modes.startswith("Overlap modes, predicted from the warmup step: serial ")
        assert f"In force: {'overlap=True' if overlap else 'serial'}" in modes
        # the host chunks' own fp32 gradients: what overlap=True adds, unless it is in force
        assert ("of host memory)" in modes.split("overlap='backward'")[0]) == (not overlap)
        assert not sched.step_timeline.records  # the warmup step is the model's input, not a record


def test_exposed_update_of_each_mode():
    """One formula for both models: serial waits for the CPU and the stream at once; overlap=True hides the
    CPU behind the stream's wait and the next forward; "backward" hides the speculating chunks' update behind
    backward first."""
    from memsched.planning.step_model import exposed_update

    assert exposed_update(0.030, 0.010, 0.020, False) == pytest.approx(0.030)
    assert exposed_update(0.030, 0.010, 0.020, False, link_s=0.050) == pytest.approx(0.050)
    assert exposed_update(0.030, 0.010, 0.020, True) == pytest.approx(0.020)
    assert exposed_update(0.030, 0.010, 0.020, True, link_s=0.005) == pytest.approx(0.005 + 0.015)
    # 25 ms speculate: 20 ms hidden by backward, 5 + 5 ms left for the 10 ms forward
    assert exposed_update(0.030, 0.010, 0.020, "backward", speculative_s=0.025) == pytest.approx(0.0)
    # 5 ms speculate: 25 ms left, 10 hidden by the forward
    assert exposed_update(0.030, 0.010, 0.020, "backward", speculative_s=0.005) == pytest.approx(0.015)
    assert exposed_update(0.030, 0.010, 0.020, "backward") == pytest.approx(0.020)  # none speculates
    with pytest.raises(ValueError, match="speculative_s <= cpu_s"):
        exposed_update(0.010, 0.010, 0.020, "backward", speculative_s=0.020)
    with pytest.raises(ValueError, match="overlap must be False, True or 'backward', got 'both'"):
        exposed_update(0.010, 0.010, 0.020, "both")


def test_the_warmup_model_counts_speculating_and_streamed_chunks():
    spans = (Span(MAIN, "forward", 0.0, 0.010), Span(MAIN, "backward", 0.010, 0.030),
             Span(CPU_UPDATE, "update", 0.031, 0.041))
    costs = WarmupCosts.from_record(StepRecord(1, 0.0, 0.05, spans, False), host_elements=1_000_000)
    # 3 M elements = 30 ms; 1 M of them speculate (10 ms hidden by the 20 ms backward); 20 ms left, 10 hidden
    p = costs.predict(3_000_000, "backward", speculative_elements=1_000_000)
    assert p["exposed_cpu_s"] == pytest.approx(0.010) and p["speculative_s"] == pytest.approx(0.010)
    assert costs.predict(3_000_000, "backward")["exposed_cpu_s"] == pytest.approx(0.0)  # all speculate
    assert costs.predict(1_000_000, False, link_s=0.025)["step_s"] == pytest.approx(0.030 + 0.025)
    with pytest.raises(ValueError, match="speculative_elements must be in"):
        costs.predict(1_000, "backward", speculative_elements=2_000)
    text = costs.reason(3_000_000, 3, "backward", speculative_elements=1_000_000)
    assert "overlapped from backward" in text and "10.0 ms of it from backward" in text


def _planned(device: str = "sim:64MiB", **kw):
    """A tiny GPT's plan after its warmup step, every chunk on the host: ``(sched, plan, host elements,
    speculating elements)``; the scheduler is closed."""
    with memsched.attach(tiny_gpt(), policy="cpu", device=device, lr=LR, weight_decay=WD, chunk_numel=8192,
                         **kw) as sched:
        sched.backward(gpt_loss(sched.model, gpt_batches(1)[0]))
        sched.optimizer.step()
        plan, chunks = sched.plan, sched.store.chunks
    return (sched, plan, sum(c.hi - c.lo for c in chunks if c.index in plan.host_chunks),
            sum(c.hi - c.lo for c in chunks if c.index in plan.speculative))


def test_the_plan_predicts_its_speculating_and_streamed_chunks():
    """The runtime plan's prediction takes the plan's own choices: with overlap="backward" the speculating
    chunks' update is counted as hidden by backward, and streamed chunks leave the CPU update for the link's
    time at the step, which the reasons name."""
    sched, plan, host, spec = _planned("sim:64MiB,link=25GBps", overlap="backward")
    p = sched.predicted_step
    assert p["overlap"] == "backward" and plan.speculative
    assert p["speculative_s"] == pytest.approx(spec / sched.warmup_costs.cpu_elements_per_s)
    assert p["cpu_update_s"] == pytest.approx(host / sched.warmup_costs.cpu_elements_per_s)
    assert "overlapped from backward" in plan.reasons[-2]
    assert "In force: overlap='backward'" in plan.reasons[-1]
    sched, plan, _host, _spec = _planned("sim:64MiB,link=25GBps", host_update="device")
    p = sched.predicted_step
    assert plan.streamed == tuple(plan.host_chunks) and p["cpu_update_s"] == 0
    assert p["link_s"] > 0 and p["exposed_cpu_s"] == pytest.approx(p["link_s"])
    assert f"{len(plan.streamed)} chunks streamed through the device" in plan.reasons[-1]
    assert not any(r.startswith("Overlap modes") for r in plan.reasons)  # no chunk is updated on the CPU


def test_the_plan_compares_the_overlap_modes_with_their_host_memory():
    """With host chunks updated on the CPU the plan says what each overlap mode is predicted to take and the
    host memory it would add: overlap=True each host chunk's own fp32 gradients (4 bytes per element),
    overlap="backward" the spare states of the chunks that would speculate."""
    from policies.units import format_bytes

    _sched, plan, host, _spec = _planned()

    modes = plan.reasons[-1]
    assert "overlap=True" in modes and f"(+{format_bytes(4 * host)} of host memory)" in modes
    spares = modes.split("overlap='backward'")[1]
    assert "of host memory)" in spares and "chunks speculating" in spares
    assert "In force: serial" in modes
