"""The documented findings in known_failures.yaml stay true and stay reproducible here."""

from __future__ import annotations

import re

import yaml

from mlacheck import harness, known
from mlacheck.backends.registry import resolve
from mlacheck.matrices import load
from mlacheck.spec import DecodeCase, Request


def test_every_known_failure_names_its_finding_and_a_registered_backend() -> None:
    table = yaml.safe_load(known.KNOWN_FAILURES_FILE.read_text())
    for backend, cases in table.items():
        resolve(backend)  # a typo in the backend name would hide nothing and match nothing
        for case_id, reason in cases.items():
            assert re.fullmatch(r"[a-z0-9.-]+-[0-9a-f]{8}", case_id), case_id
            assert re.search(r"docs/gpu-results\.md, finding \d", reason), reason


def test_folded_heads_kv_offset_finding_reproduces_on_the_model() -> None:
    """Finding 2's minimal case: the model of AITER's planner writes another request's tail
    length into kv_offset and the metadata validator fails the case; the output is right."""
    case = DecodeCase(requests=(Request(1, 700), Request(1, 900)), num_heads=32, page_size=16)
    assert known.lookup("aiter-model", case.id)
    v = harness.run_case(case, resolve("aiter-model"))
    assert v.status == "FAIL" and v.reason == "metadata", v.summary()
    meta = next(c for c in v.checks if c.name == "metadata")
    assert "kv_offset 128, expected 132 (tokens of request 1" in meta.detail


def test_nightly_case_of_finding_2_is_in_the_nightly_matrix() -> None:
    ids = {mc.case.id for mc in load("nightly").cases}
    assert "dec-b128-kv1000-32768-h128-p64-bf16-shuffled-7f65875f" in ids
