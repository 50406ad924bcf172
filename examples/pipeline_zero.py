"""Pipeline parallelism x ZeRO with memsched: a small GPT cut into 2 stages, each stage data-parallel over 2
ranks, on the CPU with gloo.

    torchrun --nproc_per_node 4 examples/pipeline_zero.py [--zero-stage 1|2|3] [--schedule gpipe|1f1b]

Rank ``r`` is stage ``r % 2`` of data-parallel replica ``r // 2``. Each rank attaches memsched to its stage
with the stage's data-parallel group (``memsched.attach(stage, process_group=dp_group, zero_stage=...)``);
torch's ``PipelineStage`` and schedule run the micro-batches' forwards and backwards, and
``sched.optimizer.step()`` reduces the gradients once per step over the data-parallel group
(docs/pipeline.md).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import memsched
from memsched.models.gpt import GPT, GPTConfig
from memsched.models.gpt_stages import split_gpt, stage_loss

STAGES, REPLICAS = 2, 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=1, choices=(1, 2, 3))
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != STAGES * REPLICAS:
        raise SystemExit(f"run with torchrun --nproc_per_node {STAGES * REPLICAS} (got {world} ranks)")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # every rank creates every group, in the same order
    pp_groups = [dist.new_group([d * STAGES + s for s in range(STAGES)]) for d in range(REPLICAS)]
    dp_groups = [dist.new_group([d * STAGES + s for d in range(REPLICAS)]) for s in range(STAGES)]
    stage_index, replica = rank % STAGES, rank // STAGES

    torch.manual_seed(0)  # every rank builds the same model and keeps its stage
    gpt = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64))
    module = split_gpt(gpt, STAGES)[stage_index]
    with memsched.attach(module, policy="cpu", device="cpu", zero_stage=args.zero_stage,
                         process_group=dp_groups[stage_index], lr=3e-3) as sched:
        stage = PipelineStage(module, stage_index, STAGES, torch.device("cpu"), group=pp_groups[replica])
        cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        schedule = cls(stage, n_microbatches=args.micro_batches, loss_fn=stage_loss)
        g = torch.Generator().manual_seed(1 + replica)  # each replica its own data
        for step in range(args.steps):
            tokens = torch.randint(0, 256, (2 * args.micro_batches, 65), generator=g)
            losses: list[torch.Tensor] = []
            if stage_index == 0:
                schedule.step(tokens[:, :-1])
            else:
                schedule.step(target=tokens[:, 1:], losses=losses)
            sched.optimizer.step()
            sched.optimizer.zero_grad()
            if losses:
                mean = torch.stack(losses).mean()
                print(f"step {step} replica {replica}: loss {mean.item():.4f}", flush=True)
        if rank == 0:
            print(f"stage {stage_index}: {sched.dp.pipeline.detected}; peak non-model data "
                  f"{sched.peak_non_model_bytes():,} B; ZeRO-{args.zero_stage}, {args.schedule}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
