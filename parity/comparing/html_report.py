"""report.html: one self-contained page per comparison and per layer check, generated from their JSON alone
(curve_comparison.json, layer_comparison.json; the main job's main_job_times.json and a layer check's folder beside a
comparison when they are there), so that writing it again from a folder gives the same page and a later layer check can
add its module to the comparison's page.

The page holds everything inline (the data, the stylesheet, the script, the heatmap as a data: URI) and a content
security policy that forbids any fetch: it opens from a copied folder, offline, and its links to the records are
relative. The curves are static SVG (parity.comparing.html_charts) that a reader without JavaScript, or on paper,
reads as they are; report.js adds a hover readout (every run's loss, grad norm, parameter norm and bound at a step).
Why plain SVG and no chart library: docs/report.md.
"""

from __future__ import annotations

import json
import os
import shlex
from html import escape

from parity import storage
from parity.comparing import html_page as hp
from parity.comparing.html_charts import curve_panels
from parity.comparing.html_tensors import tensor_section, tensors_cell
from parity.comparing.recorded import RESUMED_ROWS, resumed_note, resumed_rows_words, stopped_words
from parity.comparing.verdict import EXACT_MARGIN
from parity.registry import label, run_label

PAGE_NAME = "report.html"
TIMES_NAME = "main_job_times.json"  # the main job's time table (parity/commands/main_job.py)
CURVE_JSON, LAYER_JSON = "curve_comparison.json", "layer_comparison.json"
TITLES = {"loss": "Loss", "grad_norm": "Gradient norm (before clipping)",
          "param_norm": "Parameter norm (after the step)", "aux_loss": "Load-balancing loss"}
NOUNS = {"loss": "loss", "grad_norm": "grad norm", "param_norm": "param norm", "aux_loss": "aux loss"}
# --- the loss-curve comparison's page ------------------------------------------------------------------

def write_curve_page(directory: str) -> str:
    """report.html from the folder's curve_comparison.json (and main_job_times.json, and the layer checks of its
    FAILs that ran beside it); returns its path."""
    saved = hp.load_json(storage.read_text(storage.join(directory, CURVE_JSON)))
    times_path = storage.join(directory, TIMES_NAME)
    times = json.loads(storage.read_text(times_path)) if storage.exists(times_path) else None
    path = storage.join(directory, PAGE_NAME)
    storage.write_text_atomic(path, curve_page(saved, directory, times))
    return path


def layer_checks(saved: dict, directory: str) -> dict[str, tuple[str, dict]]:
    """Per FAILing run: (folder, layer_comparison.json) of the layer check of its first step outside, where one ran —
    the folder its replay command names, else replay_step_<K> beside the page. Only on this machine's filesystem."""
    found = {}
    if storage.local_path(directory) is None:
        return found
    for name, against in saved["against_baseline"].items():
        f = against.get("first_outside") or {}
        command = (saved.get("replay_commands") or {}).get(name)
        candidates = []
        if command:
            argv = shlex.split(command)
            if "--output_dir" in argv:
                candidates.append(argv[argv.index("--output_dir") + 1])
        if f.get("step") is not None:
            candidates.append(os.path.join(storage.local_path(directory), f"replay_step_{f['step']}"))
        for folder in candidates:
            if os.path.isfile(os.path.join(folder, LAYER_JSON)):
                with open(os.path.join(folder, LAYER_JSON)) as fh:
                    found[name] = (folder, hp.load_json(fh.read()))
                break
    return found


def first_divergence(layer: dict, strategy: str | None = None) -> dict | None:
    """The layer check's first FAILing pair (the one of `strategy` first), with its first divergence."""
    failing = [p for p in layer["pairs"] if p["verdict"] == "FAIL"]
    mine = [p for p in failing if strategy in (p["run"], p["reference"])]
    return (mine or failing or [None])[0]


