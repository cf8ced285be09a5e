"""Whether this process trains in the process group its launcher started (the recorder's first check, recorder.py).

torchrun and `accelerate launch` start N processes and tell each of them N (WORLD_SIZE). A process that then trains
alone — no process group, a group of one, or accelerate's state with one process — is one of N separate one-process
runs on the same data: each would record a run of its own into the same folder (or all of them one whose ranks fed
the same rows), and the harness's verdict would find a failure without naming its cause. The recorder refuses such
a process in one line that names the cause and the fix, and records nothing; the training goes on.

The cause is accelerate's where accelerate's state is the one that trains alone. accelerate 1.15's
PartialState._prepare_backend forms a group for a device backend (GPU and the like) where LOCAL_RANK is set, and on
CPU only with cpu=True (Accelerator(cpu=True) or ACCELERATE_USE_CPU=1, then MULTI_CPU over gloo); with neither it
keeps DistributedType.NO and num_processes 1 — under `accelerate launch --multi_gpu --num_processes 2` on a machine
without GPUs too, whose processes torchrun starts with WORLD_SIZE=2.

Also where a recording process's collectives run (`exchange_device`): the recorder's and a framework room's view's.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def exchange_device() -> torch.device:
    """Where this process's collectives run (the recorder's exchanges, a view's gathers): the current CUDA device
    under NCCL, else the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def first_process() -> bool:
    """Whether this process speaks for the run: the launcher's rank 0 (RANK), which a process that trains alone is
    not told otherwise; without a launcher, rank 0 of the process group."""
    if "RANK" in os.environ:
        return os.environ["RANK"] == "0"
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def launched_processes() -> int:
    """How many processes the launcher says it started: WORLD_SIZE (torchrun's, accelerate launch's; LOCAL_WORLD_SIZE
    where only that is set); 1 without a launcher."""
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)


def trains_alone() -> str | None:
    """Why this process trains alone while its launcher started several, with the fix, in one line; None where it
    trains in a group of them all (or no launcher started several)."""
    launched = launched_processes()
    if launched <= 1:
        return None
    found = _accelerate_alone() or _group_alone()
    if found is None:
        return None
    cause, fix = found
    return (f"the launcher started {launched} processes (WORLD_SIZE={launched}) but this one trains alone ({cause}): "
            f"{fix}")


def _accelerate_alone() -> tuple[str, str] | None:
    """accelerate's cause and fix, where an Accelerator's state says one process."""
    if "accelerate" not in sys.modules:
        return None
    from accelerate.state import PartialState, is_initialized

    state = PartialState() if is_initialized() else None
    if state is None or state.num_processes != 1:
        return None
    seen = f"accelerate's {state.distributed_type}, num_processes 1"
    if state.device.type == "cpu":
        return (f"{seen}: on CPU accelerate forms a process group only with cpu=True",
                "pass Accelerator(cpu=True) or set ACCELERATE_USE_CPU=1")
    return (f"{seen} on {state.device.type}: accelerate forms a group only where LOCAL_RANK is set and the device has "
            f"a distributed backend", "start the processes with torchrun or accelerate launch")


def _group_alone() -> tuple[str, str] | None:
    """torch.distributed's cause and fix: no process group, or a group of one."""
    if not dist.is_available() or not dist.is_initialized():
        cause = "torch.distributed is not initialised in it"
    elif dist.get_world_size() == 1:
        cause = "its process group has 1 rank"
    else:
        return None
    return cause, ("call init_process_group(backend) in every process, without rank and world_size: it takes the "
                   "launcher's variables")


__all__ = ["launched_processes", "trains_alone"]
