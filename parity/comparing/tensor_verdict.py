"""The tensor verdict: every trainable tensor's gradient norm (phase "gradient", as the record holds it: before
clipping) and parameter norm after the step (phase "update") of a run, at every step, held against the baseline's,
each with bounds of its own.

Why: a bug confined to one tensor — a norm weight's or a q_proj's gradient doubled, an expert's gradient counted twice
under EP, a router's gradient wrong — moves the loss by ~1e-7 and the global grad norm by that tensor's share only (4–8
× its fp32 bound, no tensor named; in bf16 nothing, inside 20 × the twins' noise), while AdamW divides a tensor's
constant scale away from the parameters. Per tensor the same bug reads 1.0 (docs/tensors.md).

The deviation of a tensor at a step is |x − baseline| / max(|baseline|, TENSOR_FLOOR × the baseline's global norm at
that step) (parity.comparing.tolerances says why the floor). Its bound: calibrated on the noise references the curves
use, from their own series — NOISE_K × the envelope of their deviations over steps s ± NOISE_SMOOTHING, held at its
largest so far (noise.held_envelope), never below TENSOR_NOISE_FLOOR (parity.comparing.noise's logic, per tensor) —
else the fixed TENSORS table by precision (in fp32 also a floor under the calibrated bound). Not judged:
the gradient at the steps the baseline skipped on an fp16 overflow (as the curves), frozen parameters (in no series).
The point named — at the first step any point is outside, the one furthest outside its bound (`first_outside`) —
FAILs the run whatever the curves say: curves.py takes it with the curves' and the
teacher-forced check's, the earliest step first, at one step the curves'.

Both runs' series must name the same tensors and hold the same gradient (pre-clip, or a recorded run's clipped one
against its replay's clipped one): else the comparison is refused (`mismatches`). A run whose record holds no series (a
strategy or a recorder's layout that hands over no pieces: its record says why), or whose series folder was not copied
beside it, is not judged here: one line says why, and the curves' verdict stands.

The summary per run (curve_comparison.json's against_baseline.<run>.tensors; `TensorVerdict.to_dict`): {"taken",
"why", "calibrated", "source", "gradient", "tensors", "steps", "first_outside", "largest" (per phase), "matrix"; for a
FAIL also "replay_command" and "localise", the layer check of its step: curve_report.write_outputs}; each point
{"step", "tensor", "phase", "value", "reference", "deviation", "bound", "ratio"}. The matrix is the report page's
heatmap: tensors (model order) × columns of steps (one step each, or bins of several when there are many), each cell
the largest deviation ÷ bound over its steps and both phases, with where it was ({"tensors", "phases", "columns":
[[first, last]], "ratio": [[...]], "at": [[[step, phase index, value, reference]]]}).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from parity import storage
from parity.comparing import clip_read, update_bound
from parity.comparing.noise import held_envelope
from parity.comparing import tolerances  # OPTIMIZER_NOISE_K read at use: tools/seeded_before_after.py sets it
from parity.comparing.tolerances import (ADAM_SIGN_FLIP, CALIBRATION_FLOORED, NOISE_K, TENSOR_FLOOR,
                                         TENSOR_NOISE_FLOOR, TENSORS, looser_precision, tolerance_class)
from parity.comparing.verdict import Outside
from parity.training.tensor_norms import AT_CLIP, AT_OPTIMIZER, GRADIENT, PRE_CLIP, READ_AT, UPDATE
from parity.training.tensor_series import KEY as SERIES_KEY, TensorSeries, load_series

KEY = "tensors"  # curve_comparison.json's entry per run
TEST = "tensors"  # Outside.test of a FAIL
PHASES = (GRADIENT, UPDATE)  # in the order a step's points are judged
SERIES_OF = {GRADIENT: "grad_norm", UPDATE: "param_norm"}  # TensorSeries' attribute per phase
NOUNS = {GRADIENT: "gradient norm", UPDATE: "parameter norm after the step"}
GRADIENTS = {PRE_CLIP: "pre-clip"}  # how a series' gradient is named in words (else its own name: "clipped")
# The heatmap's columns: one per step up to MATRIX_COLUMNS, else bins of steps; fewer for many tensors, so that the page
# holds at most ~MATRIX_CELLS cells (never fewer than MIN_COLUMNS columns): 1000 steps × 30 tensors is 40 bins of 25
# steps × 30 tensors, ~250 kB of the page.
MATRIX_COLUMNS, MATRIX_CELLS, MIN_COLUMNS = 40, 2000, 10


@dataclass(frozen=True)
class Point:
    """One tensor at one step in one phase: the run's norm, the baseline's, the deviation and its bound."""

    step: int
    tensor: str
    phase: str
    value: float
    reference: float
    deviation: float
    bound: float

    @property
    def ratio(self) -> float:
        """Deviation ÷ bound (a NaN deviation: infinite, outside)."""
        return math.inf if math.isnan(self.deviation) else self.deviation / self.bound if self.bound else math.inf

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


@dataclass(frozen=True)
class TensorVerdict:
    """One run's tensor verdict against the baseline, or why none was taken (`why`)."""

    why: str | None = None
    calibrated: bool = False
    source: str = ""
    gradient: str = PRE_CLIP
    tensors: tuple[str, ...] = ()
    steps: int = 0
    first: Point | None = None  # the first point outside
    largest: dict[str, Point] | None = None  # per phase: the point of largest deviation ÷ bound
    matrix: dict | None = None
    read_at: str = AT_CLIP  # where the run's gradients were read (tensor_norms.READ_AT)
    clip_gap: Outside | None = None  # the record's own invariant, whatever the baseline's: clip_read.first_gap

    @property
    def taken(self) -> bool:
        return self.why is None

    def first_fail(self) -> Outside | None:
        """The first point outside as the verdict's point outside (curves.py takes the earliest of the checks', the
        record's own invariant, `clip_gap`, ahead of any tolerance)."""
        f = self.first
        return None if f is None else Outside(quantity=f.phase, rel_diff=f.deviation, tolerance=f.bound, step=f.step,
                                              module=f.tensor, value=f.value, reference=f.reference, test=TEST)

    def to_dict(self) -> dict:
        gap = {"clip_read": self.clip_gap.to_dict() if self.clip_gap else None, "read_at": self.read_at}
        if not self.taken:  # (its own invariant where the run has a series and it parts)
            return {"taken": False, "why": self.why, **(gap if self.clip_gap else {})}
        return {"taken": True, "why": None, "calibrated": self.calibrated, "source": self.source,
                "gradient": self.gradient, "tensors": len(self.tensors), "steps": self.steps,
                "first_outside": self.first.to_dict() if self.first else None,
                "largest": {phase: p.to_dict() for phase, p in self.largest.items()}, "matrix": self.matrix, **gap}


