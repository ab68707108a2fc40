"""Inline SVG charts for the HTML report: line / step charts, bar charts, the alpha x c map.

Plain string building, no plotting library. Every label that may come from the user (config or
category names) is escaped here, so the returned markup can be embedded as is.

Layout: the legend sits under the plot, one entry a row, labels in full; a chart is made wider
than asked where its title or a legend label would not fit (text widths are estimated from the
character count, generously: the report's browser test checks that no text is clipped). The
data marks (lines, points, bars, the boundary curve) carry class "data", so a check can count
the distinct x positions a chart really draws.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

from specdecode.report.analysis import break_even_c

# character widths in ems (of the font size), generous: lower-case letters and digits, the
# narrow ones, capitals and the widest letters
CHAR_WIDTH, NARROW_EM, WIDE_EM = 0.62, 0.36, 0.95
NARROW = set(" .,:;'|!()[]-/ijlrtf1")
FONT_SIZE = 11
LEGEND_ROW = 16
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#7f7f7f", "#bcbd22")
MAX_POINTS = 400


@dataclass
class Series:
    """One line: points (xs, ys), drawn as a step function when `step`; optional error bars."""

    label: str
    xs: list[float]
    ys: list[float]
    step: bool = False
    err_low: list[float] = field(default_factory=list)
    err_high: list[float] = field(default_factory=list)
    color_index: int | None = None  # a fixed palette slot (same config, same colour everywhere)

    def color(self, i: int) -> str:
        return PALETTE[(i if self.color_index is None else self.color_index) % len(PALETTE)]


def text_width(text: str, size: float = FONT_SIZE, bold: bool = False) -> float:
    """An upper estimate of a text's width in pixels: per character, in ems, generous for
    common sans-serif fonts (DejaVu Sans, Liberation Sans, Arial)."""
    ems = sum(NARROW_EM if c in NARROW else WIDE_EM if c.isupper() or c in "mwMW%@"
              else CHAR_WIDTH for c in text)
    return ems * size * (1.1 if bold else 1.0)


@dataclass(frozen=True)
class Frame:
    """A chart: the plotting area, its data limits and the legend rows under it. `height` is
    the plot's (axes and their labels included); the legend adds `legend_rows` rows below."""

    width: int
    height: int
    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float
    left: int = 58
    right: int = 24
    top: int = 28
    bottom: int = 44
    legend_rows: int = 0

    @property
    def total_height(self) -> int:
        return self.height + (LEGEND_ROW * self.legend_rows + 6 if self.legend_rows else 0)

    @property
    def plot_right(self) -> int:
        return self.width - self.right

    @property
    def plot_bottom(self) -> int:
        return self.height - self.bottom

    def px(self, x: float) -> float:
        span = (self.x_hi - self.x_lo) or 1.0
        return self.left + (x - self.x_lo) / span * (self.plot_right - self.left)

    def py(self, y: float) -> float:
        span = (self.y_hi - self.y_lo) or 1.0
        return self.plot_bottom - (y - self.y_lo) / span * (self.plot_bottom - self.top)


def fitted_width(width: int, title: str, labels: Sequence[str], left: int = 58) -> int:
    """`width`, or more where the title (from `left`) or a legend label would not fit."""
    need = [left + text_width(title, bold=True), *(left + 14 + text_width(x) for x in labels)]
    return max(width, math.ceil(max(need)) + 8)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round-numbered ticks covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    count = math.floor((hi - first) / step + 1e-9) + 1
    return [round(first + i * step, 12) for i in range(count)]


def fmt_num(x: float) -> str:
    """Short tick label."""
    if x == 0:
        return "0"
    if abs(x) >= 1000 or abs(x) < 0.01:
        return f"{x:.2g}"
    return f"{x:.3g}"


def _axes(f: Frame, title: str, x_label: str, y_label: str) -> list[str]:
    out = [f'<rect x="{f.left}" y="{f.top}" width="{f.plot_right - f.left}" '
           f'height="{f.plot_bottom - f.top}" fill="none" stroke="#999"/>',
           f'<text x="{f.left}" y="16" font-weight="bold">{escape(title)}</text>',
           f'<text x="{(f.left + f.plot_right) / 2:.1f}" y="{f.height - 8}" '
           f'text-anchor="middle">{escape(x_label)}</text>',
           f'<text transform="translate(14,{(f.top + f.plot_bottom) / 2:.1f}) '
           f'rotate(-90)" text-anchor="middle">{escape(y_label)}</text>']
    for t in nice_ticks(f.x_lo, f.x_hi):
        x = f.px(t)
        out.append(f'<line x1="{x:.1f}" y1="{f.plot_bottom}" x2="{x:.1f}" '
                   f'y2="{f.plot_bottom + 4}" stroke="#999"/><text x="{x:.1f}" '
                   f'y="{f.plot_bottom + 16}" text-anchor="middle">{fmt_num(t)}</text>')
    for t in nice_ticks(f.y_lo, f.y_hi):
        y = f.py(t)
        out.append(f'<line x1="{f.left - 4}" y1="{y:.1f}" x2="{f.plot_right}" '
                   f'y2="{y:.1f}" stroke="#eee"/><text x="{f.left - 6}" y="{y + 4:.1f}" '
                   f'text-anchor="end">{fmt_num(t)}</text>')
    return out


