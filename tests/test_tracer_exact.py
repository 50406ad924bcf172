"""Exact figures of MemoryTracer on a Linear+ReLU stack, derived by hand (CPU, float32, 4 bytes/element).

Model: Linear(D0,D1) -> ReLU -> Linear(D1,D2) -> ReLU -> Linear(D2,D3), batch B, input x made before the
tracer (so it is never counted), training loop ``loss = model(x).sum(); loss.backward(); opt.step();
opt.zero_grad()`` with single-tensor AdamW (``foreach=False``). Names: h0 = addmm output of layer 0, r1 = ReLU
output, h2, r3, h4 likewise.

What autograd keeps for backward: addmm saves its inputs (x, r1, r3) and W^T (a view of a parameter); ReLU
saves its *output* (r1, r3). So h0 and h2 die as soon as the ReLU after them returns; r1 and r3 live until the
backward nodes that saved them ran.

Forward (activation), live non-model bytes right after each allocation:
  h0: B*D1 | r1: 2*B*D1 (then h0 freed) | h2: B*D1 + B*D2 | r3: B*D1 + 2*B*D2 (then h2 freed)
  h4: B*D1 + B*D2 + B*D3
  => forward peak = 4 * max(2*B*D1, B*D1 + 2*B*D2, B*D1 + B*D2 + B*D3); from step 1 on, the previous step's
  ``loss`` (4 bytes, ``other``) is still referenced by the Python variable during the forward: +4.
Backward ("other" = loss + the ones tensor that seeds backward = 8 bytes throughout; the weight/bias grads are
model data from their allocation, because the tracer classifies them in post-accumulate-grad hooks and
reclassification is retroactive within an interval):
  AddmmBackward(layer 4): grad_r3 (B*D2)                     -> r1 + r3 + grad_r3        = B*D1 + 2*B*D2
  ReluBackward(3):        grad_h2 (B*D2), grad_r3 still live  -> r1 + r3 + grad_r3 + grad_h2 = B*D1 + 3*B*D2
  AddmmBackward(layer 2): grad_r1 (B*D1), r3/grad_r3 freed    -> r1 + grad_h2 + grad_r1  = 2*B*D1 + B*D2
  ReluBackward(1):        grad_h0 (B*D1), grad_h2 freed       -> r1 + grad_r1 + grad_h0  = 3*B*D1
  AddmmBackward(layer 0): x needs no grad: only parameter grads (model data)
  => backward peak = 4 * max(...) + 8.
Optimizer (single-tensor AdamW, per parameter i in order W0, b0, W2, b2, W4, b4 with n_i elements):
  ``denom = (exp_avg_sq.sqrt() / c).add_(eps)``: sqrt (n_i) and the division (n_i) are live together, while
  the previous parameter's ``denom`` (n_{i-1}) is still held by the local variable until reassigned. Only
  ``loss`` (4 bytes) is left of the other data. exp_avg / exp_avg_sq / step are optimizer states (model data
  from their allocation in step 0).
  => optimizer peak = 4 * max_i(n_{i-1} + 2*n_i) + 4.
Model data: parameters P = 4 * sum(n_i); gradients P; optimizer states 2P + 4 bytes per parameter (the
float32 ``step`` scalar of each parameter). Peak of all bytes: in the optimizer step,
P + P + (2P + 24) + optimizer peak.
"""

from __future__ import annotations

import torch
from torch import nn

from tracer import MemoryTimeline, MemoryTracer

B, D0, D1, D2, D3 = 64, 32, 128, 96, 16
F32 = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D0, D1), nn.ReLU(), nn.Linear(D1, D2), nn.ReLU(), nn.Linear(D2, D3))


def _trace(steps: int = 2) -> MemoryTimeline:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(B, D0)
    with MemoryTracer(model, optimizer=opt) as t:
        for _ in range(steps):
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return t.timeline


def _phase_peak(tl: MemoryTimeline, phase: str, step: int) -> int:
    return max(s.peak_non_model_bytes for s in tl.samples if s.phase == phase and s.step == step)


