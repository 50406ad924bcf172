"""The picture of the decision: the PNG draws the capacity, the resident model data, the peak non-model data,
the GPU margin, the budget and the optimizer state on each side on the timeline's y axis, its title names the
device as the user gave it, and the plan panel shows the same figures."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from torch import nn

import memsched
import policies
from memsched.report import exports
from memsched.report.plan import DecisionFigures, plan_panel
from policies.types import DEVICE, HOST, ChunkSpec, PlacementProblem
from policies.units import format_bytes
from tracer.timeline import MemoryTimeline, Sample

pytest.importorskip("matplotlib")

MiB = 2**20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DECISION_GIDS = {"capacity", "margin", "budget", "optimizer-device", "optimizer-host", "resident",
                 "peak-non-model"}


@pytest.fixture(scope="module")
def sched():
    """A tiny MLP trained 3 steps on the stand-in ``sim:2GiB``; ``static`` puts half the chunks on host."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(6)],
                          nn.Linear(128, 8))
    with memsched.attach(model, policy="static", policy_options={"offload_optim_frac": 0.5},
                         device="sim:2GiB", chunk_numel=20000) as s:
        for _ in range(3):
            s.backward(model(torch.randn(16, 128).to(s.device.torch_device)).pow(2).mean())
            s.optimizer.step()
            s.optimizer.zero_grad()
    assert {DEVICE, HOST} <= set(s.plan.placement)  # a real split, so both sides are drawn
    return s


def artists(fig) -> dict[str, object]:
    """Every artist of the figure that carries a gid, by gid (each gid is drawn once)."""
    found: dict[str, object] = {}
    for ax in fig.axes:
        for a in [*ax.lines, *ax.patches]:
            gid = a.get_gid()
            if gid:
                assert gid not in found, f"{gid} drawn twice"
                found[gid] = a
    return found


def y_span(artist) -> tuple[float, float]:
    """Bottom and top of a horizontal span or bar (a Rectangle or, in older matplotlib, a Polygon), bytes."""
    if hasattr(artist, "get_height"):
        return artist.get_y(), artist.get_y() + artist.get_height()
    ys = [y for _x, y in artist.get_xy()]
    return min(ys), max(ys)


def legend_texts(fig) -> list[str]:
    """The legend's entries, each on one line (the figure wraps long ones)."""
    return [" ".join(t.get_text().split()) for legend in fig.legends for t in legend.get_texts()]


def test_figure_draws_the_decision_on_the_timeline_axis(sched) -> None:
    problem, plan = sched.problem, sched.plan
    fig = exports.render_figure(sched.timeline, plan=plan, problem=problem, device="sim:2GiB")
    found = artists(fig)
    assert DECISION_GIDS <= set(found)
    floor = problem.resident_model_bytes + problem.peak_non_model_bytes
    assert list(found["capacity"].get_ydata()) == [problem.capacity_bytes] * 2
    assert list(found["resident"].get_ydata()) == [problem.resident_model_bytes] * 2
    assert list(found["peak-non-model"].get_ydata()) == [floor] * 2
    assert y_span(found["margin"]) == pytest.approx((floor, problem.capacity_bytes))
    assert problem.capacity_bytes - floor == problem.margin_bytes == plan.margin_bytes
    assert y_span(found["budget"]) == pytest.approx((floor, floor + plan.budget_bytes))
    # plan.device_bytes: the device chunks' optimizer states and gradients, and the host chunks' gradients
    # on their way to the host, drawn above them
    placed = list(zip(problem.chunks, plan.placement, strict=True))
    on_device = sum(c.device_bytes for c, p in placed if p == DEVICE)
    working = problem.host_grad_working_bytes
    assert 0 < working and on_device + working == plan.device_bytes
    assert y_span(found["optimizer-device"]) == pytest.approx((floor, floor + on_device))
    assert y_span(found["grad-working"]) == pytest.approx((floor + on_device, floor + plan.device_bytes))
    on_host = sum(c.device_bytes for c, p in zip(problem.chunks, plan.placement, strict=True) if p == HOST)
    assert 0 < on_host and y_span(found["optimizer-host"]) == pytest.approx((0, on_host))
    assert "params-host" not in found  # every parameter on the device
    # One y axis: the timeline's axes carry the levels and the column beside it shares them.
    main, side = fig.axes[:2]
    assert found["capacity"].axes is main and found["optimizer-host"].axes is side
    assert side.get_shared_y_axes().joined(main, side)
    assert main.get_ylim()[1] > problem.capacity_bytes
    assert "GiB" in main.get_ylabel() or "MiB" in main.get_ylabel()
    # Words, not colour only: the legend names every level with its figure.
    legend = "\n".join(legend_texts(fig))
    for words in (f"capacity {format_bytes(problem.capacity_bytes)}",
                  f"GPU margin {format_bytes(plan.margin_bytes)}",
                  f"budget {format_bytes(plan.budget_bytes)} (gpu_margin_mem_ratio 0.8)",
                  f"resident model data {format_bytes(problem.resident_model_bytes)}",
                  f"peak non-model data {format_bytes(problem.peak_non_model_bytes)}",
                  f"optimizer state and gradients on the device {format_bytes(on_device)}",
                  f"host chunks' gradients on their way to the host {format_bytes(working)}",
                  f"optimizer state and gradients on the host {format_bytes(on_host)}"):
        assert words in legend
    title = main.get_title(loc="left")
    assert title.startswith("sim:2GiB (stand-in; tensors on sim:0)") and "policy static" in title


