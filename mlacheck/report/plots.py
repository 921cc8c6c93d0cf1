"""Report plots as PNG bytes. matplotlib is an optional extra (`mlacheck[report]`).

matplotlib is imported lazily and only through its object API (Figure + Agg, never pyplot):
a report must not change a user's global backend, and without matplotlib every function here
returns None so the report is written without plots (and says so).
"""

from __future__ import annotations

import io
import math
from functools import cache
from typing import TYPE_CHECKING, Any

from mlacheck.report.summary import KNOWN, STATUSES, Failure, Summary, ratio
from mlacheck.verdict import CRASH, FAIL, PASS, SKIP, noteworthy

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLOURS = {PASS: "#2e7d32", FAIL: "#c62828", CRASH: "#6a1b9a", SKIP: "#9e9e9e", KNOWN: "#ef6c00"}
NONFINITE = 1e29  # report.heatmap writes non-finite rows as 1e30; anything this large is one
RATIO_FLOOR = 1e-4  # worst/bound below this (e.g. an exact 0) is drawn at the floor of a log axis
RATIO_CEIL = 1e6  # and above this (e.g. inf) at the ceiling
MAX_BOXES = 12  # where-boxes drawn on a heat map (the summary text lists them all)


@cache
def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def _figure(w: float, h: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), layout="constrained")


# --------------------------------------------------------------------------- status bars


