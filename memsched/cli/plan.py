"""`memsched plan`: predict one training step's memory without a GPU, then plan placement for a device size.

The prediction is :mod:`memsched.planning.prediction` (a trace under ``FakeTensorMode``), the verdicts
:mod:`memsched.planning.capacity`, the parser :func:`memsched.cli.parsers.add_plan`; this module runs and
renders.

``--seq-len 512,1024,2048`` (or ``--batch-size 4,8``) traces each size and prints, per size, the peak
non-model data and the verdicts of ``auto`` and ``cpu``, then the largest size that fits with each
(:func:`memsched.planning.capacity.sweep_dict`). One size prints exactly what it always did.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import policies
from memsched.cli import parsers
from memsched.devices.gpus import get_gpu, gpu_for_device_name, gpu_names
from memsched.devices.host_memory import available_bytes
from memsched.models import config_for, sizes
from memsched.models.llama import LLAMA_PRESETS, llama_shape, llama_workload
from memsched.planning.capacity import (  # noqa: F401 (re-exported for the command's users)
    SCHEMA,
    SWEEP_POLICIES,
    SWEEP_SCHEMA,
    VERDICTS,
    VERSION,
    CapacityPlan,
    largest_preset,
    per_rank_dict,
    plan_for_capacity,
    result_dict,
    stream_link_bytes,
    sweep_dict,
    verdict,
    with_update_paths,
)
from memsched.planning.prediction import (  # noqa: F401 (re-exported for the command's users)
    ATTENTION,
    Prediction,
    WorkloadFn,
    fake_device,
    fake_module_conversions,
    first_use_order,
    gpt_workload,
    trace_step,
)
from memsched.planning.step_model import measure_cpu_adam_rate, predict_step
from memsched.report.console import make_console
from policies.units import format_bytes
from policies.update_paths import stream_seconds

# The parser (memsched.cli.parsers) names the dtypes and the defaults without importing torch.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, dt) for name, dt in parsers.DTYPE_NAMES.items()}
DEFAULT_BATCH_SIZE = parsers.PLAN_BATCH_SIZE
DEFAULT_SEQ_LEN = parsers.PLAN_SEQ_LEN


def _capacity(args: argparse.Namespace) -> tuple[int, str | None]:
    """The device capacity (bytes) and the GPU's name: ``--capacity``, ``--gpu``'s memory, or both (the GPU
    capped, as every measurement of ``bench/results`` was made).

    Raises:
        ValueError: an unknown GPU (lists the known ones), a cap above the GPU's memory, or neither given
            where there is no GPU.
    """
    if args.gpu is not None:
        gpu = get_gpu(args.gpu)
        if args.capacity is None:
            return gpu.memory_bytes, gpu.name
        if args.capacity > gpu.memory_bytes:
            raise ValueError(f"--capacity {format_bytes(args.capacity)} exceeds the {gpu.name}'s memory, "
                             f"{format_bytes(gpu.memory_bytes)}: a cap must be at most that")
        return args.capacity, gpu.name
    if args.capacity is not None:
        return args.capacity, None
    if torch.cuda.is_available():
        from memsched.devices.spec import cuda_capacity_bytes

        return cuda_capacity_bytes(torch.device("cuda")), torch.cuda.get_device_name()
    raise ValueError(f"no GPU here: give --capacity SIZE (e.g. 24GiB) or --gpu NAME "
                     f"({', '.join(gpu_names())})")


def _host_budget(args: argparse.Namespace) -> tuple[int, str]:
    """The pinned host memory the plans may take: ``--host-memory``, else what this machine has available
    (:func:`memsched.devices.host_memory.available_bytes`, cgroup limits included), bytes, and its source."""
    if args.host_memory is not None:
        return args.host_memory, f"--host-memory {format_bytes(args.host_memory)}"
    free = available_bytes()
    return free, (f"available host memory here, {format_bytes(free)} (give --host-memory for the training "
                  "machine)")


def run(args: argparse.Namespace) -> int:
    # ---- validate everything before the (possibly long) trace ----------------------------------------------
    if (args.target is None) == (args.model is None):
        raise ValueError("give either a TARGET (file.py:function or module:function) or --model SIZE "
                         f"(one of {', '.join([*sizes(), *LLAMA_PRESETS])}), not both or neither")
    shape = llama_shape(args.model) if args.model is not None else None  # a preset, or a config.json
    llama = shape is not None
    if args.checkpointing and not llama:
        raise ValueError(f"--checkpointing applies to a Llama-class --model ({', '.join(LLAMA_PRESETS)}, "
                         "or a config.json); "
                         "a TARGET enables its own")
    if llama and args.lora is not None:
        raise ValueError(f"--lora applies to the built-in GPT sizes, not to {args.model!r}")
    if args.policy not in policies.names():
        raise ValueError(f"unknown policy {args.policy!r}: known policies are {', '.join(policies.names())}")
    if args.world_size is not None and args.world_size < 2:
        raise ValueError(f"--world-size must be at least 2 (one rank is the plan without it), got "
                         f"{args.world_size}")
    if args.link_bandwidth is not None and args.host_update == "cpu":
        raise ValueError("--link-bandwidth applies with --host-update device or auto (the streamed update's "
                         "link); the CPU update does not use it")
    capacity, gpu = _capacity(args)
    host = _host_budget(args)
    link = _link(args, gpu)
    dtype = DTYPES[args.dtype] if args.dtype else None
    over: str | None = None  # the swept key when several sizes are given
    if args.model is not None:
        batches = args.batch_size or [DEFAULT_BATCH_SIZE]
        seqs = args.seq_len or [DEFAULT_SEQ_LEN]
        if len(batches) > 1 and len(seqs) > 1:
            raise ValueError(f"give several values to --seq-len or to --batch-size, not both (got "
                             f"--batch-size {','.join(map(str, batches))} and --seq-len "
                             f"{','.join(map(str, seqs))}): the largest size that fits is defined along one")
        over = "batch_size" if len(batches) > 1 else "seq_len" if len(seqs) > 1 else None
        if over is not None and args.world_size is not None:
            raise ValueError(f"--world-size predicts one size: give one --{over.replace('_', '-')} value")
        # Every workload is made (and checked: block size) before the first, possibly long, trace.
        lora = {"lora_rank": args.lora} if args.lora is not None else {}
    stage = _pipeline_stage(args, llama, over)
    runs: list[tuple[str | WorkloadFn, dict[str, Any]]]
    if stage is not None:
        runs = [stage]
    elif args.model is not None:
        runs = [
            (llama_workload(args.model, b, s, checkpointing=args.checkpointing) if llama else
             gpt_workload(args.model, b, s, lora_rank=args.lora),
             {"model": args.model, "batch_size": b, "seq_len": s, **lora,
              **({"checkpointing": args.checkpointing, "source": shape.source}
                 if llama else {})})
            for b in batches for s in seqs]
    elif args.target is not None:
        if args.lora is not None:
            raise ValueError("--lora applies to --model only: a TARGET freezes its own parameters")
        if args.batch_size is not None or args.seq_len is not None:
            raise ValueError("--batch-size and --seq-len apply to --model only; a TARGET's loss_fn makes "
                             "its own batch")
        runs = [(args.target, {"target": args.target})]

    console = make_console(stderr=args.json)
    # the training host's CPU AdamW rate: given, or measured here once (right when planning on that host)
    rate = (args.cpu_adam_rate, "--cpu-adam-rate") if args.cpu_adam_rate is not None else \
        (measure_cpu_adam_rate() if gpu is not None or args.host_update == "auto" else 0.0,
         "measured on this machine; give --cpu-adam-rate for the training host")
    entries: list[tuple[int, dict[str, Any], CapacityPlan]] = []
    for build, what in runs:
        label = f" ({over} {what[over]})" if over else ""
        if not args.json and not console.is_terminal:  # a log: rich's spinner would print nothing
            console.print(f"tracing one training step with fake tensors{label} ...", highlight=False)
        with console.status(f"tracing one training step with fake tensors{label} ...") \
                if not args.json and console.is_terminal else contextlib.nullcontext():
            prediction = trace_step(build, dtype=dtype or (torch.float32 if args.model else None),
                                    attention=args.attention)
        cplan = plan_for_capacity(prediction, capacity, gpu_margin_mem_ratio=args.gpu_margin_mem_ratio,
                                  host_capacity_bytes=host[0], host_capacity_source=host[1])
        if args.host_update != "cpu":
            with_update_paths(cplan, args.policy, mode=args.host_update, dtype=prediction.dtype,
                              cpu_elements_per_s=rate[0] or None, link_bytes_per_s=link[0],
                              rate_source=rate[1], link_source=link[1])
        result = result_dict(prediction, cplan, what=what, policy=args.policy, gpu=gpu)
        result["step_time"] = _step_time(args, prediction, cplan, gpu, rate, link)
        if args.world_size is not None:
            result["ranks"] = per_rank_dict(prediction, capacity, args.world_size, policy=args.policy,
                                            gpu_margin_mem_ratio=args.gpu_margin_mem_ratio)
        entries.append((what[over] if over else 0, result, cplan))
    if over is None:
        result = entries[0][1]
        # the GPT sizes' ladder (whole models: not for a stage)
        if args.model is not None and args.largest_preset and not llama and stage is None:
            what = runs[0][1]
            with console.status("finding the largest preset that fits ...") \
                    if not args.json and console.is_terminal else contextlib.nullcontext():
                result["largest_preset"] = _largest_preset(args, what["batch_size"], what["seq_len"], dtype,
                                                           capacity, {args.model: entries[0][2]}, host)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            render(result, console)
        return 0
    sweep = sweep_dict(over, entries)
    if args.json:
        print(json.dumps(sweep, indent=2))
    else:
        render_sweep(sweep, console)
    return 0


def _pipeline_stage(args: argparse.Namespace, llama: bool, over: str | None,
                    ) -> tuple[WorkloadFn, dict[str, Any]] | None:
    """``--stages/--stage/--micro-batches/--schedule``: the workload of one pipeline stage of the built-in GPT
    (:func:`memsched.planning.pipeline.gpt_stage_workload`) and its description, or ``None`` without them.

    Raises:
        ValueError: the options are incomplete, or combined with a TARGET, a Llama-class model, --lora or a
            sweep.
    """
    if args.stages is None and args.stage is None and args.micro_batches is None:
        return None
    from memsched.planning.pipeline import gpt_stage_workload, in_flight, schedule_order

    if args.stages is None or args.stage is None or args.micro_batches is None:
        raise ValueError("a pipeline stage's plan needs --stages S, --stage I and --micro-batches N together")
    if args.model is None or llama or args.lora is not None or over is not None:
        raise ValueError("--stages/--micro-batches apply to a built-in GPT --model with one --batch-size and "
                         "--seq-len, without --lora")
    b = args.batch_size[0] if args.batch_size else DEFAULT_BATCH_SIZE
    s = args.seq_len[0] if args.seq_len else DEFAULT_SEQ_LEN
    order = schedule_order(args.schedule, args.stage, args.stages, args.micro_batches)
    build = gpt_stage_workload(args.model, b, s, stages=args.stages, stage=args.stage,
                               micro_batches=args.micro_batches, schedule=args.schedule)
    return build, {"model": args.model, "batch_size": b, "seq_len": s,
                   "pipeline": {"stages": args.stages, "stage": args.stage,
                                "micro_batches": args.micro_batches, "schedule": args.schedule,
                                "in_flight": in_flight(order)}}


def _link(args: argparse.Namespace, gpu: str | None) -> tuple[float | None, str]:
    """The host link's bandwidth per direction for ``--host-update`` (bytes per second, ``None`` unknown) and
    its source: ``--link-bandwidth``, else the named GPU's nominal PCIe bandwidth."""
    if args.link_bandwidth is not None:
        return args.link_bandwidth, "--link-bandwidth"
    table = get_gpu(gpu) if gpu in gpu_names() else None
    if table is not None and table.link_bytes_per_s:
        return table.link_bytes_per_s, (f"the {table.name}'s nominal PCIe x16 bandwidth; give "
                                        "--link-bandwidth with a measured one")
    return None, "unknown: give --link-bandwidth or --gpu NAME"