def read(run) -> TensorSeries | str:
    """The run's series (a run.Run), or in words why it has none: its record holds none (and says why), or the
    series folder was not copied beside it. RecordError for a record of another schema or a damaged folder."""
    entry, name = run.record.get(SERIES_KEY), storage.name(run.file)
    if isinstance(entry, dict) and entry.get("names") == []:
        return f"{name} holds no tensor series: {entry.get('why') or 'its run measured none'}"
    if isinstance(entry, dict) and isinstance(entry.get("folder"), str) and \
            not storage.is_dir(storage.join(storage.parent(run.file), entry["folder"])):
        return f"{name}'s tensor series ({entry['folder']}) is not beside it: copy that folder with the record"
    return load_series(run.file, run.record)


def mismatches(base, run, series: dict) -> list[str]:
    """Why `run`'s series cannot be held against the baseline's (empty: they can, or either has none): other tensors
    named, or another gradient (pre-clip against clipped). `series`: read() by record file."""
    a, b = series[base.file], series[run.file]
    if isinstance(a, str) or isinstance(b, str):
        return []
    if set(a.names) != set(b.names):
        only = lambda x, y: ", ".join(sorted(set(x.names) - set(y.names), key=name_order)) or "none"  # noqa: E731
        return [f"{base.name} and {run.name} record different tensors in their series (only {base.name}'s: "
                f"{only(a, b)}; only {run.name}'s: {only(b, a)}): both hold the model's trainable parameters under "
                f"their Hugging Face names"]
    if a.grad != b.grad:
        return [f"{base.name}'s tensor series holds {_gradient_words(a.grad)} gradients and {run.name}'s "
                f"{_gradient_words(b.grad)} ones: they differ by the clip coefficient wherever a step clips; a recorded "
                f"run whose series holds the clipped gradients is compared with a replay whose series holds them "
                f"clipped too"]
    return []