def curve_data(saved: dict) -> dict:
    """What the charts and the script read: per run its series and, against the baseline, its bounds and first point
    outside."""
    base = saved["baseline"]
    order = [base, *[n for n in saved["runs"] if n != base]]
    runs = []
    for name in order:
        r, against = saved["runs"][name], saved["against_baseline"].get(name, {})
        runs.append({"name": name, "label": r["label"], "short": label(name), "series": r.get("series", {}),
                     "bounds": against.get("bounds"), "first_outside": against.get("first_outside"),
                     "verdict": against.get("verdict", "baseline")})
    quantities = [q for q in TITLES if q in runs[0]["series"]]
    calibrated = any(a.get("calibrated") for a in saved["against_baseline"].values())
    tensors = {name: {"label": saved["runs"][name]["label"], "matrix": a["tensors"]["matrix"]}
               for name, a in saved["against_baseline"].items() if (a.get("tensors") or {}).get("taken")}
    return hp.finite({"num_steps": saved["num_steps"], "runs": runs, "calibrated": calibrated,
                    "quantities": [[q, TITLES[q]] for q in quantities], "nouns": NOUNS, "tensors": tensors})


def verdict_sentence(saved: dict, layers: dict) -> str:
    """The page's first sentence: the verdict, and for a FAIL where (and, after a layer check, in which module)."""
    base = saved["runs"][saved["baseline"]]["label"]
    n = saved["num_steps"]
    against = saved["against_baseline"]
    names = {k: saved["runs"][k]["label"] for k in against}
    if saved["verdict"] == "PASS":
        found = {names[k]: a["tensors"] for k, a in against.items() if a.get("tensors")}
        taken, missing = [k for k, t in found.items() if t["taken"]], [k for k, t in found.items() if not t["taken"]]
        return (f"PASS: every run ({', '.join(names.values())}) trains the same model as {base}: loss, grad norm and "
                f"parameter norm within their bounds at each of the {n} steps."
                + (f" Every tensor's gradient and parameter norm too ({', '.join(taken)})." if taken else "")
                + (f" The tensor verdict was not taken for {', '.join(missing)}." if missing else ""))
    parts = []
    for name, a in against.items():
        if a["verdict"] == "PASS":
            continue
        if a["verdict"] != "FAIL":
            parts.append(f"{names[name]} ran in another precision policy ({a['verdict']}: not judged)")
            continue
        f, parted = a.get("first_outside"), a.get("replicas_parted")
        where = []
        if parted:
            where.append(f"its replicas part at step {parted['step']} ({parted.get('name', '')})")
        if f:
            where.append("first step outside: " + _outside_words(f))
        tf = (saved["runs"][name].get("teacher_forced") or a.get("teacher_forced") or {})
        if tf.get("first_fail_step") is not None and not (f and f.get("test") == "teacher_forced"):
            bad = next((c for c in tf.get("checks", []) if c.get("step") == tf["first_fail_step"]), {})
            where.append(f"teacher-forced check fails first at step {tf['first_fail_step']} ({bad.get('tensor', '')})")
        tv = (a.get("tensors") or {}).get("first_outside")
        if tv and not (f and f.get("test") == "tensors"):
            where.append(f"the tensor verdict fails first at step {tv['step']} ({tv['tensor']}, {tv['phase']}, "
                         f"{tv['ratio']:.3g} × its bound)")
        sentence = f"{names[name]} FAILs: " + "; ".join(where or ["see below"])
        if name in layers:
            pair = first_divergence(layers[name][1], name)
            fd = pair and pair.get("first_outside")
            if fd:
                sentence += (f"; the layer check names the first divergent module: {fd['module']} "
                             f"({fd['quantity']})")
        parts.append(sentence)
    passing = [names[k] for k, a in against.items() if a["verdict"] == "PASS"]
    tail = f" {', '.join(passing)} PASS{'' if len(passing) > 1 else 'es'}." if passing else ""
    return f"{saved['verdict']} against {base} over {n} steps. " + ". ".join(parts) + "." + tail


def stopped_sentences(saved: dict) -> str:
    """Where each recorded run's record stopped early, a sentence each after the verdict's ('' when none did)."""
    return "".join(f" {run['label']}: {stopped_words(run['stopped'])}." for run in saved["runs"].values()
                   if run.get("stopped"))


