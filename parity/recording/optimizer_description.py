"""The optimizer of a recorded run, described whole for its record (config.optimizer): what the replay rebuilds
(parity/replay/replay.py) and the comparison checks as it checks the other optimizer settings."""

from __future__ import annotations

import torch

OPTIMIZER_FLAGS = ("amsgrad", "maximize", "decoupled_weight_decay", "nesterov")  # what changes the update, if set


def describe_optimizer(optimizer, names: dict[int, str], group_params: list[list] | None = None) -> dict:
    """The optimizer whole: its type and per parameter group the parameters' names, the lr scale (the group's lr ÷ the
    first group's: each group's lr is scale × the step's lr), weight decay, betas, eps, and the flags that change the
    update where set (amsgrad, maximize ...). `group_params`: each group's module parameters, where the optimizer's
    groups hold others (ZeRO's flat partitions)."""
    groups = optimizer.param_groups
    group_params = group_params or [g["params"] for g in groups]
    firsts = [g.get("initial_lr", g.get("lr", 0.0)) for g in groups]
    described = []
    for group, first, params in zip(groups, firsts, group_params):
        entry = {"params": [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in params],
                 "lr_scale": float(first / firsts[0]) if firsts[0] else 1.0,
                 "weight_decay": float(group.get("weight_decay", 0.0))}
        if "betas" in group:
            entry["betas"] = [float(b) for b in group["betas"]]
        if "momentum" in group:
            entry["momentum"] = float(group["momentum"])
        if "eps" in group:
            entry["eps"] = float(group["eps"])
        flags = {k: group[k] for k in OPTIMIZER_FLAGS if group.get(k)
                 and not (k == "decoupled_weight_decay" and isinstance(optimizer, torch.optim.AdamW))}  # AdamW's own
        if flags:
            entry["flags"] = flags
        described.append(entry)
    return {"type": type(optimizer).__name__, "groups": described}
