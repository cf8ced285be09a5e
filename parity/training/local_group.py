"""Runs of the shared loop in a local gloo process group spawned here, without Ray: several runs one after
another in one group, for work where Ray adds nothing to what is measured (the calibration study, and the
tests that need many runs). Each run is resolved, gets its data and writes its loss record exactly as a Ray
run does; only the process group is ours. CPU only.

A group runs under one CPU kernel path (`KERNEL_PATHS`): bf16 matrix products on CPU go through oneDNN,
whose kernels are chosen by the instruction set (AMX, AVX512-BF16, AVX512, AVX2 ...), and each gives other
bf16 roundings — the same seed is numerically another run on another CPU. oneDNN reads ONEDNN_MAX_CPU_ISA
once, when a process first uses it, so the path is set in the environment the group's processes start with.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket

import torch.multiprocessing as mp

from parity.fingerprint import cpu_has_onednn_bf16
from parity.training.cluster import Cluster
from parity.training.config import resolve
from parity.training.data import training_data
from parity.training.record import load_record, run_record_path

CLUSTER = Cluster(cpus=2, gpus=0)  # what resolve is told: CPU workers sharing two cores
ISA_ENV = "ONEDNN_MAX_CPU_ISA"
KERNEL_PATHS = {
    "default": {},  # whatever oneDNN picks on this CPU (AMX or AVX512-BF16 where the CPU has them)
    "avx512_core_bf16": {ISA_ENV: "AVX512_CORE_BF16"},  # native bf16 dot products without AMX (e.g. AMD EPYC)
    "avx512_core": {ISA_ENV: "AVX512_CORE"},  # AVX512 without bf16 instructions: bf16 converted in registers
    "avx2": {ISA_ENV: "AVX2"},  # the generic path of CPUs without AVX512
    "no_onednn": {"PARITY_DISABLE_ONEDNN": "1"},  # torch's own bf16 matmul (torch.backends.mkldnn off)
}


def kernel_path() -> str:
    """The kernel path this process runs under, by the names of KERNEL_PATHS ('default' when none is set)."""
    for name, env in KERNEL_PATHS.items():
        if env and all(os.environ.get(k) == v for k, v in env.items()):
            return name
    return "default" if not os.environ.get(ISA_ENV) else os.environ[ISA_ENV].lower()


def same_kernels(a: str, b: str) -> bool:
    """Whether kernel paths `a` and `b` compute bf16 matrix products with the same kernels on this CPU, so that runs
    under one are bit for bit the runs under the other (tests run such a pair once): on a CPU where torch does not
    send them to oneDNN (no AVX512), every path is torch's own kernels, whatever ONEDNN_MAX_CPU_ISA says."""
    return a == b or not cpu_has_onednn_bf16()


def plan(strategy: str, values: dict) -> tuple:
    """One run: its resolved config and its data. values["strategy_class"] (a class, or "module:Class") runs
    another Strategy subclass than the registry's `strategy`, e.g. a copy with a bug in it."""
    cfg = resolve(strategy, {"device": "cpu", **values}, cluster=CLUSTER)
    return cfg, training_data(cfg)


def run_group(runs: list[tuple], kernel: str = "default") -> list[dict]:
    """Run every planned run (all with the same world size) in one spawned gloo group under the kernel path
    `kernel`; return their records."""
    world = runs[0][0].num_workers
    assert all(cfg.num_workers == world for cfg, _ in runs), "one group, one world size"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with _environment(KERNEL_PATHS[kernel]):
        mp.spawn(_rank, args=(world, port, runs), nprocs=world)
    return [load_record(run_record_path(cfg)) for cfg, _ in runs]


@contextlib.contextmanager
def _environment(variables: dict):
    """The kernel path's variables set (and any other path's unset) while the group's processes start."""
    names = {k for env in KERNEL_PATHS.values() for k in env}
    saved = {k: os.environ.get(k) for k in names}
    for k in names:
        os.environ.pop(k, None)
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank(rank: int, world: int, port: int, runs: list[tuple]) -> None:
    import torch
    import torch.distributed as dist

    from parity.training.loop import start_worker, train

    if os.environ.get("PARITY_DISABLE_ONEDNN"):
        torch.backends.mkldnn.enabled = False
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for cfg, batches in runs:
            train(start_worker({"cfg": cfg.to_dict()}), batches)
            gc.collect()
    finally:
        dist.destroy_process_group()
