"""Train a Hugging Face ``transformers`` GPT-2 with memsched over several ranks at a ZeRO stage.

Run it with ``torchrun --nproc_per_node 2 examples/zero_train.py --zero-stage 3`` (gloo on the CPU with
the stand-in accelerator ``sim:SIZE`` where the machine has fewer GPUs than ranks, NCCL with one GPU per rank
otherwise). Each rank
trains on its own batches; at ZeRO-3 the parameters are sharded over the ranks between steps, so the weight
norm logged on rank 0 is read inside ``sched.gathered_params()``, which every rank enters. At the end the
model and the sharded optimizer state are saved with ``memsched.checkpoint.save`` (every rank) when
``--save DIR`` is given. Rank 0 prints one JSON line: the losses of every optimizer step, the logged norms and
the per-rank device peak, bytes.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import memsched
from memsched import checkpoint
from memsched.data import batches, load_stdlib_corpus


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save", metavar="DIR", default=None, help="save a checkpoint there at the end")
    args = ap.parse_args(argv)
    # NCCL with one GPU per rank where the machine has that many, else gloo and the stand-in
    cuda = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(0)  # the same initial model on every rank (rank 0's is broadcast anyway)
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=2,  # bytes as tokens
                        bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    sched = memsched.attach(model, device="cuda" if cuda else "sim:256MiB", lr=3e-3,
                            zero_stage=args.zero_stage)
    data = batches(load_stdlib_corpus(2**20).train, batch_size=4, seq_len=64, seed=rank)
    losses, norms = [], []
    with sched:
        for _ in range(args.steps):
            x, _ = next(data)
            x = x.to(sched.device.torch_device)
            loss = model(input_ids=x, labels=x).loss
            sched.backward(loss)
            sched.clip_grad_norm_(1.0)  # exact over every rank's gradients
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            mean = loss.detach().clone() if cuda else loss.detach().cpu()  # gloo reduces host tensors
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
            with sched.gathered_params():  # every rank: at ZeRO-3 the weights are sharded between steps
                norms.append(model.transformer.wte.weight.norm().item())
        if args.save:
            checkpoint.save(sched, args.save)
        peak = sched.sim.peak_bytes if sched.sim is not None else torch.cuda.max_memory_allocated()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    result = {"zero_stage": args.zero_stage, "losses": losses, "wte_norms": norms,
              "peak_bytes_per_rank": peaks}
    if rank == 0:
        print(json.dumps(result))
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
