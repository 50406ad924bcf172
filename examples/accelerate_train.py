"""Hugging Face Accelerate with memsched: prepare memsched's optimizer like any other, keep Accelerate's loop.

    pip install -e ".[hf]"
    python examples/accelerate_train.py

``accelerator.prepare`` wraps ``sched.optimizer`` (``AcceleratedOptimizer``: it steps and zeroes only at
the end of each accumulation cycle) and the LR scheduler; ``accelerator.backward`` and
``accelerator.clip_grad_norm_`` work on memsched's gradients, which stay views into its chunks. The loop
equals the same loop with ``torch.optim.AdamW(fused=True)`` bit for bit, in fp32 and with
``mixed_precision="bf16"`` (``tests/test_accelerate.py``). One process only; with memsched's own
``dtype=torch.float16`` call ``sched.backward`` and ``sched.clip_grad_norm_`` instead (they apply the loss
scale), and with its ``dtype=torch.bfloat16`` / ``float16`` prepare the optimizer with
``device_placement=[False, False, True, True]`` (Accelerate's state round-trip would reset the fp32 masters).
The model is prepared without device placement (memsched placed it; without a GPU Accelerate's device is the
CPU) and the batches go to the scheduler's device. On a machine without a GPU it uses the stand-in device,
half of the optimizer state on the host.
``main()`` returns the loss of every optimizer step, averaged over its micro-batches.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

import memsched
from memsched.data import batches, load_stdlib_corpus


def main(steps: int = 20, accum: int = 2, max_norm: float = 1.0, mixed_precision: str = "no",
         report: bool = False, device: str | None = None) -> list[float]:
    """The losses of each optimizer step. ``device``: memsched's; by default CUDA where Accelerate's device is
    CUDA, else the stand-in (``sim:64MiB``, with half of the optimizer state on the host)."""
    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=accum, mixed_precision=mixed_precision)
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=2,  # bytes as tokens
                        bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    device = device or ("cuda" if accelerator.device.type == "cuda" else "sim:64MiB")
    if not device.startswith("sim"):
        placement = {"device": device, "policy": "auto"}
    else:  # the stand-in, with half of the optimizer state on the host so that the run shows offload
        placement = {"device": device, "policy": "static", "policy_options": {"offload_optim_frac": 0.5}}
    sched = memsched.attach(model, lr=3e-3, weight_decay=0.1, **placement)
    lr_schedule = get_linear_schedule_with_warmup(sched.optimizer, num_warmup_steps=3,
                                                  num_training_steps=steps)
    data = batches(load_stdlib_corpus(2**20).train, batch_size=8, seq_len=64, seed=0)
    micro_batches = torch.cat([next(data)[0] for _ in range(steps * accum)])
    loader = torch.utils.data.DataLoader(micro_batches, batch_size=8)

    # memsched already placed the model (on the GPU, or on the stand-in sim:0 while Accelerate's device is the
    # CPU): no device placement for it, which would move its parameters out of memsched's chunks
    model, optimizer, loader, lr_schedule = accelerator.prepare(model, sched.optimizer, loader, lr_schedule,
                                                                device_placement=[False, True, True, True])
    losses, total = [], 0.0
    with sched:
        model.train()
        for x in loader:
            x = x.to(sched.device.torch_device)  # the scheduler's device (a no-op where Accelerate put it)
            with accelerator.accumulate(model):
                loss = model(input_ids=x, labels=x).loss  # the model shifts the labels itself
                accelerator.backward(loss)  # divides by the accumulation steps
                total += loss.item() / accum
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_norm)
                optimizer.step()  # memsched's step, at the end of each accumulation cycle only
                lr_schedule.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                losses.append(total)
                total = 0.0
        if report:
            sched.report()
    return losses


if __name__ == "__main__":
    losses = main(report=True)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
