"""DeepSpeed's import in this process, which picks the accelerator for good and must wait for the worker's device, and
keeps DeepSpeed from JIT-building a comm op training never uses. On the ground floor: DeepSpeed's strategies, the
local groups' forkserver and the final model's writer (transformers' save_pretrained imports DeepSpeed) all import it
so.
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
