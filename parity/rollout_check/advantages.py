"""The advantages a trainer used, recomputed from the rollout file's rewards and groups by the estimator its settings
name, and judged row by row (docs/sampler.md#the-advantages). A wrong scale or baseline changes every step's update
while the loss, the gradients and the sampler all look right: the trainer trained faithfully on wrong advantages.

The estimators, each over one generation batch (the rows of one `generation` id: what TRL gathers before it computes
them), by the names the trainers' settings give them:
- GRPO, TRL's `scale_rewards`: "group" (r − the group's mean) ÷ (the group's std + 1e-4), "batch" (÷ the generation
  batch's std + 1e-4), "none" (r − the group's mean, unscaled: Dr. GRPO's);
- "rloo": r − the mean of the group's other rewards (TRL's RLOOTrainer, OpenRLHF's and verl's rloo);
- "reinforce_plus_plus": r whitened over the generation batch, (r − its mean) ÷ (its std + 1e-4) (OpenRLHF, verl).
Standard deviations are torch's (Bessel-corrected), as TRL's. Computed in float64 from the file's float32 rewards; a
trainer's float32 arithmetic stays within ADVANTAGE_RTOL of it.
"""

from __future__ import annotations

import torch

EPSILON = 1e-4  # TRL's, added to a standard deviation before it divides
ADVANTAGE_RTOL = 1e-5  # |recorded − recomputed| ≤ this × max(|recomputed|, the generation batch's largest |advantage|)
ESTIMATORS = ("group", "batch", "none", "rloo", "reinforce_plus_plus")
SETTING_NAMES = ("advantage_estimator", "scale_rewards")  # where a file's settings name its estimator, first found wins


def declared_estimator(settings: dict) -> str | None:
    """The estimator a rollout file's writer settings name (advantage_estimator, or TRL's scale_rewards, whose True
    and False mean group and none), or None where they name none."""
    for key in SETTING_NAMES:
        value = settings.get(key)
        if value is not None:
            return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else str(value)
    return None


def recompute(estimator: str, rewards: torch.Tensor, groups: torch.Tensor, generations: torch.Tensor) -> torch.Tensor:
    """Every row's advantage under `estimator`, float64, each generation batch on its own."""
    rewards = rewards.double()
    out = torch.empty_like(rewards)
    for g in generations.unique():
        batch = generations == g
        out[batch] = _one_batch(estimator, rewards[batch], groups[batch])
    return out


def _one_batch(estimator: str, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    if estimator == "reinforce_plus_plus":
        return (rewards - rewards.mean()) / (rewards.std() + EPSILON)
    centred, spread = torch.empty_like(rewards), torch.ones_like(rewards)
    for g in groups.unique():
        rows = groups == g
        mine = rewards[rows]
        if estimator == "rloo":
            n = len(mine)
            centred[rows] = (mine - (mine.sum() - mine) / max(n - 1, 1)) if n > 1 else torch.zeros_like(mine)
        else:
            centred[rows] = mine - mine.mean()
            spread[rows] = mine.std() if len(mine) > 1 else 0.0
    if estimator == "group":
        return centred / (spread + EPSILON)
    if estimator == "batch":
        return centred / (rewards.std() + EPSILON)
    return centred


def judge(recorded: torch.Tensor, rewards: torch.Tensor, groups: torch.Tensor, generations: torch.Tensor,
          estimator: str) -> dict:
    """The recorded advantages against `estimator`'s: {"estimator", "verdict" PASS/FAIL, "max_deviation" (relative,
    ÷ the bound's scale), "bound", "first_outside" (row, recorded, recomputed) or None, "matches" (the estimators whose
    advantages the recorded ones are, within the bound: the cause where another one is named)}."""
    recomputed = {name: recompute(name, rewards, groups, generations) for name in ESTIMATORS}
    deviation = {name: _deviation(recorded, values, generations) for name, values in recomputed.items()}
    mine = deviation[estimator]
    outside = (mine > ADVANTAGE_RTOL).nonzero().flatten().tolist()
    first = None
    if outside:
        row = outside[0]
        first = {"row": row, "recorded": float(recorded[row]), "recomputed": float(recomputed[estimator][row])}
    return {"estimator": estimator, "verdict": "FAIL" if outside else "PASS", "max_deviation": float(mine.max()),
            "bound": ADVANTAGE_RTOL, "first_outside": first,
            "matches": [name for name, d in deviation.items() if float(d.max()) <= ADVANTAGE_RTOL]}


def _deviation(recorded: torch.Tensor, recomputed: torch.Tensor, generations: torch.Tensor) -> torch.Tensor:
    """|recorded − recomputed| per row ÷ max(|recomputed|, its generation batch's largest |recomputed|, 1e-6)."""
    scale = torch.empty_like(recomputed)
    for g in generations.unique():
        batch = generations == g
        scale[batch] = recomputed[batch].abs().max().clamp_min(1e-6)
    return (recorded.double() - recomputed).abs() / scale


def describe(result: dict) -> str:
    """The advantages' verdict in one line."""
    head = (f"advantages ({result['estimator']}): {result['verdict']}, largest deviation {result['max_deviation']:.2e} "
            f"of the batch's scale (bound {result['bound']:.0e})")
    if result["verdict"] == "PASS":
        return head
    first = result["first_outside"]
    cause = [m for m in result["matches"] if m != result["estimator"]]
    because = (f"; they are the {cause[0]} estimator's advantages, not the declared {result['estimator']}'s"
               if cause else "; no estimator of the harness computes them")
    return (f"{head}; first at row {first['row']}: recorded {first['recorded']:.6g}, {result['estimator']} gives "
            f"{first['recomputed']:.6g}{because}")
