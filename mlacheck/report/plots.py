"""Report plots as inline SVG, drawn with the standard library alone.

The report's first reader runs the main job's install (`pip install -e .`), which has no
plotting library: the heat maps are the point of a failure card, so they cannot depend on an
extra. An SVG drawn here is text in the HTML (no extra install, no font or backend setup, a
few kB per plot, sharp at any zoom); the heat map's cells are one small palette PNG inside it
(encoded here with zlib), so a 256 x 128 grid stays tens of kB instead of 32768 elements.
Axes, ticks, the colour bar, the bound's mark and the failure boxes are vector elements.

Each function returns an `<svg>` element as a string, or None when there is nothing to draw.
"""

from __future__ import annotations

import base64
import math
import struct
import zlib
from collections.abc import Sequence
from html import escape

from mlacheck.ops import unit_of
from mlacheck.report.summary import KNOWN, STATUSES, Failure, Summary, ratio
from mlacheck.verdict import CRASH, FAIL, PASS, SKIP, noteworthy

COLOURS = {PASS: "#2e7d32", FAIL: "#c62828", CRASH: "#6a1b9a", SKIP: "#9e9e9e", KNOWN: "#ef6c00"}
NONFINITE = 1e29  # mlacheck.heatmap writes non-finite rows as 1e30; anything this large is one
NONFINITE_COLOUR = (0xE0, 0x40, 0xFB)  # magenta
RATIO_FLOOR = 1e-4  # worst/bound below this (e.g. an exact 0) is drawn at the floor of a log axis
RATIO_CEIL = 1e6  # and above this (e.g. inf) at the ceiling
MAX_BOXES = 12  # where-boxes drawn on a heat map (the summary text lists them all)
# The colour scale reaches this factor below the bound, so the bound's mark is on the colour
# bar even when every row is far beyond it (all red, the bound still drawn).
BELOW_BOUND = 3.0
# Heat-map drawing area (CSS px): cells are stretched to it, never drawn thinner than 1 px.
HEAT_W, HEAT_H = 440, 280
FONT = 'font-family="system-ui,sans-serif" font-size="11"'
# Colour ramps (light to dark): within the bound (blues) and beyond it (yellow to red).
BLUES = ((0xDE, 0xEB, 0xF7), (0x9E, 0xCA, 0xE1), (0x42, 0x92, 0xC6), (0x08, 0x45, 0x94))
REDS = ((0xFE, 0xD9, 0x76), (0xFD, 0x8D, 0x3C), (0xE3, 0x1A, 0x1C), (0x80, 0x00, 0x26))


# --------------------------------------------------------------------------- status bars


def status_bars(summary: Summary) -> str | None:
    """Stacked horizontal bars, one per backend x op: PASS / KNOWN / FAIL / CRASH / SKIP."""
    if not summary.counts:
        return None
    keys = list(summary.counts)
    order = [PASS, KNOWN, FAIL, CRASH, SKIP] + [s for s in summary.statuses if s not in STATUSES]
    label_w = 8 + 7 * max(len(f"{b}  {o}") for b, o in keys)
    bar_w, row_h, top = 420, 22, 24
    widest = max(c.total() for c in summary.counts.values()) or 1
    width, height = label_w + bar_w + 220, top + row_h * len(keys) + 40
    parts = [_legend([s for s in order if any(summary.counts[k][s] for k in keys)], label_w, 14)]
    for y, k in enumerate(keys):
        cy = top + y * row_h
        parts.append(_text(label_w - 6, cy + 15, f"{k[0]}  {k[1]}", anchor="end"))
        x = float(label_w)
        for s in order:
            n = summary.counts[k][s]
            if not n:
                continue
            w = bar_w * n / widest
            parts.append(f'<rect x="{x:.1f}" y="{cy + 3}" width="{w:.1f}" height="{row_h - 6}" '
                         f'fill="{COLOURS.get(s, "#000")}"><title>{n} {escape(s)}</title></rect>')
            if w >= 22:  # no digits on slivers
                parts.append(_text(x + w / 2, cy + 15, str(n), anchor="middle", fill="#fff"))
            x += w
        problems = [f"{summary.counts[k][s]} {s}" for s in order
                    if noteworthy(s) and summary.counts[k][s]]
        if problems:  # a single FAIL is a sliver: spell the problems out at the bar's end
            parts.append(_text(x + 5, cy + 15, ", ".join(problems), fill=COLOURS[FAIL],
                               weight="bold"))
    parts.append(_x_axis(label_w, top + row_h * len(keys), bar_w, 0, widest, "cases",
                         linear=True))
    return _svg(width, height, "status per backend and op", parts)


