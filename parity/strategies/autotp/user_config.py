"""A user's own --deepspeed_config: read on the driver (the workers get its content with the run), checked against the
keys the run's flags decide and the keys the comparison owns, and read for the precision policy its bf16 / fp16 /
torch_autocast sections ask for. Apart from the strategy because it is the one place where a DeepSpeed config written
by someone else enters the run: what it may change and what it may not is decided here, and nowhere else.
"""

from __future__ import annotations

import os

from parity.errors import ConfigError
from parity.precision import LOSS_SCALING_DEFAULTS, PolicyRequest


# The keys the run's flags decide: a user's --deepspeed_config must agree with them. (flag, path, value from the
# run's settings); `settings` has the flags as attributes and the strategy's options in .options.
OWNED_KEYS = (
    ("--batch_size / --grad_accum_steps", ("train_micro_batch_size_per_gpu",),
     lambda s: s.batch_size // s.grad_accum_steps),
    ("--grad_accum_steps", ("gradient_accumulation_steps",), lambda s: s.grad_accum_steps),
    ("--max_grad_norm", ("gradient_clipping",), lambda s: s.max_grad_norm),
    ("--zero_stage", ("zero_optimization", "stage"), lambda s: s.options["zero_stage"]),
    ("--tp_size", ("tensor_parallel", "autotp_size"), lambda s: s.tp_size),
)


# Keys a user config may not hold at all: the harness's shared AdamW, lr schedule and global batch are the
# comparison's.
REFUSED_KEYS = {"optimizer": "the shared torch AdamW", "scheduler": "the shared warm-up schedule (--warmup_steps)",
                "train_batch_size": "--batch_size × DP (DeepSpeed counts TP ranks into it)"}


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
    (default: the parameters' dtype). None when it enables none of them (the run's --precision decides)."""
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
            raise ConfigError(f"{source}: torch_autocast.dtype {autocast['dtype']}: the harness's autocast policy is "
                              f"bf16 (--precision bf16); fp16 is --precision fp16 (DeepSpeed's fp16 section)")
        return PolicyRequest(source, "bf16", reduce_dtype=reduce, grad_accum_dtype=accum)
    if enabled == ["fp16"]:
        scaling = {k: fp16[k] for k in FP16_SCALER_KEYS if k in fp16}
        return PolicyRequest(source, "fp16", reduce_dtype=reduce or "fp16", grad_accum_dtype=accum or "fp16",
                             loss_scaling=scaling, refines_bf16=False)
    master, states = bf16.get("bf16_master_weights_and_grads"), bf16.get("bf16_optimizer_states")
    if bool(master) != bool(states):
        raise ConfigError(f"{source}: bf16_master_weights_and_grads {json_text(master)} with bf16_optimizer_states "
                          f"{json_text(states)}: the harness's policies keep both in bf16 (bf16_pure) or both in fp32 "
                          f"(bf16_params): set both the same")
    return PolicyRequest(source, "bf16_pure" if master else "bf16_params", reduce_dtype=reduce or "bf16",
                         grad_accum_dtype=accum or "bf16")


def json_text(value) -> str:
    import json

    return json.dumps(value)


def _ds_dtype(value, key: str, source: str) -> str | None:
    if value is None:
        return None
    name = DS_DTYPES.get(str(value).replace("torch.", "").lower())
    if name is None:
        raise ConfigError(f"{source}: {key} {json_text(value)} is not a dtype DeepSpeed takes: use fp32, bf16 or fp16")
    return name


def user_config(option) -> tuple[str, dict]:
    """(path, content) of --deepspeed_config: a path to read (on the driver), or what read_user_config made of one
    (a recorded run's options: {"file", "config"}). ConfigError for a file that cannot be read."""
    import json

    if isinstance(option, dict):
        return option["file"], option["config"]
    path = option
    try:
        with open(path) as f:
            user = json.load(f)
    except OSError as exc:
        raise ConfigError(f"--deepspeed_config {path} cannot be read ({exc.strerror}): give the path of a JSON "
                          f"file") from None
    except ValueError as exc:
        raise ConfigError(f"--deepspeed_config {path} is not valid JSON ({exc}): fix the file") from None
    if not isinstance(user, dict):
        raise ConfigError(f"--deepspeed_config {path} holds a {type(user).__name__}, not a JSON object of "
                          f"DeepSpeed's settings")
    return path, user


def read_user_config(option, settings) -> dict:
    """--deepspeed_config: the JSON file read on the driver (the workers get its content with the run, so the file
    need not exist where they run), checked against the run's flags. {"file", "config"}; ConfigError for a file
    that cannot be read or a key that contradicts a flag. (Its precision keys decided the run's policy already:
    config_policy.)"""
    import json

    path, user = user_config(option)
    for key, why in REFUSED_KEYS.items():
        if key in user:
            raise ConfigError(f"--deepspeed_config {path} sets \"{key}\": the run's comes from {why}: drop the key")
    for flag, path_keys, value in OWNED_KEYS:
        node = user
        for key in path_keys:
            node = node.get(key, _ABSENT) if isinstance(node, dict) else _ABSENT
        want = value(settings)
        if node is not _ABSENT and node != want and not (path_keys == ("tensor_parallel", "autotp_size") and
                                                        want == 1 and node in (0, 1)):
            raise ConfigError(f"--deepspeed_config {path}: {'.'.join(path_keys)} {json.dumps(node)} contradicts "
                              f"{flag} ({json.dumps(want)} for this run): set it with the flag (for the baseline too), "
                              f"or drop the key")
    return {"file": os.path.abspath(path), "config": user}


_ABSENT = object()


def given_config(options: dict) -> dict:
    """The user's --deepspeed_config content, as validate read it (empty without one)."""
    return (options.get("deepspeed_config") or {}).get("config", {})