def judge(base, run, references: list, series: dict, num_steps: int, judged: bool = True) -> TensorVerdict:
    """`run` against the baseline `base` over `num_steps` steps (run.Run each), calibrated on those `references`
    whose series are there; `judged` False for a run the curves do not judge (another precision policy)."""
    if not judged:
        return TensorVerdict(why="the run is in another precision policy than the baseline's: not judged")
    theirs, mine = series[base.file], series[run.file]
    if isinstance(mine, str):
        return TensorVerdict(why=mine)
    own = {"read_at": mine.read_at, "clip_gap": clip_read.first_gap(run, mine)}
    if isinstance(theirs, str):
        return TensorVerdict(why=f"the baseline has none to hold it against ({theirs})", **own)
    skipped = base.skipped(num_steps)
    points = {phase: _points(mine, theirs, phase, num_steps) for phase in PHASES}
    bounds, calibrated, source = _bounds(base, run, references, series, num_steps, skipped)
    order = sorted(range(len(theirs.names)), key=lambda i: name_order(theirs.names[i]))
    judged_points = [Point(s, theirs.names[i], phase, *points[phase][s][i], bounds[phase][s][i])
                     for s in range(num_steps) for phase in PHASES if not (phase == GRADIENT and skipped[s])
                     for i in order]
    first = first_outside(judged_points)
    largest = {phase: max((p for p in judged_points if p.phase == phase), key=lambda p: p.ratio,
                          default=Point(0, theirs.names[0], phase, 0.0, 0.0, 0.0, 1.0)) for phase in PHASES}
    return TensorVerdict(None, calibrated, source, theirs.grad, tuple(theirs.names), num_steps, first, largest,
                         heat_matrix(theirs.names, judged_points, num_steps), **own)


