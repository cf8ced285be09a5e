"""A sharding wrapper's own mixed precision read as the run's precision policy (View.policy_request): FSDP2's
MixedPrecisionPolicy and FSDP1's MixedPrecision, each a parameter dtype and a reduce dtype, one for the whole model.
bf16 parameters computed from fp32 ones are the bf16_params policy, fp16 ones the fp16 policy; fp32 parameters say only
their reduce dtype (the autocast the loop's forward runs under says the rest: recording/precision_seen.py). Over a model
whose parameters are bf16 already (loaded so) nothing holds fp32 masters: that is bf16_pure, reduced in bf16."""

from __future__ import annotations

import torch

from parity.errors import ConfigError
from parity.precision import DTYPES, NAME_OF_DTYPE, PolicyRequest

LOW = {torch.bfloat16: "bf16_params", torch.float16: "fp16"}


def mixed_precision_request(wrapper: str, policies: set[tuple], stored: set[torch.dtype],
                            accumulate: str = "reduce") -> PolicyRequest | None:
    """The policy `policies` ask for — the (param_dtype, reduce_dtype) pairs of `wrapper`'s modules (None where
    unset: the dtype the trained parameters are `stored` in, and the reduce dtype the parameters') — with micro-batches
    accumulated in the reduce dtype or the parameters' (`accumulate`: where the wrapper accumulates them); None where
    it asks for fp32 alone. ConfigError in one line for pairs that differ between modules, a dtype no policy computes
    in, and low-precision stored parameters (no fp32 masters) computed or reduced in another dtype."""
    if len(policies) > 1:
        raise ConfigError(f"{wrapper} with {len(policies)} different policies among the model's modules: the replay "
                          f"trains one policy; give every module the same")
    if not policies:
        return None
    (param, reduce), = policies
    held = stored_dtype(stored)
    param = param or held
    reduce = reduce or param
    source = f"{wrapper}(param_dtype={param}, reduce_dtype={reduce})"
    if param not in NAME_OF_DTYPE or reduce not in NAME_OF_DTYPE:
        raise ConfigError(f"{source}: the replay computes and reduces in {', '.join(DTYPES)} only")
    if held != torch.float32:  # no fp32 master weights: the optimizer steps the stored low-precision parameters
        if (param, reduce) != (torch.bfloat16, torch.bfloat16):
            raise ConfigError(f"{source} over parameters stored in {held}, without fp32 master weights: the replay "
                              f"steps low-precision parameters as bf16 ones computed and reduced in bf16 (bf16_pure); "
                              f"keep the parameters in fp32 (param_dtype casts them for the forward: bf16_params) or "
                              f"reduce in bf16")
        return PolicyRequest(source, precision="bf16_pure", reduce_dtype="bf16")
    if param == torch.float32:
        return PolicyRequest(source, reduce_dtype=NAME_OF_DTYPE[reduce]) if reduce != torch.float32 else None
    return PolicyRequest(source, precision=LOW[param], reduce_dtype=NAME_OF_DTYPE[reduce],
                         grad_accum_dtype=NAME_OF_DTYPE[reduce if accumulate == "reduce" else param])


def stored_dtype(stored: set[torch.dtype]) -> torch.dtype:
    """The dtype trained parameters `stored` in these dtypes are held in: fp32 where they are in several."""
    return next(iter(stored)) if len(stored) == 1 else torch.float32


def trained_dtypes(model) -> set[torch.dtype]:
    """The dtypes of the parameters `model`'s optimizer steps (those requiring gradients)."""
    return {p.dtype for p in model.parameters() if p.requires_grad}


__all__ = ["mixed_precision_request", "stored_dtype", "trained_dtypes"]
