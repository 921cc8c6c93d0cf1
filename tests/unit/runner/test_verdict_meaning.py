"""What a status means has one owner (mlacheck.verdict): the report's columns, the gate's
counts and the pytest outcome all read the same bucket, and no other module writes a
status test such as `status in (FAIL, CRASH)` out again (issue 31)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mlacheck import outcome
from mlacheck.report.summary import summarise
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
    bucket,
    executed,
    is_suite_error,
    kernel_failed,
)

ROOT = Path(__file__).resolve().parents[3]

# status, known rule -> bucket, kernel_failed, executed, is_suite_error
TABLE = [
    (PASS, False, PASS, False, True, False),
    (PASS, True, XPASS, False, True, False),
    (FAIL, False, FAIL, True, True, False),
    (FAIL, True, KNOWN, True, True, False),
    (CRASH, False, CRASH, True, True, False),
    (CRASH, True, KNOWN, True, True, False),
    (SKIP, False, SKIP, False, False, False),
    (SKIP, True, SKIP, False, False, False),
    (ERROR, False, ERROR, False, False, True),
    (ERROR, True, ERROR, False, False, True),
]


@pytest.mark.parametrize("status, known, want, failed, ran, suite", TABLE)
def test_one_meaning_per_status(status: str, known: bool, want: str, failed: bool, ran: bool,
                                suite: bool) -> None:
    v = Verdict("c", "b", "mla_decode", status, known_failure="finding" if known else "")
    assert (v.bucket, v.kernel_failed, v.executed, v.is_suite_error) == (want, failed, ran, suite)
    assert (bucket(status, known), kernel_failed(status), executed(status),
            is_suite_error(status)) == (want, failed, ran, suite)
    assert want in BUCKETS
    # the gate's lean record and the report's column read the same bucket
    assert outcome.Item("b", "mla_decode", "c", status, known=known).bucket == want
    assert summarise([v]).by_status == {want: 1}


def test_the_meaning_lives_in_the_verdict_not_in_its_json() -> None:
    v = Verdict("c", "b", "mla_decode", FAIL, known_failure="finding")
    assert not {"bucket", "kernel_failed", "executed", "is_suite_error"} & set(v.to_dict())


# `status in (FAIL, CRASH)`, `v.status not in (PASS, SKIP)`, `(FAIL, CRASH, ERROR)`, ...: the
# meaning of a status written out by hand
_STATUS_TUPLE = re.compile(r"\bin \(\s*(PASS|FAIL|CRASH|SKIP|ERROR|\"(PASS|FAIL|CRASH)\")\s*,")


def test_no_status_tests_outside_the_verdict_module() -> None:
    found = []
    for top in ("mlacheck", "ci", "benchmarks"):
        for p in sorted((ROOT / top).rglob("*.py")):
            if p.relative_to(ROOT).as_posix() == "mlacheck/verdict.py":
                continue
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                if _STATUS_TUPLE.search(line) and not line.strip().startswith("#"):
                    found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "ask mlacheck.verdict instead:\n" + "\n".join(found)
