"""`mlacheck`: run / list / replay / report / gate / selftest.

`run` is a thin layer over pytest.main with the mlacheck plugin (never a second runner).
Bad input (unknown backend, malformed matrix, impossible case) is one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DEFAULT_RESULTS = "mlacheck-out/results.jsonl"
# pytest exit codes -> ours: 0 ok, 1 tests failed, 5 nothing collected (an empty selection is
# not a failure of the kernels: the skip reasons are in the report); anything else is an error.
PYTEST_EXIT = {0: EXIT_OK, 1: EXIT_FAIL, 5: EXIT_OK}


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


def _die(msg: str) -> int:
    print(f"mlacheck: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _plugin_args() -> list[str]:
    """Load the plugin explicitly when it is not installed as a pytest11 entry point
    (e.g. mlacheck used from a source tree on PYTHONPATH)."""
    from importlib.metadata import entry_points

    installed = any(ep.name == "mlacheck" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "mlacheck.pytest_plugin"]


def _suite_path() -> str:
    from mlacheck.suite import test_mla

    return str(Path(test_mla.__file__))


# --------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace, extra: list[str]) -> int:
    from mlacheck.backends.registry import DEFAULT_BACKEND, resolve
    from mlacheck.matrices import load

    backends = args.backend or [DEFAULT_BACKEND]
    for b in backends:
        resolve(b)  # validate before pytest starts: one-line errors, exit 2
    matrix = load(args.matrix, args.seed)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    leave_out = None
    if args.resume:
        from mlacheck.pytest_plugin import recorded_items

        done = recorded_items(results)
        if results.exists() and not results.read_bytes().endswith(b"\n"):
            with results.open("a") as f:  # end a torn last line: new records start on their own
                f.write("\n")
        leave_out = results.with_name(f".{results.name}.done")
        leave_out.write_text("".join(f"{b}\t{c}\n" for b, c in sorted(done)))
        print(f"mlacheck: resuming {results}: {len(done)} item(s) already recorded", flush=True)
    elif results.exists() and not args.append:
        results.unlink()
    workers = args.workers if args.workers is not None else _default_workers(args.device)
    argv = [
        _suite_path(), "-q", "-rfE", "--no-header",
        "-o", "console_output_style=progress", "-p", "no:cacheprovider",
        f"--mla-matrix={args.matrix}", f"--mla-device={args.device}", f"--mla-golden={args.golden}",
        f"--mla-results={results}", f"--timeout={args.timeout}",
        f"-n={workers}", f"--max-worker-restart={max(4, len(matrix.cases) * len(backends))}",
        "--rootdir", str(Path.cwd()),
    ]
    argv += _plugin_args()
    argv += [f"--mla-backend={b}" for b in backends]
    if args.seed is not None:
        argv.append(f"--mla-seed={args.seed}")
    if leave_out is not None:
        argv.append(f"--mla-leave-out={leave_out}")
    if args.junit:
        argv.append(f"--junitxml={args.junit}")
    if args.k:
        argv += ["-k", args.k]
    if args.m:
        argv += ["-m", args.m]
    argv += extra
    print(f"mlacheck: matrix {matrix.name} ({len(matrix.cases)} cases) x backends {', '.join(backends)}"
          f" on {args.device}, {workers} worker(s); results -> {results}", flush=True)
    import pytest

    os.environ.setdefault("PYTHONHASHSEED", "0")
    code = int(pytest.main(argv))
    if args.report and results.exists():
        from mlacheck.report import main as report_main

        report_main([str(results), "-o", str(results.parent)])
    return PYTEST_EXIT.get(code, EXIT_USAGE if code in (2, 3, 4) else EXIT_FAIL)


def _default_workers(device: str) -> int:
    """One worker per GPU; on CPU one worker (a process apart, so a crash cannot take the run)."""
    if device == "cpu":
        return 1
    from mlacheck.pytest_plugin import _gpu_count

    return max(1, _gpu_count())


# --------------------------------------------------------------------------- list


def cmd_list(args: argparse.Namespace) -> int:
    from mlacheck.backends.registry import BackendError, available_names, resolve
    from mlacheck.matrices import load, names

    print("backends:")
    for name in available_names():
        try:
            b = resolve(name)
        except BackendError as e:
            print(f"  {name:18s} unavailable: {e}")
            continue
        why = b.unavailable()
        if why:
            print(f"  {name:18s} unavailable here: {why}")
            continue
        print(f"  {name}")
        for op, cap in b.capabilities().items():
            print(f"    {op:18s} {_describe(cap)}")
    print("matrices:")
    for m in names():
        print(f"  {m:10s} {len(load(m).cases)} cases")
    return EXIT_OK


def _describe(cap: object) -> str:
    from dataclasses import fields

    from mlacheck.backends.base import _fmt

    parts = []
    for f in fields(cap):  # type: ignore[arg-type]
        v = getattr(cap, f.name)
        if v is None or f.name == "notes" or v == "":
            continue
        parts.append(f"{f.name}={_fmt(v) if not isinstance(v, bool | int) else v}")
    return " ".join(parts)


# --------------------------------------------------------------------------- replay


def find_case(ref: str):  # noqa: ANN201
    """A case from a JSON file, inline JSON, or a case id found in the named matrices."""
    from mlacheck.matrices import load, names
    from mlacheck.spec import case_from_json

    path = Path(ref)
    if ref.endswith(".json") and path.exists():
        return case_from_json(path.read_text())
    if ref.lstrip().startswith("{"):
        return case_from_json(ref)
    for m in names():
        for mc in load(m).cases:
            if mc.case.id == ref:
                return mc.case
    raise UsageError(f"case {ref!r} is not a JSON file, JSON text, or an id in matrices {', '.join(names())}")


def cmd_replay(args: argparse.Namespace) -> int:
    from mlacheck.backends.registry import DEFAULT_BACKEND, resolve
    from mlacheck.harness import RunOptions, run_case
    from mlacheck.judge import CRASH, FAIL

    case = find_case(args.case)
    backend = resolve(args.backend or DEFAULT_BACKEND)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    v = run_case(case, backend, RunOptions(device, args.golden))
    print(v.summary())
    print("case:", case.to_json())
    checks = [{"check": c.name, "passed": c.passed, "value": c.value, "bound": c.bound, "detail": c.detail}
              for c in v.checks]
    print(json.dumps({"checks": checks, "timings": v.timings,
                      "metrics": {k: x for k, x in v.metrics.items() if k != "heatmap"}}, indent=1, default=str))
    return EXIT_FAIL if v.status in (FAIL, CRASH) else EXIT_OK


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlacheck", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run a matrix against backends (pytest underneath)")
    r.add_argument("--backend", "-b", action="append", help="backend (repeatable); default: the embedded one")
    r.add_argument("--matrix", default="smoke")
    r.add_argument("--device", default="auto")
    r.add_argument("--golden", default="fp32", choices=("fp32", "fp64"))
    r.add_argument("--results", default=DEFAULT_RESULTS)
    r.add_argument("--append", action="store_true", help="append to an existing results file")
    r.add_argument("--resume", action="store_true",
                   help="continue an interrupted run: keep the results file and run only the "
                        "(case, backend) items it has no line for")
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--workers", "-n", type=int, default=None, help="xdist workers (default: one per GPU)")
    r.add_argument("--timeout", type=int, default=900, help="per-case timeout in seconds")
    r.add_argument("--junit", default=None, help="write JUnit XML here")
    r.add_argument("-k", default=None, help="pytest -k expression")
    r.add_argument("-m", default=None, help="pytest -m marker expression")
    r.add_argument("--no-report", dest="report", action="store_false")

    sub.add_parser("list", help="backends available here and matrices")

    rp = sub.add_parser("replay", help="re-run exactly one case and print the full verdict")
    rp.add_argument("case", help="case id, case.json, or JSON text")
    rp.add_argument("--backend", "-b", default=None)
    rp.add_argument("--device", default="auto")
    rp.add_argument("--golden", default="fp32", choices=("fp32", "fp64"))

    sub.add_parser("report", help="markdown + HTML report from results.jsonl", add_help=False)
    sub.add_parser("gate", help="end-to-end accuracy gates (gsm8k)", add_help=False)
    sub.add_parser("selftest", help="prove the suite catches every known bug class", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    delegated = {"report": "mlacheck.report:main", "gate": "mlacheck.gate.cli:main",
                 "selftest": "mlacheck.selftest:main"}
    if argv and argv[0] in delegated:
        import importlib

        mod, fn = delegated[argv[0]].split(":")
        try:  # only the import: an ImportError while the command runs is its own failure
            entry = getattr(importlib.import_module(mod), fn)
        except ImportError as e:
            return _die(f"{argv[0]} is not available: {e}")
        return int(entry(argv[1:]))
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = build_parser().parse_args(argv)
    from mlacheck.backends.registry import BackendError
    from mlacheck.matrices import MatrixError

    try:
        if args.cmd == "run":
            return cmd_run(args, extra)
        if args.cmd == "list":
            return cmd_list(args)
        if args.cmd == "replay":
            return cmd_replay(args)
    except (UsageError, BackendError, MatrixError, ValueError) as e:
        return _die(str(e))
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
