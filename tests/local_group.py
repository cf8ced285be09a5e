"""Runs of the shared loop in a local gloo process group spawned here, without Ray: several runs one after
another in one group, for tests where Ray adds nothing to what is tested (the calibrated verdict needs
many runs). Each run is resolved, gets its data and writes its loss record exactly as a Ray run does;
only the process group is ours. CPU only."""

from __future__ import annotations

import gc
import os
import socket

import torch.multiprocessing as mp

from parity.training.cluster import Cluster
from parity.training.config import resolve
from parity.training.data import training_data
from parity.training.record import load_record, run_record_path

CLUSTER = Cluster(cpus=2, gpus=0)  # what resolve is told: CPU workers sharing two cores


def plan(strategy: str, values: dict, strategy_cls=None) -> tuple:
    """One run: its resolved config, its data, and the strategy class to run it with (default: the
    registry's; a test passes a copy with a bug in it)."""
    cfg = resolve(strategy, {"device": "cpu", **values}, cluster=CLUSTER)
    return cfg, training_data(cfg), strategy_cls


def run_group(runs: list[tuple]) -> list[dict]:
    """Run every planned run (all with the same world size) in one spawned gloo group; return their records."""
    world = runs[0][0].num_workers
    assert all(cfg.num_workers == world for cfg, _, _ in runs), "one group, one world size"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, port, runs), nprocs=world)
    return [load_record(run_record_path(cfg)) for cfg, _, _ in runs]


def _rank(rank: int, world: int, port: int, runs: list[tuple]) -> None:
    import torch.distributed as dist

    from parity.training.loop import start_worker, train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for cfg, batches, strategy_cls in runs:
            train(start_worker({"cfg": cfg.to_dict()}, strategy_cls), batches)
            gc.collect()
    finally:
        dist.destroy_process_group()
