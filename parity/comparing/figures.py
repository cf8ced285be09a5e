"""The figures: the loss-curve comparison (curves, differences inside the tolerance band, grad norms) and
the layer heatmap (modules × run pairs), and the one way they are saved.

Built on a bare `matplotlib.figure.Figure` (no pyplot): nothing global is touched, nothing needs a
display, and `savefig` renders PNG with Agg and SVG/PDF with their own backends.
"""

from __future__ import annotations

import io
import math
import os

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from parity import storage
from parity.errors import ConfigError
from parity.registry import label

FIGURE_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def figure_format(path: str, flag: str = "--output") -> str:
    """The format the file's extension asks for; ConfigError for one matplotlib is not asked to write."""
    ext = os.path.splitext(storage.name(path))[1].lower()
    if ext not in FIGURE_FORMATS:
        raise ConfigError(f"{flag} {path}: unknown extension '{ext}': use {', '.join(FIGURE_FORMATS)}")
    return FIGURE_FORMATS[ext]


def save_figure(fig: Figure, path: str, flag: str = "--output") -> None:
    """Rendered in memory (format given explicitly), then written atomically (a local path or a URI)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=figure_format(path, flag), dpi=120)
    storage.write_bytes_atomic(path, buffer.getvalue())


def curve_figure(c) -> Figure:
    """The loss curves, then each curve's relative difference from the baseline inside its bound (the band:
    NOISE_K × the noise when calibrated, the fixed tolerance otherwise), the first point outside marked. A
    run keeps its colour in every panel (c: a parity.comparing.curves.Comparison)."""
    from parity.comparing.noise import relative_diffs
    from parity.comparing.tolerances import QUANTITIES

    base = label(c.baseline.name)
    steps = list(range(c.num_steps))
    colours = {run.name: f"C{i}" for i, run in enumerate(c.runs)}
    fig = Figure(figsize=(10, 14), layout="constrained")
    ax_loss, *ax_diffs = fig.subplots(1 + len(QUANTITIES), 1, sharex=True)
    fig.suptitle(f"{c.num_steps} steps against {c.baseline.label}: {c.word}"
                 + ("" if c.references else " (uncalibrated)"))
    for run in c.runs:
        ax_loss.plot(steps, c.series(run, "loss"), color=colours[run.name], label=run.label)
    ax_loss.set(title="Loss", ylabel="loss (nats)")

    titles = {"loss": "Loss", "grad_norm": "Gradient norm (before clipping)", "param_norm": "Parameter norm (after the step)"}
    for ax, quantity in zip(ax_diffs, QUANTITIES):
        base_series = c.series(c.baseline, quantity)
        for bound in {tuple(r.bounds.per_step[quantity]) for r in c.results if quantity in r.bounds.per_step}:
            kind = "noise band" if any(r.bounds.calibrated for r in c.results) else "tolerance"
            ax.fill_between(steps, [-b for b in bound], bound, color="0.85", label=f"{kind} (bound)")
        for r in c.results:
            ax.plot(steps, relative_diffs(c.series(r.run, quantity), base_series), color=colours[r.run.name],
                    label=r.run.label)
            f = r.verdict.first_outside
            if f and f.quantity == quantity:
                y = (f.value - f.reference) / abs(f.reference) if f.test == "step" else 0.0
                ax.scatter([f.step], [y], color=colours[r.run.name], marker="x", zorder=3,
                           label=f"{label(r.run.name)}: first outside ({f.step}, {f.test})")
        ax.set(title=f"{titles[quantity]}: relative difference from {base}", ylabel=f"(x − {base}) / |{base}|")
    ax_diffs[-1].set(xlabel="step")
    ax_diffs[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_loss, *ax_diffs):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def layer_heatmap(dumps: dict, results: list) -> Figure:
    """Two panels (forward outputs, output gradients): modules × run pairs, log10 relative difference
    (the dumps and PairResults of parity.comparing.layers)."""
    import numpy as np

    panels = [("output", "Forward outputs"), ("output_grad", "Output gradients")]
    modules = dumps[results[0].b].meta["forward_order"]
    fig = Figure(figsize=(6 + 2 * len(results), 0.22 * len(modules) + 2), layout="constrained")
    fig.suptitle("log10 relative difference, per module and run pair")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, (kind, title) in zip(axes, panels):
        grid = np.full((len(modules), len(results)), np.nan)
        for j, r in enumerate(results):
            rel = {row.name: row.rel for row in r.rows if row.kind == kind}
            for i, m in enumerate(modules):
                if m in rel:
                    grid[i, j] = math.log10(max(rel[m], 1e-12)) if math.isfinite(rel[m]) else 0.0
        image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=-12, vmax=0)
        ax.set_title(title)
        ax.set_xticks(range(len(results)), [f"{r.a} vs {r.b}" for r in results], rotation=30, ha="right")
        ax.set_yticks(range(len(modules)), modules, fontsize=7)
    fig.colorbar(image, ax=axes, label="log10(max|a−b| / scale)")
    return fig


def curve_png(comparison, figure_path: str):
    """The comparison's figure as PNG bytes, made once when first asked (the trackers ask): the file itself when it is
    a PNG, else drawn again as one (the figure was written as SVG or PDF)."""
    made = []

    def png() -> bytes:
        if not made:
            if figure_path.lower().split("?")[0].endswith(".png"):
                made.append(storage.read_bytes(figure_path))
            else:
                buffer = io.BytesIO()
                curve_figure(comparison).savefig(buffer, format="png", dpi=120)
                made.append(buffer.getvalue())
        return made[0]
    return png
