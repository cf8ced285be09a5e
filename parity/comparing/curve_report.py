"""A loss-curve Comparison in words: the printed statistics block, curve_report.md and curve_comparison.json,
written beside the figure."""

from __future__ import annotations

import os
import shlex
from typing import NamedTuple

from parity import fingerprint, storage
from parity.comparing.curves import Comparison, CurveResult
from parity.comparing import clip_read, loss_scales, margins, objective, teacher_forced, tensor_verdict
from parity.comparing.figures import curve_figure, save_figure
from parity.comparing.html_report import write_curve_page
from parity.comparing.recorded import (RESUMED_ROWS, cut_words, replay_lines, resumed_at, resumed_note,
                                      resumed_rows_words, stopped_words)
from parity.comparing.tolerances import CALIBRATION_FLOORED, DRIFT_K, DRIFT_WINDOW, NOISE_K, tolerance_class
from parity.comparing.verdict import EXACT_MARGIN
from parity.precision import describe
from parity.registry import label

JSON_NAME, REPORT_NAME = "curve_comparison.json", "curve_report.md"

RULE = 60


class Curve(NamedTuple):
    key: str  # the step field
    noun: str  # how a row names it: "Initial loss"
    title: str  # the block's heading


CURVES = (Curve("loss", "loss", "LOSS CURVE STATISTICS"),
          Curve("grad_norm", "grad norm", "GRAD NORM STATISTICS (before clipping)"),
          Curve("param_norm", "param norm", "PARAMETER NORM STATISTICS (after the step)"),
          Curve("aux_loss", "aux loss", "LOAD-BALANCING LOSS STATISTICS (mixture of experts)"))
NOUNS = {c.key: c.noun for c in CURVES}


def judged_curves(c: Comparison) -> tuple[Curve, ...]:
    return tuple(curve for curve in CURVES if curve.key in c.quantities)


def statistics_text(c: Comparison) -> str:
    """The seed's LOSS CURVE STATISTICS block, the same for the grad and parameter norms (and a mixture of experts'
    load-balancing loss), then the verdicts."""
    lines = []
    for key, noun, title in judged_curves(c):
        lines += ["=" * RULE, title, "=" * RULE, ""]
        for run in c.runs:
            s = c.curve_stats(run, key)
            lines += [f"{run.label}:", *_aligned([(f"Initial {noun}", s.initial), (f"Final {noun}", s.final),
                                                  (f"Min {noun}", s.min), (f"Mean {noun}", s.mean)]), ""]
        lines += ["-" * RULE, f"Differences from {_baseline_name(c)} baseline:", ""]
        for r in c.results:
            d = r.diffs[key]
            lines += [f"{r.run.label}:", *_aligned([("Max abs diff", d.max_abs), ("Mean abs diff", d.mean_abs),
                                                    ("Final diff", d.final)]), ""]
    base = _baseline_name(c)
    lines += ["=" * RULE, f"VERDICT (every step, each curve: |x - {base}| <= bound * |{base}|)", "=" * RULE, "",
              policy_line(c), calibration_line(c), *([policy_distance_line(c)] if c.policy_distance else []),
              f"Baseline {c.baseline.label}: {replicas_line(c.baseline)}.",
              *stopped_lines(c.baseline, f"Baseline {c.baseline.label}: "), *judge_lines(c), ""]
    for r in c.results:
        lines += [f"{r.run.label}: {r.verdict.word}", *[f"  {line}" for line in verdict_details(c, r)]]
    lines += ["", "Fingerprints (shared code, strategy code or framework and script, libraries, device):"]
    lines += [f"  {storage.name(run.file)}: {fingerprint.short(run.fingerprint)}" for run in [*c.runs, *c.references]]
    return "\n".join(lines)


def policy_line(c: Comparison) -> str:
    """Which precision policy each run used (docs/precision.md): one line when they share it."""
    policies = {run.label: describe(run.config) for run in c.runs}
    if len(set(policies.values())) == 1:
        return f"Precision policy of every run: {next(iter(policies.values()))}."
    return "Precision policies: " + "; ".join(f"{label}: {text}" for label, text in policies.items()) + "."


