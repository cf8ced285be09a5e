"""The optimizer of a recorded run, described whole for its record (config.optimizer): what the replay rebuilds
(parity/replay/replay.py) and the comparison checks as it checks the other optimizer settings."""

from __future__ import annotations

from parity.training.optimizer import OPTIMIZERS

OPTIMIZER_FLAGS = ("amsgrad", "maximize", "decoupled_weight_decay", "nesterov")  # what changes the update, if set
REPLAYED_OPTIMIZERS = tuple(OPTIMIZERS)  # what the replay builds: AdamW and Adam


def describe_optimizer(view, names: dict[int, str]) -> dict:
    """The optimizer of `view` (parity/views/) whole, its parameters under `names` (view.names(), which the recorder
    reads once): its type and per parameter group the parameters' names, the lr scale (the group's lr ÷ the first
    group's: each group's lr is scale × the step's lr), weight decay, betas, eps, and the flags that change the update
    where set (amsgrad, maximize ...). Its type is the torch optimizer it equals, as the view says
    (View.optimizer_kind: DeepSpeed's FusedAdam is torch's AdamW in one kernel), and each group's parameters the
    module's (View.group_params: ZeRO's optimizer's groups hold flat partitions)."""
    groups = view.optimizer.param_groups
    kind, implementation = view.optimizer_kind()
    firsts = [g.get("initial_lr", g.get("lr", 0.0)) for g in groups]
    described = []
    for group, first, params in zip(groups, firsts, view.group_params()):
        entry = {"params": [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in params],
                 "lr_scale": float(first / firsts[0]) if firsts[0] else 1.0,
                 "weight_decay": float(group.get("weight_decay", 0.0))}
        if "betas" in group:
            entry["betas"] = [float(b) for b in group["betas"]]
        if "momentum" in group:
            entry["momentum"] = float(group["momentum"])
        if "eps" in group:  # (Adafactor's is a pair)
            eps = group["eps"]
            entry["eps"] = [float(e) for e in eps] if isinstance(eps, (tuple, list)) else float(eps)
        flags = {k: group[k] for k in OPTIMIZER_FLAGS if group.get(k)
                 and not (k == "decoupled_weight_decay" and kind == "AdamW")}  # AdamW's own
        if group.get("bias_correction") is False:  # FusedAdam's: torch's always corrects
            flags["bias_correction"] = False
        if flags:
            entry["flags"] = flags
        described.append(entry)
    return {"type": kind, **({"implementation": implementation} if implementation else {}), "groups": described}


def unreplayable(description: dict, recorded: bool = False) -> str | None:
    """Why the replay cannot build the described optimizer (None: it can — AdamW or Adam, without amsgrad and the
    like): the recorder refuses such a run before its first step, the replay (`recorded`) an older record of one."""
    the, kind = "the recorded " if recorded else "the ", description.get("type")
    if kind not in REPLAYED_OPTIMIZERS:
        return f"{the}optimizer is {kind}: the replay builds {' and '.join(REPLAYED_OPTIMIZERS)} only"
    for i, group in enumerate(description["groups"]):
        if group.get("flags"):
            return f"{the}{kind}'s group {i} sets {next(iter(group['flags']))}: the replay builds {kind} without it"
        if "betas" not in group or "eps" not in group:
            return f"{the}{kind}'s group {i} has no betas or eps"
    return None


def applied(groups) -> list[dict]:
    """What each of an optimizer's `groups` applies at a step (read as the step begins): its lr, weight decay, betas
    and eps."""
    return [{"lr": float(g["lr"]), "weight_decay": float(g.get("weight_decay", 0.0)),
             **({"betas": [float(b) for b in g["betas"]]} if "betas" in g else {}),
             **({"eps": float(g["eps"])} if isinstance(g.get("eps"), (int, float)) else {})} for g in groups]


class GroupReadings:
    """What each parameter group applies at a step, read by the optimizer's step pre-hook at each firing (`take`) and
    gathered for the step (`groups`). DeepSpeed's ZeRO-1/2 steps its torch optimizer once a group, its param_groups
    swapped for that group alone: each firing reads one group, placed by identity among the groups the optimizer holds
    outside its step (read at the recorder's start). Groups it does not hold are read as they come."""

    def __init__(self, optimizer):
        self.order = [id(g) for g in optimizer.param_groups]
        self.read: dict[int, dict] = {}

    def take(self, groups) -> None:
        places = [self.order.index(id(g)) if id(g) in self.order else -1 for g in groups]
        if -1 in places:
            self.read = dict(enumerate(applied(groups)))
        else:
            self.read.update(zip(places, applied(groups)))

    def groups(self) -> list[dict] | None:
        """The step's reading, group by group in the optimizer's order (None: the hook did not fire), taken: the next
        step's firings read afresh."""
        read, self.read = self.read, {}
        return [read[k] for k in sorted(read)] if read else None


def departure(description: dict, step_groups: list[dict], first: tuple[int, list[dict]] | None,
              step: int) -> str | None:
    """Why the optimizer a step applies (`applied`) is not the one the replay applies at every step (None: it is):
    each group's lr its recorded scale × the first group's, and its eps and weight decay what they were at the record's
    first step (`first`: that step and its groups, read as this one's were) — a scheduler that moves them trains with
    others than the replay's. Moved betas are not a departure: the record keeps them and the replay follows
    (moved_betas)."""
    lr = step_groups[0]["lr"]
    for group, now in zip(description["groups"], step_groups):
        if lr and abs(now["lr"] - group["lr_scale"] * lr) > 1e-12 * abs(now["lr"]):
            return (f"at step {step} the groups' lrs are not in their recorded ratios (the replay applies each group "
                    f"its recorded scale of the first's)")
    if first is None or len(first[1]) != len(step_groups):
        return None
    for i, (then, now) in enumerate(zip(first[1], step_groups)):
        moved = [k for k in ("eps", "weight_decay") if k in now and now[k] != then.get(k)]
        if moved:
            return (f"at step {step} the optimizer's group {i} applies {moved[0]} {_shown(now[moved[0]])}, not "
                    f"{_shown(then[moved[0]])} as at step {first[0]}: the replay applies one value at every step")
    return None


def moved_betas(description: dict, step_groups: list[dict] | None) -> list[list[float]] | None:
    """Each group's betas as a step applies them (`applied`, read as it began), where any group's are not the
    described ones (None: all are, or the step was not read group by group): a scheduler's — OneCycleLR's and
    CyclicLR's cycle_momentum cycle Adam's β1 — which the step's record entry keeps and the replay follows
    (recorded_betas)."""
    described = description["groups"]
    if step_groups is None or len(step_groups) != len(described) or any("betas" not in g for g in step_groups):
        return None
    betas = [g["betas"] for g in step_groups]
    return betas if betas != [g.get("betas") for g in described] else None


def recorded_betas(record: dict) -> tuple | None:
    """The betas each group applied at each step of `record` (a tuple over its steps of per-group lists): a step's
    own where it kept them (moved_betas), else the described ones; None where no step kept any (one set throughout)."""
    if not any("betas" in s for s in record["steps"]):
        return None
    described = [g["betas"] for g in record["config"]["optimizer"]["groups"]]
    return tuple(s.get("betas", described) for s in record["steps"])


def _shown(value) -> str:
    return f"({', '.join(f'{v:g}' for v in value)})" if isinstance(value, list) else f"{value:g}"
