"""Every tensor of a run against the baseline, per phase (its gradient norm, its parameter norm after the step), and
against the per-tensor noise of the baseline's references: the measurements that choose the per-tensor bounds
(docs/tensors_measured.md) and the calibration study's per-tensor false alarms and detections.

Each tensor's two curves are measured as the three global curves are — relative_diffs and noise_envelope of
parity.comparing.noise, the envelope per tensor from the references' own series of that tensor, never below the
phase's floor — so a ratio here is what NOISE_K × the per-tensor envelope would judge.
"""

from __future__ import annotations

from dataclasses import dataclass

from parity.comparing.noise import noise_envelope, relative_diffs
from parity.comparing.tolerances import NOISE_FLOOR, tolerance_class
from parity.training.tensor_norms import GRADIENT, UPDATE
from parity.training.tensor_series import TensorSeries

PHASES = {GRADIENT: "grad_norm", UPDATE: "param_norm"}
"""A phase → its TensorSeries field."""


@dataclass(frozen=True)
class TensorDeviation:
    """One tensor in one phase of a run against the baseline, per step: the signed relative difference and the
    per-tensor noise envelope."""

    phase: str
    name: str
    rel_diffs: list[float]
    envelope: list[float]

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


def deviations(run: TensorSeries, base: TensorSeries, references: list[TensorSeries],
               floors: dict[str, float]) -> list[TensorDeviation]:
    """Every tensor of `run` in both phases against `base`, with the per-tensor envelope of `references` never below
    `floors[phase]`. Tensors in the baseline's order (runs of one model: every run names the same tensors)."""
    out = []
    for phase in PHASES:
        mine, theirs = tensor_curves(run, phase), tensor_curves(base, phase)
        refs = [tensor_curves(r, phase) for r in references]
        for name, baseline in theirs.items():
            envelope = noise_envelope(baseline, [r[name] for r in refs], floors[phase])
            out.append(TensorDeviation(phase, name, relative_diffs(mine[name], baseline), envelope))
    return out


def first_outside(measured: list[TensorDeviation], k: float) -> TensorDeviation | None:
    """The tensor to name: at the earliest step any tensor is outside k × its envelope, the one furthest outside.
    Not the first in the model's order: a bug in one tensor moves the gradients of every tensor backpropagation reaches
    before it (the aux loss's dropped gradient moves the embedding's too, measured: 190 × its bound in fp32, the router's
    far more), and the tensor it is in moves most."""
    found = [(step, -d.ratios[step], d) for d in measured if (step := d.first_above(k)) is not None]
    return min(found, key=lambda x: x[:2])[2] if found else None


def phase_floors(precision: str) -> dict[str, float]:
    """The per-tensor envelope's floor per phase: the global curves' (a tensor's norm is the global one's part)."""
    floor = NOISE_FLOOR[tolerance_class(precision)]
    return {GRADIENT: floor.grad_norm, UPDATE: floor.param_norm}
