"""memsched's numerics on a real GPU, with the copy streams slowed down so that races show every time.

Run ``python bench/gpu_numerics.py`` from the repository root on a CUDA machine (one command; about a
minute). Every case trains the tiny GPT of ``tests/_numerics.py`` (tied embeddings; ``nn.MultiheadAttention``
reads ``out_proj``'s parameters without calling it) for a few steps and compares every parameter, bit for bit,
with plain PyTorch: ``torch.optim.AdamW(fused=True)`` on the device where memsched updates each parameter
(the GPU for device chunks, the CPU for host chunks and during warmup: the two kernels round differently),
``clip_grad_norm_`` with a norm that always triggers, and GradScaler's semantics for fp16 (a scale that
grows every second step).

Cases: policies ``cpu`` (all optimizer state in pinned host memory), ``static`` (half), ``auto`` and ``cuda``;
fp32, bf16, fp16; clipping through torch, through ``sched.clip_grad_norm_`` or none; ``overlap`` off, on and
``"backward"`` (on: the parameters are read only after every second step, so the next forward must wait for
the CPU worker by itself; ``"backward"``: host chunks are updated during backward, and without clipping the
updates are committed at the step, so the early D2H and its fingerprint are on the path); then ``close()``
followed at once by a read of the parameters and of ``model.state_dict()``.

The race detector: every D2H and H2D copy memsched issues is preceded on its side stream by
``torch.cuda._sleep`` (``--delay-ms``, default 20 ms). A forward that does not wait for a chunk's H2D copy
reads the old parameters; a CPU update that does not wait for its D2H copy reads old gradients; a read after
``close()`` that does not wait sees half-updated parameters. Any of these makes a case differ from the
reference. Exit code 1 when any case differs. Results go to ``bench/results/gpu_numerics_<gpu>.json``.

``--device sim:64MiB`` runs the same cases on the stand-in device (no delays; the CPU smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make ``bench``, ``tests`` and the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memsched  # noqa: E402
from bench._machine import write_result  # noqa: E402
from bench.gpu_step_time import gpu_slug  # noqa: E402
from memsched.devices.spec import parse_device  # noqa: E402
from memsched.devices.transfers import Streams  # noqa: E402
from policies.types import HOST  # noqa: E402
from tests._numerics import LR, WD, Reference, gpt_batches, gpt_loss, tiny_gpt  # noqa: E402

CLIP = 0.05
POLICIES = {
    "cpu": {"policy": "cpu"},
    "static": {"policy": "static", "policy_options": {"offload_optim_frac": 0.5}},
    "auto": {"policy": "auto"},
    "cuda": {"policy": "cuda"},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def slow_copies(delay_ms: float):
    """Every copy memsched issues on a side stream starts ``delay_ms`` late (``torch.cuda._sleep``)."""
    if delay_ms <= 0 or not torch.cuda.is_available():
        yield
        return
    khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 1_500_000) or 1_500_000
    cycles = int(delay_ms * khz)  # clock_rate is in kHz: cycles per millisecond
    original = Streams._copy

    def delayed(self, stream, dst, src, device, after=None):
        if self.cuda:
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
        return original(self, stream, dst, src, device, after)

    Streams._copy = delayed
    try:
        yield
    finally:
        Streams._copy = original


def host_updated(model: torch.nn.Module, sched: memsched.Scheduler) -> set[int]:
    """Indices (``model.parameters()`` order) of the parameters whose chunk is host-resident: the next step
    updates them with torch's CPU fused AdamW kernel (all of them during warmup)."""
    on_host = {id(p) for c in sched.store.chunks if c.placement == HOST for p in c.params}
    return {i for i, p in enumerate(model.parameters()) if id(p) in on_host}


def first_difference(model: torch.nn.Module, ref: Reference) -> str | None:
    for (name, p), q in zip(model.named_parameters(), ref.model.parameters(), strict=True):
        p, q = p.detach().cpu(), q.detach().cpu()  # host views between steps and device tensors alike
        if not torch.equal(p, q):
            d = (p.float() - q.float()).abs().max().item()
            return f"{name} differs (max abs diff {d:.3g})"
    return None


