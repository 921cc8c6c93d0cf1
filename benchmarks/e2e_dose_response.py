"""What the end-to-end gate can see: planted faults of graded size in the e2e model's
attention (mlacheck.e2e.faults.DOSES), each judged twice —

* by the GSM8K gate: the model answers the held-out questions with the fault in its
  attention (lm-eval's gsm8k task, 0-shot), and `compare` puts the run against the clean
  one (paired non-inferiority, the margin given to `table`);
* by mlacheck's kernel-level judge on the very attention calls the model made
  (mlacheck.e2e.kernel_verdicts: the first layer's prefill and every layer's decode calls
  at 8 steps, of each batch).

    python benchmarks/e2e_dose_response.py run --model references/e2e_model --out-dir OUT \\
        --n 150 [--doses all | NAME,NAME] [--inner torch] [--device cpu] [--no-baseline]
    python benchmarks/e2e_dose_response.py table OUT [--margin-points 5]

`run` writes OUT/data (the questions, unless --data-dir), OUT/baseline.json (the inner
backend, bf16, no fault) and per dose OUT/<dose>.json (its gate record) and
OUT/<dose>.kernel.json (the kernel-level verdicts, the run's seconds). Runs of one OUT can be
spread over processes (--doses, --no-baseline); `table` reads whatever is there and writes
OUT/dose_response.md and .json. A dose planted in the torch backend's own arithmetic is
skipped, with the reason, when --inner names another backend. Exit status: 0, or 2 when a
run failed (its kernel.json says why).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from mlacheck.backends.base import Backend
from mlacheck.backends.registry import resolve
from mlacheck.e2e.checkpoint import load_model
from mlacheck.e2e.faults import DOSES, Dose, dose, planted
from mlacheck.e2e.kernel_verdicts import KernelVerdicts
from mlacheck.e2e.runner import DEFAULT_PLACEMENT, AttentionConfig, MLARunner
from mlacheck.e2e.tokenizer import load_tokenizer
from mlacheck.spec import Quant

BASELINE = "baseline"
# The longest answer of the e2e problems is 83 tokens: a model that never stops is cut here
# (the e2e CI test's setting; the protocol hash includes it: runs compared must share it).
MAX_GEN_TOKS = 96


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.%()-]+", "_", name)


def _run_one(name: str, d: Dose | None, args: argparse.Namespace, data: Path) -> dict[str, Any]:
    from mlacheck.e2e.lm import MLACheckLM
    from mlacheck.gate.lmeval_runner import RunSettings, run_task
    from mlacheck.gate.tasks import get_task

    out = args.out_dir / f"{slug(name)}.json"
    info: dict[str, Any] = {"dose": name, "inner": args.inner, "model": str(args.model),
                            "n": args.n, "device": args.device}
    if d is not None:
        info.update(family=d.family, mechanism=d.mechanism, control=d.control)
        if d.torch_only and args.inner != "torch":
            return {**info, "skipped": f"planted in the torch backend's arithmetic: needs "
                                       f"--inner torch, not {args.inner}"}
    quant = (d.quant if d is not None and d.quant is not None else Quant())
    tail = d.tail_poison if d is not None else "nan"
    att = AttentionConfig(quant=quant, page_size=args.page_size,
                          placement=dataclasses.replace(DEFAULT_PLACEMENT, tail_poison=tail))
    inner: Backend = resolve(args.inner)
    decode, prefill = planted(d, inner, att.page_size) if d is not None else (inner, inner)
    model = load_model(args.model, device=args.device, dtype=torch.float32)
    judged = (KernelVerdicts(decode, prefill, model.config.num_hidden_layers, device=args.device)
              if d is not None else None)
    tok = load_tokenizer(args.model, model.config.bos_token_id, model.config.eos_token_id)
    runner = MLARunner(model, decode, att, observer=judged, prefill_backend=prefill)
    t0 = time.perf_counter()
    rec = run_task(get_task("gsm8k"), MLACheckLM(runner, tok, batch_size=args.batch_size),
                   RunSettings(out=out, model_label=f"e2e:{args.model.name}", num_fewshot=0,
                               limit=args.n, data_dir=data, max_gen_toks=args.max_gen_toks,
                               kv_dtype=quant.kv, attention_backend=runner.backend_label,
                               extra={"q_dtype": quant.q, "dose": name, "inner": args.inner,
                                      "tail_poison": tail, "page_size": str(args.page_size)}))
    info.update(seconds=round(time.perf_counter() - t0, 1), record=out.name,
                complete=rec.complete, attention=runner.backend_label, quant=quant.slug,
                tail_poison=tail)
    if judged is not None:
        info.update(kernel=judged.summary(), kernel_failed=judged.failed,
                    kernel_errors=judged.errors, kernel_judged=len(judged.records),
                    kernel_records=judged.records)
    return info


def cmd_run(args: argparse.Namespace) -> int:
    from mlacheck.e2e.problems import write_gsm8k_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    data = args.data_dir or write_gsm8k_dir(args.out_dir / "data", n_train=20, n_test=args.n)
    names = [d.name for d in DOSES] if args.doses == "all" else args.doses.split(",")
    todo: list[tuple[str, Dose | None]] = [] if args.no_baseline else [(BASELINE, None)]
    todo += [(n, dose(n)) for n in names if n]
    rc = 0
    for name, d in todo:
        try:
            info = _run_one(name, d, args, data)
        except Exception as e:  # noqa: BLE001 - one dose failing must not lose the others
            info = {"dose": name, "inner": args.inner, "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(limit=6)}
            rc = 2
        (args.out_dir / f"{slug(name)}.kernel.json").write_text(json.dumps(info, indent=1))
        print(_one_line(info), flush=True)
    return rc


def _one_line(info: dict[str, Any]) -> str:
    if "error" in info or "skipped" in info:
        return f"{info['dose']}: {info.get('error') or 'skipped: ' + info['skipped']}"
    k = (f", kernel-level FAIL on {info['kernel_failed']}/{info['kernel_judged']} judged calls"
         if "kernel_judged" in info else "")
    return f"{info['dose']}: {info['record']} in {info['seconds']:.0f} s{k}"


# --------------------------------------------------------------------------- table


def _row(info: dict[str, Any], base: Any, margin: float) -> dict[str, Any]:
    from mlacheck.gate.compare import GatePolicy, compare
    from mlacheck.gate.record import GateRecord
    from mlacheck.gate.task import STRICT

    row: dict[str, Any] = {k: info.get(k) for k in ("dose", "family", "mechanism", "control",
                                                    "inner", "seconds", "quant")}
    if "skipped" in info or "error" in info:
        row["gate"] = row["kernel_level"] = "not run"
        row["note"] = info.get("skipped") or info.get("error")
        return row
    rec = GateRecord.load(Path(info["dir"]) / info["record"])
    v = compare(base, rec, GatePolicy(margin=margin))
    p = v.primary
    row.update(gate="PASS" if v.passed else "FAIL", accuracy=rec.metrics[STRICT].accuracy,
               invalid=rec.invalid_count())
    if p is not None:
        row.update(n=p.n_candidate, diff=p.difference.estimate, lower=p.difference.lower,
                   upper=p.difference.upper, b=p.b, c=p.c, resolves=p.min_detectable_drop)
    judged, failed = info.get("kernel_judged", 0), info.get("kernel_failed", 0)
    row["kernel_level"] = ("ERROR" if info.get("kernel_errors") else
                           "FAIL" if failed else "PASS")
    row["kernel_failed"], row["kernel_judged"] = failed, judged
    row["kernel_by_op"] = {op: f"{s['status'].get('FAIL', 0)}/{s['judged']}"
                           for op, s in (info.get("kernel") or {}).items()}
    row["checks"] = sorted({c for s in (info.get("kernel") or {}).values() for c in s["checks"]})
    row["seen_by"] = _seen_by(row["gate"] == "FAIL", row["kernel_level"] == "FAIL")
    return row


def _seen_by(gate: bool, kernel: bool) -> str:
    return {(True, True): "both", (False, True): "kernel checks only",
            (True, False): "gate only", (False, False): "neither"}[(gate, kernel)]


def _pts(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f}"


def render(rows: list[dict[str, Any]], margin: float, base_acc: float, n: int) -> str:
    lines = [
        f"Baseline strict-match accuracy {base_acc:.1%} on its {n} questions; each run is "
        f"compared on the n questions it shares with it (paired non-inferiority, margin "
        f"{100 * margin:g} points, one-sided alpha 0.05). Accuracy: the run's own.",
        "",
        "| dose | what | gate | n | accuracy | difference, 90% CI (pts) | b / c | kernel-level: "
        "FAIL / judged calls | checks that fired | seen by |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["gate"] == "not run":
            lines.append(f"| {r['dose']} | {r.get('mechanism') or ''} | not run | | | | | | | "
                         f"{r.get('note', '')} |")
            continue
        ops = ", ".join(f"{op.removeprefix('mla_')} {x}" for op, x in r["kernel_by_op"].items())
        ci = f"{_pts(r.get('diff'))} [{_pts(r.get('lower'))}, {_pts(r.get('upper'))}]"
        lines.append(
            f"| {r['dose']} | {r['mechanism']} | {r['gate']} | {r.get('n')} | {r['accuracy']:.1%} "
            f"| {ci} | "
            f"{r.get('b')} / {r.get('c')} | {r['kernel_level']} ({ops}) | "
            f"{', '.join(r['checks']) or '-'} | {'control' if r['control'] else r['seen_by']} |")
    return "\n".join(lines) + "\n"


def cmd_table(args: argparse.Namespace) -> int:
    from mlacheck.gate.record import GateRecord
    from mlacheck.gate.task import STRICT

    order = {d.name: i for i, d in enumerate(DOSES)}
    infos = []
    for path in sorted(args.out_dir.glob("*.kernel.json")):
        info = json.loads(path.read_text())
        info["dir"] = str(path.parent)
        if info["dose"] != BASELINE:
            infos.append(info)
    base = GateRecord.load(args.baseline or args.out_dir / f"{BASELINE}.json")
    infos.sort(key=lambda i: (order.get(i["dose"], len(order)), i.get("inner", "")))
    margin = args.margin_points / 100
    rows = [_row(i, base, margin) for i in infos]
    md = render(rows, margin, base.metrics[STRICT].accuracy, len(base.samples))
    (args.out_dir / "dose_response.md").write_text(md)
    (args.out_dir / "dose_response.json").write_text(json.dumps(rows, indent=1))
    print(md, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the baseline and the doses' gate runs")
    r.add_argument("--model", type=Path, default=Path("references/e2e_model"))
    r.add_argument("--out-dir", type=Path, required=True)
    r.add_argument("--data-dir", type=Path, default=None)
    r.add_argument("--n", type=int, default=150, help="held-out questions per run")
    r.add_argument("--doses", default="all", help="all, or names: " + ", ".join(d.name for d in DOSES))
    r.add_argument("--inner", default="torch", help="the backend the faults are planted in")
    r.add_argument("--device", default="cpu")
    r.add_argument("--page-size", type=int, default=16)
    r.add_argument("--batch-size", type=int, default=250)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--max-gen-toks", type=int, default=MAX_GEN_TOKS)
    r.add_argument("--no-baseline", action="store_true", help="do not run the baseline")
    t = sub.add_parser("table", help="compare each dose with the baseline; the table")
    t.add_argument("out_dir", type=Path)
    t.add_argument("--baseline", type=Path, default=None, help="default: OUT/baseline.json")
    t.add_argument("--margin-points", type=float, default=5.0)
    args = ap.parse_args(argv)
    return cmd_run(args) if args.cmd == "run" else cmd_table(args)


if __name__ == "__main__":
    sys.exit(main())
