"""ZeRO-0/1/2 over torch.distributed (gloo, CPU, local processes): parity with single-process AdamW on the
same global batch, sharded state sizes, accumulation, fetch modes, failures and timeouts.

Launches are few and each runs several configurations in sequence (the machine has 2 cores)."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

import memsched
from memsched.chunks import chunk_bytes
from memsched.distributed import (
    ZeroAccumulationWarning,
    ZeroCommError,
    check_zero_options,
    padded_chunk_numel,
    param_shards,
    shard_range,
    shard_state_numel,
)
from tests._dist_utils import run_ranks
from tests._numerics import same, to_dev

pytestmark = pytest.mark.slow  # several processes per test: started first (tests/conftest.py)

STEPS = 3
LR, WD = 1e-2, 0.1
BATCH = 12  # global batch per micro-batch; divisible by 1, 2, 3


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # Odd sizes: chunks that do not divide by 2 or 3, parameters straddling the ranks' shards.
    return torch.nn.Sequential(
        torch.nn.Linear(7, 13),
        torch.nn.Tanh(),
        torch.nn.Linear(13, 11),
        torch.nn.Tanh(),
        torch.nn.Linear(11, 5),
    )


def batches(n_steps: int, accum: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(BATCH, 7, generator=g), torch.randn(BATCH, 5, generator=g)) for _ in range(accum)]
        for _ in range(n_steps)
    ]


def reference(n_steps: int, accum: int, clip: float | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Single-process torch.optim.AdamW on the global batches (gradients clipped to ``clip`` if given)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    for micro in batches(n_steps, accum):
        for x, y in micro:
            (torch.nn.functional.mse_loss(model(x), y) / accum).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict()


def _train_rank(rank: int, world: int, cfg: dict) -> dict:
    model = make_model(seed=100 + rank)  # different on each rank: attach must broadcast rank 0's
    if rank == 0:
        model.load_state_dict(make_model().state_dict())
    accum = cfg.get("accum", 1)
    sched = memsched.attach(
        model,
        policy=cfg.get("policy", "auto"),
        device=cfg["device"],
        lr=LR,
        weight_decay=WD,
        zero_stage=cfg["stage"],
        chunk_build=cfg.get("build", "auto"),
        fetch=cfg["fetch"],
        policy_options=cfg.get("policy_options"),
    )
    caught: list[str] = []
    norms: list[float] = []
    with sched, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always", ZeroAccumulationWarning)
        per = BATCH // world
        for micro in batches(STEPS, accum):
            for k, (x, y) in enumerate(micro):
                dev = sched.device.torch_device
                xs, ys = x[rank * per : (rank + 1) * per].to(dev), y[rank * per : (rank + 1) * per].to(dev)
                ctx = sched.no_sync() if k < accum - 1 else _null()
                with ctx:
                    sched.backward(torch.nn.functional.mse_loss(model(xs), ys) / accum)
            if cfg.get("clip") is not None:
                norms.append(float(sched.clip_grad_norm_(cfg["clip"])))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        caught = [str(x.message) for x in w if issubclass(x.category, ZeroAccumulationWarning)]
        full_sd = sched.optimizer.state_dict()
    store = sched.store
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state": {i: {k: v.clone() for k, v in st.items()} for i, st in full_sd["state"].items()},
        "exp_avg_numel": sum(c.exp_avg.numel() for c in store.chunks),
        "state_bytes": sum(c.state_nbytes() for c in store.chunks),
        "chunk_numel": store.layout.chunk_numel,
        "n_chunks": store.layout.n_chunks,
        "used_numel": sum(store.layout.used_numel(i) for i in range(store.layout.n_chunks)),
        "shards": [(c.lo, c.hi) for c in store.chunks],
        "placement": [c.placement for c in store.chunks],
        "n_params": [len(c.params) for c in store.chunks],
        "warnings": caught,
        "stats": dict(sched.zero.stats),
        "build": sched.zero.build_stats["decisions"],
        "norms": norms,
    }


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def _run_configs(rank: int, world: int, cfgs: list[dict]) -> list[dict]:
    return [_train_rank(rank, world, cfg) for cfg in cfgs]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.cpu(), b.cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _state_bytes(res: dict, world: int) -> int:
    """Optimizer-state bytes by memsched.chunks.chunk_bytes (the planner's arithmetic, step count included)
    for the rank's chunks and placements, each chunk's state split over ``world`` ranks."""
    total = 0
    for where, n_params in zip(res["placement"], res["n_params"], strict=True):
        cb = chunk_bytes(res["chunk_numel"], shard_numel=res["chunk_numel"] // world, n_params=n_params)
        total += cb.device_state_bytes if where == "device" else cb.host_state_bytes
    return total


def _check(results: list[list[dict]], cfgs: list[dict], world: int) -> None:
    refs = {}
    for ci, cfg in enumerate(cfgs):
        key = (cfg.get("accum", 1), cfg.get("clip"))
        if key not in refs:
            refs[key] = reference(STEPS, *key)
        ref_params, ref_sd = refs[key]
        per_rank = [results[r][ci] for r in range(world)]
        for r, res in enumerate(per_rank):
            for name, ref in ref_params.items():
                got = res["params"][name]
                assert _rel(got, ref) < 1e-6, (cfg, r, name, _rel(got, ref))
                # every rank holds the same parameters, bit for bit, after the fetch
                assert same(got, per_rank[0]["params"][name]), (cfg, r, name)
            for i, st in ref_sd["state"].items():
                for k in ("exp_avg", "exp_avg_sq"):
                    assert _rel(res["state"][i][k], st[k]) < 1e-5, (cfg, r, i, k)
                assert float(res["state"][i]["step"]) == float(st["step"])
        # chunks built where asked ("auto": the stand-in / CPU has room for every chunk)
        want = "cpu" if cfg.get("build") == "cpu" else "device"
        assert all(d == want for res in per_rank for d in res["build"]), cfg
        if cfg.get("clip") is not None:  # clipping engaged, with the same global norm on every rank
            assert max(per_rank[0]["norms"]) > cfg["clip"]
            assert all(res["norms"] == per_rank[0]["norms"] for res in per_rank)
        # sharding: every rank holds 1/world of the (padded) optimizer state, and the shards tile each chunk
        r0 = per_rank[0]
        total = r0["n_chunks"] * r0["chunk_numel"]
        if cfg["stage"] >= 1:
            assert r0["chunk_numel"] % world == 0
            assert all(res["exp_avg_numel"] * world == total for res in per_rank)
            assert all(res["state_bytes"] == r0["state_bytes"] for res in per_rank)
            # bytes: each rank holds 1/world of what one process would hold for the same (padded) chunks,
            # apart from the fp32 step counts (one per parameter) that every rank keeps
            single = _state_bytes(r0, 1)
            assert r0["state_bytes"] == _state_bytes(r0, world)
            assert r0["state_bytes"] * world - single == 4 * sum(r0["n_params"]) * (world - 1)
            assert total - r0["used_numel"] >= 0
            for c in range(r0["n_chunks"]):
                spans = sorted(res["shards"][c] for res in per_rank)
                assert spans[0][0] == 0 and spans[-1][1] == r0["chunk_numel"]
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        else:
            assert all(res["exp_avg_numel"] == total for res in per_rank)
        # ZeRO-2 with accumulation warns once; nothing else warns
        expect_warn = cfg["stage"] >= 2 and cfg.get("accum", 1) > 1
        assert all(len(res["warnings"]) == (1 if expect_warn else 0) for res in per_rank), cfg
        # reductions: one per chunk per optimizer step (accumulation reduces once per boundary)
        assert r0["stats"]["reductions"] == STEPS * r0["n_chunks"] or r0["stats"]["reductions"] >= STEPS, cfg


SIM_MIXED = {"device": "sim:64MiB", "policy": "static", "policy_options": {"offload_optim_frac": 0.5}}
CPU = {"device": "cpu"}

CONFIGS_2 = [
    {**SIM_MIXED, "stage": 1, "fetch": "all_gather"},
    {**SIM_MIXED, "stage": 1, "fetch": "all_reduce", "build": "cpu"},
    {**SIM_MIXED, "stage": 2, "fetch": "all_gather"},
    {**CPU, "stage": 2, "fetch": "all_reduce"},
    {**SIM_MIXED, "stage": 2, "fetch": "all_gather", "accum": 2},
    {**CPU, "stage": 1, "fetch": "all_gather", "accum": 3},
    {**SIM_MIXED, "stage": 0, "fetch": "all_gather"},
    {**SIM_MIXED, "stage": 2, "fetch": "all_gather", "clip": 0.05},
    {**SIM_MIXED, "stage": 3, "fetch": "all_gather", "clip": 0.05},
    {**CPU, "stage": 3, "fetch": "all_reduce", "accum": 2},
]
CONFIGS_3 = [
    {**SIM_MIXED, "stage": 1, "fetch": "all_gather", "build": "cpu"},
    {**SIM_MIXED, "stage": 2, "fetch": "all_reduce"},
    {**CPU, "stage": 2, "fetch": "all_gather", "accum": 2},
    {**CPU, "stage": 1, "fetch": "all_reduce", "clip": 0.05},
    {**SIM_MIXED, "stage": 3, "fetch": "all_reduce", "build": "cpu"},
]


@pytest.mark.parametrize(("world", "cfgs"), [(2, CONFIGS_2), (3, CONFIGS_3)], ids=["world2", "world3"])
def test_parity_with_single_process_adamw(world: int, cfgs: list[dict]) -> None:
    results = run_ranks(_run_configs, world, cfgs, timeout=240)
    _check(results, cfgs, world)


# ---- failures: a rank that dies gives the others a clear error within the timeout --------------------------
def _dies_before_attach(rank: int, world: int) -> dict:
    if rank == 1:
        os._exit(0)  # never reaches attach
    t0 = time.monotonic()
    try:
        memsched.attach(make_model(), device="cpu", zero_stage=1, dist_timeout=2.0)
    except ZeroCommError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def _dies_mid_training(rank: int, world: int) -> dict:
    model = make_model()
    sched = memsched.attach(model, device="cpu", zero_stage=2)
    x, y = batches(1, 1)[0][0]
    t0 = time.monotonic()
    try:
        for step in range(3):
            if rank == 1 and step == 1:
                os._exit(0)  # dies between steps: rank 0's next collective must fail, not hang
            sched.backward(torch.nn.functional.mse_loss(model(x), y))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
    except ZeroCommError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def _hangs(rank: int, world: int) -> dict:
    model = make_model()
    if rank == 1:
        time.sleep(6)  # hangs before attach, then leaves
        os._exit(0)
    t0 = time.monotonic()
    try:
        memsched.attach(model, device="cpu", zero_stage=1, dist_timeout=1.5)
    except ZeroCommError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def test_hung_rank_is_named_after_dist_timeout() -> None:
    res = run_ranks(_hangs, 2, timeout=60, pg_timeout_s=30, allow_exit=(1,))
    r0 = res[0]
    assert r0["error"] is not None and "Ranks 1 failed to pass monitoredBarrier" in r0["error"]
    assert 1.4 < r0["seconds"] < 5.9  # the attach timeout, not the group's 30 s nor the 6 s hang


def test_rank_dead_before_attach_is_named_within_the_timeout() -> None:
    res = run_ranks(_dies_before_attach, 2, timeout=60, pg_timeout_s=20, allow_exit=(1,))
    r0 = res[0]
    assert r0["error"] is not None and "barrier at memsched.attach" in r0["error"]
    assert "rank 0 of 2" in r0["error"] and "1" in r0["error"]
    assert r0["seconds"] < 15  # bounded by dist_timeout=2 s, far below the group's 20 s


def test_rank_dead_mid_training_raises_instead_of_hanging() -> None:
    res = run_ranks(_dies_mid_training, 2, timeout=60, pg_timeout_s=5, allow_exit=(1,))
    r0 = res[0]
    assert r0["error"] is not None, "rank 0 trained on without its peer"
    assert "failed on rank 0 of 2" in r0["error"] and "peer rank" in r0["error"]
    assert r0["seconds"] < 30


# ---- pure layout math --------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", [1, 5, 143, 144, 1000])
def test_pieces_tile_the_padded_chunk_evenly(numel: int, world: int) -> None:
    padded = padded_chunk_numel(numel, world)
    assert padded % world == 0 and numel <= padded < numel + world
    spans = [shard_range(padded, r, world) for r in range(world)]
    assert spans[0][0] == 0 and spans[-1][1] == padded
    assert all(hi - lo == padded // world for lo, hi in spans)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert shard_state_numel(numel, 3, world) * world == 3 * padded


def test_param_shards_split_straddling_parameters() -> None:
    ranges = [(0, 5), (5, 4), (9, 3)]  # a chunk of 12 over 3 ranks: shards [0,4) [4,8) [8,12)
    got = [param_shards(ranges, *shard_range(12, r, 3)) for r in range(3)]
    # each parameter's parts over the ranks add up to the parameter, in order and without overlap
    for i, (off, n) in enumerate(ranges):
        parts = [g[i] for g in got if g[i] is not None]
        assert sum(p.numel for p in parts) == n
        assert [p.param_start for p in parts] == sorted(p.param_start for p in parts)
        assert all(p.chunk_start == off + p.param_start for p in parts)
    assert got[0][2] is None and got[2][0] is None
    assert got[1][0].shard_start == 0 and got[1][0].param_start == 4 and got[1][0].numel == 1


def test_bad_layout_values_raise() -> None:
    with pytest.raises(ValueError, match="multiple of the world size 3"):
        shard_range(10, 0, 3)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 3\)"):
        shard_range(12, 3, 3)
    with pytest.raises(ValueError, match="world size must be an integer >= 1"):
        padded_chunk_numel(10, 0)


# ---- options and world size 1 ------------------------------------------------------------------------------
def test_bad_zero_options_list_the_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"zero_stage must be one of \(0, 1, 2, 3\).*got 4"):
        check_zero_options(4, "all_gather")
    with pytest.raises(ValueError, match=r"fetch must be one of \('all_gather', 'all_reduce'\).*'broadcast'"):
        check_zero_options(1, "broadcast")
    with pytest.raises(ValueError, match="zero_stage must be one of"):
        memsched.attach(make_model(), device="cpu", zero_stage=True)
    with pytest.raises(ValueError, match="fetch must be one of"):
        memsched.attach(make_model(), device="cpu", fetch="gather")
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        memsched.attach(make_model(), device="cpu", process_group=object())


def _train_single(**kw: object) -> dict[str, torch.Tensor]:
    model = make_model()
    with memsched.attach(model, device="sim:64MiB", lr=LR, weight_decay=WD, **kw) as sched:
        assert sched.zero is None
        for micro in batches(STEPS, 1):
            x, y = to_dev(micro[0], sched.device.torch_device)
            sched.backward(torch.nn.functional.mse_loss(model(x), y))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_world_size_one_is_exactly_single_process() -> None:
    plain = _train_single()
    for stage, fetch in [(2, "all_reduce"), (0, "all_gather")]:
        got = _train_single(zero_stage=stage, fetch=fetch)
        assert all(same(got[n], plain[n]) for n in plain)


# ---- per-rank reports --------------------------------------------------------------------------------------
def _report_rank(rank: int, world: int, path: str) -> dict | None:
    import io
    import json

    from rich.console import Console

    from memsched.report.ranks import rank_summary, write_rank_reports
    from policies.units import format_bytes

    model = make_model()
    with memsched.attach(model, device="sim:64MiB", zero_stage=1, **{"policy": "static"}) as sched:
        x, y = to_dev(batches(1, 1)[0][0], sched.device.torch_device)
        for _ in range(2):
            sched.backward(torch.nn.functional.mse_loss(model(x), y))
            sched.optimizer.step()
            sched.optimizer.zero_grad()
        got = write_rank_reports(sched, path)
        state = format_bytes(rank_summary(sched).optimizer_state_bytes)
    if got is None:
        return None
    out, table = got
    buf = io.StringIO()
    Console(file=buf, width=200).print(table)
    trace = json.loads(out.read_text())
    return {"pids": sorted({e["pid"] for e in trace["traceEvents"]}), "table": buf.getvalue(), "state": state}


def test_per_rank_reports_merge_on_rank_0(tmp_path) -> None:
    res = run_ranks(_report_rank, 2, str(tmp_path / "trace.json"), timeout=60)
    assert res[1] is None
    assert res[0]["pids"] == [0, 1]
    lines = [ln for ln in res[0]["table"].splitlines() if "sim" in ln]
    assert len(lines) == 2  # one row per rank
    # one row per rank, in rank order, each with the optimizer state and step count the ranks computed
    assert [ln.split("│")[1].strip() for ln in lines] == ["0", "1"]
    assert all(res[0]["state"] in ln for ln in lines)
    assert all(ln.split("│")[-2].strip() == "2" for ln in lines)  # steps


# ---- fp16: an overflow on one rank skips the step on every rank -------------------------------------------
def _fp16_rank(rank: int, world: int, stage: int) -> dict:
    model = make_model().half()
    sched = memsched.attach(model, device="cpu", dtype=torch.float16, zero_stage=stage, lr=LR)
    x, y = batches(1, 1)[0][0]
    per = BATCH // world
    xs, ys = x[rank * per : (rank + 1) * per].half(), y[rank * per : (rank + 1) * per].half()
    skipped = []
    with sched:
        for step in range(3):
            sched.backward(torch.nn.functional.mse_loss(model(xs), ys))
            if step == 1:
                sched.clip_grad_norm_(1e30)  # a no-op clip that finishes the gradient reductions
                if rank == 1:
                    # ZeRO-2/3: rank 1 holds only its shard of the reduced gradients: only rank 1 sees this
                    with torch.no_grad():
                        sched.store.chunks[0].grad_shard[0] = float("inf")
            with sched.gathered_params():  # ZeRO-3: whole parameters between steps
                before = {n: p.detach().clone() for n, p in model.named_parameters()}
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.gathered_params():
                skipped.append(all(same(before[n], p) for n, p in model.named_parameters()))
        with sched.gathered_params():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return {"skipped": skipped, "count": sched.scaler.skipped_steps, "scale": float(sched.scaler.scale),
                "params": params}


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(stage: int) -> None:
    res = run_ranks(_fp16_rank, 2, stage, timeout=60)
    for r in res:
        # step 1 skipped on both ranks; step 0 may overflow at the initial scale, on both alike
        assert r["skipped"][1] and not r["skipped"][2] and r["count"] == sum(r["skipped"])
    assert res[0]["skipped"] == res[1]["skipped"] and res[0]["scale"] == res[1]["scale"]
    assert all(same(res[0]["params"][n], res[1]["params"][n]) for n in res[0]["params"])


# ---- where chunks are built -----------------------------------------------------------------------------
def test_plan_build_falls_back_to_cpu_per_chunk() -> None:
    from memsched.distributed import plan_build

    # buffers of 10 B per chunk, parameter copies of 30 B: 2 full copies fit, the 3rd not, then a chunk whose
    # parameters are on the device already (only its buffers needed) fits again
    assert plan_build([30, 30, 30, 0], 10, 100, "auto") == ["device", "device", "cpu", "device"]
    assert plan_build([30, 30], 10, 0, "auto") == ["cpu", "cpu"]
    assert plan_build([30, 30], 10, 0, "device") == ["device", "device"]
    assert plan_build([30, 30], 10, 10**9, "cpu") == ["cpu", "cpu"]
    with pytest.raises(ValueError, match=r"chunk_build must be one of \('auto', 'device', 'cpu'\)"):
        plan_build([1], 1, 1, "gpu")
    with pytest.raises(ValueError, match="chunk_build must be one of"):
        memsched.attach(make_model(), device="cpu", chunk_build="host")


def test_stage_params_packs_cpu_chunks_into_one_flat_buffer() -> None:
    from memsched.chunks import build_layout
    from memsched.distributed import stage_params

    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    layout = build_layout([p.numel() for p in params], chunk_numel=160)
    decisions = ["cpu"] + ["device"] * (layout.n_chunks - 1)
    stats = stage_params([params], layout, torch.device("cpu"), decisions)
    assert stats["cpu_chunks"] == 1 and stats["device_chunks"] == layout.n_chunks - 1
    first = [params[s.index] for s in layout.chunks[0]]
    assert len(first) > 1 and len({p.untyped_storage().data_ptr() for p in first}) == 1
    assert stats["moved_bytes"] == sum(p.numel() * 4 for p in first)
    assert all(same(p, before[n]) for n, p in model.named_parameters())
