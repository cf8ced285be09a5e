"""Runs of the shared loop in a local gloo process group started here, without Ray: several runs one after
another in one group, for work where Ray adds nothing to what is measured (the calibration study, the layer
check's --launcher local, and the tests that need many runs). Each rank runs the worker function a Ray Train
worker runs (training or the layer check's recorded step), on the same payload: each run is resolved, gets
its data and writes its records exactly as a Ray run does; only the process group is ours. On the run's device:
cpu over gloo, or cuda with one GPU per rank over NCCL; with PARITY_SHARE_ONE_GPU=1 (a switch for testing only,
docs/gpu.md) every rank of a group on cuda:0 of one GPU, over gloo with CUDA tensors (NCCL refuses two ranks on one
device).

A group runs under one CPU kernel path (`KERNEL_PATHS`): bf16 matrix products on CPU go through oneDNN,
whose kernels are chosen by the instruction set (AMX, AVX512-BF16, AVX512, AVX2 ...), and each gives other
bf16 roundings — the same seed is numerically another run on another CPU. oneDNN reads ONEDNN_MAX_CPU_ISA
once, when a process first uses it, so the path is set in the environment of the group's processes before their
first bf16 product.

The processes are forked from this process's multiprocessing forkserver, which imports torch, transformers'
Qwen2, DeepSpeed and the harness's loop once (PRELOAD): a spawned rank spent about 6 CPU-seconds importing them,
more than a short run trains. A forked rank takes the environment this process has when the group starts (as a
spawned one would), not the forkserver's, and imports the strategy modules itself, from this process's sys.path.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys

import torch.multiprocessing as mp

from parity.attaching.launch import SHARE_ONE_GPU, share_one_gpu
from parity.fingerprint import cpu_has_onednn_bf16
from parity.driver.cluster import Cluster
from parity.errors import TrainingFailed
from parity.driver.config import resolve
from parity.run_config import RunConfig
from parity.training.data import training_data
from parity.training.record import load_record, run_record_path

CLUSTER = Cluster(cpus=2, gpus=0)  # what resolve is told: CPU workers sharing two cores
SHARED_GPU_RANKS = 64  # the ranks resolve is told the one GPU takes under SHARE_ONE_GPU
ISA_ENV = "ONEDNN_MAX_CPU_ISA"
KERNEL_PATHS = {
    "default": {},  # this process's environment as it is: unset, whatever oneDNN picks (AMX or AVX512-BF16 where present)
    "avx512_core_bf16": {ISA_ENV: "AVX512_CORE_BF16"},  # native bf16 dot products without AMX (e.g. AMD EPYC)
    "avx512_core": {ISA_ENV: "AVX512_CORE"},  # AVX512 without bf16 instructions: bf16 converted in registers
    "avx2": {ISA_ENV: "AVX2"},  # the generic path of CPUs without AVX512
    "no_onednn": {"PARITY_DISABLE_ONEDNN": "1"},  # torch's own bf16 matmul (torch.backends.mkldnn off)
    # other fp32 and bf16 kernels than the default's on any x86 CPU: MKL's compatible code path (MKL_ENABLE_INSTRUCTIONS
    # moves nothing on AMD, where MKL takes one path) and oneDNN's AVX2 one — the noise another CPU kind brings; as a
    # noise reference's (NOISE_KERNELS), each variable flipped against this process's: set, or unset where it is so
    "other_kernels": {"MKL_CBWR": "COMPATIBLE", ISA_ENV: "AVX2"},
    # a CUDA group's other kernels (other_cuda_kernels, read by its ranks): cuBLAS's deterministic algorithms (the
    # workspace they need set before CUDA starts), bf16/fp16 products reduced in fp32 only, TF32 off
    "other_cuda_kernels": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PARITY_OTHER_CUDA_KERNELS": "1"},
}
PORT_TAKEN = "EADDRINUSE"  # rank 0's store could not listen on the group's port
NOISE_KERNELS = {"cpu": "other_kernels", "cuda": "other_cuda_kernels"}  # by device: the kernel path of a noise
# reference at the baseline's own layout (noise_kernels)


# What the forkserver imports once for every rank it forks: rank_preload.py, which imports what every rank imports
# (RANK_IMPORTS) and the rest of a rank's start-up.
PRELOAD = ["parity.driver.rank_preload"]


def same_kernels(a: str, b: str) -> bool:
    """Whether kernel paths `a` and `b` compute bf16 matrix products with the same kernels on this CPU, so that runs
    under one are bit for bit the runs under the other (tests run such a pair once): on a CPU where torch does not
    send them to oneDNN (no AVX512), every path is torch's own kernels, whatever ONEDNN_MAX_CPU_ISA says."""
    return a == b or not cpu_has_onednn_bf16()


