#!/usr/bin/env python
"""A hand-written DDP training loop, recorded for the harness (docs/own_trainer.md).

The loop is a user's own: torch DDP over gloo on CPU, a tiny Qwen2 (the harness's qwen2-tiny preset, random weights),
a dataset of right-padded samples of different lengths with an attention mask, read in epochs the way
DistributedSampler and a DataLoader with drop_last=False read it (each rank every world-th sample of a shuffled
epoch, the epoch topped up from its start to a multiple of the ranks, a smaller last micro-batch, a partial last
accumulation window), gradient accumulation under no_sync, AdamW with two parameter groups (no weight decay on biases
and norms, as Hugging Face's Trainer does), a linear warm-up, and clipping. Each window's loss is its global token
mean, whatever its micro-batches hold. The recorder (parity.recording.recorder.ParityRecorder) is five lines of it.
`--fp16` trains it as torch's AMP docs write it: the forward under torch.autocast(float16), the loss scaled by
torch.amp.GradScaler, scaler.unscale_ before the recorder's before_step and the clip, scaler.step, scaler.update.

It checkpoints the way a user's loop does: `--save_at K` writes the model's, the optimizer's and the scheduler's state
dicts and the data position after K steps (torch.save on rank 0) and stops; `--resume_from DIR` restores them and goes
on, the recorder continuing the record from step K (start_step).

    python examples/plain_loop.py --output_dir OUT --nproc 2          # 2 ranks, spawned here (gloo, CPU)
    torchrun --nproc_per_node 2 examples/plain_loop.py --output_dir OUT
    python train_ddp.py --replay_record OUT/loss_plain_loop.json --num_workers 2 --loss_output_dir OUT \\
        --storage_path OUT/checkpoints
    python plot_loss_curves.py --input_dir OUT --output OUT/curves.png    # PASS: the loop trains as DDP does

    python examples/plain_loop.py --output_dir OUT --nproc 2 --save_at 3                        # steps 0-2, checkpoint
    python examples/plain_loop.py --output_dir OUT --nproc 2 --resume_from OUT/checkpoint-3     # steps 3-5: one record
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from parity import agent_store_environment, held_port, rank_device
from parity import ParityRecorder


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True, help="where loss_<name>.json and the recorded batches go")
    p.add_argument("--name", default="plain_loop", help="the record's name: loss_<name>.json")
    p.add_argument("--nproc", type=int, default=1, help="ranks to spawn when not started by torchrun")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=4, help="rows per rank per step (a full window)")
    p.add_argument("--samples", type=int, default=None,
                   help="samples in the dataset (default: every step a full window); others end each epoch in a "
                        "partial window")
    p.add_argument("--grad_accum_steps", type=int, default=2)
    p.add_argument("--seq_length", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model_name", default="qwen2-tiny",
                   help="a built-in model config (parity.models.presets), random weights: e.g. Qwen/Qwen2.5-0.5B's "
                        "widths for benchmark.py --recorder")
    p.add_argument("--model_layers", type=int, default=2, help="the model's decoder layers (its first N)")
    p.add_argument("--bf16", action="store_true", help="the forward under torch.autocast(bfloat16), over fp32 weights")
    p.add_argument("--fp16", action="store_true", help="torch's AMP recipe: the forward under torch.autocast(float16) "
                   "over fp32 weights, the loss scaled by torch.amp.GradScaler")
    p.add_argument("--init_scale", type=float, default=2.0 ** 16, help="with --fp16, GradScaler's init_scale")
    p.add_argument("--growth_interval", type=int, default=2000, help="with --fp16, GradScaler's growth_interval")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the model and batches on the rank's "
                   "GPU (the group stays gloo, which carries DDP's CUDA tensors)")
    p.add_argument("--lora", action="store_true", help="train peft's LoRA adapters (r 8, alpha 16, on q_proj and "
                                                       "v_proj) on the frozen model (docs/own_trainer/techniques.md#lora)")
    p.add_argument("--lora_save", default=None,
                   help="with --lora, modules trained whole beside the adapters (peft's modules_to_save, the tied "
                        "embedding kept tied): embed_tokens,norm,...")
    p.add_argument("--checkpoint_interval", type=int, default=50,
                   help="the recorder saves the run's state around step 0 and every N steps, for the replay's "
                        "teacher-forced check (0: step 0 alone)")
    p.add_argument("--max_state_bytes", type=int, default=None, help="the recorder's cap on the states it saves")
    p.add_argument("--max_batch_bytes", type=int, default=None, help="the recorder's cap on the batches it saves")
    p.add_argument("--dump_step", type=int, default=None,
                   help="record step K in full for compare_dumps.py (docs/own_trainer.md: localising a FAIL)")
    p.add_argument("--save_at", type=int, default=None,
                   help="after K steps write a checkpoint into OUTPUT_DIR/checkpoint-K and stop")
    p.add_argument("--resume_from", default=None, help="a checkpoint folder --save_at wrote: restore it and go on")
    return p.parse_args(argv)


def dataset(rows: int, seq_length: int, vocab: int, seed: int):
    """The samples: random tokens, each row of its own length, right-padded with 0 (attention mask 0, labels -100
    there)."""
    g = torch.Generator().manual_seed(seed * 1_000_003)
    ids = torch.randint(1, vocab, (rows, seq_length), generator=g)
    lengths = torch.randint(seq_length // 4, seq_length + 1, (rows,), generator=g)
    mask = (torch.arange(seq_length)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    return ids, ids.masked_fill(mask == 0, -100), mask


def build(args, shard, optimizer_class=torch.optim.AdamW):
    """The model (random weights, the same on every rank; with --lora a PeftModel: adapters on it, the rest frozen)
    and AdamW in two groups over what trains, with a linear warm-up. `shard`: what wraps or shards the model in place
    once its adapters are in, before the optimizer is built (DDP here, examples/sharded_loop.py's fully_shard), or
    returns the model that replaces it (sharded_loop.py's transformers' TP, which loads it again). `optimizer_class`:
    what steps the groups, called as AdamW is (sharded_loop.py's ZeroRedundancyOptimizer over AdamW)."""
    from parity import build_model, resolve_model_config

    model = build_model(resolve_model_config(args.model_name, args.model_layers), args.seed)
    if args.lora:  # peft's adapters, the model frozen under them
        from peft import LoraConfig, get_peft_model

        saved = args.lora_save.split(",") if args.lora_save else None
        tied = bool({"embed_tokens", "lm_head"} & set(saved or ()))  # qwen2-tiny ties them: one copy trains
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0, task_type="CAUSAL_LM", modules_to_save=saved,
                                                 ensure_weight_tying=tied))
    flat = {n for n, p in model.named_parameters() if p.ndim < 2}  # biases and norms, named before any sharding
    model = shard(model) or model
    decay = [p for n, p in model.named_parameters() if n not in flat and p.requires_grad]
    no_decay = [p for n, p in model.named_parameters() if n in flat and p.requires_grad]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # no empty group (LoRA's adapters have no biases or norms): DeepSpeed 0.19.8's initialize drops it from this
    # optimizer in place, and the scheduler made over it here then fails in engine.step()
    optimizer = optimizer_class([g for g in groups if g["params"]], lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps))
    return model, optimizer, scheduler