def policy_distance_line(c: Comparison) -> str:
    """How far the policy itself moves the baseline from its fp32 twin: the scale every deviation sits in."""
    far = ", ".join(f"{NOUNS[q]} {x:.2e}" for q, x in c.policy_distance.items())
    return (f"The policy itself ({c.baseline.precision}) moves {_baseline_name(c)} from its fp32 twin by (max relative "
            f"over the steps): {far}.")


def calibration_line(c: Comparison) -> str:
    if c.references:
        names = ", ".join(storage.name(r.file) for r in c.references)
        drift = (f"and no drift beyond {DRIFT_K} × that noise over {DRIFT_WINDOW} steps" if c.num_steps >= DRIFT_WINDOW
                 else f"no drift test: it needs {DRIFT_WINDOW} steps and {c.num_steps} were compared")
        floored = (f", never below the fixed {kind} table (a floor)"
                   if (kind := tolerance_class(c.baseline.precision)) in CALIBRATION_FLOORED else "")
        return (f"Bounds calibrated on {names}: {NOISE_K} × the noise between them and the baseline at each "
                f"step{floored}, {drift}.")
    return ("Bounds UNCALIBRATED: no noise reference in the folder, so the fixed table by precision applies "
            "(docs/tolerances.md); run the baseline again with --noise_reference at another layout to calibrate.")


