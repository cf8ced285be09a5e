"""The optimizer's own noise in the update's bound: how far a correct run's parameter norms may part from the
baseline's because AdamW turns the gradient noise the references measured into moves of its own — an element's update
flips where its first moment lies within that noise, and one whose gradient history is near zero moves by up to lr —
which the references draw a few of, or none, by chance (docs/tensors.md#the-optimizers-own-noise).

The baseline's series holds, per step and tensor, the table of its AdamW (parity/training/update_noise.py): per
element-noise level x (in rms gradients), Σ_i (p̂_i · move_i)². Here, per tensor i and step k, the level is
x = ELEMENT_NOISE × the references' gradient envelope of that tensor at k (the tensor verdict's, before NOISE_K),
taken as a share of the tensor's own gradient norm; the table read there (log-log between its levels). The parameters
keep each step's move, and a table holds every move so far, read at the element's value now (update_noise.py):

    σ_s,i = √(table_s,i(x_s,i)),   bound_s,i = OPTIMIZER_NOISE_K × σ_s,i / the update deviation's denominator

(A record from before holds each step's increment, its move read at that step: σ_s,i = √(Σ_{k ≤ s} table_k,i(x_k,i)).)

The tensor verdict's update bound is the larger of this and what the references drew (NOISE_K × their envelope); the
parameter norm's curve takes the tensors' together (each tensor's σ weighted by its share of the global norm).
"""

from __future__ import annotations

import math

from parity.comparing import tolerances  # OPTIMIZER_NOISE_K read at use: tools/seeded_before_after.py sets it
from parity.comparing.tolerances import ELEMENT_NOISE
from parity.training.update_noise import GRID

_LOG_GRID = [math.log10(x) for x in GRID]


def read(row: list[float], x: float) -> float:
    """A table's `row` at the noise level `x`: log-log between its levels, as x³ up from a level where no element was
    flip-prone (their number grows as x, each one's move² as x²); below the first as x²; above the last in proportion
    to x (the flip-prone elements grow with the noise, each one's move saturates)."""
    if not x > 0 or not any(row):
        return 0.0
    if x <= GRID[0]:
        return row[0] * (x / GRID[0]) ** 2
    if x >= GRID[-1]:
        return row[-1] * x / GRID[-1]
    lx = math.log10(x)
    j = next(i for i in range(1, len(GRID)) if _LOG_GRID[i] >= lx)
    a, b = row[j - 1], row[j]
    if a <= 0:  # no element flip-prone at the level below
        return b * (x / GRID[j]) ** 3
    t = (lx - _LOG_GRID[j - 1]) / (_LOG_GRID[j] - _LOG_GRID[j - 1])
    return 10 ** (math.log10(a) + t * (math.log10(b) - math.log10(a)))


def sigmas(tables: list, grad_norms: list[list[float]], envelopes: list[list[float]], scales: list[float],
           num_steps: int, carried: bool = True) -> list[list[float]] | None:
    """σ_s,i (module docstring; absolute, in the parameter norm's units) per step [s][i] from the baseline's `tables`
    (TensorSeries.update_noise), its tensors' gradient norms, the references' gradient envelopes per tensor [i][s]
    (relative to max(‖g‖, `scales`[s]): the tensor verdict's deviation) — None where the baseline holds no tables.
    `carried`: each step's table is its whole variance, read at that step's level; else (a record from before) each
    step's increment, added up over the steps."""
    if tables is None or any(t is None for t in tables[:num_steps]):
        return None
    names = len(grad_norms[0]) if grad_norms else 0
    total, out = [0.0] * names, []
    for s in range(num_steps):
        for i in range(names):
            g = grad_norms[s][i]
            x = ELEMENT_NOISE * envelopes[i][s] * max(g, scales[s]) / g if g > 0 else GRID[-1]
            total[i] = read(tables[s][i], x) + (0.0 if carried else total[i])
        out.append([math.sqrt(v) for v in total])
    return out


def tensor_bounds(sigma: list[list[float]], denominators: list[list[float]]) -> list[list[float]]:
    """Per step [s][i]: OPTIMIZER_NOISE_K × σ over the update deviation's denominator (0 where it is 0)."""
    k = tolerances.OPTIMIZER_NOISE_K
    return [[k * x / d if d else 0.0 for x, d in zip(row, den)] for row, den in zip(sigma, denominators)]


def global_bounds(sigma: list[list[float]], param_norms: list[list[float]]) -> list[float]:
    """Per step: OPTIMIZER_NOISE_K × the global parameter norm's σ (each tensor's weighted by ‖p_i‖ / ‖P‖, its share of
    the global norm's move) over ‖P‖."""
    out, k = [], tolerances.OPTIMIZER_NOISE_K
    for row, norms in zip(sigma, param_norms):
        total = math.sqrt(sum(p * p for p in norms))
        out.append(k * math.sqrt(sum((p / total * x) ** 2 for p, x in zip(norms, row))) / total
                   if total else 0.0)
    return out