def status_bars(summary: Summary) -> bytes | None:
    """Stacked horizontal bars, one per backend x op: PASS / KNOWN / FAIL / CRASH / SKIP."""
    if not available() or not summary.counts:
        return None
    keys = list(summary.counts)
    fig = _figure(9, 0.9 + 0.42 * len(keys))
    ax = fig.add_subplot()
    order = [PASS, KNOWN, FAIL, CRASH, SKIP] + [s for s in summary.statuses if s not in STATUSES]
    left = [0] * len(keys)
    labels = [f"{b}  {o}" for b, o in keys]
    widest = max(c.total() for c in summary.counts.values())
    for s in order:
        n = [summary.counts[k][s] for k in keys]
        if not any(n):
            continue
        bars = ax.barh(labels, n, left=left, color=COLOURS.get(s, "#000"), label=s, height=0.7)
        fits = [str(x) if x >= 0.06 * widest else "" for x in n]  # no digits on slivers
        ax.bar_label(bars, labels=fits, label_type="center", color="white", fontsize=8)
        left = [a + b for a, b in zip(left, n, strict=True)]
    for y, (k, end) in enumerate(zip(keys, left, strict=True)):
        # a single FAIL is a sliver: spell the problems out at the end of each bar
        problems = [f"{summary.counts[k][s]} {s}" for s in order if noteworthy(s)]
        problems = [p for p in problems if not p.startswith("0 ")]
        if problems:
            ax.annotate(
                ", ".join(problems),
                (end, y),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
                color=COLOURS[FAIL],
                fontweight="bold",
            )
    ax.invert_yaxis()
    ax.set_xlabel("cases")
    ax.legend(loc="lower right", fontsize=8, ncols=5, bbox_to_anchor=(1, 1), frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return _png(fig)


# --------------------------------------------------------------------------- distributions


def error_distributions(summary: Summary) -> bytes | None:
    """Per compute format: box + every case of worst_row / bound on a log axis, bound at 1."""
    dists = [d for d in summary.distributions if d.n]
    if not available() or not dists:
        return None
    import numpy as np

    fig = _figure(9, 1.0 + 0.55 * len(dists))
    ax = fig.add_subplot()
    rng = np.random.default_rng(0)  # jitter only; fixed so reports are reproducible
    data = [np.clip(np.asarray(d.ratios), RATIO_FLOOR, RATIO_CEIL) for d in dists]
    ax.boxplot(
        data,
        **_horizontal(),
        showfliers=False,
        widths=0.6,
        medianprops={"color": "black"},
        boxprops={"color": "#555"},
    )
    for i, (d, xs) in enumerate(zip(dists, data, strict=True), 1):
        ys = i + rng.uniform(-0.22, 0.22, len(xs))
        over = xs > 1.0
        ax.scatter(xs[~over], ys[~over], s=6, alpha=0.45, color="#1565c0", linewidths=0)
        ax.scatter(xs[over], ys[over], s=14, alpha=0.9, color=COLOURS[FAIL], linewidths=0)
        ax.annotate(
            f"n={d.n}, >1: {d.over}",
            (1.0, i),
            xycoords=("axes fraction", "data"),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    ax.axvline(1.0, color=COLOURS[FAIL], ls="--", lw=1.2)
    ax.text(
        1.0,
        1.0,
        " bound",
        color=COLOURS[FAIL],
        transform=ax.get_xaxis_transform(),
        va="bottom",
        fontsize=8,
    )
    ax.set_xscale("log")
    ax.set_yticks(range(1, len(dists) + 1), [d.fmt for d in dists])
    ax.invert_yaxis()
    ax.set_xlabel("worst row error / bound (per case; > 1 fails)")
    ax.spines[["top", "right"]].set_visible(False)
    return _png(fig)


def _horizontal() -> dict[str, Any]:
    """boxplot's horizontal switch: `orientation` from matplotlib 3.10, `vert` before."""
    import matplotlib

    major, minor = (int(x) for x in matplotlib.__version__.split(".")[:2])
    return {"orientation": "horizontal"} if (major, minor) >= (3, 10) else {"vert": False}


# --------------------------------------------------------------------------- heat maps


def token_step(heat_rows: int, heat_heads: int, rows: Any) -> int:
    """Tokens per heat-map row: report.heatmap max-pools long token axes into blocks."""
    if not isinstance(rows, int) or rows <= 0 or heat_rows <= 0 or heat_heads <= 0:
        return 1
    tokens = rows // heat_heads
    return max(1, math.ceil(tokens / heat_rows))


def error_heatmap(failure: Failure) -> bytes | None:
    """Per-row error, token x head, log colour: blues within the bound, reds beyond it."""
    grid = failure.heatmap
    if not available() or grid is None:
        return None
    import numpy as np
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator

    v = failure.verdict
    try:
        data = np.array(grid, dtype=float)
    except (ValueError, TypeError):  # ragged or non-numeric: not a heat map
        return None
    if data.ndim != 2:
        return None
    bad = ~np.isfinite(data) | (data >= NONFINITE)
    finite = data[~bad]
    bound = v.metrics.get("bound")
    bound = float(bound) if isinstance(bound, int | float) and bound > 0 else None
    vmin, vmax = _colour_range([float(x) for x in finite[finite > 0]], bound)
    shown = np.ma.masked_array(np.clip(data, vmin, vmax), mask=bad)

    # magenta: non-finite rows (NaN/Inf where the golden is finite, or the other way round)
    cmap = ListedColormap(_split_colours(vmin, vmax, bound)).with_extremes(bad="#e040fb")
    step = token_step(*data.shape, v.metrics.get("rows"))
    t, h = data.shape
    fig = _figure(7.5, 4.6)
    ax = fig.add_subplot()
    im = ax.imshow(
        shown,
        cmap=cmap,
        norm=LogNorm(vmin, vmax),
        aspect="auto",
        interpolation="nearest",
        extent=(-0.5, h - 0.5, t * step - 0.5, -0.5),
    )
    for w in v.where[:MAX_BOXES]:
        if w.heads:
            ax.add_patch(
                Rectangle(
                    (min(w.heads) - 0.5, w.tokens[0] - 0.5),
                    max(w.heads) - min(w.heads) + 1,
                    w.tokens[1] - w.tokens[0] + 1,
                    fill=False,
                    ec="black",
                    lw=1.0,
                    ls="--",
                )
            )
    cb = fig.colorbar(im, ax=ax, label="row error (relative L2)")
    if bound is not None and vmin <= bound <= vmax:  # always, by _colour_range
        cb.ax.axhline(bound, color="black", lw=2)
        cb.ax.annotate(
            "bound",
            (0, bound),
            xycoords=("axes fraction", "data"),
            xytext=(-2, 0),
            textcoords="offset points",
            ha="right",
            va="center",
            fontsize=8,
            annotation_clip=True,
        )
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("head")
    ax.set_ylabel("token row" + (f" (max over blocks of {step})" if step > 1 else ""))
    r = ratio(v)
    title = f"{v.backend} {v.op}: worst row {_g(v.metrics.get('worst_row'))}"
    title += f" vs bound {_g(bound)}" + (f" (x{r:.3g})" if r is not None else "") if bound else ""
    if bad.any():
        title += f"; {int(bad.sum())} non-finite cells (magenta)"
    ax.set_title(title, fontsize=10)
    return _png(fig)


# The colour scale reaches this factor below the bound, so the bound's line is on the colour
# bar even when every row is far beyond it (all red, the bound still drawn).
BELOW_BOUND = 3.0


def _colour_range(positive: list[float], bound: float | None) -> tuple[float, float]:
    """Log colour limits spanning the errors seen and the bound, at least a decade wide."""
    vmax = max(max(positive, default=0.0), (bound or 0.0) * 1.5) or 1.0
    vmin = min(positive) if positive else (bound or vmax) / 100
    if bound is not None:
        vmin = min(vmin, bound / BELOW_BOUND)
    return min(vmin, vmax / 10), vmax


def _split_colours(vmin: float, vmax: float, bound: float | None) -> Any:
    """256 colours: blues up to the bound's position on the log scale, reds beyond."""
    import matplotlib
    import numpy as np

    if bound is None:
        return matplotlib.colormaps["viridis"](np.linspace(0, 1, 256))
    frac = (math.log(bound) - math.log(vmin)) / (math.log(vmax) - math.log(vmin))
    n_lo = int(round(256 * min(1.0, max(0.0, frac))))
    lo = matplotlib.colormaps["Blues"](np.linspace(0.12, 0.75, n_lo))
    hi = matplotlib.colormaps["YlOrRd"](np.linspace(0.35, 1.0, 256 - n_lo))
    return np.vstack([lo, hi])


def _g(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, int | float) else "?"


def plot_note() -> str:
    """What to tell the reader when plots are missing."""
    return (
        ""
        if available()
        else "matplotlib is not installed: this report has no plots "
        "(pip install 'mlacheck[report]' to get them)."
    )
