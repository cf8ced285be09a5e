"""DeepSpeed in this process: its import, which picks the accelerator for good and must wait for the worker's device (and
keeps DeepSpeed from JIT-building a comm op training never uses), its version, and the TP / DP groups it keeps
process-global between engines. Apart from the strategy because the driver's checks (guards.py, partition.py) and the
worker's setup both need them, each importing DeepSpeed only when it runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

import torch


def import_deepspeed(device: torch.device):
    """Import DeepSpeed for this process's device, quietly, without its CPU shared-memory comm op.

    DS_ACCELERATOR is set before the import because the import picks the accelerator for good: a CPU
    worker on a GPU machine (--device cpu) must not get the CUDA one.

    The shm op: creating DeepSpeed's comm backend JIT-compiles `deepspeed_shm_comm` with g++ on the CPU
    accelerator (190 s with an empty extension cache, and a "built successfully" print per rank) although
    only inference_all_reduce uses it, never training. The backend builds it only when DeepSpeed's own
    op-compatibility table says it can (`deepspeed.ops.__compatible_ops__`, the dict it also marks False on
    non-Linux platforms, probed once and kept), so that entry is set False here. DS_BUILD_SHM_COMM only
    affects `pip install`-time pre-building, and replacing comm.torch.build_shm_op would patch code.

    mlflow: DeepSpeed's autotuner imports it where it is installed (its import of deepspeed went 2.3 → 0.4 s here
    without it), to log tuning experiments, which training never runs; a tracker that imports it later gets it whole.
    """
    wanted = "cuda" if device.type == "cuda" else "cpu"
    os.environ["DS_ACCELERATOR"] = wanted
    if "deepspeed" in sys.modules:  # imported before the device was known: its accelerator may be wrong
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != wanted:
            raise RuntimeError(f"deepspeed was imported with the {get_accelerator().device_name()} accelerator "
                               f"before the {wanted} worker set DS_ACCELERATOR")
    with absent("mlflow"):
        import deepspeed
        import deepspeed.ops

    deepspeed.utils.logger.setLevel(logging.ERROR)
    # ZeRO's collectives and the logits gather call torch's all_gather_into_tensor/reduce_scatter_tensor,
    # which torch 2.13 marks deprecated: one FutureWarning per rank and call site, nothing to act on here.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def forget_other_tp_layout(tp_size: int) -> None:
    """DeepSpeed keeps its TP and DP groups process-global (deepspeed.utils.groups) once an AutoTP engine made
    them, and every later engine in the process reuses them: a run after one of another TP size in the same
    worker process (runs sharing a worker group, e.g. ZeRO at TP=1 after AutoTP at TP=2) would get the old
    layout's groups, or fail on them. Forget them when the layout differs; the same layout keeps them. A group whose
    process group was replaced since (a run of another world size in the worker group: parity/training/sub_world.py)
    is no group at all: then every group DeepSpeed keeps is forgotten."""
    from deepspeed.utils import groups
    from torch.distributed.distributed_c10d import _world

    kept = [groups._TENSOR_MODEL_PARALLEL_GROUP, groups._MODEL_PARALLEL_GROUP, groups._DATA_PARALLEL_GROUP,
            groups._WORLD_GROUP, groups._ZERO_PARAM_INTRA_PARALLEL_GROUP, *groups._EXPERT_PARALLEL_GROUP.values(),
            *groups._EXPERT_DATA_PARALLEL_GROUP.values(), *groups._ALL_TO_ALL_GROUP.values()]
    if any(g is not None and g not in _world.pg_map for g in kept):
        groups._WORLD_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = groups.mesh_device = None
        groups._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = groups._MPU_TENSOR_MODEL_PARALLEL_RANK = None
        for cache in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                      groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
                      groups._ALL_TO_ALL_GROUP):
            cache.clear()
    cached = groups._TENSOR_MODEL_PARALLEL_GROUP
    if cached is not None and (cached not in _world.pg_map or torch.distributed.get_world_size(cached) != tp_size):
        groups.mpu = None
        groups._TENSOR_MODEL_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = groups._DATA_PARALLEL_GROUP = None


def deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


@contextlib.contextmanager
def absent(name: str):
    """Module `name` not importable inside the block (an ImportError, as where it is not installed), unless it is
    imported already; importable again after."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None
    try:
        yield
    finally:
        if sys.modules.get(name, 0) is None:
            del sys.modules[name]
