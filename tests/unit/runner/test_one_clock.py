"""One clock for a run (issue 33): pytest's duration, the progress lines and the report's wall
time all count from the pytest session's start, and the report puts the wall time beside the
phase times summed over items (which add up over workers)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlacheck import progress
from mlacheck.progress import Progress
from mlacheck.report.load import read_results

TINY = """
name: tiny
description: two small cases
groups:
  - name: decode
    kind: decode
    base: {requests: [[1, 70], [2, 130]], page_size: 16, num_heads: 16}
  - name: prefill
    kind: prefill
    base: {segments: [[20, 10], [24, 0]], num_heads: 16}
"""
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def test_report_wall_time_is_on_pytests_clock(tmp_path: Path) -> None:
    """The results header's start is the instant pytest's own duration counts from (it was
    the time the header was written, after the workers had started: seconds later)."""
    matrix = tmp_path / "tiny.yaml"
    matrix.write_text(TINY)
    res, clock = tmp_path / "r.jsonl", tmp_path / "clock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(FIXTURES), env.get("PYTHONPATH")])),
               SESSION_CLOCK_FILE=str(clock))
    r = subprocess.run([sys.executable, "-m", "mlacheck.cli", "run", "-b", "torch", "--matrix",
                        str(matrix), "--results", str(res), "-n", "1", "--", "-p",
                        "session_clock"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    pytest_s = float(re.search(r" in ([\d.]+)s", r.stdout).group(1))
    loaded = read_results(res)
    header = loaded.headers[0]
    assert header.started == float(clock.read_text())
    stamps = [json.loads(line)["written"] for line in res.read_text().splitlines()[1:]]
    assert all(header.started < t for t in stamps)
    assert loaded.wall_s is not None and 0 < loaded.wall_s <= pytest_s + 0.5
    md = (tmp_path / "report.md").read_text()
    assert f"| **wall time** | {loaded.wall_s:.2f} |" in md and "all phases, summed" in md


def test_progress_counts_from_the_start_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin hands Progress the session's start: its first line does not read 0 s after
    a long first item (its own clock used to start at the first finished item). The clock
    stands still: on the real one, a pause of 0.5 s before record() read 43 s."""
    monkeypatch.setattr(progress.time, "monotonic", lambda: 1000.0)
    p = Progress({("torch", "mla_decode"): 1}, started=1000.0 - 42.0)
    line = p.record("torch", "mla_decode", "passed")
    assert line is not None and "(100%, 42 s)" in line
