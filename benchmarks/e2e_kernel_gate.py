"""The GSM8K gate with real kernels serving the e2e model (issue 30): one gate run per kernel
configuration, each `python -m mlacheck.e2e gate` in its own process (a kernel that takes
the device down takes only its run), several at once, then `mlacheck gate gsm8k compare`
of each against a baseline.

    python benchmarks/e2e_kernel_gate.py list
    python benchmarks/e2e_kernel_gate.py run --out-dir OUT --data-dir DATA --device cuda \\
        [--runs all | NAME,NAME] [--jobs 6] [--budget-s 480] [--n 500]
    python benchmarks/e2e_kernel_gate.py table OUT --baseline BASE [--margin-points 2]

`run` writes OUT/NAME.json (the gate record), OUT/NAME.log (the command, its output) and
OUT/runs.json (per run: the command, exit code, seconds). A run not started when `--budget-s`
has passed is recorded as not started, and every run is stopped at the budget (exit code
124), so a GPU call's time limit cuts nothing silently. `table` compares each complete record
with BASE (a record path or a baseline name in references/gsm8k) through the gate's CLI
(`mlacheck gate gsm8k compare`),
records each compare's exit code, and writes OUT/kernel_gate[-TAG].md and .json (the
compare reports in OUT/compare[-TAG]/NAME/). Exit status of
`run` and `table`: 0 when every run / compare worked (a FAIL verdict is not an error), else 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "references/e2e_model_deepseek_dims"
MAX_GEN_TOKS = 96  # as the dose-response runs and the e2e CI test: one protocol
FP8 = "fp8_e4m3fn"  # the OCP FP8 of NVIDIA GPUs


@dataclass(frozen=True)
class KernelRun:
    """One configuration of the model's attention: which backend serves each op, formats,
    page size, and what the cache's free memory holds."""

    name: str
    decode: str
    prefill: str = "torch"
    q: str = "bf16"
    kv: str = "bf16"
    page_size: int = 16
    tail_poison: str = "nan"
    why: str = ""

    def argv(self, args: argparse.Namespace, out: Path) -> list[str]:
        return [sys.executable, "-m", "mlacheck.e2e", "gate", "--model", str(args.model),
                "--backend", self.decode, "--prefill-backend", self.prefill, "--q", self.q,
                "--kv", self.kv, "--page-size", str(self.page_size), "--tail-poison",
                self.tail_poison, "--device", args.device, "--data-dir", str(args.data_dir),
                "--limit", str(args.n), "--max-gen-toks", str(MAX_GEN_TOKS), "--batch-size",
                str(args.batch_size), "--threads", "1", "--label", f"e2e-kernel:{self.name}",
                "--out", str(out)]


def _r(name: str, decode: str, **kw: Any) -> KernelRun:
    return KernelRun(name, decode, **kw)


# In the order they run: the reference first, then each kernel's main configuration, then
# the variants (page sizes, FP8 formats, free-memory contents).
RUNS: tuple[KernelRun, ...] = (
    _r("torch-bf16-p16", "torch", why="the reference on this device (baseline)"),
    _r("flashmla-bf16-p64", "flashmla", page_size=64, why="FlashMLA's native page size"),
    _r("flashinfer-bf16-p16", "flashinfer"),
    _r("flashinfer-fa3-bf16-p16", "flashinfer-fa3"),
    _r("aiter-triton-bf16-p16", "aiter-triton",
       why="NaN in free memory: AITER Triton finding 1 (tail x P=0)"),
    _r("aiter-triton-bf16-p16-finite", "aiter-triton", tail_poison="sentinel",
       why="finite free memory: finding 1 harmless"),
    _r("prefill-flashinfer-bf16", "torch", prefill="flashinfer"),
    _r("prefill-aiter-triton-bf16", "torch", prefill="aiter-triton"),
    _r("aiter-triton-fp8kv-p64-finite", "aiter-triton", kv=FP8, page_size=64,
       tail_poison="sentinel", why="bf16 q over an FP8 KV cache"),
    _r("torch-fp8kv-p16", "torch", kv=FP8, why="the reference with an FP8 KV cache"),
    _r("aiter-triton-fp8-p64-finite", "aiter-triton", q=FP8, kv=FP8, page_size=64,
       tail_poison="sentinel", why="FP8 q and KV (page >= 32 off ROCm)"),
    _r("prefill-aiter-triton-fp8", "torch", prefill="aiter-triton", q=FP8, kv=FP8,
       why="FP8 q/k/v prefill (decode: the reference, FP8 too)"),
    _r("torch-fp8-p16", "torch", q=FP8, kv=FP8, why="the reference, FP8 q and KV"),
    _r("prefill-flashinfer-fa3-bf16", "torch", prefill="flashinfer-fa3"),
    _r("flashinfer-bf16-p1", "flashinfer", page_size=1),
    _r("flashinfer-bf16-p64", "flashinfer", page_size=64),
    _r("flashinfer-fa3-bf16-p1", "flashinfer-fa3", page_size=1),
    _r("flashinfer-fa3-bf16-p64", "flashinfer-fa3", page_size=64),
    _r("flashmla-bf16-p16", "flashmla", why="repacked into a page-64 pool per call"),
    _r("flashmla-bf16-p1", "flashmla", page_size=1, why="repacked into a page-64 pool per call"),
    _r("aiter-triton-bf16-p64-finite", "aiter-triton", page_size=64, tail_poison="sentinel"),
    _r("aiter-triton-fp8kv-p16-finite", "aiter-triton", kv=FP8, tail_poison="sentinel"),
    _r("flashinfer-both-bf16-p16", "flashinfer", prefill="flashinfer",
       why="one library serving both ops"),
)
BY_NAME = {r.name: r for r in RUNS}