# --------------------------------------------------------------------------- distributions


def error_distributions(summary: Summary) -> str | None:
    """Per compute format: box + every case of worst_row / bound on a log axis, bound at 1."""
    dists = [d for d in summary.distributions if d.n]
    if not dists:
        return None
    label_w, plot_w, row_h, top = 90, 520, 34, 18
    lo = math.floor(math.log10(max(RATIO_FLOOR, min(d.ratios[0] for d in dists) or RATIO_FLOOR)))
    hi = math.ceil(math.log10(min(RATIO_CEIL, max(max(d.ratios[-1] for d in dists), 2.0))))
    lo, hi = min(lo, -1), max(hi, 1)

    def x_of(r: float) -> float:
        r = min(RATIO_CEIL, max(RATIO_FLOOR, r))
        return label_w + plot_w * (math.log10(r) - lo) / (hi - lo)

    parts = []
    for i, d in enumerate(dists):
        cy = top + i * row_h + row_h / 2
        parts.append(_text(label_w - 8, cy + 4, d.fmt, anchor="end"))
        q1, med, q3 = (x_of(d.quantile(q)) for q in (0.25, 0.5, 0.75))
        parts.append(f'<line x1="{x_of(d.ratios[0]):.1f}" x2="{x_of(d.ratios[-1]):.1f}" '
                     f'y1="{cy}" y2="{cy}" stroke="#999"/>')
        parts.append(f'<rect x="{q1:.1f}" y="{cy - 9}" width="{max(1.0, q3 - q1):.1f}" '
                     'height="18" fill="none" stroke="#555"/>')
        parts.append(f'<line x1="{med:.1f}" x2="{med:.1f}" y1="{cy - 9}" y2="{cy + 9}" '
                     'stroke="#000" stroke-width="2"/>')
        for j, r in enumerate(d.ratios):
            over = r > 1.0
            jitter = (_hash01(i, j) - 0.5) * 20  # fixed: reports are reproducible
            parts.append(f'<circle cx="{x_of(r):.1f}" cy="{cy + jitter:.1f}" '
                         f'r="{2.6 if over else 1.8}" fill="{COLOURS[FAIL] if over else "#1565c0"}" '
                         f'fill-opacity="{0.9 if over else 0.45}"/>')
        parts.append(_text(label_w + plot_w + 6, cy + 4, f"n={d.n}, >1: {d.over}"))
    bottom = top + row_h * len(dists)
    one = x_of(1.0)
    parts.append(f'<line x1="{one:.1f}" x2="{one:.1f}" y1="{top - 4}" y2="{bottom}" '
                 f'stroke="{COLOURS[FAIL]}" stroke-dasharray="4 3" stroke-width="1.2"/>')
    parts.append(_text(one + 3, top - 6, "bound", fill=COLOURS[FAIL]))
    parts.append(_x_axis(label_w, bottom, plot_w, lo, hi,
                         "worst row error / bound (per case; > 1 fails)"))
    return _svg(label_w + plot_w + 110, bottom + 40, "error distributions", parts)


def _hash01(i: int, j: int) -> float:
    """A fixed pseudo-random number in [0, 1) for point (i, j): jitter without a generator."""
    h = (i * 73856093) ^ (j * 19349663) ^ 0x5BD1E995
    h = (h * 2654435761) & 0xFFFFFFFF
    return h / 2**32


