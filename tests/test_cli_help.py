"""`memsched --help` stays quick: building the parser and printing any command's help imports neither torch
nor rich nor the tracer (each command imports them when it runs)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from memsched.cli.main import COMMANDS

# Run in a fresh interpreter: this test process has imported torch long ago.
PROBE = textwrap.dedent("""
    import contextlib, io, json, sys
    from memsched.cli.main import build_parser, main
    build_parser()
    helps = {}
    for argv in [["--help"], *[[name, "--help"] for name in sys.argv[1:]]]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(argv)
        helps[" ".join(argv)] = out.getvalue()
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "rich", "tracer", "numpy"))
    print(json.dumps({"heavy": heavy, "helps": helps}))
""")


def test_help_of_every_command_imports_no_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE, *COMMANDS], capture_output=True, text=True,
                          timeout=120, check=True)
    result = json.loads(proc.stdout)
    assert result["heavy"] == []
    assert all(name in result["helps"]["--help"] for name in COMMANDS)
    for name in COMMANDS:
        assert f"usage: memsched {name}" in result["helps"][f"{name} --help"]
    assert "1.3b" in result["helps"]["demo --help"]  # the GPT sizes, listed without torch


def test_python_dash_m_memsched_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "memsched", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: memsched") and "plan" in proc.stdout


def test_lazy_names_still_import() -> None:
    import memsched
    import memsched.models
    from memsched.optim.hybrid_adamw import HybridAdamW
    from memsched.scheduler import attach

    assert memsched.attach is attach and memsched.HybridAdamW is HybridAdamW
    assert set(memsched.__all__) <= set(dir(memsched))
    from memsched.models import build_gpt  # from the torch half of memsched.models, on first use

    assert build_gpt("tiny").config == memsched.models.config_for("tiny")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        memsched.nope  # noqa: B018


def test_the_parsers_choices_match_what_the_commands_run() -> None:
    import torch

    from memsched.cli import parsers, plan
    from memsched.planning.prediction import ATTENTION

    assert parsers.ATTENTION == ATTENTION
    assert plan.DTYPES == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def test_demo_overlap_takes_an_optional_mode():
    """``--overlap`` alone is attach(overlap=True); ``--overlap backward`` is attach(overlap="backward")."""
    import argparse

    from memsched.cli.parsers import add_demo

    ap = argparse.ArgumentParser()
    add_demo(ap.add_subparsers(dest="cmd"))
    assert ap.parse_args(["demo"]).overlap is False
    assert ap.parse_args(["demo", "--overlap"]).overlap is True
    assert ap.parse_args(["demo", "--overlap", "backward"]).overlap == "backward"
    with pytest.raises(SystemExit):
        ap.parse_args(["demo", "--overlap", "yes"])
