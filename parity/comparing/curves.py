"""Comparing loss records: invariants first, then statistics, bounds and one verdict per run.

A difference says something about a strategy only if nothing else differed, so before any number every run is checked
against the baseline: same initial weights, model, objective (parity/comparing/objective.py: and its quantities at
every step), optimizer settings and number of steps, and at every step the same batch, tokens and learning rate. A run that differs is reported as not
comparable (`NotComparable`), never as a difference.

Then integrity, ahead of any tolerance: a run whose replicas parted (tensors several ranks hold that the loop's
replica check found different, parity.training.replicas) FAILs at the first step they did, and a baseline whose
replicas parted is no reference: the comparison is refused.

The verdict holds three curves at every step — loss, pre-clip grad norm, parameter norm, and a mixture of experts'
load-balancing loss where both runs record it — to bounds on
|x − baseline| / |baseline|: NOISE_K × the noise the baseline's twins measured (calibrated, when
noise_reference_*.json records are there), else the fixed table by precision (uncalibrated). Calibrated
verdicts also run the drift test (parity.comparing.noise). A FAIL lists the config fields in which the run
differs from the baseline: the first suspects. A mixture of experts' expert loads are compared at every step too: a
token routed to another expert (a near-tie that another reduction order tips) is reported with its step and layer,
never silently; the curves' bounds decide the verdict (docs/moe.md).

A strategy is judged against DDP in its own precision policy (parity.precision): a run in another policy
than the baseline is reported as a POLICY DIFFERENCE — both policies named, the distance shown for scale — and not
judged, because the difference would measure the policy, not the strategy. Under fp16 the steps an overflow skipped
must be the baseline's: a run that applies a step the baseline skipped (or skips one it applied) trains another model
from there, and FAILs at that step; at steps both skipped the grad norm (infinite) is not judged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from parity import storage
from parity.comparing import (clip_read, loss_scales, margins, objective, recorded_checks, teacher_forced,
                              tensor_verdict, tolerances)
from parity.comparing.comparability import (code_mismatches, comparability_mismatches, config_differences,
                                             policy_differences)
from parity.comparing.noise import (Bounds, another_layout, calibrated_bounds, first_outside, fixed_bounds, floored,
                                    noise_ratio, relative_diff, relative_diffs)
from parity.comparing.recorded import resumed_at, resumed_rows
from parity.comparing.run import Run
from parity.comparing.tolerances import AUX_LOSS, NOISE_K, QUANTITIES
from parity.comparing.verdict import POLICY_DIFFERENCE, Outside, Verdict
from parity.errors import ConfigError, NotComparable
from parity.precision import POLICIES, describe
from parity.training.record import REFERENCE_GLOB, load_record


@dataclass(frozen=True)
class CurveStats:
    initial: float
    final: float
    min: float
    mean: float

    @classmethod
    def of(cls, values: list[float]) -> "CurveStats":
        """A NaN anywhere makes the min and the mean NaN (Python's min would skip it, depending on order)."""
        if any(math.isnan(v) for v in values):
            return cls(values[0], values[-1], math.nan, math.nan)
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
    """One run against the baseline: its verdict, the bounds it was judged by, and its differences."""

    run: Run
    bounds: Bounds
    verdict: Verdict
    diffs: dict[str, DiffStats]  # per curve: this run's curve minus the baseline's
    noise_ratios: dict[str, float] | None  # calibrated: deviation ÷ noise per curve (the worst step)
    config_differences: list[str]  # "field: baseline's vs this run's", for fields that may explain a FAIL
    fp32_distance_ratios: dict[str, float] | None = None  # a low-precision run's largest distance from the baseline's
    # fp32 twin ÷ the baseline's own, per curve: how much farther its policy moves this strategy than the baseline
    routing: dict | None = None  # a mixture of experts: where its expert loads differ from the baseline's (routing_diff)
    tensors: tensor_verdict.TensorVerdict | None = None  # every tensor's gradient and update against the baseline's

    @property
    def noise_ratio(self) -> float | None:
        """The worst curve's deviation ÷ noise; the run FAILs the per-step test beyond NOISE_K."""
        return max(self.noise_ratios.values()) if self.noise_ratios else None

    @property
    def bit_identical(self) -> bool:
        """Every judged curve equals the baseline's at every compared step (a NaN equals nothing)."""
        return all(d.max_abs == 0 for d in self.diffs.values())


@dataclass(frozen=True)
class Comparison:
    baseline: Run
    runs: list[Run]  # the baseline first, then the others by name
    num_steps: int  # compared steps: all of them, or those every run has done with --allow_incomplete
    results: list[CurveResult]  # one per run but the baseline, in `runs` order
    warnings: list[str]
    references: list[Run]  # the noise references the bounds were calibrated on (empty: uncalibrated)
    policy_distance: dict[str, float] | None = None  # the baseline's largest relative distance from its fp32 twin,
    # per curve: how far the policy itself moves DDP from fp32
    quantities: tuple = QUANTITIES  # the curves judged (quantities_of)

    @property
    def passed(self) -> bool:
        return all(r.verdict.passed for r in self.results)

    @property
    def word(self) -> str:
        """PASS; FAIL when a run FAILs; POLICY DIFFERENCE when none FAILs but one ran in another policy."""
        words = {r.verdict.word for r in self.results}
        return "FAIL" if "FAIL" in words else POLICY_DIFFERENCE if POLICY_DIFFERENCE in words else "PASS"

    def series(self, run: Run, key: str) -> list[float]:
        return _series(run, key, self.num_steps)

    def curve_stats(self, run: Run, key: str) -> CurveStats:
        return CurveStats.of(self.series(run, key))

    def to_dict(self) -> dict:
        """Everything the printed block says, machine-readable (curve_comparison.json)."""
        return {
            "baseline": self.baseline.name, "num_steps": self.num_steps, "verdict": self.word,
            "warnings": self.warnings,
            "noise_references": [storage.name(r.file) for r in self.references],
            "fingerprints": {storage.name(r.file): r.fingerprint for r in [*self.runs, *self.references]},
            "policy_fp32_distance": self.policy_distance,
            "runs": {r.name: {"label": r.label, "file": storage.name(r.file), "complete": r.complete,
                              "steps_recorded": len(r.steps), "precision": r.precision, "policy": r.policy,
                              "tp_size": r.config["tp_size"], "dp_size": r.config["dp_size"],
                              "replica_checks": r.replica_checks, **({"stopped": r.stopped} if r.stopped else {}),
                              **({"resumed_at": resumed_at(r.config)} if resumed_at(r.config) else {}),
                              **({"teacher_forced": tf} if (tf := teacher_forced.summary(r.record)) else {}),
                              "series": {q: self.series(r, q) for q in self.quantities},  # every compared step's value
                              **{q: asdict(self.curve_stats(r, q)) for q in self.quantities}} for r in self.runs},
            "against_baseline": {r.run.name: {
                **r.verdict.to_dict(),
                "replicas_parted": r.verdict.parting.to_dict() if r.verdict.parting else None,
                "calibrated": r.bounds.calibrated,
                "noise_ratio": r.noise_ratios,
                "margin": margins.curves_margin(held := margins.bounds_held(self, r))[0],  # against what held
                "bounds_held": held,  # per curve: its closest step's deviation ÷ the bound that held, and what set it
                "bound_ratios": margins.bound_ratios(self, r),  # each check's largest deviation ÷ bound
                "bit_identical": r.bit_identical,
                "fp32_distance_ratio": r.fp32_distance_ratios,
                "config_differences": r.config_differences, "routing": r.routing,
                tensor_verdict.KEY: r.tensors and r.tensors.to_dict(), "bounds": r.bounds.per_step,  # (the page's bands)
                **{f"{key}_diff": asdict(d) for key, d in r.diffs.items()}} for r in self.results},
        }


def load_runs(input_dir: str) -> list[Run]:
    """Every loss_*.json in `input_dir`, validated. Raises ConfigError (RecordError for a bad record)."""
    if not storage.is_dir(input_dir):
        raise ConfigError(f"--input_dir {input_dir} is not a directory")
    paths = storage.list_files(input_dir, "loss_*.json")
    if not paths:
        raise ConfigError(f"no loss_*.json in {input_dir}: run the train_*.py scripts with "
                          f"--loss_output_dir {input_dir} first")
    runs, by_name = [], {}
    for path in paths:
        run = Run(path, recorded_checks.attach(path, load_record(path)))  # a recorded run's, from its replay
        if run.name in by_name:
            raise ConfigError(f"{storage.name(by_name[run.name].file)} and {storage.name(path)} are both "
                              f"{run.name} runs: keep one of them in {input_dir}")
        by_name[run.name] = run
        runs.append(run)
    return runs


def load_references(input_dir: str) -> list[Run]:
    """Every noise_reference_*.json in `input_dir`, validated."""
    return [Run(path, load_record(path)) for path in storage.list_files(input_dir, REFERENCE_GLOB)]


def compare(runs: list[Run], baseline: str = "ddp", rtol: float | None = None,
            allow_incomplete: bool = False, grad_norm_rtol: float | None = None,
            references: list[Run] = (), allow_fingerprint_mismatch: bool = False) -> Comparison:
    """Check every run (and every noise reference) against the baseline, then measure it. With references
    of the baseline's strategy the bounds are calibrated; `rtol` / `grad_norm_rtol` fix the bound on the
    loss / the grad norm whatever the rest is. Runs of other shared code or libraries are not comparable
    unless `allow_fingerprint_mismatch` (then a warning says so)."""
    base, others = _split_baseline(runs, baseline)
    warnings = [f"warning: {storage.name(r.file)} is a noise reference of {r.name}, not of the baseline "
                f"({base.name}): not used" for r in references if r.name != base.name]
    references = [r for r in references if r.name == base.name]
    num_steps = min(len(r.steps) for r in [*runs, *references])
    warnings += _incomplete_warnings([*runs, *references], allow_incomplete, num_steps) + objective.notes(base)
    mismatches = [m for run in [*others, *references] for m in comparability_mismatches(base, run)]
    code = [m for run in [*others, *references] for m in code_mismatches(base, run)]
    if allow_fingerprint_mismatch:
        warnings += [f"warning: {m} (compared anyway: --allow_fingerprint_mismatch)" for m in code]
    else:
        mismatches += [f"{m}: rerun them with one harness and one set of libraries, or pass "
                       f"--allow_fingerprint_mismatch to compare them anyway" for m in code]
    mismatches += [f"{storage.name(r.file)} ({r.name}{', the baseline' if r is base else ', a noise reference'}): "
                   f"{r.parting.line()}: {r.parting.no_reference}; find why "
                   f"(docs/running.md#replicas) and run it again" for r in [base, *references] if r.parting]
    mismatches += [f"{storage.name(r.file)} ({r.name}): ranks fed the same rows at step {r.duplicate_rows.step}: a run "
                   f"that trained on other data than it says is no reference" for r in [base, *references] if r.duplicate_rows]
    mismatches += [f"{storage.name(base.file)} ({base.name}, the baseline): "
                   f"{teacher_forced.describe(teacher_forced.summary(base.record))}: a baseline whose own step is not "
                   f"the reference step's is no reference"] if teacher_forced.first_fail(base.record) else []
    series = {r.file: tensor_verdict.read(r) for r in [*runs, *references]}  # every tensor's, or why none
    mismatches += [m for run in [*others, *references] for m in tensor_verdict.mismatches(base, run, series)]
    mismatches += clip_read.no_reference(base, series[base.file])
    if mismatches:
        raise NotComparable(mismatches)
    quantities = quantities_of([*runs, *references], num_steps)
    references, same = _check_references(base, references, num_steps, quantities)
    references, unlike = overflow_alike(base, references, num_steps)
    warnings += same + unlike + loss_scales.notes(base, others, num_steps)  # an fp16 record's replay: its overflows
    fp32_twin = next((r for r in references if r.precision == "fp32" != base.precision), None)
    if fp32_twin is not None and not POLICIES[base.precision].fp32_twin_measures_noise:
        references = [r for r in references if r is not fp32_twin]  # its distance only (Policy's docstring)
    scales = objective.scales(base, num_steps)  # a post-training loss measured on its own scale where it crosses 0
    optimizer = tensor_verdict.parameter_norm_floor(base, references, series, num_steps)  # its own noise's bound
    results = [_result(base, run, num_steps, floored(bounds_for(base, run, references, num_steps, rtol, grad_norm_rtol,
                                                                quantities, scales), "param_norm", *optimizer),
                       fp32_twin, quantities,
                       tensor_verdict.judge(base, run, references, series, num_steps, not policy_differences(base, run)),
                       scales, references) for run in others]
    distance = None
    if fp32_twin is not None:
        judged = _judged(base, num_steps, base.skipped(num_steps), quantities)
        exact = _judged(fp32_twin, num_steps, base.skipped(num_steps), quantities)
        distance = {q: max(relative_diff(x, e) for x, e in zip(judged[q], exact[q])) for q in quantities}
    warnings += objective.tie_notes(base, others, num_steps)
    return Comparison(base, [base, *others], num_steps, results, warnings, list(references), distance, quantities)


def quantities_of(runs: list[Run], num_steps: int) -> tuple[str, ...]:
    """The curves judged: the three, and the load-balancing loss where every run records it at every step."""
    routed = all(step.get(AUX_LOSS) is not None for run in runs for step in run.steps[:num_steps])
    return (*QUANTITIES, AUX_LOSS) if routed else QUANTITIES


def routing_diff(base: Run, run: Run, num_steps: int) -> dict | None:
    """Where a mixture of experts' expert loads differ from the baseline's: per step and sparse layer, the token-expert
    assignments that moved (half the summed count differences) — the flips a near-tie can take under another
    reduction order. None where either run records no loads."""
    if not all("expert_loads" in s for r in (base, run) for s in r.steps[:num_steps]):
        return None
    moved = []
    for a, b in zip(run.steps[:num_steps], base.steps[:num_steps]):
        for layer, (row, ref) in enumerate(zip(a["expert_loads"], b["expert_loads"])):
            n = sum(abs(x - y) for x, y in zip(row, ref)) // 2
            if n:
                moved.append({"step": a["step"], "layer": layer, "assignments": n})
    return {"equal": not moved, "steps": sorted({m["step"] for m in moved}),
            "assignments_moved": sum(m["assignments"] for m in moved), "first": moved[0] if moved else None}


def overflow_alike(base: Run, references: list[Run], num_steps: int) -> tuple[list[Run], list[str]]:
    """The references whose fp16 overflows skipped the baseline's steps (the fp32 twin skips none and stays), and a
    warning for each other: a twin that skipped other steps trained another model, not the baseline's noise. fp16
    overflows depend on the DP layout — a rank's gradient before the reduction holds fewer samples at more ranks —
    so twins at other layouts may skip other steps where overflows are frequent (docs/precision.md)."""
    kept, warnings = [], []
    skipped = base.skipped(num_steps)
    for ref in references:
        theirs = ref.skipped(num_steps)
        if ref.precision == "fp32" or theirs == skipped:
            kept.append(ref)
            continue
        steps = lambda flags: ", ".join(str(i) for i, f in enumerate(flags) if f) or "none"  # noqa: E731
        warnings.append(f"warning: {storage.name(ref.file)} skipped steps {steps(theirs)} on fp16 overflows, the "
                        f"baseline {steps(skipped)}: it trained another model, not the baseline's noise: not used")
    return kept, warnings


def bounds_for(base: Run, run: Run, references: list[Run], num_steps: int, rtol: float | None = None,
               grad_norm_rtol: float | None = None, quantities: tuple = QUANTITIES, scales: dict | None = None) -> Bounds:
    """Calibrated on the references when there are any and the run is in the baseline's policy; else
    the fixed table of the looser precision. --tolerance / --grad_norm_tolerance replace one curve's bound."""
    if references and not policy_differences(base, run):
        skipped = base.skipped(num_steps)
        names = ", ".join(storage.name(r.file) for r in references)
        judged = [_judged(r, num_steps, skipped, quantities) for r in references]
        bounds = calibrated_bounds(_judged(base, num_steps, skipped, quantities), judged, base.precision,
                                   f"calibrated: {NOISE_K} × the noise of {names}", scales,
                                   [storage.name(r.file) for r in references])
    else:
        try:
            looser = tolerances.looser_precision(base.precision, run.precision)
        except ConfigError as exc:
            odd = base if base.precision not in tolerances.TOLERANCE_CLASS else run
            raise ConfigError(f"{storage.name(odd.file)}: {exc}") from None
        why = "no noise reference" if not references else "the run's precision policy differs from the baseline's"
        bounds = fixed_bounds(tolerances.CURVES[looser], num_steps,
                              f"the fixed {looser} table ({base.name} {base.precision}, {run.name} {run.precision}); "
                              f"uncalibrated: {why}", quantities, f"the fixed {looser} table")
    for quantity, value, flag in (("loss", rtol, "--tolerance"), ("grad_norm", grad_norm_rtol, "--grad_norm_tolerance")):
        if value is not None:
            bounds = Bounds({**bounds.per_step, quantity: [value] * num_steps}, f"{bounds.source}; {quantity} {flag}",
                            bounds.envelope, {**(bounds.held or {}), quantity: [f"{flag} {value:g}"] * num_steps})
    return bounds


def _result(base: Run, run: Run, num_steps: int, bounds: Bounds, fp32_twin: Run | None = None,
            quantities: tuple = QUANTITIES, tensors: tensor_verdict.TensorVerdict | None = None,
            scales: dict | None = None, references: list[Run] = ()) -> CurveResult:
    skipped, scales = base.skipped(num_steps), scales or {}
    series, baseline = _judged(run, num_steps, skipped, quantities), _judged(base, num_steps, skipped, quantities)
    rel = {q: relative_diffs(series[q], baseline[q], scales.get(q)) for q in quantities}
    max_rel = {q: max(map(abs, rel[q])) for q in quantities}
    other_policy = policy_differences(base, run)
    outside = None
    if not other_policy:  # the earlier of the two; at one step, the overflow mismatch (it explains the rest)
        found = [o for o in (run.duplicate_rows, resumed_rows(base.record, run.record), run.lr_off_schedule,
                             first_overflow_mismatch(base, run, num_steps), loss_scales.first_fault(run, num_steps),
                             tensors and tensors.clip_gap,
                             first_outside(series, baseline, bounds, scales),
                             teacher_forced.first_fail(run.record, num_steps),
                             objective.first_outside(base, run, num_steps, bounds.per_step["loss"], references),
                             tensors.first_fail() if tensors else None) if o]  # (at one step, the curves')
        outside = min(found, key=lambda o: o.step, default=None)
    verdict = Verdict(run.name, base.name, bounds.source, max_rel, outside, run.parting, tuple(other_policy))
    ratios = ({q: noise_ratio(rel[q], bounds.envelope[q]) for q in quantities}
              if bounds.calibrated else None)
    distance = None
    if fp32_twin is not None and not other_policy:
        exact = _judged(fp32_twin, num_steps, skipped, quantities)
        worst = lambda a, q: max(abs(x - e) for x, e in zip(a[q], exact[q]))  # noqa: E731
        distance = {q: worst(series, q) / worst(baseline, q) if worst(baseline, q) else math.inf for q in quantities}
    return CurveResult(run, bounds, verdict, {q: DiffStats.of(series[q], baseline[q]) for q in quantities}, ratios,
                       config_differences(base, run), distance, routing_diff(base, run, num_steps), tensors)


def first_overflow_mismatch(base: Run, run: Run, num_steps: int) -> Outside | None:
    """The first step one run skipped on an fp16 overflow and the other applied: from there they train different
    models (the module docstring's rule)."""
    for step, (a, b) in enumerate(zip(base.skipped(num_steps), run.skipped(num_steps))):
        if a != b:
            return Outside(quantity="skipped", rel_diff=1.0, tolerance=0.0, step=step, value=float(b),
                           reference=float(a), test="overflow")
    return None


def _judged(run: Run, num_steps: int, skipped: list[bool], quantities: tuple = QUANTITIES) -> dict[str, list[float]]:
    """The curves a verdict judges (`quantities`): the recorded ones, with the grad norm set to 0 (not judged) at the
    steps the baseline skipped on an overflow (an infinite norm there, in every run that skipped them too)."""
    curves = {q: _series(run, q, num_steps) for q in quantities}
    curves["grad_norm"] = [0.0 if skip else g for g, skip in zip(curves["grad_norm"], skipped)]
    return curves


def _check_references(base: Run, references: list[Run], num_steps: int, quantities: tuple = QUANTITIES
                      ) -> tuple[list[Run], list[str]]:
    """(the references kept, a note for each dropped): a reference measures the baseline's noise in the baseline's
    policy (a twin at another layout, or at its own under other CPU kernels: noise_kernels), or the scale of the
    policy's rounding itself (a low-precision baseline's twin in fp32, at its own layout); and only if it differs — a
    kernel twin identical to the baseline (those kernels compute this model alike here) is dropped, saying so."""
    kept, notes = [], []
    for ref in references:
        name = storage.name(ref.file)
        layout = [ref.config[k] for k in ("tp_size", "dp_size", "batch_size")] == \
            [base.config[k] for k in ("tp_size", "dp_size", "batch_size")]
        fp32_twin = base.precision != "fp32" and ref.precision == "fp32" and layout
        if policy_differences(base, ref) and not fp32_twin:
            raise ConfigError(f"{name} is {describe(ref.config)} but the baseline is {describe(base.config)}: a noise "
                              f"reference runs in the baseline's policy, or in fp32 at a low-precision baseline's own "
                              f"layout")

        identical = all(_series(ref, q, num_steps) == _series(base, q, num_steps) for q in quantities)
        if identical and ref.config.get("noise_kernels"):
            notes.append(f"note: {name} trained bit for bit as the baseline (its kernels compute this model alike "
                         f"here): it measured no noise, not used")
            continue
        if identical:
            raise ConfigError(f"{name} is identical to the baseline: a noise reference must run at another layout"
                              f"{another_layout(base.config, ref.config)}")
        kept.append(ref)
    return kept, notes


def _series(run: Run, key: str, num_steps: int) -> list[float]:
    return [step[key] for step in run.steps[:num_steps]]


def _split_baseline(runs: list[Run], baseline: str) -> tuple[Run, list[Run]]:
    by_name = {r.name: r for r in runs}
    input_dir = storage.parent(runs[0].file)
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
        raise ConfigError(f"{storage.name(r.file)} is incomplete ({len(r.steps)} of "
                          f"{r.config['total_steps']} steps: still running, or it stopped early): "
                          f"pass --allow_incomplete to compare the steps done so far")
    return [f"warning: {storage.name(r.file)} is incomplete ({len(r.steps)} of "
            f"{r.config['total_steps']} steps): comparing the first {num_steps} steps of every run"
            for r in incomplete]


