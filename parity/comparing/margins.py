"""How close a run came to FAILing: per check, its largest deviation ÷ that check's bound (a FAIL is above 1). The
clean matrix (tools/kernel_matrix.py, docs/tolerances.md#the-clean-matrix) holds every capability's worst to 0.5 on
every kernel path; curve_comparison.json carries them per run ("bound_ratios").

The checks: the curves at each step (|run − baseline| ÷ the step's bound), the drift test (its statistic ÷ DRIFT_K,
calibrated), the tensor verdict (its largest point per phase), the teacher-forced check (its worst tensor) and a
post-training run's quantities (objective.ratios).
"""

from __future__ import annotations

from parity.comparing import objective, teacher_forced
from parity.comparing.noise import drift_statistic, relative_diffs
from parity.comparing.tolerances import DRIFT_K


def bound_ratios(c, r) -> dict[str, float]:
    """{check: the largest deviation ÷ bound} of result `r` (a curves.CurveResult) in comparison `c`; a check that did
    not run is absent."""
    skipped = c.baseline.skipped(c.num_steps)  # the grad norm is not judged where the baseline skipped a step
    series, base = ({q: [0.0 if q == "grad_norm" and skip else v for v, skip in zip(c.series(run, q), skipped)]
                     for q in c.quantities} for run in (r.run, c.baseline))
    scales = objective.scales(c.baseline, c.num_steps)
    found = {}
    for q, bounds in r.bounds.per_step.items():
        rel = relative_diffs(series[q], base[q], scales.get(q))
        found[q] = max((abs(d) / b if b else (0.0 if d == 0 else float("inf")) for d, b in zip(rel, bounds)),
                       default=0.0)
        if r.bounds.calibrated and q in r.bounds.envelope:
            found[f"{q} drift"] = drift_statistic(rel, r.bounds.envelope[q]) / DRIFT_K
    if r.tensors is not None and r.tensors.taken:
        found.update({f"tensor {phase}": point.ratio for phase, point in r.tensors.largest.items()})
    checked = teacher_forced.summary(r.run.record)
    ratios = [check["ratio"] for check in (checked or {}).get("checks", []) if check["ratio"] is not None]
    if ratios:
        found["teacher_forced"] = max(ratios)
    found.update({f"objective {name}": ratio for name, ratio in
                  objective.ratios(c.baseline, r.run, c.num_steps, r.bounds.per_step["loss"], c.references).items()})
    return found


def worst(ratios: dict[str, float]) -> tuple[str, float]:
    """(the check, its ratio) of the largest ratio, or ("none", 0) where no check ran."""
    return max(ratios.items(), key=lambda kv: kv[1], default=("none", 0.0))
