#!/usr/bin/env python
"""A hand-written accelerate loop, written the way transformers' examples/pytorch/language-modeling/
run_clm_no_trainer.py is (Accelerator, accelerator.prepare, accelerator.accumulate, accelerator.backward,
accelerator.clip_grad_norm_, a scheduler from transformers.get_scheduler), on a tiny Qwen2 (the harness's qwen2-tiny
preset, random weights) and right-padded samples with an attention mask, recorded for the harness
(docs/own_trainer/accelerate.md#accelerate).

    torchrun --nproc_per_node 2 examples/accelerate_loop.py --output_dir OUT
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py --output_dir OUT   # CPU too: torchrun
    python examples/accelerate_loop.py --output_dir OUT --nproc 2     # 2 ranks spawned here
    python train_ddp.py --replay_record OUT/loss_accelerate_loop.json --num_workers 2 --loss_output_dir OUT \\
        --storage_path OUT/checkpoints
    python plot_loss_curves.py --input_dir OUT --output OUT/curves.png

The loss. run_clm_no_trainer.py backpropagates the model's own `.loss`: each micro-batch's mean over its own tokens.
accelerator.backward divides it by the accumulation steps and DDP averages the ranks: a mean of micro-batch means,
not the global batch's token mean, wherever micro-batches hold different numbers of loss tokens (padding). Here the
step's micro-batches are fetched first and their loss tokens counted over every rank (as Trainer's
`num_items_in_batch` is), and the loss is the token sum scaled to undo both averages. Fetched ahead, the last step's
micro-batches end accelerate's dataloader before that step's first one trains, and accelerate then syncs (and steps)
at each of them: `sync_with_dataloader=False` leaves the sync to the accumulation count.

On a machine without GPUs, `accelerate launch --cpu --num_processes 2` and `--num_processes 2` alone start one process
(accelerate's simple launcher: several CPU processes only through mpirun); a plain `Accelerator()` under torchrun or
`--multi_gpu` trains each process alone (DistributedType.NO), which the recorder refuses in one line.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from parity import launch
from parity import ParityRecorder


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True, help="where loss_<name>.json and the recorded batches go")
    p.add_argument("--name", default="accelerate_loop", help="the record's name: loss_<name>.json")
    p.add_argument("--nproc", type=int, default=1, help="ranks to spawn when no launcher started this process")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps")
    p.add_argument("--batch_size", type=int, default=2, help="rows per rank per micro-batch")
    p.add_argument("--grad_accum_steps", type=int, default=2)
    p.add_argument("--seq_length", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=2)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="Accelerator(mixed_precision=\"bf16\"): autocast over fp32 weights")
    p.add_argument("--fp16", action="store_true", help="Accelerator(mixed_precision=\"fp16\"): autocast(float16) over "
                                                       "fp32 weights and a GradScaler on a GPU; fp32 on a CPU")
    return p.parse_args(argv)


class PaddedSamples(torch.utils.data.Dataset):
    """Random tokens, each sample of its own length, right-padded with 0 (attention mask 0, labels -100 there)."""

    def __init__(self, samples: int, seq_length: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(seq_length // 4, seq_length + 1, (samples,), generator=g)
        self.mask = (torch.arange(seq_length)[None, :] < lengths[:, None]).long()
        self.ids = torch.randint(1, vocab, (samples, seq_length), generator=g) * self.mask

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.ids[i].masked_fill(self.mask[i] == 0, -100)}


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The micro-batch's cross-entropy summed over its loss tokens (each position predicts the next label)."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")


def train(args) -> str | None:
    """The loop, in every process the launcher started. Returns the record's path on rank 0."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin, set_seed
    from transformers import get_scheduler

    from parity import build_model, resolve_model_config

    accum = args.grad_accum_steps
    # cpu=True where there is no GPU: on CPU accelerate forms the launcher's process group (gloo) only when told
    accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=accum, sync_with_dataloader=False), cpu=not torch.cuda.is_available(),
        mixed_precision="bf16" if args.bf16 else "fp16" if args.fp16 else "no")
    set_seed(args.seed)
    model = build_model(resolve_model_config("qwen2-tiny"), args.seed)
    world = accelerator.num_processes
    data = PaddedSamples(args.steps * world * args.batch_size * accum, args.seq_length, model.config.vocab_size,
                         args.seed)
    train_dataloader = torch.utils.data.DataLoader(data, shuffle=True, batch_size=args.batch_size)
    no_decay = ["bias", "norm.weight"]
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ], lr=args.lr)
    # accelerate steps a prepared scheduler once per process at each update: run_clm_no_trainer.py's scaling
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=args.warmup_steps * world,
                                 num_training_steps=args.steps * world)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader,
                                                                           lr_scheduler)
    rec = ParityRecorder(args.output_dir, name=args.name, model=model, optimizer=optimizer,
                         max_grad_norm=args.max_grad_norm,  # its precision: the Accelerator's mixed_precision
                         framework="examples/accelerate_loop.py")
    model.train()
    batches = iter(train_dataloader)
    for _ in range(args.steps):
        step_batches = [next(batches) for _ in range(accum)]
        # the step's loss tokens over every rank and micro-batch: the global token mean's denominator
        tokens = accelerator.reduce(sum((b["labels"][:, 1:] != -100).sum() for b in step_batches), "sum")
        summed_total = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        for batch in step_batches:
            with accelerator.accumulate(model):
                outputs = model(**batch, use_cache=False)
                summed = token_loss_sum(outputs.logits, batch["labels"])
                # accelerator.backward divides by the accumulation steps, DDP averages the ranks: undo both
                loss = summed * world * accum / tokens
                accelerator.backward(loss)
                rec.micro_batch(batch["input_ids"], batch["labels"], outputs.logits,
                                attention_mask=batch["attention_mask"])
                if accelerator.sync_gradients:
                    rec.before_step()  # the pre-clip norm
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            summed_total += summed.detach().double()
        if accelerator.sync_gradients:
            rec.after_step(logged_loss=float(accelerator.reduce(summed_total, "sum") / tokens))
    return rec.close()


def main(argv=None) -> None:
    launch(train, parse_args(argv))


if __name__ == "__main__":
    main()
