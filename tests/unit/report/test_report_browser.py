"""The HTML report of a fault run as a browser draws it (issue 16): every plot (inline SVG,
issue 33) is rendered at its own aspect ratio and a readable size, and no plot is a blank
band (the heat map of a case whose every row is over the bound used to collapse: blank area,
the bound's label astray).

Needs playwright (pip), a Chromium (its own download, or the distribution's
chromium-headless-shell / chromium package) and Pillow (to read the screenshots): skipped with
the reason when one is missing, as on CI, which installs none of them.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from mlacheck.backends.faults import make
from mlacheck.harness import run_case
from mlacheck.matrices import load
from mlacheck.report import main as report_main
from mlacheck.verdict import FAIL

# Chromium binaries the distributions install, tried after playwright's own download.
SYSTEM_CHROMIUMS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
# Fault x case runs whose report the browser draws: every row over the bound at page size 1024
# (the collapsed heat map of issue 16), a head bug, a paging bug, one perturbed row.
RUNS = (("read-past-page-end", "dec-b3-kv37-300-h16-p1024-bf16"),
        ("unpad-heads-slice", "dec-b2-kv33-70-h8-p16"),
        ("last-page-lens-one", "dec-b3-kv37-300-h16-p16-bf16"),
        ("perturb-row", "pf-s1-q40-ctx88-h16-bf16-full"))
# A plot drawn smaller than this (CSS pixels) is unreadable; the report lays them out at
# 420 px and more (render_html CSS: .card .body>div flex-basis 420px).
MIN_WIDTH, MIN_HEIGHT = 300, 150
# Rendered width / height may differ from the PNG's own by this fraction (rounding).
ASPECT_SLACK = 0.02
# A run of all-white pixel rows longer than this share of a plot's height is a blank band.
MAX_BLANK_SHARE = 0.25


def _chromium() -> tuple[object, str | None]:
    """(playwright's sync_playwright, a Chromium executable or None for its own), or skip."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright): no browser check")
    with sync_playwright() as p:
        own = Path(p.chromium.executable_path)
    if own.exists():
        return sync_playwright, None
    for name in SYSTEM_CHROMIUMS:
        found = shutil.which(name)
        if found:
            return sync_playwright, found
    pytest.skip("no Chromium: neither playwright's own (playwright install chromium) nor a "
                f"system one ({', '.join(SYSTEM_CHROMIUMS)})")


def _fault_run_report(out: Path) -> tuple[Path, int]:
    """report.html of the RUNS, and how many of them FAIL (each has a heat map)."""
    cases = [mc.case for m in ("smoke", "selftest") for mc in load(m).cases]
    verdicts = [run_case(next(c for c in cases if c.id.startswith(prefix)), make(fault))
                for fault, prefix in RUNS]
    results = out / "results.jsonl"
    results.write_text("".join(v.to_json() + "\n" for v in verdicts))
    assert report_main([str(results), "-o", str(out)]) == 0
    return out / "report.html", sum(v.status == FAIL for v in verdicts)


def _longest_white_band(png: bytes) -> float:
    """Share of the image's height taken by its longest run of all-white pixel rows."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("L")
    width, height = img.size
    pixels = img.load()
    white = [all(pixels[x, y] > 250 for x in range(width)) for y in range(height)]
    longest = run = 0
    for w in white:
        run = run + 1 if w else 0
        longest = max(longest, run)
    return longest / len(white)


def test_fault_run_report_draws_every_plot_whole(tmp_path: Path) -> None:
    pytest.importorskip("PIL", reason="Pillow reads the screenshots")
    sync_playwright, executable = _chromium()
    html, failing = _fault_run_report(tmp_path)
    with sync_playwright() as p:  # type: ignore[operator]
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(html.as_uri())
        page.wait_for_load_state("load")
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        plots = page.query_selector_all("svg.plot")
        sizes = [(svg.get_attribute("aria-label"), svg.evaluate(
            "s => [s.viewBox.baseVal.width, s.viewBox.baseVal.height, "
            "s.getBoundingClientRect().width, s.getBoundingClientRect().height]"))
            for svg in plots]
        bands = {svg.get_attribute("aria-label"): _longest_white_band(svg.screenshot())
                 for svg in plots}
        browser.close()
    heat = [alt for alt, _ in sizes if alt and alt.startswith("error heat map")]
    assert failing >= 3 and len(heat) == failing, sizes
    for alt, (nw, nh, w, h) in sizes:
        assert nw > 0 and nh > 0, f"{alt}: no view box"
        assert w >= MIN_WIDTH and h >= MIN_HEIGHT, f"{alt}: drawn {w:.0f}x{h:.0f}"
        assert abs((w / h) / (nw / nh) - 1) <= ASPECT_SLACK, f"{alt}: {w}x{h} of {nw}x{nh}"
        assert bands[alt] <= MAX_BLANK_SHARE, f"{alt}: blank band of {bands[alt]:.0%}"
