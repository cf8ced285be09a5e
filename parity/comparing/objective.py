"""The objective in a comparison: runs of different objectives computed other gradients by definition (not comparable,
never a difference), and a definition that depends on the split (bnpo, an entropy bonus, DPO's sft: a term of each
micro-batch's own) is compared only between runs — a baseline, a run, a noise reference — that split the step into the
same micro-batches (parity.objectives.micro_rows); the report says so in one line.

A post-training run's own per-step quantities (each step's "objective" entry: the KL to the reference, the mean
ratio, the clipped fractions, the entropy, DPO's rewards, margin and accuracy) are held to the baseline's at every step
(`first_outside`), beside the curves: a continuous one within the loss's bound at that step × max(|the baseline's|,
1), a fraction of discrete decisions (clipped, accurate) within one decision of the baseline's (1 ÷ the tokens, rows or
pairs it counts) plus that bound; calibrated, never below NOISE_K × the quantity's own noise in the references. A
GRPO-family loss, which crosses 0 where the advantages cancel, is measured on its own scale (`scales`: the mean
|advantage|) where |the baseline's| is smaller.

A decision whose margin lies within its own rounding is a tie (parity/objectives/ties.py: DPO's step 0, where the
policy is its reference, is all ties), which either run may decide either way: a discrete quantity's one decision
becomes 1 + the ties counted at that step (the larger count of the two runs), and a step at which every decision is
a tie in either run does not judge it; the report says so in one line a run (`tie_notes`). A record without ties
counts (older ones) keeps one decision."""

from __future__ import annotations

from parity.comparing.noise import smoothed_envelope
from parity.comparing.tolerances import NOISE_K
from parity.comparing.verdict import Outside
from parity.objectives import describe, invariance_of, micro_rows
from parity.objectives.ties import SUFFIX

TEST = "objective"  # Outside.test of a quantity's FAIL
DISCRETE = {"clipped_fraction": "scored", "clipped_low": "scored", "clipped_high": "scored", "accuracy": "pairs"}
# what the quantities are counted over, the loss's scale, and each discrete quantity's ties: not judged themselves
COUNTS = ("tokens", "scored", "pairs", "advantage_scale", *(name + SUFFIX for name in DISCRETE))
NOUNS = {"scored": "ratios", "pairs": "pairs"}  # a discrete quantity's decisions, in the report


def mismatches(base, run) -> list[str]:
    """What keeps `run` (a run.Run, or a noise reference) from being judged against `base` on its objective: one entry
    naming both, or none."""
    a, b = base.config.get("objective"), run.config.get("objective")
    if a != b:
        return [f"{base.name} and {run.name} train different objectives ({describe(a)} vs {describe(b)}): train both "
                f"with one --objective and --objective_args"]
    invariance = invariance_of(a)
    rows_a, rows_b = micro_rows(base.config), micro_rows(run.config)
    if invariance.depends_on_split and rows_a != rows_b:
        return [f"{a['name']} depends on the split by definition ({'; '.join(invariance.split_terms)}): {base.name} "
                f"feeds micro-batches of {rows_a} rows, {run.name} of {rows_b}: train both at one split (--batch_size "
                f"÷ micro-batches)"]
    return []


def notes(base) -> list[str]:
    """The report's line for a baseline whose objective depends on the split, or none."""
    objective = base.config.get("objective")
    line = invariance_of(objective).note(objective["name"]) if objective else None
    return [f"note: {line} ({micro_rows(base.config)} rows a micro-batch)"] if line else []


def first_outside(base, run, num_steps: int, loss_bounds: list[float], references=()) -> Outside | None:
    """The first step at which one of `run`'s objective quantities leaves its bound around `base`'s (the module
    docstring), or None; runs without quantities (the causal LM) have none to hold. With noise `references` (runs of
    the baseline's at other layouts) a quantity's bound is also at least NOISE_K × its own noise, as a calibrated
    curve's: in bf16 the KL and the entropy carry the logits' rounding, which the loss does not show."""
    for step, name, value, reference, bound in _judged(base, run, num_steps, loss_bounds, references):
        if not abs(value - reference) <= bound:  # (a NaN fails too)
            return Outside(quantity=name, rel_diff=abs(value - reference), tolerance=bound, step=step, value=value,
                           reference=reference, test=TEST)
    return None


