"""`memsched trace` / `memsched report` end to end, and the TARGET contract (memsched.target)."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from memsched.cli.main import main
from memsched.target import Workload, build_workload, load_target
from policies.units import format_bytes
from tracer.timeline import MemoryTimeline

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = f"{ROOT / 'examples' / 'trace_target.py'}:build"
needs_tracer = pytest.mark.skipif(
    not hasattr(__import__("tracer"), "MemoryTracer"), reason="tracer.MemoryTracer is not available"
)

BAD_TARGETS = """
import torch
from torch import nn

NOT_A_FUNCTION = 3


def model_only(device):
    return nn.Linear(2, 2).to(device)


def not_a_module(device):
    return 1, 2


def three_things(device):
    return nn.Linear(2, 2).to(device), None, None


def loss_not_callable(device):
    return nn.Linear(2, 2).to(device), "mse"


def on_meta(device):
    model = nn.Linear(2, 2, device="meta")
    return model, lambda m: m(torch.ones(1, 2, device="meta")).sum()


def _net(device):
    return nn.Linear(4, 3).to(device)


def vector_loss(device):
    return _net(device), lambda m: m(torch.randn(5, 4, device=device))


def float_loss(device):
    return _net(device), lambda m: 0.5


def no_grad_loss(device):
    def loss_fn(m):
        with torch.no_grad():
            return m(torch.randn(5, 4, device=device)).sum()
    return _net(device), loss_fn


def frozen(device):
    model = _net(device).requires_grad_(False)
    return model, lambda m: m(torch.randn(5, 4, device=device)).sum()


def as_workload(device):
    from memsched.target import Workload
    return Workload(_net(device), lambda m: m(torch.randn(5, 4, device=device)).square().mean())
