"""The HTML report: one self-contained file (inline CSS, plots as inline SVG, no URLs).

The header says what ran (matrix, backends with versions, machine, software, date, wall time)
and the headline with executed vs skipped per backend x op. Failures come next, each with its
where-messages and, when the verdict carries one, an error heat map (token x head). Then
totals, skip reasons, error distributions, timings and the table of every case (PASS rows
folded away so 2000 cases stay readable).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from pathlib import Path

from mlacheck.ops import unit_of
from mlacheck.report import plots
from mlacheck.report.render_md import time_note, title_of, warnings_of
from mlacheck.report.summary import Failure, Summary, ratio, summarise
from mlacheck.results import RunHeader
from mlacheck.verdict import (
    BUCKETS,
    CRASH,
    ERROR,
    FAIL,
    KNOWN,
    PASS,
    SKIP,
    XPASS,
    Verdict,
    noteworthy,
)

MAX_HEATMAPS = 40  # heat maps embedded (each ~5-40 kB of SVG); later failures get text only
MAX_WHERE = 40  # where-messages listed per failure
ROW_ORDER = {FAIL: 0, CRASH: 1, ERROR: 2, XPASS: 3, KNOWN: 4, SKIP: 5, PASS: 6}

CSS = """
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d1d1f;
 margin:0;background:#f6f7f9}