def name_order(name: str) -> list:
    """A tensor name's sort key with its numbers by value (model.layers.2 before model.layers.10)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def deviation(value: float, reference: float, scale: float) -> float:
    """|value − reference| / max(|reference|, scale): the relative difference, floored (`scale`: TENSOR_FLOOR × the
    step's global norm); with a denominator of 0 (both norms 0 at that step), 0 where the value is 0 too, else
    infinite."""
    denominator = max(abs(reference), scale)
    if denominator == 0:
        return 0.0 if value == reference else math.inf
    return abs(value - reference) / denominator


def _points(run: TensorSeries, base: TensorSeries, phase: str, num_steps: int) -> list[list[tuple]]:
    """Per step, per tensor in the baseline's order: (the run's norm, the baseline's, the deviation)."""
    rows, base_rows = getattr(run, SERIES_OF[phase]), getattr(base, SERIES_OF[phase])
    where = [run.names.index(name) for name in base.names]
    out = []
    for s in range(num_steps):
        ref = base_rows[s]
        scale = TENSOR_FLOOR[phase] * math.sqrt(sum(x * x for x in ref))
        out.append([(rows[s][j], r, deviation(rows[s][j], r, scale)) for j, r in zip(where, ref)])
    return out


def _bounds(base, run, references: list, series: dict, num_steps: int, skipped: list[bool]) -> tuple:
    """(bounds per phase [step][tensor] in the baseline's order, calibrated, their source in words). Calibrated: NOISE_K
    × each tensor's envelope, in a precision of CALIBRATION_FLOORED never below the fixed table; else the fixed table."""
    usable = [r for r in references if not isinstance(series[r.file], str)]
    looser = looser_precision(base.precision, run.precision)
    theirs = series[base.file]
    fixed = _fixed_bounds(base, theirs, looser, num_steps)
    if usable:
        kind = tolerance_class(base.precision)
        names = len(theirs.names)
        envelopes = {phase: envelopes_of(theirs, [series[r.file] for r in usable], phase, num_steps, skipped, kind)
                     for phase in PHASES}
        sigma = optimizer_sigmas(theirs, envelopes[GRADIENT], num_steps)
        least = {phase: fixed[phase] if kind in CALIBRATION_FLOORED else [[0.0] * names] * num_steps
                 for phase in PHASES}
        if sigma is not None:  # the optimizer's own noise (update_bound.py), a floor under the update's bound
            denominators = [[d for *_, d in row] for row in _scales(theirs, UPDATE, num_steps)]
            least[UPDATE] = [[max(a, b) for a, b in zip(x, y)] for x, y in
                             zip(least[UPDATE], update_bound.tensor_bounds(sigma, denominators))]
        bounds = {phase: [[max(NOISE_K * envelopes[phase][i][s], least[phase][s][i]) for i in range(names)]
                          for s in range(num_steps)] for phase in PHASES}
        floored = f", never below the fixed {kind} table" if kind in CALIBRATION_FLOORED else ""
        optimizer = (f", the update never below {tolerances.OPTIMIZER_NOISE_K} × its optimizer's own noise"
                     if sigma is not None else "")
        return bounds, True, (f"calibrated: {NOISE_K} × the noise of "
                              f"{', '.join(storage.name(r.file) for r in usable)}, per tensor{floored}{optimizer}")
    why = ("no noise reference" if not references else
           f"the noise references hold no tensor series ({'; '.join(series[r.file] for r in references)})")
    return fixed, False, f"the fixed {looser} table; uncalibrated: {why}"


def envelopes_of(base: TensorSeries, references: list[TensorSeries], phase: str, num_steps: int,
                 skipped: list[bool], kind: str) -> list[list[float]]:
    """Per tensor [i][s], the references' envelope of a phase's deviation from the baseline (held_envelope, floored at
    TENSOR_NOISE_FLOOR of the precision class `kind`); the gradient's 0 at the steps the baseline skipped."""
    refs = [_points(ref, base, phase, num_steps) for ref in references]
    raw = [[0.0 if phase == GRADIENT and skipped[s] else max(ref[s][i][2] for ref in refs) for s in range(num_steps)]
           for i in range(len(base.names))]
    return [held_envelope(per_step, TENSOR_NOISE_FLOOR[kind][phase]) for per_step in raw]


def parameter_norm_floor(base, references: list, series: dict, num_steps: int) -> tuple[list[float] | None, str]:
    """(per step, the parameter norm curve's bound from the baseline's optimizer noise — update_bound.global_bounds at
    its references' gradient envelopes —, its words); None where the baseline's series holds no table or no reference
    has a series."""
    theirs, usable = series[base.file], [series[r.file] for r in references if not isinstance(series[r.file], str)]
    words = f"{tolerances.OPTIMIZER_NOISE_K} × the optimizer's own noise"
    if isinstance(theirs, str) or theirs is None or not usable or theirs.update_noise is None:
        return None, words
    envelopes = envelopes_of(theirs, usable, GRADIENT, num_steps, base.skipped(num_steps),
                             tolerance_class(base.precision))
    sigma = optimizer_sigmas(theirs, envelopes, num_steps)
    return (None if sigma is None else update_bound.global_bounds(sigma, theirs.param_norm[:num_steps])), words


def optimizer_sigmas(base: TensorSeries, gradient_envelopes: list[list[float]], num_steps: int):
    """update_bound.sigmas of the baseline's series at its references' gradient envelopes (None: it holds no table)."""
    scales = [TENSOR_FLOOR[GRADIENT] * math.sqrt(sum(x * x for x in base.grad_norm[s])) for s in range(num_steps)]
    return update_bound.sigmas(base.update_noise, base.grad_norm, gradient_envelopes, scales, num_steps,
                               base.update_noise_carried)


def _scales(base: TensorSeries, phase: str, num_steps: int) -> list[list[tuple]]:
    """Per step, per tensor: (its norm, the deviation's denominator max(|norm|, TENSOR_FLOOR × the global norm))."""
    rows = getattr(base, SERIES_OF[phase])
    out = []
    for s in range(num_steps):
        scale = TENSOR_FLOOR[phase] * math.sqrt(sum(x * x for x in rows[s]))
        out.append([(x, max(abs(x), scale)) for x in rows[s]])
    return out


def _fixed_bounds(base, theirs: TensorSeries, precision: str, num_steps: int) -> dict:
    """The fixed table's bounds per phase [step][tensor]; in fp32 the update's at least ADAM_SIGN_FLIP × the largest lr
    so far over the deviation's denominator: each element whose AdamW update flips sign moves its tensor's norm by up to
    2 lr, whatever the element's size (tolerances.TENSORS)."""
    names = len(theirs.names)
    bounds = {phase: [[TENSORS[precision][phase]] * names for _ in range(num_steps)] for phase in PHASES}
    if precision == "fp32":
        rows, peak = theirs.param_norm, 0.0
        for s in range(num_steps):
            peak = max(peak, abs(base.steps[s].get("lr") or 0.0))
            scale = TENSOR_FLOOR[UPDATE] * math.sqrt(sum(x * x for x in rows[s]))
            bounds[UPDATE][s] = [max(b, ADAM_SIGN_FLIP * peak / d) if (d := max(abs(x), scale)) else b
                                 for b, x in zip(bounds[UPDATE][s], rows[s])]
    return bounds


def first_outside(points: list[Point]) -> Point | None:
    """The point to name: at the earliest step any point is outside its bound, the one furthest outside (a NaN
    deviation: outside). Not the first in the model's order: a bug in one tensor moves the gradient of every tensor
    backpropagation reaches before it — the aux loss's gradient dropped moves the embedding's gradient 9.6 × its fp32
    bound and the router's 1989 × (docs/tensors_measured.md) — and the tensor it is in moves most."""
    outside = [p for p in points if not p.deviation <= p.bound]  # written so that a NaN fails too
    if not outside:
        return None
    step = min(p.step for p in outside)  # ratios alike to rounding (a scale on every tensor) go to the earlier phase
    return max((p for p in outside if p.step == step), key=lambda p: _rounded(p.ratio, 9))  # and model order


def heat_matrix(names: list[str], points: list[Point], num_steps: int) -> dict:
    """The report page's heatmap (the module docstring's shape): per tensor and column of steps, the largest deviation
    ÷ bound over the column's judged points, rounded, and where it was."""
    most = max(MIN_COLUMNS, min(MATRIX_COLUMNS, MATRIX_CELLS // max(len(names), 1)))
    width = max(1, math.ceil(num_steps / most))
    columns = [[first, min(first + width, num_steps) - 1] for first in range(0, num_steps, width)]
    row = {name: i for i, name in enumerate(names)}
    cells: list[list[Point | None]] = [[None] * len(columns) for _ in names]
    for p in points:
        i, c = row[p.tensor], p.step // width
        if cells[i][c] is None or p.ratio > cells[i][c].ratio:
            cells[i][c] = p
    return {"tensors": list(names), "phases": list(PHASES), "columns": columns,
            "ratio": [[None if p is None else _rounded(p.ratio, 3) for p in r] for r in cells],
            "at": [[None if p is None else [p.step, PHASES.index(p.phase), _rounded(p.value, 6),
                                            _rounded(p.reference, 6)] for p in r] for r in cells]}


def describe(found: dict, baseline: str) -> str:
    """The terminal's one line on a run's tensor verdict (to_dict's summary; `baseline`: its name in words), and where
    its gradients were read when that is not at the norm the run clips by (tensor_norms.READ_AT)."""
    where = found.get("read_at", AT_CLIP)
    return _verdict_words(found, baseline) + ("" if where in (AT_CLIP, AT_OPTIMIZER) else
                                              f"; its gradients read {READ_AT.get(where, where)}")


def _verdict_words(found: dict, baseline: str) -> str:
    if not found["taken"]:
        return f"tensor verdict not taken: {found['why']}"
    judged = "calibrated" if found["calibrated"] else "uncalibrated"
    f = found["first_outside"]
    if f is not None:
        return (f"tensor verdict: FAIL at step {f['step']}: {f['tensor']}, phase {f['phase']}: its "
                f"{NOUNS[f['phase']]} {f['value']:.6e} vs {baseline} {f['reference']:.6e}, deviation "
                f"{f['deviation']:.3e} > bound {f['bound']:.3e} ({f['ratio']:.3g} × its bound; {judged})")
    largest = "largest deviation ÷ bound: " + "; ".join(f"{phase} {p['ratio']:.2g}, {p['tensor']} at step {p['step']}"
                                                        for phase, p in found["largest"].items())
    if all(p["deviation"] == 0 for p in found["largest"].values()):
        largest = f"bit-identical to {baseline}'s"
    return (f"tensor verdict: PASS: {found['tensors']} tensors' gradient and parameter norms within their bounds at each "
            f"of {found['steps']} steps ({largest}; {judged})")


def _gradient_words(kind: str) -> str:
    return GRADIENTS.get(kind, kind)


def _rounded(x: float, digits: int) -> float:
    """`x` to `digits` significant digits (the JSON's matrix is for the eye; its exact values are the series')."""
    return float(f"{x:.{digits}g}") if math.isfinite(x) else x