"""


@pytest.fixture(scope="module")
def bad_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("targets") / "bad_targets.py"
    path.write_text(textwrap.dedent(BAD_TARGETS))
    return path


# ---- the TARGET contract, without the tracer -------------------------------------------------------------
def test_load_target_from_file_and_module(bad_file):
    fn = load_target(EXAMPLE)
    assert fn.__name__ == "build"
    assert load_target(EXAMPLE) is fn  # loaded once
    assert load_target("memsched.target:build_workload") is build_workload
    assert load_target("memsched.target:Workload.loss") is Workload.loss  # dotted attribute path


def test_build_workload_accepts_tuple_workload_and_callable(bad_file):
    wl = build_workload(EXAMPLE, "cpu")
    assert isinstance(wl.model, nn.Module) and wl.name == EXAMPLE
    loss = wl.loss()
    assert loss.dim() == 0 and loss.requires_grad
    wl2 = build_workload(f"{bad_file}:as_workload", torch.device("cpu"))
    assert isinstance(wl2.model, nn.Linear) and wl2.loss().requires_grad
    wl3 = build_workload(lambda device: (nn.Linear(1, 1), lambda m: m(torch.ones(1)).sum()), "cpu")
    assert wl3.loss().numel() == 1


@pytest.mark.parametrize(
    "suffix, error, message",
    [
        ("NOT_A_FUNCTION", TypeError, "'NOT_A_FUNCTION' is int 3, not callable; expected a function"),
        (
            "nope",
            ValueError,
            "'nope' not found in .*callables there: as_workload, float_loss, frozen, loss_not_callable",
        ),
        ("model_only", TypeError, "returned Linear .*; expected \\(model, loss_fn\\)"),
        ("not_a_module", TypeError, "returned int 1 as the model; expected \\(model, loss_fn\\)"),
        ("three_things", TypeError, "returned a tuple of 3 \\(Linear, NoneType, NoneType\\); expected"),
        ("loss_not_callable", TypeError, "as loss_fn; expected a callable loss_fn\\(model\\)"),
        ("on_meta", ValueError, "parameters are on meta, expected cpu"),
    ],
)
def test_build_workload_errors_say_what_was_expected(bad_file, suffix, error, message):
    with pytest.raises(error, match=message):
        build_workload(f"{bad_file}:{suffix}", "cpu")


@pytest.mark.parametrize(
    "suffix, error, message",
    [
        ("vector_loss", ValueError, "returned a tensor of shape \\(5, 3\\); expected a scalar loss"),
        ("float_loss", TypeError, "returned float 0.5; expected a scalar torch.Tensor loss"),
        ("no_grad_loss", ValueError, "does not require grad; expected a loss computed from"),
    ],
)
def test_bad_losses_are_reported(bad_file, suffix, error, message):
    wl = build_workload(f"{bad_file}:{suffix}", "cpu")
    with pytest.raises(error, match=message):
        wl.loss()


@pytest.mark.parametrize(
    "spec, error, message",
    [
        (
            "examples/trace_target.py",
            ValueError,
            "has no ':function' part; expected path/to/file.py:function",
        ),
        (":build", ValueError, "has no ':function' part"),
        ("missing/dir/train.py:build", FileNotFoundError, "not found; expected path/to/file.py:function"),
        ("no_such_package_xyz.models:build", ValueError, "no module named 'no_such_package_xyz'; expected"),
        (42, TypeError, "TARGET must be a string"),
    ],
)
def test_load_target_errors(spec, error, message):
    with pytest.raises(error, match=message):
        load_target(spec)


def test_a_target_that_fails_to_import_leaves_no_trace(tmp_path):
    path = tmp_path / "broken_target.py"
    path.write_text("raise RuntimeError('boom at import')\n")
    before_modules, before_path = set(sys.modules), list(sys.path)
    with pytest.raises(RuntimeError, match="boom at import"):
        load_target(f"{path}:build")
    assert set(sys.modules) == before_modules and sys.path == before_path


# ---- the CLI -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """One `memsched trace` of the example (1 step, cpu), shared by the tests that read its output."""
    if not hasattr(__import__("tracer"), "MemoryTracer"):
        pytest.skip("tracer.MemoryTracer is not available")
    out = tmp_path_factory.mktemp("traced") / "out"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["trace", EXAMPLE, "--steps", "1", "--out", str(out), "--device", "cpu", "--top", "4"])
    return rc, out, stdout.getvalue(), stderr.getvalue()


def test_trace_end_to_end(traced):
    rc, out, stdout, stderr = traced
    assert rc == 0, stderr
    files = {p.name for p in out.iterdir()}
    assert files == {"trace.json", "trace.perfetto.json", "trace.memory_viz.pickle", "trace.png"}
    timeline = MemoryTimeline.load(out / "trace.json")
    assert timeline.meta["steps"] == 1 and timeline.device == "cpu"
    assert {s.step for s in timeline.samples if s.phase in ("forward", "backward", "optimizer")} == {0}
    assert timeline.meta["optimizer"] == "AdamW"
    assert timeline.meta["target"] == EXAMPLE
    stats = {m.name: m for m in timeline.module_stats()}
    assert stats["shared"].calls == 2 and stats["block"].calls == 1  # shared runs twice per forward
    assert timeline.model_data_bytes()["optimizer_state"] > 0  # AdamW states were traced
    assert "peak non-model data" in stdout and "shared" in stdout
    assert format_bytes(timeline.peak_non_model_bytes()) in stdout
    for name in files:
        assert str(out / name) in stdout  # says where each file went
    assert json.loads((out / "trace.perfetto.json").read_text())["traceEvents"]
    assert pickle.loads((out / "trace.memory_viz.pickle").read_bytes())["device_traces"][0]
    assert (out / "trace.png").read_bytes()[:4] == b"\x89PNG"


@needs_tracer
def test_trace_without_optimizer_and_with_overrides(tmp_path, capsys):
    json_path, perfetto = tmp_path / "a" / "t.json", tmp_path / "b" / "p.json"
    rc = main(
        [
            "trace",
            EXAMPLE,
            "--steps",
            "2",
            "--optimizer",
            "none",
            "--device",
            "cpu",
            "--quiet",
            "--out",
            str(tmp_path / "out"),
            "--timeline",
            str(json_path),
            "--perfetto",
            str(perfetto),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "peak non-model data" not in captured.out  # --quiet: no report, only the paths
    assert json_path.exists() and perfetto.exists()
    assert not (tmp_path / "out" / "trace.json").exists()
    timeline = MemoryTimeline.load(json_path)
    assert timeline.model_data_bytes()["optimizer_state"] == 0
    assert timeline.meta["optimizer"] is None and timeline.meta["steps"] == 2


@needs_tracer
@pytest.mark.slow
def test_trace_in_a_subprocess(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "memsched",
            "trace",
            EXAMPLE,
            "--steps",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "peak non-model data" in proc.stdout
    assert (out / "trace.json").exists() and (out / "trace.png").exists()


def test_report_rerenders_and_reexports(traced, tmp_path, capsys):
    _, out, _, _ = traced
    saved = MemoryTimeline.load(out / "trace.json")
    viz, png = tmp_path / "re" / "m.pickle", tmp_path / "re" / "p.png"
    rc = main(["report", str(out / "trace.json"), "--top", "2", "--memory-viz", str(viz), "--png", str(png)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "peak non-model data" in captured.out and "top 2 of" in captured.out
    assert format_bytes(saved.peak_non_model_bytes()) in captured.out
    assert pickle.loads(viz.read_bytes())["device_traces"] and png.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (tmp_path / "re").iterdir()) == ["m.pickle", "p.png"]  # only what was asked


def test_report_bad_files(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "memsched report: error:" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "something.else"}))
    assert main(["report", str(other)]) == 2
    assert "not a memsched timeline: expected schema 'memsched.timeline'" in capsys.readouterr().err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert main(["report", str(garbage)]) == 2


@pytest.mark.parametrize(
    "suffix, message",
    [
        (None, "has no ':function' part; expected path/to/file.py:function or package.module:function"),
        ("nope", "'nope' not found in"),
        ("NOT_A_FUNCTION", "not callable; expected a function taking a torch.device"),
        ("model_only", "; expected (model, loss_fn)"),
        ("not_a_module", "as the model; expected (model, loss_fn)"),
        ("vector_loss", "expected a scalar loss"),
        ("float_loss", "expected a scalar torch.Tensor loss"),
        ("frozen", "no trainable parameters; expected at least one parameter with requires_grad=True"),
    ],
)
def test_trace_bad_target_exit_code_2(bad_file, tmp_path, capsys, suffix, message):
    if suffix in ("vector_loss", "float_loss") and not hasattr(__import__("tracer"), "MemoryTracer"):
        pytest.skip("the loss is checked under the tracer")
    spec = str(bad_file) if suffix is None else f"{bad_file}:{suffix}"
    out = tmp_path / "out"
    rc = main(["trace", spec, "--steps", "1", "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("memsched trace: error: ") and message in err and err.count("\n") == 1
    assert not out.exists()  # nothing written


@pytest.mark.parametrize(
    "spec, message",
    [
        ("missing/train.py:build", "not found; expected path/to/file.py:function"),
        ("no_such_package_xyz:build", "no module named 'no_such_package_xyz'"),
    ],
)
def test_trace_missing_file_or_module_exit_code_2(tmp_path, capsys, spec, message):
    assert main(["trace", spec, "--device", "cpu", "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--steps", "0"],
        ["--steps", "x"],
        ["--top", "0"],
        ["--lr", "-1"],
        ["--backend", "magic"],
        ["--optimizer", "sgd"],
    ],
)
def test_trace_bad_options_exit_code_2(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["trace", EXAMPLE, *args])
    assert exc.value.code == 2
    assert "memsched trace: error: argument" in capsys.readouterr().err


def test_trace_bad_device(tmp_path, capsys):
    assert main(["trace", EXAMPLE, "--device", "toaster", "--out", str(tmp_path)]) == 2
    assert "--device 'toaster' is not a torch device; expected cpu, cuda or cuda:N" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["trace", EXAMPLE, "--device", "cuda", "--out", str(tmp_path)]) == 2
        assert "CUDA is not available here" in capsys.readouterr().err


@needs_tracer
def test_trace_cuda_backend_on_cpu_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["trace", EXAMPLE, "--device", "cpu", "--backend", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memsched trace: error: ") and "backend 'cuda'" in err
    assert not out.exists()


@needs_tracer
def test_trace_without_matplotlib_skips_the_png(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "out"
    assert main(["trace", EXAMPLE, "--steps", "1", "--device", "cpu", "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "skipped PNG" in err and "pip install 'memsched[plot]'" in err
    assert {p.name for p in out.iterdir()} == {"trace.json", "trace.perfetto.json", "trace.memory_viz.pickle"}
    # Asked for explicitly, a missing PNG is a failure (exit code 1) after the other exports.
    rc = main(
        [
            "report",
            str(out / "trace.json"),
            "--png",
            str(tmp_path / "p.png"),
            "--perfetto",
            str(tmp_path / "p.json"),
        ]
    )
    assert rc == 1 and "cannot write PNG" in capsys.readouterr().err
    assert (tmp_path / "p.json").exists() and not (tmp_path / "p.png").exists()


@needs_tracer
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trace_on_cuda(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["trace", EXAMPLE, "--steps", "2", "--device", "cuda", "--backend", "cuda", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    timeline = MemoryTimeline.load(out / "trace.json")
    assert timeline.device.startswith("cuda")
    assert any(s.cuda for s in timeline.for_device())
    assert "CUDA reserved (max)" in captured.out and "NVML used" in captured.out
