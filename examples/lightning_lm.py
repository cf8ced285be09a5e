#!/usr/bin/env python
"""Lightning's Trainer on a tiny Qwen2 (the harness's qwen2-tiny preset, random weights), padded data with an attention
mask and gradient accumulation under DDP, recorded for the harness by parity's ParityLightningCallback (docs/own_trainer.md).

    python examples/lightning_lm.py --output_dir OUT --nproc 2     # 2 ranks spawned here (DDP over gloo, CPU)
    torchrun --nproc_per_node 2 examples/lightning_lm.py --output_dir OUT
    python examples/lightning_lm.py --output_dir OUT --ray 2       # Ray Train: RayDDPStrategy, RayLightningEnvironment
    python examples/lightning_lm.py --output_dir OUT --nproc 2 --manual --static_graph   # manual optimization
    python train_ddp.py --replay_record OUT/loss_lightning_lm.json --num_workers 2 --loss_output_dir OUT \\
        --storage_path OUT/checkpoints
    python plot_loss_curves.py --input_dir OUT --output OUT/curves.png

Lightning's accumulation divides each micro-batch's loss by `accumulate_grad_batches`, and DDP averages the ranks'
gradients: a per-micro-batch mean loss (the Hugging Face model's own `.loss`) would train on the mean of micro-batch
means, not the global batch's token mean, on padded data. So each micro-batch here carries its optimizer step's global
loss tokens (counted when the data is built, as Trainer's `num_items_in_batch` is), and the loss is the token sum
scaled to undo both averages.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from parity import launch
from parity import ParityLightningCallback


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--name", default="lightning_lm")
    p.add_argument("--nproc", type=int, default=1, help="ranks to spawn when not started by torchrun")
    p.add_argument("--ray", type=int, default=0, help="run on this many Ray Train workers (TorchTrainer) instead")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=2, help="rows per rank per micro-batch")
    p.add_argument("--grad_accum_steps", type=int, default=2)
    p.add_argument("--micro_batches", type=int, default=None,
                   help="micro-batches a rank in an epoch (default: every step a full window); others end each epoch in "
                        "a partial accumulation window")
    p.add_argument("--seq_length", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model_name", default="qwen2-tiny", help="a built-in model config, random weights")
    p.add_argument("--model_layers", type=int, default=2, help="the model's decoder layers (its first N)")
    p.add_argument("--lora", action="store_true", help="train peft's LoRA adapters (r 8, alpha 16, on q_proj and "
                                                       "v_proj) on the frozen model (docs/own_trainer/techniques.md#lora)")
    p.add_argument("--strategy", default="ddp", choices=("ddp", "model_parallel", "fsdp"),
                   help="Lightning's strategy: ddp; model_parallel (FSDP2 over its data-parallel dim: CPU or GPU); "
                        "fsdp (GPU only: Lightning refuses it on CPU)")
    p.add_argument("--bf16", action="store_true", help="Trainer(precision=\"bf16-mixed\"): autocast over fp32 weights")
    p.add_argument("--fp16", action="store_true", help="Trainer(precision=\"16-mixed\"): autocast(float16) over fp32 "
                                                       "weights, Lightning's GradScaler")
    p.add_argument("--manual", action="store_true", help="manual optimization (automatic_optimization = False): the "
                                                         "module's own manual_backward, clip_gradients and opt.step()")
    p.add_argument("--static_graph", action="store_true", help="DDP with static_graph=True")
    p.add_argument("--no_record", action="store_true", help="train without the callback (the bare step: to time the "
                                                            "recorder's cost)")
    p.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"), help="gpu: one GPU a rank (NCCL)")
    return p.parse_args(argv)


class MicroBatches(torch.utils.data.Dataset):
    """This rank's micro-batches of an epoch in order (window w's rows over every rank in order, rank r's at its r-th
    share, micro-batch k its k-th slice): random tokens, each row of its own length, right-padded with 0 (mask 0,
    labels -100 there). An epoch of `--micro_batches` micro-batches a rank (default: every step a full window) ends in
    a partial window where accumulation does not divide it. Each micro-batch carries `step_tokens`: its window's loss
    tokens over every rank and micro-batch."""

    def __init__(self, args, rank: int, world: int, vocab: int):
        b, accum, length = args.batch_size, args.grad_accum_steps, args.seq_length
        micro = args.micro_batches or args.steps * accum
        g = torch.Generator().manual_seed(args.seed)
        rows = micro * world * b
        ids = torch.randint(1, vocab, (rows, length), generator=g)
        lengths = torch.randint(length // 4, length + 1, (rows,), generator=g)
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        ids = ids * mask
        labels = ids.masked_fill(mask == 0, -100)
        self.items = []
        for first in range(0, micro, accum):
            window = min(accum, micro - first)  # micro-batches in this window: the epoch's last may hold fewer
            start, per_rank = first * world * b, window * b
            rows_of_window = slice(start, start + world * per_rank)
            tokens = int((labels[rows_of_window, 1:] != -100).sum())
            mine = start + rank * per_rank
            for k in range(window):
                part = slice(mine + k * b, mine + (k + 1) * b)
                self.items.append({"input_ids": ids[part], "attention_mask": mask[part], "labels": labels[part],
                                   "step_tokens": torch.tensor(tokens)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def module_class():
    import lightning.pytorch as pl

    class CausalLM(pl.LightningModule):
        """A Hugging Face causal LM, AdamW in Trainer's two groups (no decay on biases and norms), warm-up."""

        def __init__(self, model, args, world: int):
            super().__init__()
            self.model, self.args, self.world = model, args, world
            self.automatic_optimization = not args.manual

        def training_step(self, batch, batch_idx):
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             labels=batch["labels"], use_cache=False)
            summed = F.cross_entropy(out.logits[:, :-1].float().flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                     ignore_index=-100, reduction="sum")
            if self.args.manual:
                return self.manual_step(summed * self.world / batch["step_tokens"], batch_idx)
            # Lightning divides by accumulate_grad_batches, DDP averages over ranks: undo both for the global token mean
            loss = summed * self.world * self.args.grad_accum_steps / batch["step_tokens"]
            return loss

        def manual_step(self, loss, batch_idx):
            """Manual optimization: backward each micro-batch (DDP averages over ranks: the loss undoes it), and at
            the window's last one clip, step, zero and advance the schedule."""
            opt = self.optimizers()
            self.manual_backward(loss)
            if (batch_idx + 1) % self.args.grad_accum_steps == 0:
                if self.args.max_grad_norm:
                    self.clip_gradients(opt, gradient_clip_val=self.args.max_grad_norm, gradient_clip_algorithm="norm")
                opt.step()
                opt.zero_grad()
                self.lr_schedulers().step()
            return loss.detach()  # its window's sum over micro-batches, averaged over ranks: the global token mean

        def configure_model(self):
            """Under ModelParallelStrategy: FSDP2 over its data-parallel mesh (each decoder layer, then the whole)."""
            mesh = getattr(self, "device_mesh", None)
            if mesh is None or self.args.strategy != "model_parallel":
                return
            from torch.distributed.fsdp import fully_shard

            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh["data_parallel"])
            fully_shard(self.model, mesh=mesh["data_parallel"])

        def configure_optimizers(self):
            decay = [p for p in self.model.parameters() if p.ndim >= 2]
            no_decay = [p for p in self.model.parameters() if p.ndim < 2]
            optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                           {"params": no_decay, "weight_decay": 0.0}], lr=self.args.lr)
            warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    return CausalLM