def _step_time(args: argparse.Namespace, prediction: Any, cplan: CapacityPlan, gpu: str | None,
               rate: tuple[float, str], link: tuple[float | None, str]) -> dict[str, Any]:
    """The verdict policy's predicted step (:mod:`memsched.planning.step_model`), serial and with
    ``overlap=True``, its streamed chunks' update over the link included, or why there is none
    (``{"reason": ...}``)."""
    table = (get_gpu(gpu) if gpu in gpu_names() else gpu_for_device_name(gpu)) if gpu else None
    if table is None:
        return {"reason": "no step-time prediction without a known GPU (give --gpu NAME)"}
    plan = cplan.plans.get(args.policy)
    if plan is None or isinstance(plan, str):
        return {"reason": f"no plan for policy {args.policy!r}"}
    streamed = set(plan.streamed)
    host = sum(cplan.problem.chunks[i].numel for i in plan.host_chunks if i not in streamed)
    link_s = stream_seconds(plan.streamed, stream_link_bytes(cplan.problem), link[0]) if streamed else 0.0
    out: dict[str, Any] = {"gpu": table.name, "cpu_rate_source": rate[1]}
    if streamed:
        out["link_source"] = link[1]
    for mode, overlap in (("serial", False), ("overlap", True)):
        step = predict_step(prediction.flops, table, prediction.dtype, host, rate[0], overlap, link_s=link_s)
        if step is None:
            return {"reason": f"the step-time model is not calibrated for {prediction.dtype} yet "
                              "(memsched.planning.step_model.EFFICIENCY)"}
        out[mode] = step.as_dict()
    return out


