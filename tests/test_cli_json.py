"""`--json` on every command that prints a report: one JSON document on stdout and nothing else (no ANSI
codes even where colour is forced, progress and a TARGET's own prints on stderr), holding the numbers the text
report shows; the exports are still written and the document says where.

``memsched trace`` used to take ``--json FILE`` for the timeline's path: that is ``--timeline FILE`` now, and
``--json FILE`` fails saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch

from memsched.cli.main import COMMANDS, build_parser, main
from memsched.report import exports
from memsched.report.text import module_label, peak_total
from policies.units import format_bytes
from tracer.timeline import MemoryTimeline

ROOT = Path(__file__).resolve().parents[1]
# A TARGET that prints to stdout while it is built and at every loss: under --json that must go to stderr.
CHATTY_TARGET = """
import torch
from torch import nn


def build(device):
    print("building the chatty model")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)

    def loss_fn(m):
        print("one chatty step")
        return m(torch.randn(8, 16, device=device)).square().mean()

    return model, loss_fn
"""
DEMO_SIZE = ["--size", "tiny", "--batch-size", "2", "--seq-len", "32", "--steps", "2"]
TOP = 3
#: Sub-commands that print no report, so need no --json. None today: a new command that prints something
#: gets --json (parsers.add_json_flag) and a run in RUNS below, or is named here on purpose.
NO_REPORT: frozenset[str] = frozenset()
ANSI = re.compile(r"\x1b\[")


def _plain(text: str) -> str:
    """``text`` without its colour codes."""
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", text)


@functools.cache
def _demo_capacity() -> int:
    """A stand-in size at which ``auto`` splits the tiny GPT's optimizer state between device and host: the
    base (peak non-model + resident model data + the host chunks' gradient working set) and half the
    optimizer state within auto's budget (0.8 of the margin less a 5 % reserve), with 1 % slack."""
    from memsched.planning.capacity import plan_for_capacity
    from memsched.planning.prediction import gpt_workload, trace_step

    problem = plan_for_capacity(trace_step(gpt_workload("tiny", 2, 32)), 1, policy_names=[]).problem
    base = problem.peak_non_model_bytes + problem.resident_model_bytes + problem.host_grad_working_bytes
    half = sum(c.device_bytes for c in problem.chunks) / 2
    return int((base * 1.01 + half / 0.8) / 0.95) // 65536 * 65536 + 65536


#: Command -> its arguments for a run with --json, given a scratch folder: the smallest sizes, the stand-in.
RUNS: dict[str, Callable[[Path], list[str]]] = {
    "demo": lambda d: ["demo", *DEMO_SIZE, "--device", f"sim:{_demo_capacity()}", "--out", str(d / "demo"),
                       "--json"],
    "trace": lambda d: ["trace", f"{d / 'chatty.py'}:build", "--steps", "1", "--device", "cpu", "--out",
                        str(d / "trace"), "--top", str(TOP), "--json"],
    "report": lambda d: ["report", str(d / "saved.json"), "--top", str(TOP), "--perfetto",
                         str(d / "re" / "saved.perfetto.json"), "--json"],
    "plan": lambda d: ["plan", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--capacity",
                       "4MiB", "--json"],
    "policies": lambda d: ["policies", "--json"],
}


def _run(argv: list[str]) -> tuple[int, str, str]:
    """``memsched ARGV`` in this process with colour forced (rich would colour stdout if anything printed
    there went through it), 200 columns wide (a text report's lines unwrapped): exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {"FORCE_COLOR": "1", "COLUMNS": "200"}):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the runs: the chatty TARGET and a timeline saved by a plain `memsched trace`."""
    d = tmp_path_factory.mktemp("json")
    (d / "chatty.py").write_text(textwrap.dedent(CHATTY_TARGET))
    example = f"{ROOT / 'examples' / 'trace_target.py'}:build"
    rc, _, err = _run(["trace", example, "--steps", "1", "--device", "cpu", "--out", str(d / "saved"),
                       "--timeline", str(d / "saved.json"), "--quiet"])
    assert rc == 0, err
    return d


@pytest.fixture(scope="module")
def runs(scratch: Path) -> dict[str, tuple[int, str, str]]:
    """Every command of RUNS, run once with --json: ``{command: (exit code, stdout, stderr)}``."""
    return {name: _run(argv(scratch)) for name, argv in RUNS.items()}


def _document(runs: dict[str, tuple[int, str, str]], name: str) -> dict:
    rc, out, err = runs[name]
    assert rc == 0, err
    return json.loads(out)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


# ---- every command has it ----------------------------------------------------------------------------------
def test_every_command_that_prints_a_report_has_a_json_flag() -> None:
    subparsers = _subparsers()
    assert set(subparsers) == set(COMMANDS)
    reporting = set(subparsers) - NO_REPORT
    assert set(RUNS) == reporting, "every command that prints a report needs --json and a run in RUNS"
    for name in sorted(reporting):
        p = subparsers[name]
        assert "--json" in p._option_string_actions, f"memsched {name} prints a report but has no --json"
        required = ["X" for a in p._actions if not a.option_strings and a.required]  # TARGET, FILE
        assert p.parse_args([*required, "--json"]).json is True, name  # a flag: it takes no value
        assert p.parse_args(required).json is False, name


@pytest.mark.parametrize("name", sorted(RUNS))
def test_json_is_the_only_thing_on_stdout(runs, name: str) -> None:
    rc, out, err = runs[name]
    assert rc == 0, err
    assert not ANSI.search(out)  # colour was forced: nothing went through rich to stdout
    json.loads(out)  # the whole of stdout is one document
    assert "Traceback" not in err


def test_colour_is_forced_in_these_runs(scratch) -> None:
    """The ANSI check above means something: without --json, the same forced run colours its report."""
    rc, out, _ = _run(["report", str(scratch / "saved.json"), "--top", str(TOP)])
    assert rc == 0 and ANSI.search(out)


# ---- memsched trace / report -------------------------------------------------------------------------------
def test_trace_json_has_the_timelines_numbers_and_the_exports(runs, scratch) -> None:
    doc = _document(runs, "trace")
    _, _, err = runs["trace"]
    assert "building the chatty model" in err and "one chatty step" in err  # the TARGET's prints: stderr
    assert doc["schema"] == "memsched.report.text" and doc["version"] == 1 and doc["command"] == "trace"
    kinds = {"json", "perfetto", "memory_viz"} | ({"png"} if exports.png_available() else set())
    assert set(doc["exports"]) == kinds
    assert all(Path(path).is_file() for path in doc["exports"].values())
    assert doc["exports"]["json"] == str(scratch / "trace" / "trace.json")

    timeline = MemoryTimeline.load(doc["exports"]["json"])  # what the JSON reports is what was written
    assert doc["meta"]["target"] == f"{scratch / 'chatty.py'}:build" and doc["meta"]["steps"] == 1
    s = doc["summary"]
    assert s["peak_non_model_bytes"] == timeline.peak_non_model_bytes() > 0
    assert s["peak_total_bytes"] == peak_total(timeline)[0] > s["peak_non_model_bytes"]
    assert s["model_data_bytes"] == timeline.model_data_bytes()
    assert s["model_data_bytes"]["optimizer_state"] > 0  # AdamW states were traced
    stats = timeline.module_stats()
    top = sorted(stats, key=lambda m: m.activation_bytes, reverse=True)[:TOP]
    assert doc["modules"]["count"] == len(stats)
    assert [(m["name"], m["activation_bytes"]) for m in doc["modules"]["top"]] == \
        [(m.name, m.activation_bytes) for m in top]
    assert doc["plan"] is None and doc["transfers"] is None  # a plain trace places nothing


def test_report_json_equals_the_text_report(runs, scratch) -> None:
    doc = _document(runs, "report")
    assert doc["command"] == "report" and doc["file"] == str(scratch / "saved.json")
    perfetto = scratch / "re" / "saved.perfetto.json"
    assert doc["exports"] == {"perfetto": str(perfetto)} and json.loads(perfetto.read_text())["traceEvents"]

    rc, text, err = _run(["report", str(scratch / "saved.json"), "--top", str(TOP)])
    assert rc == 0, err
    text = _plain(text)  # the same numbers, read without the colours
    s = doc["summary"]
    peak_line = next(line for line in text.splitlines() if "peak non-model data" in line)
    assert format_bytes(s["peak_non_model_bytes"]) in peak_line
    total_line = next(line for line in text.splitlines() if "peak total" in line)
    assert format_bytes(s["peak_total_bytes"]) in total_line
    for category, size in s["model_data_bytes"].items():
        assert f"{category} {format_bytes(size)}" in text
    assert f"top {TOP} of {doc['modules']['count']}" in text
    rows = [line.split() for line in text.splitlines()]
    for m in doc["modules"]["top"]:
        row = next(r for r in rows if r and r[0] == module_label(m["name"]))
        assert " ".join(row).startswith(f"{module_label(m['name'])} {m['calls_per_step']:g} "
                                        f"{format_bytes(m['activation_bytes'])}")
    assert f"{s['steps']} traced, {s['samples']} samples" in text


def test_report_json_of_the_traces_timeline_is_the_traces_json(runs, scratch) -> None:
    """`report FILE --json` re-reads what `trace --json` reported: the same document, but for where files
    went (and whatever the export adds to the file's meta)."""
    traced = _document(runs, "trace")
    rc, out, err = _run(["report", traced["exports"]["json"], "--top", str(TOP), "--json"])
    assert rc == 0, err
    again = json.loads(out)
    assert again["exports"] == {}  # nothing asked for, nothing written
    drop = {"command", "exports", "file", "meta"}
    assert {k: v for k, v in again.items() if k not in drop} == \
        {k: v for k, v in traced.items() if k not in drop}
    assert traced["meta"].items() <= again["meta"].items()


def test_trace_json_file_moved_to_timeline(scratch, tmp_path, capsys) -> None:
    """The old ``--json FILE`` fails naming --timeline (parsing, before any work); --timeline writes there."""
    target = f"{scratch / 'chatty.py'}:build"
    for argv in (["--json", "out/t.json"], ["--json=out/t.json"]):
        with pytest.raises(SystemExit) as e:
            main(["trace", target, *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert ("memsched trace: error: argument --json: takes no value (got 'out/t.json'): the timeline "
                "JSON's path moved to --timeline FILE, so write --timeline out/t.json; --json now prints "
                "the report as JSON on stdout") in err
    with pytest.raises(SystemExit):  # --json before TARGET takes it as the value: the message says where to
        main(["trace", "--json", target])
    assert f"if {target!r} is the TARGET, put --json after it" in capsys.readouterr().err
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        main(["trace", "--help"])
    assert "[--json]" in help_text.getvalue() and "--timeline FILE" in help_text.getvalue()

    where = tmp_path / "elsewhere" / "t.json"
    rc = main(["trace", target, "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "o"), "--timeline",
               str(where), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert json.loads(captured.out)["exports"]["json"] == str(where)
    assert MemoryTimeline.load(where).meta["steps"] == 1 and not (tmp_path / "o" / "trace.json").exists()


# ---- memsched demo -----------------------------------------------------------------------------------------
def test_demo_json_is_the_runs_report_plan_and_exports(runs, scratch) -> None:
    doc = _document(runs, "demo")
    _, _, err = runs["demo"]
    assert "memsched demo: GPT tiny" in _plain(err)  # the header (and the progress) went to stderr
    assert doc["schema"] == "memsched.report.text" and doc["command"] == "demo"
    out = scratch / "demo"
    assert doc["exports"]["json"] == str(out / "trace.json")
    assert doc["exports"]["plan"] == str(out / "plan.json")
    assert doc["exports"]["summary"] == str(out / "demo.json")
    assert all(Path(path).is_file() for path in doc["exports"].values())

    # The document holds what the exports hold: demo.json's run, plan.json's plan, history and problem.
    run = json.loads((out / "demo.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert doc["run"] == run and run["capacity_bytes"] == _demo_capacity() and len(run["losses"]) == 2
    assert doc["plan"] == plan["plan"] and doc["plan_history"] == plan["history"]
    assert doc["problem"] == plan["problem"]
    assert doc["transfers"] == run["transfers"] and doc["step_summary"] == run["step_timeline"]
    timeline = MemoryTimeline.load(out / "trace.json")
    assert doc["summary"]["peak_non_model_bytes"] == timeline.peak_non_model_bytes() \
        == doc["problem"]["peak_non_model_bytes"]
    assert doc["summary"]["peak_total_bytes"] == peak_total(timeline)[0]
    if not torch.cuda.is_available():  # the stand-in is sized for a real split
        assert {"device", "host"} <= set(doc["plan"]["placement"])
        assert doc["transfers"]["h2d_bytes"] > 0


def test_demo_json_numbers_are_the_text_reports(runs, scratch, tmp_path) -> None:
    """The same demo printed as text shows the JSON's figures (bytes are deterministic on the stand-in)."""
    doc = _document(runs, "demo")
    rc, text, err = _run(["demo", *DEMO_SIZE, "--device", f"sim:{_demo_capacity()}", "--out",
                          str(tmp_path / "text")])
    assert rc == 0, err
    text = _plain(text)
    lines = text.splitlines()
    def line_of(label: str) -> str:
        return next(line for line in lines if label in line)

    assert format_bytes(doc["summary"]["peak_non_model_bytes"]) in line_of("peak non-model data")
    assert format_bytes(doc["summary"]["peak_total_bytes"]) in line_of("peak total")
    assert format_bytes(doc["plan"]["margin_bytes"]) in line_of("GPU margin")
    text_plan = json.loads((tmp_path / "text" / "plan.json").read_text())
    assert text_plan["plan"]["placement"] == doc["plan"]["placement"]
    assert f"train loss {doc['run']['losses'][0]:.3f}" in text
