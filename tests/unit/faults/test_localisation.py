"""Failures point at the bug: for every fault in the catalogue, the first line of its failure
card names the axis the fault acts along (heads, requests / segments, KV positions / pages,
pool region, tokens, the schedule, the LSE, output rows, runs), on the selftest cases that
expose it (mlacheck/backends/faults AXES is the fault's known footprint)."""

from __future__ import annotations

import pytest

from mlacheck.backends.faults import AXES, FAULTS, make
from mlacheck.harness import RunOptions, run_case
from mlacheck.matrices import load
from mlacheck.verdict import CRASH, FAIL

# The words each axis puts on the first line of the card.
AXIS_WORDS = {
    "heads": "heads ", "requests": "request", "segments": "segment", "kv": "KV positions",
    "pool": "pool region", "tokens": "tokens", "rows": "rows of", "all": "every",
    "lse": "LSE only", "schedule": "schedule:", "output": "output rows", "runs": "runs:",
}
SELFTEST = load("selftest").cases


def test_every_fault_has_a_known_axis() -> None:
    assert set(AXES) == set(FAULTS)
    assert set(AXES.values()) - {"crash"} <= set(AXIS_WORDS)


@pytest.mark.parametrize("name", sorted(n for n, a in AXES.items() if a != "crash"))
def test_first_line_of_the_card_names_the_faults_axis(name: str) -> None:
    spec = FAULTS[name]
    fault = make(name)
    opts = RunOptions(repeat=2 if spec.determinism else 1)
    for mc in (mc for mc in SELFTEST if mc.group in spec.groups):
        v = run_case(mc.case, fault, opts)
        if v.status == FAIL:
            break
    else:
        pytest.fail(f"{name}: no selftest case of {spec.groups} fails")
    first = v.summary().splitlines()[0]
    assert v.metrics.get("axis") == AXES[name], first
    assert AXIS_WORDS[AXES[name]] in first, first
    if name.startswith("page-id"):
        assert "page ids up to" in first and "past 2^16" in first, first


def test_a_crash_names_its_reason_instead() -> None:
    v = run_case(next(mc.case for mc in SELFTEST if mc.group == "decode-heads"
                      and mc.case.num_heads == 12), make("pad-heads-floor-div"))
    assert v.status == CRASH and v.reason


def test_a_paging_bug_points_at_the_last_page_not_at_heads() -> None:
    """Issue 16's example: fault:last-page-lens-one used to read `heads 0-1,4-5,...`."""
    mc = next(mc for mc in SELFTEST if mc.group == "decode-mixed" and mc.case.page_size == 16)
    first = run_case(mc.case, make("last-page-lens-one")).summary().splitlines()[0]
    assert "KV positions: request 0 attends to tokens 0..32 only" in first
    assert "(the last page, page id" in first and "heads" not in first.split(" -- ")[1][:60]