def _largest_preset(args: argparse.Namespace, batch: int, seq: int, dtype: torch.dtype | None, capacity: int,
                    known: dict[str, CapacityPlan], host: tuple[int, str]) -> dict[str, Any]:
    """The largest GPT preset that fits ``capacity`` and the host budget ``host`` (bytes, source) at this
    batch and sequence length (:func:`memsched.planning.capacity.largest_preset`; presets whose block size is
    shorter are left out)."""
    presets = [name for name in sizes() if config_for(name).block_size >= seq]

    def plan_of(name: str) -> CapacityPlan:
        if name not in known:
            prediction = trace_step(gpt_workload(name, batch, seq, lora_rank=args.lora),
                                    dtype=dtype or torch.float32, attention=args.attention)
            known[name] = plan_for_capacity(prediction, capacity,
                                            gpu_margin_mem_ratio=args.gpu_margin_mem_ratio,
                                            host_capacity_bytes=host[0], host_capacity_source=host[1])
        return known[name]

    return {"batch_size": batch, "seq_len": seq, "policy": args.policy,
            **largest_preset(presets, plan_of, args.policy)}


# ---- rendering -------------------------------------------------------------------------------------------
def render(result: dict[str, Any], console: Console) -> None:
    """Print a :func:`result_dict` as rich tables."""
    w, tr, md = result["workload"], result["trace"], result["model_data"]
    fb = format_bytes
    head = Table(title="Workload and trace", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row("workload",
                 w.get("target") or f"{'' if 'source' in w else 'GPT '}{w['model']}, batch "
                                    f"{w['batch_size']} x seq {w['seq_len']}"
                                    + (", activation checkpointing" if w.get("checkpointing") else "")
                                    + _pipeline_text(w.get("pipeline")))
    head.add_row("parameters", f"{w['parameters']:,} ({w['dtype']})")
    stand_in = " standing in for CUDA" if tr["device"] == "cpu" else ""
    head.add_row("traced on", f"fake {tr['device']}{stand_in} (attention: {tr['attention']}), "
                              f"{tr['elapsed_s']:.1f} s")
    where = ""
    if tr["peak_module"] is not None:
        where = f" in {tr['peak_module'] or '(root)'} ({tr['peak_phase']})"
    head.add_row("peak non-model data", f"{fb(tr['peak_non_model_bytes'])}{where}")
    head.add_row("all on the device", f"{fb(result['verdict']['needed_all_on_device_bytes'])} (peak "
                 "non-model + resident model data + all optimizer states)")
    console.print(head)

    chunks = result["chunks"]
    # The chunks' padding is allocated with the parameters, gradients and optimizer states but holds no
    # parameter: its own row, so a small model's parameter bytes are its parameters'.
    pad = chunks.get("padding") or {"numel": 0, "parameter": 0, "gradient": 0, "optimizer_state": 0}
    elements = chunks["total_numel"]
    share = f", {100 * pad['numel'] / elements:.1f} % padding" if elements else ""
    sizes = (f"of {chunks['numel']:,} elements" if elements == chunks["count"] * chunks["numel"] else
             f"of up to {chunks['largest_numel']:,} elements, {elements:,} in all")
    data = Table(title=f"Model data ({chunks['count']} chunks {sizes}{share})", title_justify="left")
    data.add_column("category")
    data.add_column("bytes", justify="right")
    data.add_column("where")
    data.add_row("parameters", fb(md["parameter"] - pad["parameter"]),
                 "device; a plan may keep chunks' parameters on the host, fetched for their reads")
    if md.get("frozen"):
        data.add_row("frozen parameters", fb(md["frozen"]),
                     "chunks of their own, no gradients or optimizer state: device, or the host first "
                     "when the parameters do not fit (fetched for their reads)")
    data.add_row("gradients", fb(md["gradient"] - pad["gradient"]),
                 "with their chunk's optimizer state (a host chunk's go D2H as backward makes them)")
    # frozen parameters of another dtype than the compute dtype (or with more ranks) stay out of chunks
    other = "buffers + other frozen parameters" if md.get("frozen") else "buffers + frozen parameters"
    data.add_row(other, fb(md["other"]), "device (resident)")
    data.add_row("optimizer states (AdamW)", fb(md["optimizer_state"] - pad["optimizer_state"]),
                 "placed by the policy")
    data.add_row("chunk padding", fb(pad["parameter"] + pad["gradient"] + pad["optimizer_state"]),
                 f"{pad['numel']:,} elements")
    console.print(data)

    cap = fb(result["capacity_bytes"]) + (f" ({result['gpu']})" if result["gpu"] else "")
    host = result["host_capacity_bytes"]
    plans = Table(title=f"Plans for {cap}: GPU margin {fb(result['margin_bytes'])}, "
                        f"gpu_margin_mem_ratio {result['gpu_margin_mem_ratio']:g}; host budget "
                        f"{fb(host) if host is not None else 'none'} ({result['host_capacity_source']})",
                  title_justify="left")
    for col in ("policy", "chunks on device", "device bytes", "chunks on host", "pinned host bytes",
                "params on host", "peak"):
        plans.add_column(col, justify="left" if col == "policy" else "right")
    errors = []
    for name, plan in result["plans"].items():
        if "error" in plan:
            plans.add_row(name, "[red]no plan[/red]", "-", "-", "-", "-", "-")
            errors.append((name, plan["error"]))
            continue
        n_dev = plan["placement"].count(policies.DEVICE)
        n_params = plan["param_placement"].count(policies.HOST)
        plans.add_row(name, str(n_dev), fb(plan["device_bytes"]), str(len(plan["placement"]) - n_dev),
                      fb(plan["host_bytes"]), f"{n_params} chunks" if n_params else "-",
                      fb(plan["peak_bytes"]) if plan["peak_bytes"] is not None else "-")
    console.print(plans)
    if result["margin_bytes"] < 0 and len(errors) == len(result["plans"]):
        errors = errors[:1]  # every policy fails for the same reason: say it once
    for name, message in errors:
        console.print(f"[red]{name}[/red]: {message}")
    chosen = result["plans"].get(result["verdict"]["policy"], {})
    for reason in chosen.get("reasons", []):
        console.print(f"  [dim]{result['verdict']['policy']}:[/dim] {reason}")

    v = result["verdict"]
    style = _STYLES[v["status"]]
    console.print(f"[{style}]Verdict ({v['policy']}):[/{style}] {v['message']}")
    st = result.get("step_time") or {}
    if "serial" in st:
        a, b = st["serial"], st["overlap"]
        console.print(
            f"[bold]Predicted step ({st['gpu']}):[/bold] {a['step_s'] * 1e3:.0f} ms serial, "
            f"{b['step_s'] * 1e3:.0f} ms with overlap=True: compute {a['compute_s'] * 1e3:.0f} ms "
            f"({a['flops'] / 1e12:.2f} TFLOP at {a['efficiency']:.2f} of "
            f"{a['peak_flops'] / 1e12:.0f} TFLOP/s) "
            f"+ CPU update {a['cpu_update_s'] * 1e3:.0f} ms ({a['host_elements']:,} elements at "
            f"{a['cpu_elements_per_s'] / 1e9:.2f} G/s, {st['cpu_rate_source']})"
            + (f" beside the streamed update, {a['link_s'] * 1e3:.0f} ms over the link ({st['link_source']})"
               if a.get("link_s") else ""), highlight=False)
    elif st:
        console.print(f"[dim]Step time: {st['reason']}[/dim]")
    if "ranks" in result:
        render_ranks(result["ranks"], result["trace"]["peak_non_model_bytes"], console)
    largest = result.get("largest_preset")
    if largest is not None:
        def say(name: str | None) -> str:
            return name if name is not None else "none"

        console.print(
            f"[bold]Largest preset that fits {cap} at batch {largest['batch_size']} x seq "
            f"{largest['seq_len']} ({largest['policy']}):[/bold] {say(largest['any'])}; with the parameters "
            f"on the device {say(largest['params_on_device'])}; with everything on the device "
            f"{say(largest['all_on_device'])}")


def _pipeline_text(pipe: dict[str, Any] | None) -> str:
    """A pipeline stage's workload, for the head table ("" for a whole model)."""
    if not pipe:
        return ""
    return (f"; stage {pipe['stage']} of {pipe['stages']}, {pipe['micro_batches']} micro-batches "
            f"({pipe['schedule']}, {pipe['in_flight']} in flight at most)")


_STYLES = {"fits": "bold green", "offload": "bold yellow", "offload_params": "bold yellow",
           "does_not_fit": "bold red", "does_not_fit_host": "bold red"}


def render_ranks(ranks: dict[str, Any], peak_non_model_bytes: int, console: Console) -> None:
    """Print a :func:`memsched.planning.capacity.per_rank_dict`: one row per ZeRO stage."""
    fb = format_bytes
    table = Table(title=f"Per rank with {ranks['world_size']} data-parallel ranks ({ranks['policy']}; the "
                        f"batch is per rank, peak non-model data {fb(peak_non_model_bytes)})",
                  title_justify="left")
    for col in ("ZeRO stage", "resident model data", "optimizer state on device", "pinned host", "peak",
                "verdict"):
        table.add_column(col, justify="left" if col == "verdict" else "right")

    def cell(value: int | None) -> str:
        return "-" if value is None else fb(value)

    for st in ranks["stages"]:
        style = _STYLES[st["status"]]
        status = st["status"].replace("_", " ")
        table.add_row(str(st["zero_stage"]), cell(st["resident_model_bytes"]), cell(st["device_state_bytes"]),
                      cell(st["host_bytes"]), cell(st["peak_bytes"]), f"[{style}]{status}[/{style}]")
    console.print(table)


def _status_text(v: dict[str, Any]) -> str:
    """A policy's :func:`verdict` in a sweep's cell."""
    status = v["status"]
    tight = " [bold yellow](tight)[/bold yellow]" if v.get("tight") else ""
    if status == "fits":
        return f"[green]fits[/green], all on the device{tight}"
    if status == "offload":
        return f"[yellow]fits[/yellow], {format_bytes(v['offloaded_bytes'])} offloaded{tight}"
    if status == "offload_params":
        return (f"[yellow]fits[/yellow], {format_bytes(v['params_on_host_bytes'])} of parameters on the "
                f"host{tight}")
    short = f", short {format_bytes(v['short_bytes'])}" if v["short_bytes"] else ""
    return f"[red]does not fit[/red]{short}"


def render_sweep(sweep: dict[str, Any], console: Console) -> None:
    """Print a :func:`memsched.planning.capacity.sweep_dict`: one row per size, then the largest that fits."""
    over, fb = sweep["over"], format_bytes
    name = over.replace("_", " ")
    w = sweep["sizes"][0]["result"]["workload"]
    fixed = "seq" if over == "batch_size" else "batch"
    fixed_value = w["seq_len"] if over == "batch_size" else w["batch_size"]
    cap = fb(sweep["capacity_bytes"]) + (f" ({sweep['gpu']})" if sweep["gpu"] else "")
    family = "" if "source" in w else "GPT "
    table = Table(title=f"{family}{w['model']} ({w['parameters']:,} parameters, {w['dtype']}), {fixed} "
                        f"{fixed_value}, on {cap}, gpu_margin_mem_ratio {sweep['gpu_margin_mem_ratio']:g}",
                  title_justify="left")
    table.add_column(name, justify="right")
    table.add_column("peak non-model data", justify="right")
    table.add_column("GPU margin", justify="right")
    shown = list(sweep["sizes"][0]["verdicts"])
    for policy in shown:
        table.add_column(policy)
    for size in sweep["sizes"]:
        cells = [_status_text(size["verdicts"][policy]) for policy in shown]
        table.add_row(str(size[over]), fb(size["peak_non_model_bytes"]), fb(size["margin_bytes"]), *cells)
    console.print(table)
    largest = sweep["largest_fitting"]

    def say(value: int | None) -> str:
        return "none" if value is None else str(value)

    line = f"Largest {name} that fits {cap}: {say(largest['auto'])} with auto, {say(largest['cpu'])} with cpu"
    if largest["auto_all_on_device"] is not None:
        line += f" (auto keeps all optimizer state on the device up to {largest['auto_all_on_device']})"
    elif largest["auto"] is not None:
        line += " (auto offloads optimizer state at every size that fits)"
    console.print(f"[bold]{line}[/bold]")