def test_plain_trace_draws_the_timeline_alone(sched, tmp_path) -> None:
    fig = exports.render_figure(sched.timeline)
    assert not DECISION_GIDS & set(artists(fig))
    assert len(fig.axes) == 1 and fig.axes[0].collections  # the stacked area
    # Without a device string the title names the stand-in as the scheduler recorded it.
    assert fig.axes[0].get_title(loc="left").startswith("sim:2.0 GiB (stand-in; tensors on sim:0)")
    path = exports.write_png(sched.timeline, tmp_path / "plain.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_write_all_saves_the_decision_for_a_re_export(sched, tmp_path) -> None:
    meta_before = dict(sched.timeline.meta)
    written = exports.write_all(sched.timeline, tmp_path, plan=sched.plan, problem=sched.problem,
                                device="sim:2GiB", kinds=["json", "png"])
    assert written["png"].read_bytes()[:8] == PNG_MAGIC
    assert sched.timeline.meta == meta_before  # the timeline itself is left as it was
    meta = json.loads(written["json"].read_text())["meta"]
    figures = DecisionFigures.of(sched.plan, sched.problem)
    assert meta["device_given"] == "sim:2GiB" and meta["decision"] == figures.to_dict()
    loaded = MemoryTimeline.load(written["json"])  # `memsched report trace.json --png` draws it again
    fig = exports.render_figure(loaded)
    assert list(artists(fig)["capacity"].get_ydata()) == [sched.problem.capacity_bytes] * 2
    assert fig.axes[0].get_title(loc="left").startswith("sim:2GiB")
    # A file from before these keys, or with a damaged decision, loads and draws the plain timeline.
    for decision in (None, {"capacity_bytes": "lots"}):
        old = MemoryTimeline.from_dict({**loaded.to_dict(), "meta": {**meta, "decision": decision}})
        assert not DECISION_GIDS & set(artists(exports.render_figure(old)))


def test_plan_without_its_problem_is_refused(sched) -> None:
    with pytest.raises(ValueError, match="problem the plan was made for"):
        exports.render_figure(sched.timeline, plan=sched.plan)
    other = PlacementProblem(capacity_bytes=sched.problem.capacity_bytes + 1,
                             peak_non_model_bytes=sched.problem.peak_non_model_bytes,
                             resident_model_bytes=sched.problem.resident_model_bytes,
                             chunks=sched.problem.chunks)
    with pytest.raises(ValueError, match="not made for this problem"):
        exports.render_figure(sched.timeline, plan=sched.plan, problem=other)


def test_no_margin_is_drawn_as_the_overflow() -> None:
    samples = [Sample(i * 1000, 0, "forward", "", "pre", "cuda:0", {"parameter": 4 * MiB, "activation": a},
                      4 * MiB + a, a) for i, a in enumerate((0, 6 * MiB, 2 * MiB))]
    timeline = MemoryTimeline(samples, {"device": "cuda:0", "steps": 1})
    problem = PlacementProblem(capacity_bytes=8 * MiB, peak_non_model_bytes=6 * MiB,
                               resident_model_bytes=4 * MiB,
                               chunks=(ChunkSpec(0, device_bytes=MiB, host_bytes=2 * MiB),))
    plan = policies.make_plan(problem, [HOST], budget_bytes=0, policy="cpu")
    fig = exports.render_figure(timeline, plan=plan, problem=problem)
    found = artists(fig)
    assert y_span(found["margin"]) == pytest.approx((8 * MiB, 10 * MiB))  # capacity up to what is needed
    assert "budget" not in found and "optimizer-device" not in found
    assert any("exceed the capacity by 2.0 MiB" in t for t in legend_texts(fig))
    assert fig.axes[0].get_title(loc="left").startswith("cuda:0: ")


def test_plan_panel_shows_the_figures_of_the_png(sched) -> None:
    def text(*args) -> str:
        console = Console(file=io.StringIO(), width=160, color_system=None)
        console.print(plan_panel(*args))
        return console.file.getvalue()

    with_problem = text(sched.plan, sched.problem)
    figures = DecisionFigures.of(sched.plan, sched.problem)
    for name, value in figures.rows():
        assert name in with_problem and value in with_problem
    for size in (figures.capacity_bytes, figures.peak_non_model_bytes, figures.resident_model_bytes,
                 figures.margin_bytes, figures.budget_bytes, figures.device_state_bytes,
                 figures.host_state_bytes):
        assert format_bytes(size) in with_problem
    assert "capacity" not in text(sched.plan).split("why")[0]  # without the problem: as before


def test_parameters_on_the_host_are_drawn_and_named() -> None:
    from policies.types import BACKWARD, FORWARD, ChunkAccess

    samples = [Sample(i * 1000, 0, "forward", "", "pre", "cuda:0", {"parameter": 4 * MiB, "activation": a},
                      4 * MiB + a, a) for i, a in enumerate((0, 6 * MiB, 2 * MiB))]
    timeline = MemoryTimeline(samples, {"device": "cuda:0", "steps": 1})
    chunks = tuple(ChunkSpec(i, device_bytes=3 * MiB, host_bytes=5 * MiB, param_bytes=MiB) for i in range(4))
    reads = [ChunkAccess(i, FORWARD, 2 * MiB) for i in range(4)] + \
        [ChunkAccess(i, BACKWARD, 6 * MiB) for i in reversed(range(4))]
    problem = PlacementProblem(capacity_bytes=10 * MiB, peak_non_model_bytes=6 * MiB,
                               resident_model_bytes=4 * MiB + MiB // 2, chunks=chunks, accesses=tuple(reads))
    plan = policies.get("auto").plan(problem)
    assert plan.param_host_chunks  # the parameters do not all fit beside the peak
    figures = DecisionFigures.of(plan, problem)
    per = MiB
    assert figures.params_on_host_bytes == len(plan.param_host_chunks) * per
    assert figures.fetched_param_bytes == plan.schedule.max_resident * per
    fig = exports.render_figure(timeline, plan=plan, problem=problem)
    found = artists(fig)
    on_host = sum(c.device_bytes for c in chunks)
    assert y_span(found["params-host"]) == pytest.approx((on_host, on_host + figures.params_on_host_bytes))
    legend = "\n".join(legend_texts(fig))
    assert (f"parameters on the host {format_bytes(figures.params_on_host_bytes)} "
            f"({len(plan.param_host_chunks)} chunks") in legend
    rows = dict(figures.rows())
    assert rows["parameters"].startswith(f"{len(plan.param_host_chunks)} chunk")
    # a saved decision from before these figures reads them as 0
    added = ("params_on_host_bytes", "param_host_chunks", "fetched_param_bytes", "grad_working_bytes")
    old = {k: v for k, v in figures.to_dict().items() if k not in added}
    assert DecisionFigures.from_dict(old).params_on_host_bytes == 0
