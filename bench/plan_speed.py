"""Wall time of ``memsched plan`` for a 1.3B GPT at batch 8 x 1024 on a 24 GiB device (fake tensors, no GPU).

Run ``python bench/plan_speed.py [--repeats 3] [--dtype fp32]`` from the repository root. Each repetition runs
``python -m memsched plan ... --json`` in a fresh process (interpreter start and imports included, as a user
sees it); the result, ``bench/results/plan_speed.json``, has each run's wall time, the traced part
(``trace.elapsed_s``: build + fake forward/backward), the predicted peak non-model bytes and the verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._machine import write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="1.3b")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--capacity", default="24GiB")
    args = ap.parse_args()
    argv = ["plan", "--model", args.model, "--batch-size", "8", "--seq-len", "1024", "--capacity",
            args.capacity, "--dtype", args.dtype, "--json"]
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "memsched", *argv], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"memsched plan failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        r = json.loads(proc.stdout)
        runs.append({"wall_s": round(wall, 2), "trace_s": r["trace"]["elapsed_s"],
                     "peak_non_model_bytes": r["trace"]["peak_non_model_bytes"],
                     "verdict": r["verdict"]["status"], "short_bytes": r["verdict"]["short_bytes"],
                     "offloaded_bytes": r["verdict"]["offloaded_bytes"]})
        print(json.dumps(runs[-1]))
    path = write_result(f"plan_speed_{args.model}_{args.dtype}", {
        "command": "memsched " + " ".join(argv),
        "runs": runs,
        "median_wall_s": statistics.median(r["wall_s"] for r in runs),
        "max_wall_s": max(r["wall_s"] for r in runs),
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
