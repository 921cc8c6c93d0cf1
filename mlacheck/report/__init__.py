"""Reports of a run: results file (JSON lines of verdicts) -> markdown + self-contained HTML.

load_results -> summarise -> write_markdown / write_html; `main` is `mlacheck report`.
Plots are inline SVG drawn with the standard library (report/plots.py): no extra install.
"""

from mlacheck.report.cli import main
from mlacheck.report.load import load_results, read_results
from mlacheck.report.render_html import render_html, write_html
from mlacheck.report.render_md import render_markdown, write_markdown
from mlacheck.report.summary import KNOWN, Summary, summarise

__all__ = [
    "KNOWN",
    "Summary",
    "load_results",
    "main",
    "read_results",
    "render_html",
    "render_markdown",
    "summarise",
    "write_html",
    "write_markdown",
]
