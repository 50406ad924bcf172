"""Describe the machine a benchmark ran on, for the committed result files."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any

import psutil
import torch


def describe_machine() -> dict[str, Any]:
    """CPU model, core counts, memory, GPU (if any), torch and Python versions, and the date (UTC)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "logical_cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": None,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "memory_bytes": p.total_memory, "cuda": torch.version.cuda}
    return info


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` with the machine description under ``"machine"``.

    Returns the path written. ``MEMSCHED_BENCH_OUT`` overrides the folder."""
    out = Path(os.environ.get("MEMSCHED_BENCH_OUT", Path(__file__).parent / "results")) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": describe_machine(), **payload}, indent=2) + "\n")
    return out
