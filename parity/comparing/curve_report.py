"""A loss-curve Comparison in words: the printed statistics block, curve_report.md and curve_comparison.json,
written beside the figure."""

from __future__ import annotations

import os
from typing import NamedTuple

from parity.comparing.curves import Comparison, CurveResult
from parity.comparing.figures import curve_figure, save_figure
from parity.registry import label
from parity.storage import write_json_atomic, write_text_atomic

JSON_NAME, REPORT_NAME = "curve_comparison.json", "curve_report.md"

RULE = 60


class Curve(NamedTuple):
    key: str  # the step field
    noun: str  # how a row names it: "Initial loss"
    title: str  # the block's heading


CURVES = (Curve("loss", "loss", "LOSS CURVE STATISTICS"),
          Curve("grad_norm", "grad norm", "GRAD NORM STATISTICS (before clipping)"))


def statistics_text(c: Comparison) -> str:
    """The seed's LOSS CURVE STATISTICS block, the same for grad norms, then the verdicts."""
    lines = []
    for key, noun, title in CURVES:
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
    lines += ["=" * RULE, f"VERDICT (every step, loss and grad norm: |x - {base}| <= rtol * |{base}|)",
              "=" * RULE, ""]
    for r in c.results:
        lines += [f"{r.run.label}: {r.verdict.word}", f"  {_verdict_detail(c, r)}"]
    return "\n".join(lines)


def markdown_report(c: Comparison, figure_file: str) -> str:
    """curve_report.md: the same numbers as tables, and the figure by its path relative to the report."""
    base = _baseline_name(c)
    out = [f"# Loss curve comparison against {base}", "",
           f"{c.num_steps} steps compared; baseline {c.baseline.label}. "
           f"Overall: **{c.word}**.", ""]
    out += [f"> {w}" for w in c.warnings] + ([""] if c.warnings else [])
    out += [f"![Loss curves]({figure_file})", "", "## Verdicts", "",
            "| run | verdict | rtol loss / grad norm | tolerance from | max relative diff loss / grad norm "
            "| first step outside |", "|---|---|---|---|---|---|"]
    for r in c.results:
        v, f = r.verdict, r.verdict.first_outside
        outside = f"step {f.step}, {f.quantity}: {f.value:.6f} vs {f.reference:.6f} ({f.rel_diff:.3e})" if f else "–"
        out.append(f"| {r.run.label} | {v.word} | {r.tolerance.loss:g} / {r.tolerance.grad_norm:g} | "
                   f"{v.tolerance_source} | {v.max_rel_diff['loss']:.3e} / {v.max_rel_diff['grad_norm']:.3e} | "
                   f"{outside} |")
    for key, noun, _ in CURVES:
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


def write_outputs(c: Comparison, figure_path: str) -> list[str]:
    """The figure, curve_comparison.json and curve_report.md (all atomic), in the figure's directory;
    returns the paths."""
    directory = os.path.dirname(os.path.abspath(figure_path))
    json_path, md_path = os.path.join(directory, JSON_NAME), os.path.join(directory, REPORT_NAME)
    save_figure(curve_figure(c), figure_path)
    write_json_atomic(json_path, {**c.to_dict(), "figure": os.path.basename(figure_path)})
    write_text_atomic(md_path, markdown_report(c, os.path.basename(figure_path)))
    return [figure_path, json_path, md_path]


def _aligned(rows: list[tuple[str, float]]) -> list[str]:
    """'  Label: value' with the values in one column, as in the seed's block."""
    width = max(len(label) for label, _ in rows) + 1
    return [f"  {label + ':':<{width}} {value:.6f}" for label, value in rows]


def _verdict_detail(c: Comparison, r: CurveResult) -> str:
    v, f = r.verdict, r.verdict.first_outside
    tolerance = f"rtol {r.tolerance.loss:g} (loss), {r.tolerance.grad_norm:g} (grad norm) from {v.tolerance_source}"
    if f is None:
        return (f"{tolerance}; max relative diff {v.max_rel_diff['loss']:.3e} (loss), "
                f"{v.max_rel_diff['grad_norm']:.3e} (grad norm)")
    noun = "loss" if f.quantity == "loss" else "grad norm"
    return (f"{tolerance}; first step outside: step {f.step}: {noun} {f.value:.6f} vs {_baseline_name(c)} "
            f"{f.reference:.6f}, relative diff {f.rel_diff:.3e} > rtol {f.tolerance:g}")


def _baseline_name(c: Comparison) -> str:
    return label(c.baseline.name)
