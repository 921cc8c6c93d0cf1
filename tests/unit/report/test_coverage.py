"""The coverage table: executed / SKIP by kernel limit / by adapter / by machine, per backend x
version x op, from results files."""

from __future__ import annotations

import json
from pathlib import Path

from mlacheck.backends.base import adapter_choice
from mlacheck.report import coverage
from mlacheck.report.cli import main as report_main
from mlacheck.verdict import Verdict


def _v(status: str, reason: str = "", op: str = "mla_decode", version: str = "lib 1.0",
       known: str = "") -> Verdict:
    return Verdict(case_id=f"c{hash((status, reason, op, version)) % 10**6}", backend="fake",
                   op=op, status=status, reason=reason, known_failure=known,
                   implementation={"version": version})


VERDICTS = [
    _v("PASS"), _v("FAIL", known="documented"), _v("CRASH"),
    _v("SKIP", "page size 1 not in {16, 32} (tl.dot needs >= 16)"),
    _v("SKIP", "q format fp8_e4m3fn not in {bf16} (" + adapter_choice("FP8 not wired") + ")"),
    _v("SKIP", "does not provide op paged_prefill", op="paged_prefill"),
    _v("SKIP", "lib.f has no parameter 'x' (renamed or removed)"),
    _v("SKIP", "unavailable: lib not installed"),
    _v("SKIP", "case needs 90 GB, more than 85% of the free memory"),
    _v("ERROR", "building inputs failed"),
    _v("PASS", version="lib 2.0"),
]


def test_each_verdict_lands_in_its_column() -> None:
    cov = coverage.coverage(VERDICTS)
    one = cov.counts[("fake", "lib 1.0", "mla_decode")]
    assert one == {"executed": 3, "kernel limit": 1, "adapter": 2, "machine": 2,
                   "suite error": 1}
    assert cov.counts[("fake", "lib 1.0", "paged_prefill")] == {"adapter": 1}
    assert cov.counts[("fake", "lib 2.0", "mla_decode")] == {"executed": 1}  # versions apart


def test_markdown_lists_counts_and_every_skip_reason_with_its_class() -> None:
    text = coverage.markdown(coverage.coverage(VERDICTS), ["r.jsonl"])
    assert "| fake | lib 1.0 | mla_decode | 3 / 9 | 1 | 2 | 2 | 1 |" in text
    assert "[kernel limit] x1: page size 1 not in {16, 32} (tl.dot needs >= 16)" in text
    assert "[adapter] x1: does not provide op paged_prefill" in text


def test_one_command_from_results_files(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(v.to_dict()) + "\n" for v in VERDICTS[:5]))
    b.write_text("".join(json.dumps(v.to_dict()) + "\n" for v in VERDICTS[5:]))
    out = tmp_path / "coverage.md"
    assert report_main(["--coverage", str(a), str(b), "-o", str(out)]) == 0
    assert "| fake | lib 1.0 | mla_decode | 3 / 9 |" in out.read_text()
    assert coverage.main([str(tmp_path / "missing.jsonl")]) == 2
