"""The judge owns every part of a verdict: the known-failure label and the implementation
record are set by judge functions, the harness only passes them what it collected."""

from __future__ import annotations

import torch

from mlacheck import judge, known
from mlacheck.verdict import CRASH, ERROR, FAIL, PASS, SKIP, Verdict


def test_known_label_only_on_verdicts_about_the_kernel() -> None:
    rule = next(r for r in known.RULES if set(r.fails_as) == {FAIL, CRASH})
    case = rule.minimal_case
    for status in (PASS, FAIL, CRASH, SKIP, ERROR):
        v = judge.with_known_label(Verdict(case.id, rule.backends[0], case.op, status), case)
        labelled = status in (PASS, FAIL, CRASH)
        assert (v.known_rule, v.known_failure) == (
            (rule.name, rule.finding) if labelled else ("", "")), status
    other = judge.with_known_label(Verdict(case.id, "torch", case.op, FAIL), case)
    assert other.known_rule == ""


def test_implementation_record_keeps_what_ran_and_the_small_reported_part() -> None:
    ran = {"torch": "2.x", "version": "lib 1.0"}
    metadata = {
        "kernel": "fa2", "calls": 3, "nested": {"a": [1, 2], "t": torch.zeros(2)},
        "schedule": torch.zeros(4), "long": list(range(17)),
        "validation": ["a problem"], "validation_note": "a note",  # the judge's own inputs
        "version": "reported",
    }
    record = judge.implementation_record(ran, metadata)
    assert record == {"torch": "2.x", "version": "reported", "kernel": "fa2", "calls": 3,
                      "nested": {"a": [1, 2]}}


def test_a_failure_of_another_kind_than_the_rule_documents_stays_unknown() -> None:
    """Finding 1 is a FAIL (NaN rows); a CRASH on a case it matches is another bug (on the
    H100 an out-of-shared-memory compile error was labelled with it)."""
    rule = next(r for r in known.RULES if r.name == "aiter-triton-partial-page-tail")
    case = rule.minimal_case
    crash = judge.with_known_label(Verdict(case.id, "aiter-triton", case.op, CRASH), case)
    fail = judge.with_known_label(Verdict(case.id, "aiter-triton", case.op, FAIL), case)
    assert crash.known_rule == "" and fail.known_rule == rule.name


def test_every_rule_documents_how_it_fails() -> None:
    for rule in known.RULES:
        assert rule.fails_as and set(rule.fails_as) <= {FAIL, CRASH}, rule.name
        assert CRASH in rule.fails_as or not rule.can_end_the_worker, rule.name
