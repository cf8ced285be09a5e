#!/usr/bin/env python
"""Hugging Face's Trainer on a tiny Qwen2 (the harness's qwen2-tiny preset, random weights), padded data with an
attention mask and gradient accumulation, recorded for the harness by ParityCallback (docs/own_trainer.md).

    python examples/hf_trainer.py --output_dir OUT --nproc 2        # 2 ranks spawned here (DDP over gloo, CPU)
    torchrun --nproc_per_node 2 examples/hf_trainer.py --output_dir OUT
    python train_ddp.py --replay_record OUT/loss_hf_trainer.json --num_workers 2 --loss_output_dir OUT \\
        --storage_path OUT/checkpoints
    python plot_loss_curves.py --input_dir OUT --output OUT/curves.png

Padding-free: each micro-batch's rows flattened into one row by transformers' DataCollatorWithFlattening (each row's
position ids from 0, its first label -100, no attention mask), recorded and replayed as fed:

    python examples/hf_trainer.py --output_dir OUT --nproc 2 --padding_free

Stopped after a checkpoint and resumed from it (the recorder continues its record from the checkpoint's step):

    python examples/hf_trainer.py --output_dir OUT --nproc 2 --save_at 3
    python examples/hf_trainer.py --output_dir OUT --nproc 2 --resume_from_checkpoint OUT/trainer/checkpoint-3
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import TrainerCallback

from parity import backend, launch
from parity import ParityCallback

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --model_dtype


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--name", default="hf_trainer")
    p.add_argument("--nproc", type=int, default=1, help="ranks to spawn when not started by torchrun")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=2, help="rows per rank per micro-batch")
    p.add_argument("--grad_accum_steps", type=int, default=2)
    p.add_argument("--seq_length", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model_path", default=None,
                   help="a Hugging Face model folder to train, loaded with from_pretrained (default: qwen2-tiny, "
                        "random weights)")
    p.add_argument("--model_name", default="qwen2-tiny", help="without --model_path: a built-in model config, random "
                                                               "weights")
    p.add_argument("--model_layers", type=int, default=None, help="its decoder layers (default: the config's)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU a rank (NCCL; gloo where "
                   "the ranks share one: PARITY_SHARE_ONE_GPU=1)")
    p.add_argument("--bf16", action="store_true", help="Trainer's bf16 (autocast over fp32 weights)")
    p.add_argument("--fp16", action="store_true", help="Trainer's fp16 (autocast over fp32 weights, accelerate's "
                                                       "GradScaler)")
    p.add_argument("--lora", action="store_true", help="train peft's LoRA adapters (r 8, alpha 16, on q_proj and "
                                                       "v_proj) on the frozen model (docs/own_trainer/techniques.md#lora)")
    p.add_argument("--model_dtype", default="fp32", choices=("fp32", "bf16"),
                   help="the dtype the model is loaded in (from_pretrained's dtype); bf16 with --lora: peft's fp32 "
                        "adapters over a bf16 base (docs/precision.md#bf16_base-loras-fp32-adapters-over-a-bf16-base)")
    p.add_argument("--rows", type=int, default=None,
                   help="samples in the dataset (default: every step a full window); others end each epoch in a "
                        "partial accumulation window and, with drop_last off, a smaller last batch")
    p.add_argument("--dynamic_padding", action="store_true",
                   help="pad each batch to its own longest row (a collator), not every row to --seq_length")
    p.add_argument("--padding_free", action="store_true",
                   help="each micro-batch's rows as one row: transformers' DataCollatorWithFlattening (position ids, "
                        "no mask)")
    p.add_argument("--drop_last", action="store_true", help="TrainingArguments(dataloader_drop_last=True)")
    p.add_argument("--dump_step", type=int, default=None,
                   help="record step K in full for compare_dumps.py (docs/own_trainer.md: localising a FAIL)")
    p.add_argument("--max_grad_norm", type=float, default=10.0,
                   help="Trainer's clipping; where it does not clip, the recorder measures the pre-clip norm itself in "
                        "float64, else it records Trainer's fp32 value (docs/own_trainer.md)")
    p.add_argument("--save_at", type=int, default=None,
                   help="save Trainer's checkpoint at step K (OUTPUT_DIR/trainer/checkpoint-K) and stop there")
    p.add_argument("--resume_from_checkpoint", default=None, help="trainer.train(resume_from_checkpoint=...)")
    p.add_argument("--checkpoint_interval", type=int, default=50,
                   help="the callback saves the run's state around step 0 and every N steps, for the replay's "
                        "teacher-forced check (0: step 0 alone)")
    return p.parse_args(argv)


class StopAt(TrainerCallback):
    """Stops the run at step K, after the checkpoint save_steps=K has Trainer save there (Trainer saves after
    on_step_end, then leaves its loop): the run max_steps declares, stopped — its schedule is the full run's."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop |= state.global_step == self.step


