"""How far mlacheck.cost's kernel estimate is from the kernel times a GPU run measured, per
(backend, op): the table cost.KERNEL_CALIBRATION holds.

    python benchmarks/calibrate_cost.py RESULTS.jsonl [--matrix nightly] [--seed 0]

RESULTS.jsonl: an `mlacheck run` results file from a GPU (each verdict's timings['kernel']).
Per (backend, op) the median of measured / estimated kernel seconds over the items whose
estimate is at least MIN_ESTIMATE_S (tiny items measure launch overheads, not the work), where
at least MIN_ITEMS such items ran. The estimate's FLOP rate misses per-call and per-token
work (Python models of a kernel's schedule, a launch per request): the ranking of the longest
cases, which orders a run and balances its shards, needs these factors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from mlacheck import cost
from mlacheck.matrices import load
from mlacheck.verdict import executed

MIN_ESTIMATE_S = 1e-4
MIN_ITEMS = 3


def ratios(results: str, matrix: str, seed: int) -> dict[tuple[str, str], list[float]]:
    cases = {mc.case.id: mc.case for mc in load(matrix, seed).cases}
    got: dict[tuple[str, str], list[float]] = defaultdict(list)
    for line in Path(results).read_text().splitlines():
        rec = json.loads(line)
        kernel = (rec.get("timings") or {}).get("kernel")
        case = cases.get(rec.get("case_id", ""))
        # a kernel that ran to its end (a CRASH has no kernel time)
        if kernel is None or case is None or not executed(rec.get("status", "")):
            continue
        est = cost.kernel_s(case, rec["backend"], "cuda", calibrated=False)
        if est >= MIN_ESTIMATE_S:
            got[(rec["backend"], str(case.op))].append(kernel / est)
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("--matrix", default="nightly")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    table = {k: round(statistics.median(v), 1) for k, v in sorted(ratios(a.results, a.matrix, a.seed).items())
             if len(v) >= MIN_ITEMS}
    for (backend, op), factor in table.items():
        print(f"    ({backend!r}, Op({op!r})): {factor},")
    return 0


if __name__ == "__main__":
    sys.exit(main())