def run_case(device: str, policy: str, dtype_name: str, via: str, steps: int,
             overlap: bool | str = False) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    dev = parse_device(device).torch_device  # cuda, or the stand-in sim:0
    model = tiny_gpt().to(dev)
    ref = Reference(model, dtype, growth_interval=2, device=dev)
    batches = gpt_batches(steps, device=dev)
    out: dict[str, Any] = {"policy": policy, "dtype": dtype_name, "clip_via": via, "overlap": overlap,
                           "status": "ok"}
    t0 = time.perf_counter()
    sched = memsched.attach(model, device=device, dtype=dtype, lr=LR, weight_decay=WD, warmup_steps=2,
                            chunk_numel=8192, overlap=overlap, **POLICIES[policy])
    try:
        if sched.scaler is not None:
            sched.scaler.growth_interval = 2
        for i, b in enumerate(batches):
            sched.backward(gpt_loss(model, b))
            # torch's clip groups the norms by the devices it finds the gradients on (host chunks' on the
            # host): the reference computes its norm over the same devices
            devices = [None if p.grad is None else p.grad.device for p in model.parameters()]
            if via == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            elif via == "memsched":
                sched.clip_grad_norm_(CLIP)
            on_host = host_updated(model, sched)  # where this step updates each parameter
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            with sched.sim.paused() if sched.sim is not None else contextlib.nullcontext():
                ref.step(b, gpt_loss, None if via == "none" else CLIP, on_host=on_host,
                         clip_devices=devices if via == "torch" else None)
            if i < steps - 1 and not (overlap and i % 2 == 0):  # last: after close(); overlap: every 2nd
                sched.synchronize()  # reads outside a forward wait first (the documented contract)
                with sched.sim.paused() if sched.sim is not None else contextlib.nullcontext():
                    diff = first_difference(model, ref)
                if diff:
                    return {**out, "status": "differs", "step": i, "what": diff}
        out["placements"] = sorted({c.placement for c in sched.store.chunks})
    finally:
        sched.close()
    # Right after close(): the parameters and the model's state dict hold the last update.
    diff = first_difference(model, ref)
    state = model.state_dict()
    if diff is None:
        for name, q in zip(state, ref.model.state_dict().values(), strict=True):
            if not torch.equal(state[name].cpu(), q.cpu()):
                diff = f"state_dict[{name!r}] differs after close()"
                break
    if diff:
        return {**out, "status": "differs", "step": steps - 1, "what": f"after close(): {diff}"}
    out["seconds"] = time.perf_counter() - t0
    return out


def cases(policies: Sequence[str], dtypes: Sequence[str]) -> list[tuple[str, str, str]]:
    out = []
    for policy in policies:
        for dt in dtypes:
            for via in (("memsched", "none") if dt == "fp16" else ("torch", "memsched", "none")):
                out.append((policy, dt, via))  # fp16: torch's clip would see the scaled gradients
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or a stand-in such as sim:64MiB")
    ap.add_argument("--delay-ms", type=float, default=20.0, help="sleep before every side-stream copy (20)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--policies", nargs="*", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--overlap", choices=("off", "on", "backward", "all"), default="all",
                    help="attach(overlap=...) for each case: off (False), on (True), backward "
                         "('backward') or all three (default)")
    ap.add_argument("--name", default=None, help="result name (default gpu_numerics_<gpu-name>)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_numerics: needs a CUDA device (or --device sim:SIZE); nothing written")
        return 0
    results = []
    with slow_copies(args.delay_ms if args.device == "cuda" else 0.0):
        overlaps = {"off": (False,), "on": (True,), "backward": ("backward",),
                    "all": (False, True, "backward")}[args.overlap]
        for overlap in overlaps:
            for policy, dt, via in cases(args.policies, args.dtypes):
                try:
                    r = run_case(args.device, policy, dt, via, args.steps, overlap)
                except Exception as e:  # noqa: BLE001 - a failing case is a result
                    r = {"policy": policy, "dtype": dt, "clip_via": via, "overlap": overlap,
                         "status": "error", "what": f"{type(e).__name__}: {e}"[:2000]}
                print(f"  {policy:7s} {dt:5s} clip via {via:9s} overlap {overlap!s:5s} {r['status']:8s} "
                      f"{r.get('what', '')}", flush=True)
                results.append(r)
    bad = [r for r in results if r["status"] != "ok"]
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    payload = {
        "what": "bit-exact parity with torch.optim.AdamW(fused=True) + clip_grad_norm_ (+ GradScaler "
                "semantics for fp16), every side-stream copy delayed by --delay-ms",
        "device": gpu, "delay_ms": args.delay_ms if args.device == "cuda" else 0.0,
        "torch": torch.__version__, "steps": args.steps,
        "passed": len(results) - len(bad), "failed": len(bad), "results": results,
    }
    path = write_result(args.name or f"gpu_numerics_{gpu_slug(gpu)}", payload)
    print(f"{len(results) - len(bad)} passed, {len(bad)} failed; wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
