#!/usr/bin/env python
"""A hand-written GRPO loop (DAPO's token-level loss with a KL term), recorded for the harness: the recorder is told
its objective and handed each micro-batch's inputs (docs/posttrain.md#your-own-run-recorded).

The loop is a user's own: torch DDP over gloo on CPU, a tiny Qwen2 (the harness's qwen2-tiny preset, random weights),
real generation (model.generate, sampled; 1 token id in 16 ends a completion, so lengths vary and some are cut at
--max_completion_length), a verifiable reward (the share of even token ids), --num_generations completions a prompt,
each prompt's group on one rank, advantages (r − the group's mean) ÷ (its std + 1e-4), a frozen reference (a copy of the
initial model) for the k3 KL term, micro-batches under no_sync, the DAPO loss normalised by the step's completion
tokens over every rank, AdamW, clipping. The recorder is its ParityRecorder(objective="dapo", objective_args=...) and
one objective_batch() per micro-batch.

    python examples/grpo_loop.py --output_dir OUT --nproc 2          # 2 ranks, spawned here (gloo, CPU)
    torchrun --nproc_per_node 2 examples/grpo_loop.py --output_dir OUT
    python verify_trainer.py --output_dir OUT2 -- python examples/grpo_loop.py --output_dir RUN --nproc 2
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from parity import launch
from parity import ParityRecorder

STOP_EVERY = 16  # ids 0, 16, 32, … end a completion


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--name", default="grpo_loop")
    p.add_argument("--nproc", type=int, default=1, help="ranks to spawn when not started by torchrun")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2, help="prompts a rank a step")
    p.add_argument("--num_generations", type=int, default=2)
    p.add_argument("--grad_accum_steps", type=int, default=2)
    p.add_argument("--prompt_length", type=int, default=4)
    p.add_argument("--max_completion_length", type=int, default=8)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--epsilon", type=float, default=0.2)
    p.add_argument("--epsilon_high", type=float, default=0.28)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def token_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log π of each next token [rows, L − 1]: the logits at t score the token at t + 1."""
    return logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def rollouts(model, reference, prompts: torch.Tensor, args, seed: int) -> dict:
    """Each prompt's completions, right-padded after the prompt, with their masks, truncation, rewards and group
    advantages, and the reference's log-probs of every token at its position."""
    torch.manual_seed(seed)
    g, limit, vocab = args.num_generations, args.max_completion_length, model.config.vocab_size
    stops = list(range(0, vocab, STOP_EVERY))
    with torch.no_grad():
        out = model.generate(prompts.repeat_interleave(g, 0), do_sample=True, top_k=0, top_p=1.0,
                             max_new_tokens=limit, eos_token_id=stops, pad_token_id=0,
                             attention_mask=torch.ones(len(prompts) * g, prompts.shape[1], dtype=torch.long))
    completion = out[:, prompts.shape[1]:]
    is_stop = torch.isin(completion, torch.tensor(stops))
    ends = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, completion.shape[1])
    keep = torch.arange(completion.shape[1])[None] < ends[:, None]
    ids = torch.cat([out[:, :prompts.shape[1]], completion * keep], 1)
    mask = torch.cat([torch.ones_like(out[:, :prompts.shape[1]]), keep.long()], 1)
    completion_mask = torch.cat([torch.zeros_like(out[:, :prompts.shape[1]]), keep.long()], 1)
    rewards = ((completion % 2 == 0) & keep).sum(1) / ends
    grouped = rewards.view(-1, g)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    with torch.no_grad():
        ref = token_log_probs(reference(input_ids=ids, attention_mask=mask).logits, ids)
    return {"ids": ids, "mask": mask, "completion_mask": completion_mask, "truncated": ~is_stop.any(1),
            "advantages": advantages.float(), "ref_logps": torch.cat([torch.zeros(len(ids), 1), ref], 1)}


def train(args, ray: bool = False) -> str | None:
    from parity import build_model, resolve_model_config

    own = not dist.is_initialized()  # (a launcher's variables: torchrun, or the ranks spawned by launch())
    if own:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(resolve_model_config("qwen2-tiny"), args.seed)
    reference = copy.deepcopy(model).eval()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rec = ParityRecorder(args.output_dir, name=args.name, model=ddp, optimizer=optimizer,
                         max_grad_norm=args.max_grad_norm, objective="dapo",
                         objective_args={"beta": args.beta, "epsilon": args.epsilon,
                                         "epsilon_high": args.epsilon_high})
    vocab = model.config.vocab_size
    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1000 + step)  # the step's prompts, alike on every rank
        prompts = torch.randint(1, vocab, (world * args.prompts, args.prompt_length), generator=g)
        mine = rollouts(model, reference, prompts[rank * args.prompts:(rank + 1) * args.prompts], args,
                        seed=args.seed * 1000 + step * world + rank)
        counted = mine["completion_mask"][:, 1:].sum()
        global_tokens = counted.clone()
        dist.all_reduce(global_tokens)  # DAPO: the step's completion tokens over every rank
        rows, logged = len(mine["ids"]), 0.0
        size = rows // args.grad_accum_steps
        for k in range(args.grad_accum_steps):
            part = {key: value[k * size:(k + 1) * size] for key, value in mine.items()}
            last = k == args.grad_accum_steps - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                logits = ddp(input_ids=part["ids"], attention_mask=part["mask"], use_cache=False).logits
                logp = token_log_probs(logits, part["ids"])
                ratio = torch.exp(logp - logp.detach())  # on-policy: π_old is π, detached
                a = part["advantages"][:, None]
                surrogate = -torch.min(ratio * a, ratio.clamp(1 - args.epsilon, 1 + args.epsilon_high) * a)
                gap = part["ref_logps"][:, 1:] - logp
                kl = (torch.exp(gap) - gap - 1) * ratio  # k3, bias-corrected
                m = part["completion_mask"][:, 1:]
                summed = ((surrogate + args.beta * kl) * m).sum()
                (summed * world / global_tokens).backward()  # DDP averages the ranks: the step's token sum ÷ its tokens
            rec.objective_batch(part["ids"], logits, completion_mask=part["completion_mask"],
                                attention_mask=part["mask"], advantages=part["advantages"],
                                ref_logps=part["ref_logps"], truncated=part["truncated"],
                                group=torch.arange(rank * args.prompts, (rank + 1) * args.prompts).repeat_interleave(
                                    args.num_generations)[k * size:(k + 1) * size])
            logged += float(summed.detach())
        logged = torch.tensor(logged, dtype=torch.float64)
        dist.all_reduce(logged)
        rec.before_step()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rec.after_step(logged_loss=float(logged / global_tokens))
    path = rec.close()
    if own:
        dist.destroy_process_group()
    return path


def main(argv=None) -> None:
    launch(train, parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
