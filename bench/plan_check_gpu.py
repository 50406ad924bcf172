"""The runtime plan after warmup against `memsched plan`'s, on the device (issue 30).

Plans the GPT preset with ``memsched plan --json`` (a fake trace on this machine, ``--attention gpu`` on
CUDA), then trains the same workload for two steps per policy with ``attach(expected_plan=...)`` on the device
capped at ``--capacity``, and writes each policy's :class:`memsched.planning.plan_check.PlanCheck` (the rows
and the differences) with the predicted and measured steps to ``bench/results/plan_check_<device>.json``.

    python bench/plan_check_gpu.py                                  # on a GPU: gpt2-355m 4 x 1024, 13 GiB
    python bench/plan_check_gpu.py --device sim --size tiny --batch 2 --seq 64 --capacity 8MiB   # stand-in
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import memsched  # noqa: E402
from bench._machine import write_result  # noqa: E402
from memsched.cli.main import main as cli  # noqa: E402
from memsched.planning.prediction import gpt_workload  # noqa: E402
from policies.units import parse_positive_bytes  # noqa: E402


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device == "cuda"
    if not cuda:  # before the plan's (fake) backward: autograd sizes its device threads at the first one
        from memsched.devices import sim_backend

        sim_backend.load()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli(["plan", "--model", args.size, "--batch-size", str(args.batch), "--seq-len", str(args.seq),
                  "--capacity", args.capacity, "--attention", "gpu" if cuda else "math",
                  "--no-largest-preset", "--json"])
    if rc != 0:
        raise SystemExit(f"memsched plan failed ({rc})")
    expected = json.loads(out.getvalue())
    cap = parse_positive_bytes(args.capacity)
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total)
        device, tdev = "cuda", torch.device("cuda")
    else:
        from memsched.devices import sim_backend

        device, tdev = f"sim:{args.capacity}", torch.device(sim_backend.NAME, 0)
    rows = []
    for policy in args.policies:
        w = gpt_workload(args.size, args.batch, args.seq)(tdev)  # its batches are made on the device
        row: dict[str, Any] = {"policy": policy}
        try:
            with memsched.attach(w.model, policy=policy, device=device, expected_plan=expected) as sched:
                for _ in range(args.steps):
                    sched.backward(w.loss_fn(w.model))
                    sched.optimizer.step()
                    sched.optimizer.zero_grad()
                row["plan_check"] = sched.plan_check.to_dict() if sched.plan_check is not None else None
                row["predicted_step"] = sched.predicted_step
                row["step_timeline"] = sched.step_timeline.mean_summary()
        except torch.OutOfMemoryError as e:
            row["error"] = str(e).splitlines()[0]
        rows.append(row)
        sched = None  # the closed scheduler still holds the chunks (the model's memory)
        del w, sched
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return {"size": args.size, "batch": args.batch, "seq": args.seq, "capacity": args.capacity,
            "device": device, "cli_plan": expected, "runs": rows,
            "agrees": all(r.get("plan_check", {}) and r["plan_check"]["agrees"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = "cuda" if torch.cuda.is_available() else "sim"
    p.add_argument("--device", choices=["cuda", "sim"], default=default)
    p.add_argument("--size", default="gpt2-355m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--capacity", default="13GiB")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--policies", nargs="+", default=["auto", "cpu"])
    p.add_argument("--name", default=None)
    args = p.parse_args()
    result = run(args)
    name = args.name or f"plan_check_{args.device}"
    print(write_result(name, result))
    print("agrees" if result["agrees"] else "differs")


if __name__ == "__main__":
    main()
