#!/usr/bin/env python
"""examples/plain_loop.py's loop with the model sharded — FSDP2, FSDP1 or DeepSpeed ZeRO 1–3 — recorded for the
harness (docs/own_trainer.md) and replayed under its DDP, which trains the same model unsharded.

The same model, data, AdamW groups, warm-up and clipping as plain_loop.py (its build and global_rows); what differs is
the sharding and who steps: under FSDP2 and FSDP1 the loop clips and steps (the recorder measures the pre-clip norm over the full
gradients), under DeepSpeed `engine.step()` clips and steps (the record keeps DeepSpeed's own pre-clip norm).

    python examples/sharded_loop.py --shard fsdp2 --output_dir OUT --nproc 2        # or fsdp1, zero1, zero2, zero3
    python train_ddp.py --replay_record OUT/loss_sharded_loop.json --num_workers 2 --loss_output_dir OUT \\
        --storage_path OUT/checkpoints
    python plot_loss_curves.py --input_dir OUT --output OUT/curves.png              # PASS: it trains as DDP does
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain_loop import build, global_rows, launch  # noqa: E402  (the example beside this one)
from plain_loop import parse_args as plain_args  # noqa: E402

from parity.integrations.recorder import ParityRecorder  # noqa: E402

SHARDS = ("fsdp2", "fsdp1", "zero1", "zero2", "zero3")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--shard", choices=SHARDS, default="fsdp2")
    p.add_argument("--tp", type=int, default=1, help="fsdp2: DTensor TP over this many ranks (the harness's plan for "
                                                     "the model), FSDP2 over the 'dp' dim of the ('dp', 'tp') mesh")
    known, rest = p.parse_known_args(argv)
    args = plain_args([*rest, *([] if "--name" in rest else ["--name", "sharded_loop"])])
    args.shard, args.tp = known.shard, known.tp
    return args


def fully_shard_layers(model, tp: int = 1) -> None:
    """FSDP2: one group per decoder layer, then the root (the tied embedding and the final norm) — over every rank
    (fully_shard's default mesh), or with `tp` > 1 over the 'dp' dim of a ('dp', 'tp') mesh after TP over 'tp'."""
    from torch.distributed.fsdp import fully_shard

    mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from parity.models.families import family_of
        from parity.strategies.fsdp.plans import apply_tp, tp_plan

        mesh = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
        apply_tp(model, mesh["tp"], tp_plan(family_of(model.config), False))
        mesh = mesh["dp"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def fsdp1(model, wrapped: list) -> None:
    """FSDP1 around the whole model (one unit, use_orig_params: the optimizer steps the model's own parameters, now
    views of each rank's flat shard); the wrapper goes into `wrapped`."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped.append(FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu")))


def deepspeed_engine(args, model, optimizer, scheduler):
    """ZeRO stage N over the AdamW and warm-up built as plain_loop.py's; DeepSpeed clips to --max_grad_norm."""
    from parity.strategies.autotp.library import import_deepspeed  # on CPU: DeepSpeed's CPU accelerator, no shm op

    deepspeed = import_deepspeed(torch.device("cpu"))
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # DeepSpeed asks for it (torchrun sets it; one node here)
    config = {"train_micro_batch_size_per_gpu": args.batch_size // args.grad_accum_steps,
              "gradient_accumulation_steps": args.grad_accum_steps, "gradient_clipping": args.max_grad_norm,
              "zero_optimization": {"stage": int(args.shard[-1])}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def train(args) -> str | None:
    """The loop on every rank of the process group that is up. Returns the record's path on rank 0."""
    fsdp, wrapped = args.shard.startswith("fsdp"), []  # the loop steps (FSDP), or DeepSpeed's engine does
    dp_rank, dp_world = dist.get_rank() // args.tp, dist.get_world_size() // args.tp  # a TP group feeds one DP rank
    shard = (lambda m: fully_shard_layers(m, args.tp)) if args.shard == "fsdp2" else (lambda m: fsdp1(m, wrapped))
    model, optimizer, scheduler = build(args, shard=shard if fsdp else None)
    engine = wrapped[0] if wrapped else model if fsdp else deepspeed_engine(args, model, optimizer, scheduler)
    rec = ParityRecorder(args.output_dir, name=args.name, model=engine,
                         optimizer=optimizer if fsdp else engine.optimizer, max_grad_norm=args.max_grad_norm,
                         framework=f"examples/sharded_loop.py --shard {args.shard}")
    b, accum = args.batch_size, args.grad_accum_steps
    m = b // accum
    for step in range(args.steps):
        ids, labels, mask = global_rows(step, dp_world * b, args.seq_length, model.config.vocab_size, args.seed)
        global_tokens = (labels[:, 1:] != -100).sum()  # the global batch's loss tokens
        mine = slice(dp_rank * b, (dp_rank + 1) * b)  # this DP rank's rows
        ids, labels, mask = ids[mine], labels[mine], mask[mine]
        for k in range(accum):
            micro = slice(k * m, (k + 1) * m)
            if args.shard == "fsdp2":
                model.set_requires_gradient_sync(k == accum - 1)  # reduce-scatter after the last micro-batch only
            with engine.no_sync() if wrapped and k < accum - 1 else contextlib.nullcontext():  # FSDP1's
                logits = engine(input_ids=ids[micro], attention_mask=mask[micro], use_cache=False).logits
                summed = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[micro][:, 1:].flatten(),
                                         ignore_index=-100, reduction="sum")
                loss = summed * dp_world / global_tokens  # averaged over the DP ranks: the global token mean
                if fsdp:
                    loss.backward()
            if not fsdp:
                engine.backward(loss, scale_wrt_gas=False)  # the loss is already the global mean
                engine.step()  # clips, steps and schedules at the accumulation boundary (the last micro-batch)
            rec.micro_batch(ids[micro], labels[micro], logits, attention_mask=mask[micro])
        if fsdp:
            rec.before_step()  # the pre-clip norm over the full gradients
            if wrapped:
                engine.clip_grad_norm_(args.max_grad_norm)  # FSDP1's own, over its shards
            elif args.tp == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            else:  # torch's refuses DTensors on two meshes (dp × tp and dp): the harness's clip across meshes
                from parity.training.dtensor_strategy import clip_sharded_gradients

                clip_sharded_gradients(model.parameters(), args)  # torch's formula, to args.max_grad_norm
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        rec.after_step()
    return rec.close()


def main(argv=None) -> None:
    launch(parse_args(argv), train)  # plain_loop.py's: torchrun's group, or --nproc ranks spawned here


if __name__ == "__main__":
    main()
