"""`mlacheck report results.jsonl [-o outdir]`: write report.md and report.html.
`mlacheck report --coverage results.jsonl [...] [-o coverage.md]`: the coverage table.

Bad input (a missing, unreadable or empty results file) is one line on stderr and exit code 2,
so CI scripts can tell "no results" from "results with failures" (exit 0: the report's job is
to show failures; the pytest run's exit code is what gates).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlacheck.report.load import read_results, skipped_message
from mlacheck.report.render_html import write_html
from mlacheck.report.render_md import write_markdown
from mlacheck.report.summary import summarise

BAD_INPUT = 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlacheck report", description="Markdown + HTML report of a results file (JSON lines)."
    )
    p.add_argument("results", type=Path, help="results file written by the pytest plugin")
    p.add_argument(
        "-o",
        "--outdir",
        type=Path,
        default=None,
        help="where report.md and report.html go (default: next to the results file)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; argv excludes the 'report' subcommand word. `--coverage FILE...` prints
    the per backend x version x op coverage table instead (mlacheck.report.coverage)."""
    if argv is None:
        argv = sys.argv[1:]
    if "--coverage" in argv:
        from mlacheck.report import coverage

        return coverage.main([a for a in argv if a != "--coverage"])
    args = parser().parse_args(argv)
    path: Path = args.results
    try:
        loaded = read_results(path)
    except OSError as e:
        return _fail(f"cannot read {path}: {e.strerror or e}")
    if not loaded.verdicts and not loaded.headers:
        why = f"all {loaded.skipped} line(s) unparsable" if loaded.skipped else "empty file"
        return _fail(f"no verdicts in {path} ({why})")
    # a run header and no verdict: a run interrupted before its first item ended; its report
    # says what was to run and that nothing did (INCOMPLETE: 0 of N), as its gate does
    if loaded.skipped:
        print(
            f"mlacheck report: warning: {skipped_message(path, loaded.bad_lines)}", file=sys.stderr
        )
    outdir: Path = args.outdir if args.outdir is not None else path.parent
    try:
        outdir.mkdir(parents=True, exist_ok=True)
        run = {"expected": loaded.expected, "superseded": loaded.superseded,
               "missing": loaded.missing, "headers": loaded.headers, "wall_s": loaded.wall_s}
        md = write_markdown(loaded.verdicts, outdir / "report.md", unparsable=loaded.skipped,
                            **run)
        html = write_html(loaded.verdicts, outdir / "report.html", unparsable=loaded.skipped,
                          source=str(path), **run)
    except OSError as e:
        print(f"mlacheck report: error: cannot write the report: {e}", file=sys.stderr)
        return 1
    print(md)
    print(html)
    print(summarise(loaded.verdicts, loaded.skipped, **run).total_line())
    return 0


def _fail(msg: str) -> int:
    print(f"mlacheck report: error: {msg}", file=sys.stderr)
    return BAD_INPUT
