"""The stand-in's modelled host link (``device="sim:SIZE,link=25GBps"``, :mod:`memsched.devices.transfers`):
parsing, copies that take bytes / bandwidth on their copy threads, training bit for bit as without the link,
the step timeline's copy and wait spans, and no thread left after ``close()``.

Timings use generous bounds: the machine is shared and noisy.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

import memsched
from memsched.devices.spec import parse_bandwidth, parse_device
from memsched.devices.transfers import SimEvent, Streams
from memsched.telemetry.step_timeline import D2H, H2D, WAITS
from policies.types import HOST
from tests._numerics import gpt_batches, gpt_loss, same, tiny_gpt

MiB = 2**20
CPU = torch.device("cpu")


def _copy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("memsched-")]


# ---- parsing -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("25GBps", 25e9), ("25GB/s", 25e9), ("25 GB/s", 25e9), ("12GiBps", 12 * 2**30), ("12GiB/s", 12 * 2**30),
    ("800MBps", 800e6), ("1.5GBps", 1.5e9), ("100kBps", 1e5), ("64KiB/s", 64 * 1024), ("5e2MBps", 5e8),
    ("1000Bps", 1000.0),
])
def test_bandwidth_spellings(text: str, expected: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(expected)


def test_link_option_on_the_stand_in() -> None:
    spec = parse_device("sim:2GiB,link=25GBps")
    assert (spec.kind, spec.capacity_bytes, spec.link_bytes_per_s, spec.host_capacity_bytes) == \
        ("sim", 2 * 2**30, 25e9, None)
    both = parse_device("sim:2GiB, link=12GiB/s ,host=1GiB")
    assert (both.link_bytes_per_s, both.host_capacity_bytes) == (12 * 2**30, 2**30)
    assert parse_device("sim:2GiB,host=1GiB,link=1GBps").link_bytes_per_s == 1e9
    assert parse_device("sim:2GiB").link_bytes_per_s is None


@pytest.mark.parametrize(("device", "match"), [
    ("sim:2GiB,link=", r"lacks a bandwidth for the host link.*25GBps"),
    ("sim:2GiB,link=fast", r"cannot parse bandwidth 'fast'.*25GBps, 25GB/s, 12GiBps"),
    ("sim:2GiB,link=25GB", r"cannot parse bandwidth '25GB'.*bytes per second"),
    ("sim:2GiB,link=25", r"cannot parse bandwidth '25'"),
    ("sim:2GiB,link=25Gbps", r"'25Gbps' is in bits per second.*'3.125GBps'"),
    ("sim:2GiB,link=0GBps", r"'0GBps' must be > 0"),
    ("sim:2GiB,link=-1GBps", r"cannot parse bandwidth '-1GBps'"),
    ("sim:2GiB,link=1e999GBps", r"'1e999GBps' must be > 0 and finite"),
    ("sim:2GiB,link=1GBps,link=2GBps", r"link= is given twice"),
    ("sim:2GiB,bandwidth=1GBps", r"takes only 'host=SIZE'.*'link=BANDWIDTH'.*got 'bandwidth=1GBps'"),
])
def test_bad_links_name_the_value_and_what_is_allowed(device: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_device(device)


# ---- copies on the link ------------------------------------------------------------------------------------
def test_a_copy_takes_bytes_over_bandwidth_on_its_thread() -> None:
    streams = Streams(CPU, 100e6)  # 100 MB/s
    try:
        src, dst = torch.arange(MiB, dtype=torch.float32), torch.zeros(MiB)  # 4 MiB
        modelled = 4 * MiB / 100e6  # ~42 ms
        t0 = time.perf_counter()
        ev = streams.copy_h2d(dst, src)
        queued = time.perf_counter() - t0
        assert isinstance(ev, SimEvent) and ev.nbytes == 4 * MiB
        assert queued < modelled / 2 and not ev.query()  # asynchronous, like a side stream
        ev.synchronize()
        took = time.perf_counter() - t0
        assert 0.8 * modelled <= took <= 5 * modelled, (took, modelled)
        assert ev.query() and same(dst, src)
    finally:
        streams.close()


def test_copies_serialise_per_direction_and_overlap_across() -> None:
    streams = Streams(CPU, 100e6)
    try:
        n = MiB // 2  # 2 MiB: ~21 ms each
        modelled = 2 * MiB / 100e6
        src = [torch.full((n,), float(i)) for i in range(3)]
        dst = [torch.zeros(n) for _ in range(3)]
        t0 = time.perf_counter()
        a = streams.copy_h2d(dst[0], src[0])
        b = streams.copy_h2d(dst[1], src[1])
        streams.wait([a, b])
        same_direction = time.perf_counter() - t0
        t0 = time.perf_counter()
        c = streams.copy_h2d(dst[2], src[2])
        d = streams.copy_d2h(src[0], dst[1])  # the other engine: src[0] takes dst[1]'s values
        streams.wait([c, d])
        both_directions = time.perf_counter() - t0
        assert 0.8 * 2 * modelled <= same_direction <= 5 * 2 * modelled
        assert 0.8 * modelled <= both_directions < 0.9 * same_direction  # the two engines overlap
        assert all(same(d_, torch.full((n,), float(i))) for i, d_ in enumerate(dst))
        assert same(src[0], dst[1])
    finally:
        streams.close()


def test_a_copy_after_an_event_waits_for_it_and_versions_move_when_queued() -> None:
    streams = Streams(CPU, 100e6)
    try:
        n = MiB // 2
        host, dev, back = torch.arange(n, dtype=torch.float32), torch.zeros(n), torch.zeros(n)
        view = dev[:10]  # shares the version counter, as a parameter does its chunk's
        before = view._version
        first = streams.copy_h2d(dev, host)
        assert view._version == before + 1  # at once, as a CUDA copy when it is queued
        second = streams.copy_d2h(back, dev, after=first)  # reads what the first one writes
        second.wait()
        assert first.query() and same(back, host)
    finally:
        streams.close()


def test_without_a_link_copies_are_synchronous_as_before() -> None:
    streams = Streams(CPU)
    src, dst = torch.ones(8), torch.zeros(8)
    assert streams.copy_h2d(dst, src) is None and same(dst, src)
    assert streams.link is None and not streams.asynchronous and streams.record() is None
    streams.wait([None])
    assert not _copy_threads()


def test_a_closed_link_copies_synchronously_and_starts_no_thread() -> None:
    streams = Streams(CPU, 1e9)
    ev = streams.copy_h2d(torch.zeros(4), torch.ones(4))
    assert _copy_threads() == ["memsched-h2d-copy"]
    streams.close()
    assert ev.query() and not _copy_threads() and not streams.asynchronous
    dst = torch.zeros(4)
    assert streams.copy_d2h(dst, torch.ones(4)) is None and same(dst, torch.ones(4))
    assert not _copy_threads()


def test_a_failed_copy_raises_where_it_is_waited_for_and_the_stream_goes_on() -> None:
    streams = Streams(CPU, 1e9)
    try:
        bad = streams.copy_h2d(torch.zeros(4), torch.ones(5))  # shapes that do not broadcast
        dst = torch.zeros(4)
        good = streams.copy_h2d(dst, torch.ones(4))
        with pytest.raises(RuntimeError, match="h2d copy of 16 bytes on the stand-in's link failed"):
            bad.synchronize()
        good.synchronize()
        assert same(dst, torch.ones(4))
    finally:
        streams.close()


def test_a_copy_thread_never_waits_for_itself() -> None:
    # The scheduler's finalizer may run on a copy thread (the garbage collector runs where it is triggered):
    # its waits for that thread's own copies must not hang, and closing there ends the thread after them.
    streams = Streams(CPU, 1e9)
    later: list[SimEvent] = []

    class FinalizerOnTheCopyThread:
        def synchronize(self) -> None:
            while not later:
                time.sleep(0.001)
            streams.wait(later)  # queued behind this copy, on this thread
            streams.close()

    first = streams.copy_h2d(torch.zeros(4), torch.ones(4), after=FinalizerOnTheCopyThread())
    dst = torch.zeros(4)
    later.append(streams.copy_h2d(dst, torch.ones(4)))
    later[0].synchronize()
    assert first.query() and same(dst, torch.ones(4))
    streams.h2d.thread.join(timeout=5)
    assert not _copy_threads()


# ---- training ----------------------------------------------------------------------------------------------
def _train(device: str, overlap, steps: int = 4, dtype: torch.dtype | None = None, chunk_numel: int = 8192):
    model = tiny_gpt()  # 34,176 parameters: 6 chunks of 8,192 elements, or 2 of 17,408
    if dtype is not None:
        model.to(dtype)
    sched = memsched.attach(model, policy="cpu", device=device, overlap=overlap, chunk_numel=chunk_numel,
                            lr=1e-2, dtype=dtype)
    for b in gpt_batches(steps):
        sched.backward(gpt_loss(model, b))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
    return model, sched


# 20 MB/s: each chunk's copy takes ~1.6 ms, so copies are in flight when the next forward or step reads.
@pytest.mark.parametrize(("overlap", "dtype"), [(False, None), (True, None), ("backward", None),
                                                (True, torch.bfloat16)],
                         ids=["serial", "overlap", "backward", "overlap-bf16"])
def test_training_on_a_slow_link_is_bit_exact(overlap, dtype) -> None:
    plain, ps = _train("sim:64MiB", overlap, dtype=dtype)
    linked, ls = _train("sim:64MiB,link=20MBps", overlap, dtype=dtype)
    try:
        ps.synchronize()
        ls.synchronize()
        assert ls.streams.asynchronous and ls.waits.needed
        assert all(c.placement == HOST for c in ls.store.chunks) and len(ls.store.chunks) > 2
        totals = ("h2d_bytes", "d2h_bytes", "steps", "chunk_moves_bytes")  # last_*: the worker's timing
        assert [ls.transfers[k] for k in totals] == [ps.transfers[k] for k in totals]
        for (name, p), q in zip(plain.named_parameters(), linked.parameters(), strict=True):
            assert same(p, q), name
        a, b = ps.optimizer.state_dict(), ls.optimizer.state_dict()
        for i in a["state"]:
            for k in a["state"][i]:
                assert same(a["state"][i][k], b["state"][i][k]), (i, k)
    finally:
        ps.close()
        ls.close()


def test_the_step_timeline_attributes_copies_and_stalls() -> None:
    # 1 MB/s and 2 chunks: the last chunk's H2D, queued at the end of the step, takes ~70 ms, far longer than
    # the next forward before it reads the chunk.
    model, sched = _train("sim:64MiB,link=1MBps", False, steps=3, chunk_numel=17408)
    try:
        summary = sched.step_timeline.mean_summary()
        assert summary["h2d_s"] > 0 and summary["d2h_s"] > 0 and summary["copy_wait_s"] > 0
        assert summary["h2d_copy_bytes"] > 0 and summary["d2h_copy_bytes"] > 0
        assert summary["waits_s"] >= summary["copy_wait_s"]
        spans = [s for r in sched.step_timeline.records for s in r.spans]
        copies = {tr: [s for s in spans if s.track == tr] for tr in (H2D, D2H)}
        for track, ss in copies.items():
            assert ss and all(s.args["bytes"] > 0 and s.seconds >= 0.8 * s.args["bytes"] / 1e6 for s in ss)
            assert all(s.name.startswith(track) for s in ss)
        waits = [s for s in spans if s.track == WAITS and "copy" in s.args]
        assert any(w.args["copy"] == "h2d" and w.name.endswith("(h2d copy)") and "<- chunk" in w.name
                   for w in waits)  # a module's forward
        names = {e["args"]["name"] for e in sched.step_timeline.to_perfetto_events() if e["ph"] == "M"}
        assert {"h2d", "d2h", "waits"} <= names
        assert any(w.args["copy"] == "d2h" for w in waits)  # backward's end, for the gradients
    finally:
        sched.close()


def test_overlapped_waits_for_copies_are_not_counted_as_exposed_cpu_update() -> None:
    _, sched = _train("sim:64MiB,link=10MBps", True, steps=4)
    try:
        rows = sched.step_timeline.summaries()
        assert any(r["copy_wait_s"] > 0 for r in rows)
        for r in rows:
            assert r["exposed_cpu_s"] == pytest.approx(r["waits_s"] - r["copy_wait_s"], abs=1e-9)
    finally:
        sched.close()


# ---- teardown ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_no_thread_outlives_close(overlap) -> None:
    model, sched = _train("sim:64MiB,link=50MBps", overlap, steps=3)
    assert "memsched-h2d-copy" in _copy_threads() and "memsched-d2h-copy" in _copy_threads()
    sched.close()
    assert not _copy_threads(), _copy_threads()
    # The optimizer keeps working after close(), with synchronous copies and no new thread.
    sched.backward(gpt_loss(model, gpt_batches(1, seed=5)[0]))
    sched.optimizer.step()
    assert not _copy_threads()


def test_no_thread_outlives_a_scheduler_dropped_without_close() -> None:
    model, sched = _train("sim:64MiB,link=50MBps", False, steps=2)
    assert _copy_threads()
    del sched
    gc.collect()
    assert not _copy_threads(), _copy_threads()
    del model


def test_the_bench_script_runs(tmp_path, monkeypatch) -> None:
    # bench/link_model.py, tiny: it cannot rot (timings live in its committed result, not here).
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import link_model

    monkeypatch.setenv("MEMSCHED_BENCH_OUT", str(tmp_path))
    assert link_model.main(["--blocks", "2", "--block", "2", "--warmup", "2", "--links", "500MBps",
                            "--batch", "2", "--seq", "16", "--name", "smoke"]) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["bit_identical"] and result["runs"]["500MBps"]["h2d_copy_bytes"] > 0
    assert not _copy_threads()
