"""Measure what a backend's kernels really take: run probe cases with its capabilities lifted.

A new backend declares its capabilities as data (mlacheck.backends.base.Capability); this
script is how they are measured instead of guessed: each probe case varies one feature
(page size, head count, format, MTP, empty requests, long kv, pools past 2^31, ...) of a
small base case and runs through the full harness with the backend's capability checks
replaced by "anything", so a PASS says the kernel handles it, a CRASH says it refuses it
(with the library's message), and a FAIL is a discrepancy to investigate.

    python3 benchmarks/capability_probe.py --backend flashinfer --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from mlacheck.backends.base import Capability
from mlacheck.backends.registry import resolve
from mlacheck.harness import RunOptions, run_case
from mlacheck.spec import (
    Case,
    DecodeCase,
    Placement,
    PrefillCase,
    Quant,
    Request,
    Segment,
)

DECODE_BASE = DecodeCase(requests=(Request(1, 300), Request(1, 77)), num_heads=16, page_size=64)
PREFILL_BASE = PrefillCase(segments=(Segment(48, 0), Segment(33, 17)), num_heads=16)
FN = Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax")


def decode_probes() -> dict[str, Case]:
    r = dataclasses.replace
    probes: dict[str, Case] = {"base": DECODE_BASE}
    probes |= {f"page{p}": r(DECODE_BASE, page_size=p) for p in (1, 16, 32, 128, 1024)}
    probes |= {f"heads{h}": r(DECODE_BASE, num_heads=h) for h in (8, 12, 24, 32, 64, 128)}
    probes |= {
        "fp16": r(DECODE_BASE, quant=Quant("fp16", "fp16")),
        "fp8-amax": r(DECODE_BASE, quant=FN),
        "fp8-unit": r(DECODE_BASE, quant=Quant("fp8_e4m3fn", "fp8_e4m3fn", "unit")),
        "bf16-q-fp8-kv": r(DECODE_BASE, quant=Quant("bf16", "fp8_e4m3fn", "amax")),
        "mtp-uniform": r(DECODE_BASE, requests=(Request(2, 64), Request(2, 200))),
        "mtp-mixed": r(DECODE_BASE, requests=(Request(2, 64), Request(3, 200))),
        "empty-requests": r(DECODE_BASE, requests=(Request(0, 0), Request(1, 70),
                                                   Request(0, 40), Request(1, 33))),
        "long-kv": r(DECODE_BASE, requests=(Request(1, 98305),)),
        "batch128": r(DECODE_BASE, requests=tuple(Request(1, 33 + 7 * i) for i in range(128))),
        "sentinel-tail": r(DECODE_BASE, placement=Placement(tail_poison="sentinel")),
        "pool-2^31": r(DECODE_BASE, placement=Placement("high", offset_bytes=1 << 31)),
        "pool-2^32": r(DECODE_BASE, placement=Placement("high", offset_bytes=1 << 32)),
    }
    return probes


def prefill_probes() -> dict[str, Case]:
    r = dataclasses.replace
    return {
        "base": PREFILL_BASE,
        "non-causal": r(PREFILL_BASE, causal=False),
        "fp16": r(PREFILL_BASE, quant=Quant("fp16", "fp16")),
        "fp8-amax": r(PREFILL_BASE, quant=FN),
        "soft-cap": r(PREFILL_BASE, soft_cap=30.0),
        "heads8": r(PREFILL_BASE, num_heads=8),
        "heads12": r(PREFILL_BASE, num_heads=12),
        "heads128": r(PREFILL_BASE, num_heads=128),
        "empty-segment": r(PREFILL_BASE, segments=(Segment(0, 20), Segment(12, 5),
                                                   Segment(7, 9))),
        "one-token-segment": r(PREFILL_BASE, segments=(Segment(40, 0), Segment(1, 256))),
        "long": r(PREFILL_BASE, segments=(Segment(1024, 3072),)),
    }


class _Lifted:
    """The backend with its capability checks replaced by 'anything on this device'."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, inner.name

    def unavailable(self) -> str | None:
        return self.inner.unavailable()

    def capabilities(self) -> dict[str, Capability]:
        return {op: Capability(soft_cap=True, per_token_scales=True, empty_requests=True)
                for op in self.inner.capabilities()}

    def run(self, case: Case, inputs: Any) -> Any:
        return self.inner.run(case, inputs)


def probe(backend_name: str, device: str) -> list[dict[str, Any]]:
    inner = resolve(backend_name)
    why = inner.unavailable()
    if why:
        return [{"backend": backend_name, "probe": "-", "status": "UNAVAILABLE", "reason": why}]
    lifted, ops = _Lifted(inner), set(inner.capabilities())
    rows = []
    for kind, probes in (("mla_decode", decode_probes()), ("mla_prefill", prefill_probes())):
        if kind not in ops:
            continue
        for label, case in probes.items():
            start = time.perf_counter()
            v = run_case(case, lifted, RunOptions(device))
            declared = inner.capabilities()[case.op].why_not(case, device)
            rows.append({"backend": backend_name, "op": case.op, "probe": label,
                         "case": case.id, "status": v.status,
                         "reason": (v.diagnosis or v.reason)[:300],
                         "declared_skip": declared, "seconds": time.perf_counter() - start})
            print(f"{backend_name:16s} {case.op:11s} {label:18s} {v.status:5s} "
                  f"{'(declared SKIP: ' + declared + ')' if declared else ''} {v.reason[:160]}",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", action="append", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [row for b in args.backend for row in probe(b, args.device)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