def _replicas(run: dict, against: dict) -> str:
    parted = against.get("replicas_parted") if against else None
    if parted:
        return f'<span class="differs">✗ part at step {parted["step"]}: {escape(str(parted.get("name", "")))}</span>'
    checks = run.get("replica_checks") or {}
    if not checks.get("declared"):
        return "not declared by the strategy"
    if not checks.get("groups"):
        return "none held by several ranks"
    return f"bit-identical at {checks['checks']} checks of {checks['groups']} tensors"


def _outside_words(f: dict) -> str:
    """The first point outside in words, by the test that found it (parity.comparing.verdict.Outside)."""
    test, step = f.get("test"), f"step {f['step']}"
    if test == "step":
        return (f"{step}, {NOUNS.get(f['quantity'], f['quantity'])} {f['value']:.6g} vs {f['reference']:.6g}, relative "
                f"diff {f['rel_diff']:.3e} > bound {f['tolerance']:.3e}")
    if test == "tensors":
        return (f"{step}, the tensor verdict: {f.get('module')}, phase {f['quantity']}: {f['value']:.6g} vs "
                f"{f['reference']:.6g}, deviation {f['rel_diff']:.3e} > bound {f['tolerance']:.3e}")
    if test == "teacher_forced":
        return (f"{step}, the teacher-forced check: {f.get('module')} relative diff {f['rel_diff']:.3e} > bound "
                f"{f['tolerance']:.3e}")
    if test == "drift":
        return (f"{step}, {NOUNS.get(f['quantity'], f['quantity'])} drifts (one sign over a window): mean relative "
                f"diff {f['rel_diff']:.3e} > {f['tolerance']:.3e}")
    if test == "overflow":
        return f"{step}, one run skipped it on an fp16 overflow and the other applied it"
    if test == "loss_scaler":  # parity/comparing/loss_scales.py
        return (f"{step}, its loss scaler: " + ("skipped without an overflow" if f["quantity"] == "skipped" and
                f.get("value") else "applied on an overflow" if f["quantity"] == "skipped" else
                f"scale {f.get('value')} where its rules give {f.get('reference')}"))
    if test == "lr_schedule":
        return (f"{step}, the lr applied ({f.get('value')}) is not the one the framework's settings declare "
                f"({f.get('reference')})")
    if test == "duplicate_rows":
        return f"{step}, two data-parallel ranks fed the same rows"
    if test == RESUMED_ROWS:
        return f"{step}, {resumed_rows_words(f['step'], bool(f['value']))}"
    return f"{step} ({test}, {f['quantity']})"


def _outside(a: dict) -> str:
    f = a.get("first_outside")
    if not f:
        return "–"
    step, _, rest = _outside_words(f).partition(", ")
    return f"<strong>{escape(step)}</strong>: {escape(rest)}"


def runs_table(saved: dict, directory: str, quantities: list[str]) -> str:
    rows = []
    for name, run in saved["runs"].items():
        a = saved["against_baseline"].get(name)
        record = (saved.get("record_links") or {}).get(name, run["file"])
        link = f'<a href="{escape(record)}">{escape(run["file"])}</a>'
        if a is None:
            rows.append([escape(run["label"]), "baseline", "–", "–", "–", "–", "–", _replicas(run, {}), link])
            continue
        ratios, held = a.get("noise_ratio") or {}, a.get("bounds_held") or {}  # (a page of an older json: no held)
        ratio = "<br>".join(escape(f"{NOUNS.get(q, q)} " + (f"{ratios[q]:.1f} × noise" if q in ratios else "")
                                   + (": " if q in ratios and q in held else "")
                                   + (f"{held[q]['ratio']:.2g} of {held[q]['held']}" if q in held else ""))
                            for q in quantities if q in held or q in ratios) or "uncalibrated"
        ratio += f"<br>{escape(EXACT_MARGIN)}" if a.get("bit_identical") else (
            f"<br>margin {a['margin']:.1f}×" if a.get("margin") else "")
        worst = "<br>".join(f"{escape(NOUNS.get(q, q))} {a['max_rel_diff'][q]:.3e}" for q in quantities
                            if q in a["max_rel_diff"])
        rows.append([escape(run["label"]), hp.word(a["verdict"]), ratio, worst,
                     "calibrated" if a.get("calibrated") else "uncalibrated", _outside(a), tensors_cell(a),
                     _replicas(run, a), link])
    return hp.table(["run", "verdict", "deviation ÷ noise, and ÷ the bound that held", "max relative diff", "bounds",
                   "first step outside", "tensor verdict", "replicas", "record"], rows,
                  "One row per run, against the baseline",
                  "runs")


