"""report.html's tensor verdict (parity/comparing/tensor_verdict.py): per run a heatmap of tensors × steps, each cell
its largest deviation ÷ bound over both phases, drawn as static SVG from curve_comparison.json's matrix.

A cell is a rectangle with a `<title>`: pointing at it reads the tensor, the step, the phase, the run's norm, the
baseline's and the ratio, without JavaScript (report.js adds the same in the page's readout). Colour: a light
sequential blue on log10 of the ratio, half a decade a shade from 10⁻²·⁵ to 1, saturating there (light grey: exactly
0); past 1 — outside its bound — dark red, by far the darkest cell in greyscale too; the first cell outside is framed
and named. Many steps are binned into at most 40 columns (tensor_verdict.heat_matrix), each cell its bin's largest, so
that the page stays a few hundred kilobytes at 1000 steps × 30 tensors. The grid is drawn in cell units (one scaled
group: each rectangle's x and y are its column and row), which keeps every cell a few dozen bytes.
"""

from __future__ import annotations

import math
import os
from html import escape

from parity.comparing.tensor_verdict import describe
from parity.registry import label

WIDTH, TOP, RIGHT, BOTTOM, ROW = 1000, 46, 12, 34, 12
CELL_MIN, CELL_MAX = 3, 24  # a column's width in pixels
LEVELS = 6  # blue shades up to 1, half a decade each (report.css: .tc1 … .tc6; .tc0 a ratio of 0, .tco past 1)


def level(ratio: float) -> str:
    """The cell's colour class for a deviation ÷ bound."""
    if not ratio <= 1:  # (a NaN too)
        return "tco"
    if ratio <= 0:
        return "tc0"
    return f"tc{min(LEVELS, max(1, LEVELS + math.ceil(2 * math.log10(ratio))))}"


def cell_words(found: dict, row: int, column: int, run: str, baseline: str) -> str:
    """A cell's reading: tensor, step (and the bin's steps), phase, both norms (`run`, `baseline`: short names),
    deviation ÷ bound."""
    m = found["matrix"]
    step, phase, value, reference = m["at"][row][column]
    first, last = m["columns"][column]
    steps = f"step {step}" + (f" (of {first}–{last})" if last > first else "")
    return (f"{m['tensors'][row]}, {steps}, {m['phases'][phase]}: {run} {value:.6g} vs {baseline} {reference:.6g}, "
            f"{m['ratio'][row][column]:.3g} × bound")