def windows(args, rank: int, world: int, samples: int):
    """This rank's accumulation windows, epoch after epoch: lists of micro-batches (lists of sample indices) as
    DistributedSampler(shuffle, drop_last=False) and a DataLoader(batch_size=micro) with drop_last=False give them —
    each rank every world-th index of the epoch's permutation, topped up from its start to a multiple of the ranks —
    grouped `grad_accum_steps` micro-batches at a time, the epoch's last window partial if it must be."""
    micro = args.batch_size // args.grad_accum_steps
    epoch = 0
    while True:
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        order += order[:-samples % world]  # topped up from the epoch's start, as DistributedSampler does
        mine = order[rank::world]
        batches = [mine[i:i + micro] for i in range(0, len(mine), micro)]
        for i in range(0, len(batches), args.grad_accum_steps):
            yield batches[i:i + args.grad_accum_steps]
        epoch += 1


def save_checkpoint(folder: str, model, optimizer, scheduler, step: int) -> None:
    """Rank 0 writes the state dicts and the data position — the steps done: the windows follow from the seed — and
    every rank waits for it."""
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": step}, os.path.join(folder, "checkpoint.pt"))
    dist.barrier()


def restore(folder: str, model, optimizer, scheduler) -> int:
    """Every rank loads the checkpoint save_checkpoint wrote; returns the steps done."""
    state = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True,
                       map_location=next(model.parameters()).device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"]