def teacher_forced_table(name: str, label_: str, tf: dict) -> str:
    rows = [[str(c["step"]), hp.word("PASS" if c["ok"] else "FAIL"), escape(c.get("tensor") or "–"), hp.sci(c.get("rel_diff")),
             hp.sci(c.get("bound")), hp.sci(c.get("ratio")), escape(c.get("note") or "")] for c in tf.get("checks", [])]
    first = tf.get("first_fail_step")
    every = f" (every {tf['interval']} steps)" if tf.get("interval") is not None else ""
    out = [f'<h3 id="teacher-forced-{escape(name)}">{escape(label_)}: teacher-forced check{every}</h3>',
           f"<p>No check: {escape(tf['none'])}.</p>" if tf.get("none") else
           f"<p>First failing checkpoint: <strong>step {first}</strong>.</p>" if first is not None else
           "<p>Every checkpoint within its bound.</p>",
           hp.table(["step", "verdict", "tensor", "relative diff", "bound", "ratio", "note"], rows) if rows else ""]
    if tf.get("replay_command"):
        out.append(f"<pre><code>{escape(tf['replay_command'])}</code></pre>")
    return "\n".join(out)


def failure_section(saved: dict, name: str, directory: str, layers: dict) -> str:
    run, a = saved["runs"][name], saved["against_baseline"][name]
    f = a.get("first_outside")
    resumed = resumed_note(run.get("resumed_at", []), f["step"], f.get("test")) if f else None
    out = [f'<section id="why-{escape(name)}"><h2>Why {escape(run["label"])} FAILed</h2>',
           f"<p>{_outside(a)}</p>" if f else "", f"<p>{escape(resumed)}.</p>" if resumed else ""]
    if a.get("replicas_parted"):
        out.append(f"<p>{escape(a['replicas_parted'].get('line', ''))}</p>")
    diffs = a.get("config_differences") or []
    rows = [[escape(d.split(": ", 1)[0]), escape(d.split(": ", 1)[1] if ": " in d else "")] for d in diffs]
    out.append("<h3>Config fields that differ from the baseline (the first suspects)</h3>")
    out.append(hp.table(["field", "baseline's vs this run's"], rows) if rows else "<p>None recorded.</p>")
    command = (saved.get("replay_commands") or {}).get(name)
    if command:
        out += ["<h3>Replay the first step outside, layer by layer</h3>", f"<pre><code>{escape(command)}</code></pre>"]
    if name in layers:
        folder, layer = layers[name]
        pair = first_divergence(layer, name)
        link = hp.relative_link(os.path.join(folder, PAGE_NAME), directory)
        out.append(f'<h3 id="layer-check-{escape(name)}">Layer check (<a href="{escape(link)}">its page</a>; '
                   f'<a href="#tensors-{escape(name)}">the tensor verdict</a>)</h3>')
        fd = pair and pair.get("first_outside")
        if fd:
            out.append(f'<p class="module">First divergent module: <strong>{escape(fd["module"])}</strong>, phase '
                       f'<strong>{escape(fd["quantity"])}</strong> ({escape(pair["run"])} vs '
                       f'{escape(pair["reference"])}: relative diff {fd["rel_diff"]:.3e} &gt; {fd["tolerance"]:.2e}).</p>')
        else:
            out.append("<p>The layer check found every pair within its tolerances at that step.</p>")
        heatmap = os.path.join(folder, layer.get("heatmap", "layer_heatmap.png"))
        out.append(hp.image(heatmap, "Layer heatmap: log10 relative difference per module (rows, named) and run pair"))
    out.append("</section>")
    return "\n".join(out)


RUN_PARTS = ("setup_s", "steps_s", "teacher_forced_s", "checkpoints_s", "finish_s")  # a run's timed parts


