"""Comparing loss records: invariants first, then statistics, tolerances and one verdict per run.

A loss difference says something about a strategy only if nothing else differed, so before any number
every run is checked against the baseline: same initial weights, same model, same optimizer settings,
same number of steps, and at every step the same batch, tokens and learning rate. A run that differs is
reported as not comparable (`NotComparable`), never as a loss diff.

The verdict is per step, on the loss and on the pre-clip grad norm: |x - baseline| <= rtol · |baseline| at
every step, with rtol from parity.comparing.tolerances (the looser precision of the pair) unless given.
The grad norm is in it because AdamW is (up to eps) invariant to the gradient's scale: a gradient reduced
twice, not averaged over DP, or clipped differently barely moves the loss but moves the norm.
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import asdict, dataclass

from parity.comparing import tolerances
from parity.comparing.tolerances import Tolerance
from parity.comparing.verdict import Outside, Verdict, verdict_word
from parity.errors import ConfigError, NotComparable
from parity.registry import label
from parity.training.record import load_record

QUANTITIES = ("loss", "grad_norm")
# Optimizer settings recorded in the config that change the numbers (the lr is compared per step).
OPTIMIZER_SETTINGS = ("max_grad_norm", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")
# Per-step entries every run must share with the baseline: (field, what differs, in words).
STEP_INVARIANTS = (("batch_hash", "see different batches"), ("tokens", "train on different tokens per step"),
                   ("lr", "use different learning rates"))


@dataclass(frozen=True)
class Run:
    """One loss record, named by its strategy."""

    file: str
    record: dict

    @property
    def name(self) -> str:
        return self.record["strategy"]

    @property
    def config(self) -> dict:
        return self.record["config"]

    @property
    def steps(self) -> list[dict]:
        return self.record["steps"]

    @property
    def complete(self) -> bool:
        return self.record["complete"]

    @property
    def precision(self) -> str:
        return self.config["precision"]

    @property
    def label(self) -> str:
        return f"{label(self.name)} (TP={self.config['tp_size']}, DP={self.config['dp_size']})"


@dataclass(frozen=True)
class CurveStats:
    initial: float
    final: float
    min: float
    mean: float

    @classmethod
    def of(cls, values: list[float]) -> "CurveStats":
        return cls(values[0], values[-1], min(values), sum(values) / len(values))


@dataclass(frozen=True)
class DiffStats:
    """A run's curve minus the baseline's: largest and mean absolute step difference, and the last one."""

    max_abs: float
    mean_abs: float
    final: float

    @classmethod
    def of(cls, values: list[float], baseline: list[float]) -> "DiffStats":
        diffs = [v - b for v, b in zip(values, baseline)]
        return cls(max(abs(d) for d in diffs), sum(abs(d) for d in diffs) / len(diffs), diffs[-1])


@dataclass(frozen=True)
class CurveResult:
    """One run against the baseline: its verdict, the tolerance it was judged by, and its differences."""

    run: Run
    tolerance: Tolerance
    verdict: Verdict
    diffs: dict[str, DiffStats]  # "loss" and "grad_norm": this run's curve minus the baseline's


@dataclass(frozen=True)
class Comparison:
    baseline: Run
    runs: list[Run]  # the baseline first, then the others by name
    num_steps: int  # compared steps: all of them, or those every run has done with --allow_incomplete
    results: list[CurveResult]  # one per run but the baseline, in `runs` order
    warnings: list[str]

    @property
    def passed(self) -> bool:
        return all(r.verdict.passed for r in self.results)

    @property
    def word(self) -> str:
        return verdict_word(self.passed)

    def series(self, run: Run, key: str) -> list[float]:
        return _series(run, key, self.num_steps)

    def curve_stats(self, run: Run, key: str) -> CurveStats:
        return CurveStats.of(self.series(run, key))

    def to_dict(self) -> dict:
        """Everything the printed block says, machine-readable (curve_comparison.json)."""
        return {
            "baseline": self.baseline.name, "num_steps": self.num_steps, "verdict": self.word,
            "warnings": self.warnings,
            "runs": {r.name: {"label": r.label, "file": os.path.basename(r.file), "complete": r.complete,
                              "steps_recorded": len(r.steps), "precision": r.precision,
                              "tp_size": r.config["tp_size"], "dp_size": r.config["dp_size"],
                              "loss": asdict(self.curve_stats(r, "loss")),
                              "grad_norm": asdict(self.curve_stats(r, "grad_norm"))} for r in self.runs},
            "against_baseline": {r.run.name: {**r.verdict.to_dict(), "tolerance": asdict(r.tolerance),
                                              **{f"{key}_diff": asdict(d) for key, d in r.diffs.items()}}
                                 for r in self.results},
        }


def load_runs(input_dir: str) -> list[Run]:
    """Every loss_*.json in `input_dir`, validated. Raises ConfigError (RecordError for a bad record)."""
    if not os.path.isdir(input_dir):
        raise ConfigError(f"--input_dir {input_dir} is not a directory")
    paths = sorted(glob.glob(os.path.join(input_dir, "loss_*.json")))
    if not paths:
        raise ConfigError(f"no loss_*.json in {input_dir}: run the train_*.py scripts with "
                          f"--loss_output_dir {input_dir} first")
    runs, by_name = [], {}
    for path in paths:
        run = Run(path, load_record(path))
        if run.name in by_name:
            raise ConfigError(f"{os.path.basename(by_name[run.name].file)} and {os.path.basename(path)} are both "
                              f"{run.name} runs: keep one of them in {input_dir}")
        by_name[run.name] = run
        runs.append(run)
    return runs


def compare(runs: list[Run], baseline: str = "ddp", rtol: float | None = None,
            allow_incomplete: bool = False, grad_norm_rtol: float | None = None) -> Comparison:
    """Check every run against the baseline, then measure it. `rtol` / `grad_norm_rtol` override the
    precision tolerances for the loss / the grad norm."""
    base, others = _split_baseline(runs, baseline)
    num_steps = min(len(r.steps) for r in runs)
    warnings = _incomplete_warnings(runs, allow_incomplete, num_steps)
    mismatches = [m for run in others for m in comparability_mismatches(base, run)]
    if mismatches:
        raise NotComparable(mismatches)
    results = [_result(base, run, num_steps, *tolerance_for(base, run, rtol, grad_norm_rtol)) for run in others]
    return Comparison(base, [base, *others], num_steps, results, warnings)


def comparability_mismatches(base: Run, run: Run) -> list[str]:
    """What differs between two runs besides the strategy, each naming both runs (empty: comparable)."""
    a, b = base.name, run.name
    found = []
    sha_a, sha_b = base.config["init_weights_sha256"], run.config["init_weights_sha256"]
    if sha_a != sha_b:
        found.append(f"{a} and {b} start from different initial weights (init_weights_sha256 {sha_a[:12]}… vs "
                     f"{sha_b[:12]}…): train both from the same --init_weights_path")
    model_a, model_b = base.config["model_config"], run.config["model_config"]
    for what, differing in (("train different models", _differing(model_a, model_b, sorted(model_a | model_b))),
                            ("use different optimizer settings",
                             _differing(base.config, run.config, OPTIMIZER_SETTINGS))):
        if differing:
            found.append(f"{a} and {b} {what} ({differing})")
    if base.complete and run.complete and len(base.steps) != len(run.steps):
        found.append(f"{a} has {len(base.steps)} steps, {b} has {len(run.steps)}: train both with the same "
                     f"--debug_steps")
    for field, what in STEP_INVARIANTS:
        for sa, sb in zip(base.steps, run.steps):
            if sa[field] != sb[field]:
                found.append(f"{a} and {b} {what} from step {sa['step']} ({field} {sa[field]} vs {sb[field]})")
                break
    return found


def tolerance_for(base: Run, run: Run, rtol: float | None = None,
                  grad_norm_rtol: float | None = None) -> tuple[Tolerance, str]:
    """(tolerance, where it came from): the given overrides, else the looser of the runs' precisions."""
    if rtol is not None and grad_norm_rtol is not None:
        return Tolerance(rtol, grad_norm_rtol), "--tolerance, --grad_norm_tolerance"
    try:
        looser = tolerances.looser_precision(base.precision, run.precision)
    except ConfigError as exc:
        odd = base if base.precision not in tolerances.PRECISION_ORDER else run
        raise ConfigError(f"{os.path.basename(odd.file)}: {exc}") from None
    source = f"precision {looser} ({base.name} {base.precision}, {run.name} {run.precision})"
    if rtol is not None:
        source = f"--tolerance; grad norm from {source}"
    elif grad_norm_rtol is not None:
        source = f"{source}; --grad_norm_tolerance"
    table = tolerances.CURVES[looser]
    return Tolerance(table.loss if rtol is None else rtol,
                     table.grad_norm if grad_norm_rtol is None else grad_norm_rtol), source


