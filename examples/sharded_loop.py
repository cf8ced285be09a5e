#!/usr/bin/env python
"""examples/plain_loop.py's loop with the model sharded — FSDP2, FSDP1, DeepSpeed ZeRO 1–3 or torch's own ZeRO-1
(DDP with ZeroRedundancyOptimizer) — recorded for the harness (docs/own_trainer.md) and replayed under its DDP, which
trains the same model unsharded.

The same model, data, AdamW groups, warm-up and clipping as plain_loop.py (its build, dataset and windows); what differs is
the sharding and who steps: under FSDP2, FSDP1 and ZeroRedundancyOptimizer the loop clips and steps (the recorder measures the pre-clip norm over the full
gradients), under DeepSpeed `engine.step()` clips and steps (the record keeps DeepSpeed's own pre-clip norm; the loop
calls before_step() before the boundary's engine.step(), where the recorder reads every tensor's gradient from ZeRO's
partitions).

    python examples/sharded_loop.py --shard fsdp2 --output_dir OUT --nproc 2        # or fsdp1, zero0|1|2|3
    python examples/sharded_loop.py --shard fsdp2 --replicate 2 --output_dir OUT --nproc 4   # HSDP (fsdp1: HYBRID_SHARD)
    python examples/sharded_loop.py --shard fsdp2 --mixed_precision fp16 --output_dir OUT --nproc 2   # or bf16; fsdp1
    python examples/sharded_loop.py --shard fsdp1 --sharding_strategy NO_SHARD --output_dir OUT --nproc 2
    python examples/sharded_loop.py --shard zero_redundancy --output_dir OUT --nproc 2   # DDP + ZeroRedundancyOptimizer
    python examples/sharded_loop.py --shard transformers_tp --output_dir OUT --nproc 2   # from_pretrained's own TP
    python examples/sharded_loop.py --shard zero1 --tp 2 --output_dir OUT --nproc 2     # DeepSpeed's AutoTP + ZeRO-1
    python examples/sharded_loop.py --shard zero2 --deepspeed_bf16 --output_dir OUT --nproc 2   # DeepSpeed's bf16
    python examples/sharded_loop.py --shard zero2 --deepspeed_optimizer --output_dir OUT --nproc 2   # its FusedAdam
    python examples/sharded_loop.py --shard zero2 --deepspeed_optimizer --offload_optimizer --output_dir OUT --nproc 2
    python examples/sharded_loop.py --shard zero3 --deepspeed_optimizer --offload_optimizer --offload_param \\
        --output_dir OUT --nproc 2                                                   # ZeRO-3 offload, both
    python train_ddp.py --replay_record OUT/loss_sharded_loop.json --num_workers 2 --loss_output_dir OUT \\
        --storage_path OUT/checkpoints
    python plot_loss_curves.py --input_dir OUT --output OUT/curves.png              # PASS: it trains as DDP does
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel

from parity import ParityRecorder


def _beside(name: str):
    """The example `name`.py in this folder, loaded from its file (the examples are scripts, not a package), under
    sys.modules' `_<name>`: --nproc's spawned ranks find its functions there by name (each imports this script first)."""
    spec = importlib.util.spec_from_file_location(f"_{name}", os.path.join(os.path.dirname(__file__), f"{name}.py"))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plain_loop = _beside("plain_loop")

DEEPSPEED = ("zero0", "zero1", "zero2", "zero3")  # deepspeed.initialize's stages: its engine steps
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --mixed_precision's parameter dtypes
SHARDS = ("fsdp2", "fsdp1", *DEEPSPEED, "transformers_tp", "zero_redundancy")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--shard", choices=SHARDS, default="fsdp2")
    p.add_argument("--tp", type=int, default=1, help="fsdp2: DTensor TP over this many ranks (the harness's plan for "
                                                     "the model), FSDP2 over the 'dp' dim of the ('dp', 'tp') mesh; "
                                                     "zero0|1|2|3: DeepSpeed's AutoTP (autotp_size)")
    p.add_argument("--replicate", type=int, default=1,
                   help="fsdp2: HSDP, FSDP2 over a (replicate, shard) mesh of this many replicas of the shard group; "
                        "fsdp1: HYBRID_SHARD over that mesh")
    p.add_argument("--sharding_strategy", choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                                                   "_HYBRID_SHARD_ZERO2"),
                   help="fsdp1: its ShardingStrategy (default FULL_SHARD; HYBRID_SHARD with --replicate)")
    p.add_argument("--deepspeed_optimizer", action="store_true",
                   help="zero0|1|2|3: DeepSpeed's own AdamW (its FusedAdam) and WarmupLR from the config, as its docs "
                        "write a loop, over the loop's two parameter groups")
    p.add_argument("--offload_optimizer", action="store_true",
                   help="zero1|2|3 with --deepspeed_optimizer: ZeRO-Offload, the optimizer's states and step on the "
                        "CPU (DeepSpeed builds its DeepSpeedCPUAdam from the config's optimizer)")
    p.add_argument("--offload_param", action="store_true",
                   help="zero3: the parameters' partitions on the CPU (offload_param), fetched for each forward and "
                        "backward; with --offload_optimizer as DeepSpeed's and Hugging Face's ZeRO-3 offload configs "
                        "write it")
    p.add_argument("--deepspeed_bf16", action="store_true",
                   help="zero0|1|2|3: DeepSpeed's bf16.enabled — bf16 weights and gradients, fp32 masters and Adam "
                        "state, reduced in bf16 (recorded as the harness's bf16_params policy)")
    p.add_argument("--mixed_precision", choices=("bf16", "fp16"), default=None,
                   help="fsdp2: fully_shard's MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=float32), as "
                        "torchtitan writes it; fsdp1: MixedPrecision(the same); fp16 scales the loss with torch's "
                        "ShardedGradScaler (--init_scale, --growth_interval). The recorder reads the policy: no "
                        "precision told")
    known, rest = p.parse_known_args(argv)
    args = plain_loop.parse_args([*rest, *([] if "--name" in rest else ["--name", "sharded_loop"])])
    args.shard, args.tp, args.deepspeed_bf16 = known.shard, known.tp, known.deepspeed_bf16
    args.deepspeed_optimizer, args.offload_optimizer = known.deepspeed_optimizer, known.offload_optimizer
    args.offload_param = known.offload_param
    args.replicate, args.sharding_strategy = known.replicate, known.sharding_strategy
    args.mixed_precision = known.mixed_precision
    if args.device != "cpu":
        print(f"error: --device {args.device}: sharded_loop.py runs on CPU ranks only (gloo); plain_loop.py takes "
              f"--device cuda", file=sys.stderr)
        raise SystemExit(2)
    if args.tp > 1 and args.shard in ("fsdp1", "transformers_tp", "zero_redundancy"):
        print(f"error: --tp {args.tp} with --shard {args.shard}: --tp is fsdp2's DTensor TP and zero0|1|2|3's AutoTP "
              f"(transformers_tp shards over every rank; zero_redundancy is DDP's)", file=sys.stderr)
        raise SystemExit(2)
    if args.replicate > 1 and (not args.shard.startswith("fsdp") or args.tp > 1):
        print(f"error: --replicate {args.replicate} with --shard {args.shard}{' --tp' if args.tp > 1 else ''}: HSDP "
              f"is fsdp2's and HYBRID_SHARD fsdp1's, without --tp here", file=sys.stderr)
        raise SystemExit(2)
    if args.sharding_strategy and args.shard != "fsdp1":
        print(f"error: --sharding_strategy with --shard {args.shard}: it is FSDP1's; use --shard fsdp1",
              file=sys.stderr)
        raise SystemExit(2)
    if args.offload_optimizer and (args.shard not in DEEPSPEED[1:] or not args.deepspeed_optimizer):
        print(f"error: --offload_optimizer with --shard {args.shard}"
              f"{'' if args.deepspeed_optimizer else ' without --deepspeed_optimizer'}: ZeRO-Offload is ZeRO-1, 2 or "
              f"3's, stepping the DeepSpeedCPUAdam DeepSpeed builds from its config's optimizer; use --shard "
              f"zero1|zero2|zero3 --deepspeed_optimizer", file=sys.stderr)
        raise SystemExit(2)
    if args.offload_param and args.shard != "zero3":
        print(f"error: --offload_param with --shard {args.shard}: parameter offload is ZeRO-3's (stages 1 and 2 "
              f"keep every parameter on each rank); use --shard zero3", file=sys.stderr)
        raise SystemExit(2)
    if args.mixed_precision and (args.shard not in ("fsdp2", "fsdp1") or args.bf16):
        print(f"error: --mixed_precision with --shard {args.shard}{' --bf16' if args.bf16 else ''}: it is fsdp2's "
              f"MixedPrecisionPolicy and fsdp1's MixedPrecision, without autocast", file=sys.stderr)
        raise SystemExit(2)
    if args.fp16:
        print("error: --fp16 is plain_loop.py's AMP recipe: sharded_loop.py trains fp16 under fsdp2 or fsdp1 with "
              "--mixed_precision fp16 (their mixed precision and torch's ShardedGradScaler)",
              file=sys.stderr)
        raise SystemExit(2)
    for flag in ("deepspeed_bf16", "deepspeed_optimizer"):
        if getattr(args, flag) and args.shard not in DEEPSPEED:
            print(f"error: --{flag} with --shard {args.shard}: it is DeepSpeed's setting; use zero0, zero1, zero2 or "
                  f"zero3{' (--bf16: autocast under any shard)' if flag == 'deepspeed_bf16' else ''}", file=sys.stderr)
            raise SystemExit(2)
    return args


def hybrid_mesh(replicate: int):
    """The 2-D (replicate, shard) mesh of HSDP and HYBRID_SHARD: `replicate` copies of a shard group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (replicate, dist.get_world_size() // replicate),
                            mesh_dim_names=("replicate", "shard"))