def run_times(r: dict) -> str:
    """One run's seconds by part, as the main job's time table says them (its text and this page)."""
    return (f"setup {r['setup_s']:.1f} s, {r['steps']} steps {r['steps_s']:.1f} s, teacher-forced checks "
            f"{r['teacher_forced_s']:.1f} s, checkpoints {r['checkpoints_s']:.1f} s, finishing {r['finish_s']:.1f} s, "
            f"the rest {r['other_s']:.1f} s")


def time_section(times: dict) -> str:
    rows = []
    for row in times["rows"]:
        rows.append([escape(row["what"]), f"{row['seconds']:.1f} s", ""])
        for r in row.get("runs", []):
            seconds = sum(r[k] for k in (*RUN_PARTS, "other_s"))
            rows.append([f'<span class="indent">{escape(r["title"])}</span>', f"{seconds:.1f} s", run_times(r)])
        for what, seconds in row.get("parts", []):
            rows.append([f'<span class="indent">{escape(what)}</span>', f"{seconds:.1f} s", ""])
    return (f'<section id="time"><h2>Where the time went ({times["total_s"]:.0f} s)</h2>'
            + hp.table(["what", "seconds", "of which"], rows) + "</section>")


def curve_page(saved: dict, directory: str, times: dict | None = None) -> str:
    """The comparison's page (HTML text) from its JSON."""
    layers = layer_checks(saved, directory)
    data = curve_data(saved)
    quantities = [q for q, _ in data["quantities"]]
    base = saved["runs"][saved["baseline"]]["label"]
    word = saved["verdict"]
    body = [f'<header><h1>Loss-curve comparison against {escape(base)}: {hp.word(word)}</h1>',
            f'<p id="verdict" class="verdict {word.lower().replace(" ", "-")}" role="status">'
            f'{escape(verdict_sentence(saved, layers) + stopped_sentences(saved))}</p>']
    body += [f'<p class="warning">{escape(w)}</p>' for w in saved.get("warnings", [])]
    tensors = any(a.get("tensors") for a in saved["against_baseline"].values())
    sections = [("runs", "Verdict per run"), ("curves", "Curves"), *([("tensors", "Tensor verdict")] if tensors else []),
                *[(f"why-{n}", f"Why {saved['runs'][n]['label']} "
                f"FAILed") for n, a in saved["against_baseline"].items() if a["verdict"] == "FAIL"],
                *([("teacher-forced", "Teacher-forced check")] if any(r.get("teacher_forced") for r in
                                                                       saved["runs"].values()) else []),
                ("fingerprints", "Fingerprints"), *([("time", "Where the time went")] if times else []),
                ("statistics", "Statistics"), ("files", "Files")]
    body.append('<nav aria-label="Sections"><ul>' + "".join(f'<li><a href="#{escape(i)}">{escape(t)}</a></li>'
                                                            for i, t in sections) + "</ul></nav></header><main>")
    refs = saved.get("noise_references") or []
    calibration = (f"Bounds calibrated on {', '.join(refs)}: 20 × the noise between them and the baseline at each step."
                   if refs else "Bounds UNCALIBRATED: no noise reference in the folder, so the fixed table by "
                                "precision applies.")
    body += ['<section id="runs"><h2>Verdict per run</h2>', f"<p>{escape(calibration)}</p>",
             runs_table(saved, directory, quantities), "</section>"]
    charts = "".join(f'<figure class="chart"><figcaption>{escape(h)}</figcaption>{svg}</figure>'
                     for h, svg in curve_panels(data)) if quantities else (
        "<p>This comparison's JSON predates the per-step values the charts need: run plot_loss_curves.py on the "
        "folder again.</p>")
    figure = saved.get("figure")
    body += ['<section id="curves"><h2>Curves</h2>',
             '<p class="hint">With JavaScript on, hover a chart (or focus it and use ← →) to read every run\'s values '
             'at a step. The grey '
             'band is the bound; a cross marks the first point outside.</p>',
             '<div id="readout" aria-live="polite" hidden></div>', charts,
             (f'<p>The same figure as an image: <a href="{escape(figure)}">{escape(figure)}</a>.</p>' if figure else ""),
             "</section>"]
    body += [tensor_section(saved, directory, layers)] if tensors else []
    for name, a in saved["against_baseline"].items():
        if a["verdict"] == "FAIL":
            body.append(failure_section(saved, name, directory, layers))
    forced = [teacher_forced_table(name, run["label"], tf) for name, run in saved["runs"].items()
              if (tf := run.get("teacher_forced") or saved["against_baseline"].get(name, {}).get("teacher_forced"))]
    if forced:
        body.append('<section id="teacher-forced"><h2>Teacher-forced check</h2>' + "\n".join(forced) + "</section>")
    body += ['<section id="fingerprints"><h2>Fingerprints</h2>', hp.fingerprints(saved["fingerprints"]), "</section>"]
    if times:
        body.append(time_section(times))
    stats = []
    for q in quantities:
        rows = [[escape(r["label"]), *(f"{r[q][k]:.6f}" if isinstance(r[q][k], float) else escape(str(r[q][k]))
                                       for k in ("initial", "final", "min", "mean"))]
                for r in saved["runs"].values() if q in r]
        stats.append(f"<h3>{escape(TITLES[q])}</h3>" + hp.table(["run", "initial", "final", "min", "mean"], rows))
    body += ['<section id="statistics"><h2>Statistics</h2>', *stats, "</section>"]
    files = [(CURVE_JSON, "the comparison, machine-readable"), ("curve_report.md", "the same as Markdown tables")]
    files += [(figure, "the figure")] if figure else []
    files += [(TIMES_NAME, "the main job's time table")] if times else []
    links = [f'<li><a href="{escape(f)}">{escape(f)}</a>: {escape(w)}</li>' for f, w in files]
    links += [f'<li><a href="{escape(link)}">{escape(saved["runs"][n]["file"] if n in saved["runs"] else n)}</a>: '
              f'loss record</li>' for n, link in (saved.get("record_links") or {}).items()]
    links += [f'<li><a href="{escape(hp.relative_link(os.path.join(folder, PAGE_NAME), directory))}">layer check of '
              f'{escape(saved["runs"][n]["label"])}</a></li>' for n, (folder, _) in layers.items()]
    body += ['<section id="files"><h2>Files</h2><ul>', *links, "</ul></section></main>"]
    return hp.page(f"{word}: loss curves against {base}", "\n".join(body), data)