def heatmap(name: str, found: dict, run: str, baseline: str) -> str:
    """One run's heatmap (svg.tensor-map, its run in data-run)."""
    m = found["matrix"]
    names, columns = m["tensors"], m["columns"]
    left = min(330, 12 + 6 * max(len(n) for n in names))
    cell = max(CELL_MIN, min(CELL_MAX, (WIDTH - left - RIGHT) / len(columns)))
    height = TOP + ROW * len(names) + BOTTOM
    width = max(WIDTH, left + cell * len(columns) + RIGHT)  # (the legend and the marker's words beside the grid)
    cells = []
    for i, row in enumerate(m["ratio"]):
        for c, ratio in enumerate(row):
            if ratio is not None:
                cells.append(f'<rect x="{c}" y="{i}" width="1" height="1" class="{level(ratio)}"><title>'
                             f'{escape(cell_words(found, i, c, run, baseline))}</title></rect>')
    labels = "".join(f'<text class="tick" x="{left - 4}" y="{TOP + ROW * i + 9}" text-anchor="end">{escape(n)}</text>'
                     for i, n in enumerate(names))
    every = max(1, math.ceil(len(columns) / 10))
    ticks = "".join(f'<text class="tick" x="{left + cell * (c + 0.5):.1f}" y="{TOP + ROW * len(names) + 14}" '
                    f'text-anchor="middle">{columns[c][0]}</text>' for c in range(0, len(columns), every))
    marker = ""
    f = found.get("first_outside")
    if f:
        row = names.index(f["tensor"])
        column = next(c for c, (a, b) in enumerate(columns) if a <= f["step"] <= b)
        words = (f"first outside: step {f['step']}, {f['tensor']}, {f['phase']}: {run} {f['value']:.6g} vs "
                 f"{baseline} {f['reference']:.6g}, deviation {f['deviation']:.3e} > bound {f['bound']:.3e}")
        marker = (f'<g class="first-outside"><rect x="{left + cell * column - 1:.1f}" y="{TOP + ROW * row - 1}" '
                  f'width="{cell + 2:.1f}" height="{ROW + 2}"><title>{escape(words)}</title></rect>'
                  f'<text x="{left}" y="{TOP - 8}">✗ first outside: step {f["step"]}, {escape(f["tensor"])} '
                  f'({escape(f["phase"])})</text></g>')
    legend = "".join(f'<rect class="tc{k}" x="{left + 28 * k}" y="6" width="28" height="10"/>' for k in range(LEVELS + 1))
    edges = ((0.5, "0"), (3, "10⁻²"), (5, "10⁻¹"), (LEVELS + 1, "1"))  # (where on the ramp, in cells: its label)
    legend += (f'<rect class="tco" x="{left + 28 * (LEVELS + 1) + 6}" y="6" width="28" height="10"/>'
               f'<text class="legend" x="{left - 4}" y="15" text-anchor="end">deviation ÷ bound:</text>'
               + "".join(f'<text class="legend" x="{left + 28 * x}" y="28" text-anchor="middle">{t}</text>'
                         for x, t in edges)
               + f'<text class="legend" x="{left + 28 * (LEVELS + 2) + 10}" y="15">&gt; 1: outside its bound</text>')
    title = f"{run}: every tensor's deviation ÷ bound per step against {baseline} (gradient and update, the larger)"
    return (f'<svg class="tensor-map" role="img" aria-labelledby="tensors-{escape(name)}-title" '
            f'viewBox="0 0 {width:.0f} {height}" width="{width:.0f}" height="{height}" data-run="{escape(name)}" '
            f'xmlns="http://www.w3.org/2000/svg"><title id="tensors-{escape(name)}-title">{escape(title)}</title>'
            f'{legend}{labels}<g class="cells" transform="translate({left},{TOP}) scale({cell:.3f},{ROW})">'
            f'{"".join(cells)}</g>{ticks}<text class="axis" x="{left}" y="{height - 4}">step</text>{marker}</svg>')


def tensor_section(saved: dict, directory: str, layers: dict) -> str:
    """The page's section: per run its verdict's line and its heatmap, and for a FAIL the layer check of its step (a
    link to the one that ran beside the page, else the command)."""
    base = saved["runs"][saved["baseline"]]
    out = ['<section id="tensors"><h2>Tensor verdict</h2>',
           f"<p>Each trainable tensor's gradient norm (before clipping) and parameter norm after the step, at every step, "
           f"against {escape(base['label'])}'s: deviation = |x − {escape(base['label'])}| / max(|{escape(base['label'])}"
           f"|, a floor × its global norm), each within a bound of its own. Point at a cell to read it.</p>"]
    for name, a in saved["against_baseline"].items():
        found = a.get("tensors")
        if not found:
            continue
        run = saved["runs"][name]
        out.append(f'<div id="tensors-{escape(name)}"><h3>{escape(run["label"])}</h3>')
        out.append(f"<p>{escape(describe(found, base['label']))}.</p>")
        if not found["taken"]:
            out.append("</div>")
            continue
        f = found["first_outside"]
        if f:
            folder, layer = layers.get(name, (None, None))
            if folder and os.path.basename(os.path.normpath(folder)) == f"replay_step_{f['step']}":
                out.append(f'<p>Localised: <a href="#layer-check-{escape(name)}">the layer check of step '
                           f'{f["step"]}</a>.</p>')
            elif found.get("replay_command"):
                out.append(f"<p>Localise step {f['step']} layer by layer:</p>"
                           f"<pre><code>{escape(found['replay_command'])}</code></pre>")
            elif found.get("localise"):
                out.append(f"<p>{escape(found['localise'])}.</p>")
        out.append(f'<figure class="chart">{heatmap(name, found, label(name), label(saved["baseline"]))}</figure></div>')
    out.append("</section>")
    return "\n".join(out)


def tensors_cell(a: dict) -> str:
    """The runs table's cell: the tensor verdict in a few words."""
    found = a.get("tensors")
    if not found or not found["taken"]:
        return "not taken"
    f = found["first_outside"]
    if f:
        return (f'<span class="differs">✗ step {f["step"]}: {escape(f["tensor"])} ({escape(f["phase"])})</span>')
    worst = max(p["ratio"] for p in found["largest"].values())
    return f"✓ largest {worst:.2g} of its bound"