def train(args, ray: bool = False) -> None:
    """One run on every rank: torchrun's (or the spawned ranks') environment, or a Ray Train worker's (`ray`)."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    from parity import build_model, resolve_model_config

    up = dist.is_initialized()  # a group already up (Ray's): Lightning's own environment deletes WORLD_SIZE at teardown
    world = dist.get_world_size() if up else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if up else int(os.environ.get("RANK", "0"))
    model = build_model(resolve_model_config(args.model_name, args.model_layers), args.seed)
    if args.lora:  # a PeftModel in the module; its optimizer over every parameter steps the adapters alone
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
    data = torch.utils.data.DataLoader(MicroBatches(args, rank, world, model.config.vocab_size), batch_size=None)
    if ray:
        from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

        strategy, plugins = RayDDPStrategy(process_group_backend="gloo"), [RayLightningEnvironment()]
    elif args.strategy == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # its default on one node is tensor parallel over every device (dp 1): here FSDP2 over all of them
        strategy, plugins = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), []
    elif args.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        strategy, plugins = FSDPStrategy(), []
    else:
        from lightning.pytorch.strategies import DDPStrategy

        strategy, plugins = DDPStrategy(process_group_backend="gloo" if args.accelerator == "cpu" else "nccl",
                                        static_graph=args.static_graph), []
    automatic = not args.manual  # manual optimization accumulates and clips in its training_step
    trainer = pl.Trainer(accelerator=args.accelerator, devices="auto" if ray else world, strategy=strategy,
                         plugins=plugins, max_steps=args.steps,
                         precision="bf16-mixed" if args.bf16 else "16-mixed" if args.fp16 else "32-true",
                         accumulate_grad_batches=args.grad_accum_steps if automatic else 1,
                         # Lightning's FSDPPrecision refuses clipping by norm: FSDP runs unclipped
                         gradient_clip_val=None if args.strategy == "fsdp" or not automatic else args.max_grad_norm,
                         use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[] if args.no_record else [ParityLightningCallback(args.output_dir, name=args.name)])
    if ray:
        trainer = prepare_trainer(trainer)
    trainer.fit(module_class()(model, args, world), data)


def main(argv=None) -> None:
    launch(train, parse_args(argv))


if __name__ == "__main__":
    main()
