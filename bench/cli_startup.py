"""How long ``memsched --help`` (and each subcommand's ``--help``) takes, against ``python -c pass`` and
``python -c "import torch"`` measured the same way (run by hand: ``python bench/cli_startup.py``).

Each command runs ``--repeats`` times as a fresh process (``subprocess.run``); the median wall time is
recorded. The CLI's parsers import neither torch nor rich (``memsched/cli/parsers.py``), so ``--help``
costs the interpreter's start-up plus argparse; the target is under 0.5 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._machine import write_result  # noqa: E402

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "memsched --help": [sys.executable, "-m", "memsched", "--help"],
    **{f"memsched {c} --help": [sys.executable, "-m", "memsched", c, "--help"]
       for c in ("demo", "trace", "report", "plan", "policies")},
}


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--name", default="cli_startup")
    args = ap.parse_args(argv)
    wall(COMMANDS["memsched --help"])  # warm the file cache
    medians = {name: statistics.median(wall(cmd) for _ in range(args.repeats))
               for name, cmd in COMMANDS.items()}
    path = write_result(args.name, {"what": "median wall time of a fresh process, seconds",
                                    "repeats": args.repeats, "median_s": medians})
    for name, s in medians.items():
        print(f"{name:32s} {s:6.3f} s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
