"""Points for `memsched plan`'s calibration table (issue 30): one real training step per workload, traced on
the GPU, against the fake trace's prediction.

For each GPT preset x batch shape x dtype, a real forward + backward runs on the device inside the tracer
that memsched's warmup uses (:func:`memsched.planning.prediction.trace_step` with ``fake=False``: the GPU's
own kernels, its allocator's 512 B blocks), and a fake trace of the same step predicts it the way
`memsched plan` does on a machine without a GPU (fake CPU tensors, ``attention="gpu"``). Both peak non-model
data values (bytes) and their ratio are written to ``bench/results/gpu_calibration_<gpu>.json``, which
``tests/test_gpu_calibration.py`` then holds to -1 % / +5 % on every CPU CI run. Each workload runs in a
process of its own (a fresh CUDA context, nothing cached from the one before); one that does not fit the
device is recorded as such.

    python bench/gpu_calibration.py                   # on a GPU: 3 sizes x 2 batch shapes x fp32/bf16
    python bench/gpu_calibration.py --device cpu --sizes tiny --shapes 2x64 --dtypes fp32   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._machine import write_result  # noqa: E402
from memsched.planning.prediction import gpt_workload, trace_step  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shape(text: str) -> tuple[int, int]:
    """``BATCHxSEQ`` (``4x1024``)."""
    try:
        b, s = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected BATCHxSEQ such as 4x1024") from None
    if b <= 0 or s <= 0:
        raise argparse.ArgumentTypeError(f"shape {text!r}: batch and sequence must be > 0")
    return b, s


def measure(size: str, batch: int, seq: int, dtype: str, device: str) -> dict[str, Any]:
    """One workload: the real trace on ``device`` and the CPU's fake prediction (bytes)."""
    build = gpt_workload(size, batch, seq)
    row: dict[str, Any] = {"size": size, "batch": batch, "seq": seq, "dtype": dtype, "device": device}
    # The prediction first: a real run that does not fit still has one.
    predicted = trace_step(build, dtype=DTYPES[dtype], fake=True, device="cpu",
                           attention="gpu" if device.startswith("cuda") else "default")
    row["predicted_peak_non_model_bytes"] = predicted.peak_non_model_bytes
    row["predicted_attention"] = predicted.attention
    try:
        real = trace_step(build, dtype=DTYPES[dtype], fake=False, device=device)
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=str(e).splitlines()[0])
        return row
    row.update(status="ok", measured_peak_non_model_bytes=real.peak_non_model_bytes,
               ratio=predicted.peak_non_model_bytes / real.peak_non_model_bytes)
    if device.startswith("cuda"):
        row["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return row


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:  # internal: one workload, its row to a file
        spec = json.loads(argv[1])
        Path(argv[2]).write_text(json.dumps(measure(**spec)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", nargs="+", default=["gpt2-124m", "gpt2-355m", "760m"])
    ap.add_argument("--shapes", nargs="+", type=shape, default=[(4, 1024), (8, 512)],
                    help="BATCHxSEQ each (default 4x1024 8x512)")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per workload (120)")
    ap.add_argument("--name", default=None, help="result name (default gpu_calibration_<device>)")
    args = ap.parse_args(argv)
    rows = []
    for size in args.sizes:
        for batch, seq in args.shapes:
            for dtype in args.dtypes:
                spec = {"size": size, "batch": batch, "seq": seq, "dtype": dtype, "device": args.device}
                with tempfile.TemporaryDirectory(prefix="memsched-calib-") as d:
                    out = Path(d) / "row.json"
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec),
                           str(out)]
                    try:
                        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                        row = json.loads(out.read_text()) if out.exists() else {
                            **spec, "status": "crashed", "returncode": done.returncode,
                            "stderr": done.stderr[-2000:]}
                    except subprocess.TimeoutExpired:
                        row = {**spec, "status": "timeout", "timeout_s": args.timeout}
                rows.append(row)
                ratio = row.get("ratio")
                print(f"  {size:10s} {batch}x{seq:<5d} {dtype}  {row['status']:7s} "
                      + (f"predicted/measured {ratio:.5f}" if ratio else ""), flush=True)
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    slug = (gpu or args.device).lower().replace(" ", "-")
    path = write_result(args.name or f"gpu_calibration_{slug}", {
        "what": "peak non-model data (bytes) of one real forward + backward on the device, traced as "
                "memsched's warmup traces it, against memsched plan's fake-trace prediction on the CPU "
                "(attention as the GPU picks it)",
        "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
