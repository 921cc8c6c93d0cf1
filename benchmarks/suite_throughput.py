"""Throughput of the suite itself: a matrix run end to end, and input construction alone.

    python benchmarks/suite_throughput.py --matrix premerge --device cpu --repeats 3 [-n 2]
    python benchmarks/suite_throughput.py --from nightly.jsonl        # a run already made
    python benchmarks/suite_throughput.py --inputs --matrix nightly   # input builds only

A run is `mlacheck run` in a subprocess (the way users run it); reported per repeat and as
the median: wall time, items per second, peak resident memory of the largest process (the
run's workers included), and from its results file the per-phase times summed over items
(inputs, kernel, golden, baseline, judge, ...). `--inputs` times `inputs.build` for the
matrix's largest cases (median of the repeats) in MB of stored inputs per second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mlacheck import footprint, inputs, results
from mlacheck.matrices import load

LARGEST_CASES = 3  # --inputs: how many of the matrix's largest cases are timed


def phases(path: str | Path, spawned: float | None = None, ended: float | None = None
           ) -> dict[str, Any]:
    """Items, statuses and per-phase seconds summed over the latest line of each item.
    `spawned` / `ended`: when the run's process was started and when it ended (epoch seconds),
    for the time outside the items (timeline's `outside_items_s`)."""
    raw = results.read_raw(path)
    records = results.latest_per_item(raw.records)
    total: dict[str, float] = {}
    statuses: dict[str, int] = {}
    for rec in records:
        statuses[rec["status"]] = statuses.get(rec["status"], 0) + 1
        for k, v in (rec.get("timings") or {}).items():
            total[k] = total.get(k, 0.0) + float(v)
        total["wall"] = total.get("wall", 0.0) + float(rec.get("wall") or 0.0)
    return {"items": len(records), "statuses": statuses,
            "summed_s": {k: round(v, 1) for k, v in sorted(total.items())},
            "longest_cases": longest_cases(records),
            "timeline": timeline(records, _run_started(raw.headers), spawned, ended)}


def _run_started(headers: list[Any]) -> float | None:
    """When the run's session started (its first header), epoch seconds."""
    for h in headers:
        started = getattr(h, "started", None)
        if started:
            return float(started)
    return None


def timeline(records: list[dict[str, Any]], session_started: float | None = None,
             spawned: float | None = None, ended: float | None = None) -> dict[str, Any]:
    """How the workers spent the run (items record when and where they ran): the span from
    the first item's start to the last one's end, each worker's busy share, what ended last,
    and the kernel time of each worker's first item of a backend against that backend's
    median (a per-process compile, e.g. Triton JIT, shows as a large first item).

    `first_item_vs_median_s`: the same for the whole item (any status, SKIP included) against
    the backend's later items. What a worker pays once for a backend outside its kernel call
    (importing the library, loading its kernels) shows only there: on the H100 and on a 4x
    H200 host (2026-11-26) a worker's first aiter-triton item took 4.8-7.0 s where it was a
    SKIP (later SKIPs 0.001 s), while its first kernel call took 0.45-0.5 s on average.

    `outside_items_s` (when the process's start and end are known): what the run spent before
    its first item and after its last one, split at the session's start (the run header): a
    fixed cost of every run that more GPUs do not shorten."""
    timed = [r for r in records if r.get("started") and r.get("worker")]
    if not timed:
        return {}
    t0 = min(float(r["started"]) for r in timed)
    end = max(float(r["started"]) + float(r.get("wall") or 0) for r in timed)
    span = end - t0
    busy: dict[str, float] = {}
    first: dict[tuple[str, str], dict[str, Any]] = {}
    for r in sorted(timed, key=lambda r: float(r["started"])):
        w = str(r["worker"])
        busy[w] = busy.get(w, 0.0) + float(r.get("wall") or 0)
        kernel = (r.get("timings") or {}).get("kernel")
        if kernel is not None:
            first.setdefault((w, str(r["backend"])), r)
    last = max(timed, key=lambda r: float(r["started"]) + float(r.get("wall") or 0))
    kernels: dict[str, list[float]] = {}
    for r in timed:
        k = (r.get("timings") or {}).get("kernel")
        if k is not None:
            kernels.setdefault(str(r["backend"]), []).append(float(k))
    firsts: dict[str, list[float]] = {}
    for (_, b), r in first.items():
        firsts.setdefault(b, []).append(float(r["timings"]["kernel"]))
    first_items: dict[str, list[float]] = {}
    later_items: dict[str, list[float]] = {}
    seen: set[tuple[str, str]] = set()
    for r in sorted(timed, key=lambda r: float(r["started"])):
        key = (str(r["worker"]), str(r["backend"]))
        into = later_items if key in seen else first_items
        seen.add(key)
        into.setdefault(key[1], []).append(float(r.get("wall") or 0))
    out: dict[str, Any] = {}
    if spawned is not None and ended is not None:
        out["outside_items_s"] = {
            "to_session": round(session_started - spawned, 1) if session_started else None,
            "session_to_first_item": round(t0 - session_started, 1) if session_started else None,
            "to_first_item": round(t0 - spawned, 1),
            "after_last_item": round(ended - end, 1)}
        firsts_at = {}
        for r in timed:
            w = str(r["worker"])
            firsts_at[w] = min(firsts_at.get(w, float("inf")), float(r["started"]) - spawned)
        out["worker_first_item_at_s"] = {w: round(v, 1) for w, v in sorted(firsts_at.items())}
    return {
        **out,
        "span_s": round(span, 1), "workers": len(busy),
        "busy_share": {w: round(b / span, 2) for w, b in sorted(busy.items())} if span else {},
        "ended_last": {"case": last["case_id"], "backend": last["backend"],
                       "started_at_s": round(float(last["started"]) - t0, 1),
                       "wall_s": round(float(last.get("wall") or 0), 1)},
        "first_kernel_vs_median_s": {
            b: {"first_mean": round(statistics.mean(firsts[b]), 2),
                "first_max": round(max(firsts[b]), 2),
                "median": round(statistics.median(ks), 3)}
            for b, ks in sorted(kernels.items()) if b in firsts},
        "first_item_vs_median_s": {
            b: {"first_mean": round(statistics.mean(fs), 2), "first_max": round(max(fs), 2),
                "median": round(statistics.median(later_items[b]), 3)}
            for b, fs in sorted(first_items.items()) if later_items.get(b)},
    }


LONGEST = 8  # how many of the longest cases `phases` lists


def longest_cases(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases whose items took longest together (a case's items run one after another in
    one worker, so this is what no run can end before), with their phases summed and the
    estimate mlacheck.cost gave them."""
    from mlacheck import cost
    from mlacheck.spec import case_from_json

    by_case: dict[str, dict[str, Any]] = {}
    for rec in records:
        row = by_case.setdefault(rec["case_id"], {"case": rec["case_id"], "wall_s": 0.0,
                                                  "items": 0, "phases_s": {},
                                                  "json": rec.get("case")})
        row["wall_s"] += float(rec.get("wall") or 0.0)
        row["items"] += 1
        for k, v in (rec.get("timings") or {}).items():
            row["phases_s"][k] = row["phases_s"].get(k, 0.0) + float(v)
    rows = sorted(by_case.values(), key=lambda r: -r["wall_s"])[:LONGEST]
    backends = sorted({str(rec.get("backend")) for rec in records})
    device = str(records[0].get("device") or "cuda") if records else "cuda"
    for row in rows:
        case_json = row.pop("json")
        row["wall_s"] = round(row["wall_s"], 2)
        row["phases_s"] = {k: round(v, 2) for k, v in sorted(row["phases_s"].items())}
        if case_json:
            with contextlib.suppress(ValueError, TypeError, KeyError):  # an older case layout
                row["estimate_s"] = round(cost.case_s(case_from_json(json.dumps(case_json)),
                                                      backends, device), 2)
    return rows


def run_once(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "mlacheck.cli", "run", "--matrix", args.matrix,
           "--device", args.device, "--results", str(out / "results.jsonl"), "--no-report"]
    for b in args.backend:
        cmd += ["--backend", b]
    if args.workers:
        cmd += ["-n", str(args.workers)]
    t, spawned = time.perf_counter(), time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall, ended = time.perf_counter() - t, time.time()
    # ru_maxrss of waited-for children: the largest single process of the run (KiB on Linux)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / (1 << 20)
    got = phases(out / "results.jsonl", spawned, ended)
    return {"exit": proc.returncode, "wall_s": round(wall, 1),
            "items_per_s": round(got["items"] / wall, 2), "peak_process_gib": round(peak, 2),
            **got}


def input_rates(matrix: str, repeats: int, device: str) -> list[dict[str, Any]]:
    cases = sorted((mc.case for mc in load(matrix).cases), key=_footprint, reverse=True)
    rows = []
    for case in cases[:LARGEST_CASES]:
        times, size = [], 0
        for _ in range(repeats):
            t = time.perf_counter()
            built = inputs.build(case, device)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            size = _stored_bytes(built)
            del built
        med = statistics.median(times)
        rows.append({"case": case.id, "stored_mb": round(size / 1e6, 1),
                     "median_s": round(med, 2), "mb_per_s": round(size / 1e6 / med, 1)})
    return rows


def _footprint(case: Any) -> int:
    est = footprint.estimate(case)
    return est.inputs + est.pools


def _stored_bytes(built: inputs.Inputs) -> int:
    if isinstance(built, inputs.PrefillInputs):
        ts = [built.q.stored, built.k.stored, built.v.stored]
    else:
        ts = [built.q.stored, built.pool.data]
    return sum(t.numel() * t.element_size() for t in ts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--matrix", default="premerge")
    p.add_argument("--backend", "-b", action="append", default=[],
                   help="repeatable (default: mlacheck run's default backends)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", "-n", type=int, default=0, help="default: mlacheck run's")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--from", dest="from_file", help="summarise this results file instead")
    p.add_argument("--inputs", action="store_true", help="time input construction only")
    p.add_argument("--json", help="write the numbers here too")
    p.add_argument("--keep", help="keep each run's results file in DIR/runN/ (for tables)")
    a = p.parse_args(argv)
    report: dict[str, Any] = {"machine": {"python": platform.python_version(),
                                          "cpus": len(_cores()), "node": platform.node()}}
    if a.from_file:
        report["phases"] = phases(a.from_file)
    elif a.inputs:
        report["inputs"] = input_rates(a.matrix, a.repeats, a.device)
    else:
        runs = []
        for i in range(a.repeats):
            if a.keep:
                out = Path(a.keep) / f"run{i + 1}"
                out.mkdir(parents=True, exist_ok=True)
                runs.append(run_once(a, out))
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    runs.append(run_once(a, Path(tmp)))
            print(f"run {i + 1}/{a.repeats}: {json.dumps(runs[-1])}", flush=True)
        report["runs"] = runs
        report["median"] = {k: statistics.median(r[k] for r in runs)
                            for k in ("wall_s", "items_per_s")}
        report["peak_process_gib"] = max(r["peak_process_gib"] for r in runs)
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


def _cores() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


if __name__ == "__main__":
    sys.exit(main())