def verdict_details(c: Comparison, r: CurveResult) -> list[str]:
    """What the verdict rests on: the headline numbers, and for a FAIL where and the first suspects."""
    v, f, base = r.verdict, r.verdict.first_outside, _baseline_name(c)
    worst = ", ".join(f"{NOUNS[q]} {x:.3e}" for q, x in v.max_rel_diff.items())
    if v.policy_difference:
        return [f"{base} ran {describe(c.baseline.config)}; {label(r.run.name)} ran {describe(r.run.config)}.",
                f"A precision-policy difference, not a difference of the strategy ({'; '.join(v.policy_difference)}): "
                f"not judged. To test the strategy, train {base} in {r.run.precision} too (train_ddp.py --precision "
                f"{r.run.precision}, or the main job with PRECISION={r.run.precision}, which runs the baseline in the "
                f"run's policy); {base} in each policy shows what the policy itself changes.",
                f"for scale, max relative diff {worst}"]
    if r.noise_ratios:
        ratios = ", ".join(f"{NOUNS[q]} {x:.1f}" for q, x in r.noise_ratios.items())
        lines = [f"deviation ÷ noise {r.noise_ratio:.1f} ({ratios}); {held_words(c, r)}; {margin_words(c, r)}; max "
                 f"relative diff {worst}"]
        if r.fp32_distance_ratios:
            far = ", ".join(f"{NOUNS[q]} {x:.1f}×" for q, x in r.fp32_distance_ratios.items())
            lines.append(f"how far {r.run.precision} moved it from the fp32 baseline, as a multiple of how far it moved "
                         f"{base}: {far}")
    else:
        bounds = ", ".join(f"{b[0]:g} ({NOUNS[q]})" for q, b in r.bounds.per_step.items())
        lines = [f"rtol {bounds} from {v.tolerance_source}; max relative diff {worst}; {margin_words(c, r)}"]
    lines = [*stopped_lines(r.run), *lines]
    if v.parting is not None:
        lines.append(f"{v.parting.line()}: {v.parting.broken} — FAIL before any tolerance")
        if f is None:
            lines += ["curves alone: within their bounds at every step",
                      "differs from the baseline in: " + ("; ".join(r.config_differences) or "nothing recorded")]
    else:
        lines.append(replicas_line(r.run))
    checked = teacher_forced.summary(r.run.record)
    if checked:  # (a record from before the check, or a run with --no_teacher_forced: no line)
        lines.append(teacher_forced.describe(checked))
    k = r.tensors.first.step if r.tensors is not None and r.tensors.first else None  # the tensor verdict's FAIL
    if r.tensors is not None:  # its line, and on the next the layer check of its step
        lines.append(tensor_verdict.describe(r.tensors.to_dict(), base))
        lines += [f"  {where}"] if k is not None and (where := localise(c, r, k)) else []
    if f is not None:
        if f.test == "duplicate_rows":
            lines.append(f"first step outside: step {f.step}: ranks {int(f.value)} and {int(f.reference)} fed the same "
                         f"rows ({int(f.rel_diff)} duplicated): no two data-parallel ranks may train on one sample")
        elif f.test == RESUMED_ROWS:
            lines.append(f"first step outside: step {f.step}: {resumed_rows_words(f.step, bool(f.value))}")
        elif f.test == clip_read.TEST:
            lines.append(f"first step outside: {clip_read.line(f)}: ahead of any tolerance")
        elif f.test == tensor_verdict.TEST:
            lines.append(f"first step outside: step {f.step}: {f.module}, phase {f.quantity}, outside its bound (the "
                         f"tensor verdict above), whatever the curves say")
        elif f.test == teacher_forced.TEST:
            state = "the state its recorder saved before step" if r.run.recorded else \
                "its own state at the checkpoint of step"
            lines.append(f"first step outside: step {f.step}: the teacher-forced step from {state} {f.step}: "
                         f"{f.module} relative diff {f.rel_diff:.3e} > {f.tolerance:.3e} from the reference step "
                         f"(whatever the curves say)")
        elif f.test == objective.TEST:
            lines.append(f"first step outside: {objective.line(f, base)}")
        elif f.test == "lr_schedule":
            lines.append(f"first step outside: step {f.step}: the lr applied, {f.value:.6g}, is not the one the "
                         f"framework's own settings declare ({f.reference:.6g}): a scheduler stepped other than once "
                         f"per update")
        elif f.test == loss_scales.TEST:
            rules = (r.run.config.get("loss_scaling") or {}).get("rules")
            lines.append(f"first step outside: {loss_scales.line(f, rules)}: ahead of any tolerance")
        elif f.test == "overflow":
            did = lambda skipped: "skipped" if skipped else "applied"  # noqa: E731
            lines.append(f"first step outside: step {f.step}: {label(r.run.name)} {did(f.value)} it and {base} "
                         f"{did(f.reference)} it (an fp16 overflow): from there they train different models")
        elif f.test == "drift":
            lines.append(f"drift: steps {f.step - DRIFT_WINDOW + 1}–{f.step}: {NOUNS[f.quantity]} keeps one sign, "
                         f"mean relative diff {f.rel_diff:.3e} > {f.tolerance:.3e} ({DRIFT_K} × the window's noise)")
        else:
            lines.append(f"first step outside: step {f.step}: {NOUNS[f.quantity]} {f.value:.6f} vs {base} "
                         f"{f.reference:.6f}, relative diff {f.rel_diff:.3e} > {f.tolerance:.3e}")
        lines += [resumed] if (resumed := resumed_line(r)) else []
        lines += [scaled] if (scaled := clip_read.scale_left_in(r.run, c.baseline)) else []
        lines.append("differs from the baseline in: " + ("; ".join(r.config_differences) or "nothing recorded"))
        if (f.test not in ("duplicate_rows", RESUMED_ROWS, "lr_schedule") or not r.run.recorded) and f.step != k:
            lines += [where] if (where := localise(c, r, f.step)) else []  # (at the tensors' step: above, once)
    routed = routing_line(r)
    return lines + ([routed] if routed else [])


def held_words(c: Comparison, r: CurveResult) -> str:
    """Which bound held each curve where it came closest to it, and how much of it the deviation used
    (margins.bounds_held): 'the bounds that held, 20 × noise: loss 0.031, grad norm 0.003 of it', or per curve where
    they differ ('grad norm 0.0047 of the fp32 table's floor 0.0001')."""
    held = margins.bounds_held(c, r)
    kinds = {p["held"] for p in held.values()}
    if len(kinds) == 1:
        return (f"the bounds that held, {next(iter(kinds))}: "
                + ", ".join(f"{NOUNS[q]} {p['ratio']:.2g}" for q, p in held.items()) + " of it")
    return "the bounds that held: " + ", ".join(f"{NOUNS[q]} {p['ratio']:.2g} of {p['held']}" for q, p in held.items())


