"""The compact markdown report: what a CI job posts as a comment or step summary."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mlacheck.report.summary import Summary, summarise
from mlacheck.results import RunHeader
from mlacheck.verdict import Verdict

MAX_MD_FAILURES = 50  # failure blocks in full; the rest listed one line each
DEFAULT_TITLE = "mlacheck report"
# The headline's tone, as a word a markdown reader sees (no colour in markdown).
TONE_WORDS = {"bad": "RED", "partial": "PARTIAL", "good": "GREEN"}


def title_of(s: Summary, title: str = "") -> str:
    """The given title, else what ran (matrix x backends on device), else the default."""
    return title or s.run.title() or DEFAULT_TITLE


def render_markdown(s: Summary, title: str = "") -> str:
    """What ran and the headline, then failures, totals, skip reasons, error distributions
    and timings."""
    text, tone = s.headline()
    out = [f"# {title_of(s, title)}", ""]
    out += [f"- {line}" for line in s.run.facts()] + ([""] if s.run.facts() else [])
    out += [f"**{TONE_WORDS[tone]}: {text}**", "", s.total_line(), ""]
    warns = warnings_of(s)
    out += [f"> warning: {w}" for w in warns] + ([""] if warns else [])
    out += (_executed(s) + _failures(s) + _known(s) + _totals(s) + _skips(s)
            + _distributions(s) + _timings(s))
    return "\n".join(out).rstrip() + "\n"


def write_markdown(
    verdicts: list[Verdict],
    path: str | Path,
    *,
    unparsable: int = 0,
    title: str = "",
    expected: int = 0,
    superseded: int = 0,
    missing: int | None = None,
    headers: Sequence[RunHeader] = (),
    wall_s: float | None = None,
) -> Path:
    path = Path(path)
    s = summarise(verdicts, unparsable, expected=expected, superseded=superseded,
                  missing=missing, headers=headers, wall_s=wall_s)
    path.write_text(render_markdown(s, title), encoding="utf-8")
    return path


def warnings_of(s: Summary) -> list[str]:
    """Things about the run itself a reader must not miss."""
    w = []
    if s.incomplete:
        w.append(s.incomplete_line())
    if s.unparsable:
        w.append(
            f"{s.unparsable} unparsable line(s) in the results file were skipped "
            "(a truncated last line means the run died before finishing)"
        )
    if s.duplicates:
        w.append(f"{s.duplicates} case x backend verdict line(s) were written again (re-runs): "
                 "each item counts once, its latest verdict")
    for v in s.stale_known:
        rule = v.known_rule or "see mlacheck/known.py"
        w.append(f"XPASS: known failure now PASSES, remove its rule ({rule}): "
                 f"{v.backend} {v.case_id}")
    return w


def _executed(s: Summary) -> list[str]:
    """Executed vs skipped per backend x op: what the green or red is about."""
    if not s.coverage:
        return []
    thin = {(b, op) for b, op, _ in s.thin}
    out = ["## Executed per backend x op", "", s.coverage_line(), "",
           "| backend | op | executed | skipped | executed share |", "|---|---|---:|---:|---:|"]
    for (b, op), c in s.coverage.items():
        mark = " (thin)" if (b, op) in thin else ""
        out.append(f"| {b} | {op} | {c.executed} | {c.skipped} | "
                   f"{c.executed / c.total:.0%}{mark} |")
    return out + [""]


def _failures(s: Summary) -> list[str]:
    if not s.failures:
        return ["## Failures", "", "None.", ""]
    out = [f"## Failures ({len(s.failures)})", ""]
    for f in s.failures[:MAX_MD_FAILURES]:
        v = f.verdict
        out += [
            f"### {v.status} {v.backend} {v.op} `{v.case_id}`",
            "",
            "```text",
            f.text,
            "```",
            "",
        ]
    rest = s.failures[MAX_MD_FAILURES:]
    if rest:
        out += [f"{len(rest)} more failures (see report.html):", ""]
        out += [
            f"- {f.verdict.status} {f.verdict.backend} `{f.verdict.case_id}`: "
            f"{_cell(f.verdict.reason)}"
            for f in rest
        ] + [""]
    return out


def _known(s: Summary) -> list[str]:
    if not s.known:
        return []
    out = [
        f"## Known failures ({len(s.known)})",
        "",
        "Documented real findings: counted as KNOWN, not hidden.",
        "",
    ]
    for f in s.known:
        v = f.verdict
        out.append(
            f"- {v.status} {v.backend} {v.op} `{v.case_id}`: {_cell(v.reason)} "
            f"— known: {_cell(v.known_failure)}"
        )
    return out + [""]


def _totals(s: Summary) -> list[str]:
    cols = s.statuses
    out = [
        "## Totals",
        "",
        "| backend | op | " + " | ".join(cols) + " | total |",
        "|---|---|" + "---:|" * (len(cols) + 1),
    ]
    for (b, o), c in s.counts.items():
        out.append(f"| {b} | {o} | " + " | ".join(str(c[x]) for x in cols) + f" | {c.total()} |")
    out.append("| **all** | | " + " | ".join(str(s.by_status[x]) for x in cols) + f" | {s.total} |")
    return out + [""]


def _skips(s: Summary) -> list[str]:
    if not s.skips:
        return []
    out = [
        "## Skip reasons (coverage not exercised)",
        "",
        "| backend | op | reason | cases | e.g. |",
        "|---|---|---|---:|---|",
    ]
    out += [
        f"| {g.backend} | {g.op} | {_cell(g.reason)} | {g.count} | `{g.examples[0]}` |"
        for g in s.skips
    ]
    return out + [""]


def _distributions(s: Summary) -> list[str]:
    if not s.distributions:
        return []
    out = [
        "## Worst row error / bound per compute format",
        "",
        "| format | cases | median | p90 | p99 | max | > bound |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for d in s.distributions:
        q = [f"{d.quantile(x):.3g}" for x in (0.5, 0.9, 0.99)]
        out.append(f"| {d.fmt} | {d.n} | " + " | ".join(q) + f" | {d.ratios[-1]:.3g} | {d.over} |")
    return out + [""]


def _timings(s: Summary) -> list[str]:
    if not s.timings:
        return []
    out = [
        "## Time per phase",
        "",
        time_note(s),
        "",
        "| phase | summed s | cases | slowest s | slowest case |",
        "|---|---:|---:|---:|---|",
    ]
    out += [
        f"| {t.phase} | {t.total:.2f} | {t.cases} | {t.worst:.3f} | `{t.worst_case}` |"
        for t in s.timings
    ]
    total = sum(t.total for t in s.timings)
    out.append(f"| **all phases, summed** | {total:.2f} | | | |")
    if s.run.wall_s is not None:
        out.append(f"| **wall time** | {s.run.wall_s:.2f} | | | |")
    return out + [""]


def time_note(s: Summary) -> str:
    """What the two clocks mean: phases summed over items (workers add up) vs wall time."""
    workers = f" on {s.run.workers} worker{'s' if s.run.workers != 1 else ''}" \
        if s.run.workers else ""
    wall = (f"; the run took {s.run.wall_s:.2f} s of wall time{workers} (from the session's "
            "start, the clock pytest's duration and the progress lines use)"
            if s.run.wall_s is not None else "")
    return f"Phase times are summed over every item{wall}."


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")
