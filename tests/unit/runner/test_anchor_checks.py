"""benchmarks/anchor_checks.py: each anchor project's rule behaves as its source says, and the
side-by-side run judges the same outputs as mlacheck; benchmarks/false_alarms.py reports every
check's closest approach. (The measurements themselves: docs/detection.md.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import torch

from mlacheck.spec import DecodeCase, PrefillCase, Quant, Request, Segment

ROOT = Path(__file__).resolve().parents[3]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


A = _load("anchor_checks")
DEC = DecodeCase(requests=(Request(1, 40),), num_heads=16, page_size=16)
PRE = PrefillCase(segments=(Segment(8, 0),), num_heads=16)


def _seen(case, out, gold, base=None, lse=None):  # noqa: ANN001, ANN202
    n = out.shape[0]
    g_lse = torch.zeros(n)
    return A.Seen(case, out, gold, gold if base is None else base, lse, g_lse)


def test_assert_close_and_isclose_follow_torch() -> None:
    e = torch.tensor([1.0, 2.0, float("inf"), 0.0])
    a = torch.tensor([1.005, 2.0, float("inf"), 0.02])
    ok, _ = A.assert_close(a, e, atol=1e-2, rtol=1e-2)
    assert not ok  # 0.02 > 1e-2 + 0
    assert A.isclose_fraction(a, e, 1e-2, 1e-2) == 0.25
    ok, _ = A.assert_close(torch.tensor([float("nan")]), torch.tensor([1.0]), 1.0, 1.0)
    assert not ok
    torch.testing.assert_close(a[:3], e[:3], atol=1e-2, rtol=1e-2)  # the same verdict


def test_cos_diff_is_the_squared_distance_over_the_squared_norms() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)).double()
    assert abs(A.cos_diff(x, x * 1.001) - 1e-6 / (1 + 1.001**2)) < 1e-12


def test_kernelkit_wants_anomalies_in_the_same_places() -> None:
    ref = torch.tensor([1.0, float("-inf"), 2.0])
    assert A.check_is_allclose(ref.clone(), ref, 1e-6, 1e-3, 1e-7)[0]
    moved = torch.tensor([1.0, 2.0, float("-inf")])
    assert not A.check_is_allclose(moved, ref, 1e-6, 1e-3, 1e-7)[0]


def test_flashattention_rule_by_op() -> None:
    gold = torch.ones(4, 16, 8)
    base = gold + 0.01
    out = gold + 0.025  # 2.5x the baseline's largest error
    assert not A.flashattention(_seen(PRE, out, gold, base))[0]  # forward: 2x
    assert A.flashattention(_seen(DEC, out, gold, base))[0]  # decode with a KV cache: 3x


def test_aiter_triton_decode_allows_one_percent_of_elements() -> None:
    gold = torch.ones(10, 16, 8)
    out = gold.clone()
    out.view(-1)[:12] += 1.0  # 12 of 1280 elements (0.9%)
    assert A.aiter_triton(_seen(DEC, out.bfloat16(), gold))[0]
    assert not A.aiter_triton(_seen(PRE, out.bfloat16(), gold))[0]  # prefill: assert_close
    out.view(-1)[:14] += 1.0  # 1.1%
    assert not A.aiter_triton(_seen(DEC, out.bfloat16(), gold))[0]


def test_fp8_tolerances_apply_to_fp8_cases() -> None:
    fp8 = DecodeCase(requests=(Request(1, 40),), num_heads=16, page_size=16,
                     quant=Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax"))
    gold = torch.ones(4, 16, 8)
    out = (gold * 1.05).bfloat16()
    assert not A.flashinfer_trtllm(_seen(DEC, out, gold))[0]  # 1e-2
    assert A.flashinfer_trtllm(_seen(fp8, out, gold))[0]  # 1e-1


def test_side_by_side_run_judges_faults_and_correct_backends(tmp_path: Path) -> None:
    out = tmp_path / "a.jsonl"
    code = A.main(["-k", "dec-b1-kv300-h16-p16-bf16", "-b", "torch-split", "--faults",
                   "perturb-row,q-rope-scale", "--out", str(out)])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {r["backend"]: r for r in rows}
    assert by["torch-split"]["status"] == "PASS"
    assert by["fault:q-rope-scale"]["status"] == "FAIL"
    assert set(by["torch-split"]["rules"]) == set(A.RULES)
    assert not by["fault:q-rope-scale"]["rules"]["flashattention"][0]
    assert "| fault:perturb-row | 1 | 1 |" in A.table(rows)


def test_false_alarm_run_reports_each_checks_closest_approach(tmp_path: Path) -> None:
    fa = _load("false_alarms")
    summary = tmp_path / "s.json"
    code = fa.main(["--seeds", "1", "-k", "dec-b1-kv300-h16-p16-bf16", "-b", "torch-split",
                    "--out", str(tmp_path / "f.jsonl"), "--summary", str(summary)])
    assert code == 0
    data = json.loads(summary.read_text())
    checks = {c["check"]: c for c in data["checks"]}
    for name in ("row_error", "rms_error", "max_abs_error"):
        assert checks[name]["failed"] == 0 and 0 < checks[name]["closest"] < 1, checks[name]
    assert data["status"] == {"PASS": 1}


def test_false_alarm_table_from_earlier_records(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """--from reads anchor_checks lines (faults left out) and `mlacheck run` results lines
    (seed in the case); a FAIL that is not KNOWN makes the exit code 1."""
    fa = _load("false_alarms")
    anchors = tmp_path / "anchors.jsonl"
    anchors.write_text("\n".join(json.dumps(r) for r in (
        {"seed": 0, "case": "c1", "backend": "flashmla", "fault": False, "status": "PASS",
         "checks": {"rms_error": [True, 0.3, 1.0], "row_error": [True, 0.1, 1.0]}},
        {"seed": 0, "case": "c1", "backend": "fault:q-rope-scale", "fault": True,
         "status": "FAIL", "checks": {"rms_error": [False, 3.0, 1.0]}},
        {"seed": 1, "case": "c2", "backend": "aiter-triton", "fault": False, "status": "FAIL",
         "known": "finding-1", "checks": {"row_error": [False, 9.0, 1.0]}})) + "\n")
    assert fa.main(["--from", str(anchors)]) == 0
    text = capsys.readouterr().out
    assert "| rms_error | 0 | 0.300 | flashmla c1 seed 0 |" in text
    assert "'KNOWN': 1" in text and "row_error | 0 |" in text
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(
        {"case_id": "c3", "backend": "flashinfer", "op": "mla_decode", "status": "FAIL",
         "reason": "row_error", "case": {"seed": 4},
         "checks": [{"name": "max_abs_error", "passed": False, "value": 2.0, "bound": 1.0}]})
        + "\n")
    assert fa.main(["--from", str(anchors), str(results)]) == 1
    text = capsys.readouterr().out
    assert "FAIL flashinfer c3 (seed 4): row_error" in text
    assert "| max_abs_error | 1 |" in text


def test_indexer_cases_get_mlacheck_verdict_and_no_anchor_rule(tmp_path: Path) -> None:
    """The indexer's logits (no LSE) have no anchor rule; the H100 run of 2026-11-27 recorded
    'LogitsResult' object has no attribute 'lse' as an ERROR for each of them."""
    out = tmp_path / "a.jsonl"
    assert A.main(["-k", "idx-s1-q64-h32-d128-e4m3fn-", "-b", "torch", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["status"] == "PASS" and "rules" not in r for r in rows), rows