# --- the layer check's page ----------------------------------------------------------------------------

def write_layer_page(directory: str) -> str:
    """report.html from the layer-check folder's layer_comparison.json (and its heatmap); returns its path."""
    with open(os.path.join(directory, LAYER_JSON)) as f:
        saved = hp.load_json(f.read())
    path = os.path.join(directory, PAGE_NAME)
    storage.write_text_atomic(path, layer_page(saved, directory))
    return path


def layer_page(saved: dict, directory: str) -> str:
    labels = {s: run_label(s, r) for s, r in saved["runs"].items()}
    pairs = saved["pairs"]
    failing = [p for p in pairs if p["verdict"] == "FAIL"]
    word = "FAIL" if failing else "PASS"
    if failing:
        p = failing[0]
        fd = p.get("first_outside") or {}
        sentence = (f"FAIL: {labels.get(p['run'], p['run'])} first diverges from {labels.get(p['reference'], p['reference'])}"
                    f" at module {fd.get('module')} ({fd.get('quantity')}), relative diff {fd.get('rel_diff', 0):.3e} "
                    f"> {fd.get('tolerance', 0):.2e}" + (f"; {len(failing) - 1} more pair(s) FAIL." if len(failing) > 1
                                                         else "."))
    else:
        same = [f"{labels[p['run']]} vs {labels[p['reference']]}" for p in pairs if p["bit_identical"]]
        sentence = (f"PASS: every pair of the {len(pairs)} agrees tensor for tensor within its tolerance"
                    + (f" ({', '.join(same)} bit-identical)." if same else "."))
    rows = []
    for p in pairs:
        fd = p.get("first_outside")
        rows.append([f"{escape(labels.get(p['run'], p['run']))} vs {escape(labels.get(p['reference'], p['reference']))}",
                     hp.word(p["verdict"]), "calibrated" if p.get("calibrated") else "fixed",
                     "yes" if p["bit_identical"] else "no", hp.sci(p["max_rel"]),
                     (f"<strong>{escape(fd['module'])}</strong> ({escape(fd['quantity'])}): {fd['rel_diff']:.3e} &gt; "
                      f"{fd['tolerance']:.2e}") if fd else "–", f"{p['loss']:.8f} vs {p['reference_loss']:.8f}"])
    run_rows = [[escape(labels[s]), escape(r["precision"]), f"{r['loss']:.8f}",
                 ", ".join(f"{x:.8f}" for x in r["dp_rank_losses"]), hp.sci(r.get("grad_norm")),
                 escape(str(r.get("perturbed") or "–"))] for s, r in saved["runs"].items()]
    modules = list(dict.fromkeys(row["name"] for p in pairs for row in p["rows"] if row["kind"] == "output"))
    grid = []
    for m in modules:
        cells = [f"<code>{escape(m)}</code>"]
        for p in pairs:
            row = next((r for r in p["rows"] if r["kind"] == "output" and r["name"] == m), None)
            if row is None:
                cells.append("–")
                continue
            over = not row["rel"] <= row["tolerance"]  # NaN is over too
            cells.append(f'<span class="differs">✗ {hp.sci(row["rel"])}</span>' if over else hp.sci(row["rel"]))
        grid.append(cells)
    heatmap = saved.get("heatmap", "layer_heatmap.png")
    parent = os.path.dirname(os.path.abspath(directory))
    back = (f'<p>This check replays a step of the comparison in <a href="../{PAGE_NAME}">../{PAGE_NAME}</a> (its '
            f'<a href="../{PAGE_NAME}#tensors">tensor verdict</a>).</p>'
            if os.path.isfile(os.path.join(parent, CURVE_JSON)) else "")
    body = [f"<header><h1>Layer-by-layer check: {hp.word(word)}</h1>",
            f'<p id="verdict" class="verdict {word.lower()}" role="status">{escape(sentence)}</p>{back}</header><main>',
            '<section id="pairs"><h2>Pairs</h2>',
            hp.table(["pair (run vs reference)", "verdict", "tolerance", "bit-identical", "max relative diff",
                    "first divergence (module, phase)", "loss vs reference"], rows), "</section>",
            '<section id="heatmap"><h2>Heatmap</h2>',
            hp.image(os.path.join(directory, heatmap), "Layer heatmap: log10 relative difference per module (rows, "
                   "named) and run pair (columns), forward outputs and output gradients"),
            "<h3>Forward outputs: relative difference per module (✗: over its tolerance)</h3>",
            hp.table(["module", *[escape(f"{p['run']} vs {p['reference']}") for p in pairs]], grid, cls="modules"),
            "</section>", '<section id="runs"><h2>Runs</h2>',
            hp.table(["run", "precision", "loss", "loss per DP rank", "grad norm", "perturbed"], run_rows), "</section>",
            '<section id="fingerprints"><h2>Fingerprints</h2>',
            hp.fingerprints({labels[s]: r.get("fingerprint") for s, r in saved["runs"].items()}), "</section>",
            '<section id="files"><h2>Files</h2><ul>',
            *[f'<li><a href="{escape(f)}">{escape(f)}</a></li>' for f in ("layer_report.md", LAYER_JSON, heatmap,
                                                                          "layer_check.log")
              if os.path.exists(os.path.join(directory, f))],
            *[f'<li><a href="dump_{escape(s)}.json">dump_{escape(s)}.json</a></li>' for s in saved["runs"]],
            "</ul></section></main>"]
    return hp.page(f"{word}: layer check", "\n".join(body))


def refresh_comparison_beside(layer_dir: str) -> str | None:
    """After a layer check in a folder beside a comparison (its replay of a FAIL's step): that comparison's page
    written again, now naming the module. Returns its path, or None when there is no comparison there."""
    parent = os.path.dirname(os.path.abspath(layer_dir))
    if not os.path.isfile(os.path.join(parent, CURVE_JSON)):
        return None
    return write_curve_page(parent)

