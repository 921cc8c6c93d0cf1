"""False-alarm run: correct backends that differ from the baseline, over a matrix x N seeds.

    python benchmarks/false_alarms.py --matrix premerge --seeds 20 \
        --backend torch-split --backend torch-reverse --out false_alarms.jsonl

Prints seeds x cases and the failures found (expected: none). Results as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from mlacheck.backends.registry import resolve
from mlacheck.harness import RunOptions, run_case
from mlacheck.matrices import load
from mlacheck.verdict import FAIL, PASS, SKIP


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--matrix", default="premerge")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--backend", action="append", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="false_alarms.jsonl")
    p.add_argument("-m", dest="exclude_markers", action="append", default=["gpu", "large_kv"],
                   help="skip cases with these markers (default: gpu, large_kv)")
    a = p.parse_args(argv)
    backends = [resolve(b) for b in (a.backend or ["torch-split", "torch-reverse"])]
    counts = {PASS: 0, FAIL: 0, SKIP: 0, "CRASH": 0}
    worst_ratio = 0.0
    start = time.time()
    with open(a.out, "w") as out:
        for seed in range(a.seeds):
            cases = [mc.case for mc in load(a.matrix, seed).cases
                     if not set(mc.markers) & set(a.exclude_markers)]
            for b in backends:
                for c in cases:
                    v = run_case(c, b, RunOptions(a.device))
                    counts[v.status] += 1
                    if v.status == PASS and v.metrics.get("bound"):
                        worst_ratio = max(worst_ratio, v.metrics["worst_row"] / v.metrics["bound"])
                    if v.kernel_failed or v.is_suite_error:
                        print(v.summary(), flush=True)
                    rec = {k: x for k, x in v.to_dict().items() if k != "metrics"}
                    rec["metrics"] = {k: x for k, x in v.metrics.items() if k != "heatmap"}
                    out.write(json.dumps(rec, default=str) + "\n")
            print(f"seed {seed}: {counts} ({time.time() - start:.0f}s)", flush=True)
    print(f"{a.seeds} seeds x {len(cases)} cases x {len(backends)} backends: {counts}; "
          f"worst row/bound among PASS: {worst_ratio:.3f}")
    return 1 if counts[FAIL] or counts["CRASH"] else 0


if __name__ == "__main__":
    sys.exit(main())
