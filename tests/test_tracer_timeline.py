"""MemoryTimeline queries added for the tracer: linear module_stats, per-phase peaks, summary."""

from __future__ import annotations

import random

import torch
from torch import nn

from tracer import MemoryTimeline, MemoryTracer, ModuleStats, Sample


def _sample(i: int, phase: str, module: str, event: str, act: int, peak: int) -> Sample:
    return Sample(t_ns=i, step=0, phase=phase, module=module, event=event, device="cpu",
                  bytes={"activation": act}, peak_bytes=peak, peak_non_model_bytes=peak)


def _random_trace(rng: random.Random, n_calls: int) -> list[Sample]:
    """Forward calls nest properly; backward pre/post pairs interleave arbitrarily (as they can)."""
    out: list[Sample] = []
    names = [f"m{k}" for k in range(6)]
    stack: list[str] = []
    open_bw: list[str] = []
    act = 0

    def add(phase, module, event):
        nonlocal act
        act = max(0, act + rng.randint(-50, 80))
        out.append(_sample(len(out), phase, module, event, act, act + rng.randint(0, 500)))

    for _ in range(n_calls):
        r = rng.random()
        if r < 0.35 or not stack and r < 0.6:
            stack.append(rng.choice(names))
            add("forward", stack[-1], "pre")
        elif r < 0.6:
            add("forward", stack.pop(), "post")
        elif r < 0.8:
            open_bw.append(rng.choice(names))
            add("backward", open_bw[-1], "pre")
        elif open_bw:
            add("backward", open_bw.pop(rng.randrange(len(open_bw))), "post")
        else:
            add("other", "x", "mark")
    return out


def _reference_module_stats(samples: list[Sample]) -> list[ModuleStats]:
    """The definition, written the slow way: peaks are maxima over the samples in (pre, post]."""
    stats: dict[str, ModuleStats] = {}
    open_fwd: dict[str, list[int]] = {}
    open_bwd: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        if s.phase == "forward":
            st = stats.setdefault(s.module, ModuleStats(s.module))
            if s.event == "pre":
                st.calls += 1
                open_fwd.setdefault(s.module, []).append(i)
            elif open_fwd.get(s.module):
                j = open_fwd[s.module].pop()
                st.activation_bytes = max(st.activation_bytes,
                                          s.bytes["activation"] - samples[j].bytes["activation"])
                st.forward_peak_bytes = max(st.forward_peak_bytes,
                                            max(x.peak_non_model_bytes for x in samples[j + 1 : i + 1]))
        elif s.phase == "backward" and s.module in stats:
            if s.event == "pre":
                open_bwd.setdefault(s.module, []).append(i)
            elif open_bwd.get(s.module):
                j = open_bwd[s.module].pop()
                stats[s.module].backward_peak_bytes = max(
                    stats[s.module].backward_peak_bytes,
                    max(x.peak_non_model_bytes for x in samples[j + 1 : i + 1]))
    return list(stats.values())


def test_module_stats_match_the_definition_on_random_traces():
    rng = random.Random(7)
    for n in (1, 5, 40, 400, 2000):
        samples = _random_trace(rng, n)
        assert MemoryTimeline(samples).module_stats() == _reference_module_stats(samples), n


def test_module_stats_scale_to_long_traces():
    # 60k samples of one deep call chain: quadratic code would take minutes here, linear code milliseconds.
    depth, reps = 50, 300
    samples: list[Sample] = []
    for _ in range(reps):
        for d in range(depth):
            samples.append(_sample(len(samples), "forward", f"m{d}", "pre", d, d))
        for d in reversed(range(depth)):
            samples.append(_sample(len(samples), "forward", f"m{d}", "post", d + 1, 2 * d))
    stats = {s.name: s for s in MemoryTimeline(samples).module_stats()}
    assert stats["m0"].calls == reps and stats["m0"].forward_peak_bytes == 2 * (depth - 1)
    assert stats["m49"].forward_peak_bytes == 98 and stats["m49"].activation_bytes == 1


def test_summary_and_phase_peaks_of_a_real_trace():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 16)
    with MemoryTracer(model, optimizer=opt) as t:
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    tl = t.timeline
    summary = tl.summary()
    peak = tl.peak_non_model_sample()
    assert summary["peak_non_model_bytes"] == tl.peak_non_model_bytes() == peak.peak_non_model_bytes > 0
    assert (summary["peak_module"], summary["peak_phase"], summary["peak_step"]) == (peak.module, peak.phase,
                                                                                     peak.step)
    assert summary["model_data_bytes"] == tl.model_data_bytes()
    assert summary["steps"] == 2 and summary["samples"] == len(tl.samples) and summary["device"] == "cpu"
    by_phase = tl.peak_non_model_by_phase()
    assert set(by_phase) == {"forward", "backward", "optimizer", "other"}
    assert max(by_phase.values()) == tl.peak_non_model_bytes()
    assert by_phase == summary["peak_non_model_by_phase"]
    assert MemoryTimeline().summary()["peak_module"] is None
