"""A Comparison in words: the printed statistics block, report.md, and the files written beside the figure."""

from __future__ import annotations

import os
from typing import NamedTuple

from parity.atomic import write_json_atomic, write_text_atomic
from parity.compare import Comparison, Verdict
from parity.plot import plot_comparison, save_figure
from parity.strategies import display_name

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
        for v in c.verdicts:
            d = v.diffs[key]
            lines += [f"{v.run.label}:", *_aligned([("Max abs diff", d.max_abs), ("Mean abs diff", d.mean_abs),
                                                    ("Final diff", d.final)]), ""]
    base = _baseline_name(c)
    lines += ["=" * RULE, f"VERDICT (every step, loss and grad norm: |x - {base}| <= rtol * |{base}|)",
              "=" * RULE, ""]
    for v in c.verdicts:
        lines += [f"{v.run.label}: {v.status}", f"  {_verdict_detail(c, v)}"]
    return "\n".join(lines)


def markdown_report(c: Comparison, figure_file: str) -> str:
    """report.md: the same numbers as tables, and the figure by its path relative to the report."""
    base = _baseline_name(c)
    out = [f"# Loss curve comparison against {base}", "",
           f"{c.num_steps} steps compared; baseline {c.baseline.label}. "
           f"Overall: **{c.status}**.", ""]
    out += [f"> {w}" for w in c.warnings] + ([""] if c.warnings else [])
    out += [f"![Loss curves]({figure_file})", "", "## Verdicts", "",
            "| run | verdict | rtol loss / grad norm | tolerance from | max relative diff loss / grad norm "
            "| first step outside |", "|---|---|---|---|---|---|"]
    for v in c.verdicts:
        f = v.first_failure
        outside = (f"step {f.step}, {f.quantity}: {f.value:.6f} vs {f.baseline_value:.6f} ({f.rel_diff:.3e})"
                   if f else "–")
        out.append(f"| {v.run.label} | {v.status} | {v.tolerance.rtol:g} / {v.tolerance.grad_norm_rtol:g} | "
                   f"{v.tolerance.source} | {v.max_rel_diff:.3e} / {v.max_grad_norm_rel_diff:.3e} | {outside} |")
    for key, noun, _ in CURVES:
        out += ["", f"## {noun.capitalize()}", "", "| run | initial | final | min | mean |", "|---|---|---|---|---|"]
        for run in c.runs:
            s = c.curve_stats(run, key)
            out.append(f"| {run.label} | {s.initial:.6f} | {s.final:.6f} | {s.min:.6f} | {s.mean:.6f} |")
        out += ["", f"Differences from {base}:", "", "| run | max abs diff | mean abs diff | final diff |",
                "|---|---|---|---|"]
        for v in c.verdicts:
            d = v.diffs[key]
            out.append(f"| {v.run.label} | {d.max_abs:.6f} | {d.mean_abs:.6f} | {d.final:.6f} |")
    return "\n".join(out) + "\n"


def write_outputs(c: Comparison, figure_path: str) -> list[str]:
    """The figure, comparison.json and report.md (all atomic), in the figure's directory; returns the paths."""
    directory = os.path.dirname(os.path.abspath(figure_path))
    json_path, md_path = os.path.join(directory, "comparison.json"), os.path.join(directory, "report.md")
    save_figure(plot_comparison(c), figure_path)
    write_json_atomic(json_path, {**c.to_dict(), "figure": os.path.basename(figure_path)})
    write_text_atomic(md_path, markdown_report(c, os.path.basename(figure_path)))
    return [figure_path, json_path, md_path]


def _aligned(rows: list[tuple[str, float]]) -> list[str]:
    """'  Label: value' with the values in one column, as in the seed's block."""
    width = max(len(label) for label, _ in rows) + 1
    return [f"  {label + ':':<{width}} {value:.6f}" for label, value in rows]


def _verdict_detail(c: Comparison, v: Verdict) -> str:
    tolerance = (f"rtol {v.tolerance.rtol:g} (loss), {v.tolerance.grad_norm_rtol:g} (grad norm) "
                 f"from {v.tolerance.source}")
    f = v.first_failure
    if f is None:
        return (f"{tolerance}; max relative diff {v.max_rel_diff:.3e} (loss), "
                f"{v.max_grad_norm_rel_diff:.3e} (grad norm)")
    noun = "loss" if f.quantity == "loss" else "grad norm"
    return (f"{tolerance}; first step outside: step {f.step}: {noun} {f.value:.6f} vs {_baseline_name(c)} "
            f"{f.baseline_value:.6f}, relative diff {f.rel_diff:.3e} > rtol {f.rtol:g}")


def _baseline_name(c: Comparison) -> str:
    return display_name(c.baseline.name)
