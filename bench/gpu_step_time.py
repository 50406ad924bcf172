"""Training-step time of a GPT per placement policy under a GPU memory cap (needs CUDA).

Run ``python bench/gpu_step_time.py`` from the repository root on a machine with a CUDA GPU. Without CUDA it
prints one line saying so and exits 0, writing nothing. The result goes to
``bench/results/gpu_step_time_<gpu-name>.json`` via :func:`bench._machine.write_result`.

Each configuration runs in its own child process (a fresh CUDA context, so one run's cached blocks,
fragmentation or out-of-memory cannot affect the next), capped with
``torch.cuda.set_per_process_memory_fraction(f)``, ``f = --mem-cap / total device memory`` (or
``--mem-fraction``): the caching allocator refuses to hold more than that share, as if the GPU were smaller.
Configurations:

* memsched: ``memsched.attach(model, policy=P, device="cuda")`` for each ``--policies`` entry (default
  ``cpu``, ``static:offload_optim_frac=0.5``, ``auto``, ``cuda``; ``name:key=value,...`` passes
  ``policy_options={key: value}``; a trailing ``+overlap`` attaches with ``overlap=True``, ``+backward``
  with ``overlap="backward"``; then ``+device-update`` or ``+auto-update`` attaches with
  ``host_update="device"``/``"auto"``), step = forward,
  ``sched.backward(loss)``,
  ``sched.optimizer.step()``, ``zero_grad()``. The plan and the H2D/D2H bytes are recorded.
* ``torch_adamw``: plain ``torch.optim.AdamW(fused=True)`` with everything on the device (when it fits).
* ``deepspeed_zero_offload``: DeepSpeed ZeRO stage 2 with ``offload_optimizer: cpu`` (if importable).
* ``deepspeed_zero3_offload``: DeepSpeed ZeRO stage 3 with ``offload_optimizer: cpu`` and ``offload_param:
  cpu`` (ZeRO-Infinity's parameter offload to CPU memory; if importable).
* ``torchao_cpu_offload``: torchao's ``CPUOffloadOptimizer`` around ``torch.optim.AdamW`` (if importable).

Timing: after ``--warmup`` untimed steps (memsched's tracing warmup step among them) the ``--steps`` timed
steps run back to back with ``torch.cuda.synchronize()`` only before the first and after the last, so work
that one step leaves running (copies, a CPU update) overlaps the next as it would in training, and nothing
reads the loss inside the window. ``mean_step_s`` is the window divided by the steps (the throughput figure,
and tokens/s); ``step_time`` summarises the host-side intervals between step returns. The peak allocated /
reserved device memory over the timed steps is recorded.

Numerics: every configuration trains the same model from the same seed on the same batches, so the loss
trajectories are compared with ``torch_adamw`` (``loss_max_abs_diff``): memsched's must be identical (it is
bit-exact against ``torch.optim.AdamW(fused=True)``); peers may differ in their last bits.

The model is :class:`memsched.models.gpt.GPT`, or with ``--llama NAME`` a Llama-class model built with
transformers (a preset of :mod:`memsched.models.llama`, or a ``config.json``; random weights) in
``--dtype bf16`` with ``--checkpointing`` (Hugging Face's ``gradient_checkpointing_enable()``), the
workload of issue 42:

* memsched builds it on the meta device, attaches with ``dtype=torch.bfloat16`` (fp32 masters on the host) and
  initialises it in place (``model.apply(model._init_weights)``): the model never exists whole on the host;
* ``fsdp2_cpu_offload``: FSDP2 (``fully_shard`` per decoder layer and the root, world size 1) with
  ``CPUOffloadPolicy`` and ``MixedPrecisionPolicy(param_dtype=bf16)``, fp32 parameters sharded on the host;
* ``deepspeed_zero3_offload``: ZeRO-3 with parameters and optimizer state offloaded to the CPU, ``bf16``;
* ``torchao_cpu_offload``: the bf16 model on the device, its AdamW state on the host.

Per configuration it records tokens/s, the peak device bytes, pinned host bytes per parameter
(``pinned_host_bytes_per_param``: memsched's registered pinned memory) and the step timeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make ``bench`` and the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import summarize
from bench._machine import write_result  # noqa: E402
from policies.units import format_bytes, parse_bytes  # noqa: E402

NEEDS_CUDA = "gpu_step_time: needs a CUDA device (torch.cuda.is_available() is False); nothing written"
DEFAULT_POLICIES = ("cpu", "cpu+overlap", "static:offload_optim_frac=0.5",
                    "static:offload_optim_frac=0.5+overlap", "auto", "auto+overlap", "cuda")
PEERS = ("torch_adamw", "deepspeed_zero_offload", "deepspeed_zero3_offload", "torchao_cpu_offload",
         "fsdp2_cpu_offload")
LR, WEIGHT_DECAY = 3e-4, 0.1


# ----------------------------------------------------------------------------------------- small helpers
def parse_policy_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"static:offload_optim_frac=0.5"`` -> ``("static", {"offload_optim_frac": "0.5"})``. A trailing
    ``+overlap`` (memsched's ``overlap=True``) is not part of the policy: see :func:`split_overlap`.

    Values stay strings: the policy registry coerces and range-checks them (``policies.get``).

    Raises:
        ValueError: empty name or an option without ``=``.
    """
    spec, _ = split_overlap(spec)
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"policy spec {spec!r} has no name; expected NAME or NAME:key=value[,key=value]")
    options: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"policy spec {spec!r}: option {item!r} is not key=value")
        options[key] = value
    return name, options


