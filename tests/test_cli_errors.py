"""CLI errors on files: one line on stderr naming the file and the problem, no traceback, exit code 2; and
`memsched trace` checks its output paths before it runs anything."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memsched.cli.main import main
from tracer.timeline import READABLE_VERSIONS, SCHEMA, VERSION


def one_error_line(err: str, command: str) -> str:
    """The single line a failing command prints (no traceback, no usage)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"memsched {command}: error: "), err
    return lines[0]


def timeline(samples: list[dict] | None = None, **top: object) -> bytes:
    return json.dumps({"schema": SCHEMA, "version": VERSION, "meta": {}, "samples": samples or [],
                       **top}).encode()


GOOD_SAMPLE = {"t_ns": 0, "step": 0, "phase": "forward", "module": "", "event": "pre", "device": "cpu",
               "bytes": {"activation": 10}, "peak_bytes": 10, "peak_non_model_bytes": 10}
FOLDER, MISSING = b"<a folder>", b"<no file>"

# name -> (the file's bytes, or FOLDER / MISSING; what the message says besides the file's name)
BAD_FILES: dict[str, tuple[bytes, str]] = {
    "truncated-json": (timeline()[:40], "is not valid JSON (Unterminated string"),
    "empty": (b"", "is empty; expected a memsched timeline (JSON, schema 'memsched.timeline', version 2)"),
    "blank": (b"  \n", "is empty; expected a memsched timeline"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\xff", "is not UTF-8 text (byte 0x89 at offset 0)"),
    "other-schema": (json.dumps({"schema": "other", "version": 1}).encode(),
                     "not a memsched timeline: expected schema 'memsched.timeline', got 'other'"),
    "json-array": (b"[1, 2]", "not a memsched timeline: expected schema 'memsched.timeline', got a JSON "
                              "array"),
    "newer-version": (timeline(version=VERSION + 1),
                      f"unsupported timeline version {VERSION + 1}: this release reads "
                      f"{', '.join(map(str, READABLE_VERSIONS))}"),
    "no-samples": (json.dumps({"schema": SCHEMA, "version": VERSION}).encode(),
                   "'samples' must be a list, got null"),
    "sample-missing-field": (timeline([{k: v for k, v in GOOD_SAMPLE.items() if k != "phase"}]),
                             "sample 0 lacks 'phase'; expected the fields t_ns, step, phase"),
    "sample-wrong-type": (timeline([GOOD_SAMPLE, {**GOOD_SAMPLE, "peak_bytes": "10"}]),
                          "sample 1: 'peak_bytes' must be an integer, got '10'"),
    "folder": (FOLDER, "cannot read {file!r}: Is a directory"),
    "missing": (MISSING, "cannot read {file!r}: No such file or directory"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_report_bad_file_is_one_line_naming_it(case, tmp_path, capsys):
    content, problem = BAD_FILES[case]
    path = tmp_path / f"{case}.json"
    if content == FOLDER:
        path.mkdir()
    elif content != MISSING:
        path.write_bytes(content)
    assert main(["report", str(path)]) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err, "report")
    assert repr(str(path)) in line  # names the file
    assert problem.format(file=str(path)) in line, line
    assert captured.out == ""  # nothing was rendered


def test_report_bad_export_path_fails_before_rendering(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_bytes(timeline([GOOD_SAMPLE]))
    folder = tmp_path / "a-folder"
    folder.mkdir()
    assert main(["report", str(path), "--perfetto", str(folder)]) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err, "report")
    assert f"--perfetto {str(folder)!r} is a folder; expected a file path" in line
    assert captured.out == ""  # checked before the report was rendered


def test_report_folder_in_a_subprocess_has_no_traceback(tmp_path):
    """Run as users run it: the exit code and stderr of the process itself."""
    proc = subprocess.run([sys.executable, "-m", "memsched", "report", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert one_error_line(proc.stderr, "report") == \
        f"memsched report: error: cannot read {str(tmp_path)!r}: Is a directory"


TARGET = """
import pathlib

import torch
from torch import nn


def build(device):
    pathlib.Path(__file__).with_name("built").touch()  # the target ran: outputs were not checked first
    model = nn.Linear(4, 2).to(device)
    return model, lambda m: m(torch.ones(3, 4, device=device)).square().mean()
"""


@pytest.fixture
def target(tmp_path: Path) -> Path:
    path = tmp_path / "target.py"
    path.write_text(textwrap.dedent(TARGET))
    return path


# name -> (arguments after TARGET given the tmp folder and a file and a folder in it, expected message)
BAD_OUTPUTS = {
    "out-is-a-file": (lambda d, f, dd: ["--out", str(f)],
                      "--out {f!r} is a file; expected a folder for the exports (created if missing)"),
    "timeline-is-a-folder": (lambda d, f, dd: ["--out", str(d / "o"), "--timeline", str(dd)],
                             "--timeline {dd!r} is a folder; expected a file path (an existing file is "
                             "replaced)"),
    "png-under-a-file": (lambda d, f, dd: ["--out", str(d / "o"), "--png", str(f / "plot.png")],
                         "--png {fp!r}: {f!r} is a file, not a folder"),
    "default-export-is-a-folder": (lambda d, f, dd: ["--out", str(dd.parent), "--timeline",
                                                     str(d / "t.json")],
                                   "{perfetto!r} (in --out) is a folder; expected a file path"),
    "two-exports-one-file": (lambda d, f, dd: ["--out", str(d / "o"), "--timeline", str(d / "x.json"),
                                               "--perfetto", str(d / "x.json")],
                             "--timeline {x!r} and --perfetto {x!r} are the same file"),
}


@pytest.mark.parametrize("case", sorted(BAD_OUTPUTS))
def test_trace_checks_outputs_before_it_runs(case, target, tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me\n")
    a_folder = tmp_path / "exports" / "a-folder"
    a_folder.mkdir(parents=True)
    (tmp_path / "exports" / "trace.perfetto.json").mkdir()  # where --out exports's Perfetto file would go
    args, message = BAD_OUTPUTS[case]
    rc = main(["trace", f"{target}:build", "--steps", "1", "--device", "cpu", "--quiet",
               *args(tmp_path, a_file, a_folder)])
    captured = capsys.readouterr()
    assert rc == 2
    line = one_error_line(captured.err, "trace")
    assert message.format(f=str(a_file), dd=str(a_folder), fp=str(a_file / "plot.png"),
                          perfetto=str(tmp_path / "exports" / "trace.perfetto.json"),
                          x=str(tmp_path / "x.json")) in line, line
    assert not (tmp_path / "built").exists()  # the TARGET was never built, let alone traced
    assert a_file.read_text() == "keep me\n" and not (tmp_path / "o").exists()  # nothing written
