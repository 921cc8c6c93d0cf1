"""The judge owns every part of a verdict: the known-failure label and the implementation
record are set by judge functions, the harness only passes them what it collected."""

from __future__ import annotations

import torch

from mlacheck import judge, known
from mlacheck.verdict import CRASH, ERROR, FAIL, PASS, SKIP, Verdict


def test_known_label_only_on_verdicts_about_the_kernel() -> None:
    rule = known.RULES[0]
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