# --------------------------------------------------------------------------- heat maps


def token_step(heat_rows: int, heat_heads: int, rows: object) -> int:
    """Tokens per heat-map row: mlacheck.heatmap max-pools long token axes into blocks."""
    if not isinstance(rows, int) or rows <= 0 or heat_rows <= 0 or heat_heads <= 0:
        return 1
    tokens = rows // heat_heads
    return max(1, math.ceil(tokens / heat_rows))


def error_heatmap(failure: Failure) -> str | None:
    """Per-row error, token x head, log colour: blues within the bound, reds beyond it,
    magenta for non-finite rows; dashed boxes around the localised failures."""
    grid = _grid(failure.heatmap)
    if grid is None:
        return None
    v = failure.verdict
    t, h = len(grid), len(grid[0])
    finite = [x for row in grid for x in row if _finite(x) and x > 0]
    n_bad = sum(not _finite(x) for row in grid for x in row)
    bound = v.metrics.get("bound")
    bound = float(bound) if isinstance(bound, int | float) and bound > 0 else None
    vmin, vmax = _colour_range(finite, bound)
    index, palette = _colour_map(vmin, vmax, bound)
    step = token_step(t, h, v.metrics.get("rows"))

    # cells stretched to the drawing area; at most 24 px a cell (a one-row map is a strip)
    cw, ch = min(24.0, HEAT_W / h), min(24.0, HEAT_H / t)
    pw, ph = cw * h, ch * t
    left, top = 58, 30
    # each cell as a block of whole pixels near its drawn size: a renderer that smooths
    # scaled images (some do, whatever image-rendering says) then blurs only cell edges
    fx, fy = max(1, int(cw)), max(1, int(ch))
    png = _png([[index(x) for x in row for _ in range(fx)] for row in grid for _ in range(fy)],
               palette)
    parts = [f'<image x="{left}" y="{top}" width="{pw:.1f}" height="{ph:.1f}" '
             'preserveAspectRatio="none" image-rendering="optimizeSpeed" '
             'style="image-rendering:pixelated" '
             f'href="data:image/png;base64,{base64.b64encode(png).decode("ascii")}"/>',
             f'<rect x="{left}" y="{top}" width="{pw:.1f}" height="{ph:.1f}" fill="none" '
             'stroke="#888"/>']
    unit = unit_of(v.op)
    for w in v.where[:MAX_BOXES]:
        if not w.heads:
            continue
        x0, x1 = left + min(w.heads) * cw, left + (max(w.heads) + 1) * cw
        y0 = top + (w.tokens[0] // step) * ch
        y1 = top + (w.tokens[1] // step + 1) * ch
        parts.append(f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{x1 - x0:.1f}" '
                     f'height="{y1 - y0:.1f}" fill="none" stroke="#000" stroke-dasharray="4 3">'
                     f'<title>{escape(w.message(unit))}</title></rect>')
    # axes: integer ticks at sane steps, in tokens and heads (a one-row map gets one tick)
    for head in _int_ticks(h):
        x = left + (head + 0.5) * cw
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + ph}" y2="{top + ph + 4}" '
                     'stroke="#555"/>')
        parts.append(_text(x, top + ph + 16, str(head), anchor="middle"))
    for row in _int_ticks(t):
        y = top + (row + 0.5) * ch
        parts.append(f'<line x1="{left - 4}" x2="{left}" y1="{y:.1f}" y2="{y:.1f}" '
                     'stroke="#555"/>')
        parts.append(_text(left - 7, y + 4, str(row * step), anchor="end"))
    parts.append(_text(left + pw / 2, top + ph + 32, "head", anchor="middle"))
    ylabel = "token row" + (f" (max over blocks of {step})" if step > 1 else "")
    parts.append(f'<text transform="translate(14 {top + ph / 2:.1f}) rotate(-90)" '
                 f'text-anchor="middle" {FONT}>{escape(ylabel)}</text>')
    parts += _colour_bar(left + pw + 24, top, max(ph, 120.0), vmin, vmax, bound, palette)
    r = ratio(v)
    title = f"{v.backend} {v.op}: worst row {_g(v.metrics.get('worst_row'))}"
    if bound:
        title += f" vs bound {_g(bound)}" + (f" (x{r:.3g})" if r is not None else "")
    if n_bad:
        title += f"; {n_bad} non-finite cells (magenta)"
    parts.append(_text(left, 18, title, weight="bold"))
    width = max(left + pw + 24 + 16 + 90, left + 7 * len(title))
    height = top + max(ph, 120.0) + 44
    return _svg(width, height, f"error heat map of {v.case_id}", parts)


