"""Where a narrow (bf16) accumulator becomes visible: fault:narrow-accumulation vs KV length.

    python benchmarks/narrow_accumulation.py --seeds 8 --json narrow.json

The fault keeps the running P.V output in bf16 between 64-key tiles (the softmax sum in
fp32). For each kv length, a 16-head bf16 decode of one request (page size 16) runs under
seeds 0..N-1 through `run_case`; reported per length: how many seeds FAIL, and the worst
row error over the row bound (min / max over seeds). The length from which every seed FAILs
is boundaries.NARROW_ACCUMULATION_KV (docs/detection.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from mlacheck.backends.faults import make
from mlacheck.harness import run_case
from mlacheck.spec import DecodeCase, Request
from mlacheck.verdict import FAIL

KV_LENGTHS = (1024, 2048, 4096, 8192, 16384, 65537)


def measure(kv: int, seeds: int) -> dict[str, object]:
    fault = make("narrow-accumulation")
    ratios, caught = [], 0
    start = time.perf_counter()
    for seed in range(seeds):
        case = DecodeCase(requests=(Request(1, kv),), num_heads=16, page_size=16, seed=seed)
        v = run_case(case, fault)
        row = next(c for c in v.checks if c.name == "row_error")
        assert row.value is not None and row.bound
        ratios.append(row.value / row.bound)
        caught += v.status == FAIL
    return {"kv_len": kv, "seeds": seeds, "caught": caught, "ratio_min": min(ratios),
            "ratio_max": max(ratios), "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--kv", type=int, action="append", help="kv lengths (default: the table's)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    print("| kv_len | caught | ratio min | ratio max | seconds |\n|---|---|---|---|---|")
    for kv in args.kv or KV_LENGTHS:
        r = measure(kv, args.seeds)
        rows.append(r)
        print(f"| {kv} | {r['caught']}/{r['seeds']} | {r['ratio_min']:.2f} | "
              f"{r['ratio_max']:.2f} | {r['seconds']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