def _select(spec: str) -> list[KernelRun]:
    if spec == "all":
        return list(RUNS)
    unknown = [n for n in spec.split(",") if n and n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown runs: {', '.join(unknown)}; see `list`")
    return [BY_NAME[n] for n in spec.split(",") if n]


def cmd_run(args: argparse.Namespace) -> int:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = _select(args.runs)
    deadline = time.monotonic() + args.budget_s

    def one(run: KernelRun) -> dict[str, Any]:
        out = args.out_dir / f"{run.name}.json"
        argv = run.argv(args, out)
        info: dict[str, Any] = {**asdict(run), "command": " ".join(argv[1:])}
        left = deadline - time.monotonic()
        if left < args.min_start_s:
            return {**info, "rc": None, "status": "not started: budget spent"}
        t0 = time.monotonic()
        log = args.out_dir / f"{run.name}.log"
        with log.open("w") as fh:
            fh.write(info["command"] + "\n")
            fh.flush()
            try:
                rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=left).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        seconds = round(time.monotonic() - t0, 1)
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        print(f"{run.name}: rc={rc} in {seconds:.0f} s: {tail[0][:200] if tail else ''}",
              flush=True)
        return {**info, "rc": rc, "seconds": seconds, "last_line": tail[0] if tail else ""}

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(one, runs))
    path = args.out_dir / "runs.json"
    old = {r["name"]: r for r in json.loads(path.read_text())} if path.exists() else {}
    old.update({r["name"]: r for r in done})
    path.write_text(json.dumps(list(old.values()), indent=1))
    return 0 if all(r.get("rc") == 0 for r in done) else 2


def cmd_table(args: argparse.Namespace) -> int:
    from mlacheck.gate.record import GateRecord
    from mlacheck.gate.task import STRICT

    runs = json.loads((args.out_dir / "runs.json").read_text())
    order = {r.name: i for i, r in enumerate(RUNS)}
    runs.sort(key=lambda r: order.get(r["name"], len(order)))
    rows, ok = [], True
    for r in runs:
        row = {k: r.get(k) for k in ("name", "decode", "prefill", "q", "kv", "page_size",
                                     "tail_poison", "why", "rc", "seconds", "status")}
        rec_path = args.out_dir / f"{r['name']}.json"
        if r.get("rc") == 0 and rec_path.exists():
            rec = GateRecord.load(rec_path)
            row["accuracy"] = rec.metrics[STRICT].accuracy
            cmp_dir = args.out_dir / f"compare{args.suffix}" / r["name"]
            rc, stdout, stderr = _gate_cli(["gsm8k", "compare", str(args.baseline),
                                            str(rec_path), "--margin-points",
                                            str(args.margin_points), "--out-dir", str(cmp_dir)])
            row["compare_rc"] = rc
            # the compare's verdict line ("PASS gsm8k ..." / "FAIL gsm8k ..."), not "report: ..."
            said = stdout.strip().splitlines()
            row["verdict"] = next((ln for ln in said if ln.startswith(("PASS", "FAIL"))),
                                  said[-1] if said else "")
            if rc == 2:
                ok = False
                row["verdict"] = stderr.strip()[-300:]
            verdict = cmp_dir / "gsm8k_gate.json"
            if verdict.exists():
                row["compare"] = json.loads(verdict.read_text())
        rows.append(row)
    md = render(rows, args)
    (args.out_dir / f"kernel_gate{args.suffix}.md").write_text(md)
    (args.out_dir / f"kernel_gate{args.suffix}.json").write_text(json.dumps(rows, indent=1))
    print(md, end="")
    return 0 if ok else 2


