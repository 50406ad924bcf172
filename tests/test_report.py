"""The rich report: what it says about a (synthetic) timeline, plans and transfers, and that it fits."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from memsched.report.category_bars import CATEGORY_COLORS, CATEGORY_SYMBOLS, StackedBar
from memsched.report.text import (
    module_label,
    render_report,
    report_renderables,
    timeline_bars,
)
from policies.types import DEVICE, HOST, PlacementPlan
from policies.units import format_bytes
from tracer.timeline import MemoryTimeline, Sample

MiB = 2**20


def make_timeline(steps: int = 2, *, cuda: bool = False, rank: int | None = None) -> MemoryTimeline:
    """A small trace: root > encoder > (layer0, layer1), head; layer1 runs twice per step; then AdamW.

    Activations kept: layer0 3 MiB, layer1 2 MiB per call, head 1 MiB. The non-model peak (10 MiB + 1 MiB per
    step of temporaries) is in the backward of ``encoder.layer0`` of the last step.
    """
    samples: list[Sample] = []
    live = {
        "parameter": 8 * MiB,
        "buffer": MiB,
        "gradient": 0,
        "optimizer_state": 0,
        "activation": 0,
        "temporary": 0,
        "other": 0,
    }
    clock = [0]
    device = "cuda:0" if cuda else "cpu"

    def add(step: int, phase: str, module: str, event: str, extra_non_model: int = 0) -> None:
        clock[0] += 250_000  # 0.25 ms between samples
        non_model = live["activation"] + live["temporary"] + live["other"]
        total = sum(live.values())
        info = None
        if cuda:
            info = {
                "allocated": total,
                "peak_allocated": total + extra_non_model,
                "reserved": total + 6 * MiB,
                "nvml_used": total + 500 * MiB,
            }
        samples.append(
            Sample(
                clock[0],
                step,
                phase,
                module,
                event,
                device,
                dict(live),
                total + extra_non_model,
                non_model + extra_non_model,
                info,
            )
        )

    def forward(step: int, module: str, kept: int) -> None:
        add(step, "forward", module, "pre")
        live["activation"] += kept
        add(step, "forward", module, "post", extra_non_model=MiB)

    def backward(step: int, module: str, freed: int, grad: int, temp: int) -> None:
        add(step, "backward", module, "pre")
        live["activation"] -= freed
        live["gradient"] += grad
        add(step, "backward", module, "post", extra_non_model=temp)

    for step in range(steps):
        add(step, "forward", "", "pre")
        add(step, "forward", "encoder", "pre")
        forward(step, "encoder.layer0", 3 * MiB)
        forward(step, "encoder.layer1", 2 * MiB)
        forward(step, "encoder.layer1", 2 * MiB)
        add(step, "forward", "encoder", "post")
        forward(step, "head", MiB)
        add(step, "forward", "", "post")
        add(step, "backward", "", "pre")
        backward(step, "head", MiB, MiB, 0)
        add(step, "backward", "encoder", "pre")
        backward(step, "encoder.layer1", 2 * MiB, MiB, MiB)
        backward(step, "encoder.layer1", 2 * MiB, MiB, MiB)
        # Large temporaries, growing with the step: the last step holds the peak.
        backward(step, "encoder.layer0", 3 * MiB, 2 * MiB, (10 + step) * MiB)
        add(step, "backward", "encoder", "post")
        add(step, "backward", "", "post")
        add(step, "optimizer", "AdamW", "pre")
        live["optimizer_state"] = 16 * MiB
        add(step, "optimizer", "AdamW", "post")
        live["gradient"] = 0
    meta = {"device": device, "backend": "cuda" if cuda else "tensor", "steps": steps}
    if rank is not None:
        meta["rank"] = rank
    return MemoryTimeline(samples, meta)


def record(width: int = 100) -> Console:
    return Console(record=True, width=width, force_terminal=False, color_system=None)


def test_summary_names_the_peak_and_where_it_is():
    tl = make_timeline()
    console = record()
    render_report(tl, console=console)
    text = console.export_text()
    peak = tl.peak_non_model_sample()
    assert peak is not None and peak.module == "encoder.layer0" and peak.phase == "backward"
    assert tl.peak_non_model_bytes() == 11 * MiB
    assert format_bytes(11 * MiB) in text
    assert "at backward post of encoder.layer0 (step 1)" in text
    assert (
        f"parameter {format_bytes(8 * MiB)}" in text and f"optimizer_state {format_bytes(16 * MiB)}" in text
    )
    assert format_bytes(tl.peak_bytes()) in text
    assert "cpu (backend: tensor)" in text
    assert "CUDA" not in text  # no CUDA figures on a CPU trace


def test_module_table_sorted_by_activations_and_limited_by_top():
    tl = make_timeline()
    console = record()
    render_report(tl, top=2, console=console)
    text = console.export_text()
    table = text[text.index("Modules:") : text.index("Timeline")]
    # root keeps 8 MiB, encoder 7 MiB, layer0 3 MiB, layer1 2 MiB per call, head 1 MiB.
    assert "(root)" in table and "encoder " in table
    assert "encoder.layer0" not in table and "head" not in table
    assert "3 more modules" in table
    console = record()
    render_report(tl, top=10, console=console)
    table = console.export_text()
    rows = [
        line.split() for line in table.splitlines() if line.strip().startswith(("encoder", "head", "(root)"))
    ]
    names = [r[0] for r in rows]
    assert names[:5] == ["(root)", "encoder", "encoder.layer0", "encoder.layer1", "head"]
    layer1 = rows[names.index("encoder.layer1")]
    assert layer1[1] == "2"  # two calls per step (four over the two traced steps)
    assert " ".join(layer1[2:4]) == format_bytes(2 * MiB)  # per call
    encoder = rows[names.index("encoder")]
    assert " ".join(encoder[2:4]) == format_bytes(7 * MiB)  # one call: layer0's 3 MiB + layer1's 2 x 2 MiB


def test_module_table_says_per_step_and_per_call_in_its_headers():
    console = record(120)
    render_report(make_timeline(), console=console)
    text = console.export_text()
    header = text[text.index("Modules:") : text.index("(root)")]
    assert "calls" in header and "per step" in header
    assert header.count("per call") == 4  # the title and the three byte columns
    assert "over 2 traced steps" in text


@pytest.mark.parametrize("width", [80, 120])
def test_fits_the_terminal(width):
    tl = make_timeline(cuda=True)
    plan = PlacementPlan(
        "greedy", (DEVICE, HOST, HOST), 4 * MiB, 8 * MiB, 5 * MiB, 4 * MiB, ("the margin holds one chunk",)
    )
    console = record(width)
    render_report(
        tl, plan=plan, transfers={"h2d_bytes": 8 * MiB, "d2h_bytes": 4 * MiB, "steps": 2}, console=console
    )
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= width
    assert any("encoder.layer0" in line for line in lines)


def test_cuda_figures_reserved_fragmentation_and_nvml():
    tl = make_timeline(cuda=True)
    console = record(120)
    render_report(tl, console=console)
    text = console.export_text()
    biggest = max((s.cuda for s in tl.samples if s.cuda), key=lambda c: c["reserved"])
    assert f"CUDA reserved (max)   {format_bytes(biggest['reserved'])}" in text
    frag = biggest["reserved"] - biggest["allocated"]
    assert (
        f"unallocated in it: {format_bytes(frag)} ({100 * frag / biggest['reserved']:.1f}% of reserved)"
        in text
    )
    assert format_bytes(max(s.cuda["nvml_used"] for s in tl.samples)) in text


def test_plan_and_transfer_sections():
    tl = make_timeline()
    plan = PlacementPlan(
        "greedy",
        (DEVICE, DEVICE, HOST),
        6 * MiB,
        3 * MiB,
        10 * MiB,
        8 * MiB,
        ("margin 10.0 MiB, budget 80%", "chunk 2 does not fit"),
        {"gpu_margin_mem_ratio": 0.8},
    )
    console = record(120)
    render_report(
        tl, plan=plan, transfers={"h2d_bytes": 6 * MiB, "d2h_bytes": 3 * MiB, "steps": 3}, console=console
    )
    text = console.export_text()
    assert "Placement plan" in text and "greedy" in text
    assert f"GPU margin  {format_bytes(10 * MiB)}" in text and f"budget      {format_bytes(8 * MiB)}" in text
    assert f"2 chunks, {format_bytes(6 * MiB)} of optimizer states" in text
    assert f"1 chunk, {format_bytes(3 * MiB)} of pinned memory" in text
    assert "• chunk 2 does not fit" in text and "gpu_margin_mem_ratio=0.8" in text
    transfers = text[text.index("Transfers over 3 steps") :]
    h2d = next(line for line in transfers.splitlines() if "H2D" in line)
    assert h2d.split()[-4:] == [*format_bytes(2 * MiB).split(), *format_bytes(6 * MiB).split()]


def test_renderables_grow_with_plan_and_transfers():
    tl = make_timeline()
    plan = PlacementPlan("all-host", (HOST,), 0, MiB, 0, 0)
    assert len(report_renderables(tl)) == 3
    assert len(report_renderables(tl, plan=plan, transfers={"h2d_bytes": 0, "d2h_bytes": 0, "steps": 1})) == 5


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_bad_top_is_rejected(bad):
    with pytest.raises(ValueError, match="top must be an integer >= 1"):
        report_renderables(make_timeline(), top=bad)


@pytest.mark.parametrize(
    "transfers, key",
    [
        ({"d2h_bytes": 0, "steps": 1}, "h2d_bytes"),
        ({"h2d_bytes": -1, "d2h_bytes": 0, "steps": 1}, "h2d_bytes"),
        ({"h2d_bytes": 1, "d2h_bytes": 0, "steps": 1.5}, "steps"),
    ],
)
def test_bad_transfers_are_rejected(transfers, key):
    with pytest.raises(ValueError, match=f"transfers\\['{key}'\\]"):
        report_renderables(make_timeline(), transfers=transfers)


def test_empty_timeline_renders():
    console = record()
    render_report(MemoryTimeline([], {"device": "cpu"}), console=console)
    text = console.export_text()
    assert "nothing to report" in text and "no samples" in text


def test_timeline_bars_bucket_long_traces_and_mark_the_peak():
    tl = make_timeline(steps=30)  # 30 * 26 samples
    console = record(100)
    console.print(timeline_bars(tl, rows=40))
    rows = [line for line in console.export_text().splitlines() if " ms " in line]
    assert len(rows) == 40
    assert sum("◀" in r for r in rows) == 1
    peak_row = next(r for r in rows if "◀" in r)
    assert "s29 bwd" in peak_row  # the peak is in the last step
    short = make_timeline(steps=1)
    assert len(short.samples) < 40  # then every sample gets its own bar
    console = record(100)
    console.print(timeline_bars(short, rows=40))
    assert len([line for line in console.export_text().splitlines() if " ms " in line]) == len(short.samples)


def test_stacked_bar_is_proportional_and_coloured_by_category():
    console = Console(width=40, force_terminal=True, color_system="truecolor")
    bar = StackedBar({"parameter": 30, "activation": 10, "gradient": 0}, scale=80)
    segments = list(console.render(bar, console.options.update(width=40)))
    drawn = [s for s in segments if s.text.strip()]
    by_colour = {s.style.color.triplet.hex: len(s.text) for s in drawn}
    assert by_colour == {CATEGORY_COLORS["parameter"]: 15, CATEGORY_COLORS["activation"]: 5}


def test_module_label_names_the_root():
    assert module_label("") == "(root)" and module_label("a.b") == "a.b"


def test_no_non_model_data_marks_no_peak():
    samples = [
        Sample(i * 1000, 0, "forward", "", ev, "cpu", {"parameter": MiB}, MiB, 0)
        for i, ev in enumerate(["pre", "post"])
    ]
    console = record()
    render_report(MemoryTimeline(samples, {"device": "cpu"}), console=console)
    text = console.export_text()
    assert "0 B (no non-model data measured)" in text and "◀ marks" in text
    assert not any("◀" in line for line in text.splitlines() if " ms " in line)


def test_transfer_stats_dict_shows_last_step_and_chunk_moves():
    stats = {
        "h2d_bytes": 9 * MiB,
        "d2h_bytes": 6 * MiB,
        "steps": 3,
        "last_h2d_bytes": 4 * MiB,
        "last_d2h_bytes": 2 * MiB,
        "chunk_moves_bytes": 5 * MiB,
    }  # memsched.devices.transfers.TransferStats.as_dict()
    console = record(100)
    render_report(make_timeline(), transfers=stats, console=console)
    text = console.export_text()
    d2h = next(line for line in text.splitlines() if "D2H" in line).split()
    assert d2h[-6:] == ["2.0", "MiB", "2.0", "MiB", "6.0", "MiB"]  # mean per step, last step, total
    h2d = next(line for line in text.splitlines() if "H2D" in line).split()
    assert h2d[-6:] == ["3.0", "MiB", "4.0", "MiB", "9.0", "MiB"]
    assert f"plus {format_bytes(5 * MiB)} moved once to apply the plan" in text
    with pytest.raises(ValueError, match="last_h2d_bytes"):
        report_renderables(make_timeline(), transfers={**stats, "last_h2d_bytes": -1})


def test_cuda_without_nvml_says_why():
    tl = make_timeline(cuda=True)
    for s in tl.samples:
        s.cuda["nvml_used"] = None  # what the tracer records when NVML cannot be read
    tl.meta["nvml"] = "nvmlInit failed: NVML Shared Library Not Found"
    console = record(120)
    render_report(tl, console=console)
    text = console.export_text()
    assert "NVML used   " in text and "not measured: nvmlInit failed" in text
    assert "CUDA reserved (max)" in text


def test_saved_timelines_load_back_with_every_kind_of_sample(tmp_path):
    """The loader's checks of each sample accept all the tracer writes: CUDA figures, a null NVML figure
    (NVML unreadable), CPU samples without CUDA figures."""
    cuda = make_timeline(cuda=True)
    cuda.samples[0].cuda["nvml_used"] = None
    for tl in (cuda, make_timeline()):
        tl.save(tmp_path / "t.json")
        assert MemoryTimeline.load(tmp_path / "t.json").to_dict() == tl.to_dict()


# ---- one peak total; output without colour ---------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_trace() -> MemoryTimeline:
    """Two real AdamW steps of the tiny GPT traced on the CPU."""
    import torch

    from memsched.models import build_gpt, lm_loss
    from tracer import MemoryTracer

    torch.manual_seed(0)
    model = build_gpt("tiny")
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (4, 64))
    with MemoryTracer(model, optimizer=opt) as tracer:
        for _ in range(2):
            lm_loss(model, x, x).backward()
            opt.step()
            opt.zero_grad()
    return tracer.timeline


def test_the_three_peak_totals_agree_on_a_real_trace(gpt_trace: MemoryTimeline):
    samples = gpt_trace.for_device()
    peak = max(s.peak_bytes for s in samples)
    # Between hooks the trace goes higher than at any hook: the figures can only agree by definition.
    assert peak > max(s.total_bytes for s in samples)
    console = record(120)
    render_report(gpt_trace, console=console)
    text = console.export_text()
    summary = next(line for line in text.splitlines() if "peak total" in line)
    width = text[text.index("full width = peak total ") :].split()[5:7]
    rows = [line for line in text.splitlines() if " ms " in line]
    top = [r for r in rows if "▲" in r]
    assert len(top) == 1
    figure = top[0].split("▲")[0].split()[-2:]  # the size printed on the right of the row
    assert summary.split()[3:5] == width == figure == format_bytes(peak).split()


def test_report_without_colour_has_no_ansi_and_says_it_in_words():
    console = Console(file=io.StringIO(), force_terminal=False, width=100)
    plan = PlacementPlan("greedy", (DEVICE, HOST, HOST), 4 * MiB, 8 * MiB, 5 * MiB, 4 * MiB, ("why",))
    render_report(make_timeline(), plan=plan, console=console)
    text = console.file.getvalue()
    assert "\x1b" not in text
    bars = [line for line in text.splitlines() if " ms " in line]
    legend = " ".join(text[text.index("Timeline (live bytes") : text.index(bars[0])].split())
    for c in ("parameter", "buffer", "gradient", "optimizer_state", "activation"):  # those it holds
        assert f"{CATEGORY_SYMBOLS[c]} {c}" in legend  # each category's letter, next to its name
    assert "P parameter 8.0 MiB" in text  # the summary's model data uses the same keys
    assert any("PPPP" in b and "AAA" in b for b in bars)  # the bars are drawn with the letters
    strip = next(line for line in text.splitlines() if "chunks" in line and "first-use order" in line)
    assert "■□□" in strip and "■ device" in strip and "□ host" in strip


def test_a_colour_terminal_keeps_solid_bars_and_swatches():
    console = Console(file=io.StringIO(), force_terminal=True, color_system="truecolor", width=100)
    render_report(make_timeline(), console=console)
    text = console.file.getvalue()
    assert "\x1b[" in text and "█" in text and "PPPP" not in text
