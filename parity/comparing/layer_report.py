"""What the layer check writes: the console summary, layer_report.md (seed 001's tables, on full tensors),
layer_comparison.json, the heatmap (modules × run pairs, log10 relative difference) and report.html."""

from __future__ import annotations

import os

from parity import fingerprint
from parity.comparing.figures import layer_heatmap, save_figure
from parity.comparing.html_report import write_layer_page
from parity.comparing.layers import Dump, PairResult, summary_json
from parity.storage import write_json_atomic, write_text_atomic

JSON_NAME, REPORT_NAME, HEATMAP_NAME = "layer_comparison.json", "layer_report.md", "layer_heatmap.png"


def console_summary(dumps: dict[str, Dump], results: list[PairResult]) -> str:
    lines = ["LAYER-BY-LAYER VERIFICATION (one step, full tensors)", ""]
    for s, d in dumps.items():
        extra = f"  [perturbed: {d.meta['perturbed']}]" if d.meta.get("perturbed") else ""
        losses = ", ".join(f"{x:.8f}" for x in d.meta["dp_rank_losses"])
        lines.append(f"{d.label}: loss {d.meta['loss']:.8f} (per DP rank: {losses}), {d.meta['precision']}{extra}")
    lines += ["", "Fingerprints (shared code, strategy code, libraries, device):"]
    lines += [f"  {d.label}: {fingerprint.short(d.meta['fingerprint'])}" for d in dumps.values()]
    lines.append("")
    for r in results:
        head = f"{dumps[r.a].label} vs {dumps[r.b].label}: {r.verdict.word}"
        detail = "bit-identical" if r.bit_identical else f"max relative diff {r.max_rel:.3e} ({_tolerance_words(r)})"
        lines.append(f"{head} — {detail}")
        fd = r.verdict.first_outside
        if fd:
            lines.append(f"  first divergence: {fd.module} ({fd.quantity}), relative diff {fd.rel_diff:.3e} > "
                         f"{fd.tolerance:.2e}")
        lines += [f"  {line}" for line in routing_lines(r)]
    return "\n".join(lines)


def routing_lines(r: PairResult) -> list[str]:
    """A mixture of experts' routing against the reference's: loads equal, or each flipped token (router, token, the
    reference's logit gap). Never silent; the tensors' tolerances decide the verdict."""
    if not r.routing:
        return []
    flipped = [(router["router"], f) for router in r.routing for f in router["flips"]]
    if not flipped:
        return ["routing: every token went to the reference's experts (expert loads equal)"]
    return [f"routing: {len(flipped)} token(s) went to other experts than the reference's (judged by the tensors' "
            f"tolerances):", *(f"  {name} token {f['token']}: experts {f['experts']} vs {f['reference_experts']}, "
                               f"reference logit gap {f['logit_gap']:.3e}" for name, f in flipped[:10])]


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
    out += ["", "## Fingerprints", "", "| run | fingerprint |", "|---|---|"]
    out += [f"| {dumps[s].label} | {fingerprint.short(dumps[s].meta['fingerprint'])} |" for s in names]
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
        out += ["", f"## {dumps[r.a].label} vs {dumps[r.b].label}: {r.verdict.word}", "",
                f"{_tolerance_words(r).capitalize()}, relative to each tensor's max |value|; "
                + ("**bit-identical**." if r.bit_identical else f"max relative diff {r.max_rel:.3e}.")]
        fd = r.verdict.first_outside
        if fd:
            out.append(f"First divergence: **{fd.module}** ({fd.quantity}), relative diff {fd.rel_diff:.3e} > "
                       f"{fd.tolerance:.2e}.")
        out += ["", *routing_lines(r)] if r.routing else []
        out += ["", "| Tensor | Norm (run) | Norm (reference) | Max abs diff | Relative diff | Tolerance |",
                "|---|---|---|---|---|---|"]
        out += [f"| {row.key} | {row.norm_a:.4f} | {row.norm_b:.4f} | {row.max_abs:.2e} | {row.rel:.2e} | "
                f"{(r.tolerance[row.key] if isinstance(r.tolerance, dict) else r.tolerance):.2e} |" for row in r.rows]
    out += ["", f"![heatmap]({heatmap_name})", ""]
    return "\n".join(out)


def _tolerance_words(r: PairResult) -> str:
    if isinstance(r.tolerance, dict):
        return r.verdict.tolerance_source
    return f"tolerance {r.tolerance:.0e}, {r.verdict.tolerance_source}"


def write_outputs(input_dir: str, dumps: dict[str, Dump], results: list[PairResult], heatmap_path: str) -> list[str]:
    """The heatmap, layer_comparison.json, layer_report.md and report.html (all atomic); returns the paths."""
    json_path, md_path = os.path.join(input_dir, JSON_NAME), os.path.join(input_dir, REPORT_NAME)
    save_figure(layer_heatmap(dumps, results), heatmap_path, flag="--heatmap")
    heatmap = os.path.relpath(heatmap_path, input_dir)
    write_json_atomic(json_path, {**summary_json(dumps, results), "heatmap": heatmap})
    write_text_atomic(md_path, markdown(dumps, results, heatmap))
    return [md_path, json_path, heatmap_path, write_layer_page(input_dir)]
