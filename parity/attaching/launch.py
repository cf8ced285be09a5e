"""How the own-trainer examples start (docs/own_trainer/one_command.md#launchers): under a launcher that set torchrun's variables
(torchrun, `accelerate launch`) the training function runs in this process; with `--ray N` it runs on N Ray Train
workers (a TorchTrainer over gloo, the function told `ray=True` to use Ray's own integrations); otherwise `--nproc`
ranks are spawned here with torchrun's variables set. On a GPU a spawned rank's LOCAL_RANK is its GPU; under the testing
switch that puts several ranks on one GPU (PARITY_SHARE_ONE_GPU=1, docs/gpu.md) every rank's is 0 and its group gloo
(`backend`)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable

SHARE_ONE_GPU = "PARITY_SHARE_ONE_GPU"  # =1: every rank of a cuda group on cuda:0, over gloo (testing only)


def launch(train: Callable, args) -> None:
    """`train(args)` on every rank (`train(args, ray=True)` on Ray Train's workers)."""
    import torch

    if getattr(args, "ray", 0):
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        # the function by its script's path, not pickled by value: cloudpickle takes along the submodules of torch
        # whose names a function's code mentions, and torch 2.13's torch.distributed.config (a function that imports
        # torch.distributed and reads model.config) cannot be pickled
        script = {"script": os.path.abspath(sys.modules[train.__module__].__file__), "function": train.__name__}
        TorchTrainer(_ray_worker, train_loop_config={**script, "args": args},
                     scaling_config=ScalingConfig(num_workers=args.ray, use_gpu=False),
                     run_config=RunConfig(storage_path=os.path.abspath(os.path.join(args.output_dir, "ray")),
                                          name=args.name),
                     torch_config=TorchConfig(backend="gloo")).fit()
        return
    if "RANK" in os.environ:  # torchrun, accelerate launch
        train(args)
        return
    with held_port() as port:
        torch.multiprocessing.spawn(_spawned, args=(args.nproc, port, train, args), nprocs=args.nproc)


@contextlib.contextmanager
def held_port():
    """The port of a store this process holds open while its spawned ranks run: they join it as clients (torchrun's
    agent store, `agent_store_environment`), so no other process can take the port between its choice here and the
    ranks' start, as a free port chosen here and listened on later by rank 0 could be (EADDRINUSE in a busy CI)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


def agent_store_environment(port: int) -> dict[str, str]:
    """A spawned rank's variables for joining the store of `held_port` (every rank a client, rank 0 included)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _spawned(rank: int, world: int, port: int, train: Callable, args) -> None:
    import torch

    os.environ.update(agent_store_environment(port), RANK=str(rank), LOCAL_RANK=str(0 if share_one_gpu() else rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0")
    torch.set_num_threads(1)
    train(args)


def share_one_gpu() -> bool:
    """Whether the testing switch puts every rank on the one GPU (PARITY_SHARE_ONE_GPU=1), here and in a local
    group's ranks (parity/driver/local_group.py)."""
    return os.environ.get(SHARE_ONE_GPU) == "1"


def backend(device: str) -> str:
    """The process group's backend for this process's ranks on `device` (cpu or cuda; WORLD_SIZE set): gloo on CPU and
    for several ranks sharing one GPU (NCCL refuses two ranks on one device), else nccl."""
    shared = share_one_gpu() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return "gloo" if device == "cpu" or shared else "nccl"


def rank_device(device: str):
    """This rank's torch.device on `device` (cpu or cuda): the GPU of its LOCAL_RANK (else its rank), modulo the GPUs
    (several ranks on one GPU under the testing switch)."""
    import torch
    import torch.distributed as dist

    if device != "cuda":
        return torch.device("cpu")
    rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    return torch.device("cuda", rank % torch.cuda.device_count())


def _ray_worker(config: dict) -> None:
    import importlib.util

    import torch

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("parity_ray_script", config["script"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, config["function"])(config["args"], ray=True)


__all__ = ["launch"]