def plan(strategy: str, values: dict) -> tuple:
    """One run: its resolved config and its data. values["strategy_class"] (a class, or "module:Class") runs
    another Strategy subclass than the registry's `strategy`, e.g. a copy with a bug in it; values["device"] is cpu
    (the default) or cuda (local_cluster)."""
    device = values.get("device") or "cpu"
    cfg = resolve(strategy, {**values, "device": device}, cluster=local_cluster(device))
    return cfg, training_data(cfg)


def local_cluster(device: str) -> Cluster:
    """What resolve is told for a local group on `device`: CPU workers sharing two cores; on cuda this machine's
    GPUs, one per rank, or under the testing switch as many ranks as a group asks for, all on the one GPU."""
    if device != "cuda":
        return CLUSTER
    import torch

    gpus = torch.cuda.device_count()
    return Cluster(cpus=float(len(os.sched_getaffinity(0))),
                   gpus=max(gpus, SHARED_GPU_RANKS) if gpus and share_one_gpu() else gpus)


def run_group(runs: list[tuple], kernel: str = "default") -> list[dict]:
    """Train every planned run in one local group of the largest run's ranks under the kernel path `kernel` (a run of
    fewer on its first ranks); return their records."""
    launch_local([cfg for cfg, _ in runs], [{"batches": batches} for _, batches in runs], kernel=kernel)
    return [load_record(run_record_path(cfg)) for cfg, _ in runs]


def launch_local(cfgs: list[RunConfig], payloads: list[dict], worker=None, kernel: str = "default") -> None:
    """launch_runs without Ray: `cfgs` one after another in one gloo group of this machine's processes, as many as
    the largest run's workers (a run of fewer on the group's first ranks: parity/training/sub_world.py), each rank
    calling `worker` (default: the training loop's train_group_worker) with the payload a Ray Train worker gets, without
    checkpoints (Ray Train's: there is no restart to resume). Raises TrainingFailed with the line of the rank that
    failed."""
    from parity.training.loop import train_group_worker

    world = max(cfg.num_workers for cfg in cfgs)
    group = {"runs": [{"cfg": cfg.to_dict(), "title": cfg.strategy, **payload} for cfg, payload in zip(cfgs, payloads)],
             "checkpoints": False}
    for attempt in (1, 2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            start_processes(_rank, (world, port, worker or train_group_worker, group, placement(cfgs[0].device)), world,
                            kernel_environment(kernel), cfgs[0].device)
            return
        except mp.ProcessRaisedException as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()]
            if attempt == 1 and PORT_TAKEN in lines[-1]:  # before any run: another process's socket took the port
                continue  # between its choice here and rank 0's store listening on it (once in ~60 groups on a
                # machine busy with other groups and Ray): a new port
            print(exc, file=sys.stderr, flush=True)  # the rank's traceback, in the run's log (the terminal says where)
            raise TrainingFailed(f"rank {exc.error_index}: {lines[-1]}") from None
        except mp.ProcessExitedException as exc:
            raise TrainingFailed(f"rank {exc.error_index}: {exc}") from None


def placement(device: str) -> tuple[str, str | None]:
    """(backend, GPU of every rank or None: rank r's own, cuda:r) of a local group on `device`."""
    if device != "cuda":
        return "gloo", None
    return ("gloo", "0") if share_one_gpu() else ("nccl", None)


