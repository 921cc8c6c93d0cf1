"""False-alarm run: correct backends that differ from the baseline, over a matrix x N seeds.

    python benchmarks/false_alarms.py --matrix premerge --seeds 20 \
        --backend torch-split --backend torch-reverse --backend torch-lazy \
        --backend torch-normalised --out false_alarms.jsonl
    python benchmarks/false_alarms.py --seeds 20 --distribution layer --distribution ties \
        --jobs 16                                  # every case under each input distribution

Prints seeds x cases and the failures found (expected: none). Results as JSON lines.
`--distribution` runs every case under that input distribution (mlacheck/distributions.py)
instead of its own; `--jobs` spreads the runs over processes (one CPU thread each).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from typing import Any

DEFAULT_BACKENDS = ["torch-split", "torch-reverse", "torch-lazy", "torch-normalised"]


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


@lru_cache(maxsize=4)
def _matrix(name: str, seed: int) -> Any:
    """A worker loads each seeded matrix once (premerge: ~0.4 s, as long as a small case)."""
    from mlacheck.matrices import load

    return load(name, seed)


def _run(job: tuple[str, int, str | None, int, list[str], str]) -> list[dict[str, Any]]:
    """One case (by index in the seeded matrix) on every backend: JSON-ready records."""
    from mlacheck.backends.registry import resolve
    from mlacheck.harness import RunOptions, run_case

    matrix, seed, dist, index, backends, device = job
    case = _matrix(matrix, seed).cases[index].case
    if dist is not None:
        case = dataclasses.replace(case, distribution=dist)
    out = []
    for name in backends:
        v = run_case(case, resolve(name), RunOptions(device))
        rec = {k: x for k, x in v.to_dict().items() if k != "metrics"}
        rec["metrics"] = {k: x for k, x in v.metrics.items() if k != "heatmap"}
        rec["seed"], rec["distribution"] = seed, case.distribution
        out.append(rec)
    return out


def main(argv: list[str] | None = None) -> int:
    from mlacheck.matrices import load
    from mlacheck.verdict import FAIL, PASS, SKIP

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--matrix", default="premerge")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--backend", action="append", default=None)
    p.add_argument("--distribution", action="append", default=None,
                   help="run every case under this input distribution (repeatable; default: "
                        "each case's own)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", type=int, default=1, help="processes (one CPU thread each)")
    p.add_argument("--out", default="false_alarms.jsonl")
    p.add_argument("-m", dest="exclude_markers", action="append", default=["gpu", "large_kv"],
                   help="skip cases with these markers (default: gpu, large_kv)")
    a = p.parse_args(argv)
    backends = a.backend or DEFAULT_BACKENDS
    dists = a.distribution or [None]
    jobs = []
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for i, mc in enumerate(load(a.matrix, seed).cases):
            if not set(mc.markers) & set(a.exclude_markers):
                jobs += [(a.matrix, seed, d, i, backends, a.device) for d in dists]
    counts = {PASS: 0, FAIL: 0, SKIP: 0, "CRASH": 0, "ERROR": 0}
    worst_ratio, start = 0.0, time.time()
    with open(a.out, "w") as out, ProcessPoolExecutor(a.jobs, initializer=_init_worker) as pool:
        for done, recs in enumerate(pool.map(_run, jobs, chunksize=4), 1):
            for rec in recs:
                counts[rec["status"]] = counts.get(rec["status"], 0) + 1
                m = rec["metrics"]
                if rec["status"] == PASS and m.get("bound"):
                    worst_ratio = max(worst_ratio, m["worst_row"] / m["bound"])
                if rec["status"] not in (PASS, SKIP):
                    print(f"{rec['status']} {rec['backend']} seed {rec['seed']} {rec['case_id']}: "
                          f"{rec.get('reason', '')} {rec.get('diagnosis', '')}", flush=True)
                out.write(json.dumps(rec, default=str) + "\n")
            if done % max(1, len(jobs) // 10) == 0:
                print(f"{done}/{len(jobs)} cases: {counts} ({time.time() - start:.0f}s)",
                      flush=True)
    print(f"{a.seeds} seeds x {len(jobs) // a.seeds} case runs x {len(backends)} backends: "
          f"{counts}; worst row/bound among PASS: {worst_ratio:.3f}; "
          f"{time.time() - start:.0f}s")
    return 1 if counts[FAIL] or counts["CRASH"] or counts["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