def margin_words(c: Comparison, r: CurveResult) -> str:
    """The curves' margin against the bounds that held (margins.bounds_held), naming the curve closest to its bound:
    'margin 32.0× (loss)'; past its bound, how far ('loss at 8.33e+03 × the bound that held'); exact for a run equal
    to the baseline at every step."""
    margin, q = margins.curves_margin(margins.bounds_held(c, r))
    if margin is None:
        return EXACT_MARGIN if r.bit_identical else "margin: every judged curve at the baseline's"
    if margin >= 1:
        return f"margin {margin:.1f}× ({NOUNS[q]})"
    return f"{NOUNS[q]} at {1 / margin if margin else float('inf'):.3g} × the bound that held"  # inf: non-finite where
    # the baseline's is finite (an fp16 step that overflowed on one side)


def resumed_line(r: CurveResult) -> str | None:
    """For a FAIL first outside at a step the run resumed from its checkpoint: that it did (recorded.resumed_note)."""
    f = r.verdict.first_outside
    return resumed_note(resumed_at(r.run.config), f.step, f.test) if f is not None else None


def stopped_lines(run, prefix: str = "") -> list[str]:
    """Where a recorded run's record stopped early, and that it trained cut to fewer layers, each in one line after
    `prefix`; none for a record that did neither."""
    cut = cut_words(run.config)
    return [f"{prefix}{words}" for words in (stopped_words(run.stopped) if run.stopped else None, cut) if words]


def judge_lines(c: Comparison) -> list[str]:
    """Which replay judged the recorded runs, and where it shares a library's code with one (recorded.replay_lines)."""
    lines = replay_lines(c.baseline.config, {r.run.label: r.run.config for r in c.results})
    return [f"Baseline {c.baseline.label}: {line}." for line in lines]


def routing_line(r: CurveResult) -> str | None:
    """A mixture of experts' expert loads against the baseline's, in words: equal, or where tokens went to other
    experts (never silent; the curves' bounds decide)."""
    if r.routing is None:
        return None
    if r.routing["equal"]:
        return "expert loads: equal to the baseline's at every step and sparse layer"
    first = r.routing["first"]
    return (f"expert loads: {r.routing['assignments_moved']} token-expert assignments differ from the baseline's over "
            f"{len(r.routing['steps'])} steps (first: step {first['step']}, sparse layer {first['layer']}, "
            f"{first['assignments']}): a near-tie tipped the other way, or the routing parted; judged by the curves' "
            f"bounds")


def replicas_line(run) -> str:
    """What the replica check found in a run whose replicas held: how often it looked, at how many tensors."""
    checks = run.replica_checks
    if not checks["declared"]:
        return "replicas: not declared by this strategy (Strategy.replicas): not checked"
    if not checks["groups"]:
        return "replicas: none (no two ranks hold the same tensor)"
    every = "every step" if checks["interval"] == 1 else f"every {checks['interval']} steps, checkpoints, the end"
    return (f"replicas: bit-identical at each of {checks['checks']} checks ({every}) of the {checks['groups']} tensors "
            f"held by several ranks each")


def first_failure(r: CurveResult) -> str:
    """The report table's cell: where the run first failed — its replicas parting, then the curves."""
    v, f = r.verdict, r.verdict.first_outside
    cells = [f"replicas part at step {v.parting.step}: {v.parting.to_dict()['name']}"] if v.parting else []
    if f is not None and f.test == tensor_verdict.TEST:
        cells.append(f"step {f.step}, {f.module} ({f.quantity}, tensors): {f.rel_diff:.3e} > {f.tolerance:.3e}")
    elif f is not None:
        cells.append(f"step {f.step}, {f.quantity} ({f.test}): {f.rel_diff:.3e} > {f.tolerance:.3e}")
    return "; ".join(cells) or "–"


def localise_recorded(name: str, step: int) -> str:
    """For a recorded run's FAIL: how to find the first divergent module at the first step outside
    (parity/recording/dump.py)."""
    return (f"localise step {step}: rerun your script with the recorder's dump_step={step} (ParityRecorder or "
            f"ParityCallback(..., dump_step={step})) into a fresh folder D, then python train_ddp.py --replay_record "
            f"D/loss_{name}.json --dump_step {step} --loss_output_dir D, then python compare_dumps.py --input_dir D: "
            f"it names the first divergent module")


