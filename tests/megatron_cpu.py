"""megatron-core's own code on a CPU with gloo, for the tests: megatron-core 0.16.1 has no CPU path, so `install()`
makes the changes below at run time, and `python megatron_cpu.py SCRIPT ARGS…` (under torchrun for several ranks)
then runs SCRIPT as `python SCRIPT ARGS…` would. No file of megatron-core is edited, and none of it is in the harness:
on GPUs a job runs as its users run it (docs/megatron.md). The job builds its model with the local layer spec
(get_gpt_layer_local_spec: no TransformerEngine, no apex), use_cpu_initialization and every fusion off.

Each change, and why it is needed:
- CUDA device names to the CPU: megatron-core asks `torch.cuda.current_device()` for the device of what it creates
  (RoPE's inverse frequencies, buffers) and passes `device="cuda"` to factories; `torch.cuda.current_device` answers
  "cpu", and a torch-function mode turns every `device` that names CUDA, `.cuda()` and `.to("cuda")` into the CPU.
- `Tensor.type()` answers under torch.cuda's names ("torch.cuda.FloatTensor"): the optimizers and `clip_grads` keep
  the tensors whose type is a CUDA one, and would otherwise leave every CPU gradient out of the norm and the step.
- streams, events and `torch.cuda.synchronize` as no-ops: the pipeline's and the distributed optimizer's overlap waits
  on them; on one CPU every operation is in order already.
- the local spec's norm (`WrappedTorchNorm`: torch's RMSNorm) built under sequence parallelism, which it refuses:
  its weights tagged `sequence_parallel` as TransformerEngine's and apex's norms tag theirs (what `finalize_model_grads`
  all-reduces over TP: each TP rank's norm sees its part of the sequence), where the job runs TE or apex on GPUs.
- the CUDA RNG tracker's `fork` as a no-op: the attention's dropout forks the model-parallel RNG state (CUDA's) even
  at dropout 0, which the jobs here train with; and `model_parallel_cuda_manual_seed` (which seeds those CUDA states
  for the tracker, through torch.cuda's RNG) a no-op with it: nothing forks them.
- wandb left unimported (`sys.modules["wandb"] = None`, before megatron-core imports): its timers and inference code
  import it where installed (torchtitan's requirements install it here) and log nothing to it in these jobs; ~0.35
  CPU-s a rank (3.5 of megatron-core's 4 CPU-s of imports).
"""

from __future__ import annotations

import contextlib
import runpy
import sys

from parity.gc_thresholds import fewer_collections

fewer_collections()  # a test's process: fewer collections while megatron-core imports (parity/gc_thresholds.py)

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


def _cpu(device):
    if isinstance(device, torch.device) and device.type == "cuda" or isinstance(device, str) and \
            device.startswith("cuda") or isinstance(device, int):
        return torch.device("cpu")
    return device


class CudaOnCpu(TorchFunctionMode):
    """What asks for CUDA gets the CPU; Tensor.type() answers under torch.cuda's names (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if func is torch.device and args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return torch.device("cpu")  # torch.device(f"cuda:{torch.cuda.current_device()}")
        if name == "to":
            args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        if name == "type" and len(args) == 1 and not kwargs:
            found = func(*args)
            return found if found.startswith("torch.cuda.") else found.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class _Waits:
    """A CUDA stream or event on one CPU: every wait, record and synchronize is already done (a class, as torch.cuda's:
    annotations take its union with None)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: True if name == "query" else _Waits() if name == "record_event" else None


def sequence_parallel_norms() -> None:
    """WrappedTorchNorm under sequence parallelism (the module docstring)."""
    from megatron.core.transformer import torch_norm

    build = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, *args, **kwargs)
        config.sequence_parallel = False  # what its check reads; the norm itself is the same
        try:
            norm = build(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__


def moe_host_copies() -> None:
    """The alltoall dispatcher's device-to-host copies as on a GPU (the module docstring)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    for name in TE_NAMES:  # what its import of TransformerEngine would have defined: None, as TE's absence means
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    if not isinstance(mcore_fsdp_adapter.TELinear, type):  # without TE a mock, which Megatron-FSDP's isinstance
        mcore_fsdp_adapter.TELinear = type("TELinear", (), {})  # check refuses: a class no local module is


def unequal_gathers() -> None:
    """`all_gather` into tensors of unequal sizes (the dispatcher's gather of each TP rank's routed tokens): gloo takes
    equal ones only, so each rank's piece is padded to the longest and cut back after."""
    gather = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if all(t.shape == tensor.shape for t in tensor_list):
            return gather(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(t.shape[0] for t in tensor_list)
        padded = [tensor.new_empty((longest, *tensor.shape[1:])) for _ in tensor_list]
        mine = torch.cat([tensor, tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))])
        gather(padded, mine.contiguous(), group=group)
        for out, got in zip(tensor_list, padded):
            out.copy_(got[:out.shape[0]])
        return None

    dist.all_gather = all_gather


TE_NAMES = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
            "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
            "fused_topk_with_score_function", "fused_unpermute")


def cpu_meshes() -> None:
    """A DeviceMesh megatron-core builds over a process group for "cuda" (its FSDP wrappers) built for the CPU."""
    from torch.distributed.device_mesh import DeviceMesh

    build = DeviceMesh.from_group

    def from_group(group, device_type, *args, **kwargs):
        return build(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    DeviceMesh.from_group = staticmethod(from_group)


def premultiplied_sums() -> None:
    """Megatron-FSDP's gradient reduction by NCCL's PREMUL_SUM (each rank's gradient × the scaling factor, then
    summed), which gloo lacks: the gradient multiplied first, then summed — the same arithmetic."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffers

    def gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config):
        if scaling_factor is None or ddp_config.average_in_collective:
            return prepare(grad_data, scaling_factor, ddp_config)
        grad_data.mul_(scaling_factor)
        return dist.ReduceOp.SUM

    prepare = buffers.gradient_reduce_preprocessing
    buffers.gradient_reduce_preprocessing = gradient_reduce_preprocessing


def install() -> None:
    sys.modules.setdefault("wandb", None)  # (module docstring)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: _Waits()
    torch.cuda.Stream = torch.cuda.Event = _Waits
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random

    random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    random.model_parallel_cuda_manual_seed = tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.ByteTensor()  # no CUDA RNG to read or set (Megatron-FSDP
    torch.cuda.set_rng_state = lambda *args, **kwargs: None  # syncs the TP group's; dropout 0 draws none)
    sequence_parallel_norms()
    moe_host_copies()
    unequal_gathers()
    cpu_meshes()
    premultiplied_sums()
    CudaOnCpu().__enter__()  # for the rest of the process


def main() -> None:
    script, *argv = sys.argv[1:]
    install()
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