def relative_diff(value: float, baseline: float) -> float:
    if baseline == 0:
        return 0.0 if value == 0 else math.inf
    return abs(value - baseline) / abs(baseline)


def first_outside(series: dict[str, list[float]], baseline: dict[str, list[float]],
                  tolerance: Tolerance) -> Outside | None:
    """The first step at which the loss, then the grad norm, leaves its envelope."""
    for step in range(len(series["loss"])):
        for quantity in QUANTITIES:
            value, base, rtol = series[quantity][step], baseline[quantity][step], tolerance.of(quantity)
            if not abs(value - base) <= rtol * abs(base):  # written so that a NaN fails too
                return Outside(quantity=quantity, rel_diff=relative_diff(value, base), tolerance=rtol, step=step,
                               value=value, reference=base)
    return None


def _result(base: Run, run: Run, num_steps: int, tolerance: Tolerance, source: str) -> CurveResult:
    series = {key: _series(run, key, num_steps) for key in QUANTITIES}
    baseline = {key: _series(base, key, num_steps) for key in QUANTITIES}
    max_rel = {key: max(relative_diff(x, b) for x, b in zip(series[key], baseline[key])) for key in QUANTITIES}
    verdict = Verdict(run.name, base.name, source, max_rel, first_outside(series, baseline, tolerance))
    return CurveResult(run, tolerance, verdict, {key: DiffStats.of(series[key], baseline[key]) for key in QUANTITIES})


