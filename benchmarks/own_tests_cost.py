"""Wall time and peak memory of mlacheck's own test command (issue 17's CPU-side goal).

    python benchmarks/own_tests_cost.py --repeats 3                  # the README command
    python benchmarks/own_tests_cost.py --repeats 1 -- -m slow       # extra pytest arguments
    python benchmarks/own_tests_cost.py --json cost.json

Each repeat runs `python3 -m pytest -q -n 2 tests [extra]` in a subprocess and samples, every
SAMPLE_S seconds, three peaks:
- system: the rise of the machine's used memory (MemTotal - MemAvailable over its value at
  the start). Counts shared pages once, but also whatever else runs and the kernel's own
  accounting (seen: 2.1-3.1 GB for the same tree on a quiet VM): run on a quiet machine.
- tree PSS: the largest sum of proportional set sizes over the pytest process tree (each
  shared page split among the processes mapping it): what the tree itself costs, shared
  libraries once; the figure the 3 GB goal is read against.
- tree RSS: the largest sum of resident sizes over the tree (counts torch's shared libraries
  once per process: reads higher).
Reports each repeat and the medians. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
README_COMMAND = [sys.executable, "-m", "pytest", "-q", "-n", "2", "tests"]
SAMPLE_S = 0.2  # fine enough for peaks that last seconds (a large case's input build)
GB = 1e9


def used_bytes() -> int:
    """MemTotal - MemAvailable, in bytes."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def tree_memory(root: int) -> tuple[int, int]:
    """(sum of Rss, sum of Pss) over `root` and its descendants, in bytes."""
    kids, rss, pss, todo = _children(), 0, 0, [root]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            continue  # the process ended while we looked
    return rss, pss


def run_once(cmd: list[str], log: Path) -> dict[str, Any]:
    base = used_bytes()
    peaks = {"system": 0, "rss": 0, "pss": 0}
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(SAMPLE_S):
                peaks["system"] = max(peaks["system"], used_bytes() - base)
                rss, pss = tree_memory(proc.pid)
                peaks["rss"], peaks["pss"] = max(peaks["rss"], rss), max(peaks["pss"], pss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        done.set()
        sampler.join()
    wall = time.perf_counter() - t0
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    return {"rc": rc, "wall_s": round(wall, 1), "peak_system_gb": round(peaks["system"] / GB, 2),
            "peak_tree_pss_gb": round(peaks["pss"] / GB, 2),
            "peak_tree_rss_gb": round(peaks["rss"] / GB, 2), "summary": tail[0],
            "load_before": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the repeats and medians here")
    p.add_argument("--logs", default="own-tests-cost", help="directory for each repeat's log")
    p.add_argument("extra", nargs="*", help="more pytest arguments (after --)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    cmd = README_COMMAND + args.extra
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    print(f"$ {' '.join(cmd[1:])}  ({os.cpu_count()} cores, {cpu_model()}, "
          f"{used_bytes() / GB:.1f} GB in use, Python {platform.python_version()})", flush=True)
    runs = []
    for i in range(args.repeats):
        r = run_once(cmd, logs / f"run{i}.log")
        runs.append(r)
        print(f"  repeat {i}: rc {r['rc']}, {r['wall_s']} s, peak {r['peak_system_gb']} GB "
              f"system / {r['peak_tree_pss_gb']} GB tree PSS / {r['peak_tree_rss_gb']} GB tree RSS, "
              f"load before {r['load_before']:.2f}"
              f"  [{r['summary']}]", flush=True)
    median = {k: statistics.median(r[k] for r in runs)
              for k in ("wall_s", "peak_system_gb", "peak_tree_pss_gb", "peak_tree_rss_gb")}
    print(f"median of {len(runs)}: {median['wall_s']} s, peak {median['peak_system_gb']} GB "
          f"system / {median['peak_tree_pss_gb']} GB tree PSS / {median['peak_tree_rss_gb']} GB "
          "tree RSS")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd[1:], "runs": runs,
                                               "median": median}, indent=1))
    return max((r["rc"] for r in runs), default=0)


if __name__ == "__main__":
    sys.exit(main())
