"""Synthetic verdicts for the report tests: every status, with where, heat map and KNOWN."""

from __future__ import annotations

import json
from pathlib import Path

from mlacheck.verdict import CRASH, FAIL, PASS, SKIP, Check, Verdict, Where
from mlacheck.verdict import Verdict as RecordedVerdict

PAGE_REASON = "page size 1 not in {16, 64}"
HEADS_REASON = "num_heads 8 not in {16, 128}"
KNOWN_REASON = "AITER fp8 ASM prefill: multi-segment varlen faults (issue 1234)"
FAIL_ID = "dec-b2-kv512-h16-p16-fp8_e4m3fn-unit-shuffled-deadbeef"
CRASH_ID = "pf-s3-q96-h16-e4m3fn-amax-causal-cafef00d"


def _case(kind: str, kv: str, heads: int = 16) -> dict:
    return {
        "kind": kind,
        "num_heads": heads,
        "page_size": 16,
        "quant": {"q": kv, "kv": kv, "scale": "amax", "per_token": False},
    }


def passing(
    i: int, kv: str = "bf16", ratio: float = 0.3, backend: str = "aiter", op: str = "mla_decode"
) -> Verdict:
    bound = 0.008
    return Verdict(
        f"dec-pass{i}-{kv}",
        backend,
        op,
        PASS,
        checks=[Check("row_error", True, ratio * bound, bound)],
        metrics={"worst_row": ratio * bound, "bound": bound, "rows": 32},
        case=_case("decode", kv),
        timings={
            "inputs": 0.01,
            "kernel": 0.002,
            "golden": 0.05,
            "baseline": 0.004,
            "judge": 0.001,
        },
    )


def failing() -> Verdict:
    """Request 1, tokens 0-3, heads 2-3 wrong (pages 7, 9 above 2^31): what judge localises."""
    bound = 0.0625
    heat = [[0.01] * 16 for _ in range(8)]
    for t in range(4, 8):
        heat[t][2] = heat[t][3] = 0.9
    heat[7][5] = 1e30  # a non-finite row, as mlacheck.heatmap writes it
    where = [
        Where(
            "row_error",
            1,
            (4, 7),
            (0, 3),
            [2, 3],
            0.9,
            bound,
            pages=[7, 9],
            bytes=(0x80000000, 0x80012000),
            region="above 2^31",
        ),
        Where("nonfinite", 1, (7, 7), (3, 3), [5], float("inf"), 0.0, pages=[7, 9]),
    ]
    return Verdict(
        FAIL_ID,
        "aiter",
        "mla_decode",
        FAIL,
        reason="nonfinite, row_error",
        checks=[
            Check("nonfinite", False, 1.0, 0.0, "1 rows NaN/Inf where the golden is finite"),
            Check("row_error", False, 0.9, bound, "8 of 128 rows"),
            Check("tensor_rel_l2", True, 0.01, 0.02),
        ],
        where=where,
        metrics={
            "worst_row": 0.9,
            "bound": bound,
            "rows": 128,
            "heatmap": heat,
            "tensor_rel_l2": 0.2,
            "max_abs": 3.0,
        },
        case=_case("decode", "fp8_e4m3fn"),
        timings={"inputs": 0.02, "kernel": 0.5, "golden": 0.1, "baseline": 0.01, "judge": 0.003},
    )


def crashing() -> Verdict:
    return Verdict(
        CRASH_ID,
        "aiter",
        "mla_prefill",
        CRASH,
        reason="RuntimeError: HIP error: invalid device function",
        metrics={"traceback": "Traceback (most recent call last):\n  RuntimeError: HIP error"},
        case=_case("prefill", "fp8_e4m3fn"),
        timings={"inputs": 0.01},
    )


def skipped(i: int, reason: str, op: str = "mla_decode") -> Verdict:
    return Verdict(
        f"dec-skip{i}-p1", "aiter", op, SKIP, reason=reason, case=_case("decode", "bf16")
    )


def known() -> RecordedVerdict:
    return RecordedVerdict(
        "pf-s4-q128-h16-e4m3fn-unit-causal-0badc0de",
        "aiter",
        "mla_prefill",
        FAIL,
        reason="row_error",
        known_failure=KNOWN_REASON,
        checks=[Check("row_error", False, 0.5, 0.1)],
        metrics={"worst_row": 0.5, "bound": 0.1, "rows": 64},
        case=_case("prefill", "fp8_e4m3fn"),
    )


def run_verdicts() -> list[Verdict]:
    """20 PASS (10 bf16 aiter decode, 5 fp8 aiter decode, 5 bf16 torch prefill), 1 FAIL,
    1 CRASH, 12 + 3 SKIP (two reasons), 1 KNOWN."""
    vs: list[Verdict] = [passing(i, "bf16", 0.1 + 0.05 * i) for i in range(10)]
    vs += [passing(10 + i, "fp8_e4m3fn", 0.5) for i in range(5)]
    vs += [passing(20 + i, "bf16", 0.2, backend="torch", op="mla_prefill") for i in range(5)]
    vs += [failing(), crashing(), known()]
    vs += [skipped(i, PAGE_REASON) for i in range(12)]
    vs += [skipped(100 + i, HEADS_REASON, op="mla_prefill") for i in range(3)]
    return vs


def write_jsonl(path: Path, verdicts: list[Verdict], truncated: bool = True) -> Path:
    """One Verdict.to_dict() per line, as the plugin writes; known_failure as a top-level key;
    a dead run's truncated last line (cut inside a multi-byte character) when `truncated`."""
    lines = []
    for v in verdicts:
        d = json.loads(v.to_json())
        if not v.known_failure:
            d.pop("known_failure")
        lines.append(json.dumps(d))
    text = "\n".join(lines) + "\n"
    data = text.encode()
    if truncated:
        half = json.dumps({**json.loads(lines[0]), "reason": "ünïcode"}, ensure_ascii=False)
        half = half.encode()
        data += half[: half.index("ü".encode()) + 1]  # ends mid-character
    path.write_bytes(data)
    return path
