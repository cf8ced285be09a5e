"""The report page's static charts: plain SVG drawn here from the comparison's JSON, so that a page opened without
JavaScript (or printed) still shows every curve and its tolerance band; report.js only adds the hover readout on top
of the same drawing (it reads the geometry from the panel's data-* attributes).

Each run keeps one colour and one dash pattern in every panel: the Okabe–Ito colours stay apart for colour-blind
readers, and the dashes keep them apart in greyscale and on paper.
"""

from __future__ import annotations

import math
from html import escape

WIDTH, HEIGHT = 760, 230
LEFT, RIGHT, TOP, BOTTOM = 78, 16, 30, 40
# (colour, dash pattern): the baseline solid black, then the others
STYLES = (("#000000", ""), ("#0072B2", "7 3"), ("#D55E00", "2 3"), ("#009E73", "9 3 2 3"), ("#CC79A7", "12 4"),
          ("#E69F00", "4 2 4 6"), ("#56B4E9", "1 2"))


LOG_SCALE_AT = 30  # a difference this many times the widest bound switches a panel to a symmetric log scale


def style(index: int) -> tuple[str, str]:
    return STYLES[index % len(STYLES)]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x == 0 or 1e-3 <= abs(x) < 1e4 else f"{x:.1e}"


class Panel:
    """One chart: steps on x, `lo`..`hi` on y; `svg()` returns the element with what was added."""

    def __init__(self, key: str, title: str, ylabel: str, num_steps: int, lo: float, hi: float,
                 linthresh: float | None = None):
        """`linthresh`: a symmetric log scale, linear within ±linthresh (a band far narrower than a FAIL's
        difference stays visible beside it)."""
        self.t = linthresh
        lo, hi = self.f(lo), self.f(hi)
        if not hi > lo:
            lo, hi = (lo - 1, hi + 1) if lo == 0 else (lo - abs(lo) * 0.1, hi + abs(hi) * 0.1)
        self.key, self.title, self.ylabel, self.n, self.lo, self.hi = key, title, ylabel, num_steps, lo, hi
        self.parts: list[str] = []
        self.legend: list[tuple[str, str, str]] = []  # (label, colour, dash)

    def f(self, value: float) -> float:
        """The drawn coordinate of a value: itself, or on the symmetric log scale."""
        if self.t is None:
            return value
        return math.copysign(math.log10(1 + abs(value) / self.t), value)

    def ticks(self) -> list[tuple[float, str]]:
        """(drawn coordinate, label): round values, or on the log scale 0 and ±linthresh × 10^k."""
        if self.t is None:
            return [(t, _fmt(t)) for t in _ticks(self.lo, self.hi)]
        out = [(0.0, "")]  # the band's edges, ±linthresh, sit too close to 0 for three labels
        k = 0
        while self.f(self.t * 10 ** k) <= self.hi:
            v = self.t * 10 ** k
            out += [(self.f(v), "±" + _fmt(v) if k == 0 else _fmt(v)), (self.f(-v), "" if k == 0 else _fmt(-v))]
            k += 1 if self.hi < 6 else 2
        return out

    def x(self, step: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * (step / max(self.n - 1, 1))

    def y(self, value: float) -> float:
        clipped = min(max(self.f(value), self.lo), self.hi)
        return TOP + (HEIGHT - TOP - BOTTOM) * (1 - (clipped - self.lo) / (self.hi - self.lo))

    def band(self, bounds: list[float], label: str) -> None:
        """The tolerance band ±bound per step, grey (it prints)."""
        steps = [i for i, b in enumerate(bounds) if _finite(b)]
        if not steps:
            return
        upper = [f"{self.x(i):.1f},{self.y(bounds[i]):.1f}" for i in steps]
        lower = [f"{self.x(i):.1f},{self.y(-bounds[i]):.1f}" for i in reversed(steps)]
        self.parts.append(f'<polygon class="band" points="{" ".join(upper + lower)}"><title>{escape(label)}</title>'
                          f'</polygon>')
        self.legend.append((label, "band", ""))

    def line(self, values: list, label: str, index: int, run: str) -> None:
        """A run's curve, broken where a value is not finite (a NaN loss shows as a gap, and in the tables)."""
        colour, dash = style(index)
        segments, current = [], []
        for i, v in enumerate(values):
            if _finite(v):
                current.append(f"{self.x(i):.1f},{self.y(v):.1f}")
            elif current:
                segments.append(current)
                current = []
        if current:
            segments.append(current)
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        for points in segments:
            if len(points) == 1:  # one step: a dot
                cx, cy = points[0].split(",")
                self.parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{colour}" data-run="{escape(run)}"/>')
            else:
                self.parts.append(f'<polyline class="curve" data-run="{escape(run)}" points="{" ".join(points)}" '
                                  f'stroke="{colour}"{dashes}><title>{escape(label)}</title></polyline>')
        self.legend.append((label, colour, dash))

    def marker(self, step: int, value: float, text: str, index: int) -> None:
        """The first point outside: a cross and its words."""
        colour, _ = style(index)
        x, y = self.x(step), self.y(value if _finite(value) else self.hi)
        self.parts.append(f'<g class="outside"><path d="M{x - 6:.1f},{y - 6:.1f}L{x + 6:.1f},{y + 6:.1f}M{x - 6:.1f},'
                          f'{y + 6:.1f}L{x + 6:.1f},{y - 6:.1f}" stroke="{colour}" stroke-width="2.5"/>'
                          f'<text x="{x + 8:.1f}" y="{max(y - 8, TOP + 10):.1f}" fill="{colour}">{escape(text)}</text>'
                          f'</g>')

    def svg(self) -> str:
        axes = []
        for t, text in self.ticks():
            y = TOP + (HEIGHT - TOP - BOTTOM) * (1 - (t - self.lo) / (self.hi - self.lo))
            axes.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
                        f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{text}</text>')
        for t in _ticks(0, max(self.n - 1, 1), 8):
            if t == int(t) and t <= self.n - 1:
                x = self.x(t)
                axes.append(f'<line class="tickmark" x1="{x:.1f}" x2="{x:.1f}" y1="{HEIGHT - BOTTOM}" '
                            f'y2="{HEIGHT - BOTTOM + 4}"/><text class="tick" x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" '
                            f'text-anchor="middle">{int(t)}</text>')
        axes.append(f'<rect class="frame" x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" '
                    f'height="{HEIGHT - TOP - BOTTOM}"/>'
                    f'<text class="axis" x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" text-anchor="middle">step'
                    f'</text><text class="axis" transform="translate(14,{(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" '
                    f'text-anchor="middle">{escape(self.ylabel)}</text>')
        legend, x = [], LEFT
        for label, colour, dash in self.legend:
            if colour == "band":
                legend.append(f'<rect class="band" x="{x}" y="8" width="22" height="10"/>')
            else:
                dashes = f' stroke-dasharray="{dash}"' if dash else ""
                legend.append(f'<line x1="{x}" x2="{x + 22}" y1="13" y2="13" stroke="{colour}" stroke-width="2"'
                              f'{dashes}/>')
            legend.append(f'<text class="legend" x="{x + 26}" y="17">{escape(label)}</text>')
            x += 34 + 6.2 * len(label)
        title_id = f"panel-{self.key}-title"
        return (f'<svg class="panel" role="img" aria-labelledby="{title_id}" viewBox="0 0 {WIDTH} {HEIGHT}" '
                f'width="{WIDTH}" height="{HEIGHT}" data-panel="{escape(self.key)}" data-steps="{self.n}" '
                f'data-left="{LEFT}" data-right="{WIDTH - RIGHT}" data-top="{TOP}" data-bottom="{HEIGHT - BOTTOM}" '
                f'xmlns="http://www.w3.org/2000/svg"><title id="{title_id}">{escape(self.title)}</title>'
                f'{"".join(axes)}<g class="legend-row">{"".join(legend)}</g>{"".join(self.parts)}</svg>')


def curve_panels(data: dict) -> list[tuple[str, str]]:
    """(heading, svg) per panel: the loss of every run, then per judged curve each run's relative difference from the
    baseline inside its band (the figure's panels, parity.comparing.figures.curve_figure)."""
    runs, n = data["runs"], data["num_steps"]
    base = runs[0]
    panels = []
    losses = [v for r in runs for v in r["series"]["loss"] if _finite(v)]
    loss = Panel("values", "Loss of every run", "loss (nats)", n, min(losses, default=0), max(losses, default=1))
    for i, r in enumerate(runs):
        loss.line(r["series"]["loss"], r["label"], i, r["name"])
    panels.append(("Loss", loss.svg()))
    for q, title in data["quantities"]:
        others = runs[1:]
        diffs = {r["name"]: [(x - b) / abs(b) if _finite(x) and _finite(b) and b else math.nan
                             for x, b in zip(r["series"][q], base["series"][q])] for r in others}
        bounds = [max((r["bounds"][q][s] for r in others if r.get("bounds") and q in r["bounds"]
                       and _finite(r["bounds"][q][s])), default=math.nan) for s in range(n)]
        spread = max([abs(v) for d in diffs.values() for v in d if _finite(v)] +
                     [b for b in bounds if _finite(b)] + [1e-12])
        widest = max([b for b in bounds if _finite(b)] + [0.0])
        log = widest > 0 and spread > LOG_SCALE_AT * widest  # the band would be a hairline: a symmetric log scale
        panel = Panel(q, f"{title}: relative difference from {base['label']}" + (" (symmetric log scale)" if log else ""),
                      f"(x − {base['short']}) / |{base['short']}|", n, -spread * 1.1, spread * 1.1,
                      min(b for b in bounds if _finite(b) and b > 0) if log else None)
        if any(_finite(b) for b in bounds):
            panel.band(bounds, "calibrated band (20 × noise)" if data["calibrated"] else "tolerance band")
        for i, r in enumerate(others, start=1):
            panel.line(diffs[r["name"]], r["label"], i, r["name"])
            f = r.get("first_outside")
            if f and f.get("quantity") == q and f.get("step") is not None:
                y = diffs[r["name"]][f["step"]] if f.get("test") == "step" else 0.0
                panel.marker(f["step"], y, f"{r['short']}: first outside, step {f['step']}", i)
        panels.append((f"{title}: relative difference" + (" (symmetric log scale)" if log else ""), panel.svg()))
    return panels