def localise(c: Comparison, r: CurveResult, step: int) -> str | None:
    """The line that offers the layer check of a FAIL's step `step`: the replay of it (a harness run), the recorder's
    dump_step (a recorded run), or None where neither can be offered."""
    command = replay_command(c, r, step)
    if command:
        return f"replay step {step} layer by layer from {_baseline_name(c)}'s checkpoint: {command}"
    if r.run.recorded and r.run.config.get("objective"):  # a post-training record: its rollouts, not a dump
        return (f"localise: its recorded rollouts ({r.run.config.get('rollouts')}, beside the record) train under any "
                f"strategy, and run_verification.py --objective … --rollouts takes their first step module by module "
                f"(docs/posttrain.md)")
    return localise_recorded(r.run.name, step) if r.run.recorded else None


def replay_command(c: Comparison, r: CurveResult, step: int | None = None) -> str | None:
    """For a FAIL: the layer check that records its step `step` (by default the first step outside) under DDP and the
    failing run's strategy (or its own class), from the DDP baseline's newest checkpoint at or before it, in the
    failing run's layout and options (docs/checkpoints.md) — not every strategy: one that cannot take the run's layout
    (DeepSpeed's AutoTP and a LoRA run at --tp_size 2) would refuse the whole command. None when the baseline's
    checkpoints are in an object store: a replay reads them from a folder of its machine (a shared mount on a
    cluster). Its folder goes beside the records, or under the working directory when they are in an object store."""
    f = r.verdict.first_outside
    if f is None or c.baseline.name != "ddp" or r.run.recorded:
        return None  # a recorded run has no checkpoint of the harness's to replay a step from
    step = f.step if step is None else step
    base, run = c.baseline.config, r.run.config
    checkpoints = storage.local_path(storage.join(base["storage_path"], base["experiment_name"]))
    if checkpoints is None:
        return None
    records = storage.local_path(storage.parent(storage.absolute(r.run.file)))
    output = os.path.join(records, f"replay_step_{step}") if records else f"replay_step_{step}"
    flags = ["--output_dir", output, "--replay", checkpoints, "--step", str(step),
             "--strategy", *dict.fromkeys(["ddp"] + ([] if run.get("strategy_class") else [run["strategy"]])),
             "--tp_size", str(run["tp_size"]), "--dp_size", str(run["dp_size"]), "--batch_size", str(run["batch_size"])]
    for size in ("pp_size", "ep_size"):
        if run.get(size, 1) > 1:
            flags += [f"--{size}", str(run[size])]
    if run.get("strategy_class"):
        flags += ["--strategy_class", run["strategy_class"]]
    for name, value in sorted(run.get("options", {}).items()):
        if isinstance(value, dict) and "file" in value:  # an option read from a file (--deepspeed_config)
            value = value["file"]
        if value is True:
            flags.append(f"--{name}")
        elif value not in (False, None):
            flags += [f"--{name}", str(value)]
    return "python run_verification.py " + shlex.join(flags)


