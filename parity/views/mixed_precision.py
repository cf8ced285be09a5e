"""A sharding wrapper's own mixed precision read as the run's precision policy (View.policy_request): FSDP2's
MixedPrecisionPolicy and FSDP1's MixedPrecision, each a parameter dtype and a reduce dtype, one for the whole model.
bf16 parameters are the bf16_params policy, fp16 ones the fp16 policy; fp32 parameters say only their reduce dtype
(the autocast the loop's forward runs under says the rest: recording/precision_seen.py)."""

from __future__ import annotations

import torch

from parity.errors import ConfigError
from parity.precision import DTYPES, PolicyRequest

NAMES = {dtype: name for name, dtype in DTYPES.items()}
LOW = {torch.bfloat16: "bf16_params", torch.float16: "fp16"}


def mixed_precision_request(wrapper: str, policies: set[tuple], accumulate: str = "reduce") -> PolicyRequest | None:
    """The policy `policies` ask for — the (param_dtype, reduce_dtype) pairs of `wrapper`'s modules (None where
    unset: the parameters' fp32, and the reduce dtype the parameters') — with micro-batches accumulated in the reduce
    dtype or the parameters' (`accumulate`: where the wrapper accumulates them); None where it asks for fp32 alone.
    ConfigError in one line for pairs that differ between modules or a dtype no policy computes in."""
    if len(policies) > 1:
        raise ConfigError(f"{wrapper} with {len(policies)} different policies among the model's modules: the replay "
                          f"trains one policy; give every module the same")
    if not policies:
        return None
    (param, reduce), = policies
    param = param or torch.float32
    reduce = reduce or param
    source = f"{wrapper}(param_dtype={param}, reduce_dtype={reduce})"
    if param not in NAMES or reduce not in NAMES:
        raise ConfigError(f"{source}: the replay computes and reduces in {', '.join(DTYPES)} only")
    if param == torch.float32:
        return PolicyRequest(source, reduce_dtype=NAMES[reduce]) if reduce != torch.float32 else None
    return PolicyRequest(source, precision=LOW[param], reduce_dtype=NAMES[reduce],
                         grad_accum_dtype=NAMES[reduce if accumulate == "reduce" else param])


__all__ = ["mixed_precision_request"]
