"""Tiny runs of the functions of bench/cpu_adam.py and bench/gpu_step_time.py, so the scripts cannot rot.

No timing is asserted here: speed lives in the committed bench results, not in unit tests.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import psutil
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for ``import bench``

from bench import cpu_adam, gpu_step_time  # noqa: E402
from bench.cpu_adam import ADAMW_BYTES_PER_PARAM, Impl  # noqa: E402

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


# ----------------------------------------------------------------------------------------- cpu_adam helpers
@pytest.mark.parametrize(("numel", "hidden"), [(2**16, 16), (64 * 2**20, 1024), (5_000_003, 256)])
def test_transformer_shapes_total_exactly_numel(numel: int, hidden: int) -> None:
    shapes = cpu_adam.transformer_shapes(numel, hidden)
    assert sum(cpu_adam._prod(s) for s in shapes) == numel
    assert shapes[0][1] == hidden  # the embedding comes first
    assert (3 * hidden, hidden) in shapes and (hidden, 4 * hidden) in shapes  # qkv and fc2 of a block


def test_transformer_shapes_rejects_too_small() -> None:
    with pytest.raises(ValueError, match="numel=1000 is too small for hidden=64"):
        cpu_adam.transformer_shapes(1000, 64)
    with pytest.raises(ValueError, match="hidden must be >= 8"):
        cpu_adam.transformer_shapes(2**20, 4)


def test_chunk_bounds_cover_without_overlap() -> None:
    bounds = cpu_adam.chunk_bounds(10, 4)
    assert bounds == [(0, 4), (4, 4), (8, 2)]
    assert cpu_adam.chunk_bounds(3, 8) == [(0, 3)]
    with pytest.raises(ValueError, match="chunk_numel=0"):
        cpu_adam.chunk_bounds(10, 0)


def test_staggered_buffers_differ_in_low_address_bits() -> None:
    aligned = cpu_adam.staggered_buffers(1000, 4, 0)
    staggered = cpu_adam.staggered_buffers(1000, 4, 1088)
    assert all(t.numel() == 1000 and t.is_contiguous() for t in aligned + staggered)
    offsets = [t.data_ptr() - t.untyped_storage().data_ptr() for t in staggered]
    assert offsets == [0, 1088, 2176, 3264]
    assert [t.data_ptr() - t.untyped_storage().data_ptr() for t in aligned] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="multiple of 4, got 6"):
        cpu_adam.staggered_buffers(10, 2, 6)


def test_interleaved_runs_abc_abc_and_counts_rounds() -> None:
    calls: list[str] = []
    impls = [Impl(n, "bandwidth", lambda n=n: calls.append(n), bytes_per_elem=4) for n in "ABC"]
    out = cpu_adam.interleaved(impls, repeats=3)
    assert calls == list("ABC") * 3
    assert len(out.pop("_load_avg_per_round")) == 3
    assert all(0.0 <= x <= 1.0 for x in out.pop("_others_cpu_share_per_round"))
    assert all(out[n]["n"] == 3 and out[n]["min_s"] <= out[n]["median_s"] <= out[n]["max_s"] for n in "ABC")


def test_check_numerics_flags_a_wrong_update() -> None:
    numels = [3, 5]
    ref_p, ref_m, ref_v = torch.arange(8.0), torch.ones(8), torch.ones(8)
    good = [ref_p[:3].clone(), ref_p[3:].clone()]
    bad = [t.clone() for t in good]
    bad[1][2] += 1e-3
    state = [ref_m[:3], ref_m[3:]], [ref_v[:3], ref_v[3:]]
    ref = Impl("ref", "adamw", lambda: None, state=lambda: ([ref_p], [ref_m], [ref_v]))
    same = Impl("same", "adamw", lambda: None, state=lambda: (good, *state))
    wrong = Impl("wrong", "adamw", lambda: None, state=lambda: (bad, *state))
    out = cpu_adam.check_numerics(ref, [same, wrong], numels)
    assert out["same"]["ok"] is True and out["wrong"]["ok"] is False and out["ok"] is False
    assert out["same"]["max_abs_diff_param"] == 0.0
    assert out["wrong"]["max_abs_diff_param"] == pytest.approx(1e-3, rel=1e-3)


# ------------------------------------------------------------------------------------- cpu_adam end to end
def _tiny_run(**kw):
    sizes = {"numel": 2**16, "hidden": 64, "chunk_numel": 2**14, "chunk_sweep": (2**12,)}
    return cpu_adam.run(
        repeats=2, thread_counts=[1], thread_repeats=1, contention_repeats=1, layout_repeats=1, **sizes, **kw
    )


def test_cpu_adam_tiny_run_without_deepspeed() -> None:
    threads = torch.get_num_threads()
    before = {p.pid for p in psutil.Process().children()}  # e.g. a fork server an earlier test started
    out = _tiny_run(deepspeed=False)
    assert torch.get_num_threads() == threads == out["config"]["torch_threads"]  # the study restores it
    res = out["results"]
    expected = {
        "memsched_chunk16384",
        "memsched_chunk4096",
        "memsched_params_chunk16384",
        "torch_fused",
        "torch_foreach",
        "torch_forloop",
        "triad",
        "copy",
        "axpy",
    }
    assert set(res) == expected
    # what HybridAdamW runs (one tensor per parameter part) is bit-exact against torch's fused AdamW
    assert out["numerics"]["bit_exact_vs_torch_fused"]["memsched_params_chunk16384"] is True
    # All implementations produced the same update as memsched's fused chunks (the check can fail: see above).
    assert out["numerics"]["ok"] is True
    assert {"torch_fused", "torch_foreach", "torch_forloop"} <= set(out["numerics"])
    for name, r in res.items():
        assert r["n"] == 2 and r["median_s"] > 0
        if name.startswith(("memsched", "torch")):
            assert r["params_per_s"] == pytest.approx(2**16 / r["median_s"])
    assert res["memsched_chunk4096"]["tensors_per_step"] == 16
    roof = out["roof"]
    assert roof["params_per_s"] == pytest.approx(res["triad"]["bytes_per_s"] / ADAMW_BYTES_PER_PARAM)
    t = out["targets"]
    assert t["headline"] == "memsched_chunk16384"
    assert t["vs_roof"]["ratio"] == pytest.approx(
        res["memsched_chunk16384"]["params_per_s"] / roof["params_per_s"]
    )
    assert t["vs_deepspeed"]["ratio"] is None and "disabled" in t["vs_deepspeed"]["why"]
    assert set(out["threads_study"]["torch_fused"]) == {"1"}
    assert set(out["contention_study"]) >= {
        "memsched_chunk4096",
        "memsched_chunk16384",
        "torch_fused",
        "spinners",
    }
    assert not [p for p in psutil.Process().children() if p.pid not in before]  # the busy-loop is gone
    layout = out["layout_study"]
    assert len(layout["aligned"]) == len(layout["staggered"]) == layout["allocations"] == 3
    assert all(set(entry) == {"1"} for entry in layout["aligned"] + layout["staggered"])
    assert layout["address_mod_4096"]["staggered"] != layout["address_mod_4096"]["aligned"]


def test_cpu_adam_main_writes_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMSCHED_BENCH_OUT", str(tmp_path))
    argv = "--numel 65536 --repeats 1 --hidden 64 --chunk-numel 16384 --chunk-sweep --no-deepspeed"
    rc = cpu_adam.main([*argv.split(), "--no-reference", "--threads", "--name", "smoke"])
    assert rc == 0
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert data["machine"]["torch"] == torch.__version__
    assert set(data["results"]) == {"memsched_chunk16384", "memsched_params_chunk16384", "torch_fused",
                                    "triad", "copy", "axpy"}
    assert data["threads_study"] == data["contention_study"] == data["layout_study"] == {}


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is a benchmark-only peer, not installed")
def test_cpu_adam_tiny_run_with_deepspeed() -> None:
    out = _tiny_run(deepspeed=True, reference=False)
    if not out["deepspeed"]["available"]:
        pytest.skip(f"DeepSpeed CPU Adam op unavailable: {out['deepspeed']['error']}")
    assert {"deepspeed_param", "deepspeed_chunk16384"} <= set(out["results"])
    assert out["numerics"]["deepspeed_param"]["ok"] and out["numerics"]["deepspeed_chunk16384"]["ok"]
    assert out["targets"]["vs_deepspeed"]["ratio"] > 0


# ----------------------------------------------------------------------------------------- gpu_step_time
def test_parse_policy_spec() -> None:
    assert gpu_step_time.parse_policy_spec("auto") == ("auto", {})
    assert gpu_step_time.parse_policy_spec("static:offload_optim_frac=0.5") == (
        "static",
        {"offload_optim_frac": "0.5"},
    )
    with pytest.raises(ValueError, match="is not key=value"):
        gpu_step_time.parse_policy_spec("static:0.5")
    with pytest.raises(ValueError, match="has no name"):
        gpu_step_time.parse_policy_spec(":x=1")


def test_gpu_slug() -> None:
    assert gpu_step_time.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_step_time.gpu_slug("  ") == "unknown-gpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_gpu_step_time_without_cuda_says_so_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MEMSCHED_BENCH_OUT", str(tmp_path))
    assert gpu_step_time.main([]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


TINY = {
    "dims": {"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 32, "block_size": 8},
    "batch": 2,
    "seq": 8,
    "steps": 2,
    "warmup": 1,
    "device": "cpu",
    "mem_fraction": None,
    "gpu_margin_mem_ratio": 0.8,
}


def test_gpu_step_time_run_one_times_plain_adamw_on_cpu() -> None:
    r = gpu_step_time.run_one({**TINY, "kind": "torch_adamw"})
    assert r["status"] == "ok", r
    assert r["step_time"]["n"] == 2 and len(r["losses"]) == 3
    assert r["losses"][-1] < r["losses"][0]  # the optimizer really stepped
    assert r["parameters"] == sum(
        p.numel() for p in gpu_step_time.build_model(TINY["dims"], "cpu")[0].parameters()
    )


def test_gpu_step_time_run_one_reports_bad_kind_and_missing_peer() -> None:
    r = gpu_step_time.run_one({**TINY, "kind": "nope"})
    assert r["status"] == "error" and "unknown configuration kind 'nope'" in r["error"]
    if importlib.util.find_spec("torchao") is None:
        assert gpu_step_time.run_one({**TINY, "kind": "torchao_cpu_offload"})["status"] == "skipped"


def test_gpu_step_time_memsched_policy_on_cpu_stand_in() -> None:
    import memsched

    if not hasattr(memsched, "attach"):
        pytest.skip("memsched.attach is not in this checkout yet")
    r = gpu_step_time.run_one({**TINY, "kind": "memsched", "policy": "static:offload_optim_frac=0.5"})
    assert r["status"] == "ok", r
    assert r["plan"] is not None and r["transfers"] is not None


def test_model_is_memsched_gpt_and_losses_are_compared() -> None:
    m, source = gpu_step_time.build_model(TINY["dims"], "cpu")
    assert source == "memsched.models.gpt.GPT"
    logits = m(torch.randint(32, (2, 8)))
    assert logits.shape == (2, 8, 32)
    assert m.lm_head.weight is m.wte.weight
    # memsched and plain fused AdamW: the same losses, to the bit
    runs = [gpu_step_time.run_one({**TINY, "kind": "torch_adamw"}),
            gpu_step_time.run_one({**TINY, "kind": "memsched", "policy": "cpu"}),
            {"kind": "memsched", "policy": "broken", "status": "error"}]
    gpu_step_time.compare_losses(runs)
    assert runs[1]["loss_reference"] == "torch_adamw" and runs[1]["loss_max_abs_diff"] == 0.0
    assert "loss_max_abs_diff" not in runs[2]


@pytest.mark.slow
def test_gpu_step_time_child_process_round_trip() -> None:
    r = gpu_step_time.run_child({**TINY, "kind": "torch_adamw"}, timeout_s=120)
    assert r["status"] == "ok", r


def test_gpu_step_time_runs_the_llama_bf16_workload_on_the_cpu(tmp_path: Path) -> None:
    """The 8B run's path (issue 42) at a tiny Llama shape: memsched builds it on meta, attaches in bf16 and
    initialises it in place; tokens/s recorded, losses fall. (The peers need CUDA: FSDP2's CPU offload asks
    for an accelerator.)"""
    pytest.importorskip("transformers")
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = {**TINY, "llama": str(tmp_path / "config.json"), "dtype": "bf16", "checkpointing": True,
           "steps": 3}
    r = gpu_step_time.run_one({**cfg, "kind": "memsched", "policy": "cpu"})
    assert r["status"] == "ok", r
    assert r["model_source"].startswith("transformers.LlamaForCausalLM") and r["tokens_per_s"] > 0
    assert r["plan"] is not None and r["losses"][-1] < r["losses"][0]


def test_gpu_numerics_runs_its_cases_on_the_stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import gpu_numerics

    monkeypatch.setenv("MEMSCHED_BENCH_OUT", str(tmp_path))
    assert gpu_numerics.main(["--device", "sim:64MiB", "--policies", "static", "--dtypes", "bf16",
                              "--steps", "3"]) == 0
    (out,) = tmp_path.iterdir()
    result = json.loads(out.read_text())
    assert result["passed"] == 9 and result["failed"] == 0  # 3 clipping paths x overlap off/on/backward
    assert {r["clip_via"] for r in result["results"]} == {"torch", "memsched", "none"}
    assert {r["overlap"] for r in result["results"]} == {False, True, "backward"}


def test_param_alignment_trains_both_packings_on_the_stand_in(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Both packings are exact on the stand-in (CPU kernels do not choose by address); the dense one leaves
    parameters at addresses off a 16-byte boundary, the aligned one none, and the packing comes back."""
    from bench import param_alignment
    from memsched.distributed.base import DataParallel

    monkeypatch.setenv("MEMSCHED_BENCH_OUT", str(tmp_path))
    assert param_alignment.main(["--device", "sim:64MiB", "--steps", "2"]) == 0
    runs = json.loads((tmp_path / "param_alignment_sim.json").read_text())["runs"]
    assert runs["aligned"]["unaligned_parameters"] == 0 and runs["dense"]["unaligned_parameters"] > 0
    assert all(r["bit_identical"] and r["norms_equal"] for r in runs.values())
    assert DataParallel.align == runs["aligned"]["align_elements"] > 1