def start_processes(fn, args: tuple, nprocs: int, environment: dict[str, str] | None = None,
                    device: str = "cpu") -> None:
    """fn(rank, *args) in `nprocs` processes, each with `environment` (default: this process's) and this process's
    stdout and stderr; waits for all of them and raises if one fails, as torch's mp.spawn does. On cpu they are forked
    from the forkserver (PRELOAD imported); on cuda spawned: what the forkserver imports asks torch for the GPUs
    (transformers, inductor), after which no process forked from it can use CUDA ("Cannot re-initialize CUDA in
    forked subprocess": every rank of the GPU check's first run)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the forkserver starts (this process's first group)
    mp.start_processes(_in_environment, args=(dict(os.environ if environment is None else environment), _Stdio(), fn,
                                              args), nprocs=nprocs, start_method=start_method(device))


def start_method(device: str) -> str:
    """How a local group's ranks start on `device` (start_processes): spawned where CUDA is there, a CPU group's too —
    a rank forked from the forkserver, whose imports ask torch for the GPUs, fails at its first CUDA call (torch's
    Adam asks whether a CUDA graph is being captured); forked from the forkserver elsewhere."""
    import torch

    return "spawn" if device == "cuda" or torch.cuda.is_available() else "forkserver"


def kernel_environment(kernel: str) -> dict[str, str]:
    """This process's environment with the kernel path's variables set and any other path's removed; "default": as it
    is (a replay runs on the kernels its command ran on, ONEDNN_MAX_CPU_ISA and MKL_CBWR included)."""
    if kernel == "default":
        return dict(os.environ)
    if kernel == NOISE_KERNELS["cpu"]:  # other kernels than this process's: each variable set, or unset where set so
        other = {k: v for k, v in KERNEL_PATHS[kernel].items() if os.environ.get(k) != v}
        return {**{k: v for k, v in os.environ.items() if k not in KERNEL_PATHS[kernel]}, **other}
    names = {k for env in KERNEL_PATHS.values() for k in env}
    return {**{k: v for k, v in os.environ.items() if k not in names}, **KERNEL_PATHS[kernel]}


class _Stdio:
    """This process's stdout and stderr (descriptors 1 and 2) as they are when a rank starts: multiprocessing hands
    the descriptors themselves to the forked rank, which then writes where this process writes now (a command's
    log, a test's captured output), not where the forkserver's output went when it started."""

    def __init__(self, out=None, err=None):
        self.out, self.err = out, err

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _Stdio, (DupFd(1), DupFd(2))

    def attach(self) -> None:
        for fd, inherited in ((1, self.out), (2, self.err)):
            os.dup2(inherited.detach(), fd)


def _in_environment(rank: int, environment: dict[str, str], stdio: _Stdio, fn, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environment)
    stdio.attach()
    fn(rank, *args)


def _rank(rank: int, world: int, port: int, worker, group: dict, where: tuple = ("gloo", None)) -> None:
    import torch
    import torch.distributed as dist

    if os.environ.get("PARITY_DISABLE_ONEDNN"):
        torch.backends.mkldnn.enabled = False
    if os.environ.get("PARITY_OTHER_CUDA_KERNELS"):
        other_cuda_kernels()
    backend, gpu = where
    # LOCAL_RANK is the rank's GPU (what DeviceMesh sets as the device when none is set): cuda:0 for every rank
    # under the testing switch, which sets it here first
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=gpu or str(rank), RANK=str(rank),
                      WORLD_SIZE=str(world))
    if backend == "nccl" or gpu is not None:
        torch.cuda.set_device(int(gpu or rank))
    dist.init_process_group(backend, rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()  # the group's TCPStore, served from rank 0's process
    try:
        stopped = (worker(group) or {}).get("stopped")
    finally:
        dist.destroy_process_group()
    _leave_together(store, rank, world)
    if stopped:
        raise TrainingFailed(stopped)


def other_cuda_kernels() -> None:
    """A rank of the CUDA kernel path's group (KERNEL_PATHS' other_cuda_kernels) takes other kernels than a run's
    defaults before its first product, as another GPU or another user's settings would: deterministic algorithms
    (cuBLAS without split reductions in atomics; an op that has none warns and runs as it is), the reductions inside
    bf16 and fp16 matrix products in fp32 alone, TF32 off for products and convolutions. The noise a GPU's kernels
    bring, measured by one more reference (docs/tolerances.md#every-machine-the-clean-matrix); CPU kernels read none
    of it."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _leave_together(store, rank: int, world: int) -> None:
    """Rank 0 leaves last: its process serves the group's store, and a rank still forming a group over it (the
    whole group formed again after a run of fewer ranks, parity/training/sub_world.py) when rank 0 exits loses it
    ("Connection reset by peer": measured once in 150 groups of a 2-rank run then a 1-rank one, on loaded cores).
    Each rank says it is done once its groups are destroyed; rank 0 waits for all of them. A rank that failed says
    nothing: the launcher ends the others (torch's start_processes) when it sees the failure."""
    from parity.training.sub_world import TIMEOUT

    store.set(f"parity_left/{rank}", "1")
    if rank == 0:
        store.wait([f"parity_left/{r}" for r in range(world)], TIMEOUT)
