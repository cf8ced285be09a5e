"""report.html's shell and its small parts, for every page (parity/comparing/html_report.py: the curve comparison's
and the layer check's): the page with its content security policy, stylesheet and script inlined; a table; a verdict's
word; numbers formatted, JSON made finite for the page and its spelled-out non-finite numbers read back; a relative
link; an image inlined; the records' fingerprints side by side."""

from __future__ import annotations

import base64
import json
import math
import os
from html import escape
from importlib import resources

from parity import fingerprint, storage

CSP = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
       "base-uri 'none'; form-action 'none'")


def asset(name: str) -> str:
    return resources.files("parity.comparing").joinpath("report_assets", name).read_text(encoding="utf-8")


def page(title: str, body: str, data: dict | None = None) -> str:
    script = ""
    if data is not None:
        blob = json.dumps(data, allow_nan=False).replace("</", "<\\/")
        script = (f'<script type="application/json" id="report-data">{blob}</script>\n'
                  f'<script>{asset("report.js")}</script>')
    return (f'<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>{escape(title)}</title>\n'
            f'<style>{asset("report.css")}</style>\n</head>\n<body>\n{body}\n{script}\n</body>\n</html>\n')


def table(headers: list[str], rows: list[list[str]], caption: str = "", cls: str = "") -> str:
    """A table with a header row (and row headers in the first column); cells are HTML already."""
    head = "".join(f'<th scope="col">{h}</th>' for h in headers)
    body = "".join("<tr>" + "".join((f'<th scope="row">{c}</th>' if i == 0 else f"<td>{c}</td>")
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    cap = f"<caption>{caption}</caption>" if caption else ""
    return f'<table class="{cls}">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def word(word: str) -> str:
    cls = {"PASS": "pass", "FAIL": "fail"}.get(word, "other")
    mark = {"PASS": "✓", "FAIL": "✗"}.get(word, "!")
    return f'<span class="word {cls}">{mark} {escape(word)}</span>'


def sci(x: float | None) -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return escape(x)
    return f"{x:.3e}" if isinstance(x, float) else str(x)


def finite(value):
    """JSON for the page: a non-finite number becomes null (the page shows a gap)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def load_json(text: str):
    """A JSON file's data with its spelled-out non-finite numbers made numbers again (the page formats them)."""
    return storage.finite_restored(json.loads(text))


def relative_link(target: str, directory: str) -> str:
    """A link from the page's folder: relative when both are on this machine, the location itself otherwise."""
    a, b = storage.local_path(target), storage.local_path(directory)
    if a is None or b is None:
        return target
    return os.path.relpath(a, b).replace(os.sep, "/")


def image(path: str, alt: str) -> str:
    """An image file inlined as a data: URI ('' when it is not there or not an image a browser shows)."""
    kinds = {".png": "image/png", ".svg": "image/svg+xml"}
    kind = kinds.get(os.path.splitext(path)[1].lower())
    if kind is None or not storage.exists(path):
        return ""
    data = base64.b64encode(storage.read_bytes(path)).decode()
    return f'<img class="heatmap" src="data:{kind};base64,{data}" alt="{escape(alt)}">'


def fingerprints(records: dict[str, dict]) -> str:
    """Every record's fingerprint side by side, one row per field; a cell that differs from the first record's is
    marked (≠, in words as well as in colour)."""
    def flat(fp: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in fp.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = ", ".join(map(str, v)) if isinstance(v, list) else str(v)
        return out
    flats = {name: flat(fingerprint.reported(fp or {})) for name, fp in records.items()}
    names = list(flats)
    fields = list(dict.fromkeys(k for f in flats.values() for k in f))
    rows, differing = [], 0
    for field in fields:
        first = flats[names[0]].get(field, "–")
        cells = [escape(field)]
        for n in names:
            value = flats[n].get(field, "–")
            short = value[:12] + "…" if field.endswith("sha256") and len(value) > 16 else value
            if value != first:
                differing += 1
                cells.append(f'<span class="differs" title="{escape(value)}">≠ {escape(short)}</span>')
            else:
                cells.append(f'<span title="{escape(value)}">{escape(short)}</span>')
        rows.append(cells)
    note = (f"{differing} cell(s) differ from {escape(names[0])}'s, marked ≠ (the strategy's own code differs by "
            f"design: it is what is judged)." if differing else
            "Every field is the same in every record.")
    return f"<p>{note}</p>" + table(["field", *map(escape, names)], rows, cls="fingerprints")
