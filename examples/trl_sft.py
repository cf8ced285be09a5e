#!/usr/bin/env python
"""TRL's SFTTrainer on a tiny Qwen2 (the harness's qwen2-tiny preset, random weights), recorded for the harness by
Trainer's ParityCallback, which TRL's trainers inherit (docs/own_trainer.md). No hub: the tokenizer is built here
(a word-level `tokenizers` model, then PreTrainedTokenizerFast with eos and pad), the data is a `datasets.Dataset` of
texts of different lengths (SFTTrainer's collator pads them on the right, labels -100 there), per-device batch 2,
2 accumulation steps, fp32 (`bf16=False`; --bf16: Trainer's bf16 autocast). With --packing, TRL packs the texts into rows of --seq_length (its default
'bfd' strategy) and feeds each micro-batch padding-free: its rows as one row, position ids restarting at each text,
no attention mask, use_cache=False — recorded and replayed as fed.

    python examples/trl_sft.py --output_dir OUT --nproc 2        # 2 ranks spawned here (DDP over gloo, CPU)
    torchrun --nproc_per_node 2 examples/trl_sft.py --output_dir OUT
    accelerate launch --multi_gpu --num_processes 2 examples/trl_sft.py --output_dir OUT   # on CPU too (torchrun's)
    python examples/trl_sft.py --output_dir OUT --ray 2          # Ray Train: prepare_trainer, RayTrainReportCallback
    python examples/trl_sft.py --output_dir OUT --nproc 2 --packing
    python train_ddp.py --replay_record OUT/loss_trl_sft.json --num_workers 2 --loss_output_dir OUT \\
        --storage_path OUT/checkpoints
    python plot_loss_curves.py --input_dir OUT --output OUT/curves.png
"""

from __future__ import annotations

import argparse
import os

import torch

from parity import backend, launch
from parity import ParityCallback

WORDS = 500  # the tokenizer's words, besides <pad> (0), <unk> (1) and </s> (2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--name", default="trl_sft")
    p.add_argument("--nproc", type=int, default=1, help="ranks to spawn when not started by a launcher")
    p.add_argument("--ray", type=int, default=0, help="run on this many Ray Train workers (TorchTrainer) instead")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=2, help="rows per rank per micro-batch")
    p.add_argument("--grad_accum_steps", type=int, default=2)
    p.add_argument("--seq_length", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", action="store_true", help="SFTTrainer(peft_config=...): peft's LoRA adapters (r 8, alpha "
                                                       "16, on q_proj and v_proj) on the frozen model")
    p.add_argument("--max_grad_norm", type=float, default=10.0,
                   help="Trainer's clipping; where it does not clip, the recorder measures the pre-clip norm itself")
    p.add_argument("--bf16", action="store_true", help="SFTConfig(bf16=True): Trainer's bf16 (autocast over fp32 weights)")
    p.add_argument("--packing", action="store_true", help="SFTConfig(packing=True): TRL's 'bfd' packing, padding-free")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: one GPU a rank (NCCL; gloo where the ranks share one: PARITY_SHARE_ONE_GPU=1)")
    p.add_argument("--fsdp2", action="store_true", help="accelerate's FSDP2 plugin (GPU only: accelerate picks FSDP "
                                                        "for GPU device types)")
    return p.parse_args(argv)


def local_tokenizer():
    """A word-level tokenizer built here, no hub: `w0 … w499` → ids 3…502, with <pad>, <unk> and eos </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>")


def texts(rows: int, seq_length: int, seed: int) -> list[str]:
    """Random texts of different lengths (a quarter of seq_length to one less than it, in words, eos added by TRL)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_length // 4, seq_length, (rows,), generator=g)
    return [" ".join(f"w{int(w)}" for w in torch.randint(0, WORDS, (int(n),), generator=g)) for n in lengths]


def train(args, ray: bool = False) -> None:
    """One run on every rank: a launcher's environment (torchrun, accelerate, the spawned ranks), or a Ray Train
    worker's (`ray`)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from parity import build_model, resolve_model_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = build_model(resolve_model_config("qwen2-tiny"), args.seed)
    rows = args.steps * world * args.batch_size * args.grad_accum_steps
    data = Dataset.from_dict({"text": texts(rows, args.seq_length, args.seed)})
    config = SFTConfig(
        output_dir=os.path.join(args.output_dir, "trainer"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum_steps, max_steps=args.steps, learning_rate=1e-3,
        warmup_steps=2, weight_decay=0.01, max_grad_norm=args.max_grad_norm, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=args.device == "cpu", ddp_backend=backend(args.device),
        **({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if args.fsdp2 else {}), seed=args.seed,
        data_seed=args.seed, dataloader_num_workers=0, disable_tqdm=True, bf16=args.bf16, max_length=args.seq_length,
        packing=args.packing, dataset_text_field="text")
    lora = None
    if args.lora:  # TRL wraps the model in a PeftModel itself
        from peft import LoraConfig

        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=local_tokenizer(),
                         peft_config=lora,
                         callbacks=[ParityCallback(args.output_dir, name=args.name)])
    if ray:
        from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

        trainer.add_callback(RayTrainReportCallback())
        trainer = prepare_trainer(trainer)
    trainer.train()


def main(argv=None) -> None:
    launch(train, parse_args(argv))


if __name__ == "__main__":
    main()
