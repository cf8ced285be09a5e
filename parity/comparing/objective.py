"""The objective in a comparison: runs of different objectives computed other gradients by definition (not comparable,
never a difference), and a definition that depends on the split (bnpo, an entropy bonus, DPO's sft: a term of each
micro-batch's own) is compared only between runs — a baseline, a run, a noise reference — that split the step into the
same micro-batches (parity.objectives.micro_rows); the report says so in one line."""

from __future__ import annotations

from parity.objectives import describe, invariance_of, micro_rows


def mismatches(base, run) -> list[str]:
    """What keeps `run` (a curves.Run, or a noise reference) from being judged against `base` on its objective: one entry
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