def _series(run: Run, key: str, num_steps: int) -> list[float]:
    return [step[key] for step in run.steps[:num_steps]]


def _split_baseline(runs: list[Run], baseline: str) -> tuple[Run, list[Run]]:
    by_name = {r.name: r for r in runs}
    input_dir = os.path.dirname(runs[0].file)
    if baseline not in by_name:
        raise ConfigError(f"no baseline run '{baseline}' in {input_dir}: found {', '.join(sorted(by_name))}; "
                          f"pass --baseline with one of them")
    others = [by_name[name] for name in sorted(by_name) if name != baseline]
    if not others:
        raise ConfigError(f"only the baseline run ({baseline}) in {input_dir}: nothing to compare it with")
    return by_name[baseline], others


def _incomplete_warnings(runs: list[Run], allow_incomplete: bool, num_steps: int) -> list[str]:
    """Partial runs are compared over the steps every run has, and only when asked for."""
    incomplete = [r for r in runs if not r.complete]
    if incomplete and not allow_incomplete:
        r = incomplete[0]
        raise ConfigError(f"{os.path.basename(r.file)} is incomplete ({len(r.steps)} of "
                          f"{r.config['total_steps']} steps: still running, or it stopped early): "
                          f"pass --allow_incomplete to compare the steps done so far")
    return [f"warning: {os.path.basename(r.file)} is incomplete ({len(r.steps)} of "
            f"{r.config['total_steps']} steps): comparing the first {num_steps} steps of every run"
            for r in incomplete]


def _differing(mine: dict, theirs: dict, keys) -> str:
    """'key: a vs b, ...' over the `keys` whose values differ; empty when none do."""
    return ", ".join(f"{k}: {mine.get(k)} vs {theirs.get(k)}" for k in keys if mine.get(k) != theirs.get(k))
