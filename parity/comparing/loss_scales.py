"""fp16's loss scaler judged from a recorded run's own record (docs/precision.md#the-replay-of-an-fp16-record): a recorder
that records its framework's scaler — megatron-core's (parity/frameworks/megatron/recording.py), torch's GradScaler
(parity/recording/grad_scaler.py: Trainer's, accelerate's, Lightning's, a loop's own): each step's
`loss_scale` (the scale its gradients were computed with) and `skipped`, the scaler's settings and `rules` in the
config's loss_scaling — has it judged exactly, ahead of any tolerance, at the first step where

- a step was applied whose gradients held an inf or a NaN (its recorded pre-clip norm not finite: a step taken on an
  overflow), or skipped whose gradients held none (finite): the recorder reads the gradients where the framework looks
  for the overflow, so its skips must be its gradients';
- a step's scale is not the one its rules give from the settings and the steps skipped before it (the scale grown
  or lowered at the wrong step, the hysteresis not kept).

Its replay follows those skips and scales (parity.training.loss_scaler.FollowedScaler) rather than its own overflows
— at the edge of fp16's range one arithmetic overflows where another does not — and records whether its own
gradients overflowed at the record's scale (`overflowed`): where that is not the record's skip, a note says so and
where (`notes`), the record's own gradients being what its skips are judged by.
"""

from __future__ import annotations

import math

from parity.comparing.verdict import Outside

TEST = "loss_scaler"


def megatron_core(settings: dict, skipped: list[bool]) -> list[float]:
    """The scale of each step by megatron-core's scaler (megatron/core/optimizer/grad_scaler.py), given the steps it
    skipped: a static `loss_scale` throughout; else DynamicGradScaler's — from 2^initial_scale_power, at an overflow
    the growth count restarts and the hysteresis count drops, the scale halving (never below min_loss_scale) once it
    is spent; after `loss_scale_window` good steps in a row the scale doubles and the hysteresis refills."""
    if settings["loss_scale"]:
        return [float(settings["loss_scale"])] * len(skipped)
    scale, growth, hysteresis, scales = 2.0 ** settings["initial_scale_power"], 0, settings["hysteresis"], []
    for skip in skipped:
        scales.append(scale)
        if skip:
            growth, hysteresis = 0, hysteresis - 1
            scale = max(scale / 2, settings["min_loss_scale"]) if hysteresis <= 0 else scale
        else:
            growth += 1
            if growth == settings["loss_scale_window"]:
                growth, hysteresis, scale = 0, settings["hysteresis"], scale * 2
    return scales


def grad_scaler(settings: dict, skipped: list[bool]) -> list[float]:
    """The scale of each step by torch's GradScaler (torch/amp/grad_scaler.py, recorded by recording/grad_scaler.py),
    given the steps it skipped: a static `loss_scale` throughout (a disabled scaler's 1); else from
    2^initial_scale_power (its init_scale), at an overflow × backoff_factor and the growth count restarted, after
    `loss_scale_window` (growth_interval) good steps in a row × growth_factor."""
    if settings["loss_scale"]:
        return [float(settings["loss_scale"])] * len(skipped)
    scale, growth, scales = 2.0 ** settings["initial_scale_power"], 0, []
    for skip in skipped:
        scales.append(scale)
        if skip:
            scale, growth = scale * settings["backoff_factor"], 0
        else:
            growth += 1
            if growth == settings["loss_scale_window"]:
                scale, growth = scale * settings["growth_factor"], 0
    return scales


# a record's loss_scaling["rules"] → (each step's scale from the skips, whose rules they are in the verdict's words)
RULES = {"megatron-core": (megatron_core, "megatron-core's scaler's"), "GradScaler": (grad_scaler, "GradScaler's")}


def first_fault(run, num_steps: int) -> Outside | None:
    """The first step at which a recorded run's loss scaler broke its rules (module docstring), or None — also for a
    run whose record names no rules (the harness's own runs: their scaler is the harness's)."""
    scaling = run.config.get("loss_scaling") or {}
    rules, _ = RULES.get(scaling.get("rules"), (None, None))
    if not run.recorded or rules is None:
        return None
    steps = run.steps[:num_steps]
    skipped = [bool(s.get("skipped")) for s in steps]
    for step, (entry, skip, scale) in enumerate(zip(steps, skipped, rules(scaling, skipped))):
        norm = entry.get("grad_norm")
        if skip == (norm is not None and math.isfinite(norm)):
            return Outside(quantity="skipped", rel_diff=1.0, tolerance=0.0, step=step, value=float(skip),
                           reference=norm, test=TEST)
        got = entry.get("loss_scale")
        if got is None or abs(got - scale) > 1e-6 * scale:  # GradScaler's fp32 arithmetic
            return Outside(quantity="loss_scale", rel_diff=math.inf if got is None else abs(got / scale - 1),
                           tolerance=0.0, step=step, value=got, reference=scale, test=TEST)
    return None


def line(f: Outside, rules: str | None = None) -> str:
    """The verdict's words for first_fault's finding `f`."""
    if f.quantity == "skipped" and f.value:
        return (f"step {f.step}: its loss scaler skipped it, but its gradients held no inf or NaN (pre-clip norm "
                f"{f.reference:.6g}): a skip without an overflow")
    if f.quantity == "skipped":
        return (f"step {f.step}: the step was applied, but its gradients held an inf or a NaN (pre-clip norm "
                f"{f.reference}): a step taken on an fp16 overflow")
    whose = RULES[rules][1] if rules in RULES else "its scaler's"
    return (f"step {f.step}: the loss scale {f.value:g} is not the {f.reference:g} that {whose} rules give "
            f"from its settings and the steps it skipped before: the scale changed at the wrong step")


def notes(base, runs, num_steps: int) -> list[str]:
    """A note for each recorded run whose replay (`base`) overflowed in fp16 at the record's scale where the record
    applied the step, or did not where the record skipped it (module docstring)."""
    found = []
    ours = [s.get("overflowed") for s in base.steps[:num_steps]]
    if all(o is None for o in ours):
        return found
    for run in runs:
        theirs = run.skipped(num_steps)
        over = [k for k, (o, s) in enumerate(zip(ours, theirs)) if o and not s]
        under = [k for k, (o, s) in enumerate(zip(ours, theirs)) if o is False and s]
        if over:
            found.append(f"note: the replay's gradients overflowed in fp16 at {run.name}'s loss scale at step"
                         f"{'s' if len(over) > 1 else ''} {', '.join(map(str, over))}, which {run.name} applied: "
                         f"computed again at a lower scale and applied as it did")
        if under:
            found.append(f"note: the replay's gradients did not overflow in fp16 at {run.name}'s loss scale at step"
                         f"{'s' if len(under) > 1 else ''} {', '.join(map(str, under))}, which {run.name} skipped on "
                         f"its own overflow: skipped as it did")
    return found


__all__ = ["RULES", "TEST", "first_fault", "grad_scaler", "line", "megatron_core", "notes"]
