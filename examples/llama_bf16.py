"""Full fine-tuning of a Llama-class model in bf16 with fp32 master weights, offloaded where it does not fit.

The workload offload users ask for: an 8B Llama on one 24 GB GPU with 128 GB of host memory::

    memsched plan --model llama-3.1-8b --dtype bf16 --batch-size 1 --seq-len 2048 --checkpointing \\
        --gpu rtx4090 --host-memory 128GiB                                   # the plan first, no GPU needed
    python examples/llama_bf16.py --model llama-3.1-8b --seq-len 2048 --host-memory 120GiB

Without a GPU, ``python examples/llama_bf16.py`` trains a 2-layer Llama of the same build (GQA, RoPE,
SwiGLU, untied embeddings) on the stand-in device. What it does, in the order a user would:

1. builds the model on ``meta`` with ``accelerate.init_empty_weights()`` (a preset of
   :mod:`memsched.models.llama`, a ``config.json``, or a Hugging Face model id), so an 8B model never takes
   its size in host memory before memsched packs it;
2. attaches it with ``dtype=torch.bfloat16`` (bf16 compute, fp32 masters on the host), ``policy="auto"``,
   ``overlap=True`` and ``host_update="auto"`` (each host chunk updated where the plan finds it faster:
   :mod:`policies.update_paths`);
3. gives the parameters values: the model's own initialisation, in place (or ``load_state_dict`` of a
   checkpoint, as low-memory loading does);
4. trains with Hugging Face's activation checkpointing, a cosine schedule and a clip of 1.0 on random tokens,
   and prints the plan's reasons, tokens per second and the pinned host memory per parameter.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import memsched
from policies import format_bytes


def build(name: str) -> nn.Module:
    """A Llama-class model on ``meta`` (its buffers real, as ``init_empty_weights()`` makes them), with
    activation checkpointing. ``name``: ``"tiny"``, a preset, a ``config.json`` or a model id."""
    import transformers
    from accelerate import init_empty_weights

    from memsched.models.llama import hf_config, llama_shape

    if name == "tiny":
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          tie_word_embeddings=False, max_position_embeddings=256)
    elif name.endswith(".json") or "/" in name:
        config = transformers.AutoConfig.from_pretrained(name)
    else:
        config = hf_config(name)
    qwen = name != "tiny" and llama_shape(name).family == "qwen2"
    cls = transformers.Qwen2ForCausalLM if qwen else transformers.LlamaForCausalLM
    with init_empty_weights():
        model = cls(config)
    model.tie_weights()  # a model built empty ties here (tied presets: Llama 3.2 1B and 3B)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, a preset (llama-3.1-8b), a config.json or an id")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--device", default=None,
                    help="default: cuda if present, else a stand-in too small for the toy's optimizer state")
    ap.add_argument("--host-memory", default=None, help="a limit on pinned host memory, e.g. 120GiB")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "sim:2560KiB,link=25GBps")

    torch.manual_seed(0)
    model = build(args.model)
    sched = memsched.attach(model, device=device, dtype=torch.bfloat16, policy="auto", lr=args.lr,
                            weight_decay=0.0, overlap=True, host_update="auto", host_memory=args.host_memory)
    with sched:
        model.apply(model._init_weights)  # values, in place through the chunk views (or load_state_dict)
        warm = max(1, args.steps // 10)  # linear warmup, then cosine decay

        def lr_factor(s: int) -> float:
            return min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps))))

        schedule = torch.optim.lr_scheduler.LambdaLR(sched.optimizer, lr_factor)
        vocab = model.config.vocab_size
        dev = sched.device.torch_device
        gen = torch.Generator().manual_seed(1)
        losses: list[float] = []
        t0 = None
        for step in range(args.steps):
            if step == 1:  # after the warmup step (traced, then planned)
                sched.synchronize()
                t0 = time.perf_counter()
                print("plan:", *sched.plan.reasons, sep="\n  ")
            x = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen).to(dev)
            loss = model(input_ids=x, labels=x).loss
            sched.backward(loss)
            sched.clip_grad_norm_(1.0)
            sched.optimizer.step()
            schedule.step()
            sched.optimizer.zero_grad()
            losses.append(float(loss.detach()))
        sched.synchronize()
        if t0 is not None and args.steps > 1:
            tokens = (args.steps - 1) * args.batch_size * args.seq_len
            print(f"{tokens / (time.perf_counter() - t0):.0f} tokens/s over {args.steps - 1} steps; "
                  f"losses {losses[0]:.3f} -> {losses[-1]:.3f}")
        usage = sched.host_usage()
        print(f"pinned host memory: {format_bytes(usage.pinned_bytes)} for {usage.parameters:,} parameters "
              f"({usage.pinned_bytes / max(1, usage.parameters):.2f} B/param; planned "
              f"{usage.planned_pinned_bytes / max(1, usage.parameters):.2f})")
    return losses


if __name__ == "__main__":
    main()
