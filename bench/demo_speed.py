"""Wall time of ``memsched demo`` (the main job) on this machine.

Run ``python bench/demo_speed.py [--size demo] [--steps 20] [--repeats 1]`` from the repository root; each
repetition runs ``python -m memsched demo`` in a fresh process (as a user would, imports included) with an
output folder in a temporary directory. The result, ``bench/results/demo_speed.json``, records the wall time
of each run and, from the demo's own ``demo.json``: step times (median, first = the traced warmup step),
tokens/s, losses and the plan's device/host split.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._machine import write_result  # noqa: E402


def run_once(size: str, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "memsched", "demo", "--size", size, "--steps", str(steps), "--out", tmp,
               *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"demo failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        summary = json.loads((Path(tmp) / "demo.json").read_text())
        plan = json.loads((Path(tmp) / "plan.json").read_text())["plan"]
    secs = [s["seconds"] for s in summary["steps"]]
    return {
        "wall_s": round(wall, 2),
        "train_s": round(sum(secs), 2),
        "first_step_s": round(secs[0], 3),
        "median_step_s": round(statistics.median(secs[1:] or secs), 3),
        "median_tokens_per_s": round(statistics.median(s["tokens_per_s"] for s in summary["steps"][1:]), 1)
        if len(secs) > 1 else None,
        "loss_first": round(summary["losses"][0], 4),
        "loss_last": round(summary["losses"][-1], 4),
        "val_loss_before": round(summary["val_loss_before"], 4),
        "val_loss_after": round(summary["val_loss_after"], 4),
        "device": summary["device"],
        "plan_device_chunks": plan["placement"].count("device") if plan else None,
        "plan_host_chunks": plan["placement"].count("host") if plan else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="demo")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--name", default="demo_speed", help="result file name (bench/results/<name>.json)")
    args, extra = ap.parse_known_args()
    runs = [run_once(args.size, args.steps, extra) for _ in range(args.repeats)]
    for r in runs:
        print(json.dumps(r))
    from memsched.models import config_for

    cfg = config_for(args.size)
    path = write_result(args.name, {
        "command": f"memsched demo --size {args.size} --steps {args.steps} {' '.join(extra)}".strip(),
        "model": {"size": args.size, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head,
                  "parameters": cfg.num_params()},
        "runs": runs,
        "median_wall_s": statistics.median(r["wall_s"] for r in runs),
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
