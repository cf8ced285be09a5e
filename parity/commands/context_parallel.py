"""check_context_parallel.py: does torch's context parallelism (ring attention over a "cp" mesh) train the same
model here? One forward and backward of the model on one batch, once on the whole sequence in one process and
once with the sequence split over --cp_size ranks under torch.distributed.tensor.experimental.context_parallel;
the loss and every parameter gradient compared.

Under context parallelism each rank holds a chunk of the sequence (head-tail load-balanced): its token ids, its
position ids and its targets (the labels shifted by one on the whole sequence first, so no target is lost at a
chunk's edge), and SDPA becomes ring attention, passing key/value chunks around the ranks. Each rank's loss is
its tokens' sum; summed over the ranks and divided by the whole batch's tokens it is the full run's mean, and the
gradients summed over the ranks are the full run's.

On CPU this fails, in torch itself: the ring handlers exist only for the CUDA SDPA kernels (flash, efficient,
cuDNN); CPU SDPA dispatches aten._scaled_dot_product_flash_attention_for_cpu, for which DTensor has no sharding
rule, and the math backend mixes the plain causal mask with DTensor scores (docs/context_parallel.md). The
command then says so in one line and exits 1.
"""

from __future__ import annotations

import os
import socket
import traceback

from parity.commands.common import OneLineParser, run_command
from parity.errors import ConfigError
from parity.driver.config import DEVICES

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4  # fp32: a different reduction order of the attention's softmax sums


def build_parser(description: str = "") -> OneLineParser:
    p = OneLineParser(description)
    p.add_argument("--cp_size", type=int, default=2, help="ranks the sequence is split over (one per GPU)")
    p.add_argument("--model_name", default="qwen2-tiny")
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--seq_length", type=int, default=128, help="a multiple of 2 × cp_size (head-tail load balancing)")
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--device", choices=DEVICES, default="auto", help="auto: cuda when there are cp_size GPUs")
    p.add_argument("--seed", type=int, default=42)
    return p


def check(args) -> int:
    import torch
    import torch.multiprocessing as mp

    if args.cp_size < 2:
        raise ConfigError(f"--cp_size {args.cp_size}: context parallelism splits the sequence over at least 2 ranks: "
                          f"use --cp_size 2 or more")
    if args.seq_length % (2 * args.cp_size):
        raise ConfigError(f"--seq_length {args.seq_length} is not a multiple of 2 × --cp_size ({2 * args.cp_size}): "
                          f"the load balancer gives each rank a head and a tail chunk")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.device_count() >= args.cp_size)
    if cuda and torch.cuda.device_count() < args.cp_size:
        raise ConfigError(f"--device cuda needs {args.cp_size} GPUs (one per CP rank), this machine has "
                          f"{torch.cuda.device_count()}: use --device cpu or a smaller --cp_size")
    from parity.models.model import resolve_model_config

    config = resolve_model_config(args.model_name, args.num_layers)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(args.cp_size, port, "cuda" if cuda else "cpu", config, vars(args), results),
             nprocs=args.cp_size)
    result = results.get()
    where = f"{args.cp_size} {'GPUs' if cuda else 'CPU processes'} ({'nccl' if cuda else 'gloo'})"
    if "error" in result:
        print(f"context parallelism failed on {where}: {result['error']}")
        return 1
    ok = result["loss_rel"] <= LOSS_RTOL and result["grad_rel"] <= GRAD_RTOL
    print(f"context parallelism on {where}: {'PASS' if ok else 'FAIL'} — loss {result['loss']:.8f} vs "
          f"{result['reference_loss']:.8f} (rel. {result['loss_rel']:.1e}, tolerance {LOSS_RTOL:.0e}); worst "
          f"gradient {result['worst']} rel. {result['grad_rel']:.1e} (tolerance {GRAD_RTOL:.0e})")
    return 0 if ok else 1


def _rank(rank: int, world: int, port: int, device_type: str, config, flags: dict, results) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from parity.models.model import build_model
    from parity.training.strategy import IGNORE_INDEX

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        model = build_model(config, flags["seed"]).to(device)  # the same weights on every rank
        generator = torch.Generator().manual_seed(flags["seed"])
        ids = torch.randint(0, config.vocab_size, (flags["batch_size"], flags["seq_length"]), generator=generator)
        targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1).to(device)
        ids = ids.to(device)
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids).contiguous()
        tokens = int((targets != IGNORE_INDEX).sum())

        def loss_sum(input_ids, position_ids, labels):
            logits = model(input_ids=input_ids, position_ids=position_ids).logits
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                     ignore_index=IGNORE_INDEX, reduction="sum")

        reference = loss_sum(ids, positions, targets) / tokens
        reference.backward()
        full_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)

        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("cp",))
        buffers = [ids.clone(), positions.clone(), targets.clone()]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            local = loss_sum(*buffers)
            (local / tokens).backward()
        total = local.detach().clone()
        dist.all_reduce(total)
        worst, grad_rel = "", 0.0
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad)
            rel = float((p.grad - full_grads[name]).norm() / full_grads[name].norm().clamp_min(1e-30))
            if rel >= grad_rel:
                worst, grad_rel = name, rel
        loss = float(total) / tokens
        result = {"loss": loss, "reference_loss": float(reference), "loss_rel": abs(loss / float(reference) - 1),
                  "worst": worst, "grad_rel": grad_rel}
    except Exception as exc:  # what torch raised, for the one line the driver prints
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        place = frame.filename.split("site-packages/")[-1]
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]} ({place}:{frame.lineno})"}
    if rank == 0:
        results.put(result)
    dist.destroy_process_group()


def main(argv: list[str] | None = None, description: str = "") -> int:
    args = build_parser(description).parse_args(argv)
    return run_command(lambda: check(args), "the context-parallelism check")