def split_host_update(spec: str) -> tuple[str, str]:
    """``"auto+overlap+device-update"`` -> ``("auto+overlap", "device")``: a trailing ``+device-update`` or
    ``+auto-update`` attaches with ``host_update="device"`` / ``"auto"`` (host chunks updated on the GPU,
    their state streamed: :mod:`memsched.optim.streamed_update`); none: ``"cpu"``."""
    for suffix, mode in (("+device-update", "device"), ("+auto-update", "auto")):
        if spec.endswith(suffix):
            return spec[: -len(suffix)], mode
    return spec, "cpu"


def split_overlap(spec: str) -> tuple[str, bool | str]:
    """``"auto+overlap"`` -> ``("auto", True)``; ``"auto+backward"`` -> ``("auto", "backward")`` (the update
    starts during backward, :mod:`memsched.optim.early_update`); ``"auto"`` -> ``("auto", False)``. A
    ``+device-update``/``+auto-update`` suffix after it is :func:`split_host_update`'s."""
    spec = split_host_update(spec)[0]
    for suffix, overlap in (("+overlap", True), ("+backward", "backward")):
        if spec.endswith(suffix):
            return spec[: -len(suffix)], overlap
    return spec, False


def gpu_slug(name: str) -> str:
    """File-name form of a GPU name: ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-gpu"



def _jsonable(x: Any) -> Any:
    """Plans, transfer stats and similar objects as JSON values (dataclasses -> dicts, tuples -> lists)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {
            f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x) if not f.name.startswith("_")
        }
    if hasattr(x, "as_dict"):
        return _jsonable(x.as_dict())
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


# ----------------------------------------------------------------------------------------- the model
def build_model(dims: dict[str, int], device: str) -> tuple[nn.Module, str]:
    """A :class:`memsched.models.gpt.GPT` with ``dims`` (n_layer, n_head, n_embd, vocab_size, block_size) on
    ``device``, and its source."""
    from memsched.models.gpt import GPT, GPTConfig

    with torch.device(device):
        return GPT(GPTConfig(**dims)), "memsched.models.gpt.GPT"