def ratios(base, run, num_steps: int, loss_bounds: list[float], references=()) -> dict[str, float]:
    """Each judged quantity's largest |difference| ÷ bound over the steps (first_outside's bounds; above 1 FAILs)."""
    found: dict[str, float] = {}
    for _, name, value, reference, bound in _judged(base, run, num_steps, loss_bounds, references):
        ratio = abs(value - reference) / bound if bound else (0.0 if value == reference else float("inf"))
        found[name] = max(found.get(name, 0.0), ratio)
    return found


def _judged(base, run, num_steps: int, loss_bounds: list[float], references):
    """(step, quantity, run's value, baseline's, bound) of every quantity judged at every step, in order."""
    noise = _noise(base, references, num_steps)
    for step in range(num_steps):
        ours, theirs = (r.steps[step].get("objective") or {} for r in (run, base))
        for name in sorted(set(ours) & set(theirs) - set(COUNTS)):
            value, reference = ours[name], theirs[name]
            own = NOISE_K * noise[name][step] if name in noise else 0.0
            bound = max(loss_bounds[step], own) * max(abs(reference), 1.0)
            if name in DISCRETE:
                tied, every = tie_count(ours, theirs, name)
                if every:
                    continue
                bound += (1.0 + tied) / max(theirs.get(DISCRETE[name], 1.0), 1.0)
            yield step, name, value, reference, bound


def tie_count(ours: dict, theirs: dict, name: str) -> tuple[float, bool]:
    """A discrete quantity's ties at one step (the larger count of the two runs' quantities), and whether every
    decision of either run was one (then it is not judged there); (0, False) for records without ties counts."""
    counted = [(q[name + SUFFIX], q.get(DISCRETE[name], 0.0)) for q in (ours, theirs) if name + SUFFIX in q]
    return max((t for t, _ in counted), default=0.0), any(0 < n <= t for t, n in counted)


def tie_notes(base, runs, num_steps: int) -> list[str]:
    """The report's line for each run whose discrete quantities had ties at some step, or none."""
    lines = []
    for run in runs:
        found = []
        for name in DISCRETE:
            steps = []
            for step in range(num_steps):
                ours, theirs = (r.steps[step].get("objective") or {} for r in (run, base))
                tied, every = tie_count(ours, theirs, name) if name in ours and name in theirs else (0.0, False)
                steps += [f"{tied:g} of {theirs.get(DISCRETE[name], 0.0):g} {NOUNS[DISCRETE[name]]} at step {step}"
                          f"{' (not judged there)' if every else ''}"] if tied else []
            more = f", and at {len(steps) - 3} more steps" if len(steps) > 3 else ""
            found += [f"{name.replace('_', ' ')} {', '.join(steps[:3])}{more}"] if steps else []
        if found:
            lines.append(f"note: {run.name}: the objective's ties (decisions within their rounding, each widening its "
                         f"bound by one decision): {'; '.join(found)}")
    return lines


def _noise(base, references, num_steps: int) -> dict[str, list[float]]:
    """Each quantity's envelope over the references: per step the largest |reference − baseline| ÷ max(|baseline|, 1)
    of any reference, over steps s ± NOISE_SMOOTHING (noise.smoothed_envelope)."""
    found: dict[str, list[float]] = {}
    for ref in references:
        for step in range(num_steps):
            ours, theirs = (r.steps[step].get("objective") or {} for r in (ref, base))
            for name in set(ours) & set(theirs) - set(COUNTS):
                raw = found.setdefault(name, [0.0] * num_steps)
                raw[step] = max(raw[step], abs(ours[name] - theirs[name]) / max(abs(theirs[name]), 1.0))
    return {name: smoothed_envelope(raw, 0.0) for name, raw in found.items()}


def line(f: Outside, base: str) -> str:
    """A quantity's FAIL in words."""
    return (f"step {f.step}: the objective's {f.quantity.replace('_', ' ')} {f.value:.6g} vs {base} {f.reference:.6g}, "
            f"|difference| {f.rel_diff:.3e} > {f.tolerance:.3e} (the loss's bound at that step × the quantity's scale)")


def scales(base, num_steps: int) -> dict[str, list[float]]:
    """{"loss": each step's scale} for a GRPO-family baseline: the mean |advantage| of its rows. Its loss sums
    advantage-weighted terms and crosses 0 where they cancel (grpo's mean over rows of −A at step 0, on-policy: ~1e-8),
    so a run's loss is measured relative to the larger of |the baseline's| and that scale; {} for any other."""
    found = [(s.get("objective") or {}).get("advantage_scale") for s in base.steps[:num_steps]]
    return {"loss": found} if found and all(v is not None for v in found) else {}