def test_zero_memory_measures_a_peak_per_rank_for_each_stage() -> None:
    from bench import zero_memory

    two = zero_memory.measure(2, 2, 1, "cpu")
    assert len(two["peak_bytes_per_rank"]) == 2 and two["peak_bytes"] == max(two["peak_bytes_per_rank"])
    assert two["peak_bytes"] > zero_memory.Model().gpt.wte.weight.numel() * 4  # at least the embedding
    assert two["step_s_median"] > 0
    three = zero_memory.measure(2, 3, 1, "cpu")  # parameters sharded too: a lower peak than ZeRO-2's
    assert "refused" not in three and three["peak_bytes"] < two["peak_bytes"], (two, three)


def test_gpu_calibration_runs_its_points_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration command's CPU smoke run: each point in a process of its own, the fake trace's
    prediction (the CPU's own kernels here) equal to the real trace's peak non-model data."""
    from bench import gpu_calibration

    monkeypatch.setenv("MEMSCHED_BENCH_OUT", str(tmp_path))
    assert gpu_calibration.main(["--device", "cpu", "--sizes", "tiny", "--shapes", "2x64", "--dtypes", "fp32",
                                 "--name", "calib"]) == 0
    [row] = json.loads((tmp_path / "calib.json").read_text())["rows"]
    assert row["status"] == "ok" and row["predicted_attention"] == "default"
    assert row["predicted_peak_non_model_bytes"] == row["measured_peak_non_model_bytes"] > 0


def test_compile_step_records_what_tells_a_difference_apart(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile bench's CPU smoke run (aot_eager, so no C++ compiler is needed): memsched and its control
    (torch alone, twice) bit-identical to the reference, no loss differing, no graph break, and the
    diagnostics a GPU run needs to tell where a difference comes from (issue 28, item 11) are written; the
    process's deterministic-algorithms setting is left as it was."""
    from bench import compile_step

    monkeypatch.setenv("MEMSCHED_BENCH_OUT", str(tmp_path))
    before = torch.are_deterministic_algorithms_enabled()
    inductor_deterministic = torch._inductor.config.deterministic
    assert compile_step.main(["--size", "tiny", "--device", "cpu", "--backend", "aot_eager", "--blocks", "1",
                              "--block", "2", "--warmup", "2", "--own-process-steps", "3",
                              "--inductor-deterministic", "--name", "compile"]) == 0
    result = json.loads((tmp_path / "compile.json").read_text())
    assert result["bit_identical"] and result["control_bit_identical"]
    assert result["first_step_with_a_different_loss"] is None
    assert result["control_first_step_with_a_different_loss"] is None
    assert result["graph_breaks_total"] == 0 and result["graph_break_reasons"] == {}
    assert isinstance(result["recompile_guard_failures"], dict)
    assert set(result["placement"]) == {"device"}
    # step by step through warmup: the gradients, then the parameters after each update, equal
    assert result["warmup_first_different_gradients"] is None
    assert result["warmup_first_different_parameters"] is None
    assert result["loss_max_abs_diff"] == 0.0 and result["global_flags_changed_by_memsched"] == {}
    assert result["generated_code"] == {"modules": {}, "memsched_equals_reference": None}  # aot_eager: none
    assert result["config"]["inductor_deterministic"] is True
    alone = result["in_own_processes"]  # each side trained alone in a process of its own, fresh caches
    same = {"bit_identical": True, "first_step_with_a_different_loss": None, "loss_max_abs_diff": 0.0}
    assert alone == {"steps": 3, "fresh_caches": True, **same, "control": same}
    assert torch.are_deterministic_algorithms_enabled() == before
    assert torch._inductor.config.deterministic == inductor_deterministic


def test_compile_step_tells_whether_memsched_compiled_the_references_kernels() -> None:
    """The compile bench's record of inductor's generated code by side (issue 28, item 11: fusion decides
    rounding on a GPU): the same function compiled on both sides gives the same code, another function does
    not, and inductor's own loader is back afterwards."""
    from torch._inductor.codecache import PyCodeCache

    from bench.compile_step import GeneratedCode

    torch._dynamo.reset()
    loader = PyCodeCache.load_by_key_path
    code = GeneratedCode()
    x = torch.randn(8, 8)
    try:
        with code.of("memsched"):
            torch.compile(lambda t: (t.sin() * 2 + 1).sum(0))(x)
        with code.of("adamw"):
            torch.compile(lambda t: (t.sin() * 2 + 1).sum(0))(x)
        assert code.summary() == {"modules": {"memsched": 1, "adamw": 1}, "memsched_equals_reference": True}
        with code.of("adamw"):
            torch.compile(lambda t: (t.cos() * 3).sum(1))(x)
        assert code.summary() == {"modules": {"memsched": 1, "adamw": 2}, "memsched_equals_reference": False}
    finally:
        code.close()
        torch._dynamo.reset()
    assert PyCodeCache.load_by_key_path == loader


def test_clip_link_counts_the_clips_bytes_over_the_link() -> None:
    """bench/clip_link.py on the tiny GPT: a step that clips with the norms taken in backward moves the bytes
    of a step that does not clip; the clip that copies the gradients back adds the gradients' bytes H2D."""
    from bench.clip_link import run

    rows = {clip: run("tiny", torch.float32, clip, steps=4, warmup=2)
            for clip in ("none", "memsched", "memsched-copy-back")}
    assert rows["memsched"]["h2d_mib_per_step"] == rows["none"]["h2d_mib_per_step"] > 0
    assert rows["memsched"]["backward_norm_hits"] > 0 and rows["memsched"]["clip_h2d_mib_per_step"] == 0
    back = rows["memsched-copy-back"]
    # the gradients once more (the spans their parameters cover: the chunks' padding stays behind)
    grads = rows["none"]["d2h_mib_per_step"]
    assert 0.95 * grads <= back["clip_h2d_mib_per_step"] <= grads
    assert back["h2d_mib_per_step"] == rows["none"]["h2d_mib_per_step"] + back["clip_h2d_mib_per_step"]
