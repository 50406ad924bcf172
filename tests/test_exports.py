"""Exports: timeline JSON, Perfetto trace events, PyTorch memory_viz snapshots, PNG, write_all."""

from __future__ import annotations

import copy
import json
import pickle
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memsched.report import exports
from tracer.timeline import MemoryTimeline, Sample

MiB = 2**20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_timeline(steps: int = 2, *, rank: int = 0, cuda: bool = True, drop_post: str | None = None):
    """A trace on cuda:0 (plus host samples on cpu): root > block (called twice) > linear, then AdamW.

    ``drop_post`` removes the forward ``post`` samples of that module (a hook that never fired).
    """
    device = "cuda:0" if cuda else "cpu"
    live = defaultdict(int, parameter=4 * MiB, buffer=1000)  # an odd size: addresses must stay aligned
    samples: list[Sample] = []
    clock = [1_000_000]

    def add(step, phase, module, event, extra=0):
        clock[0] += 137_000  # ns: not a whole number of microseconds
        b = {
            k: live[k]
            for k in ("parameter", "buffer", "gradient", "optimizer_state", "activation", "temporary")
        }
        nm = b["activation"] + b["temporary"]
        info = (
            {
                "allocated": sum(b.values()),
                "peak_allocated": sum(b.values()) + extra,
                "reserved": sum(b.values()) + 2 * MiB,
                "nvml_used": 3 << 30,
            }
            if cuda
            else None
        )
        samples.append(
            Sample(clock[0], step, phase, module, event, device, b, sum(b.values()) + extra, nm + extra, info)
        )
        if cuda:  # the host, sampled at the same hooks
            samples.append(
                Sample(clock[0], step, phase, module, event, "cpu", {"other": 64 * MiB}, 64 * MiB, 0)
            )

    for step in range(steps):
        add(step, "forward", "", "pre")
        for _ in range(2):
            add(step, "forward", "block", "pre")
            add(step, "forward", "block.linear", "pre")
            live["activation"] += 3 * MiB + 7
            if drop_post != "block.linear":
                add(step, "forward", "block.linear", "post", extra=MiB)
            live["activation"] += MiB
            add(step, "forward", "block", "post")
        add(step, "forward", "", "post")
        add(step, "other", "loss", "mark")
        add(step, "backward", "", "pre")
        for _ in range(2):
            add(step, "backward", "block", "pre")
            add(step, "backward", "block.linear", "pre")
            live["activation"] -= 4 * MiB + 7
            live["gradient"] += MiB
            live["temporary"] += 2 * MiB
            add(step, "backward", "block.linear", "post", extra=MiB)
            live["temporary"] -= 2 * MiB
            add(step, "backward", "block", "post")
        add(step, "backward", "", "post")
        add(step, "optimizer", "AdamW", "pre")
        live["optimizer_state"] = 8 * MiB
        live["temporary"] += 5 * MiB + 3
        add(step, "optimizer", "AdamW", "post")
        live["temporary"] -= 5 * MiB + 3
        live["gradient"] = 0
    return MemoryTimeline(samples, {"device": device, "backend": "cuda" if cuda else "tensor", "rank": rank})


# ---- JSON ------------------------------------------------------------------------------------------------
def test_write_json_round_trips(tmp_path):
    tl = make_timeline()
    path = exports.write_json(tl, tmp_path / "t.json")
    back = MemoryTimeline.load(path)
    assert back.to_dict() == tl.to_dict()


# ---- Perfetto ----------------------------------------------------------------------------------------------
def check_nesting(events):
    """Complete events on one (pid, tid) must nest: each one starts after the enclosing one ended, or lies
    inside it."""
    by_thread = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_thread[(e["pid"], e["tid"])].append(e)
    eps = 1e-6  # microseconds computed from integer nanoseconds: allow float rounding only
    for slices in by_thread.values():
        stack = []
        for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - eps:
                stack.pop()
            if stack:
                outer = stack[-1]
                assert e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + eps, ("slices overlap", outer, e)
            stack.append(e)
    return by_thread


