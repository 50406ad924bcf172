"""`memsched plan`: fake-tensor prediction (checked against real runs), plans, verdicts, JSON and the CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from memsched.chunks import PARAM_ALIGN, STEP_BYTES
from memsched.cli.argtypes import positive_int_list
from memsched.cli.main import main
from memsched.cli.plan import (
    VERDICTS,
    fake_device,
    gpt_workload,
    plan_for_capacity,
    trace_step,
    verdict,
)
from memsched.devices.gpus import get_gpu, gpu_names
from memsched.models import build_gpt, sizes
from policies.units import format_bytes

TARGET_SRC = textwrap.dedent("""
    import torch
    from torch import nn

    def build(device):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).to(device)

        def loss_fn(m):
            x = torch.randn(16, 32, device=device)
            return nn.functional.cross_entropy(m(x), torch.randint(0, 8, (16,), device=device))

        return model, loss_fn
""")


@pytest.fixture(scope="module")
def tiny_prediction():
    return trace_step(gpt_workload("tiny", 4, 64), fake=True)


@pytest.fixture
def target(tmp_path: Path) -> str:
    path = tmp_path / "mlp_target.py"
    path.write_text(TARGET_SRC)
    return f"{path}:build"


# ---- prediction against real runs --------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["math", "default"])
def test_fake_trace_predicts_the_real_cpu_peak_within_1_percent(attention: str) -> None:
    if attention == "default" and fake_device().type != "cpu":
        pytest.skip("the default attention kernel differs between fake CUDA and a real CPU run")
    build = gpt_workload("tiny", 4, 96)
    fake = trace_step(build, fake=True, attention=attention)
    real = trace_step(build, fake=False, device="cpu", attention=attention)
    assert fake.fake and not real.fake
    assert real.peak_non_model_bytes > 1_000_000  # activations of 4 x 96 tokens through 2 blocks
    assert abs(fake.peak_non_model_bytes - real.peak_non_model_bytes) <= 0.01 * real.peak_non_model_bytes
    # The fake run allocated nothing real: its parameters are fake tensors.
    from torch._subclasses.fake_tensor import FakeTensor

    assert all(isinstance(p, FakeTensor) for p in fake.model.parameters())


def test_math_attention_keeps_the_attention_matrix() -> None:
    # [batch, heads, seq, seq] fp32 probabilities are saved for backward by the math kernel only.
    build = gpt_workload("tiny", 4, 96)
    default = trace_step(build, fake=True, device="cpu").peak_non_model_bytes
    math_ = trace_step(build, fake=True, device="cpu", attention="math").peak_non_model_bytes
    assert math_ - default >= 4 * 2 * 96 * 96 * 4
    with pytest.raises(ValueError, match="unknown attention kernel 'flash2'"):
        trace_step(build, attention="flash2")


def test_target_prediction_matches_real_run(target: str) -> None:
    fake = trace_step(target, fake=True)
    real = trace_step(target, fake=False, device="cpu")
    assert real.peak_non_model_bytes > 0
    assert abs(fake.peak_non_model_bytes - real.peak_non_model_bytes) <= 0.01 * real.peak_non_model_bytes
    assert [tuple(p.shape) for p in fake.param_order] == [(64, 32), (64,), (64,), (64,), (8, 64), (8,)]


# ---- model data, plans and verdicts ------------------------------------------------------------------------
def test_model_data_follows_adamw_arithmetic(tiny_prediction) -> None:
    cp = plan_for_capacity(tiny_prediction, 2**30)
    md = cp.model_data
    padded = sum(c.numel for c in cp.problem.chunks)
    n_tensors = sum(1 for p in tiny_prediction.model.parameters() if p.requires_grad)
    # one rank: exact chunks (tied weights once), the alignment gaps between parameters their only padding
    gaps = padded - sum(p.numel() for p in set(tiny_prediction.model.parameters()))
    assert gaps == cp.padding["numel"] and 0 < gaps < PARAM_ALIGN * n_tensors
    assert md["parameter"] == md["gradient"] == 4 * padded  # fp32 compute parameters and gradients
    # fp32 exp_avg + exp_avg_sq, one step count per parameter (as torch.optim.AdamW keeps)
    assert md["optimizer_state"] == 8 * padded + STEP_BYTES * n_tensors
    # One rank: the gradients are placed with their chunk's optimizer state (a host chunk's leave the device
    # in backward), so only the parameters and buffers are resident whatever the plan.
    assert cp.problem.resident_model_bytes == md["parameter"] + md["other"]
    assert sum(c.device_bytes for c in cp.problem.chunks) == md["optimizer_state"] + md["gradient"]
    # what at most two chunks' gradients on their way to the host add to the traced peak (at the turn from
    # forward to backward, the peak, no gradient exists yet)
    assert 0 <= cp.problem.host_grad_working_bytes <= 2 * 4 * max(c.numel for c in cp.problem.chunks)
    assert cp.problem.peak_non_model_bytes == tiny_prediction.peak_non_model_bytes


def test_the_predicted_reads_cover_every_chunk_in_forward_and_backward(tiny_prediction) -> None:
    cp = plan_for_capacity(tiny_prediction, 2**30)
    accesses = cp.problem.accesses
    assert {a.chunk for a in accesses if a.phase == "forward"} == set(range(cp.n_chunks))
    assert {a.chunk for a in accesses if a.phase == "backward"} <= set(range(cp.n_chunks))
    first_backward = next(k for k, a in enumerate(accesses) if a.phase == "backward")
    assert all(a.phase == "backward" for a in accesses[first_backward:])
    # chunks in first-use order: forward reads them in increasing order (the tied head re-reads chunk 0)
    forward = [a.chunk for a in accesses[:first_backward]]
    assert forward[:cp.n_chunks] == list(range(cp.n_chunks))
    # the non-model data at the turn from forward to backward is the step's peak
    assert max(a.non_model_bytes for a in accesses) >= cp.problem.peak_non_model_bytes


def test_chunk_padding_is_reported_apart_from_the_parameters(tiny_prediction, capsys) -> None:
    own = sum(p.numel() for p in tiny_prediction.model.parameters() if p.requires_grad)  # ties counted once
    # one rank: exact chunks hold no padding but the alignment gaps between parameters
    exact = plan_for_capacity(tiny_prediction, 2**30)
    gaps = sum(c.numel for c in exact.problem.chunks) - own
    assert 0 < gaps < PARAM_ALIGN * sum(1 for p in tiny_prediction.model.parameters() if p.requires_grad)
    assert exact.padding == {"numel": gaps, "parameter": 4 * gaps, "gradient": 4 * gaps,
                             "optimizer_state": 8 * gaps}
    # ZeRO-1 over 2 ranks: uniform chunks, padded to the searched size
    cp = plan_for_capacity(tiny_prediction, 2**30, world_size=2, zero_stage=1)
    pad = cp.n_chunks * cp.chunk_numel - own
    assert pad > 0
    assert cp.padding == {"numel": pad, "parameter": 4 * pad, "gradient": 4 * pad, "optimizer_state": 8 * pad}
    # The CLI: parameters without the padding, the padding on its own row, and both in the JSON.
    one = _plan_json(capsys, "--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--capacity", "1GiB")
    assert one["chunks"]["padding"]["numel"] == gaps and one["chunks"]["total_numel"] == own + gaps
    cp = plan_for_capacity(tiny_prediction, 2**30)
    pad = gaps
    argv = ["--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--capacity", "1GiB",
            "--no-largest-preset"]
    r = _plan_json(capsys, *argv)
    assert r["chunks"]["padding"] == cp.padding
    assert main(["plan", *argv]) == 0
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in capsys.readouterr().out.splitlines() if line.count("│") >= 3}
    assert rows["parameters"] == rows["gradients"] == format_bytes(4 * own)
    assert rows["optimizer states (AdamW)"] == format_bytes(cp.model_data["optimizer_state"] - 8 * pad)
    assert rows["chunk padding"] == format_bytes(16 * pad)


def test_bf16_adds_the_fp32_master_and_keeps_ties() -> None:
    pred = trace_step(gpt_workload("tiny", 2, 32), fake=True, dtype=torch.bfloat16)
    assert pred.dtype == torch.bfloat16
    assert pred.model.lm_head.weight is pred.model.wte.weight
    cp = plan_for_capacity(pred, 2**30)
    numel = sum(c.numel for c in cp.problem.chunks)  # exact chunks (alignment gaps only), the tie once
    assert numel - sum(p.numel() for p in set(pred.model.parameters())) == cp.padding["numel"]
    assert cp.model_data["parameter"] == 2 * numel
    # fp32 master + exp_avg + exp_avg_sq (and one step count per parameter)
    n_tensors = sum(1 for p in pred.model.parameters() if p.requires_grad)
    assert cp.model_data["optimizer_state"] == 12 * numel + STEP_BYTES * n_tensors


def test_module_to_works_on_fake_models() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memsched.cli.plan import fake_module_conversions

    with FakeTensorMode(), fake_module_conversions():
        model = build_gpt("tiny")
        weight = model.wte.weight
        model.to("cpu").to(torch.float16)
        assert model.wte.weight is weight and weight.dtype == torch.float16
        assert model.lm_head.weight is model.wte.weight  # still tied
    assert torch.utils.swap_tensors.__module__ == "torch.utils"  # restored on exit


def test_verdicts_for_four_capacities(tiny_prediction) -> None:
    probe = plan_for_capacity(tiny_prediction, 2**30).problem
    base = probe.peak_non_model_bytes + probe.resident_model_bytes
    optimizer = sum(c.device_bytes for c in probe.chunks)  # optimizer states and gradients
    working = probe.host_grad_working_bytes

    # Below the peak of non-model data nothing helps.
    hopeless = verdict(plan_for_capacity(tiny_prediction, probe.peak_non_model_bytes - 1000))
    assert hopeless["status"] == "does_not_fit" and hopeless["short_bytes"] > 0

    # Parameters + non-model data do not fit: auto keeps some parameters on the host, cpu cannot.
    tight = plan_for_capacity(tiny_prediction, base - 1000)
    short = verdict(tight)
    assert short["status"] == "offload_params"
    plan = tight.plans["auto"]
    assert 0 < short["params_on_host_bytes"] == sum(tight.problem.chunks[i].param_bytes
                                                    for i in plan.param_host_chunks)
    assert short["peak_bytes"] == plan.peak_bytes <= base - 1000
    assert short["h2d_bytes_per_step"] >= plan.schedule.h2d_copies * probe.chunks[0].param_bytes
    assert short["d2h_bytes_per_step"] == sum(c.param_bytes for c in tight.problem.chunks)  # every chunk's
    cpu = verdict(tight, "cpu")
    assert cpu["status"] == "does_not_fit" and cpu["short_bytes"] == 1000

    roomy = verdict(plan_for_capacity(tiny_prediction, 4 * (base + optimizer)))
    assert roomy["status"] == "fits" and roomy["offloaded_bytes"] == 0
    assert roomy["device_bytes"] == optimizer and roomy["needed_all_on_device_bytes"] == base + optimizer
    assert roomy["h2d_bytes_per_step"] == roomy["d2h_bytes_per_step"] == 0

    # auto's budget = 0.8 x (margin - 5% of capacity): aim it at half of the optimizer state.
    capacity = int((base + working + optimizer / 1.6) / 0.95)
    split = verdict(plan_for_capacity(tiny_prediction, capacity))
    assert split["status"] == "offload"
    assert 0 < split["offloaded_bytes"] < optimizer
    assert split["device_bytes"] - working + split["offloaded_bytes"] == optimizer
    assert split["host_bytes"] > split["offloaded_bytes"]  # pinned master + states + gradient buffer
    assert split["d2h_bytes_per_step"] > 0 and split["h2d_bytes_per_step"] > 0

    cuda_only = verdict(plan_for_capacity(tiny_prediction, capacity), "cuda")
    assert cuda_only["status"] == "does_not_fit" and "no plan" in cuda_only["message"]
    with pytest.raises(LookupError, match="'nope' was not planned"):
        verdict(plan_for_capacity(tiny_prediction, capacity, policy_names=["auto"]), "nope")


def test_a_plan_over_the_host_budget_says_so(tiny_prediction) -> None:
    """The host is the limit: the device holds the step with offload, but the host budget cannot hold the
    offloaded state. The verdict says "does not fit host memory" with both numbers; a budget that holds it
    gives the plan."""
    probe = plan_for_capacity(tiny_prediction, 2**30).problem
    base = probe.peak_non_model_bytes + probe.resident_model_bytes + probe.host_grad_working_bytes
    capacity = base + 2**20  # room for the step, none for the optimizer state: every chunk on the host
    free = plan_for_capacity(tiny_prediction, capacity)
    host = verdict(free, "cpu")["host_bytes"]
    assert verdict(free, "cpu")["status"] == "offload" and host > 0
    short = plan_for_capacity(tiny_prediction, capacity, host_capacity_bytes=host - 1,
                              host_capacity_source="--host-memory")
    v = verdict(short, "cpu")
    assert v["status"] == "does_not_fit_host" and v["status"] in VERDICTS
    assert v["message"].startswith("does not fit host memory") and f"({host:,} bytes)" in v["message"]
    assert f"({host - 1:,} bytes) is available (--host-memory); short by 1 bytes" in v["message"]
    exact = plan_for_capacity(tiny_prediction, capacity, host_capacity_bytes=host)
    assert verdict(exact, "cpu")["status"] == "offload"


# ---- the command line --------------------------------------------------------------------------------------
def _plan_json(capsys, *argv: str) -> dict:
    """``memsched plan ARGV --json``; the ladder of the largest preset that fits (6 more traces) only where a
    test asks for it (``--largest-preset``)."""
    if "--largest-preset" not in argv and "--no-largest-preset" not in argv:
        argv = (*argv, "--no-largest-preset")
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_result(capsys) -> None:
    r = _plan_json(capsys, "--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--gpu", "T4",
                   "--largest-preset")
    assert r["schema"] == "memsched.plan" and r["version"] == 2
    assert r["workload"] == {"model": "tiny", "batch_size": 2, "seq_len": 64, "parameters": 132864,
                             "dtype": "float32"}
    assert r["gpu"] == "t4" and r["capacity_bytes"] == 16 * 2**30
    assert r["trace"]["fake"] is True and r["trace"]["peak_non_model_bytes"] > 0
    assert r["margin_bytes"] == r["capacity_bytes"] - r["trace"]["peak_non_model_bytes"] - \
        r["model_data"]["resident_bytes"]
    assert set(r["plans"]) >= {"auto", "cpu", "cuda", "static"}
    assert r["verdict"]["status"] == "fits" and r["verdict"]["status"] in VERDICTS
    # cpu: nothing but what the host chunks' gradients on their way to the host add to the peak
    grads = r["model_data"]["gradient"] // r["chunks"]["count"]
    assert r["plans"]["cpu"]["device_bytes"] == r["model_data"]["host_grad_working_bytes"] <= 2 * grads
    largest = r["largest_preset"]
    assert (largest["batch_size"], largest["seq_len"], largest["policy"]) == (2, 64, "auto")
    order = sizes()
    # 16 GiB holds more than the tiny model at 2 x 64, and the three answers are nested
    assert order.index(largest["all_on_device"]) > order.index("tiny")
    assert order.index(largest["any"]) >= order.index(largest["params_on_device"]) >= \
        order.index(largest["all_on_device"])


def test_cli_world_size_predicts_each_zero_stage_per_rank(capsys) -> None:
    one = _plan_json(capsys, "--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--capacity", "64MiB",
                     "--no-largest-preset", "--policy", "cuda")
    r = _plan_json(capsys, "--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--capacity", "64MiB",
                   "--no-largest-preset", "--policy", "cuda", "--world-size", "4")
    assert "ranks" not in one and r["ranks"]["world_size"] == 4 and r["ranks"]["policy"] == "cuda"
    s0, s1, s2, s3 = r["ranks"]["stages"]
    assert [s["zero_stage"] for s in (s0, s1, s2, s3)] == [0, 1, 2, 3]
    assert s3["status"] == "fits" and s3["resident_model_bytes"] < s2["resident_model_bytes"]
    md, peak = one["model_data"], one["trace"]["peak_non_model_bytes"]
    # ZeRO-0: one rank's whole state (uniform chunks with more ranks: the one-rank figures plus the padding
    # of chunks of the searched size); ZeRO-1: a quarter of it, same gradients; ZeRO-2: fewer gradient bytes
    n = r["workload"]["parameters"]
    pad = s0["device_state_bytes"] - md["optimizer_state"]
    assert pad % 8 == 0 and 0 <= pad < 8 * n  # fp32 moments of the padding
    assert one["plans"]["cuda"]["device_bytes"] == md["optimizer_state"] + md["gradient"]  # with its grads
    assert s0["resident_model_bytes"] == md["parameter"] + md["gradient"] + md["other"] + pad
    assert s1["device_state_bytes"] < s0["device_state_bytes"] / 3
    assert s1["resident_model_bytes"] >= s0["resident_model_bytes"] > s2["resident_model_bytes"]
    for s in (s0, s1, s2, s3):
        assert s["status"] == "fits"
        assert s["peak_bytes"] == peak + s["resident_model_bytes"] + s["device_state_bytes"]
    assert s0["peak_bytes"] > s1["peak_bytes"] > s2["peak_bytes"] > s3["peak_bytes"]
    main(["plan", "--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--capacity", "64MiB",
          "--no-largest-preset", "--world-size", "4"])
    out = capsys.readouterr().out
    assert "Per rank with 4 data-parallel ranks" in out


def test_largest_preset_is_a_binary_search_over_the_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    import memsched.planning.capacity as capacity

    presets = [f"p{i}" for i in range(9)]
    truth = dict(zip(presets, ["fits"] * 3 + ["offload"] * 2 + ["offload_params"] * 2 + ["does_not_fit"] * 2,
                     strict=True))
    asked: list[str] = []

    def plan_of(name: str) -> str:  # the "plan" is the preset's name; verdict reads its status
        asked.append(name)
        return name

    monkeypatch.setattr(capacity, "verdict", lambda cplan, policy: {"status": truth[cplan]})
    got = capacity.largest_preset(presets, plan_of)
    assert got == {"any": "p6", "params_on_device": "p4", "all_on_device": "p2"}
    assert len(asked) == len(set(asked)) < 3 * 4  # each traced once, about log2(9) per answer
    truth = dict.fromkeys(presets, "does_not_fit")
    assert capacity.largest_preset(presets, plan_of) == dict.fromkeys(capacity.PRESET_FITS)


def test_cli_target(capsys, target: str) -> None:
    r = _plan_json(capsys, target, "--capacity", "1MiB", "--dtype", "bf16")
    assert r["workload"]["target"] == target and r["workload"]["dtype"] == "bfloat16"
    assert r["capacity_bytes"] == 2**20 and r["gpu"] is None


def test_cli_table_output(capsys) -> None:
    argv = ["plan", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--capacity", "2MiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "peak non-model data" in out and "optimizer states (AdamW)" in out
    assert "Verdict (auto)" in out


@pytest.mark.parametrize(("argv", "message"), [
    ([], "give either a TARGET"),
    (["x.py:f", "--model", "tiny"], "give either a TARGET"),
    (["--model", "huge", "--capacity", "1GiB"], "unknown model size 'huge': known sizes are tiny"),
    (["--model", "tiny", "--gpu", "k80"], "unknown GPU 'k80': known GPUs are t4"),
    (["--model", "tiny", "--capacity", "1GiB", "--seq-len", "4096"], "exceeds the 'tiny' model's block_size"),
    (["--model", "tiny", "--capacity", "1GiB", "--policy", "magic"], "unknown policy 'magic'"),
    (["x.py:f", "--capacity", "1GiB", "--batch-size", "2"], "apply to --model only"),
    (["--model", "tiny", "--capacity", "1GiB", "--world-size", "1"], "--world-size must be at least 2"),
    (["--model", "tiny", "--capacity", "1GiB", "--seq-len", "32,64", "--world-size", "2"],
     "--world-size predicts one size: give one --seq-len value"),
])
def test_cli_bad_input_gives_one_clear_line(capsys, argv: list[str], message: str) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_target_that_needs_real_data(tmp_path: Path, capsys) -> None:
    path = tmp_path / "item_target.py"
    path.write_text(TARGET_SRC.replace("x = torch.randn(16, 32, device=device)",
                                       "x = torch.randn(16, 32, device=device) * x_scale(device)") +
                    "\ndef x_scale(device):\n    return float(torch.rand(1, device=device).item())\n")
    assert main(["plan", f"{path}:build", "--capacity", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "cannot run on fake tensors" in err and ".item()" in err and "Traceback" not in err
    assert main(["plan", f"{tmp_path / 'missing.py'}:build", "--capacity", "1GiB"]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU the capacity must be given")
def test_cli_without_gpu_needs_a_capacity(capsys) -> None:
    assert main(["plan", "--model", "tiny"]) == 2
    assert "no GPU here: give --capacity" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--capacity", "lots"], ["--gpu-margin-mem-ratio", "1.5"],
                                  ["--batch-size", "0"], ["--dtype", "fp8"]])
def test_cli_argument_errors(capsys, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "tiny", *argv])
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


# ---- several sizes at once ---------------------------------------------------------------------------------
def test_positive_int_list() -> None:
    import argparse

    assert positive_int_list("512") == [512]
    assert positive_int_list(" 512, 1024 ,2048") == [512, 1024, 2048]
    for text, bad in [("512,1k", "got '1k' in '512,1k'"), ("0", "got '0' in '0'"), ("8,-1", "got '-1'"),
                      ("8,,16", "got an empty item in '8,,16'"), ("", "got an empty item"),
                      ("8,16,8", "got 8 twice in '8,16,8'")]:
        with pytest.raises(argparse.ArgumentTypeError, match="list of distinct integers >= 1") as e:
            positive_int_list(text)
        assert bad in str(e.value)


def test_cli_seq_len_sweep_json_has_every_size_and_the_largest_that_fits(capsys) -> None:
    r = _plan_json(capsys, "--model", "tiny", "--batch-size", "2", "--seq-len", "4,32,128,256",
                   "--capacity", "3400KiB")
    assert r["schema"] == "memsched.plan_sweep" and r["version"] == 2
    assert r["over"] == "seq_len" and r["values"] == [4, 32, 128, 256]
    assert r["capacity_bytes"] == 3400 * 2**10 and r["gpu"] is None
    sizes = r["sizes"]
    assert [s["seq_len"] for s in sizes] == [4, 32, 128, 256]
    peaks = [s["peak_non_model_bytes"] for s in sizes]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4  # longer sequences, more activations
    for s in sizes:  # each size carries its own full single-size result
        assert s["result"]["schema"] == "memsched.plan"
        assert s["result"]["workload"]["seq_len"] == s["seq_len"]
        assert s["result"]["workload"]["batch_size"] == 2
        assert s["result"]["trace"]["peak_non_model_bytes"] == s["peak_non_model_bytes"]
        assert set(s["verdicts"]) == {"auto", "cpu"}
    status = [s["verdicts"]["auto"]["status"] for s in sizes]
    assert status == ["fits", "offload", "offload_params", "does_not_fit"]  # 3400 KiB shows all four
    assert [s["verdicts"]["cpu"]["status"] for s in sizes] == ["offload", "offload", "does_not_fit",
                                                               "does_not_fit"]
    assert r["largest_fitting"] == {"auto": 128, "cpu": 32, "auto_all_on_device": 4}
    # the sweep's figures are the single-size command's
    single = _plan_json(capsys, "--model", "tiny", "--batch-size", "2", "--seq-len", "128",
                        "--capacity", "3400KiB", "--no-largest-preset")
    assert single["schema"] == "memsched.plan" and single["trace"]["peak_non_model_bytes"] == peaks[2]
    assert single["verdict"] == sizes[2]["verdicts"]["auto"]
    assert "largest_preset" not in single


def test_cli_batch_size_sweep_table(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one line per row: rich would wrap cells in 80 columns
    argv = ["plan", "--model", "tiny", "--batch-size", "1,2,16", "--seq-len", "64", "--capacity", "4MiB",
            "--policy", "static"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "batch size" in line)
    for column in ("peak non-model data", "GPU margin", "auto", "cpu", "static"):
        assert column in header
    rows = {line.split()[1]: line for line in lines if line.split()[1:2] in (["1"], ["2"], ["16"])}
    assert "fits, all on the device" in rows["1"] and "offloaded" in rows["2"]
    assert rows["16"].count("does not fit, short") == 3
    assert lines[-1] == "Largest batch size that fits 4.0 MiB: 2 with auto, 2 with cpu (auto keeps all " \
                        "optimizer state on the device up to 1)"
    out = "\n".join(lines)
    assert "Verdict" not in out  # the single-size report is not repeated per size


def test_cli_sweep_with_nothing_fitting_says_none(capsys) -> None:
    r = _plan_json(capsys, "--model", "tiny", "--batch-size", "2", "--seq-len", "32,64",
                   "--capacity", "64KiB")
    assert r["largest_fitting"] == {"auto": None, "cpu": None, "auto_all_on_device": None}


@pytest.mark.parametrize(("argv", "message"), [
    (["--seq-len", "32,64", "--batch-size", "1,2"],
     "give several values to --seq-len or to --batch-size, not both"),
    (["--seq-len", "32,4096"], "sequence length 4096 exceeds the 'tiny' model's block_size"),
])
def test_cli_sweep_errors_before_any_trace(capsys, argv: list[str], message: str) -> None:
    assert main(["plan", "--model", "tiny", "--capacity", "1GiB", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--seq-len", "32,x"], "got 'x' in '32,x'"),
    (["--batch-size", "4,4"], "got 4 twice in '4,4'"),
])
def test_cli_bad_size_list_names_the_value(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "tiny", "--capacity", "1GiB", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and ("--seq-len" in err or "--batch-size" in err)


def test_gpu_table() -> None:
    assert get_gpu("A100-40GB").memory_bytes == 40 * 2**30
    names = gpu_names()
    assert names == sorted(names, key=lambda n: get_gpu(n).memory_bytes)
    with pytest.raises(ValueError, match="known GPUs are"):
        get_gpu("voodoo2")


@pytest.mark.slow
def test_1_3b_at_batch_8_seq_1024_on_24gib(capsys) -> None:
    r = _plan_json(capsys, "--model", "1.3b", "--batch-size", "8", "--seq-len", "1024", "--capacity", "24GiB")
    assert 1.25e9 < r["workload"]["parameters"] < 1.4e9
    v, p = r["verdict"], r["trace"]["peak_non_model_bytes"]
    assert v["needed_all_on_device_bytes"] == p + r["model_data"]["resident_bytes"] + \
        r["model_data"]["optimizer_state"] + r["model_data"]["gradient"]
    # fp32: activations of 24 layers x 8 x 1024 tokens alone exceed 24 GiB, so no placement helps.
    assert v["status"] == "does_not_fit" and v["short_bytes"] == -r["margin_bytes"] > 0
    assert p > 20 * 2**30


def test_the_fake_trace_reads_no_data_pointer(capsys) -> None:
    """torch deprecates reading a FakeTensor's data pointer (and will make it an error): a plan traces
    without one, so it prints none of torch's deprecation warnings and survives that torch release."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = _plan_json(capsys, "--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--gpu", "T4")
    assert r["trace"]["fake"] is True and r["trace"]["peak_non_model_bytes"] > 0
    assert not [w for w in caught if "data pointer of FakeTensor" in str(w.message)]


