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
        assert sched.plan.reasons[-1].startswith("Predicted step")
        assert not sched.step_timeline.records  # the warmup step is the model's input, not a record
