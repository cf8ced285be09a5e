"""Which trusted loop replays a record (docs/own_trainer/replay.md#the-sharded-replay): the harness's DDP, which holds a whole
replica with its gradients and AdamW's moments on every worker, or — where that would not fit one worker, or where
asked — FSDP2 as pure data parallelism, fully sharded, no TP (the harness holds that layout to DDP: 0 / 2.2e-16 / 0
in fp32), or DeepSpeed's ZeRO-3, the replay offered where the baseline would share FSDP2's own code with the run it
judges (parity.comparing.recorded.replay_lines says so in the report).

The estimate is the model states of one worker, from the recorded config (a meta model: its parameters, the ones that
train), by the ZeRO paper's bound (parity.training.memory.zero_bound): DDP the whole replica and the reducer's copy of
the gradients (docs/benchmark.md: 20 bytes a parameter in fp32), FSDP2 a 1/N share of the 16, ZeRO-3 that and its
fp32 master partition. Activations are not in it: they depend on the rows, and a replay that fits its states and not
its activations fails in its first step, in one line. A worker's memory is its GPU's, or on CPU the machine's shared
by the workers; `--replay_memory` sets it.
"""

from __future__ import annotations

import os
import re

from parity.errors import ConfigError

# replay name → (the harness's strategy, the flags that make it the replay, the words the report says it in)
REPLAYS = {
    "ddp": ("ddp", {}, "the harness's DDP (a whole replica a worker)"),
    "fsdp": ("fsdp", {"tp_size": 1}, "the harness's FSDP2 as pure data parallelism, fully sharded, no TP"),
    "zero3": ("deepspeed", {"zero_stage": 3}, "the harness's DeepSpeed ZeRO-3 as pure data parallelism"),
}
AUTO = "auto"
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size such as 80GiB, 3.5MiB, 1e9 (argparse's type: ValueError names the form)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
    try:
        value = float(match.group(1)) * UNITS[match.group(2).lower()] if match else -1.0
    except (ValueError, KeyError):
        value = -1.0
    if not value > 0:
        raise ValueError(f"not a size (e.g. 80GiB, 512MiB): {text}")
    return int(value)


def size_words(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def worker_memory(device: str, workers: int) -> int | None:
    """What one replay worker may hold: its GPU's memory (each rank its own GPU), or on CPU the machine's ÷ the
    workers, who share it; None where this machine cannot tell (a GPU replay planned on a machine without one)."""
    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // workers


def state_bytes(replay: str, cfg) -> float:
    """One worker's model states under `replay` for the planned replay `cfg` (its model, adapters, precision and
    workers)."""
    from parity.models.adapters import add_adapters
    from parity.models.model import meta_model, model_config_from_dict
    from parity.training.memory import GRADS, OPTIMIZER, PARAMS, zero_bound

    model = add_adapters(meta_model(model_config_from_dict(cfg.model_config)), cfg.lora)
    every = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    stage, workers = (0, 1) if replay == "ddp" else (3, cfg.num_workers)
    params = zero_bound(stage, every, workers, cfg.precision)[PARAMS]
    moved = zero_bound(stage, trained, workers, cfg.precision)
    total = params + moved[GRADS] + moved[OPTIMIZER]
    if replay == "ddp":
        total += moved[GRADS]  # the reducer's flat copy of the gradients
    if replay == "zero3":
        total += 4 * trained / workers  # DeepSpeed's fp32 master partition, even in fp32
    return total


def choose(requested: str, cfg, budget: int | None, record_name: str) -> tuple[str, str]:
    """(the replay, why it was chosen) for the record planned as `cfg` (a DDP replay's plan: its model, workers,
    precision) under `budget` bytes a worker (None: the device's). `requested`: auto (DDP where a replica fits, else
    FSDP2) or a replay's name. ConfigError, one line, where the one asked for — or any, under auto — does not fit."""
    source = "--replay_memory" if budget else f"the {cfg.device}'s"
    budget = budget or worker_memory(cfg.device, cfg.num_workers)
    if budget is None:
        return ("ddp" if requested == AUTO else requested), "this machine cannot tell the workers' memory"
    need = {name: state_bytes(name, cfg) for name in REPLAYS}
    given = f"{size_words(budget)} a worker ({source})"
    if requested != AUTO:
        if need[requested] > budget:
            hint = ("replay it sharded: --replay_strategy fsdp (or leave --replay_strategy out)"
                    if requested == "ddp" and need["fsdp"] <= budget else
                    "replay it at more workers (--num_workers), or record it with --num_layers")
            raise ConfigError(f"--replay_strategy {requested}: {record_name}'s replay would hold "
                              f"{size_words(need[requested])} of model, gradients and AdamW states a worker, over the "
                              f"{given}: {hint}")
        return requested, "asked for"
    if need["ddp"] <= budget:
        return "ddp", f"a replica with its gradients and AdamW states, {size_words(need['ddp'])}, fits the {given}"
    if need["fsdp"] <= budget:
        return "fsdp", (f"a replica with its gradients and AdamW states, {size_words(need['ddp'])}, would not fit the "
                        f"{given}; fully sharded over {cfg.num_workers}, {size_words(need['fsdp'])}")
    raise ConfigError(f"{record_name}'s replay would hold {size_words(need['fsdp'])} of model, gradients and AdamW "
                      f"states a worker even fully sharded over {cfg.num_workers} workers, over the {given}: replay it "
                      f"at more workers (--num_workers), or record it with --num_layers")


__all__ = ["AUTO", "REPLAYS", "choose", "parse_size", "size_words", "state_bytes", "worker_memory"]
