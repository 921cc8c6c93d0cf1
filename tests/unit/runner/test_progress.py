"""Progress lines of a long run (mlacheck/progress.py): when one is due, what it counts."""

from __future__ import annotations

from collections import Counter

import pytest

from mlacheck import progress
from mlacheck.progress import Progress


def _progress(monkeypatch: pytest.MonkeyPatch, clock: list[float], **totals: int) -> Progress:
    """A Progress whose clock stands still at its start until the test moves clock[0]."""
    p = Progress(Counter({tuple(k.split("__")): n for k, n in totals.items()}))
    clock[0] = p.started
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    return p


def test_a_line_every_tenth_of_the_items_and_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    p = _progress(monkeypatch, clock, torch__mla_decode=20)
    lines = [p.record("torch", "mla_decode", "passed") for _ in range(20)]
    due = [i + 1 for i, line in enumerate(lines) if line]
    assert due == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert lines[-1].startswith("mlacheck: 20/20 items (100%, 0 s): FAIL 0, CRASH 0, ")


def test_at_least_a_line_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    p = _progress(monkeypatch, clock, torch__mla_decode=1000)
    assert p.record("torch", "mla_decode", "passed") is None
    clock[0] += progress.PROGRESS_SECONDS + 1
    line = p.record("torch", "mla_decode", "passed")
    assert line is not None and "2/1000 items (0%, 61 s)" in line


def test_crash_fail_and_errors_counted_apart_and_open_groups_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    p = _progress(monkeypatch, clock, torch__mla_decode=3, aiter__mla_prefill=4)
    for outcome in ("failed", "crashed", "crashed", "passed"):
        p.record("aiter", "mla_prefill", outcome)
    p.record("torch", "mla_decode", "skipped")
    p.record("torch", "mla_decode", "known")
    line = p.line()
    assert "FAIL 1, CRASH 2, KNOWN 1, SKIP 1, PASS 1" in line and "ERROR" not in line
    assert line.endswith("; in progress: torch mla_decode 2/3")  # aiter's group is complete
    p.record("torch", "mla_decode", "error")
    assert "CRASH 2, ERROR 1, KNOWN 1" in p.line() and "in progress" not in p.line()


@pytest.mark.parametrize("status, when, outcome, counted", [
    ("CRASH", "call", "failed", "crashed"), ("FAIL", "call", "failed", "failed"),
    ("ERROR", "call", "failed", "error"), ("PASS", "call", "passed", "passed"),
    ("SKIP", "call", "skipped", "skipped"), (None, "???", "failed", "crashed"),
])
def test_the_plugin_tells_a_crash_from_a_fail(status: str | None, when: str, outcome: str,
                                              counted: str) -> None:
    """pytest's outcome is `failed` for both: the verdict's status travels with the report
    (a worker that died under its item, when '???', is a CRASH)."""
    from _pytest.reports import TestReport

    from mlacheck.pytest_plugin import STATUS_PROPERTY, _progress_outcome

    props = [(STATUS_PROPERTY, status)] if status else []
    report = TestReport("t::x", ("t", 0, "x"), {}, outcome, None, when, user_properties=props)
    assert _progress_outcome(report) == counted
