"""A user's own --deepspeed_config: read on the driver (the workers get its content with the run), checked against the
keys the run's flags decide and the keys the comparison owns (its bf16 / fp16 / torch_autocast sections ask for the
run's policy: parity/deepspeed_precision.py, which reads a user's engine's config too). Apart from the strategy
because it is the one place where a DeepSpeed config written by someone else enters the run: what it may change and
what it may not is decided here, and nowhere else.
"""

from __future__ import annotations

import os

from parity.errors import ConfigError


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
    deepspeed_precision.config_policy.)"""
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