def _gate_cli(argv: list[str]) -> tuple[int, str, str]:
    """`mlacheck gate ARGV` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from mlacheck.gate.cli import main as gate_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = gate_main(argv)
    return rc, out.getvalue(), err.getvalue()


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"Baseline: {args.baseline}; margin {args.margin_points:g} points "
             "(paired non-inferiority, one-sided alpha 0.05).", "",
             "| run | decode / prefill | q / KV | page | free memory | run exit | s | "
             "accuracy | b / c | lower bound (pts) | invalid | compare exit: verdict | "
             "detectable drop (pts) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['accuracy']:.1%}" if "accuracy" in r else ""
        verdict = (f"{r['compare_rc']}: {_verdict(r)}" if "compare_rc" in r
                   else r.get("status") or "")
        secs = f"{r['seconds']:.0f}" if r.get("seconds") is not None else ""
        cmp, bc, lower, invalid, drop = r.get("compare"), "", "", "", ""
        if cmp:
            p = cmp["primary"]
            bc, lower = f"{p['b']} / {p['c']}", f"{100 * p['difference']['lower']:+.2f}"
            invalid = f"{cmp['invalid_count']}/{p['n_candidate']}"
            drop = f"{100 * p['min_detectable_drop']:.2f}"
        lines.append(f"| {r['name']} | {r['decode']} / {r['prefill']} | {r['q']} / {r['kv']} | "
                     f"{r['page_size']} | {r['tail_poison']} | {r['rc']} | {secs} | {acc} | "
                     f"{bc} | {lower} | {invalid} | {verdict} | {drop} |")
    return "\n".join(lines) + "\n"


def _verdict(row: dict[str, Any]) -> str:
    """PASS, or FAIL with the compare's failed checks; else what the compare said."""
    cmp = row.get("compare")
    if not cmp:
        return row.get("verdict") or ""
    if cmp["passed"]:
        return "PASS"
    return "FAIL (" + ", ".join(c["name"] for c in cmp["checks"] if not c["passed"]) + ")"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the configurations, in run order")
    r = sub.add_parser("run", help="gate runs, several at once")
    r.add_argument("--model", type=Path, default=Path(DEFAULT_MODEL))
    r.add_argument("--out-dir", type=Path, required=True)
    r.add_argument("--data-dir", type=Path, required=True,
                   help="python -m mlacheck.e2e data DIR --n-test 500")
    r.add_argument("--runs", default="all")
    r.add_argument("--device", default="cuda")
    r.add_argument("--n", type=int, default=500)
    r.add_argument("--batch-size", type=int, default=500)
    r.add_argument("--jobs", type=int, default=6)
    r.add_argument("--budget-s", type=float, default=480.0)
    r.add_argument("--min-start-s", type=float, default=60.0,
                   help="do not start a run with less than this left of the budget")
    t = sub.add_parser("table", help="compare each run with a baseline")
    t.add_argument("out_dir", type=Path)
    t.add_argument("--baseline", required=True, help="record path or baseline name")
    t.add_argument("--margin-points", type=float, default=2.0)
    t.add_argument("--tag", default="", help="kernel_gate-TAG.md/.json, compare-TAG/ (one "
                   "table per baseline)")
    args = ap.parse_args(argv)
    args.suffix = f"-{args.tag}" if getattr(args, "tag", "") else ""
    if args.cmd == "list":
        for run in RUNS:
            print(f"{run.name:32s} decode {run.decode:15s} prefill {run.prefill:15s} "
                  f"{run.q}/{run.kv} page {run.page_size} free memory {run.tail_poison}"
                  + (f"  ({run.why})" if run.why else ""))
        return 0
    return cmd_run(args) if args.cmd == "run" else cmd_table(args)


if __name__ == "__main__":
    sys.exit(main())
