"""MemoryTracer against an independent measurement: torch's own MemTracker
(``torch.distributed._tools.mem_tracker``), on a small nn.TransformerEncoderLayer stack trained for one step.

How the two differ, and how the test lines them up:

* MemTracker registers every op output it has not seen, views included, so a tensor created *before* it
  (the input batch) is counted as soon as a view of it appears; MemoryTracer counts only storages allocated
  inside its block (or classified as model data). The batch is therefore created inside both blocks.
* MemTracker files everything allocated during ``optimizer.step()`` under optimizer state; MemoryTracer
  counts the step's scratch tensors as temporaries. So non-model peaks are compared over forward and backward
  (MemTracker's activation + temp, tracked after every op by a small subclass), and the optimizer step only
  through the peak of all bytes, where the category does not matter.
* Gradients: MemTracker marks a weight gradient as such only when autograd hands it to AccumulateGrad, after
  the backward node that made it finished; MemoryTracer counts it as model data from its allocation. So in
  backward MemTracker's non-model figure can be larger by the gradients of one module's parameters (in this
  model its backward peak holds linear2's weight and bias gradients as "temp"). Forward peaks must agree
  exactly; the backward peaks must agree up to that bound.
* On CUDA MemTracker rounds blocks up to 512 bytes; on CPU both use raw storage bytes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tracer import MemoryTracer

mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")


def _model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class _NonModelPeak(mem_tracker.MemTracker):
    """MemTracker that also keeps the largest activation + temp bytes before and during backward."""

    def __init__(self) -> None:
        super().__init__()
        self.forward_peak = 0
        self.backward_peak = 0

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        if self._in_opt:
            return
        ref = mem_tracker._MemRefType
        for snap in self._curr_mem_snap.values():
            nm = snap.get(ref.ACT, 0) + snap.get(ref.TEMP, 0) + snap.get(ref.OTH, 0)
            if self._mod_tracker.is_bw:
                self.backward_peak = max(self.backward_peak, nm)
            else:
                self.forward_peak = max(self.forward_peak, nm)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 16, 32)
    loss = model(x).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_agrees_with_torch_mem_tracker():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    theirs = _NonModelPeak()
    with theirs:
        _step(model, opt)
    their_total = theirs.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    their_end = theirs.get_tracker_snapshot("current")[torch.device("cpu")]

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    with MemoryTracer(model, optimizer=opt) as t:
        _step(model, opt)
    tl = t.timeline
    # Our samples up to the first backward one cover the forward and the loss (MemTracker's "not backward").
    first_bw = next(i for i, s in enumerate(tl.samples) if s.phase == "backward")
    ours_forward = max(s.peak_non_model_bytes for s in tl.samples[: first_bw + 1])
    ours_backward = max(s.peak_non_model_bytes for s in tl.samples[first_bw + 1 :] if s.phase == "backward")
    assert ours_forward == theirs.forward_peak > 0
    one_module_grads = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                           for m in model.modules())
    assert ours_backward <= theirs.backward_peak <= ours_backward + one_module_grads
    assert tl.peak_bytes() == their_total  # in the optimizer step, where categories do not matter
    end = tl.samples[-1].bytes
    ref = mem_tracker._MemRefType
    assert end["parameter"] == their_end[ref.PARAM]
    assert end["optimizer_state"] == their_end[ref.OPT]
    assert end["gradient"] == their_end.get(ref.GRAD, 0) == 0  # zero_grad freed them
