"""Every tensor of a run against the baseline, per phase (its gradient norm, its parameter norm after the step), and
against the per-tensor noise of the baseline's references: the measurements that choose the per-tensor bounds
(docs/tensors_measured.md) and the calibration study's per-tensor false alarms and detections.

Each tensor's two curves are measured as the three global curves are — relative_diffs and noise_envelope of
parity.comparing.noise, the envelope per tensor from the references' own series of that tensor, never below the
phase's floor — so a ratio here is what NOISE_K × the per-tensor envelope would judge. Beside it, each deviation as a
share of the baseline's global norm of that phase (|Δ‖g_t‖| / ‖g‖): where a correct run's noise lands among the
tensors (which element AdamW amplifies) changes from run to run, while its share of the whole does not as much.
"""

from __future__ import annotations

from dataclasses import dataclass

from parity.comparing.noise import noise_envelope, relative_diffs
from parity.comparing.tolerances import NOISE_FLOOR, tolerance_class
from parity.training.tensor_norms import GRADIENT, UPDATE
from parity.training.tensor_series import TensorSeries

PHASES = {GRADIENT: "grad_norm", UPDATE: "param_norm"}
"""A phase → the TensorSeries field and the record's global curve of the same quantity."""


@dataclass(frozen=True)
class TensorDeviation:
    """One tensor in one phase of a run against the baseline, per step: the signed relative difference, its share of
    the baseline's global norm, and (with references) the per-tensor noise envelope."""

    phase: str
    name: str
    rel_diffs: list[float]
    shares: list[float]
    envelope: list[float] | None = None

    @property
    def max_rel(self) -> float:
        return max(abs(d) for d in self.rel_diffs)

    @property
    def max_share(self) -> float:
        return max(self.shares)

    @property
    def ratios(self) -> list[float]:
        """Deviation ÷ noise per step (the envelope's)."""
        return [abs(d) / e for d, e in zip(self.rel_diffs, self.envelope)]

    def first_above(self, k: float) -> int | None:
        """The first step whose deviation exceeds k × the envelope."""
        return next((s for s, r in enumerate(self.ratios) if not r <= k), None)


def tensor_curves(series: TensorSeries, phase: str) -> dict[str, list[float]]:
    """Each tensor's curve of one phase: name → its norm at every step."""
    rows = getattr(series, PHASES[phase])
    return {name: [row[i] for row in rows] for i, name in enumerate(series.names)}


def deviations(run: TensorSeries, base: TensorSeries, base_steps: list[dict], references: list[TensorSeries] = (),
               floors: dict[str, float] | None = None) -> list[TensorDeviation]:
    """Every tensor of `run` in both phases against `base` (whose record's steps are `base_steps`, for the global
    norms), with the per-tensor envelope of `references` never below `floors[phase]` where references are given.
    Tensors in the baseline's order; a tensor the baseline lacks is an error of the caller (runs of one model)."""
    out = []
    for phase, key in PHASES.items():
        mine, theirs = tensor_curves(run, phase), tensor_curves(base, phase)
        refs = [tensor_curves(r, phase) for r in references]
        totals = [s[key] for s in base_steps]
        for name, baseline in theirs.items():
            diffs = relative_diffs(mine[name], baseline)
            shares = [abs(x - b) / t for x, b, t in zip(mine[name], baseline, totals)]
            envelope = noise_envelope(baseline, [r[name] for r in refs], floors[phase]) if refs else None
            out.append(TensorDeviation(phase, name, diffs, shares, envelope))
    return out


def first_outside(measured: list[TensorDeviation], k: float) -> TensorDeviation | None:
    """The tensor first outside k × its envelope: the earliest step, then the order measured (gradients before
    updates, the model's order) — what a verdict names."""
    found = [(step, i, d) for i, d in enumerate(measured) if (step := d.first_above(k)) is not None]
    return min(found, key=lambda x: x[:2])[2] if found else None


def phase_floors(precision: str) -> dict[str, float]:
    """The per-tensor envelope's floor per phase: the global curves' (a tensor's norm is the global one's part)."""
    floor = NOISE_FLOOR[tolerance_class(precision)]
    return {GRADIENT: floor.grad_norm, UPDATE: floor.param_norm}