def train(args) -> str | None:
    """The loop, on every rank of the process group that is up. Returns the record's path on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped = []  # DDP, around the model with its adapters (--lora)
    where = rank_device(args.device)
    model, optimizer, scheduler = build(args, shard=lambda m: wrapped.append(DistributedDataParallel(m.to(where))))
    start = restore(args.resume_from, model, optimizer, scheduler) if args.resume_from else 0
    ddp = wrapped[0]
    rec = ParityRecorder(args.output_dir, name=args.name, model=ddp, optimizer=optimizer,
                         max_grad_norm=args.max_grad_norm, framework="examples/plain_loop.py",
                         precision="bf16" if args.bf16 else "fp16_autocast" if args.fp16 else "fp32",
                         **({"max_batch_bytes": args.max_batch_bytes} if args.max_batch_bytes else {}),
                         **({"max_state_bytes": args.max_state_bytes} if args.max_state_bytes else {}),
                         dump_step=args.dump_step, scheduler=scheduler, start_step=start,
                         checkpoint_interval=args.checkpoint_interval)
    samples = args.samples or args.steps * world * args.batch_size
    all_ids, all_labels, all_mask = (t.to(where) for t in dataset(samples, args.seq_length, model.config.vocab_size,
                                                                 args.seed))
    data = itertools.islice(windows(args, rank, world, samples), start, None)  # the data position restored
    scaler = torch.amp.GradScaler(where.type, init_scale=args.init_scale, growth_interval=args.growth_interval,
                                  enabled=args.fp16)  # a pass-through without --fp16
    half = torch.float16 if args.fp16 else torch.bfloat16
    for step, window in zip(range(start, args.steps), data):
        # the window's loss tokens: each rank's count, summed over the ranks
        local = sum((all_labels[batch][:, 1:] != -100).sum() for batch in window)
        global_tokens = local.clone()
        dist.all_reduce(global_tokens)
        logged = 0.0
        for k, batch in enumerate(window):
            ids, labels, mask = all_ids[batch], all_labels[batch], all_mask[batch]
            with contextlib.nullcontext() if k == len(window) - 1 else ddp.no_sync():
                with torch.autocast(where.type, dtype=half, enabled=args.bf16 or args.fp16):
                    logits = ddp(input_ids=ids, attention_mask=mask, use_cache=False).logits
                summed = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(),
                                         ignore_index=-100, reduction="sum")
                loss = summed * world / global_tokens  # DDP averages over ranks: the global token mean
                scaler.scale(loss).backward()
            rec.micro_batch(ids, labels, logits, attention_mask=mask)
            logged += float(summed.detach())
        logged = torch.tensor(logged, dtype=torch.float64)
        dist.all_reduce(logged)  # the loss the loop logs: the global batch's token mean
        scaler.unscale_(optimizer)
        rec.before_step()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.max_grad_norm)
        scaler.step(optimizer)  # skipped where the gradients hold an inf or a NaN
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        rec.after_step(logged_loss=float(logged / global_tokens))
        if step + 1 == args.save_at:
            save_checkpoint(os.path.join(args.output_dir, f"checkpoint-{step + 1}"), model, optimizer, scheduler,
                            step + 1)
            rec.save()  # the record holds the steps up to the checkpoint: a run killed after it resumes without a gap
            break
    return rec.close()


def _spawned(rank: int, world: int, port: int, args, run=None) -> None:
    os.environ.update(agent_store_environment(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        (run or train)(args)
    finally:
        dist.destroy_process_group()


def launch(args, run=None) -> None:
    """`run(args)` (default: this loop's train) on every rank: in torchrun's group, or on --nproc ranks spawned here
    (gloo, CPU). examples/sharded_loop.py launches its loop with it."""
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            (run or train)(args)
        finally:
            dist.destroy_process_group()
        return
    with held_port() as port:
        torch.multiprocessing.spawn(_spawned, args=(args.nproc, port, args, run), nprocs=args.nproc)


def main(argv=None) -> None:
    launch(parse_args(argv))


if __name__ == "__main__":
    main()
