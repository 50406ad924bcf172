"""Hugging Face Trainer with memsched: pass memsched's optimizer to the Trainer, keep everything else.

    pip install -e ".[hf]"
    python examples/hf_trainer.py

The Trainer's gradient accumulation, ``max_grad_norm`` and LR scheduler work unchanged; its
``model.zero_grad()`` is followed (memsched binds the gradients back into its chunks before each forward).
The run equals the same Trainer with ``torch.optim.AdamW(fused=True)`` bit for bit
(``tests/test_hf_trainer.py``). On a machine without a GPU it uses the stand-in device ``sim:0`` while the
Trainer itself runs on the CPU: :class:`StandInArguments` and :class:`StandInTrainer` keep the Trainer and its
Accelerator from moving the model (memsched refuses parameters moved out of its chunks) and send the inputs
to the stand-in.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import memsched


class StandInArguments(TrainingArguments):
    """The Trainer's device (inputs, loss) is the stand-in; it does not place the model (memsched did)."""

    @property
    def device(self) -> torch.device:
        _ = super().device  # sets the Trainer's process state up (on the CPU)
        return torch.device("sim", 0)

    @property
    def place_model_on_device(self) -> bool:
        return False


class StandInTrainer(Trainer):
    """A Trainer whose Accelerator (on the CPU) places nothing: its ``prepare`` would move the model there."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.device_placement = False


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    tokens = torch.randint(0, 256, (64, 32))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "sim:64MiB"
    arguments, trainer = (TrainingArguments, Trainer) if gpu else (StandInArguments, StandInTrainer)
    with memsched.attach(model, device=device, lr=1e-3, weight_decay=0.1) as sched:
        args = arguments(tempfile.mkdtemp(), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                         max_steps=8, learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0,
                         logging_steps=2, report_to=[], save_strategy="no", use_cpu=not gpu)
        trainer(model=model, args=args, train_dataset=data, optimizers=(sched.optimizer, None)).train()
        sched.report()


if __name__ == "__main__":
    main()
