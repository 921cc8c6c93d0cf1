"""False-alarm run: correct backends that differ from the baseline, over a matrix x N seeds.

    python benchmarks/false_alarms.py --matrix premerge --seeds 20 \\
        --backend torch-split --backend torch-reverse --backend torch-lazy \\
        --backend torch-normalised --out false_alarms.jsonl
    python benchmarks/false_alarms.py --seeds 20 --distribution layer --distribution ties \\
        --jobs 16                                  # every case under each input distribution
    # a many-core machine (e.g. the GPU host's 16 cores, still a CPU run):
    python benchmarks/false_alarms.py --seeds 20 -b torch -b torch-split -b torch-reverse \\
        -n 16 --out false_alarms.jsonl --summary false_alarms.json
    # the real kernels on one GPU (admission shares its memory between workers):
    python benchmarks/false_alarms.py --device cuda --seeds 5 -b flashinfer -n 4 ...

Every run goes through run_case (the product's own path). `--distribution` runs every case
under that input distribution (mlacheck/distributions.py) instead of its own. Work items are
(seed, distribution, case): `-n` / `--jobs` worker processes take them, each running every backend on its case with the case's
inputs and references shared (RunOptions(share=True)), --threads torch threads each.
Printed: per seed the runs and failures, per check how many runs it failed and how close
the others came to its bound (value / bound, the largest among runs that passed it), and
the failures themselves (expected: none; a FAIL that matches a documented kernel finding,
mlacheck/known.py, counts as KNOWN and is left out of the per-check table). Results as JSON
lines; --summary writes the per-check table as JSON. `--from FILE ...` prints the same table
from earlier records: this script's, `mlacheck run --results` files, or the correct backends'
lines of benchmarks/anchor_checks.py (the real kernels' run on the GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from mlacheck.backends.registry import resolve
from mlacheck.harness import RunOptions, release_shared, run_case
from mlacheck.matrices import load
from mlacheck.verdict import CRASH, ERROR, FAIL, KNOWN, bucket, noteworthy

DEFAULT_BACKENDS = ["torch-split", "torch-reverse", "torch-lazy", "torch-normalised"]
_BACKENDS: dict[str, Any] = {}


def _work(item: tuple[str, int, str | None, int, list[str], str]) -> list[dict[str, Any]]:
    """Every backend on one (seed, distribution, case): its verdicts as records."""
    matrix, seed, dist, index, names, device = item
    case = load(matrix, seed).cases[index].case
    if dist is not None:
        case = dataclasses.replace(case, distribution=dist)
    out = []
    for name in names:
        if name not in _BACKENDS:
            _BACKENDS[name] = resolve(name)
        v = run_case(case, _BACKENDS[name], RunOptions(device, share=True))
        rec = {k: x for k, x in v.to_dict().items() if k != "metrics"}
        rec["metrics"] = {k: x for k, x in v.metrics.items() if k not in ("heatmap", "traceback")}
        rec["seed"], rec["distribution"] = seed, getattr(case, "distribution", None)
        out.append(rec)
    release_shared()
    return out


def _init(threads: int) -> None:
    torch.set_num_threads(threads)


def items(matrix: str, seeds: range, names: list[str], device: str, exclude: list[str],
          pattern: str = "", dists: list[str | None] | None = None
          ) -> Iterator[tuple[str, int, str | None, int, list[str], str]]:
    for seed in seeds:
        for i, mc in enumerate(load(matrix, seed).cases):
            if not set(mc.markers) & set(exclude) and pattern in mc.case.id:
                # the sparse path's cases draw their inputs their own way (no distribution
                # field): each runs once, under its own draw
                drawn = any(f.name == "distribution" for f in dataclasses.fields(mc.case))
                for d in (dists or [None]) if drawn else [None]:
                    yield matrix, seed, d, i, names, device


class Tally:
    """Statuses, per-check failures and closest approach, per seed."""

    def __init__(self) -> None:
        self.status: Counter[str] = Counter()
        self.per_seed: dict[int, Counter[str]] = defaultdict(Counter)
        self.fails: Counter[str] = Counter()
        self.closest: dict[str, tuple[float, str]] = {}
        self.failures: list[str] = []

    def add(self, rec: dict[str, Any]) -> None:
        """One verdict record: this script's, a results line of `mlacheck run` (the seed is in
        its case), or a correct backend's line of benchmarks/anchor_checks.py (checks as
        {name: [passed, value, bound]}, the case id under "case")."""
        case = rec.get("case")
        case_id = rec.get("case_id") or (case if isinstance(case, str) else "?")
        seed = rec.get("seed", case.get("seed") if isinstance(case, dict) else None)
        # KNOWN: a documented kernel finding (mlacheck/known.py), not a false alarm
        st = bucket(rec["status"], known=bool(rec.get("known_rule") or rec.get("known")))
        self.status[st] += 1
        self.per_seed[seed][st] += 1
        if noteworthy(st) and st != KNOWN:
            self.failures.append(f"{st} {rec['backend']} {case_id} (seed {seed}): "
                                 f"{rec.get('reason', '') or ', '.join(rec.get('failed', []))}")
        checks = rec.get("checks", [])
        if isinstance(checks, dict):
            checks = [{"name": n, "passed": c[0], "value": c[1], "bound": c[2]}
                      for n, c in checks.items()]
        for c in checks if st != KNOWN else []:
            if not c["passed"]:
                self.fails[c["name"]] += 1
            elif c.get("value") is not None and c.get("bound"):
                r = c["value"] / c["bound"]
                if r > self.closest.get(c["name"], (-1.0, ""))[0]:
                    self.closest[c["name"]] = (r, f"{rec['backend']} {case_id} seed {seed}")

    def print(self) -> None:
        for f in self.failures:
            print(f, flush=True)
        print("| check | runs failed | closest value/bound among passes | where |")
        print("|---|---|---|---|")
        for row in self.checks_table():
            print(f"| {row['check']} | {row['failed']} | {row['closest']:.3f} | "
                  f"{row['closest_run']} |")

    def checks_table(self) -> list[dict[str, Any]]:
        names = sorted(set(self.fails) | set(self.closest))
        return [{"check": n, "failed": self.fails[n],
                 "closest": round(self.closest.get(n, (0.0, ""))[0], 4),
                 "closest_run": self.closest.get(n, (0.0, ""))[1]} for n in names]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--matrix", default="premerge")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("-b", "--backend", action="append", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--distribution", action="append", default=None,
                   help="run every case under this input distribution (repeatable; default: "
                        "each case's own)")
    p.add_argument("-n", "--workers", "--jobs", dest="workers", type=int, default=1,
                   help="worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("-k", dest="pattern", default="", help="only cases whose id contains this")
    p.add_argument("--out", default="false_alarms.jsonl")
    p.add_argument("--summary", default=None, help="per-check table and counts as JSON")
    p.add_argument("-m", dest="exclude_markers", action="append", default=None,
                   help="skip cases with these markers (default: gpu on a CPU, large_kv)")
    p.add_argument("--from", dest="source", nargs="+", default=None,
                   help="tabulate these JSON-lines files instead of running: this script's, "
                        "`mlacheck run --results` files, benchmarks/anchor_checks.py's "
                        "(its correct backends)")
    a = p.parse_args(argv)
    if a.source:
        return tabulate(a.source, a.backend)
    names = a.backend or DEFAULT_BACKENDS
    exclude = a.exclude_markers or (["gpu", "large_kv"] if a.device == "cpu" else ["large_kv"])
    seeds = range(a.first_seed, a.first_seed + a.seeds)
    work = list(items(a.matrix, seeds, names, a.device, exclude, a.pattern, a.distribution))
    tally, start = Tally(), time.time()
    with open(a.out, "w") as out:
        if a.workers > 1:
            pool = mp.get_context("spawn").Pool(a.workers, initializer=_init,
                                                initargs=(a.threads,))
            results: Iterator[list[dict[str, Any]]] = pool.imap_unordered(_work, work)
        else:
            _init(a.threads)
            pool, results = None, map(_work, work)
        for done, batch in enumerate(results, 1):
            for rec in batch:
                tally.add(rec)
                out.write(json.dumps(rec, default=str) + "\n")
            if done % 50 == 0 or done == len(work):
                print(f"{done}/{len(work)} items, {dict(tally.status)} "
                      f"({time.time() - start:.0f}s)", flush=True)
        if pool is not None:
            pool.close()
            pool.join()
    wall = time.time() - start
    tally.print()
    per_case = len(work) // max(1, a.seeds)
    print(f"{a.seeds} seeds ({seeds.start}..{seeds.stop - 1}) x {per_case} case runs x "
          f"{len(names)} backends: {dict(tally.status)}; {wall:.0f}s wall, "
          f"{wall / max(1, a.seeds):.0f}s per seed with {a.workers} worker(s)")
    if a.summary:
        with open(a.summary, "w") as f:
            json.dump({"matrix": a.matrix, "seeds": list(seeds), "backends": names,
                       "device": a.device, "workers": a.workers, "wall_s": round(wall, 1),
                       "status": dict(tally.status),
                       "per_seed": {s: dict(c) for s, c in tally.per_seed.items()},
                       "checks": tally.checks_table(), "failures": tally.failures}, f, indent=1)
    return 1 if tally.status[FAIL] or tally.status[CRASH] or tally.status[ERROR] else 0


def tabulate(files: list[str], backends: list[str] | None = None) -> int:
    """Per check: runs failed and closest approach, over earlier runs' records of correct
    backends (`backends`: only these); exit 1 on any FAIL / CRASH / ERROR not KNOWN."""
    tally = Tally()
    for f in files:
        with open(f) as lines:
            for line in lines:
                rec = json.loads(line) if line.strip() else None
                if rec and "status" in rec and not rec.get("fault") and (
                        not backends or rec["backend"] in backends):
                    tally.add(rec)
    tally.print()
    print(f"{len(files)} file(s): {dict(tally.status)}; per seed: "
          + ", ".join(f"{s}: {dict(c)}" for s, c in sorted(tally.per_seed.items(), key=str)))
    return 1 if tally.status[FAIL] or tally.status[CRASH] or tally.status[ERROR] else 0


if __name__ == "__main__":
    sys.exit(main())