def _legend(f: Frame, labels: Sequence[str], colors: Sequence[str] | None = None
            ) -> list[str]:
    """One row per label under the plot, in full (`fitted_width` made room for it)."""
    out = []
    for i, label in enumerate(labels):
        y = f.height + LEGEND_ROW * (i + 1)
        color = colors[i] if colors is not None else PALETTE[i % len(PALETTE)]
        out.append(f'<rect x="{f.left}" y="{y - 9}" width="10" height="10" '
                   f'fill="{color}"/><text x="{f.left + 14}" y="{y}">'
                   f"{escape(label)}</text>")
    return out


def _svg(f: Frame, parts: Sequence[str], label: str) -> str:
    h = f.total_height
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{f.width}" height="{h}" '
            f'viewBox="0 0 {f.width} {h}" role="img" aria-label="{escape(label)}" '
            f'font-family="sans-serif" font-size="{FONT_SIZE}">' + "".join(parts) + "</svg>")


def x_values(series: Sequence[Series]) -> set[float]:
    """The distinct finite x values the series draw: a chart of fewer than two is no chart."""
    return {x for s in series for x in s.xs if math.isfinite(x)}


def thin(xs: Sequence[float], ys: Sequence[float], limit: int = MAX_POINTS
         ) -> tuple[list[float], list[float]]:
    """At most `limit` evenly spaced points (first and last kept)."""
    n = len(xs)
    if n <= limit:
        return list(xs), list(ys)
    idx = sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)})
    return [xs[i] for i in idx], [ys[i] for i in idx]


def _path(f: Frame, s: Series) -> str:
    pts: list[tuple[float, float]] = []
    prev_y: float | None = None
    for x, y in zip(*thin(s.xs, s.ys), strict=True):
        if not (math.isfinite(x) and math.isfinite(y)):
            continue
        if s.step and prev_y is not None:
            pts.append((f.px(x), f.py(prev_y)))
        pts.append((f.px(x), f.py(y)))
        prev_y = y
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)


def _limits(values: Sequence[float], lo: float | None, hi: float | None) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    low = lo if lo is not None else min(finite, default=0.0)
    high = hi if hi is not None else max(finite, default=1.0)
    return (low, high) if high > low else (low, low + 1.0)


def _error_bars(f: Frame, s: Series, color: str) -> list[str]:
    out = []
    for x, lo, hi in zip(s.xs, s.err_low, s.err_high, strict=False):
        if all(math.isfinite(v) for v in (x, lo, hi)):
            out.append(f'<line x1="{f.px(x):.1f}" y1="{f.py(lo):.1f}" x2="{f.px(x):.1f}" '
                       f'y2="{f.py(hi):.1f}" stroke="{color}" stroke-width="1.5"/>')
    return out


def line_chart(
    series: Sequence[Series], *, title: str, x_label: str, y_label: str,
    x_range: tuple[float | None, float | None] = (None, None),
    y_range: tuple[float | None, float | None] = (None, None),
    hline: float | None = None, width: int = 560, height: int = 300,
) -> str:
    """Lines (or steps) with markers, optional error bars and a dashed reference line."""
    xs = [x for s in series for x in s.xs]
    ys = [y for s in series for y in [*s.ys, *s.err_low, *s.err_high]]
    ys += [hline] if hline is not None else []
    x_lo, x_hi = _limits(xs, *x_range)
    y_lo, y_hi = _limits(ys, *y_range)
    labels = [s.label for s in series]
    f = Frame(fitted_width(width, title, labels), height, x_lo, x_hi, y_lo, y_hi,
              legend_rows=len(labels))
    parts = _axes(f, title, x_label, y_label)
    if hline is not None:
        parts.append(f'<line x1="{f.left}" y1="{f.py(hline):.1f}" x2="{f.plot_right}" '
                     f'y2="{f.py(hline):.1f}" stroke="#444" stroke-dasharray="4 3"/>')
    for i, s in enumerate(series):
        color = s.color(i)
        parts.append(f'<polyline class="data" fill="none" stroke="{color}" stroke-width="1.6" '
                     f'points="{_path(f, s)}"/>')
        parts += _error_bars(f, s, color)
        if not s.step:
            parts += [f'<circle class="data" cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="2.5" '
                      f'fill="{color}"/>'
                      for x, y in zip(s.xs, s.ys, strict=True)
                      if math.isfinite(x) and math.isfinite(y)]
    parts += _legend(f, labels, [s.color(i) for i, s in enumerate(series)])
    return _svg(f, parts, title)


