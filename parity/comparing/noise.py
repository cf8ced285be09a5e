"""What a correct run may show: bounds per curve and step, fixed (uncalibrated) or measured from the runs
themselves (calibrated), and the drift test.

A noise reference is the baseline's strategy trained again at a layout that is mathematically the same and
numerically different — DDP on one worker with the whole global batch, DDP with one sample per worker —
recorded with --noise_reference. Its per-step distance from the baseline is how far correct runs drift
apart at this precision, model, data, learning rate and hardware. The envelope is the largest distance of
any reference over steps s ± NOISE_SMOOTHING, never below a floor; a run may differ from the baseline by
NOISE_K × the envelope. Why twins, why two of them, and why K = 20: docs/tolerances.md.

The per-step test (`first_outside`) misses a small steady bias (a weight decay nobody asked for) that stays inside
the envelope at every step, so the drift test looks at windows of steps whose differences keep one sign.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parity.comparing.tolerances import (CALIBRATION_FLOORED, CURVES, DRIFT_K, DRIFT_SAME_SIGN, DRIFT_WINDOW, NOISE_FLOOR, NOISE_K,
                                         NOISE_SMOOTHING, QUANTITIES, Tolerance, tolerance_class)
from parity.comparing.verdict import Outside


@dataclass(frozen=True)
class Bounds:
    """The largest |run − baseline| / |baseline| a correct run may show, per curve and step."""

    per_step: dict[str, list[float]]  # quantity → bound at each step (a quantity without bounds is not judged)
    source: str  # where the bounds came from, in words
    envelope: dict[str, list[float]] | None = None  # calibrated: the noise envelope per step (before NOISE_K)
    held: dict[str, list[str]] | None = None  # quantity → what set its bound at each step, in words (held_by)

    @property
    def calibrated(self) -> bool:
        return self.envelope is not None


def fixed_bounds(tolerance: Tolerance, num_steps: int, source: str, quantities=QUANTITIES,
                 held: str = "the fixed table") -> Bounds:
    """The same tolerance at every step (the uncalibrated table, or the user's --tolerance); `held` names it."""
    judged = [q for q in quantities if tolerance.of(q) is not None]
    return Bounds({q: [tolerance.of(q)] * num_steps for q in judged}, source,
                  held={q: [f"{held}'s {tolerance.of(q):g}"] * num_steps for q in judged})


def calibrated_bounds(baseline: dict[str, list[float]], references: list[dict[str, list[float]]], precision: str,
                      source: str, scales: dict[str, list[float]] | None = None, names: list[str] | None = None
                      ) -> Bounds:
    """NOISE_K × the envelope of the references' distance from the baseline (series per quantity: the curves
    `baseline` holds; `scales`: a curve's floor under |baseline|, relative_diffs'); in a precision of
    CALIBRATION_FLOORED never below the fixed table (its twins miss the AdamW lottery the run may draw). With the
    references' `names`, the source says which one measured the most noise on each curve."""
    kind = tolerance_class(precision)
    floor = NOISE_FLOOR[kind]
    envelope = {q: noise_envelope(baseline[q], [r[q] for r in references], floor.of(q), (scales or {}).get(q))
                for q in baseline}
    fixed = {q: (CURVES[kind].of(q) or 0.0) if kind in CALIBRATION_FLOORED else 0.0 for q in baseline}
    if names and len(names) > 1:
        largest = {q: names[max(range(len(references)), key=lambda i: max(map(abs, relative_diffs(
            references[i][q], baseline[q], (scales or {}).get(q)))))] for q in baseline}
        source += " (the most noise: " + ", ".join(f"{q.replace('_', ' ')} {n}" for q, n in largest.items()) + ")"
    held = {q: [held_by(e, floor.of(q), fixed[q], kind) for e in envelope[q]] for q in baseline}
    return Bounds({q: [max(NOISE_K * e, fixed[q]) for e in envelope[q]] for q in baseline}, source, envelope, held)


def floored(bounds: Bounds, quantity: str, floor: list[float] | None, words: str) -> Bounds:
    """Calibrated `bounds` with `quantity`'s bound never below `floor` (per step; None: unchanged), `words` saying what
    held it where the floor lies above (the parameter norm's: the optimizer's own noise, update_bound.py)."""
    if floor is None or not bounds.calibrated or quantity not in bounds.per_step:
        return bounds
    per_step, held = list(bounds.per_step[quantity]), list((bounds.held or {}).get(quantity, [""] * len(floor)))
    for s, f in enumerate(floor[:len(per_step)]):
        if f > per_step[s]:
            per_step[s], held[s] = f, words
    return Bounds({**bounds.per_step, quantity: per_step}, bounds.source, bounds.envelope,
                  {**(bounds.held or {}), quantity: held})


def held_by(envelope: float, floor: float, fixed: float, kind: str) -> str:
    """What sets a calibrated bound, max(NOISE_K × `envelope`, `fixed`), in words: the noise the references measured;
    the envelope's `floor` where they agreed closer than it; or the fixed table of `kind` where it lies above (fp32's:
    CALIBRATION_FLOORED)."""
    if fixed > NOISE_K * envelope:
        return f"the {kind} table's floor {fixed:g}"
    return f"{NOISE_K} × the noise floor {floor:g}" if envelope <= floor else f"{NOISE_K} × noise"


def relative_diffs(series: list[float], baseline: list[float], scales: list[float] | None = None) -> list[float]:
    """(x − baseline) / |baseline| per step, signed (inf where the baseline is 0 and x is not); with `scales`, divided
    by the larger of |baseline| and the step's scale (a post-training loss that crosses 0 is measured on its own
    scale: parity/comparing/objective.py)."""
    scales = scales or [0.0] * len(baseline)
    return [(x - b) / max(abs(b), c) if b or c else (0.0 if x == b else float("inf"))
            for x, b, c in zip(series, baseline, scales)]


def noise_envelope(baseline: list[float], references: list[list[float]], floor: float,
                   scales: list[float] | None = None) -> list[float]:
    """Per step: the largest |reference − baseline| / |baseline| (relative_diffs) of any reference over steps s ±
    NOISE_SMOOTHING, at least `floor`."""
    return smoothed_envelope([max(abs(d) for d in ds)
                              for ds in zip(*(relative_diffs(r, baseline, scales) for r in references))], floor)


def held_envelope(raw: list[float], floor: float) -> list[float]:
    """The smoothed envelope, never below its value at an earlier step: a tensor's. Each reference's deviation of one
    tensor's norm is signed and crosses zero as the runs wander (three references read 1e-4 at once where they had read
    8e-4 twenty steps before), so a few steps of it under-sample the noise one rounding leaves in that tensor; what
    rounding moved it by once, a correct run may carry from then on (DeepSpeed AutoTP's q_proj.bias in bf16 read 0.84
    of a local envelope's bound at step 90 under oneDNN's AVX2 kernels, 0.22 of this one)."""
    envelope, held = smoothed_envelope(raw, floor), 0.0
    return [held := max(held, e) for e in envelope]


def smoothed_envelope(raw: list[float], floor: float) -> list[float]:
    """Per step s: the largest of `raw` (the references' largest distance from the baseline at each step) over steps
    s ± NOISE_SMOOTHING, at least `floor` — a curve's envelope, and a tensor's (parity.comparing.tensor_verdict)."""
    n = len(raw)
    return [max(floor, *raw[max(0, s - NOISE_SMOOTHING):min(n, s + NOISE_SMOOTHING + 1)]) for s in range(n)]


@dataclass(frozen=True)
class Drift:
    """A window of steps whose differences from the baseline keep one sign, with a mean beyond its bound."""

    last_step: int
    mean_rel_diff: float
    bound: float


def drift_windows(rel_diffs: list[float], envelope: list[float]):
    """Every window of DRIFT_WINDOW steps in which at least DRIFT_SAME_SIGN differences share a sign, as
    (its last step, the mean difference, the window's mean envelope)."""
    for end in range(DRIFT_WINDOW, len(rel_diffs) + 1):
        window = rel_diffs[end - DRIFT_WINDOW:end]
        if max(sum(d > 0 for d in window), sum(d < 0 for d in window)) >= DRIFT_SAME_SIGN:
            yield end - 1, sum(window) / DRIFT_WINDOW, sum(envelope[end - DRIFT_WINDOW:end]) / DRIFT_WINDOW


def first_drift(rel_diffs: list[float], envelope: list[float]) -> Drift | None:
    """The first window (by its last step) of DRIFT_WINDOW steps in which at least DRIFT_SAME_SIGN
    differences share a sign and |their mean| exceeds DRIFT_K × the window's mean envelope."""
    for last, mean, noise in drift_windows(rel_diffs, envelope):
        if not abs(mean) <= DRIFT_K * noise:
            return Drift(last, mean, DRIFT_K * noise)
    return None


def drift_statistic(rel_diffs: list[float], envelope: list[float]) -> float:
    """The drift test's score: the largest |mean difference| ÷ mean envelope of any one-signed window (0 without
    one); the test fails above DRIFT_K."""
    return max((abs(mean) / noise for _, mean, noise in drift_windows(rel_diffs, envelope)), default=0.0)


def noise_ratio(rel_diffs: list[float], envelope: list[float]) -> float:
    """Deviation ÷ noise: the worst step's |difference| over the envelope at that step."""
    return max(abs(d) / e for d, e in zip(rel_diffs, envelope))


def relative_diff(value: float, baseline: float, scale: float = 0.0) -> float:
    if baseline == 0 and not scale:
        return 0.0 if value == 0 else math.inf
    return abs(value - baseline) / max(abs(baseline), scale)


def first_outside(series: dict[str, list[float]], baseline: dict[str, list[float]], bounds: Bounds,
                  scales: dict | None = None) -> Outside | None:
    """The first step at which a curve leaves its bound (loss, then grad norm, then parameter norm; relative to the
    larger of |baseline| and a curve's `scales` at that step), or — calibrated — the end of the first drifting window,
    whichever comes first."""
    per_step, scales = None, scales or {}
    for step in range(len(series["loss"])):
        for quantity, bound in bounds.per_step.items():
            value, base = series[quantity][step], baseline[quantity][step]
            scale = max(abs(base), scales[quantity][step]) if quantity in scales else abs(base)
            if not abs(value - base) <= bound[step] * scale:  # written so that a NaN fails too
                per_step = Outside(quantity=quantity, rel_diff=relative_diff(value, base, scale), tolerance=bound[step],
                                   step=step, value=value, reference=base, test="step")
                break
        if per_step:
            break
    if bounds.calibrated:
        for quantity in bounds.envelope:
            drift = first_drift(relative_diffs(series[quantity], baseline[quantity], scales.get(quantity)),
                                bounds.envelope[quantity])
            if drift and (per_step is None or drift.last_step < per_step.step):
                per_step = Outside(quantity=quantity, rel_diff=abs(drift.mean_rel_diff), tolerance=drift.bound,
                                   step=drift.last_step, test="drift")
    return per_step


def another_layout(base: dict, reference: dict) -> str:
    """The hint for a reference identical to the baseline (configs of both): a data-parallel split of the global
    batch that neither ran at (the reference may already be at one worker)."""
    batch, accum = base["global_batch_size"], base.get("grad_accum_steps") or 1
    taken = {base["dp_size"], reference["dp_size"]}
    workers = next((w for w in range(1, batch + 1) if w not in taken and batch % (w * accum) == 0), None)
    if workers is None:
        return f" — the global batch of {batch} has no other split: judge without a reference (uncalibrated)"
    return f" (e.g. --num_workers {workers} --batch_size {batch // (workers * accum)})"
