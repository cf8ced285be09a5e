"""The comparison figure: loss curves, each run's loss minus the baseline's inside the tolerance band,
and the pre-clip gradient norms.

Built on a bare `matplotlib.figure.Figure` (no pyplot): nothing global is touched, nothing needs a
display, and `savefig` renders PNG with Agg and SVG/PDF with their own backends.
"""

from __future__ import annotations

import os

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from parity.atomic import atomic_path
from parity.compare import Comparison
from parity.errors import ConfigError
from parity.strategies import display_name

FIGURE_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def figure_format(path: str) -> str:
    """The format the output's extension asks for; ConfigError for one matplotlib is not asked to write."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FIGURE_FORMATS:
        raise ConfigError(f"--output {path}: unknown extension '{ext}': use {', '.join(FIGURE_FORMATS)}")
    return FIGURE_FORMATS[ext]


def plot_comparison(c: Comparison) -> Figure:
    """Three panels sharing the step axis; a run keeps its colour in all of them."""
    base = display_name(c.baseline.name)
    steps = list(range(c.num_steps))
    colours = {run.name: f"C{i}" for i, run in enumerate(c.runs)}
    fig = Figure(figsize=(10, 11), layout="constrained")
    ax_loss, ax_diff, ax_grad = fig.subplots(3, 1, sharex=True)
    fig.suptitle(f"{c.num_steps} steps against {c.baseline.label}: {c.status}")

    for run in c.runs:
        ax_loss.plot(steps, c.series(run, "loss"), color=colours[run.name], label=run.label)
        ax_grad.plot(steps, c.series(run, "grad_norm"), color=colours[run.name], label=run.label)
    ax_loss.set(title="Loss", ylabel="loss (nats)")
    ax_grad.set(title="Gradient norm (before clipping)", ylabel="global L2 norm", xlabel="step")
    ax_grad.xaxis.set_major_locator(MaxNLocator(integer=True))

    base_losses = c.series(c.baseline, "loss")
    for rtol in sorted({v.tolerance.rtol for v in c.verdicts}):
        band = [rtol * abs(b) for b in base_losses]
        ax_diff.fill_between(steps, [-x for x in band], band, color="0.85",
                             label=f"tolerance ±{rtol:g}·|{base}|")
    for v in c.verdicts:
        diffs = [x - b for x, b in zip(c.series(v.run, "loss"), base_losses)]
        ax_diff.plot(steps, diffs, color=colours[v.run.name], label=v.run.label)
        if v.first_failure:  # marked where it happened: on the loss difference, or on the grad norm
            f = v.first_failure
            ax, y = (ax_diff, f.value - f.baseline_value) if f.quantity == "loss" else (ax_grad, f.value)
            ax.scatter([f.step], [y], color=colours[v.run.name], marker="x", zorder=3,
                       label=f"{display_name(v.run.name)}: first step outside ({f.step}, {f.quantity})")
    ax_diff.set(title=f"Loss difference from {base}", ylabel=f"loss − {base} loss")

    for ax in (ax_loss, ax_diff, ax_grad):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def save_figure(fig: Figure, path: str) -> None:
    """Atomically: rendered to a temporary file beside `path` (format given explicitly), then renamed."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=figure_format(path), dpi=120)
