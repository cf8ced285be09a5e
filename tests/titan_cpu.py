"""torchtitan's own entry point (`torchtitan.train.main`) on a CPU with gloo, for the tests: torchtitan 0.3.0 has no
CPU path, so this launcher makes the changes below and then runs the job exactly as `-m torchtitan.train` would, with
the same arguments (`--module M --config C` and overrides). None of it is in the recorder: on GPUs the job runs as its
users run it (docs/torchtitan.md). Each change, and why it is needed:

- `device_type` "cpu" and a device-module proxy: torchtitan picks its device once at import
  (tools/utils.get_device_info: `_get_available_device_type() or "cuda"`), so on a machine without an accelerator it
  asks for CUDA, and calls the device module's set_device, synchronize, memory statistics and properties; the proxy
  answers with torch.cpu's functions where it has them and neutral values elsewhere. The backend follows the device:
  gloo.
- `parallelism.spmd_backend partial_dtensor` where the command gives none: under the default spmd_types backend
  torchtitan always calls fully_shard with `dp_mesh_dims` (even at an FSDP degree of 1, for its mixed-precision
  policy), and torch 2.13's fully_shard then wants every parameter a DTensor on the full SPMD mesh, which that backend
  does not make them: every job stops at set-up ("When dp_mesh_dims is provided, all parameters must be DTensors on
  the full SPMD mesh", measured at FSDP 2 and TP 2). partial_dtensor makes the model-parallel axes DTensors and
  leaves FSDP to fully_shard over its own mesh.
- SDPA in place of FlexAttention: FlexAttention has no CPU backward in torch 2.13 (it compiles with Triton, a GPU
  compiler). SDPA is causal over the whole row with torchtitan's per-document RoPE positions; the recorder reads the
  attention the job was built with and records its rows so (documents attend to each other), and the replay feeds them
  so.
- sum reduction forced in FSDP2 (`set_force_sum_reduction_for_comms(True)`): torchtitan turns FSDP's gradient division
  off (it divides by the global token count itself), which FSDP2 carries out as a reduce-scatter with ReduceOp
  PREMUL_SUM; gloo has no PREMUL_SUM. A divide factor of 1 makes the sum the same reduction.
- `torch.distributed.set_timeout` as a no-op: torchtitan calls it after the first step to shorten the groups'
  timeouts; torch 2.13 has no such function (torchtitan 0.3.0 expects a newer torch).

TITAN_BUG seeds one bug into this copy (tests/test_torchtitan.py), never into the recorder:
- `tp_norm`: layers.0.ffn_norm computed on each TP rank's local sequence shard with its local weight, so its weight's
  gradient is that rank's partial sum, never reduced over TP (a sequence-parallel plan that misses the norm);
- `local_tokens`: the loss normalised by the rank's own tokens instead of the global batch's;
- `fsdp_average`: FSDP2's gradient division left on (an average over the FSDP ranks) on top of torchtitan's division
  by the global batch's tokens: the gradients averaged twice.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


class DeviceModule:
    """torch.cpu where it has the call; elsewhere a function that does nothing and returns a neutral value."""

    NEUTRAL = {"device_count": 1, "current_device": 0, "get_device_name": "cpu", "memory_stats": {},
               "max_memory_allocated": 0, "max_memory_reserved": 0, "memory_allocated": 0, "memory_reserved": 0}

    def __getattr__(self, name):
        if name in self.NEUTRAL:
            return lambda *a, **k: self.NEUTRAL[name]
        if name == "get_device_properties":
            return lambda *a, **k: _Properties()
        if name == "mem_get_info":
            return lambda *a, **k: (1 << 34, 1 << 34)
        return getattr(torch.cpu, name, lambda *a, **k: None)


class _Properties:
    name, total_memory = "cpu", 1 << 34


def cpu_device() -> None:
    import importlib

    module = DeviceModule()
    for name in ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.distributed.parallel_dims",
                 "torchtitan.distributed.utils", "torchtitan.models.common.token_dispatcher",
                 "torchtitan.tools.profiler"):
        m = importlib.import_module(name)
        if hasattr(m, "device_type"):
            m.device_type = "cpu"
        if hasattr(m, "device_module"):
            m.device_module = module


def sdpa_attention(config) -> None:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    for layer in getattr(config.model_spec.model, "layers", []):
        if isinstance(layer.attention.inner_attention, (FlexAttention.Config, VarlenAttention.Config)):
            layer.attention.inner_attention = ScaledDotProductAttention.Config()


def sum_reduction() -> None:
    from torch.distributed.fsdp import FSDPModule
    import torchtitan.distributed.fsdp as fsdp

    bug = os.environ.get("TITAN_BUG") == "fsdp_average"

    def division_off(model) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                if not bug:
                    module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = division_off
    for name, m in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(m, "disable_fsdp_gradient_division", None) is not None:
            m.disable_fsdp_gradient_division = division_off


def seeded_bugs() -> None:
    bug = os.environ.get("TITAN_BUG")
    if bug == "local_tokens":
        import torchtitan.trainer as trainer

        class Local:  # dist_utils as the trainer sees it, its global token sum the rank's own
            def __getattr__(self, name):
                from torchtitan.distributed import utils

                return (lambda tokens, mesh: tokens) if name == "dist_sum_tensor" else getattr(utils, name)

        trainer.dist_utils = Local()
    elif bug == "tp_norm":
        from torch.distributed.tensor import DTensor
        from torchtitan.trainer import Trainer

        init = Trainer.__init__

        def __init__(self, config):
            init(self, config)
            norm = self.model_parts[0].layers["0"].ffn_norm
            plain = type(norm).forward

            def local(x):
                if not isinstance(x, DTensor):
                    return plain(norm, x)
                weight = norm.weight
                out = torch.nn.functional.rms_norm(x.to_local(), (x.shape[-1],), weight.to_local(), norm.eps)
                return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)

            norm.forward = local

        Trainer.__init__ = __init__
    elif bug not in (None, "", "fsdp_average"):
        raise SystemExit(f"TITAN_BUG={bug}: not a seeded bug of this launcher")


def main() -> None:
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None
    cpu_device()
    sum_reduction()
    seeded_bugs()
    from torchtitan.config import ConfigManager
    import torchtitan.train as train

    parse = ConfigManager.parse_args

    def parse_args(self, args=None):
        config = parse(self, args)
        sdpa_attention(config)
        if "--parallelism.spmd_backend" not in " ".join(sys.argv):
            config.parallelism.spmd_backend = "partial_dtensor"
        return config

    ConfigManager.parse_args = parse_args
    train.main()


if __name__ == "__main__":
    main()