def fully_shard_layers(model, tp: int = 1, replicate: int = 1, mixed_precision: str | None = None) -> None:
    """FSDP2: one group per decoder layer, then the root (the tied embedding and the final norm; a PeftModel with
    --lora) — over every rank (fully_shard's default mesh), HSDP over a (replicate, shard) mesh, or with `tp` > 1 over
    the 'dp' dim of a ('dp', 'tp') mesh after TP over 'tp' (the harness's plan, which puts each LoRA adapter beside the
    projection it wraps); each in `mixed_precision`'s parameters (bf16 or fp16), reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    half = HALF.get(mixed_precision)
    policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half else MixedPrecisionPolicy()

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel's Hugging Face model
    mesh = hybrid_mesh(replicate) if replicate > 1 else None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from parity import tensor_parallel

        mesh = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
        tensor_parallel(hf, mesh["tp"])
        mesh = mesh["dp"]
    for layer in hf.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def fsdp1(model, wrapped: list, replicate: int = 1, strategy: str | None = None,
          mixed_precision: str | None = None) -> None:
    """FSDP1 around the whole model (one unit, use_orig_params: the optimizer steps the model's own parameters, now
    views of each rank's flat shard) under `strategy` (FULL_SHARD; HYBRID_SHARD where `replicate` > 1), a hybrid one
    over a (replicate, shard) mesh, in `mixed_precision`'s parameters (bf16 or fp16) reduced in fp32; the wrapper
    goes into `wrapped`."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy

    strategy = ShardingStrategy[strategy or ("HYBRID_SHARD" if replicate > 1 else "FULL_SHARD")]
    hybrid = "HYBRID" in strategy.name
    wrapped.append(FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"),
                                            sharding_strategy=strategy, mixed_precision=MixedPrecision(
                                                param_dtype=HALF[mixed_precision], reduce_dtype=torch.float32)
                                            if mixed_precision else None,
                                            **({"device_mesh": hybrid_mesh(replicate)} if hybrid else {})))


