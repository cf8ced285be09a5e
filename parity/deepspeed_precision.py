"""DeepSpeed's precision keys read as the harness's policy, once for every place a DeepSpeed config enters: a
strategy run's --deepspeed_config (parity/strategies/autotp/user_config.py), and the config of an engine a user's own
loop or Trainer's DeepSpeed path trains through (the recorder's ZeRO view: parity/views/zero.py). Pure dict reading,
nothing of DeepSpeed imported; the table of what each key means is docs/deepspeed.md's.
"""

from __future__ import annotations

import json

from parity.errors import ConfigError
from parity.precision import LOSS_SCALING_DEFAULTS, PolicyRequest

# DeepSpeed's dtype names (communication_data_type, data_types.grad_accum_dtype) → the harness's.
DS_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
             "float16": "fp16", "half": "fp16"}

# DeepSpeed's fp16 keys the harness's loss scaler takes: LossScaler's fields (parity.precision.LossScaling's).
FP16_SCALER_KEYS = tuple(LOSS_SCALING_DEFAULTS)


def config_policy(user: dict, source: str) -> PolicyRequest | None:
    """The precision policy a DeepSpeed config asks for, with its refinements as DeepSpeed reads them: `bf16` (or
    `bfloat16`) enabled is bf16_params — bf16_pure with bf16_master_weights_and_grads and bf16_optimizer_states —,
    `fp16` enabled is fp16 with its loss-scale keys, `torch_autocast` enabled is bf16; `communication_data_type` is
    the reduce dtype (DeepSpeed's default: the mode's own dtype), `data_types.grad_accum_dtype` the accumulation dtype
    (default: the parameters' dtype). None when it enables none of them (the run's --precision decides). ConfigError
    in one line, naming `source`, for what no policy of the harness holds."""
    bf16 = user.get("bf16", user.get("bfloat16")) or {}
    fp16, autocast = user.get("fp16") or {}, user.get("torch_autocast") or {}
    enabled = [name for name, section in (("bf16", bf16), ("fp16", fp16), ("torch_autocast", autocast))
               if section.get("enabled")]
    if len(enabled) > 1:
        raise ConfigError(f"{source} enables both {enabled[0]} and {enabled[1]}: DeepSpeed runs one precision mode: "
                          f"keep one of the sections enabled")
    if not enabled:
        return None
    reduce = _ds_dtype(user.get("communication_data_type"), "communication_data_type", source)
    accum = _ds_dtype((user.get("data_types") or {}).get("grad_accum_dtype"), "data_types.grad_accum_dtype", source)
    if enabled == ["torch_autocast"]:
        if str(autocast.get("dtype", "bfloat16")).replace("torch.", "") not in ("bfloat16", "bf16"):
            raise ConfigError(f"{source}: torch_autocast.dtype {autocast['dtype']}: the harness replays autocast in "
                              f"bfloat16 only (the bf16 policy); fp16 is DeepSpeed's fp16 section (the fp16 policy)")
        return PolicyRequest(source, "bf16", reduce_dtype=reduce, grad_accum_dtype=accum)
    if enabled == ["fp16"]:
        scaling = {k: fp16[k] for k in FP16_SCALER_KEYS if k in fp16}
        return PolicyRequest(source, "fp16", reduce_dtype=reduce or "fp16", grad_accum_dtype=accum or "fp16",
                             loss_scaling=scaling, refines_bf16=False)
    master, states = bf16.get("bf16_master_weights_and_grads"), bf16.get("bf16_optimizer_states")
    if bool(master) != bool(states):
        raise ConfigError(f"{source}: bf16_master_weights_and_grads {json.dumps(master)} with bf16_optimizer_states "
                          f"{json.dumps(states)}: the harness's policies keep both in bf16 (bf16_pure) or both in fp32 "
                          f"(bf16_params): set both the same")
    return PolicyRequest(source, "bf16_pure" if master else "bf16_params", reduce_dtype=reduce or "bf16",
                         grad_accum_dtype=accum or "bf16")


def _ds_dtype(value, key: str, source: str) -> str | None:
    if value is None:
        return None
    name = DS_DTYPES.get(str(value).replace("torch.", "").lower())
    if name is None:
        raise ConfigError(f"{source}: {key} {json.dumps(value)} is not a dtype DeepSpeed takes: use fp32, bf16 or fp16")
    return name