main{max-width:1280px;margin:0 auto;padding:0 24px 48px}
header{background:#fff;border-bottom:1px solid #ddd;padding:16px 24px;margin-bottom:16px}
header .inner{max-width:1280px;margin:0 auto}
h1{font-size:20px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 10px;padding-bottom:4px;border-bottom:2px solid #e3e3e3}
h3{font-size:14px;margin:0 0 6px;word-break:break-all}
.src{color:#666;font-size:12px}
.facts{color:#444;font-size:12px;margin:2px 0}
.headline{font-size:16px;font-weight:600;margin:10px 0 6px}
.headline.bad{color:#c62828}.headline.good{color:#2e7d32}
.headline.partial{color:#a15c00;background:#fff4e5;border-left:4px solid #ef6c00;padding:4px 8px}
table.executed td.thin{color:#a15c00;font-weight:600}
.badges{display:flex;gap:8px;flex-wrap:wrap;margin:8px 0}
.badge{display:inline-block;border-radius:4px;padding:1px 8px;color:#fff;font-weight:600;
 font-size:12px;white-space:nowrap}
.badges .badge{font-size:14px;padding:4px 12px}
.badge.zero{opacity:.35}
.PASS{background:#2e7d32}.FAIL{background:#c62828}.CRASH{background:#6a1b9a}
.SKIP{background:#9e9e9e}.KNOWN{background:#ef6c00}.ERROR{background:#37474f}
.XPASS{background:#ad1457}.OTHER{background:#000}
.warn{background:#fff4e5;border-left:4px solid #ef6c00;padding:6px 10px;margin:6px 0}
nav{font-size:13px;margin-top:8px}nav a{margin-right:14px;color:#1565c0;text-decoration:none}
.card{background:#fff;border:1px solid #ddd;border-left:6px solid #c62828;border-radius:6px;
 padding:12px 14px;margin:12px 0}
.card.CRASH{border-left-color:#6a1b9a}.card.KNOWN{border-left-color:#ef6c00}
.card .reason{margin:2px 0 8px;font-weight:600}
.card .body{display:flex;gap:16px;flex-wrap:wrap;align-items:flex-start}
.card .body>div{flex:1 1 420px;min-width:0}
.card svg.plot{max-width:100%;height:auto;border:1px solid #eee;background:#fff}
ul.where{margin:4px 0;padding-left:18px;font:12px/1.4 ui-monospace,Menlo,Consolas,monospace}
ul.where li{margin:2px 0;word-break:break-word}
pre{background:#f3f3f3;padding:8px;overflow-x:auto;font-size:12px;margin:6px 0;
 white-space:pre-wrap;word-break:break-word}
table{border-collapse:collapse;background:#fff;font-size:13px;margin:6px 0}
th,td{border:1px solid #e0e0e0;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#fafafa}td.n{text-align:right;font-variant-numeric:tabular-nums}
td.id{font:12px ui-monospace,Menlo,Consolas,monospace;word-break:break-all}
table.cases td.id{white-space:nowrap;word-break:normal}
td.zero{color:#bbb}
tr.over td.ratio{color:#c62828;font-weight:600}
table.checks{font-size:12px}
details{margin:8px 0}summary{cursor:pointer;color:#1565c0}
.plot{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px;display:inline-block}
.muted{color:#777}
.diagnosis{margin:2px 0 8px;padding:4px 8px;background:#fff3e0;border-radius:4px}
"""


def render_html(s: Summary, verdicts: list[Verdict], title: str = "", source: str = "") -> str:
    title = title_of(s, title)
    body = [
        _header(s, title, source),
        "<main>",
        _failures(s),
        _known(s),
        _totals(s),
        _skips(s),
        _distributions(s),
        _timings(s),
        _all_cases(verdicts),
        "</main>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>\n"
        + "\n".join(b for b in body if b)
        + "\n</body></html>\n"
    )


def write_html(
    verdicts: list[Verdict],
    path: str | Path,
    *,
    unparsable: int = 0,
    title: str = "",
    source: str = "",
    expected: int = 0,
    superseded: int = 0,
    missing: int | None = None,
    headers: Sequence[RunHeader] = (),
    wall_s: float | None = None,
) -> Path:
    path = Path(path)
    s = summarise(verdicts, unparsable, expected=expected, superseded=superseded,
                  missing=missing, headers=headers, wall_s=wall_s)
    html = render_html(s, verdicts, title, source)
    path.write_text(html, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- sections


def _header(s: Summary, title: str, source: str) -> str:
    text, cls = s.headline()
    head = escape(text) + (" &mdash; details first, below" if s.failures else "")
    badges = "".join(
        f'<span class="badge {_cls(st)}{"" if s.by_status[st] else " zero"}">'
        f"{s.by_status[st]} {escape(st)}</span>"
        for st in s.statuses
    )
    warns = warnings_of(s)
    nav = "".join(
        f'<a href="#{a}">{t}</a>'
        for a, t in (
            ("failures", "Failures"),
            ("totals", "Totals"),
            ("skips", "Skip reasons"),
            ("errors", "Error distributions"),
            ("timings", "Timings"),
            ("cases", "All cases"),
        )
    )
    src = f'<div class="src">{escape(source)} &middot; {s.total} verdicts</div>' if source else ""
    facts = "".join(f'<div class="facts">{escape(f)}</div>' for f in s.run.facts())
    return (
        f'<header><div class="inner"><h1>{escape(title)}</h1>{src}{facts}'
        f'<div class="headline {cls}">{head}</div><div class="badges">{badges}</div>'
        + "".join(f'<div class="warn">{escape(w)}</div>' for w in warns)
        + _executed(s)
        + f"<nav>{nav}</nav></div></header>"
    )


def _executed(s: Summary) -> str:
    """Executed vs skipped per backend x op, the thin ones marked: what the headline means."""
    if not s.coverage:
        return ""
    thin = {(b, op) for b, op, _ in s.thin}
    rows = "".join(
        f"<tr><td>{escape(b)}</td><td>{escape(op)}</td>{_count_cell(c.executed)}"
        f"{_count_cell(c.skipped)}<td class=\"n{' thin' if (b, op) in thin else ''}\">"
        f"{c.executed / c.total:.0%}{' (thin)' if (b, op) in thin else ''}</td></tr>"
        for (b, op), c in s.coverage.items())
    return (f'<details{" open" if thin else ""}><summary>{escape(s.coverage_line())}</summary>'
            '<table class="executed"><tr><th>backend</th><th>op</th><th>executed</th>'
            f"<th>skipped</th><th>executed share</th></tr>{rows}</table></details>")


def _failures(s: Summary) -> str:
    if not s.failures:
        return '<h2 id="failures">Failures</h2><p class="muted">None.</p>'
    cards = [_card(f, with_plot=i < MAX_HEATMAPS) for i, f in enumerate(s.failures)]
    note = (
        f'<p class="muted">Heat maps shown for the first {MAX_HEATMAPS} failures only.</p>'
        if len(s.failures) > MAX_HEATMAPS
        else ""
    )
    return f'<h2 id="failures">Failures ({len(s.failures)})</h2>' + note + "".join(cards)


def _known(s: Summary) -> str:
    if not s.known:
        return ""
    return (
        f'<h2 id="known">Known failures ({len(s.known)})</h2><p class="muted">Documented '
        "real findings: counted as KNOWN, never hidden.</p>"
        + "".join(_card(f, with_plot=False, known=True) for f in s.known)
    )


def _card(f: Failure, with_plot: bool, known: bool = False) -> str:
    v = f.verdict
    cls = v.bucket
    parts = [
        f'<article class="card {_cls(cls)}"><h3><span class="badge {_cls(cls)}">'
        f"{escape(cls)}</span> {escape(v.backend)} {escape(v.op)} "
        f"<code>{escape(v.case_id)}</code></h3>"
    ]
    if v.reason:
        parts.append(f'<div class="reason">{escape(v.reason)}</div>')
    if v.diagnosis:  # the axis the failure lies along (mlacheck.localise)
        parts.append(f'<div class="diagnosis">{escape(v.diagnosis)}</div>')
    if known:
        parts.append(f'<div class="warn">known failure: {escape(v.known_failure)}</div>')
    svg = plots.error_heatmap(f) if with_plot else None
    text = [_checks_table(v), _where_list(v)]
    if v.status == CRASH and isinstance(tb := v.metrics.get("traceback"), str):
        text.append(f"<details><summary>traceback</summary><pre>{escape(tb)}</pre></details>")
    text.append(
        "<details><summary>one-screen summary (text)</summary>"
        f"<pre>{escape(f.text)}</pre></details>"
    )
    text.append(
        "<details><summary>case</summary>"
        f"<pre>{escape(json.dumps(v.case, indent=1, sort_keys=True))}</pre></details>"
    )
    plot = f"<div>{svg}</div>" if svg else ""
    parts.append(f'<div class="body"><div>{"".join(text)}</div>{plot}</div></article>')
    return "".join(parts)


def _checks_table(v: Verdict) -> str:
    bad = v.failed_checks
    if not bad:
        return ""
    rows = "".join(
        f"<tr><td>{escape(c.name)}</td><td class=n>{_num(c.value)}</td><td class=n>"
        f"{_num(c.bound)}</td><td>{escape(c.detail)}</td></tr>"
        for c in bad
    )
    return (
        '<table class="checks"><tr><th>failed check</th><th>value</th><th>bound</th>'
        f"<th>detail</th></tr>{rows}</table>"
    )


def _where_list(v: Verdict) -> str:
    if not v.where:
        return ""
    unit = unit_of(v.op)
    items = "".join(f"<li>{escape(w.message(unit))}</li>" for w in v.where[:MAX_WHERE])
    more = (
        f'<li class="muted">... and {len(v.where) - MAX_WHERE} more locations</li>'
        if len(v.where) > MAX_WHERE
        else ""
    )
    return f'<ul class="where">{items}{more}</ul>'


def _totals(s: Summary) -> str:
    cols = s.statuses
    head = "".join(f"<th>{escape(c)}</th>" for c in cols)
    rows = []
    for (b, o), c in s.counts.items():
        cells = "".join(_count_cell(c[x]) for x in cols)
        rows.append(
            f"<tr><td>{escape(b)}</td><td>{escape(o)}</td>{cells}<td class=n>{c.total()}</td></tr>"
        )
    cells = "".join(_count_cell(s.by_status[x]) for x in cols)
    rows.append(f"<tr><th>all</th><th></th>{cells}<td class=n><b>{s.total}</b></td></tr>")
    svg = plots.status_bars(s)
    return (
        f'<h2 id="totals">Totals per backend &times; op</h2><table><tr><th>backend</th>'
        f"<th>op</th>{head}<th>total</th></tr>{''.join(rows)}</table>"
        + (f'<div class="plot">{svg}</div>' if svg else "")
    )


def _skips(s: Summary) -> str:
    if not s.skips:
        return '<h2 id="skips">Skip reasons</h2><p class="muted">No case was skipped.</p>'
    rows = "".join(
        f"<tr><td>{escape(g.backend)}</td><td>{escape(g.op)}</td><td>{escape(g.reason)}</td>"
        f'<td class=n>{g.count}</td><td class="id">{escape(", ".join(g.examples))}</td></tr>'
        for g in s.skips
    )
    return (
        '<h2 id="skips">Skip reasons (coverage not exercised)</h2><table><tr><th>backend</th>'
        "<th>op</th><th>reason</th><th>cases</th><th>e.g.</th></tr>" + rows + "</table>"
    )


def _distributions(s: Summary) -> str:
    if not s.distributions:
        return ""
    rows = "".join(
        f"<tr><td>{escape(d.fmt)}</td><td class=n>{d.n}</td>"
        + "".join(f"<td class=n>{d.quantile(q):.3g}</td>" for q in (0.5, 0.9, 0.99))
        + f"<td class=n>{d.ratios[-1]:.3g}</td>{_count_cell(d.over)}</tr>"
        for d in s.distributions
    )
    svg = plots.error_distributions(s)
    return (
        '<h2 id="errors">Worst row error / bound per compute format</h2>'
        '<p class="muted">One point per case; the compute format is the KV format. '
        "Above 1 a case fails its row-error check.</p>"
        + (f'<div class="plot">{svg}</div>' if svg else "")
        + "<table><tr><th>format</th><th>cases</th><th>median</th><th>p90</th><th>p99</th>"
        f"<th>max</th><th>&gt; bound</th></tr>{rows}</table>"
    )


def _timings(s: Summary) -> str:
    if not s.timings:
        return ""
    rows = "".join(
        f"<tr><td>{escape(t.phase)}</td><td class=n>{t.total:.2f}</td><td class=n>{t.cases}</td>"
        f'<td class=n>{t.worst:.3f}</td><td class="id">{escape(t.worst_case)}</td></tr>'
        for t in s.timings
    )
    total = sum(t.total for t in s.timings)
    wall = (f"<tr><th>wall time</th><td class=n><b>{s.run.wall_s:.2f}</b></td><td></td><td></td>"
            "<td></td></tr>" if s.run.wall_s is not None else "")
    return (
        f'<h2 id="timings">Time per phase</h2><p class="muted">{escape(time_note(s))}</p>'
        '<table><tr><th>phase</th><th>summed s</th>'
        f"<th>cases</th><th>slowest s</th><th>slowest case</th></tr>{rows}"
        f"<tr><th>all phases, summed</th><td class=n><b>{total:.2f}</b></td><td></td><td></td>"
        f"<td></td></tr>{wall}</table>"
    )


def _all_cases(verdicts: list[Verdict]) -> str:
    """Every case: problems in view; SKIP and PASS rows folded (PASS closest to the bound first)."""
    problems = [v for v in verdicts if noteworthy(v.bucket)]
    skipped = [v for v in verdicts if v.bucket == SKIP]
    passed = [v for v in verdicts if v.bucket == PASS]
    problems.sort(key=lambda v: (ROW_ORDER.get(v.bucket, 5), v.backend, v.op, v.case_id))
    skipped.sort(key=lambda v: (v.backend, v.op, v.reason, v.case_id))
    passed.sort(key=lambda v: (-(ratio(v) or 0.0), v.backend, v.op, v.case_id))
    out = [f'<h2 id="cases">All cases ({len(verdicts)})</h2>']
    if problems:
        out.append(_case_table(problems))
    for vs, what in (
        (skipped, "skipped case{} (reasons grouped above)"),
        (passed, "passing case{} (closest to the bound first)"),
    ):
        if vs:
            out.append(
                f"<details><summary>{len(vs)} {what.format(_s(len(vs)))}</summary>"
                + _case_table(vs)
                + "</details>"
            )
    return "".join(out)


def _case_table(vs: list[Verdict]) -> str:
    rows = []
    for v in vs:
        r, b = ratio(v), v.bucket
        reason = v.reason + (f" [known: {v.known_failure}]" if v.known_failure else "")
        rows.append(
            f'<tr{" class=over" if r is not None and r > 1 else ""}><td><span class="badge '
            f'{_cls(b)}">{escape(b)}</span></td><td>{escape(v.backend)}</td><td>{escape(v.op)}</td>'
            f'<td class="id">{escape(v.case_id)}</td><td class="n ratio">'
            f"{'' if r is None else f'{r:.3g}'}</td><td>{escape(reason)}</td></tr>"
        )
    return (
        '<table class="cases"><tr><th>status</th><th>backend</th><th>op</th><th>case id</th>'
        f"<th>worst/bound</th><th>reason</th></tr>{''.join(rows)}</table>"
    )


# --------------------------------------------------------------------------- helpers


def _count_cell(n: int) -> str:
    return f'<td class="n{"" if n else " zero"}">{n}</td>'


def _num(x: object) -> str:
    return f"{x:.3g}" if isinstance(x, int | float) else ""


def _cls(status: str) -> str:
    return status if status in BUCKETS else "OTHER"


def _s(n: int) -> str:
    return "" if n == 1 else "s"
