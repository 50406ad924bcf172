"""`memsched plan`'s step-time model against every committed GPU step time: for each memsched configuration of
a ``bench/results/gpu_step_time*.json`` whose warmup measured its host's CPU AdamW rate, the prediction (the
CPU's fake trace of the same workload, the run's host chunks, that rate) beside the measured mean step.

    python bench/step_model_check.py      # writes bench/results/step_model_check.json (runs on the CPU)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._machine import write_result  # noqa: E402
from memsched.devices.gpus import get_gpu  # noqa: E402
from memsched.planning.capacity import plan_for_capacity  # noqa: E402
from memsched.planning.step_model import predict_step  # noqa: E402
from tests.test_gpu_calibration import predict, timed_runs  # noqa: E402


def main() -> int:
    rows = []
    for run in timed_runs():
        prediction = predict(run.preset, run.batch, run.seq)
        cplan = plan_for_capacity(prediction, run.capacity, policy_names=[])
        overlap = "backward" if "+backward" in run.policy else "+overlap" in run.policy
        step = predict_step(prediction.flops, get_gpu(run.gpu), torch.float32,
                            run.host_chunks * cplan.chunk_numel, run.cpu_rate, overlap)
        rows.append({"file": run.file, "policy": run.policy, "gpu": run.gpu, "preset": run.preset,
                     "batch": run.batch, "seq": run.seq, "host_chunks": run.host_chunks,
                     "cpu_elements_per_s": run.cpu_rate, "measured_step_s": run.measured_s,
                     "predicted": step.as_dict(), "ratio": step.step_s / run.measured_s})
        print(f"{run.file:48s} {run.policy:42s} predicted {step.step_s * 1e3:6.1f} ms, measured "
              f"{run.measured_s * 1e3:6.1f} ms: {step.step_s / run.measured_s:.3f}x")
    # the efficiency's calibration: plain torch AdamW on the same workloads (FLOPs of the trace / peak / step)
    import json

    from memsched.devices.gpus import gpu_for_device_name
    from tests.test_gpu_calibration import RESULTS, _preset

    torch_rows = []
    for path in sorted(RESULTS.glob("gpu_step_time*.json")):
        doc = json.loads(path.read_text())
        cfg = doc.get("config") or {}
        gpu = gpu_for_device_name(((doc.get("machine") or {}).get("gpu") or {}).get("name", ""))
        preset = _preset(cfg.get("dims") or {})
        for r in doc["results"]:
            if r.get("kind") == "torch_adamw" and r.get("status") == "ok" and gpu and preset:
                flops = predict(preset, cfg["batch"], cfg["seq"]).flops
                torch_rows.append({"file": path.name, "gpu": gpu.name, "preset": preset, "flops": flops,
                                   "mean_step_s": r["mean_step_s"],
                                   "efficiency": flops / (gpu.fp32_flops * r["mean_step_s"])})
                print(f"{path.name:48s} torch AdamW: efficiency {torch_rows[-1]['efficiency']:.3f}")
    path = write_result("step_model_check", {
        "what": "memsched plan's step-time model (memsched.planning.step_model) against the committed GPU "
                "step times; the prediction is made here, on the CPU",
        "rows": rows, "torch_adamw_efficiency": torch_rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
