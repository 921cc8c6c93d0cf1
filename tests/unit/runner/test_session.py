"""The run model (mlacheck.session): one request parsed once, one outcome every driver takes
its exit code from (issue 31)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlacheck import outcome as gate
from mlacheck.errors import UsageError
from mlacheck.results import HEADER_KEY
from mlacheck.session import PYTEST_OUTCOMES, RunRequest, outcome, parse_ops, pytest_outcome
from mlacheck.verdict import BUCKETS, CRASH, ERROR, FAIL, KNOWN, PASS, SKIP, XPASS, Verdict


def test_the_request_is_parsed_once_backends_split_and_deduplicated() -> None:
    r = RunRequest.parse(backends=["torch,aiter", "torch", " aiter-model "],
                         require_ops="mla_decode, mla_prefill,mla_decode", min_executed=0.5)
    assert r.backends == ("torch", "aiter", "aiter-model")
    assert r.policy == gate.CoveragePolicy(("mla_decode", "mla_prefill"), 0.5, False)
    assert RunRequest.parse(default_backends=("a", "b")).backends == ("a", "b")
    assert RunRequest.parse(backends="x,y").backends == ("x", "y")  # replay's single string


@pytest.mark.parametrize("kwargs, message", [
    ({"require_ops": "mla_nonsense"}, "--require-ops: unknown op 'mla_nonsense'"),
    ({"min_executed": 1.5}, "--min-executed must be a fraction in 0..1"),
    ({"min_executed": -0.1, "flag_prefix": "--mla-"}, "--mla-min-executed must be"),
])
def test_a_bad_request_is_a_usage_error(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        RunRequest.parse(**kwargs)


def test_one_ops_parser() -> None:
    assert parse_ops("") == () and parse_ops(None) == ()
    assert parse_ops(["mla_decode,paged_prefill"]) == ("mla_decode", "paged_prefill")


def test_two_spellings_of_one_backend_run_once_under_its_name() -> None:
    names = {"torch": "torch", "mlacheck.backends.torch_ref:factory": "torch", "aiter": "aiter"}
    r = RunRequest.parse(backends=["torch", "mlacheck.backends.torch_ref:factory", "aiter"])
    r = r.resolved(names.__getitem__)
    assert r.backends == ("torch", "aiter") and r.names == ("torch", "aiter")


def _line(backend: str, case_id: str, status: str, known: str = "") -> str:
    return json.dumps({"backend": backend, "case_id": case_id, "op": "mla_decode",
                       "status": status, "reason": "why" if status == SKIP else "",
                       "known_failure": known, "checks": [], "where": []})


def _header(*expected: tuple[str, str]) -> str:
    return json.dumps({HEADER_KEY: 2, "run": {"expected": [list(k) for k in expected]}})


def test_outcome_of_a_file_of_shards_and_of_verdicts_in_memory(tmp_path: Path) -> None:
    torch = RunRequest(backends=("torch",))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join([_header(("torch", "c0"), ("torch", "c1")),
                            _line("torch", "c0", PASS)]) + "\n")
    b.write_text("\n".join([_header(("torch", "c1")), _line("torch", "c1", FAIL)]) + "\n")
    assert outcome(a, torch).code == gate.EXIT_NOT_ENOUGH_RAN  # c1 missing
    merged = outcome([a, b], torch)  # the shards of one run
    assert merged.code == gate.EXIT_KERNEL_FAILURE and merged.recorded == merged.expected == 2
    assert merged.counts == {PASS: 1, FAIL: 1} and merged.coverage[("torch", "mla_decode")].executed == 2
    mem = [Verdict("c0", "torch", "mla_decode", PASS), Verdict("c1", "torch", "mla_decode", SKIP)]
    assert outcome(mem, torch).code == gate.EXIT_OK
    assert outcome(mem, RunRequest(backends=("torch", "aiter"))).code == gate.EXIT_NOT_ENOUGH_RAN
    known = Verdict("c0", "torch", "mla_decode", FAIL, known_failure="finding")
    assert outcome([known], torch).code == gate.EXIT_OK  # KNOWN
    assert outcome([Verdict("c0", "torch", "mla_decode", PASS, known_failure="f")],
                   torch).code == gate.EXIT_KERNEL_FAILURE  # strict XPASS


def test_interrupted_internal_error_and_nothing_selected(tmp_path: Path) -> None:
    torch = RunRequest(backends=("torch",))
    res = tmp_path / "r.jsonl"
    res.write_text(_line("torch", "c0", PASS) + "\n")
    out = outcome(res, torch, interrupted=True)
    assert out.code == gate.EXIT_NOT_ENOUGH_RAN and out.lines[-1].startswith(
        "INCOMPLETE: the run was interrupted")
    res.write_text(_line("torch", "c0", FAIL) + "\n")
    assert outcome(res, torch, interrupted=True).code == gate.EXIT_KERNEL_FAILURE  # a FAIL wins
    assert outcome(res, torch, internal_error=True).code == gate.EXIT_INTERNAL_ERROR
    assert outcome(tmp_path / "none.jsonl", torch).code == gate.EXIT_NOTHING_COLLECTED
    assert outcome([], torch, interrupted=True).code == gate.EXIT_NOT_ENOUGH_RAN
    # verdicts in memory (replay, selftest): a requested backend that gave none ran nothing
    assert outcome([], torch).code == gate.EXIT_NOT_ENOUGH_RAN
    out = outcome(res, torch)
    assert out.reason == "1 FAIL, 0 CRASH" and out.word == "FAIL"
    assert outcome([Verdict("c0", "torch", "mla_decode", PASS)], torch).reason == (
        gate.exit_meaning(gate.EXIT_OK))


def test_one_table_from_bucket_to_pytest_outcome() -> None:
    assert set(PYTEST_OUTCOMES) == set(BUCKETS)
    assert [pytest_outcome(b) for b in (PASS, SKIP, KNOWN, FAIL, CRASH, ERROR, XPASS)] == [
        "passed", "skipped", "xfailed", "failed", "failed", "failed", "failed"]
    assert pytest_outcome(XPASS, allow_xpass=True) == "passed"
    assert pytest_outcome("SOMETHING NEW") == "failed"  # never a silent pass


def test_every_exit_code_has_one_meaning() -> None:
    codes = [getattr(gate, n) for n in dir(gate) if n.startswith("EXIT_") and n != "EXIT_MEANINGS"]
    assert set(codes) == set(gate.EXIT_MEANINGS)


def test_the_run_model_imports_neither_torch_nor_pytest() -> None:
    code = ("import sys, mlacheck.session, mlacheck.outcome; "
            "print(sorted(m for m in ('torch', 'pytest') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