# Hand values (see the module docstring).
N = [D1 * D0, D1, D2 * D1, D2, D3 * D2, D3]  # parameter elements in AdamW's order
P = F32 * sum(N)
FORWARD = F32 * max(2 * B * D1, B * D1 + 2 * B * D2, B * D1 + B * D2 + B * D3)
BACKWARD = F32 * max(B * D1 + 2 * B * D2, B * D1 + 3 * B * D2, 2 * B * D1 + B * D2, 3 * B * D1) + 8
OPTIMIZER = F32 * max(prev + 2 * n for prev, n in zip([0, *N[:-1]], N, strict=True)) + 4
STATES = 2 * P + F32 * len(N)


def test_hand_values_are_distinct_so_the_test_can_tell_phases_apart():
    assert len({FORWARD, FORWARD + 4, BACKWARD, OPTIMIZER}) == 4
    assert BACKWARD == F32 * (B * D1 + 3 * B * D2) + 8  # the peak is ReluBackward of layer 3


def test_peak_non_model_equals_hand_value_exactly():
    tl = _trace()
    assert tl.peak_non_model_bytes() == max(FORWARD + 4, BACKWARD, OPTIMIZER) == BACKWARD
    for step in (0, 1):
        assert _phase_peak(tl, "backward", step) == BACKWARD
        assert _phase_peak(tl, "optimizer", step) == OPTIMIZER
    assert _phase_peak(tl, "forward", 0) == FORWARD
    assert _phase_peak(tl, "forward", 1) == FORWARD + 4  # step 0's loss is still alive


def test_model_data_per_category_exact():
    tl = _trace()
    assert tl.model_data_bytes() == {"parameter": P, "buffer": 0, "gradient": P, "optimizer_state": STATES}
    pre = [s for s in tl.samples if s.phase == "optimizer" and s.event == "pre"]
    post = [s for s in tl.samples if s.phase == "optimizer" and s.event == "post"]
    assert [s.step for s in pre] == [0, 1]
    # Step 0: states do not exist before the first step; gradients are complete.
    assert pre[0].bytes["gradient"] == P and pre[0].bytes["optimizer_state"] == 0
    assert post[0].bytes["optimizer_state"] == STATES and post[0].bytes["parameter"] == P
    assert pre[1].bytes["optimizer_state"] == STATES
    # The peak of all bytes is in the optimizer step: parameters + gradients + states + temporaries.
    assert tl.peak_bytes() == 2 * P + STATES + OPTIMIZER
    # After zero_grad the gradients are gone; the closing mark sees params + states + the last loss.
    end = tl.samples[-1]
    assert (end.event, end.module) == ("mark", "exit")
    assert end.bytes == {"parameter": P, "buffer": 0, "gradient": 0, "optimizer_state": STATES,
                         "activation": 0, "temporary": 0, "other": 4}


def test_forward_activation_kept_per_module():
    # What each module leaves alive after its forward (kept for backward or passed on).
    stats = {m.name: m for m in _trace(steps=1).module_stats()}
    assert stats["0"].activation_bytes == F32 * B * D1  # h0 (freed only after the ReLU)
    assert stats["1"].activation_bytes == F32 * B * D1  # r1 (h0 is freed after the post hook)
    assert stats["4"].activation_bytes == F32 * B * D3
    assert stats[""].activation_bytes == F32 * (B * D1 + B * D2 + B * D3)  # r1, r3, h4
    assert stats[""].forward_peak_bytes == FORWARD
    assert stats["3"].backward_peak_bytes == BACKWARD  # ReluBackward of layer 3 holds the peak
    assert all(m.calls == 1 for m in stats.values())


def test_summary_names_where_the_peak_is():
    summary = _trace(steps=1).summary()
    assert summary["peak_non_model_bytes"] == BACKWARD and summary["peak_phase"] == "backward"
    # The peak is inside ReLU 3's backward. Hooks registered on one autograd node fire together: ReLU 3's
    # backward pre and Linear 4's backward post at ReluBackward, Linear 2's pre and ReLU 3's post at the
    # next node. So the interval opens at Linear 4's post and closes at Linear 2's pre.
    assert (summary["peak_after_module"], summary["peak_after_event"]) == ("4", "post")
    assert (summary["peak_module"], summary["peak_event"]) == ("2", "pre")
