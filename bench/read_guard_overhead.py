"""The read guard's cost: a forward with memsched's ReadGuard entered against one without (run by hand).

Run ``python bench/read_guard_overhead.py`` from the repository root (under a minute). The guard is the
``TorchFunctionMode`` that memsched enters for the root forward while offloaded chunks are not yet waited for
(CUDA, or ``overlap=True``): every torch function call of the forward goes through its Python handler. This
measures that handler's cost on the built-in GPT (``--size``, many small ops: the worst case for a per-call
cost) on the CPU, in interleaved blocks: plain forwards, then forwards with the guard entered and guarding
``--guarded`` tensors that the forward does not read (so every call runs the full check and none waits). No
gradients (``no_grad``): the forward's ops only. Recorded: the forward time of each (median over blocks), the
ratio, the torch function calls per forward, and the cost per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

if __package__ in (None, ""):  # run as a script: make ``bench`` and the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import summarize  # noqa: E402
from bench._machine import write_result  # noqa: E402
from memsched.models.gpt import build_gpt  # noqa: E402
from memsched.runtime.read_guard import ReadGuard  # noqa: E402


class _Count(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        self.calls += 1
        return func(*args, **(kwargs or {}))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", help="built-in GPT size (default tiny)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--guarded", type=int, default=64, help="tensors in the guard's table")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--block", type=int, default=10, help="forwards per block")
    ap.add_argument("--name", default="read_guard_overhead")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_gpt(args.size, device=torch.device("cpu")).eval()
    x = torch.randint(0, 256, (args.batch, args.seq_len))
    others = [torch.zeros(1) for _ in range(args.guarded)]  # guarded, never read by the forward
    waited: list[int] = []
    guard = ReadGuard(lambda i, what: waited.append(i))

    def block(guarded: bool) -> float:
        t0 = time.perf_counter()
        for _ in range(args.block):
            if guarded:
                guard.unwaited = {id(t): k for k, t in enumerate(others)}
                guard.push()
            try:
                model(x)
            finally:
                if guarded:
                    guard.pop()
        return (time.perf_counter() - t0) / args.block

    with torch.no_grad():
        counter = _Count()
        with counter:
            model(x)
        block(False), block(True)  # warm up both paths
        plain, guarded = [], []
        for _ in range(args.blocks):
            plain.append(block(False))
            guarded.append(block(True))
    p, g = statistics.median(plain), statistics.median(guarded)
    result = {
        "what": "GPT forward (no_grad, CPU, 1 thread) with the read guard entered (a table of tensors the "
                "forward does not read: every call checked, none waits) vs without, interleaved blocks",
        "config": vars(args),
        "torch_function_calls_per_forward": counter.calls,
        "plain_forward": summarize(plain),
        "guarded_forward": summarize(guarded),
        "guarded_vs_plain": g / p,
        "cost_per_call_s": (g - p) / counter.calls,
        "waits": len(waited),
    }
    path = write_result(args.name, result)
    print(f"forward {p * 1e3:.2f} ms plain, {g * 1e3:.2f} ms guarded = {g / p:.3f}x; {counter.calls} torch "
          f"function calls per forward, {(g - p) / counter.calls * 1e6:.2f} us per call; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
