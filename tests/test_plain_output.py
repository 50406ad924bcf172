"""Output that is not a terminal (a log, CI, a pipe): no ANSI codes, the width from ``COLUMNS`` or wider than
80 columns, legends in words and symbols, and the training progress as periodic log lines."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from memsched.report.console import DEFAULT_WIDTH, make_console, output_width
from memsched.report.progress import StepStats, TrainingProgress

# Variables that make rich treat any output as a terminal; CI systems set some of them.
FORCING = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "COLUMNS")


@pytest.fixture
def plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FORCING:
        monkeypatch.delenv(name, raising=False)


def test_console_off_a_terminal_is_wider_than_80_or_takes_columns(plain_env, monkeypatch) -> None:
    console = make_console(file=io.StringIO())
    assert not console.is_terminal and console.width == DEFAULT_WIDTH > 80
    monkeypatch.setenv("COLUMNS", "150")
    assert make_console(file=io.StringIO()).width == 150
    for junk in ("0", "-5", "wide", ""):  # not a width: the default
        assert output_width({"COLUMNS": junk}) == DEFAULT_WIDTH


def test_progress_off_a_terminal_is_log_lines(plain_env) -> None:
    out = io.StringIO()
    with TrainingProgress(5, console=make_console(file=out), log_every=2) as bar:
        for i in range(5):
            bar.update(StepStats(loss=3.0 - i / 10, seconds=0.5, tokens=1000, h2d_bytes=2**20, d2h_bytes=0))
    text = out.getvalue()
    assert "\x1b" not in text
    lines = text.splitlines()
    # The first step, every second step and the last.
    assert [line.split(":")[0] for line in lines] == [f"training step {i}/5" for i in (1, 2, 4, 5)]
    assert lines[-1].startswith("training step 5/5: loss 2.600, 0.50 s/step, 2,000 tok/s, H2D 1.0 MiB "
                                "D2H 0 B /step, elapsed 0:00:0")


def test_progress_logs_about_ten_lines_by_default(plain_env) -> None:
    out = io.StringIO()
    with TrainingProgress(20, console=make_console(file=out)) as bar:
        for _ in range(20):
            bar.update(StepStats(loss=1.0, seconds=0.1, tokens=10))
    assert len(out.getvalue().splitlines()) == 11  # step 1, then every 2 steps


def test_progress_on_a_terminal_is_a_bar() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    with TrainingProgress(3, console=console) as bar:
        assert bar.progress is not None
        for _ in range(3):
            bar.update(StepStats(loss=1.0, seconds=0.1, tokens=10))
    assert "training step" not in console.file.getvalue()


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_log_every_is_named(bad: object) -> None:
    with pytest.raises(ValueError, match=f"log_every must be a positive int or None, got {bad!r}"):
        TrainingProgress(3, log_every=bad)  # type: ignore[arg-type]


def test_cli_report_piped_has_no_ansi_a_word_legend_and_full_width(tmp_path: Path) -> None:
    import torch

    from tracer import MemoryTracer

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters())
    with MemoryTracer(model, optimizer=opt) as tracer:
        model(torch.randn(32, 64)).square().mean().backward()
        opt.step()
    tracer.timeline.save(tmp_path / "trace.json")
    env = {k: v for k, v in os.environ.items() if k not in FORCING}
    proc = subprocess.run([sys.executable, "-m", "memsched", "report", str(tmp_path / "trace.json")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "\x1b" not in out
    assert "P parameter" in out and "A activation" in out  # the legend names what each letter stands for
    assert max(len(line) for line in out.splitlines()) == DEFAULT_WIDTH  # not folded at 80 columns
