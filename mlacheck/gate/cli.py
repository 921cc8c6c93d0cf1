"""``mlacheck gate <task> run|compare|promote``, for every registered task.

The top-level ``mlacheck`` command dispatches ``mlacheck gate ...`` to :func:`main` with the
arguments after ``gate``. The task words are the names in :mod:`mlacheck.gate.tasks` when
:func:`main` is called. Exit codes: 0 success / PASS, 1 FAIL (compare), 2 error (an unknown
task included). Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import getpass
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from mlacheck.gate.errors import GateError
from mlacheck.gate.record import (
    GateRecord,
    Provenance,
    record_from_lmeval_results,
    write_text_atomic,
)
from mlacheck.gate.task import ROLES, GateTask
from mlacheck.gate.tasks import get_task, task_names

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_ERROR = 2

# A task's baselines live in references/<task> (relative to the repository root; see
# references/gsm8k/README.md).
REFERENCES_DIR = Path("references")
BASELINE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
META_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise GateError(f"{self.prog}: {message}")


def default_refs_dir(task: GateTask) -> Path:
    """``references/<task>`` of the source checkout mlacheck is imported from, if there is
    one; otherwise ``references/<task>`` under the current directory."""
    import mlacheck

    subdir = REFERENCES_DIR / task.name
    candidate = Path(mlacheck.__file__).resolve().parents[1] / subdir
    return candidate if candidate.is_dir() else Path.cwd() / subdir


def _parser() -> _Parser:
    top = _Parser(prog="mlacheck gate", description="End-to-end accuracy gates (lm-eval tasks).")
    gates = top.add_subparsers(dest="task", required=True, parser_class=_Parser, metavar="TASK")
    for name in task_names():
        task = get_task(name)
        gate = gates.add_parser(name, help=f"{task.title} accuracy gate through lm-eval")
        _add_commands(gate, task)
    return top


def _add_commands(gate: argparse.ArgumentParser, task: GateTask) -> None:
    from mlacheck.gate.compare import (
        DEFAULT_ALPHA,
        DEFAULT_INVALID_RATE_CEILING,
        DEFAULT_MARGIN,
        DEFAULT_METRIC,
    )
    from mlacheck.gate.lmeval_runner import (
        DEFAULT_MAX_GEN_TOKS,
        DEFAULT_MAX_RETRIES,
        DEFAULT_NUM_CONCURRENT,
        DEFAULT_REQUEST_TIMEOUT_S,
        TOKENIZER_BACKENDS,
    )

    sub = gate.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser(
        "run", help=f"evaluate a served model on {task.title} and write a run record"
    )
    run.add_argument(
        "--base-url",
        required=True,
        help="OpenAI-compatible completions endpoint, e.g. http://localhost:8000/v1/completions "
        "(http://host:port and http://host:port/v1 are completed)",
    )
    run.add_argument("--model", required=True, help="model name as the server knows it")
    run.add_argument("--out", required=True, type=Path, help="record JSON to write")
    run.add_argument("--label", help="model label in the record (default: --model)")
    run.add_argument("--tokenizer", help="tokenizer name (optional; prompts are sent as text)")
    run.add_argument("--tokenizer-backend", choices=TOKENIZER_BACKENDS, default="none")
    run.add_argument("--num-concurrent", type=int, default=DEFAULT_NUM_CONCURRENT)
    run.add_argument("--max-retries", type=int, default=DEFAULT_MAX_RETRIES)
    run.add_argument(
        "--timeout",
        type=int,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="per-request timeout in seconds",
    )
    run.add_argument("--num-fewshot", type=int, default=task.num_fewshot)
    run.add_argument("--limit", type=int, help="evaluate only the first N test documents")
    run.add_argument("--max-gen-toks", type=int, default=DEFAULT_MAX_GEN_TOKS)
    run.add_argument(
        "--data-dir",
        type=Path,
        help=f"offline {task.title} directory with {' and '.join(task.data_files.values())} "
        "(default: HF hub)",
    )
    run.add_argument("--server-args", help="free-form: how the server was started")
    run.add_argument("--kv-dtype", help="free-form: KV-cache dtype")
    run.add_argument("--attention-backend", help="free-form: attention backend")
    run.add_argument(
        "--meta",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra free-form metadata (repeatable)",
    )

    cmp_ = sub.add_parser("compare", help="gate a candidate run against a baseline")
    cmp_.add_argument(
        "baseline", help="baseline record path, or a baseline name in the references dir"
    )
    cmp_.add_argument("candidate", type=Path, help="candidate run record")
    cmp_.add_argument(
        "--out-dir",
        type=Path,
        help="write the markdown summary, plot and verdict JSON here (default: print the markdown)",
    )
    cmp_.add_argument(
        "--margin-points",
        type=float,
        default=100 * DEFAULT_MARGIN,
        help="non-inferiority margin in accuracy points (default %(default)g)",
    )
    cmp_.add_argument(
        "--alpha",
        type=float,
        default=DEFAULT_ALPHA,
        help="one-sided significance level (default %(default)g)",
    )
    cmp_.add_argument(
        "--accuracy-floor-percent",
        type=float,
        help="minimum candidate accuracy in percent (default: none)",
    )
    cmp_.add_argument(
        "--invalid-ceiling-percent",
        type=float,
        default=100 * DEFAULT_INVALID_RATE_CEILING,
        help=f"maximum percent of candidate outputs {task.no_answer} or looping "
        "(default %(default)g)",
    )
    cmp_.add_argument("--metric", choices=ROLES, default=DEFAULT_METRIC)
    cmp_.add_argument(
        "--refs-dir", type=Path, help=f"baselines directory (default: references/{task.name})"
    )

    pro = sub.add_parser("promote", help="record a run as a named baseline")
    pro.add_argument(
        "run",
        type=Path,
        help="run record, or an lm-eval results JSON (becomes an aggregate-only baseline)",
    )
    pro.add_argument("--name", required=True, help="baseline name (file NAME.json)")
    pro.add_argument("--reason", required=True, help="why this run is the baseline")
    pro.add_argument("--by", help="who promotes it (default: the current user)")
    pro.add_argument(
        "--refs-dir", type=Path, help=f"baselines directory (default: references/{task.name})"
    )
    pro.add_argument("--force", action="store_true", help="replace an existing baseline")


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list and not args_list[0].startswith("-"):
            get_task(args_list[0])  # an unknown task: one line naming the registered ones
        args = _parser().parse_args(args_list)
        commands = {"run": _cmd_run, "compare": _cmd_compare, "promote": _cmd_promote}
        return commands[args.command](get_task(args.task), args)
    except GateError as exc:
        print(f"mlacheck gate: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR


# --- run ---------------------------------------------------------------------------------


def _parse_meta(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not META_KEY_RE.match(key):
            raise GateError(f"--meta expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _cmd_run(task: GateTask, args: argparse.Namespace) -> int:
    from mlacheck.gate.lmeval_runner import (
        RunSettings,
        local_completions_spec,
        normalize_completions_url,
        preflight,
        responses_path,
        run_task,
    )

    try:
        import lm_eval  # noqa: F401  # fail before talking to the server
    except ImportError as exc:
        raise GateError(f"{task.name} run needs lm-eval ({exc}); install mlacheck[eval]") from None
    url = normalize_completions_url(args.base_url)
    spec = local_completions_spec(
        url,
        args.model,
        num_concurrent=args.num_concurrent,
        tokenizer=args.tokenizer,
        tokenizer_backend=args.tokenizer_backend,
        max_retries=args.max_retries,
        timeout_s=args.timeout,
    )
    settings = RunSettings(
        out=args.out,
        model_label=args.label or args.model,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        data_dir=args.data_dir,
        max_gen_toks=args.max_gen_toks,
        base_url=url,
        server_args=args.server_args,
        kv_dtype=args.kv_dtype,
        attention_backend=args.attention_backend,
        extra=_parse_meta(args.meta),
    )
    preflight(url, args.model)
    record = run_task(task, spec, settings)
    parts = ", ".join(
        f"{name} {m.accuracy:.2%}" + (f" (stderr {m.stderr:.2%})" if m.stderr is not None else "")
        for name, m in record.metrics.items()
    )
    print(
        f"{task.name}: {parts}; n={record.n_planned}; record {args.out}, "
        f"responses {responses_path(args.out)}"
    )
    return EXIT_OK


# --- compare -----------------------------------------------------------------------------


def _resolve_baseline(task: GateTask, spec: str, refs_dir: Path | None) -> Path:
    path = Path(spec)
    if path.exists() or not BASELINE_NAME_RE.match(spec) or spec.endswith(".json"):
        return path
    return (refs_dir or default_refs_dir(task)) / f"{spec}.json"


def _load(task: GateTask, path: Path) -> GateRecord:
    """A record of ``task``; a record of another task is refused by name."""
    record = GateRecord.load(path)
    if record.task != task.name:
        raise GateError(f"{path} is a {record.task} record, not {task.name}")
    return record


def _cmd_compare(task: GateTask, args: argparse.Namespace) -> int:
    from mlacheck.gate.compare import (
        GatePolicy,
        compare,
        render_markdown,
        report_names,
        summary_line,
        write_plot,
    )

    policy = GatePolicy(
        margin=args.margin_points / 100,
        alpha=args.alpha,
        accuracy_floor=None
        if args.accuracy_floor_percent is None
        else args.accuracy_floor_percent / 100,
        invalid_rate_ceiling=args.invalid_ceiling_percent / 100,
        metric=args.metric,
    )
    baseline = _load(task, _resolve_baseline(task, args.baseline, args.refs_dir))
    candidate = _load(task, args.candidate)
    verdict = compare(baseline, candidate, policy)
    report_markdown, report_plot, report_json = report_names(task.name)
    if args.out_dir is None:
        print(render_markdown(verdict), end="")
        return verdict.exit_code
    out: Path = args.out_dir
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GateError(f"cannot create {out}: {exc}") from None
    plot_name: str | None = report_plot
    if verdict.primary is None:
        plot_name = None
    else:
        try:
            write_plot(verdict, out / report_plot)
        except ImportError:
            plot_name = None
            print("mlacheck gate: note: matplotlib not installed; no plot", file=sys.stderr)
    write_text_atomic(out / report_markdown, render_markdown(verdict, plot_name))
    write_text_atomic(out / report_json, json.dumps(verdict.to_json_dict(), indent=2) + "\n")
    print(summary_line(verdict))
    print(f"report: {out / report_markdown}")
    return verdict.exit_code


# --- promote -----------------------------------------------------------------------------


def _cmd_promote(task: GateTask, args: argparse.Namespace) -> int:
    if not BASELINE_NAME_RE.match(args.name):
        raise GateError(f"baseline name must match {BASELINE_NAME_RE.pattern}, got {args.name!r}")
    if not args.reason.strip():
        raise GateError("--reason must say why this run is the baseline")
    try:
        data = json.loads(args.run.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GateError(f"{args.run}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GateError(f"{args.run}: cannot read JSON: {exc}") from None
    if isinstance(data, dict) and "schema" not in data and "results" in data:
        record = record_from_lmeval_results(data, str(args.run), task)
    else:
        record = _load(task, args.run)
    if not record.complete:
        raise GateError(
            f"{args.run}: only a complete run can be a baseline (status {record.status}, "
            f"{record.failed_requests} failed requests)"
        )
    refs: Path = args.refs_dir or default_refs_dir(task)
    target = refs / f"{args.name}.json"
    if target.exists() and not args.force:
        raise GateError(f"baseline {target} exists; pass --force to replace it")
    prov = Provenance(
        name=args.name,
        promoted_by=args.by or _whoami(),
        promoted_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        reason=" ".join(args.reason.split()),
        source=str(args.run),
    )
    try:
        write_text_atomic(target, record.with_provenance(prov).dumps())
    except OSError as exc:
        raise GateError(f"cannot write {target}: {exc}") from None
    kind = "paired" if record.has_samples else "aggregate-only"
    print(f"baseline {args.name} ({kind}, n={record.n_planned}) written to {target}")
    return EXIT_OK


def _whoami() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
