"""What compare_dumps.py writes: the console summary, comparison.md (seed 001's tables, on full
tensors), comparison.json and the heatmap (modules × run pairs, log10 relative difference)."""

from __future__ import annotations

import math
import os

from parity.atomic import atomic_path, write_json_atomic, write_text_atomic
from parity.layer_compare import Dump, PairResult, summary_json


def console_summary(dumps: dict[str, Dump], results: list[PairResult]) -> str:
    lines = ["LAYER-BY-LAYER VERIFICATION (one step, full tensors)", ""]
    for s, d in dumps.items():
        extra = f"  [perturbed: {d.meta['perturbed']}]" if d.meta.get("perturbed") else ""
        losses = ", ".join(f"{x:.8f}" for x in d.meta["dp_rank_losses"])
        lines.append(f"{d.label}: loss {d.meta['loss']:.8f} (per DP rank: {losses}), {d.meta['precision']}{extra}")
    lines.append("")
    for r in results:
        head = f"{dumps[r.a].label} vs {dumps[r.b].label}: {'PASS' if r.passed else 'FAIL'}"
        detail = "bit-identical" if r.bit_identical else f"max relative diff {r.max_rel:.3e} (tolerance {r.tolerance:.0e})"
        lines.append(f"{head} — {detail}")
        if r.first_divergence:
            fd = r.first_divergence
            lines.append(f"  first divergence: {fd['module']} ({fd['phase']}), relative diff {fd['rel']:.3e}")
    return "\n".join(lines)


def markdown(dumps: dict[str, Dump], results: list[PairResult], heatmap_name: str) -> str:
    names = list(dumps)
    labels = [dumps[s].label for s in names]
    ref = dumps[names[0]]
    out = ["# Layer-by-layer verification", "",
           "One forward/backward/optimizer step on a fixed global batch from shared initial weights. Every "
           "tensor is full size under its Hugging Face name (TP shards gathered, DP slices concatenated), so "
           "sharded layers are compared like any other.", "", "## Loss", "",
           f"| Implementation | Loss | Relative diff from {ref.label} |", "|---|---|---|"]
    for s in names:
        loss = dumps[s].meta["loss"]
        out.append(f"| {dumps[s].label} | {loss:.8f} | {abs(loss - ref.meta['loss']) / abs(ref.meta['loss']):.2e} |")
    out += ["", "## Loss by DP rank", "", "| DP rank | " + " | ".join(labels) + " |",
            "|---|" + "---|" * len(names)]
    for r in range(len(ref.meta["dp_rank_losses"])):
        out.append(f"| {r} | " + " | ".join(f"{dumps[s].meta['dp_rank_losses'][r]:.8f}" for s in names) + " |")
    for kind, title in (("output", "Layer output norms"), ("output_grad", "Layer output-gradient norms"),
                        ("grad", "Parameter gradient norms")):
        out += ["", f"## {title}", "", "| Module | " + " | ".join(labels) + " |", "|---|" + "---|" * len(names)]
        for key in [k for k in ref.tensors if k.startswith(kind + "/")] if kind == "grad" else \
                [f"{kind}/{n}" for n in ref.meta["forward_order"] if f"{kind}/{n}" in ref.tensors]:
            norms = [f"{float(dumps[s].tensors[key].double().norm()):.4f}" if key in dumps[s].tensors else "–"
                     for s in names]
            out.append(f"| {key.split('/', 1)[1]} | " + " | ".join(norms) + " |")
    for r in results:
        verdict = "PASS" if r.passed else "FAIL"
        out += ["", f"## {dumps[r.a].label} vs {dumps[r.b].label}: {verdict}", "",
                f"Tolerance {r.tolerance:.0e} (relative to each tensor's max |value|); "
                + ("**bit-identical**." if r.bit_identical else f"max relative diff {r.max_rel:.3e}.")]
        if r.first_divergence:
            fd = r.first_divergence
            out.append(f"First divergence: **{fd['module']}** ({fd['phase']}), relative diff {fd['rel']:.3e}.")
        out += ["", "| Tensor | Norm (run) | Norm (reference) | Max abs diff | Relative diff |", "|---|---|---|---|---|"]
        out += [f"| {row.key} | {row.norm_a:.4f} | {row.norm_b:.4f} | {row.max_abs:.2e} | {row.rel:.2e} |"
                for row in r.rows]
    out += ["", f"![heatmap]({heatmap_name})", ""]
    return "\n".join(out)


def heatmap_figure(dumps: dict[str, Dump], results: list[PairResult]):
    """Two panels (forward outputs, output gradients): modules × run pairs, log10 relative difference."""
    import numpy as np
    from matplotlib.figure import Figure

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


def write_outputs(input_dir: str, dumps: dict[str, Dump], results: list[PairResult], heatmap_path: str) -> None:
    fig = heatmap_figure(dumps, results)
    ext = os.path.splitext(heatmap_path)[1].lstrip(".").lower() or "png"
    with atomic_path(heatmap_path) as tmp:
        fig.savefig(tmp, format=ext, dpi=110)
    write_json_atomic(os.path.join(input_dir, "comparison.json"), summary_json(dumps, results))
    write_text_atomic(os.path.join(input_dir, "comparison.md"),
                      markdown(dumps, results, os.path.relpath(heatmap_path, input_dir)))