def build_llama(name: str, device: str, checkpointing: bool, dtype: torch.dtype) -> tuple[nn.Module, str]:
    """A Llama-class model (:func:`memsched.models.llama.hf_config`: a preset or a ``config.json``) built with
    transformers on ``device`` (``"meta"``: its parameters without memory, its buffers real, as accelerate's
    ``init_empty_weights()`` builds them) in ``dtype``, with Hugging Face's activation checkpointing when
    asked; and its source."""
    import contextlib

    import transformers

    from memsched.models.llama import hf_config, llama_shape

    config = hf_config(name)
    qwen = llama_shape(name).family == "qwen2"
    cls = transformers.Qwen2ForCausalLM if qwen else transformers.LlamaForCausalLM
    if device == "meta":
        from accelerate import init_empty_weights

        where = init_empty_weights()
    else:
        where = contextlib.nullcontext()
    with where, torch.device("cpu" if device == "meta" else device):
        model = cls(config).to(dtype)
    model.tie_weights()  # a model built empty ties here
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model, f"transformers.{cls.__name__} ({llama_shape(name).source})"


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model(x)`` against ``y`` (both ``[B, T]`` int64); a Hugging Face
    model's ``.logits``."""
    logits = model(x)
    logits = getattr(logits, "logits", logits)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


