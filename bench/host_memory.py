"""Host memory per parameter: pinned bytes planned and measured, and the process's peak RSS against the plan.

Run ``python bench/host_memory.py [--sizes tiny demo small gpt2-124m 350m] [--planned 760m 1.3b 2.7b]`` from
the repository root, alone (it measures the process's memory). The result goes to
``bench/results/host_memory.json`` via :func:`bench._machine.write_result`.

Each measured configuration runs in a fresh process: the GPT preset is built on the CPU (fp32), attached to
the stand-in (``device="sim:SIZE"``, whose device memory is host memory too), and trained for two steps at
batch 1 x 64 tokens. Two placements:

* ``cpu``: every chunk's optimizer state and gradients on the host (the whole state, fully offloaded);
* ``static+params``: every chunk's optimizer state, gradients and parameters on the host (``static`` with
  ``offload_param_frac=1``);
* ``auto+params``: ``auto`` on the stand-in ``memsched demo`` sizes from the plan (:func:`memsched.cli.demo.
  stand_in`: from a fake trace of the same step, a device on which ``auto``'s plan keeps some chunks'
  parameters on the host, fetched for their reads).

Per configuration (bytes): ``planned_pinned_bytes`` (the plan's ``host_bytes``) and ``pinned_bytes`` (the
stand-in's pinned allocator after training), each per parameter; ``rss_*`` (resident set size, from
``/proc/self/status``): at start (torch and the code a first attach imports loaded), after building the
model, and the peaks (``VmHWM``) after attach and after training; ``device_peak_bytes`` (the stand-in's peak,
host memory here); ``planned_rss_bytes = rss_start + planned_pinned_bytes + device_peak_bytes``, what the
process should need, with ``rss_over_plan`` the measured training peak over it; and
``largest_chunk_host_bytes``, the one chunk that may be in flight beside the plan (issue 29: the peak is the
planned host bytes plus at most one chunk). The sizes in ``--planned`` are planned only, with fake tensors
(``memsched plan``'s own path, no memory allocated): their pinned bytes per parameter under ``cpu``.

Target (issue 29): at most 16.5 pinned bytes per parameter fully offloaded (fp32 AdamW: master, gradient and
two moments, 16 B, plus chunk padding), and the peak RSS within 5 % of the plan.

``--dtype bf16`` (issue 42): the same with ``attach(dtype=torch.bfloat16)`` (bf16 parameters, fp32 masters),
and the planned rows of ``--llama`` presets at batch 1 x 2048 with activation checkpointing on a 24 GiB device
and 128 GiB of host memory. Targets: at most 14.5 pinned bytes per parameter fully offloaded (fp32 master and
moments, bf16 gradients: 14 B), at most 16.5 with parameters offloaded too (their bf16 copy: 16 B).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._machine import write_result  # noqa: E402

BATCH, SEQ = 1, 64


def _status_bytes(key: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _dtype(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def auto_params_device(size: str) -> str:
    """The stand-in for ``auto+params`` (see the module docstring), sized from a fake trace in this process
    (the parent: the measured process allocates nothing before its start)."""
    from memsched.cli.demo import stand_in

    return f"sim:{stand_in(size, BATCH, SEQ).capacity_bytes}B"


def _load_code() -> None:
    """Train GPT ``tiny`` for two steps under each placement and close it, so that the code a first attach
    and a first GPT step load lazily (``torch._dynamo``, ``torch._subclasses``, ``sympy``,
    ``torch.distributed``, the kernels of every op the GPT runs: resident code and data, tens of MiB)
    counts in ``rss_start``, not as memory the plan failed to predict."""
    import torch

    import memsched
    from memsched.models import config_for
    from memsched.models.gpt import GPT, lm_loss

    tiny_stand_in = auto_params_device("tiny")
    for kw in ({"policy": "cpu", "device": "sim:64GiB"}, {"policy": "auto", "device": tiny_stand_in}):
        torch.manual_seed(0)
        model = GPT(config_for("tiny"))
        x = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1)).to("sim")
        with memsched.attach(model, **kw) as sched:
            for _ in range(2):
                sched.backward(lm_loss(model, x[:, :-1], x[:, 1:]))
                sched.optimizer.step()
                sched.optimizer.zero_grad()
        del sched, model, x  # the stand-in's memory back before the next (small) stand-in
        gc.collect()


def measure_one(size: str, placement: str, device: str | None = None, dtype: str = "fp32") -> dict[str, Any]:
    """One configuration in this (fresh) process; see the module docstring (``device``: the stand-in of
    ``auto+params``; ``dtype``: ``fp32``, or ``bf16`` for bf16 parameters with fp32 masters)."""
    import torch

    import memsched
    from memsched.devices import sim_backend
    from memsched.models import config_for
    from memsched.models.gpt import GPT, lm_loss

    sim_backend.load()
    _load_code()
    rss_start = _status_bytes("VmRSS")
    torch.manual_seed(0)
    model = GPT(config_for(size))  # what memsched plan traces (memsched.planning.prediction.gpt_workload)
    n_params = sum(p.numel() for p in model.parameters())
    rss_built = _status_bytes("VmRSS")
    if placement == "cpu":
        kw: dict[str, Any] = {"policy": "cpu", "device": "sim:64GiB"}
    else:
        kw = {"policy": "auto", "device": device or auto_params_device(size)}
    if placement == "static+params":  # every chunk's parameters on the host too
        kw = {"policy": "static", "device": "sim:64GiB",
              "policy_options": {"offload_optim_frac": 1.0, "offload_param_frac": 1.0}}
    if dtype != "fp32":
        kw["dtype"] = _dtype(dtype)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(3)]
    sched = memsched.attach(model, **kw)
    rss_attach_peak = _status_bytes("VmHWM")
    dev = torch.device("sim", 0)
    for x in batches:
        x = x.to(dev)
        sched.backward(lm_loss(model, x[:, :-1], x[:, 1:]))
        sched.optimizer.step()
        sched.optimizer.zero_grad()
    sched.synchronize()
    plan = sched.plan
    out = {
        "size": size, "placement": placement, "dtype": dtype, "device": kw["device"], "parameters": n_params,
        "param_host_chunks": len(plan.param_host_chunks), "host_chunks": len(plan.host_chunks),
        "chunks": len(plan.placement),
        "planned_pinned_bytes": plan.host_bytes, "pinned_bytes": sim_backend.pinned_bytes(),
        "largest_chunk_host_bytes": max(c.host_bytes for c in sched.problem.chunks),
        "max_pinned_bytes": sim_backend.max_pinned_bytes(),
        "planned_pinned_bytes_per_param": round(plan.host_bytes / n_params, 3),
        "pinned_bytes_per_param": round(sim_backend.pinned_bytes() / n_params, 3),
        "device_peak_bytes": sim_backend.max_memory_allocated(),
        "rss_start_bytes": rss_start, "rss_built_bytes": rss_built,
        "rss_attach_peak_bytes": rss_attach_peak, "rss_train_peak_bytes": _status_bytes("VmHWM"),
    }
    sched.close()
    out["planned_rss_bytes"] = rss_start + out["planned_pinned_bytes"] + out["device_peak_bytes"]
    out["rss_over_plan"] = round(out["rss_train_peak_bytes"] / out["planned_rss_bytes"], 4)
    return out


def planned_only(size: str) -> dict[str, Any]:
    """The plan of ``memsched plan --model SIZE --batch-size 1 --seq-len 1024 --capacity 13GiB`` (fake
    tensors): pinned bytes per parameter under ``auto`` (every chunk's optimizer state on the host when the
    parameters do not all fit) and ``cpu`` (where it has a plan)."""
    import torch

    from memsched.planning.capacity import plan_for_capacity
    from memsched.planning.prediction import gpt_workload, trace_step

    pred = trace_step(gpt_workload(size, 1, 1024), dtype=torch.float32)
    cplan = plan_for_capacity(pred, 13 * 2**30, policy_names=["auto", "cpu"])
    n = sum(p.numel() for p in pred.model.parameters())
    out: dict[str, Any] = {"size": size, "batch": 1, "seq": 1024, "capacity": "13GiB", "parameters": n}
    for name, plan in cplan.plans.items():
        if isinstance(plan, str):
            out[name] = {"error": plan}
        else:
            out[name] = {"host_chunks": len(plan.host_chunks), "chunks": len(plan.placement),
                         "param_host_chunks": len(plan.param_host_chunks),
                         "planned_pinned_bytes": plan.host_bytes,
                         "planned_pinned_bytes_per_param": round(plan.host_bytes / n, 3)}
    return out


def planned_llama(name: str) -> dict[str, Any]:
    """The plan of ``memsched plan --model NAME --dtype bf16 --batch-size 1 --seq-len 2048 --checkpointing
    --capacity 24GiB --host-memory 128GiB`` (fake tensors): pinned bytes per parameter under ``auto`` and
    ``cpu``."""
    import torch

    from memsched.models.llama import llama_workload
    from memsched.planning.capacity import plan_for_capacity
    from memsched.planning.prediction import trace_step

    pred = trace_step(llama_workload(name, 1, 2048, checkpointing=True), dtype=torch.bfloat16)
    cplan = plan_for_capacity(pred, 24 * 2**30, policy_names=["auto", "cpu"], host_capacity_bytes=128 * 2**30)
    n = sum(p.numel() for p in pred.model.parameters())
    out: dict[str, Any] = {"model": name, "dtype": "bf16", "batch": 1, "seq": 2048, "checkpointing": True,
                           "capacity": "24GiB", "host_memory": "128GiB", "parameters": n}
    for policy, plan in cplan.plans.items():
        out[policy] = {"error": plan} if isinstance(plan, str) else {
            "host_chunks": len(plan.host_chunks), "chunks": len(plan.placement),
            "param_host_chunks": len(plan.param_host_chunks), "planned_pinned_bytes": plan.host_bytes,
            "planned_pinned_bytes_per_param": round(plan.host_bytes / n, 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "demo", "small", "gpt2-124m", "350m"])
    ap.add_argument("--placements", nargs="+", default=["cpu", "auto+params"],
                    choices=["cpu", "auto+params", "static+params"])
    ap.add_argument("--planned", nargs="*", default=["760m", "1.3b", "2.7b"])
    ap.add_argument("--one", nargs="+", metavar="SIZE PLACEMENT [DEVICE]", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--llama", nargs="*", default=[], help="Llama-class presets to plan (with --dtype bf16)")
    ap.add_argument("--name", default="host_memory")
    args = ap.parse_args(argv)
    if args.one:
        size, placement, *rest = args.one
        print(json.dumps(measure_one(size, placement, rest[0] if rest and rest[0] != "-" else None,
                                     dtype=rest[1] if len(rest) > 1 else "fp32")))
        return 0
    rows = []
    for size in args.sizes:
        for placement in args.placements:
            device = auto_params_device(size, args.dtype) if placement == "auto+params" else "-"
            proc = subprocess.run([sys.executable, __file__, "--one", size, placement, device, args.dtype],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                rows.append({"size": size, "placement": placement, "error": proc.stderr[-2000:]})
            else:
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    planned = [planned_only(size) for size in args.planned] + [planned_llama(name) for name in args.llama]
    for row in planned:
        print(json.dumps(row), flush=True)
    path = write_result(args.name, {"batch": BATCH, "seq": SEQ, "dtype": args.dtype, "measured": rows,
                                    "planned": planned})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