def bar_chart(
    edges: Sequence[float], counts: Sequence[int], *, title: str, x_label: str,
    y_label: str = "requests", marker: float | None = None, width: int = 560,
    height: int = 240,
) -> str:
    """A histogram: one bar per bin; an optional dashed vertical marker (e.g. at 1.0)."""
    if not counts:
        return ""
    lo, hi = min(edges[0], marker or edges[0]), max(edges[-1], marker or edges[-1])
    f = Frame(fitted_width(width, title, []), height, lo, hi, 0.0,
              max(max(counts), 1) * 1.1)
    parts = _axes(f, title, x_label, y_label)
    for a, b, n in zip(edges[:-1], edges[1:], counts, strict=True):
        x, w = f.px(a), max(f.px(b) - f.px(a) - 1, 1)
        parts.append(f'<rect class="data" x="{x:.1f}" y="{f.py(n):.1f}" width="{w:.1f}" '
                     f'height="{f.py(0) - f.py(n):.1f}" fill="{PALETTE[0]}"/>')
    if marker is not None:
        parts.append(f'<line x1="{f.px(marker):.1f}" y1="{f.top}" x2="{f.px(marker):.1f}" '
                     f'y2="{f.plot_bottom}" stroke="#444" stroke-dasharray="4 3"/>')
    return _svg(f, parts, title)


def boundary_map(
    k: float, v: float, points: Sequence[tuple[str, float, float]], *, title: str,
    c_max: float | None = None, width: int = 560, height: int = 320,
) -> str:
    """The (alpha, c) plane for draft length k and verify cost v: where speculation wins.

    The curve is predicted speedup = 1, c = ((1 - alpha^(k+1)) / (1 - alpha) - v) / k; below
    it (green) speculation wins, above it (red) it loses. `points` are (label, alpha, c).
    """
    if k < 1:
        return ""
    finite_c = [c for _, _, c in points if math.isfinite(c)]
    top = c_max if c_max is not None else max([1.0, *(1.25 * c for c in finite_c)])
    labels = [label for label, _, _ in points]
    f = Frame(fitted_width(width, title, labels), height, 0.0, 1.0, 0.0, top,
              legend_rows=len(labels))
    grid = [i / 200 for i in range(200)] + [1.0]
    curve = [(a, min(max(break_even_c(a, k, v), 0.0), top)) for a in grid]
    win = " ".join(f"{f.px(a):.1f},{f.py(c):.1f}" for a, c in curve)
    parts = [f'<rect x="{f.left}" y="{f.top}" width="{f.plot_right - f.left}" '
             f'height="{f.plot_bottom - f.top}" fill="#f8d7d7"/>',
             f'<polygon fill="#d4edda" points="{win} {f.px(1):.1f},{f.py(0):.1f} '
             f'{f.px(0):.1f},{f.py(0):.1f}"/>',
             f'<polyline class="data" fill="none" stroke="#222" stroke-width="1.5" '
             f'points="{win}"/>']
    parts += _axes(f, title, "alpha (per-token acceptance)", "c (draft cost per token)")
    for i, (label, alpha, c) in enumerate(points):
        if math.isfinite(alpha) and math.isfinite(c):
            parts.append(f'<circle class="data" cx="{f.px(alpha):.1f}" '
                         f'cy="{f.py(min(c, top)):.1f}" r="5" '
                         f'fill="{PALETTE[i % len(PALETTE)]}" stroke="#000"><title>'
                         f"{escape(label)}: alpha {alpha:.2f}, c {c:.3f}</title></circle>")
    parts += _legend(f, labels)
    parts.append(f'<text x="{f.px(0.03):.1f}" y="{f.py(top) + 14:.1f}">lose (S &lt; 1)</text>'
                 f'<text x="{f.px(0.75):.1f}" y="{f.py(0) - 6:.1f}">win (S &gt; 1)</text>')
    return _svg(f, parts, title)