def _grid(h: object) -> list[list[float]] | None:
    """A rectangular grid of numbers, or None (a ragged or non-numeric one is no heat map)."""
    if not isinstance(h, list) or not h or not all(isinstance(r, list) and r for r in h):
        return None
    if len({len(r) for r in h}) != 1:
        return None
    try:
        return [[float(x) for x in row] for row in h]
    except (TypeError, ValueError):
        return None


def _finite(x: float) -> bool:
    return math.isfinite(x) and x < NONFINITE


def _colour_range(positive: Sequence[float], bound: float | None) -> tuple[float, float]:
    """Log colour limits spanning the errors seen and the bound, at least a decade wide."""
    vmax = max(max(positive, default=0.0), (bound or 0.0) * 1.5) or 1.0
    vmin = min(positive) if positive else (bound or vmax) / 100
    if bound is not None:
        vmin = min(vmin, bound / BELOW_BOUND)
    return min(vmin, vmax / 10), vmax


# The heat map's palette: LEVELS colours along the log scale, then the non-finite colour.
LEVELS = 255
NONFINITE_INDEX = LEVELS


def _colour_map(vmin: float, vmax: float, bound: float | None):  # noqa: ANN202
    """(x -> palette index, palette): LEVELS steps of the log scale, blues up to the bound's
    position, reds beyond it; NONFINITE_INDEX (magenta) for a non-finite row."""
    span = math.log(vmax) - math.log(vmin)
    split = 1.0 if bound is None else (math.log(bound) - math.log(vmin)) / span

    def rgb(f: float) -> tuple[int, int, int]:
        if f <= split:
            return _ramp(BLUES, f / split if split > 0 else 1.0)
        return _ramp(REDS, (f - split) / (1 - split) if split < 1 else 1.0)

    palette = [rgb((i + 0.5) / LEVELS) for i in range(LEVELS)] + [NONFINITE_COLOUR]

    def index(x: float) -> int:
        if not _finite(x):
            return NONFINITE_INDEX
        f = (math.log(min(vmax, max(vmin, x))) - math.log(vmin)) / span if x > 0 else 0.0
        return min(LEVELS - 1, int(f * LEVELS))

    return index, palette


def _ramp(stops: Sequence[tuple[int, int, int]], f: float) -> tuple[int, int, int]:
    f = min(1.0, max(0.0, f)) * (len(stops) - 1)
    i = min(len(stops) - 2, int(f))
    a, b, w = stops[i], stops[i + 1], f - i
    return (round(a[0] + (b[0] - a[0]) * w), round(a[1] + (b[1] - a[1]) * w),
            round(a[2] + (b[2] - a[2]) * w))