class PaddedRows(torch.utils.data.Dataset):
    """Random tokens, each row of its own length, right-padded with 0 (attention mask 0, labels -100 there)."""

    def __init__(self, rows: int, seq_length: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, vocab, (rows, seq_length), generator=g)
        lengths = torch.randint(seq_length // 4, seq_length + 1, (rows,), generator=g)
        self.mask = (torch.arange(seq_length)[None, :] < lengths[:, None]).long()
        self.ids = ids * self.mask
        self.labels = self.ids.masked_fill(self.mask == 0, -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class Unpadded(PaddedRows):
    """The same rows without their padding: each sample as long as it is (a collator pads a batch)."""

    def __getitem__(self, i: int) -> dict:
        n = int(self.mask[i].sum())
        return {"input_ids": self.ids[i, :n], "attention_mask": self.mask[i, :n], "labels": self.labels[i, :n]}


def pad_to_longest(samples: list[dict]) -> dict:
    """Dynamic padding: a batch right-padded to its own longest row (ids 0, mask 0, labels -100)."""
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {key: torch.nn.utils.rnn.pad_sequence([s[key] for s in samples], batch_first=True, padding_value=value)
            for key, value in fill.items()}


def train(args) -> None:
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from parity import build_model, resolve_model_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.model_path:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=DTYPES[args.model_dtype])
    else:
        model = build_model(resolve_model_config(args.model_name, args.model_layers), args.seed).to(
            DTYPES[args.model_dtype])
    if args.lora:  # a PeftModel: Trainer's optimizer takes what requires gradients, the adapters
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
    rows = args.rows or args.steps * world * args.batch_size * args.grad_accum_steps
    data = (Unpadded if args.dynamic_padding or args.padding_free else PaddedRows)(
        rows, args.seq_length, model.config.vocab_size, args.seed)
    training = TrainingArguments(
        output_dir=os.path.join(args.output_dir, "trainer"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum_steps, max_steps=args.steps, learning_rate=1e-3,
        warmup_steps=2, weight_decay=0.01, max_grad_norm=args.max_grad_norm, logging_steps=1, report_to=[],
        fp16=args.fp16,
        **({"save_strategy": "steps", "save_steps": args.save_at} if args.save_at else {"save_strategy": "no"}),
        use_cpu=args.device == "cpu", ddp_backend=backend(args.device), seed=args.seed, data_seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=True, bf16=args.bf16, dataloader_drop_last=args.drop_last)
    trainer = Trainer(model=model, args=training, train_dataset=data,
                      data_collator=(DataCollatorWithFlattening() if args.padding_free else
                                     pad_to_longest if args.dynamic_padding else None),
                      callbacks=[ParityCallback(args.output_dir, name=args.name, dump_step=args.dump_step,
                                                checkpoint_interval=args.checkpoint_interval),
                                 *([StopAt(args.save_at)] if args.save_at else [])])
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)


def main(argv=None) -> None:
    launch(train, parse_args(argv))


if __name__ == "__main__":
    main()