def markdown_report(c: Comparison, figure_file: str) -> str:
    """curve_report.md: the same numbers as tables, and the figure by its path relative to the report."""
    base = _baseline_name(c)
    out = [f"# Loss curve comparison against {base}", "",
           f"{c.num_steps} steps compared; baseline {c.baseline.label}. Overall: **{c.word}**.", "",
           policy_line(c), "", calibration_line(c), "", *([policy_distance_line(c), ""] if c.policy_distance else []),
           f"Baseline {c.baseline.label}: {replicas_line(c.baseline)}.", "",
           *[x for line in judge_lines(c) for x in (line, "")]]
    out += [f"> {w}" for w in c.warnings] + ([""] if c.warnings else [])
    out += [f"![Loss curves]({figure_file})", "", "## Verdicts", "",
            f"| run | verdict | deviation ÷ noise | max relative diff {' / '.join(n for _, n, _ in judged_curves(c))} "
            f"| first outside |", "|---|---|---|---|---|"]
    for r in c.results:
        v = r.verdict
        outside = first_failure(r)
        ratio = f"{r.noise_ratio:.1f}" if r.noise_ratio is not None else "uncalibrated"
        ratio += f"; {margin_words(c, r)}" if v.passed or r.bit_identical else ""  # a FAIL: its first step outside
        worst = " / ".join(f"{v.max_rel_diff[q]:.3e}" for q, _, _ in judged_curves(c))
        out.append(f"| {r.run.label} | {v.word} | {ratio} | {worst} | {outside} |")
        if routing_line(r):
            out.append(f"|  | {routing_line(r)} | | | |")
    for run in c.runs:
        out += ["", *stopped_lines(run, f"{run.label}: ")] if stopped_lines(run) else []
    for r in c.results:
        if r.verdict.parting is not None:
            out += ["", f"{r.run.label}: {r.verdict.parting.line()}: {r.verdict.parting.broken}."]
        if r.verdict.policy_difference:
            out += ["", f"{r.run.label}: " + " ".join(verdict_details(c, r)[:2])]
        elif not r.verdict.passed:
            out += ["", f"{r.run.label}: {resumed}."] if (resumed := resumed_line(r)) else []
            out += ["", f"{r.run.label} differs from the baseline in: "
                    + ("; ".join(f"`{d}`" for d in r.config_differences) or "nothing recorded")]
            command = replay_command(c, r)
            if command:
                out += ["", f"Replay step {r.verdict.first_outside.step} layer by layer from the baseline's "
                        f"checkpoint:", "", f"```bash\n{command}\n```"]
    checked = [(run, found) for run in c.runs if (found := teacher_forced.summary(run.record))]
    out += ["", "## Teacher-forced checks", "", "Each checked step's update against a reference step from the run's own "
            "state (docs/teacher_forced.md); the worst tensor by relative diff ÷ bound.", "",
            "| run | step | result | worst tensor | relative diff | bound | ratio | note |",
            "|---|---|---|---|---|---|---|---|"] if checked else []
    for run, found in checked:
        out += [f"| {run.label} | – | none | – | – | – | – | {found['none']} |"] if found.get("none") else []
        for check in found["checks"]:
            number = lambda x, form=".3e": "–" if x is None else format(x, form)  # noqa: E731
            out.append(f"| {run.label} | {check['step']} | {'PASS' if check['ok'] else 'FAIL'} | "
                       f"{check['tensor'] or '–'} | {number(check['rel_diff'])} | {number(check['bound'])} | "
                       f"{number(check['ratio'], '.2f')} | {check['note'] or ''} |")
    out += tensor_markdown(c)
    out += ["", "## Fingerprints", "", "| record | shared code | own code (strategy, or framework and script) | libraries "
            "| device |", "|---|---|---|---|---|"]
    for run in [*c.runs, *c.references]:
        fp = run.fingerprint
        libraries = ", ".join(f"{k} {v}" for k, v in fp["versions"].items())
        out.append(f"| {storage.name(run.file)} | `{fp['shared_code_sha256'][:12]}` | {fingerprint.own_code(fp)} "
                   f"| {libraries} | {fp['device']} |")
    for key, noun, _ in judged_curves(c):
        out += ["", f"## {noun.capitalize()}", "", "| run | initial | final | min | mean |", "|---|---|---|---|---|"]
        for run in c.runs:
            s = c.curve_stats(run, key)
            out.append(f"| {run.label} | {s.initial:.6f} | {s.final:.6f} | {s.min:.6f} | {s.mean:.6f} |")
        out += ["", f"Differences from {base}:", "", "| run | max abs diff | mean abs diff | final diff |",
                "|---|---|---|---|"]
        for r in c.results:
            d = r.diffs[key]
            out.append(f"| {r.run.label} | {d.max_abs:.6f} | {d.mean_abs:.6f} | {d.final:.6f} |")
    return "\n".join(out) + "\n"


