"""The precision accelerate trains a model in, as its Accelerator was told (`mixed_precision`), in the harness's
policy names: a recorder told none takes it, one told another refuses (parity/recording/precision_seen.py). Said only
where it is sure: accelerate's state initialised by this process, data-parallel (DeepSpeed, FSDP and Megatron-LM bring
their own precision configs) and every floating parameter fp32 (autocast over fp32 weights); read from the state
already made, never imported or initialised here."""

from __future__ import annotations

import sys

import torch

# mixed_precision → the harness's policy (fp16: autocast with accelerate's GradScaler — on a GPU: accelerate trains fp16
# on a CPU in fp32, neither autocast nor scaler); fp8 is none of its policies: the record's first forward says so
# (parity/recording/precision_seen.py)
POLICIES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16_autocast"}
OWN_PRECISION = {"DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA"}  # distributed types whose engine sets the precision


def policy_of(model) -> str | None:
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None) or {}
    said, kind = shared.get("_mixed_precision"), getattr(shared.get("distributed_type"), "value", None)
    if said not in POLICIES or kind in OWN_PRECISION or not isinstance(model, torch.nn.Module):
        return None
    params = [p for p in model.parameters() if p.is_floating_point()]
    if any(p.dtype != torch.float32 for p in params):
        return None
    return "fp32" if said == "fp16" and params and params[0].device.type == "cpu" else POLICIES[said]
