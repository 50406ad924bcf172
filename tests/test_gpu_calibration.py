"""`memsched plan`'s prediction against every GPU measurement committed under ``bench/results/`` (issue 30).

Each memsched configuration of a ``gpu_step_time*.json`` says, in its plan's first reason (or in its
placement error), the peak non-model data the GPU's warmup measured, to 0.1 GiB; each row of a
``gpu_calibration*.json`` (``bench/gpu_calibration.py``) gives it in bytes. The prediction made here on
the CPU, with a fake trace and the attention kernel the GPU runs (:mod:`memsched.planning.gpu_kernels`), must
lie within -1 % / +5 % of it, and the verdict must not be "fits" (or "offload") where the GPU refused the
step. A new GPU result extends the table without code changes; one this prediction misses fails here.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memsched.models import config_for, sizes
from memsched.planning.capacity import PEAK_ERROR_BAR, plan_for_capacity, verdict
from memsched.planning.gpu_kernels import gpu_attention, gpu_attention_kernel
from memsched.planning.prediction import Prediction, gpt_workload, trace_step

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
PEAK = re.compile(r"peak non-model data ([0-9.]+) (GiB|MiB)")
UNIT = {"GiB": 2**30, "MiB": 2**20}


@dataclass(frozen=True)
class Run:
    """One committed GPU configuration: its file, policy (or dtype), GPT preset, batch x sequence and cap."""

    file: str
    policy: str
    preset: str
    batch: int
    seq: int
    capacity: int


@dataclass(frozen=True)
class Measured(Run):
    low: float  # the measured peak non-model data lies in [low, high] bytes (printed to 0.1 of its unit)
    high: float
    refused: bool  # the GPU raised a placement or out-of-memory error for this configuration
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.file} {self.policy} ({self.preset}, {self.batch} x {self.seq})"


def _preset(dims: dict) -> str | None:
    for name in sizes():
        c = config_for(name)
        if (c.n_layer, c.n_head, c.n_embd, c.vocab_size) == (dims.get("n_layer"), dims.get("n_head"),
                                                              dims.get("n_embd"), dims.get("vocab_size")):
            return name
    return None


def measurements(folder: Path = RESULTS) -> list[Measured]:
    """Every GPU measurement of peak non-model data under ``folder``: the step-time runs (printed to 0.1 GiB)
    and the calibration points of ``bench/gpu_calibration.py`` (exact bytes)."""
    rows = []
    for path in sorted(folder.glob("gpu_calibration*.json")):
        for r in json.loads(path.read_text())["rows"]:
            if not str(r.get("device", "")).startswith("cuda") or r.get("status") not in ("ok", "oom"):
                continue
            m = float(r.get("measured_peak_non_model_bytes") or 0)
            rows.append(Measured(path.name, r["dtype"], r["size"], r["batch"], r["seq"], 0, m, m,
                                 r["status"] == "oom", DTYPES[r["dtype"]]))
    for path in sorted(folder.glob("gpu_step_time*.json")):
        doc = json.loads(path.read_text())
        cfg, cap = doc.get("config") or {}, (doc.get("memory_cap") or {}).get("bytes")
        preset = _preset(cfg.get("dims") or {})
        if preset is None or not cap:
            continue
        for r in doc["results"]:
            if r.get("kind") != "memsched":
                continue
            text = " ".join((r.get("plan") or {}).get("reasons") or []) + " " + (r.get("error") or "")
            m = PEAK.search(text)
            if m is None:
                continue
            half = 0.05 * UNIT[m.group(2)]
            value = float(m.group(1)) * UNIT[m.group(2)]
            refused = r.get("status") != "ok" and ("PlacementError" in text or "out of memory" in text)
            rows.append(Measured(path.name, r["policy"], preset, cfg["batch"], cfg["seq"], int(cap),
                                 value - half, value + half, refused, torch.float32))
    return rows


@functools.cache
def predict(preset: str, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> Prediction:
    return trace_step(gpt_workload(preset, batch, seq), dtype=dtype, fake=True, device="cpu", attention="gpu")


ROWS = measurements()


def test_the_committed_gpu_results_are_read() -> None:
    """The H100 (2026-11-22, 2026-11-26) and H200 (2026-11-26) runs of GPT-2 355M and 760m at 13 GiB."""
    assert {(r.preset, r.batch, r.seq) for r in ROWS} >= {("gpt2-355m", 4, 1024), ("760m", 4, 1024)}
    assert any(r.refused for r in ROWS) and any(not r.refused for r in ROWS)


@pytest.mark.parametrize("row", [r for r in ROWS if r.high > 0], ids=str)
def test_the_predicted_non_model_peak_is_within_minus_1_plus_5_percent_of_the_gpus(row: Measured) -> None:
    predicted = predict(row.preset, row.batch, row.seq, row.dtype).peak_non_model_bytes
    # whatever the exact measurement in [low, high]: never below it by more than the verdicts' error bar
    # (1 %), at most 5 % above it
    assert predicted >= (1 - PEAK_ERROR_BAR) * row.high, (predicted, row)
    assert predicted <= 1.05 * row.low, (predicted, row)


@pytest.mark.parametrize("row", [r for r in ROWS if r.refused and r.capacity], ids=str)
def test_no_verdict_says_it_fits_where_the_gpu_refused(row: Measured) -> None:
    policy = re.split(r"[:+]", row.policy)[0]
    cplan = plan_for_capacity(predict(row.preset, row.batch, row.seq), row.capacity, policy_names=[policy])
    assert verdict(cplan, policy)["status"] == "does_not_fit", (row, verdict(cplan, policy)["message"])


def test_calibration_points_are_read_exactly(tmp_path: Path) -> None:
    """``bench/gpu_calibration.py``'s rows measured on CUDA join the table with their exact bytes; rows of a
    CPU smoke run and failed runs do not."""
    rows = [{"size": "tiny", "batch": 2, "seq": 64, "dtype": "bf16", "device": "cuda",
             "status": "ok", "measured_peak_non_model_bytes": 956_440},
            {"size": "tiny", "batch": 2, "seq": 64, "dtype": "fp32", "device": "cpu",
             "status": "ok", "measured_peak_non_model_bytes": 1_516_056},
            {"size": "tiny", "batch": 2, "seq": 64, "dtype": "fp32", "device": "cuda", "status": "timeout"}]
    (tmp_path / "gpu_calibration_x.json").write_text(json.dumps({"rows": rows}))
    [row] = measurements(tmp_path)
    assert (row.preset, row.batch, row.seq, row.dtype) == ("tiny", 2, 64, torch.bfloat16)
    assert row.low == row.high == 956_440 and not row.refused


def test_the_kernel_a_gpu_picks_for_attention() -> None:
    """torch's CUDA choice (sdp_utils): FlashAttention-2 for fp16/bf16 without a mask, head dim <= 256;
    memory-efficient attention for fp32 or with a mask; the math kernel otherwise."""
    def qkv(dtype: torch.dtype, head_dim: int) -> torch.Tensor:
        return torch.empty(2, 4, 16, head_dim, dtype=dtype, device="meta")

    mask = torch.empty(16, 16, dtype=torch.bool, device="meta")
    for dtype in (torch.float16, torch.bfloat16):
        q = qkv(dtype, 64)
        assert gpu_attention_kernel(q, q, q, None) == "flash"
        assert gpu_attention_kernel(q, q, q, mask) == "efficient"
        big = qkv(dtype, 512)
        assert gpu_attention_kernel(big, big, big, None) == "efficient"
        odd = qkv(dtype, 60)
        assert gpu_attention_kernel(odd, odd, odd, None) == "math"
    q = qkv(torch.float32, 64)
    assert gpu_attention_kernel(q, q, q, None) == "efficient"
    assert gpu_attention_kernel(qkv(torch.float64, 64), qkv(torch.float64, 64), qkv(torch.float64, 64),
                                None) == "math"


def test_the_routing_is_undone_whatever_happens() -> None:
    original = F.scaled_dot_product_attention
    with pytest.raises(KeyError), gpu_attention():
        assert F.scaled_dot_product_attention is not original
        raise KeyError("inside")
    assert F.scaled_dot_product_attention is original


def test_a_real_trace_off_cuda_refuses_the_gpus_kernels() -> None:
    with pytest.raises(ValueError, match="attention 'gpu' runs CUDA's attention kernels"):
        trace_step(gpt_workload("tiny", 2, 16), fake=False, device="cpu", attention="gpu")


# ---- step time: the roofline model against every committed memsched step ---------------------------------
RATE = re.compile(r"at (\d+) M elements/s")


@dataclass(frozen=True)
class Timed(Run):
    gpu: str
    host_chunks: int
    cpu_rate: float
    measured_s: float

    def __str__(self) -> str:
        return f"{self.file} {self.policy}"  # one workload per file


def timed_runs(folder: Path = RESULTS) -> list[Timed]:
    """Every memsched configuration that ran in a ``gpu_step_time*.json``, with the CPU AdamW rate its warmup
    measured on that host (its plan's step reason) and its plan's host chunks."""
    from memsched.devices.gpus import gpu_for_device_name

    rows = []
    for path in sorted(folder.glob("gpu_step_time*.json")):
        doc = json.loads(path.read_text())
        cfg, cap = doc.get("config") or {}, (doc.get("memory_cap") or {}).get("bytes")
        gpu = gpu_for_device_name(((doc.get("machine") or {}).get("gpu") or {}).get("name", ""))
        preset = _preset(cfg.get("dims") or {})
        if preset is None or not cap or gpu is None:
            continue
        for r in doc["results"]:
            plan = r.get("plan") or {}
            m = RATE.search(" ".join(plan.get("reasons") or []))
            if r.get("kind") != "memsched" or r.get("status") != "ok" or m is None \
                    or plan.get("param_placement"):
                continue
            rows.append(Timed(path.name, r["policy"], preset, cfg["batch"], cfg["seq"], int(cap), gpu.name,
                              list(plan["placement"]).count("host"), float(m.group(1)) * 1e6,
                              float(r["mean_step_s"])))
    return rows


TIMED = timed_runs()


def test_the_committed_step_times_are_read() -> None:
    assert {(t.gpu, t.policy) for t in TIMED} >= {("h200", "cpu"), ("h200", "auto+overlap"),
                                                    ("h100-80gb", "cpu")}


# The model hides the whole CPU update behind the compute with overlap="backward"; on the H200 (2026-11-27)
# the worker's update beside backward took 3.3x (cpu) and 4.4x (auto) its serial time (it also copies the
# state into the spare first, and shares the host's cores with the backward's launches), and the step was
# slower than the serial one. Not modelled yet: bench/GPU-PENDING.md item 13.
BACKWARD_OVERLAP_UNMODELLED = pytest.mark.xfail(
    strict=True, reason="overlap='backward': the CPU update beside backward is slower than the model assumes")


@pytest.mark.parametrize("run", [pytest.param(t, marks=BACKWARD_OVERLAP_UNMODELLED) if "+backward" in t.policy
                                 else t for t in TIMED], ids=str)
def test_the_predicted_step_time_is_within_25_percent_of_the_gpus(run: Timed) -> None:
    from memsched.devices.gpus import get_gpu
    from memsched.planning.step_model import predict_step

    prediction = predict(run.preset, run.batch, run.seq)
    cplan = plan_for_capacity(prediction, run.capacity, policy_names=[])
    overlap = "backward" if "+backward" in run.policy else "+overlap" in run.policy
    step = predict_step(prediction.flops, get_gpu(run.gpu), torch.float32,
                        run.host_chunks * cplan.chunk_numel, run.cpu_rate, overlap)
    assert step is not None
    assert abs(step.step_s - run.measured_s) <= 0.25 * run.measured_s, (step, run)
