"""DeepSpeed in this process: its version, and the TP / DP groups it keeps process-global between engines. Apart from
the strategy because the driver's checks (guards.py, partition.py) and the worker's setup both need them, each importing
DeepSpeed only when it runs. Its import is parity/deepspeed_import.py's.
"""

from __future__ import annotations

import torch


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