def zero_redundancy(groups, lr: float):
    """torch's ZeRO-1 over the loop's AdamW groups: each rank's AdamW steps the parameters it was assigned and holds
    their moments alone, then broadcasts them (ZeroRedundancyOptimizer, as torch's tutorial writes it)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=lr)


def transformers_tp(model):
    """transformers' own tensor parallelism over every rank, as its docs load a model:
    `from_pretrained(folder, distributed_config=DistributedConfig(tp_size=world))`, of the model rank 0 saves to a
    temporary folder every rank reads (one node): the same random weights, now DTensors of the model's TP plan."""
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, DistributedConfig

    folder = [tempfile.mkdtemp(prefix="sharded_loop_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    if dist.get_rank() == 0:
        model.save_pretrained(folder[0])
    dist.barrier()
    try:
        return AutoModelForCausalLM.from_pretrained(
            folder[0], distributed_config=DistributedConfig(tp_size=dist.get_world_size()), dtype=torch.float32)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)


def deepspeed_engine(args, model, optimizer, scheduler):
    """ZeRO stage N over the AdamW and warm-up built as plain_loop.py's; DeepSpeed clips to --max_grad_norm."""
    from parity import import_deepspeed  # on CPU: DeepSpeed's CPU accelerator, no shm op

    deepspeed = import_deepspeed(torch.device("cpu"))
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # DeepSpeed asks for it (torchrun sets it; one node here)
    config = {"train_micro_batch_size_per_gpu": args.batch_size // args.grad_accum_steps,
              "gradient_accumulation_steps": args.grad_accum_steps, "gradient_clipping": args.max_grad_norm,
              "zero_optimization": {"stage": int(args.shard[-1])}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 1 << 30, **({"bf16": {"enabled": True}} if args.deepspeed_bf16 else {}),
              **({"tensor_parallel": {"autotp_size": args.tp}} if args.tp > 1 else {})}  # AutoTP
    if args.offload_optimizer:  # ZeRO-Offload: the optimizer's states and step on the CPU (its DeepSpeedCPUAdam)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if args.offload_param:  # ZeRO-3's parameter partitions on the CPU, fetched for each forward and backward
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if args.deepspeed_optimizer:  # as DeepSpeed's docs write it: its AdamW (FusedAdam) and warm-up from the config
        config["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr}}
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                              "warmup_num_steps": args.warmup_steps,
                                                              "warmup_type": "linear"}}
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        return engine
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def train(args) -> str | None:
    """The loop on every rank of the process group that is up. Returns the record's path on rank 0."""
    fsdp, wrapped = args.shard not in DEEPSPEED, []  # the loop steps (FSDP, TP, DDP), or DeepSpeed's engine does
    tp = dist.get_world_size() if args.shard == "transformers_tp" else args.tp
    dp_rank, dp_world = dist.get_rank() // tp, dist.get_world_size() // tp  # a TP group feeds one DP rank
    shard = {"fsdp2": lambda m: fully_shard_layers(m, args.tp, args.replicate, args.mixed_precision),
             "transformers_tp": transformers_tp,
             "fsdp1": lambda m: fsdp1(m, wrapped, args.replicate, args.sharding_strategy, args.mixed_precision),
             "zero_redundancy": lambda m: wrapped.append(DistributedDataParallel(m))}.get(args.shard)
    model, optimizer, scheduler = plain_loop.build(args, shard=shard if fsdp else lambda m: None,
                                                   optimizer_class=zero_redundancy if args.shard == "zero_redundancy"
                                                   else torch.optim.AdamW)
    engine = wrapped[0] if wrapped else model if fsdp else deepspeed_engine(args, model, optimizer, scheduler)
    rec = ParityRecorder(args.output_dir, name=args.name, model=engine,
                         optimizer=optimizer if fsdp else engine.optimizer, max_grad_norm=args.max_grad_norm,
                         framework=f"examples/sharded_loop.py --shard {args.shard}",
                         precision=None if args.mixed_precision else  # the recorder reads fully_shard's policy
                         "bf16_params" if args.deepspeed_bf16 else "bf16" if args.bf16 else "fp32",
                         checkpoint_interval=args.checkpoint_interval)
    # fp16's loss scaler (a pass-through otherwise): torch's ShardedGradScaler, its infs all-reduced over the ranks
    scaler = ShardedGradScaler("cpu", init_scale=args.init_scale, growth_interval=args.growth_interval,
                               enabled=args.mixed_precision == "fp16")
    samples = args.steps * dp_world * args.batch_size  # full windows: DeepSpeed counts its own accumulation boundary
    all_ids, all_labels, all_mask = plain_loop.dataset(samples, args.seq_length, model.config.vocab_size, args.seed)
    for step, window in zip(range(args.steps), plain_loop.windows(args, dp_rank, dp_world, samples)):
        global_tokens = sum((all_labels[batch][:, 1:] != -100).sum() for batch in window)  # the window's loss tokens
        dist.all_reduce(global_tokens)  # summed over the ranks (a TP group's ranks count once each: ÷ tp)
        global_tokens = global_tokens // tp
        for k, batch in enumerate(window):
            last = k == len(window) - 1
            ids, labels, mask = all_ids[batch], all_labels[batch], all_mask[batch]
            if args.shard == "fsdp2":
                model.set_requires_gradient_sync(last)  # reduce-scatter after the last micro-batch only
            with engine.no_sync() if wrapped and not last else contextlib.nullcontext():  # FSDP1's, DDP's
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                    logits = engine(input_ids=ids, attention_mask=mask, use_cache=False).logits
                summed = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(),
                                         ignore_index=-100, reduction="sum")
                loss = summed * dp_world / global_tokens  # averaged over the DP ranks: the global token mean
                if fsdp:
                    scaler.scale(loss).backward()
            if not fsdp:
                engine.backward(loss, scale_wrt_gas=False)  # the loss is already the global mean
                if last:
                    rec.before_step()  # every tensor's gradient while ZeRO still holds it, before engine.step() clips
                engine.step()  # clips, steps and schedules at the accumulation boundary (the last micro-batch)
            rec.micro_batch(ids, labels, logits, attention_mask=mask)
        if fsdp:
            scaler.unscale_(optimizer)  # the gradients unscaled before they are read and clipped
            rec.before_step()  # the pre-clip norm over the full gradients
            if args.shard == "fsdp1":
                engine.clip_grad_norm_(args.max_grad_norm)  # FSDP1's own, over its shards
            elif tp == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            else:  # torch's refuses DTensors on two meshes (dp × tp and dp) or beside plain tensors (TP alone):
                # the harness's clip across meshes
                from parity import clip_sharded_gradients

                clip_sharded_gradients(model.parameters(), args)  # torch's formula, to args.max_grad_norm
            scaler.step(optimizer)  # skipped where the gradients hold an inf or a NaN
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        rec.after_step()
    return rec.close()


def main(argv=None) -> None:
    plain_loop.launch(parse_args(argv), train)  # plain_loop.py's: torchrun's group, or --nproc ranks spawned here


if __name__ == "__main__":
    main()
