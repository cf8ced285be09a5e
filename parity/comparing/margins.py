"""How close a run came to FAILing: per check, its largest deviation ÷ that check's bound (a FAIL is above 1). The
clean matrix (tools/kernel_matrix.py, docs/tolerances.md#the-clean-matrix) holds every capability's worst to 0.5 on
every kernel path; curve_comparison.json carries them per run ("bound_ratios").

The checks: the curves at each step (|run − baseline| ÷ the step's bound), the drift test (its statistic ÷ DRIFT_K,
calibrated), the tensor verdict (its largest point per phase), the teacher-forced check (its worst tensor) and a
post-training run's quantities (objective.ratios). A curve's bound is what held at its step — NOISE_K × the noise, or
a floor — and bounds_held says which, so that a margin is read against the bound that held, not against the noise
alone ("bounds_held", "margin").
"""

from __future__ import annotations

import math

from parity.comparing import objective, teacher_forced
from parity.comparing.noise import drift_statistic, relative_diffs
from parity.comparing.tolerances import DRIFT_K


def curve_diffs(c, r) -> dict[str, list[float]]:
    """Each judged curve's signed relative difference from the baseline's at every compared step (relative_diffs; the
    grad norm taken as 0 where the baseline skipped a step, as the verdict does)."""
    skipped = c.baseline.skipped(c.num_steps)  # the grad norm is not judged where the baseline skipped a step
    series, base = ({q: [0.0 if q == "grad_norm" and skip else v for v, skip in zip(c.series(run, q), skipped)]
                     for q in c.quantities} for run in (r.run, c.baseline))
    scales = objective.scales(c.baseline, c.num_steps)
    return {q: relative_diffs(series[q], base[q], scales.get(q)) for q in r.bounds.per_step}


def bounds_held(c, r) -> dict[str, dict]:
    """Per judged curve of result `r` in comparison `c`, at the step where it came closest to its bound: {"ratio": its
    deviation ÷ that bound, "step", "bound", "held": what set the bound there, in words — NOISE_K × the noise, the noise
    floor, or a fixed table's floor (noise.held_by)}. A calibrated bound is the larger of NOISE_K × the noise and a
    floor, so deviation ÷ noise alone may read near NOISE_K where a floor held with room (an fp32 grad norm at 19.5 ×
    noise used 0.0047 of the table's 1e-4)."""
    found = {}
    for q, rel in curve_diffs(c, r).items():
        bounds, held = r.bounds.per_step[q], (r.bounds.held or {}).get(q)
        ratios = [abs(d) / b if b and math.isfinite(d) else (0.0 if d == 0 else float("inf"))  # NaN: beyond any
                  for d, b in zip(rel, bounds)]
        step = max(range(len(ratios)), key=ratios.__getitem__, default=None)
        if step is not None:
            found[q] = {"ratio": ratios[step], "step": step, "bound": bounds[step],
                        "held": held[step] if held else "its bound"}
    return found


def curves_margin(held: dict[str, dict]) -> tuple[float | None, str | None]:
    """(how many times the curves' worst deviation fits under the bound that held there, that curve), from
    bounds_held; (None, None) where no curve moved (bit-identical) or none was judged."""
    q = max(held, key=lambda k: held[k]["ratio"], default=None)
    return (1.0 / held[q]["ratio"], q) if q is not None and held[q]["ratio"] > 0 else (None, None)


def bound_ratios(c, r) -> dict[str, float]:
    """{check: the largest deviation ÷ bound} of result `r` (a curves.CurveResult) in comparison `c`; a check that did
    not run is absent."""
    found, held = {}, bounds_held(c, r)
    for q, rel in curve_diffs(c, r).items():
        found[q] = held[q]["ratio"] if q in held else 0.0
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