def tensor_markdown(c: Comparison) -> list[str]:
    """curve_report.md's tensor verdict: a row per run (its first point outside, the largest deviation ÷ bound per phase,
    its bounds; or why it was not taken), then for each FAIL the layer check of its step."""
    out = ["", "## Tensor verdict", "", f"Each trainable tensor's gradient norm and parameter norm after the step, at every "
           f"step, against {_baseline_name(c)}'s (docs/tensors.md).", "",
           "| run | verdict | first outside | largest deviation ÷ bound | bounds |", "|---|---|---|---|---|"]
    failed = []
    for r in c.results:
        found = r.tensors.to_dict() if r.tensors else {"taken": False, "why": "not measured"}
        if not found["taken"]:
            out.append(f"| {r.run.label} | not taken | {found['why']} | | |")
            continue
        f = found["first_outside"]
        largest = "; ".join(f"{phase} {p['ratio']:.3g} ({p['tensor']}, step {p['step']})"
                            for phase, p in found["largest"].items())
        outside = (f"step {f['step']}, {f['tensor']}, {f['phase']}: {f['value']:.6e} vs {f['reference']:.6e}, "
                   f"deviation {f['deviation']:.3e} > {f['bound']:.3e}" if f else "–")
        out.append(f"| {r.run.label} | {'FAIL' if f else 'PASS'} | {outside} | {largest} | {found['source']} |")
        if f and localise(c, r, f["step"]):
            failed.append((r, f["step"]))
    for r, step in failed:
        command = replay_command(c, r, step)
        out += ["", f"Localise {r.run.label}'s step {step} layer by layer:", "",
                f"```bash\n{command}\n```" if command else localise(c, r, step)]
    return out


def write_outputs(c: Comparison, figure_path: str) -> list[str]:
    """The figure, curve_comparison.json, curve_report.md and report.html (all atomic), in the figure's directory (a
    local one or a URI); returns the paths."""
    directory = storage.parent(storage.absolute(figure_path))
    json_path, md_path = storage.join(directory, JSON_NAME), storage.join(directory, REPORT_NAME)
    save_figure(curve_figure(c), figure_path)
    replays = {r.run.name: replay_command(c, r) for r in c.results if replay_command(c, r)}
    data = c.to_dict()
    for name, command in replays.items():  # a failing teacher-forced check's step is the first outside: its replay
        if data["runs"][name].get(teacher_forced.KEY, {}).get("first_fail_step") is not None:
            data["runs"][name][teacher_forced.KEY]["replay_command"] = command
    for r in c.results:  # a tensor verdict's FAIL: the layer check of its step (tensor_verdict's summary)
        first = r.tensors.first if r.tensors else None
        if first is not None:
            data["against_baseline"][r.run.name][tensor_verdict.KEY]["localise"] = localise(c, r, first.step)
            data["against_baseline"][r.run.name][tensor_verdict.KEY]["replay_command"] = replay_command(c, r, first.step)
    links = {**{run.name: _link(run.file, directory) for run in c.runs},  # the records, from the report page's folder
             **{storage.name(run.file): _link(run.file, directory) for run in c.references}}
    storage.write_json_atomic(json_path, {**data, "figure": storage.name(figure_path), "replay_commands": replays,
                                          "record_links": links})
    storage.write_text_atomic(md_path, markdown_report(c, storage.name(figure_path)))
    return [figure_path, json_path, md_path, write_curve_page(directory)]


def _link(location: str, directory: str) -> str:
    """A record's location relative to the outputs' folder when both are on this machine (the folder may be copied
    elsewhere with its records), else the location itself."""
    if storage.parent(storage.absolute(location)) == directory:
        return storage.name(location)  # beside the page, on any store (a folder downloaded whole keeps it)
    a, b = storage.local_path(storage.absolute(location)), storage.local_path(directory)
    return os.path.relpath(a, b).replace(os.sep, "/") if a and b else location


def _aligned(rows: list[tuple[str, float]]) -> list[str]:
    """'  Label: value' with the values in one column, as in the seed's block."""
    width = max(len(label) for label, _ in rows) + 1
    return [f"  {label + ':':<{width}} {value:.6f}" for label, value in rows]


def _baseline_name(c: Comparison) -> str:
    return label(c.baseline.name)
