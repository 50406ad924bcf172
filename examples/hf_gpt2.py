"""Train a Hugging Face ``transformers`` GPT-2 with memsched: LR schedule, gradient accumulation, stand-in.

The model is built from a config (no download) and trained on byte-level text of the Python standard library
(``memsched.data``); without a GPU it runs on the stand-in accelerator ``sim:SIZE``. Run it with
``python examples/hf_gpt2.py``; ``main()`` returns the loss of every optimizer step.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

import memsched
from memsched.data import batches, load_stdlib_corpus


def main(steps: int = 20, accum: int = 2, device: str | None = None) -> list[float]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=2,  # bytes as tokens
                        bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    device = device or ("cuda" if torch.cuda.is_available() else "sim:64MiB")
    sched = memsched.attach(model, device=device, lr=3e-3)
    lr_schedule = get_linear_schedule_with_warmup(sched.optimizer, num_warmup_steps=3,
                                                  num_training_steps=steps)
    data = batches(load_stdlib_corpus(2**20).train, batch_size=8, seq_len=64, seed=0)
    losses = []
    with sched:
        for _ in range(steps):
            total = 0.0
            for _ in range(accum):  # gradient accumulation: gradients of `accum` micro-batches add up
                x, _ = next(data)
                x = x.to(sched.device.torch_device)
                loss = model(input_ids=x, labels=x).loss  # the model shifts the labels itself
                sched.backward(loss / accum)
                total += loss.item() / accum
            sched.optimizer.step()
            lr_schedule.step()
            sched.optimizer.zero_grad()
            losses.append(total)
    return losses


if __name__ == "__main__":
    losses = main()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
