"""Sensitivity of the judge: the smallest single-row and whole-tensor relative perturbation it
catches, per input format and op, over N seeds, and the false-alarm rate of correct backends
on the same cases.

    python benchmarks/sensitivity.py --seeds 20 --json sensitivity.json
    python benchmarks/sensitivity.py --seeds 20 --mode tensor --json sensitivity-tensor.json

For each (op, format) the representative case below is built under seeds 0..N-1. The fault
is `fault:perturb-row` (mlacheck.backends.faults.generic.PerturbRow): the correct `torch`
output with one (token, head) row, drawn from the case's seed, scaled by (1 + delta), i.e. a
relative L2 error of delta on that row. Per seed the inputs, the correct output, the goldens
and the baseline are computed once; a bisection over delta then asks the judge
(mlacheck.judge.verdict, exactly what run_case calls) whether the perturbed output FAILs.
Reported: the smallest delta caught in ALL seeds (= the largest per-seed threshold), the
median per-seed threshold, the row bound the judge used (median), and, at the same judge
settings, the FAIL count of the correct backends torch-split, torch-reverse, torch-lazy,
torch-normalised and aiter-model
over the same seeded cases (SKIP where a backend does not take the case).

`--mode tensor` scales EVERY row by (1 + delta) instead (a systematic error: each row's
error is delta). Each threshold is measured twice: with every check of the judge ("after"),
and counting only the checks the judge had before the rows were judged together ("before":
a FAIL of rms_error / max_abs_error alone does not count).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import torch

from mlacheck import golden, judge
from mlacheck import inputs as inputs_mod
from mlacheck.backends.base import Output
from mlacheck.backends.faults.generic import PerturbRow
from mlacheck.backends.registry import resolve
from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.harness import BASELINE, RunOptions, run_case
from mlacheck.harness import _baseline as baseline_family
from mlacheck.spec import Case, DecodeCase, PrefillCase, Quant, Request, Segment, SparseDecodeCase
from mlacheck.verdict import FAIL, PASS, SKIP

FORMATS = ("bf16", "fp16", "fp8_e4m3fn", "fp8_e4m3fnuz")
TARGETS = {"bf16": 0.02, "fp16": 0.02, "fp8_e4m3fn": 0.10, "fp8_e4m3fnuz": 0.10}
CORRECT = ("torch-split", "torch-reverse", "torch-lazy", "torch-normalised", "aiter-model")
# Representative cases: the smoke matrix's shapes (a two-segment prefill with context, a
# ragged decode batch with a partial, a full and a multi-page request, a sparse batch with
# fewer valid indices than topk).
BASES: dict[str, Case] = {
    "mla_prefill": PrefillCase(segments=(Segment(48, 0), Segment(33, 17)), num_heads=16),
    "mla_decode": DecodeCase(requests=(Request(1, 37), Request(1, 300), Request(1, 129),
                                       Request(2, 64)), num_heads=16, page_size=16),
    "mla_sparse_decode": SparseDecodeCase(requests=(Request(1, 300), Request(2, 90)), topk=128,
                                          num_heads=16, page_size=16),
}
DELTA_HI = 1.0
BISECT_STEPS = 14  # relative resolution 2^-14 of [0, 1] on a log-free scale is plenty
# The checks added to judge the rows together (docs/detection.md "Anchor rules"): left out,
# the judge is the one before them.
ROWS_TOGETHER = frozenset({"rms_error", "max_abs_error"})


def case_for(op: str, fmt: str, seed: int) -> Case:
    base = BASES[op]
    return dataclasses.replace(base, quant=Quant(fmt, fmt, "amax"), seed=seed)


def _prepared(case: Case) -> dict[str, Any]:
    """Inputs, the correct torch output, the goldens and the baseline of one case."""
    inp = inputs_mod.build(case, "cpu")
    out = TorchBackend().run(case, inp)
    res = Output(out.out.clone(), None if out.lse is None else out.lse.clone())
    gold = golden.reference(inp, "exact")
    ideal = golden.reference(inp, "ideal")
    assert type(BASELINE) is TorchBackend  # the baseline IS the unperturbed torch output
    return {"inputs": inp, "out": res, "gold": gold, "ideal": ideal,
            "baseline": baseline_family(case, inp)}  # the product's own (harness)


def _caught(case: Case, prep: dict[str, Any], delta: float, fault: PerturbRow,
            mode: str = "row", ignored: frozenset[str] = frozenset()) -> tuple[bool, float]:
    out = prep["out"]
    o = out.out.clone()
    if mode == "tensor":
        o = (o.float() * (1.0 + delta)).to(o.dtype)
    else:
        t, h = fault.row(case, o)
        o[t, h] = (o[t, h].float() * (1.0 + delta)).to(o.dtype)
    v = judge.verdict(case, prep["inputs"], Output(o, out.lse), prep["gold"], prep["baseline"],
                      prep["ideal"], "fault:perturb-row")
    counted = {c.name for c in v.failed_checks} - ignored
    return v.status == FAIL and bool(counted), float(v.metrics.get("bound", float("nan")))


def threshold(case: Case, prep: dict[str, Any], fault: PerturbRow, mode: str = "row",
              ignored: frozenset[str] = frozenset()) -> tuple[float, float]:
    """(smallest delta the judge catches on this case, the row bound), by bisection."""
    lo, hi = 0.0, DELTA_HI
    ok, bound = _caught(case, prep, hi, fault, mode, ignored)
    if not ok:
        return float("inf"), bound
    if _caught(case, prep, 0.0, fault, mode, ignored)[0]:
        return 0.0, bound  # the unperturbed output fails: a false alarm, reported as such
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        if _caught(case, prep, mid, fault, mode, ignored)[0]:
            hi = mid
        else:
            lo = mid
    return hi, bound


def measure(op: str, fmt: str, seeds: int, correct: list[Any], mode: str = "row"
            ) -> dict[str, Any]:
    fault = PerturbRow(TorchBackend(), "fault:perturb-row")
    per_seed, bounds, before = [], [], []
    alarms: dict[str, dict[str, int]] = {b.name: {PASS: 0, FAIL: 0, SKIP: 0, "CRASH": 0}
                                         for b in correct}
    for seed in range(seeds):
        case = case_for(op, fmt, seed)
        prep = _prepared(case)
        d, bound = threshold(case, prep, fault, mode)
        per_seed.append(d)
        bounds.append(bound)
        before.append(threshold(case, prep, fault, mode, ROWS_TOGETHER)[0])
        del prep
        for b in correct:
            v = run_case(case, b, RunOptions())
            alarms[b.name][v.status] += 1
    finite = [d for d in per_seed if d != float("inf")]
    return {
        "op": op, "format": fmt, "seeds": seeds,
        "delta_all_seeds": max(per_seed) if per_seed else float("nan"),
        "delta_median": statistics.median(finite) if finite else float("nan"),
        "delta_per_seed": per_seed,
        "mode": mode,
        "before_all_seeds": max(before) if before else float("nan"),
        "before_per_seed": before,
        "bound_median": statistics.median(bounds),
        "target": TARGETS[fmt],
        "met": max(per_seed) <= TARGETS[fmt],
        "false_alarms": alarms,
    }


def _fa(alarms: dict[str, dict[str, int]]) -> str:
    parts = []
    for name, c in alarms.items():
        ran = c[PASS] + c[FAIL] + c["CRASH"]
        parts.append(f"{name} {c[FAIL] + c['CRASH']}/{ran}" if ran else f"{name} n/a (SKIP)")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--op", action="append", choices=tuple(BASES), default=None)
    p.add_argument("--format", action="append", choices=FORMATS, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", choices=("row", "tensor"), default="row",
                   help="perturb one row (default) or every row")
    p.add_argument("--no-false-alarms", action="store_true",
                   help="skip the correct backends' runs (thresholds only)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    correct = [] if a.no_false_alarms else [resolve(n) for n in CORRECT]
    rows = []
    start = time.time()
    print(f"{a.mode} perturbation")
    print("| op | format | delta caught in all seeds | median per-seed | before (all seeds) | "
          "row bound (median) | target | met | false alarms (FAIL/run) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for op in a.op or list(BASES):
        for fmt in a.format or list(FORMATS):
            r = measure(op, fmt, a.seeds, correct, a.mode)
            rows.append(r)
            print(f"| {op} | {fmt} | {r['delta_all_seeds']:.4f} | {r['delta_median']:.4f} | "
                  f"{r['before_all_seeds']:.4f} | {r['bound_median']:.4f} | {r['target']:.2f} | "
                  f"{'yes' if r['met'] else 'NO'} | {_fa(r['false_alarms'])} |", flush=True)
    print(f"({time.time() - start:.0f}s, {a.seeds} seeds)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"seeds": a.seeds, "rows": rows, "cases": {
                op: json.loads(BASES[op].to_json()) for op in BASES}}, f, indent=1)
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