# ----------------------------------------------------------------------------------------- one configuration
def _is_oom(e: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    return (bool(oom) and isinstance(e, oom)) or "out of memory" in str(e).lower()


def _setup_memsched(model: nn.Module, spec: str, cfg: dict[str, Any]) -> tuple[Callable[..., None], dict]:
    import memsched

    if not hasattr(memsched, "attach"):
        raise LookupError("memsched.attach is not available in this checkout")
    name, options = parse_policy_spec(spec)
    sched = memsched.attach(
        model,
        policy=name,
        policy_options=options or None,
        gpu_margin_mem_ratio=cfg["gpu_margin_mem_ratio"],
        device=cfg["device"],
        warmup_steps=1,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        overlap=split_overlap(spec)[1],
        host_update=split_host_update(spec)[1],
        dtype=torch.bfloat16 if cfg.get("dtype") == "bf16" else None,
    )
    if cfg.get("llama"):  # built on meta: the weights are made in place, chunk views and all
        torch.manual_seed(0)
        model.apply(model._init_weights)  # transformers' per-module initialisation, in place
    away = [p for p in model.parameters() if p.device.type != torch.device(cfg["device"]).type
            and not sched.store.in_host_memory(p)]  # parameters kept on the host are host views between steps
    if away:
        raise RuntimeError(f"memsched.attach(device={cfg['device']!r}) left the model's parameters elsewhere")
    opt = sched.optimizer

    def step(loss: torch.Tensor) -> None:
        sched.backward(loss)
        opt.step()
        opt.zero_grad()

    return step, {"sched": sched}


def _setup_torch_adamw(model: nn.Module, cfg: dict[str, Any]) -> tuple[Callable[..., None], dict]:
    model.to(cfg["device"])
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True
    )

    def step(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, {}


def _setup_torchao(model: nn.Module, cfg: dict[str, Any]) -> tuple[Callable[..., None], dict]:
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
    model.to(cfg["device"])
    opt = CPUOffloadOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        offload_gradients=False,
        fused=True,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
    )

    def step(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, {}


def _setup_fsdp2(model: nn.Module, cfg: dict[str, Any]) -> tuple[Callable[..., None], dict]:
    """FSDP2 with ``CPUOffloadPolicy`` (fp32 parameters, gradients and AdamW state on the host, bf16 compute
    with ``--dtype bf16``), world size 1: each decoder layer, then the root, is a ``fully_shard`` unit."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.device(cfg["device"]).type == "cuda" else "gloo", rank=0,
                                world_size=1)
    bf16 = cfg.get("dtype") == "bf16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=True), "mp_policy": mp}
    layers = getattr(getattr(model, "model", model), "layers", None) or getattr(model, "blocks", [])
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, {}


def _setup_deepspeed(model: nn.Module, cfg: dict[str, Any],
                     stage: int = 2) -> tuple[Callable[..., Any], dict]:
    """DeepSpeed ZeRO ``stage`` with the optimizer state in pinned CPU memory; stage 3 offloads the
    parameters to it too (``offload_param``)."""
    import deepspeed

    # A one-rank process group on this machine only (ZeRO needs torch.distributed).
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg["batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "zero_allow_untested_optimizer": True,
    }
    if cfg.get("dtype") == "bf16":
        ds_config["bf16"] = {"enabled": True}
    if stage == 3:  # ZeRO-Infinity's parameter offload to CPU memory
        ds_config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    return step, {"engine": engine, "ds_config": ds_config}


def run_one(cfg: dict[str, Any]) -> dict[str, Any]:
    """Time one configuration in this process; returns its result (``status`` ok / oom / error / skipped).

    ``cfg`` keys: ``kind`` ("memsched" or a peer name), ``policy`` (memsched spec), ``dims``, ``batch``,
    ``seq``, ``steps``, ``warmup``, ``device``, ``mem_fraction`` (None: no cap), ``gpu_margin_mem_ratio``.
    On CPU (``device="cpu"``, smoke tests only) there is no memory cap and no device memory statistics.
    """
    out: dict[str, Any] = {"kind": cfg["kind"], "policy": cfg.get("policy"), "status": "error"}
    cuda = torch.device(cfg["device"]).type == "cuda"
    try:
        if cuda and cfg.get("mem_fraction") is not None:
            torch.cuda.set_per_process_memory_fraction(cfg["mem_fraction"])
        torch.manual_seed(0)
        kind = cfg["kind"]
        if cfg.get("llama"):
            # memsched builds on meta; FSDP2 and DeepSpeed keep fp32 parameters (their masters) and compute
            # in bf16; torchao and torch train the bf16 model itself
            where = "meta" if kind == "memsched" else "cpu"
            low = cfg.get("dtype") == "bf16" and kind in ("torchao_cpu_offload", "torch_adamw")
            model, out["model_source"] = build_llama(cfg["llama"], where, cfg.get("checkpointing", False),
                                                     torch.bfloat16 if low else torch.float32)
            cfg = {**cfg, "dims": {"vocab_size": model.config.vocab_size}}
        else:
            model, out["model_source"] = build_model(cfg["dims"], "cpu")
        out["parameters"] = sum(p.numel() for p in model.parameters())
        if kind == "memsched":
            step, extra = _setup_memsched(model, cfg["policy"], cfg)
        elif kind == "torch_adamw":
            step, extra = _setup_torch_adamw(model, cfg)
        elif kind == "torchao_cpu_offload":
            if importlib.util.find_spec("torchao") is None:
                return {**out, "status": "skipped", "why": "torchao is not installed"}
            step, extra = _setup_torchao(model, cfg)
        elif kind == "fsdp2_cpu_offload":
            step, extra = _setup_fsdp2(model, cfg)
        elif kind in ("deepspeed_zero_offload", "deepspeed_zero3_offload"):
            if importlib.util.find_spec("deepspeed") is None:
                return {**out, "status": "skipped", "why": "deepspeed is not installed"}
            step, extra = _setup_deepspeed(model, cfg, stage=3 if kind == "deepspeed_zero3_offload" else 2)
            model = extra["engine"]
        else:
            raise ValueError(f"unknown configuration kind {kind!r}; allowed: memsched, {', '.join(PEERS)}")
        g = torch.Generator().manual_seed(1)
        vocab = cfg["dims"]["vocab_size"]
        x = torch.randint(vocab, (cfg["batch"], cfg["seq"]), generator=g).to(cfg["device"])
        y = torch.randint(vocab, (cfg["batch"], cfg["seq"]), generator=g).to(cfg["device"])
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        losses = []
        for _ in range(cfg["warmup"]):
            loss = lm_loss(model, x, y)
            step(loss)
            losses.append(loss.detach())
        finish = getattr(extra.get("sched"), "synchronize", None) or (lambda: None)  # overlapped CPU update
        finish()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if "sched" in extra:
            extra["sched"].step_timeline.records.clear()  # the timed steps only
        times = []
        start = prev = time.perf_counter()
        for _ in range(cfg["steps"]):  # no synchronisation and no loss read inside the window
            loss = lm_loss(model, x, y)
            step(loss)
            losses.append(loss.detach())
            now = time.perf_counter()
            times.append(now - prev)
            prev = now
        finish()  # the last step's overlapped CPU update belongs in the window
        sync()
        window = time.perf_counter() - start
        out.update(
            status="ok",
            step_time=summarize(times),
            window_s=window,
            mean_step_s=window / cfg["steps"],
            losses=[float(v) for v in losses],
            tokens_per_s=cfg["batch"] * cfg["seq"] * cfg["steps"] / window,
        )
        if cuda:
            out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
            from memsched.devices.pinned import registered_bytes

            # memsched's pinned host memory (cudaHostRegister, exact pages), against the plan's host_bytes
            out["pinned_host_bytes"], out["max_pinned_host_bytes"] = registered_bytes()
            out["pinned_host_bytes_per_param"] = out["pinned_host_bytes"] / out["parameters"]
        import resource

        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        if "sched" in extra:
            out["plan"] = _jsonable(getattr(extra["sched"], "plan", None))
            out["transfers"] = _jsonable(getattr(extra["sched"], "transfers", None))
            timeline = getattr(extra["sched"], "step_timeline", None)
            out["step_timeline"] = timeline.mean_summary() if timeline is not None else None
            # the runtime's predicted step (issue 30: the roofline on a GPU the table knows)
            out["predicted_step"] = _jsonable(getattr(extra["sched"], "predicted_step", None))
        if "ds_config" in extra:
            out["ds_config"] = extra["ds_config"]
        if hasattr(extra.get("sched"), "close"):
            extra["sched"].close()  # hooks off (matters in-process, e.g. the CPU smoke test)
    except Exception as e:  # noqa: BLE001 - a failed configuration is a result (OOM above all), not a crash
        out.update(status="oom" if _is_oom(e) else "error", error=f"{type(e).__name__}: {e}"[:2000])
    return out


def compare_losses(results: list[dict[str, Any]]) -> None:
    """Add ``loss_max_abs_diff`` (against ``torch_adamw``, else the first successful run) to each successful
    result, and ``loss_reference``: the same model, seed and batches must give the same losses."""
    ok = [r for r in results if r.get("status") == "ok"]
    ref = next((r for r in ok if r["kind"] == "torch_adamw"), ok[0] if ok else None)
    if ref is None:
        return
    label = ref.get("policy") or ref["kind"]
    for r in ok:
        n = min(len(r["losses"]), len(ref["losses"]))
        r["loss_reference"] = label
        r["loss_max_abs_diff"] = max((abs(a - b) for a, b in zip(r["losses"][:n], ref["losses"][:n],
                                                                 strict=True)), default=0.0)


def run_child(cfg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """:func:`run_one` in a fresh Python process (fresh CUDA context); a crash or timeout is a result too."""
    with tempfile.TemporaryDirectory(prefix="memsched-gpu-step-") as d:
        cfg_path, out_path = Path(d) / "cfg.json", Path(d) / "out.json"
        cfg_path.write_text(json.dumps(cfg))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(cfg_path), str(out_path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {
                "kind": cfg["kind"],
                "policy": cfg.get("policy"),
                "status": "timeout",
                "timeout_s": timeout_s,
            }
        if out_path.exists():
            return json.loads(out_path.read_text())
        return {
            "kind": cfg["kind"],
            "policy": cfg.get("policy"),
            "status": "crashed",
            "returncode": proc.returncode,
            "stderr_tail": proc.stderr[-2000:],
        }


# ----------------------------------------------------------------------------------------- the whole run
def model_dims(args: argparse.Namespace) -> dict[str, int]:
    """Model shape from ``--size`` (a :mod:`memsched.models.gpt` preset) with explicit overrides."""
    dims = {
        "n_layer": 24,
        "n_head": 16,
        "n_embd": 1024,
        "vocab_size": 50257,
        "block_size": 1024,
    }  # GPT-2 355M
    if args.size:
        from memsched.models.gpt import config_for

        c = config_for(args.size)
        dims = {k: getattr(c, k) for k in dims}
    for k in dims:
        if getattr(args, k, None) is not None:
            dims[k] = getattr(args, k)
    dims["block_size"] = max(dims["block_size"], args.seq)
    return dims


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One config dict per run: every ``--policies`` entry, then every ``--peers`` entry."""
    if args.mem_fraction is not None:
        fraction = args.mem_fraction
    else:
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = min(1.0, parse_bytes(args.mem_cap) / total)
    base = {
        "dims": model_dims(args),
        "llama": args.llama,
        "dtype": args.dtype,
        "checkpointing": args.checkpointing,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "device": "cuda",
        "mem_fraction": fraction,
        "gpu_margin_mem_ratio": args.gpu_margin_mem_ratio,
    }
    runs = [{**base, "kind": "memsched", "policy": p} for p in args.policies]
    runs += [{**base, "kind": peer} for peer in args.peers]
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:  # internal: one configuration, result to a file
        cfg = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(run_one(cfg)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--policies",
        nargs="*",
        default=list(DEFAULT_POLICIES),
        help="memsched policy specs NAME[:key=value,...] (default: %(default)s)",
    )
    ap.add_argument(
        "--peers",
        nargs="*",
        default=list(PEERS),
        choices=PEERS,
        help="peer optimizers to time too (default: all; skipped when not importable)",
    )
    ap.add_argument("--size", default=None, help="memsched.models.gpt preset (default: GPT-2 355M shapes)")
    for k in ("n_layer", "n_head", "n_embd", "vocab_size"):
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int, default=None)
    ap.add_argument("--llama", default=None, metavar="NAME",
                    help="a Llama-class model instead of the GPT: a preset (llama-3.1-8b) or a config.json")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: memsched attaches with dtype=torch.bfloat16 (fp32 masters); peers in bf16")
    ap.add_argument("--checkpointing", action="store_true", help="with --llama: activation checkpointing")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (10)")
    ap.add_argument(
        "--warmup", type=int, default=3, help="untimed steps first, memsched's trace step among them"
    )
    cap = ap.add_mutually_exclusive_group()
    cap.add_argument("--mem-cap", default="16GiB", help="device memory cap in bytes, e.g. 16GiB (default)")
    cap.add_argument("--mem-fraction", type=float, default=None, help="cap as a share of device memory")
    ap.add_argument("--gpu-margin-mem-ratio", type=float, default=0.8)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration (300)")
    ap.add_argument("--name", default=None, help="result name (default gpu_step_time_<gpu-name>)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return 0
    for spec in args.policies:
        parse_policy_spec(spec)  # fail fast on a malformed spec
    runs = configurations(args)
    gpu = torch.cuda.get_device_properties(0)
    fraction = runs[0]["mem_fraction"] if runs else None
    print(
        f"{gpu.name}: cap {fraction:.3f} of {format_bytes(gpu.total_memory)} "
        f"= {format_bytes(int(fraction * gpu.total_memory))}; {len(runs)} configurations",
        flush=True,
    )
    results = []
    for cfg in runs:
        r = run_child(cfg, args.timeout)
        label = cfg.get("policy") or cfg["kind"]
        mean = r.get("mean_step_s")
        print(
            f"  {label:34s} {r['status']:8s} "
            + (f"{mean * 1e3:9.1f} ms/step" if mean else r.get("error", "")[:80]),
            flush=True,
        )
        results.append(r)
    compare_losses(results)
    payload = {
        "memory_cap": {
            "method": "torch.cuda.set_per_process_memory_fraction(f) in each configuration's own process",
            "fraction": fraction,
            "bytes": int(fraction * gpu.total_memory) if fraction else None,
            "device_total_bytes": gpu.total_memory,
        },
        "config": {k: v for k, v in runs[0].items() if k not in ("kind", "policy")} if runs else {},
        "timing": "timed steps back to back, cuda.synchronize before the first and after the last only; "
        "mean_step_s = window / steps; step_time = host intervals between step returns",
        "results": results,
    }
    path = write_result(args.name or f"gpu_step_time_{gpu_slug(gpu.name)}", payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