def test_a_plan_within_the_predictions_error_bar_is_tight(tiny_prediction) -> None:
    """Where the device's slack at the peak is under PEAK_ERROR_BAR of the peak non-model data, a GPU's
    measurement within the bar could exhaust it: the verdict keeps its status and says "tight", with the
    slack; a little more capacity and it is not."""
    from memsched.planning.capacity import PEAK_ERROR_BAR

    roomy = verdict(plan_for_capacity(tiny_prediction, 2**30))
    assert roomy["status"] == "fits" and not roomy["tight"]
    needed = roomy["needed_all_on_device_bytes"]
    assert roomy["slack_bytes"] == 2**30 - needed
    bar = int(PEAK_ERROR_BAR * tiny_prediction.peak_non_model_bytes)
    tight = verdict(plan_for_capacity(tiny_prediction, needed + bar // 2, policy_names=["cuda"]), "cuda")
    assert tight["status"] == "fits" and tight["tight"] and tight["slack_bytes"] == bar // 2
    assert tight["message"].startswith(f"tight: {format_bytes(bar // 2)} to spare at the peak")
    fine = verdict(plan_for_capacity(tiny_prediction, needed + 2 * bar, policy_names=["cuda"]), "cuda")
    assert fine["status"] == "fits" and not fine["tight"] and fine["message"].startswith("fits")


def test_a_named_gpu_capped_by_capacity(capsys) -> None:
    """`--gpu NAME --capacity SIZE`: the GPU capped, as set_per_process_memory_fraction caps it (how every
    committed GPU measurement was made); a cap above the GPU's memory is refused with both sizes."""
    gpu = get_gpu(gpu_names()[0])
    argv = ["plan", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--no-largest-preset",
            "--json", "--gpu", gpu_names()[0]]
    assert main([*argv, "--capacity", "1GiB"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["capacity_bytes"] == 2**30 and r["gpu"] == gpu.name
    assert main([*argv, "--capacity", str(gpu.memory_bytes + 1)]) == 2
    assert "exceeds the" in capsys.readouterr().err


def test_the_plan_predicts_the_step_on_a_named_gpu(capsys) -> None:
    """With --gpu the verdict's plan gets a step time: compute from the trace's FLOPs at the calibrated share
    of the GPU's peak, plus the CPU update of its host chunks at --cpu-adam-rate, serial and overlapped;
    without a known GPU the JSON says why there is none."""
    from memsched.planning.step_model import EFFICIENCY

    argv = ["plan", "--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--no-largest-preset",
            "--json", "--policy", "cpu", "--cpu-adam-rate", "1e9"]
    assert main([*argv, "--gpu", "h100-80gb", "--capacity", "1GiB"]) == 0
    r = json.loads(capsys.readouterr().out)
    st, gpu = r["step_time"], get_gpu("h100-80gb")
    serial, overlap = st["serial"], st["overlap"]
    compute = serial["flops"] / (gpu.fp32_flops * EFFICIENCY[torch.float32])
    assert serial["flops"] > 0 and serial["compute_s"] == pytest.approx(compute)
    host = serial["host_elements"]
    assert host == r["chunks"]["total_numel"]  # policy cpu: every chunk on the host
    assert serial["step_s"] == pytest.approx(compute + host / 1e9)
    assert overlap["step_s"] == pytest.approx(compute + max(0.0, host / 1e9 - compute / 3))
    assert st["cpu_rate_source"] == "--cpu-adam-rate"
    assert main([*argv, "--capacity", "1GiB"]) == 0
    assert "give --gpu NAME" in json.loads(capsys.readouterr().out)["step_time"]["reason"]


def test_the_plan_chooses_each_host_chunks_update_path(capsys) -> None:
    """`--host-update auto` chooses, as attach(host_update="auto") does after warmup, which host chunks stream
    through the GPU from --cpu-adam-rate and the link (--link-bandwidth, else the GPU's nominal PCIe x16):
    a slow CPU over a fast link streams chunks, whose link time enters the predicted step and whose state
    enters the plan's link bytes; a fast CPU over a slow link streams none. `--host-update cpu` (the
    default) refuses --link-bandwidth."""
    argv = ["plan", "--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--no-largest-preset",
            "--json", "--policy", "cpu", "--gpu", "h100-80gb", "--capacity", "1GiB"]
    assert main([*argv, "--cpu-adam-rate", "1e9"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert main([*argv, "--cpu-adam-rate", "1e6", "--host-update", "auto"]) == 0
    r = json.loads(capsys.readouterr().out)
    plan, st = r["plans"]["cpu"], r["step_time"]
    assert plan["streamed"] and "the h100-80gb's nominal PCIe x16 bandwidth" in plan["reasons"][-1]
    assert f"{format_bytes(63e9)}/s per direction" in plan["reasons"][-1] and st["serial"]["link_s"] > 0
    assert st["serial"]["host_elements"] < cpu["step_time"]["serial"]["host_elements"]
    assert r["verdict"]["h2d_bytes_per_step"] > cpu["verdict"]["h2d_bytes_per_step"]
    assert r["verdict"]["d2h_bytes_per_step"] > cpu["verdict"]["d2h_bytes_per_step"]
    assert main([*argv, "--cpu-adam-rate", "1e12", "--host-update", "auto", "--link-bandwidth", "1MBps"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert not slow["plans"]["cpu"]["streamed"]
    assert f"{format_bytes(1e6)}/s per direction (--link-bandwidth)" in slow["plans"]["cpu"]["reasons"][-1]
    assert main([*argv, "--link-bandwidth", "25GBps"]) == 2
    assert "--link-bandwidth applies with --host-update device or auto" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's usage error
        main([*argv, "--host-update", "auto", "--link-bandwidth", "25Gbps"])
    assert "bits per second" in capsys.readouterr().err


def test_the_step_model_refuses_bad_input_and_leaves_uncalibrated_dtypes_out() -> None:
    from memsched.planning.step_model import predict_step

    gpu = get_gpu("h200")
    with pytest.raises(ValueError, match="CPU AdamW rate must be > 0 elements/s, got 0"):
        predict_step(10**12, gpu, torch.float32, 100, 0)
    with pytest.raises(ValueError, match="overlap must be False, True or 'backward', got 'yes'"):
        predict_step(10**12, gpu, torch.float32, 100, 1e9, "yes")
    assert predict_step(10**12, gpu, torch.bfloat16, 100, 1e9) is None
    back = predict_step(10**12, gpu, torch.float32, 10**9, 1e9, "backward")
    assert back.exposed_cpu_s == pytest.approx(max(0.0, 1.0 - back.compute_s))