def _colour_bar(x: float, y: float, height: float, vmin: float, vmax: float,
                bound: float | None, palette: list[tuple[int, int, int]]) -> list[str]:
    """A vertical log colour bar (high at the top), decade ticks, the bound's mark."""
    strip = _png([[i] for i in reversed(range(LEVELS))], palette)
    out = [f'<image x="{x}" y="{y}" width="14" height="{height:.1f}" preserveAspectRatio="none" '
           f'href="data:image/png;base64,{base64.b64encode(strip).decode("ascii")}"/>',
           f'<rect x="{x}" y="{y}" width="14" height="{height:.1f}" fill="none" stroke="#888"/>']

    def y_of(val: float) -> float:
        return y + height * (math.log(vmax) - math.log(val)) / (math.log(vmax) - math.log(vmin))

    for e in range(math.ceil(math.log10(vmin)), math.floor(math.log10(vmax)) + 1):
        yy = y_of(10.0**e)
        out.append(f'<line x1="{x + 14}" x2="{x + 18}" y1="{yy:.1f}" y2="{yy:.1f}" '
                   'stroke="#555"/>')
        out.append(_text(x + 20, yy + 4, f"1e{e}"))
    if bound is not None and vmin <= bound <= vmax:
        yy = y_of(bound)
        out.append(f'<line x1="{x - 3}" x2="{x + 17}" y1="{yy:.1f}" y2="{yy:.1f}" '
                   'stroke="#000" stroke-width="2"/>')
        out.append(_text(x - 5, yy + 4, "bound", anchor="end"))
    out.append(f'<text transform="translate({x + 62} {y + height / 2:.1f}) rotate(90)" '
               f'text-anchor="middle" {FONT}>row error (relative L2)</text>')
    return out


def _int_ticks(n: int, most: int = 8) -> list[int]:
    """Integer positions 0..n-1 at a 1-2-5 step, at most `most` of them."""
    step = 1
    while -(-n // step) > most:
        step = _next_step(step)
    return list(range(0, n, step))


def _next_step(step: int) -> int:
    """1, 2, 5, 10, 20, 50, ..."""
    lead = int(str(step)[0])
    scale = step // lead
    return {1: 2 * scale, 2: 5 * scale, 5: 10 * scale}[lead]


# --------------------------------------------------------------------------- SVG pieces


def _svg(width: float, height: float, label: str, parts: list[str]) -> str:
    return (f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" role="img" '
            f'aria-label="{escape(label)}" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}"><title>{escape(label)}</title>'
            + "".join(parts) + "</svg>")


def _text(x: float, y: float, text: str, anchor: str = "start", fill: str = "#222",
          weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{fill}" '
            f'font-weight="{weight}" {FONT}>{escape(text)}</text>')


def _legend(statuses: list[str], x: float, y: float) -> str:
    out, cx = [], x
    for s in statuses:
        out.append(f'<rect x="{cx:.1f}" y="{y - 9}" width="10" height="10" '
                   f'fill="{COLOURS.get(s, "#000")}"/>')
        out.append(_text(cx + 14, y, s))
        cx += 24 + 7 * len(s)
    return "".join(out)


def _x_axis(x: float, y: float, width: float, lo: float, hi: float, label: str,
            linear: bool = False) -> str:
    """A horizontal axis under a plot: linear 0..hi with integer ticks, or log decades lo..hi."""
    out = [f'<line x1="{x}" x2="{x + width}" y1="{y}" y2="{y}" stroke="#555"/>']
    if linear:
        ticks = [(float(i), str(i)) for i in _int_ticks(int(hi) + 1, 6)]
        pos = [(x + width * (v - lo) / ((hi - lo) or 1), s) for v, s in ticks]
    else:
        pos = [(x + width * (e - lo) / (hi - lo), f"1e{e}" if e not in (0, 1) else str(10**e))
               for e in range(int(lo), int(hi) + 1)]
    for px, s in pos:
        out.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{y}" y2="{y + 4}" stroke="#555"/>')
        out.append(_text(px, y + 16, s, anchor="middle"))
    out.append(_text(x + width / 2, y + 32, label, anchor="middle"))
    return "".join(out)


def _png(rows: list[list[int]], palette: list[tuple[int, int, int]]) -> bytes:
    """An 8-bit palette PNG: `rows` of indices into `palette` (at most 256 colours)."""
    height, width = len(rows), len(rows[0])
    raw = b"".join(b"\x00" + bytes(row) for row in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 3, 0, 0, 0))
            + chunk(b"PLTE", bytes(c for rgb in palette for c in rgb))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _g(x: object) -> str:
    return f"{x:.3g}" if isinstance(x, int | float) else "?"