def test_check_nesting_catches_overlap():
    def x(ts, dur):
        return {"ph": "X", "pid": 0, "tid": 1, "ts": ts, "dur": dur}

    check_nesting([x(0, 10), x(2, 3), x(5, 5), x(10, 0), x(12, 1)])
    with pytest.raises(AssertionError, match="slices overlap"):
        check_nesting([x(0, 10), x(5, 10)])


def test_perfetto_is_valid_json_with_counters_and_nested_slices(tmp_path):
    tl = make_timeline()
    path = exports.write_perfetto([tl], tmp_path / "t.perfetto.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    # One counter event per sample on each device, in microseconds, carrying the sample's bytes.
    counters = [e for e in events if e["ph"] == "C" and e["name"].endswith("live bytes")]
    assert len(counters) == len(tl.samples)
    first_gpu = next(s for s in tl.samples if s.device == "cuda:0")
    c0 = next(e for e in counters if e["name"] == "cuda:0 live bytes")
    assert c0["ts"] == pytest.approx(first_gpu.t_ns / 1000)
    assert c0["args"]["parameter"] == 4 * MiB and c0["args"]["buffer"] == 1000
    assert {e["name"] for e in counters} == {"cuda:0 live bytes", "cpu live bytes"}
    alloc = [e for e in events if e["ph"] == "C" and e["name"] == "cuda:0 CUDA allocator bytes"]
    assert len(alloc) == len(tl.for_device()) and set(alloc[0]["args"]) == {"allocated", "reserved"}
    nvml = [e for e in events if e["ph"] == "C" and e["name"] == "cuda:0 NVML used bytes"]
    assert len(nvml) == len(tl.for_device()) and nvml[0]["args"] == {"nvml_used": 3 << 30}

    by_thread = check_nesting(events)
    fwd = by_thread[(0, exports.TID_FORWARD)]
    bwd = by_thread[(0, exports.TID_BACKWARD)]
    # block runs twice per step, 2 steps: 4 slices each, forward and backward on separate threads.
    assert sum(e["name"] == "block" for e in fwd) == 4 and sum(e["name"] == "block" for e in bwd) == 4
    assert sum(e["name"] == "block.linear" for e in fwd) == 4
    assert sum(e["name"] == "(root)" for e in fwd) == 2
    linear = next(e for e in fwd if e["name"] == "block.linear")
    assert linear["args"]["activation_delta_bytes"] == 3 * MiB + 7
    assert linear["dur"] == pytest.approx(137.0)  # one sample apart, in microseconds
    steps = by_thread[(0, exports.TID_STEPS)]
    assert [e["name"] for e in steps] == ["step 0", "step 1"]
    assert sum(e["ph"] == "i" for e in events) == 2  # the "loss" marks
    names = {
        (e["name"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]
    }
    assert names[("process_name", 0)] == "rank 0 (cuda:0)"
    assert names[("thread_name", exports.TID_BACKWARD)] == "backward (module)"


def test_perfetto_nests_when_a_post_is_missing():
    tl = make_timeline(drop_post="block.linear")
    events = exports.to_perfetto(tl)["traceEvents"]
    by_thread = check_nesting(events)
    linear = [e for e in by_thread[(0, exports.TID_FORWARD)] if e["name"] == "block.linear"]
    block = [e for e in by_thread[(0, exports.TID_FORWARD)] if e["name"] == "block"]
    assert len(linear) == 4 and all(e["args"]["unclosed"] for e in linear)
    for inner, outer in zip(linear, block, strict=True):  # closed where their parent closes
        assert inner["ts"] + inner["dur"] == pytest.approx(outer["ts"] + outer["dur"])


def test_perfetto_merges_ranks_and_rejects_duplicates():
    merged = exports.to_perfetto([make_timeline(rank=0), make_timeline(rank=1)])["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in merged if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "rank 0 (cuda:0)", 1: "rank 1 (cuda:0)"}
    assert {e["pid"] for e in merged if e["ph"] == "X"} == {0, 1}
    check_nesting(merged)
    with pytest.raises(ValueError, match="both have rank 1"):
        exports.to_perfetto([make_timeline(rank=1), make_timeline(rank=1)])
    with pytest.raises(ValueError, match="expected a MemoryTimeline"):
        exports.to_perfetto([{"samples": []}])


# ---- memory_viz ------------------------------------------------------------------------------------------
def replay(snapshot):
    """Live bytes per category after each time stamp, and a check that live blocks never overlap."""
    live = {}  # addr -> (size, category)
    per_time = {}
    for e in snapshot["device_traces"][0]:
        cat = e["frames"][0]["filename"]
        if e["action"] == "alloc":
            for a, (n, _) in live.items():
                assert e["addr"] + e["size"] <= a or a + n <= e["addr"], "overlapping live blocks"
            live[e["addr"]] = (e["size"], cat)
        elif e["action"] == "free_completed":
            assert live.pop(e["addr"]) == (e["size"], cat)
        sums = defaultdict(int)
        for n, c in live.values():
            sums[c] += n
        per_time[e["time_us"]] = dict(sums)
    return live, per_time


def test_memory_viz_matches_the_timeline_and_torch_reads_it(tmp_path):
    from torch.cuda import _memory_viz

    tl = make_timeline()
    path = exports.write_memory_viz(tl, tmp_path / "t.pickle")
    raw = path.read_bytes()
    assert raw[:2] == b"\x80\x04"  # pickle protocol 4
    snap = pickle.loads(raw)
    trace = snap["device_traces"][0]
    assert {e["action"] for e in trace} == {"alloc", "free_requested", "free_completed"}
    assert all(set(e) >= {"action", "addr", "size", "stream", "time_us", "frames"} for e in trace)

    # The live bytes per category equal the timeline's at every sample of the traced device.
    live, per_time = replay(snap)
    for s in tl.for_device():
        if s.t_ns // 1000 in per_time:
            got = per_time[s.t_ns // 1000]
            assert {k: v for k, v in got.items() if v} == {k: v for k, v in s.bytes.items() if v}
    # The segment holds exactly the blocks live at the end and accounts for every byte.
    (seg,) = snap["segments"]
    active = {b["address"]: b["requested_size"] for b in seg["blocks"] if b["state"] == "active_allocated"}
    assert active == {a: n for a, (n, _) in live.items()}
    assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]

    # torch's own memory_viz helpers accept it.
    stats = _memory_viz.segsum(copy.deepcopy(snap))
    assert "total_allocated" in stats
    text = _memory_viz.trace(copy.deepcopy(snap))
    assert f"{len(trace)} entries" in text
    flame = _memory_viz.memory(copy.deepcopy(snap), format_flamegraph=lambda lines: lines)
    assert "parameter:0:forward pre of (root)" in flame  # the category and module, as a stack frame
    assert "snapshot.pickle" in _memory_viz.trace_plot(copy.deepcopy(snap))
    assert "snapshot.pickle" in _memory_viz.segment_plot(copy.deepcopy(snap))
    if hasattr(_memory_viz, "filter_alloc_free_pairs"):  # newer than torch 2.4
        filtered = _memory_viz.filter_alloc_free_pairs(copy.deepcopy(snap))
        assert all(e["action"] == "alloc" for e in filtered["device_traces"][0])  # every free paired an alloc


# The pickle opcodes the unpickler of PyTorch's viewer (torch/utils/viz/MemoryViz.js) implements; any other
# opcode makes the viewer throw "UNKNOWN OPCODE".
VIEWER_OPCODES = {
    "PROTO",
    "FRAME",
    "STOP",
    "MARK",
    "MEMOIZE",
    "BINPUT",
    "LONG_BINPUT",
    "BINGET",
    "LONG_BINGET",
    "EMPTY_DICT",
    "DICT",
    "SETITEM",
    "SETITEMS",
    "EMPTY_LIST",
    "LIST",
    "APPEND",
    "APPENDS",
    "EMPTY_TUPLE",
    "TUPLE",
    "TUPLE1",
    "TUPLE2",
    "TUPLE3",
    "BININT",
    "BININT1",
    "BININT2",
    "LONG1",
    "BINFLOAT",
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "NONE",
    "NEWTRUE",
    "NEWFALSE",
}


def test_memory_viz_pickle_uses_only_opcodes_the_viewer_reads(tmp_path):
    import pickletools

    path = exports.write_memory_viz(make_timeline(), tmp_path / "t.pickle")
    used = {op.name for op, _, _ in pickletools.genops(path.read_bytes())}
    assert used <= VIEWER_OPCODES, used - VIEWER_OPCODES
    assert "LONG1" in used  # the 47-bit synthetic addresses (the viewer reads them as exact Numbers)


def test_memory_viz_address_span_tracks_the_live_peak():
    tl = make_timeline(steps=6)
    snap = exports.to_memory_viz(tl)
    peak_live = max(s.total_bytes for s in tl.for_device())
    # First-fit reuse: the synthetic segment is far smaller than the sum of everything ever allocated.
    allocated = sum(e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc")
    assert snap["segments"][0]["total_size"] < allocated / 2
    assert snap["segments"][0]["total_size"] >= peak_live


def test_memory_viz_of_an_empty_timeline():
    assert exports.to_memory_viz(MemoryTimeline([], {"device": "cpu"})) == {
        "segments": [],
        "device_traces": [[]],
    }


# ---- PNG -------------------------------------------------------------------------------------------------
def test_png_is_a_real_png(tmp_path):
    path = exports.write_png(make_timeline(), tmp_path / "t.png")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000


def hide_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_png_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    hide_matplotlib(monkeypatch)
    assert not exports.png_available()
    with pytest.raises(ImportError, match=r"pip install 'memsched\[plot\]'"):
        exports.write_png(make_timeline(), tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()
    written = exports.write_all(make_timeline(), tmp_path)
    assert set(written) == {"json", "perfetto", "memory_viz"}


# ---- write_all -------------------------------------------------------------------------------------------
def test_write_all_writes_every_export(tmp_path):
    tl = make_timeline()
    written = exports.write_all(tl, tmp_path / "out", stem="run")
    assert {k: p.name for k, p in written.items()} == {
        "json": "run.json",
        "perfetto": "run.perfetto.json",
        "memory_viz": "run.memory_viz.pickle",
        "png": "run.png",
    }
    assert MemoryTimeline.load(written["json"]).to_dict() == tl.to_dict()
    assert "traceEvents" in json.loads(written["perfetto"].read_text())
    assert pickle.loads(written["memory_viz"].read_bytes())["device_traces"]
    assert written["png"].read_bytes()[:8] == PNG_MAGIC
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in written.values())


def test_write_all_overrides_and_kinds(tmp_path):
    other = tmp_path / "elsewhere" / "x.json"
    written = exports.write_all(make_timeline(), tmp_path, overrides={"perfetto": other}, kinds=["perfetto"])
    assert written == {"perfetto": other} and other.exists()
    assert not (tmp_path / "trace.json").exists()
    with pytest.raises(ValueError, match="unknown export kind 'svg'"):
        exports.write_all(make_timeline(), tmp_path, kinds=["svg"])
    with pytest.raises(ValueError, match="unknown export kind 'html'"):
        exports.write_all(make_timeline(), tmp_path, overrides={"html": tmp_path / "a"})
    with pytest.raises(ValueError, match="stem"):
        exports.write_all(make_timeline(), tmp_path, stem="a/b")


def test_a_failed_export_writes_nothing(tmp_path, monkeypatch):
    old = tmp_path / "trace.json"
    old.write_text("previous run")

    def broken(timeline):
        raise KeyboardInterrupt  # as if Ctrl-C hit while rendering

    monkeypatch.setattr(exports, "_memory_viz_bytes", broken)
    with pytest.raises(KeyboardInterrupt):
        exports.write_all(make_timeline(), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"] and old.read_text() == "previous run"


def test_perfetto_backward_boundaries_in_either_order_still_nest():
    # The order torch's full backward hooks fire in for root > (head, shared x2), recorded from a real trace:
    # a post and the next pre are the same instant and come in either order.
    order = [
        ("pre", "head"),
        ("pre", ""),
        ("pre", "shared"),
        ("post", "head"),
        ("pre", "shared.fc"),
        ("pre", "shared.norm"),
        ("post", "shared.fc"),
        ("pre", "shared"),
        ("post", "shared"),
        ("post", "shared.norm"),
        ("pre", "shared.fc"),
        ("pre", "shared.norm"),
        ("post", "shared.fc"),
        ("post", "shared"),
        ("post", "shared.norm"),
        ("post", ""),
    ]
    samples = [
        Sample(1000 * (i + 1), 0, "backward", m, ev, "cpu", {"activation": 0}, 0, 0)
        for i, (ev, m) in enumerate(order)
    ]
    events = exports.to_perfetto(MemoryTimeline(samples, {"device": "cpu"}))["traceEvents"]
    slices = check_nesting(events)[(0, exports.TID_BACKWARD)]
    spans = {}
    for e in slices:
        spans.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert spans["(root)"] == [(1.0, 16.0)]  # starts with its first child
    # Two calls of shared, one after the other (FIFO), each holding its own fc and norm.
    assert sorted(spans["shared"]) == [(3.0, 8.0), (8.0, 14.0)]
    assert sorted(spans["shared.norm"]) == [(6.0, 8.0), (12.0, 14.0)]
    assert sorted(spans["shared.fc"]) == [(5.0, 6.0), (11.0, 12.0)]
    assert spans["head"] == [(1.0, 3.0)]  # until the next module starts
    assert not any(e["args"].get("unclosed") for e in slices)


@pytest.mark.skipif(not hasattr(__import__("tracer"), "MemoryTracer"), reason="needs tracer.MemoryTracer")
def test_perfetto_of_a_real_trace_nests():
    import importlib.util

    import torch

    from tracer import MemoryTracer

    spec = importlib.util.spec_from_file_location(
        "_example_target", Path(__file__).resolve().parents[1] / "examples" / "trace_target.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, loss_fn = example.build(torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters())
    with MemoryTracer(model, optimizer=opt, backend="tensor") as tracer:
        for _ in range(2):
            loss_fn(model).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    events = exports.to_perfetto(tracer.timeline)["traceEvents"]
    by_thread = check_nesting(events)
    for tid in (exports.TID_FORWARD, exports.TID_BACKWARD):
        slices = by_thread[(0, tid)]
        assert sum(e["name"] == "shared" for e in slices) == 4  # 2 calls x 2 steps
        assert not any(e["args"].get("unclosed") for e in slices)
    assert [e["name"] for e in by_thread[(0, exports.TID_OPTIMIZER)]] == ["AdamW", "AdamW"]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(["parameter", "gradient", "activation", "temporary"]),
            st.integers(0, 5000),
            min_size=1,
        ),
        min_size=1,
        max_size=25,
    )
)
def test_memory_viz_replays_any_byte_sequence(byte_maps):
    from torch.cuda import _memory_viz

    samples = [
        Sample(1000 * (i + 1), 0, "forward", "m", "post", "cpu", b, 0, 0) for i, b in enumerate(byte_maps)
    ]
    snap = exports.to_memory_viz(MemoryTimeline(samples, {"device": "cpu"}))
    live, per_time = replay(snap)  # asserts that live blocks never overlap
    for s in samples:
        want = {k: v for k, v in s.bytes.items() if v}
        got = per_time.get(s.t_ns // 1000)
        if got is not None:
            assert {k: v for k, v in got.items() if v} == want
    assert {k: v for k, v in samples[-1].bytes.items() if v} == {
        c: sum(n for n, cat in live.values() if cat == c) for c in {cat for _, cat in live.values()}
    }
    if snap["segments"]:
        _memory_viz.segsum(snap)  # torch's own accounting check: blocks tile the segment
